"""The cluster config: tenants and their policies (one YAML file).

    tenants:
      acme:
        queues: [default, research]        # the queues this tenant may submit to (absent: any)
        maxGpusPerJob: 64                  # all replicas together
        allowedGpuModels: [H100, A100]     # empty or absent: any model in the cluster
        allowedJobTypes: [training, batch] # absent: all five
        allowedImages: ["registry.local/acme/*"]   # fnmatch patterns; absent: any image
        checkpointRequiredAfter: 4h        # training / finetune jobs longer than this need `checkpoint`
        ephemeralCheckpoints: correct      # checkpoint.path on /tmp or in the container: correct | reject
        idleAction: warn                   # a job found idle: warn | reclaim (checkpoint, then release)
        idleReclaimAfter: 10m              # reclaim: still idle this long after the warning
        submitRatePerS: 50                 # token bucket: sustained rate ...
        submitBurst: 100                   # ... and burst
        maxPendingJobs: 1000               # submitted, not yet placed
    openTenants: false                     # true: a tenant not listed gets `defaults`
    queues:                                # quota per queue; a queue not listed is unlimited
      research: {cohort: lab, nominal: {gpu/H100: 32, cpu: 512}, borrowingLimit: {gpu/H100: 16}}
    cohorts:                               # optional: cohorts as a tree, with quota of their own
      lab: {parent: org, borrowingLimit: {gpu/H100: 16}}
      org: {nominal: {gpu/H100: 8}}
    defaults: {...}                        # the policy of unlisted tenants when openTenants
    nodePools:                             # nodes the autoscaler adds and removes (docs/autoscaling.md)
      h100: {provider: sim, shape: {gpuModel: H100, gpus: 8, cpu: 96, memory: 1Ti},
             min: 0, max: 4, provisionDelay: 30s, provisionTimeout: 10m, scaleUpAfter: 60s, scaleDownAfter: 10m}
    prices:                                # billing (docs/billing.md); money is decimal, never float
      currency: USD
      gpuHour: {H100: "4.10", A100: "2.20", "*": "1.50"}   # per GPU-hour by model; "*": any other
      cpuCoreHour: "0.04"
      memoryGiBHour: "0.005"
    budgets:                               # per tenant and per queue, over all time or per month
      tenants: {acme: {amount: "5000", thresholds: [50, 80], policy: hold, period: month}}
      queues: {research: {amount: "800", policy: warn}}

Without a config file the mesh is open: every tenant gets the default policy (any queue).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote, urlparse

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from gpufleet.shared.contract.errors import SpecError
from gpufleet.shared.contract.ids import check_token, is_token
from gpufleet.shared.contract.spec import (
    JOB_TYPES,
    MIG_PROFILE,
    CpuMilli,
    DurationS,
    JobType,
    MemoryMiB,
    spec_error_from,
)

MAX_PAYLOAD_BYTES = 64 * 1024  # a submit larger than this is refused before it is parsed


def _tokens(field: str) -> BeforeValidator:
    return BeforeValidator(lambda v: tuple(check_token(x, field) for x in v) if isinstance(v, list | tuple) else v)


class FairSharing(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    weight: float = Field(default=1.0, ge=0, le=1_000_000)


class TenantPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    queues: Annotated[tuple[str, ...] | None, _tokens("queues")] = None  # None: any queue
    max_gpus_per_job: int = Field(default=1024, alias="maxGpusPerJob", ge=0)
    allowed_gpu_models: tuple[str, ...] = Field(default=(), alias="allowedGpuModels")
    allowed_job_types: tuple[JobType, ...] = Field(default=JOB_TYPES, alias="allowedJobTypes")
    allowed_images: tuple[str, ...] | None = Field(default=None, alias="allowedImages")
    checkpoint_required_after_s: DurationS | None = Field(default=None, alias="checkpointRequiredAfter")
    # a checkpoint path on ephemeral storage (/tmp, a relative path in the container): `correct`
    # admits the job with its checkpoints under the cluster's root and a warning; `reject` refuses it
    ephemeral_checkpoints: Literal["correct", "reject"] = Field(default="correct", alias="ephemeralCheckpoints")
    # a job telemetry found idle (job.idle_detected): `warn` only, or `reclaim` it (checkpoint in its
    # grace, then release its GPUs) when it is still idle this long after the warning
    idle_action: Literal["warn", "reclaim"] = Field(default="warn", alias="idleAction")
    idle_reclaim_after_s: DurationS = Field(default=600.0, alias="idleReclaimAfter", ge=0)
    submit_rate_per_s: float = Field(default=200.0, alias="submitRatePerS", gt=0)
    submit_burst: int = Field(default=2000, alias="submitBurst", ge=1)
    max_pending_jobs: int = Field(default=100_000, alias="maxPendingJobs", ge=1)
    # fair sharing between the tenants of a cohort: a tenant's quota over this weight orders its
    # jobs after the queues' own shares (weight 3: three times the GPUs of a tenant of weight 1)
    fair_sharing: FairSharing = Field(default_factory=lambda: FairSharing(), alias="fairSharing")
    # the dataset / model source URIs its jobs may name (glob patterns); None: the cluster's
    # `datasetCache.allowedSources`
    allowed_data_sources: tuple[str, ...] | None = Field(default=None, alias="allowedDataSources", max_length=1000)

    def image_allowed(self, image: str) -> bool:
        return self.allowed_images is None or any(fnmatch.fnmatchcase(image, p) for p in self.allowed_images)


def _quantities(v: Any) -> Any:
    """{cpu: 64, memory: 4Ti, gpu/H100: 16} -> cpu in milli, memory in MiB, GPUs as counts."""
    if not isinstance(v, dict):
        return v
    from gpufleet.shared.contract.spec import parse_cpu_milli, parse_memory_mib

    out: dict[str, int] = {}
    for key, value in v.items():
        if key == "cpu":
            out[key] = parse_cpu_milli(value)
        elif key == "memory":
            out[key] = parse_memory_mib(value)
        elif key == "gpu" or isinstance(key, str) and key.startswith("gpu/") and len(key) > 4:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} must be a whole number of GPUs >= 0")
            out[key] = value
        elif isinstance(key, str) and key.startswith("mig/"):
            if not MIG_PROFILE.fullmatch(key[4:]):
                raise ValueError(f"{key}: {key[4:]!r} is not a MIG profile (like mig/1g.10gb)")
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} must be a whole number of MIG instances >= 0")
            out[key] = value
        else:
            raise ValueError(f"unknown resource {key!r} (cpu, memory, gpu, gpu/<model>, mig/<profile>)")
    return out


Resources = Annotated[dict[str, int], BeforeValidator(_quantities)]


class QueueConfig(BaseModel):
    """A queue's quota, per resource (cpu, memory, gpu — any model — and gpu/<model>); an absent
    resource is unlimited."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    cohort: str | None = None
    nominal: Resources = Field(default_factory=dict)
    borrowing_limit: Resources = Field(default_factory=dict, alias="borrowingLimit")  # absent: no limit
    lending_limit: Resources = Field(default_factory=dict, alias="lendingLimit")  # absent: lends it all
    # fair sharing: what it borrows is weighed against the cohort's quota over this weight (a
    # queue of weight 3 borrows three times what one of weight 1 does; 0: only what nobody else wants)
    fair_sharing: FairSharing = Field(default_factory=lambda: FairSharing(), alias="fairSharing")


class CohortConfig(BaseModel):
    """A cohort: its parent cohort (a tree), quota of its own shared by everything under it, and
    how much it may borrow from / lend to its parent. A cohort that is named but not listed is a
    root without quota of its own."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    parent: str | None = None
    nominal: Resources = Field(default_factory=dict)
    borrowing_limit: Resources = Field(default_factory=dict, alias="borrowingLimit")
    lending_limit: Resources = Field(default_factory=dict, alias="lendingLimit")
    # on a root cohort: a job of a queue below its fair share may preempt jobs of a queue that
    # borrows more, while its share with the job stays <= theirs without the victim (Kueue's
    # LessThanOrEqualToFinalShare: the victim's queue cannot take it back, its job would lift it above)
    fair_sharing_preemption: bool = Field(default=False, alias="fairSharingPreemption")


class PlacementConfig(BaseModel):
    """How the placer scores nodes (docs/config.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    # default: best fit + topology + gang locality + data locality; fragaware / fgd: fragmentation
    # aware (the FGD paper's gradient); bestfit; topology
    profile: Literal["default", "fragaware", "fgd", "bestfit", "topology", "packing", "dotprod", "clustering",
                     "random"] = "default"
    candidates: int = Field(default=64, ge=1, le=100_000)  # feasible nodes scored per replica
    backfill: bool = True  # backfill with a reservation for the head job (EASY)
    # the first this many waiting jobs get a reservation each (1: EASY; more: conservative backfill,
    # as Slurm's bf_max_job_test); a job is placed early only where it delays none of them
    reservations: int = Field(default=1, ge=1, le=64)
    # an elastic job (replicas: {min, max}) grows a step only after running this long at its size:
    # each resize restarts it from its checkpoint, so growth into every brief gap would cost more
    # than it gains
    elastic_grow_after_s: DurationS = Field(default=120.0, alias="elasticGrowAfter", ge=0)



def source_refusal(uri: str, patterns: Sequence[str], real: str | None = None) -> str | None:
    """Why a job may not name `uri` as its source (None: it may): it must match one of `patterns`
    (glob, as allowedImages) and must not climb out of where it points with `..`; `real`, where
    given (a file:// path with its symlinks resolved, on the node), must match too."""
    path = unquote(urlparse(uri).path)
    if any(part == ".." for part in path.split("/")):
        return f"{uri!r} climbs out of its directory with '..'"
    if not patterns:
        return ("no source URI is allowed here (the cluster's datasetCache.allowedSources, or the tenant's "
                "allowedDataSources, lists the ones jobs may name)")
    for candidate, what in ((uri, "it"), (real, f"it resolves to {real!r}, which")):
        if candidate is not None and not any(fnmatch.fnmatchcase(candidate, p) for p in patterns):
            return f"{what} matches none of the allowed sources ({', '.join(patterns)})"
    return None


class DatasetCacheConfig(BaseModel):
    """Each driver node's cache of datasets and models (services/executor/staging.py, docs/config.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    size_mib: MemoryMiB = Field(default=100 * 1024, alias="size", ge=1)  # kept within this, LRU
    dir: str | None = Field(default=None, max_length=4096)  # default: <data dir>/datasets/<node>
    # bare dataset / model names -> the URI each is staged from (a bare name not here is used only
    # where a node already holds it)
    sources: dict[str, str] = Field(default_factory=dict, max_length=10_000)
    # the source URIs a job may name itself (`dataset: file:///data/c4-en`), as glob patterns
    # (`file:///data/public/*`, `s3://shared-datasets/*`); a tenant's `allowedDataSources` replaces
    # them for its jobs. Default: none — the executor copies as itself, so a URI nobody allowed
    # could read the node's own files or another tenant's data into a cache the job reads.
    allowed_sources: tuple[str, ...] = Field(default=(), alias="allowedSources", max_length=1000)

    @field_validator("sources")
    @classmethod
    def _uris(cls, v: dict[str, str]) -> dict[str, str]:
        for name, uri in v.items():
            if "://" in name or not name or len(name) > 256:
                raise ValueError(f"{name!r}: a source is named by a bare dataset name (no scheme, at most 256 characters)")
            if "://" not in uri:
                raise ValueError(f"{name}: {uri!r} is not a URI (file:///path, or an object store's)")
        return v


def _money(v: Any) -> Any:
    """A price or an amount: a decimal string or number >= 0 (a float goes through its shortest
    repr, so `4.1` is 4.1, not 4.0999999999999996447...)."""
    if isinstance(v, bool) or v is None:
        raise ValueError("must be an amount of money like \"4.10\"")
    if isinstance(v, float):
        v = repr(v)
    if isinstance(v, int | str | Decimal):
        try:
            d = Decimal(str(v).strip())
        except InvalidOperation:
            raise ValueError(f"{v!r} is not an amount of money (like \"4.10\")") from None
        if not d.is_finite() or d < 0:
            raise ValueError(f"{v!r} must be a finite amount >= 0")
        return d
    raise ValueError(f"must be an amount of money like \"4.10\", got {type(v).__name__}")


Money = Annotated[Decimal, BeforeValidator(_money)]


class PriceTable(BaseModel):
    """What an allocation costs per hour: a GPU by model (`*`: any model not listed), a CPU
    core, a GiB of memory. A GPU share costs its share; a MIG instance its slices / 7."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    currency: str = Field(default="USD", min_length=1, max_length=8, pattern=r"^[A-Za-z]+$")
    gpu_hour: dict[str, Money] = Field(default_factory=dict, alias="gpuHour")
    cpu_core_hour: Money = Field(default=Decimal(0), alias="cpuCoreHour")
    memory_gib_hour: Money = Field(default=Decimal(0), alias="memoryGiBHour")

    def gpu(self, model: str) -> Decimal:
        """The price of one GPU-hour of `model` (0 when neither it nor `*` is listed)."""
        return self.gpu_hour.get(model, self.gpu_hour.get("*", Decimal(0)))


# The prices a cluster config without a `prices:` block gets, so that a mesh started without
# one (`make run`, `gpufleet up`) shows what its jobs cost instead of 0.00. Public on-demand list
# prices, AWS us-east-1, Linux, USD, as read on 2026-12-03; replace them with your own rates
# (a `prices:` block replaces the whole table, docs/billing.md).
# - CPU and memory: AWS Fargate, per vCPU-hour and per GB-hour (Linux/x86): 0.04048 and 0.004445.
# - A GPU-hour: the instance's hourly price less its vCPUs and memory at those rates, over its
#   GPUs, so that a whole node costs exactly its instance:
#   H100  p5.48xlarge   8 GPUs, 192 vCPU, 2048 GiB, 55.04 /h (after AWS's June 2025 reduction) -> 4.77
#   H200  p5en.48xlarge 8 GPUs, 192 vCPU, 2048 GiB, 63.296 /h (dstack offer, dstackai/dstack#4110, 2026-08) -> 5.80
#   A100  p4d.24xlarge  8 GPUs,  96 vCPU, 1152 GiB, 32.7726 /h -> 2.97
#   A10   g5.12xlarge   4 GPUs (A10G), 48 vCPU, 192 GiB, 5.672 /h -> 0.72
#   L4    g6.12xlarge   4 GPUs,  48 vCPU, 192 GiB, 4.6016 /h -> 0.45
#   "*"   any other model: 2.00, an assumption (not a list price): set your own
# - A MIG instance costs its slices / 7 of its GPU (a 3g.40gb of an H100: 3/7 x 4.77).
LIST_PRICES = PriceTable(currency="USD", gpu_hour={
    "H100": Decimal("4.77"), "H200": Decimal("5.80"), "A100": Decimal("2.97"), "A10": Decimal("0.72"),
    "A10G": Decimal("0.72"), "L4": Decimal("0.45"), "*": Decimal("2.00"),
}, cpu_core_hour=Decimal("0.04048"), memory_gib_hour=Decimal("0.004445"))


class BudgetConfig(BaseModel):
    """A budget: an amount (in the prices' currency), the percentages that warn, and what happens
    at 100 %: `warn` only, or `hold` (admission refuses new submits while it is exceeded).
    `period: month` counts each calendar month (UTC) afresh; `all` (the default) all time."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    amount: Money
    thresholds: tuple[int, ...] = (50, 80, 100)
    policy: Literal["warn", "hold"] = "warn"
    period: Literal["all", "month"] = "all"

    @field_validator("thresholds", mode="before")
    @classmethod
    def _percentages(cls, v: Any) -> Any:
        for pct in v if isinstance(v, list | tuple) else ():
            if isinstance(pct, bool) or not isinstance(pct, int) or not 1 <= pct <= 1000:
                raise ValueError(f"{pct!r} is not a whole percentage from 1 to 1000")
        return v

    @property
    def percentages(self) -> tuple[int, ...]:
        """The thresholds, sorted, with 100 always among them (exceeded is always said)."""
        return tuple(sorted({*self.thresholds, 100}))

    def period_of(self, when: datetime) -> str | None:
        """The period `when` falls in: `2026-05` (its UTC month) for a monthly budget, else None."""
        if self.period != "month":
            return None
        when = when.astimezone(UTC) if when.tzinfo else when
        return f"{when.year:04d}-{when.month:02d}"


class BudgetsConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    tenants: dict[str, BudgetConfig] = Field(default_factory=dict)
    queues: dict[str, BudgetConfig] = Field(default_factory=dict)

    def of(self, scope: str, name: str) -> BudgetConfig | None:
        return (self.tenants if scope == "tenant" else self.queues).get(name)


class NodeShape(BaseModel):
    """What one node of a pool has (the sim provider registers exactly this)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    gpu_model: str = Field(default="", alias="gpuModel", max_length=64)
    gpus: int = Field(default=0, ge=0, le=64)
    gpu_memory_mib: MemoryMiB = Field(default=80 * 1024, alias="gpuMemory", ge=0)
    cpu_milli: CpuMilli = Field(default=64_000, alias="cpu", gt=0)
    memory_mib: MemoryMiB = Field(default=512 * 1024, alias="memory", gt=0)
    nvlink_islands: int = Field(default=1, alias="nvlinkIslands", ge=1, le=64)
    labels: dict[str, str] = Field(default_factory=dict)
    taints: tuple[str, ...] = ()


class NodePoolConfig(BaseModel):
    """A pool of identical nodes the autoscaler adds (for demand unschedulable this long) and
    removes (idle this long), between `min` and `max`; a provider makes and deletes them."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    provider: Annotated[str, BeforeValidator(lambda v: check_token(v, "provider"))] = "sim"
    shape: NodeShape = NodeShape()
    min: int = Field(default=0, ge=0, le=10_000)
    max: int = Field(default=0, ge=0, le=10_000)
    provision_delay_s: DurationS = Field(default=30.0, alias="provisionDelay", le=86400)
    # a node asked for that has not registered this long after is given up on (removal requested,
    # reason provision_timeout): its room stops counting and the pool may ask for another.
    # Default: 10 minutes, at least twice provisionDelay (`give_up_after_s`)
    provision_timeout_s: DurationS | None = Field(default=None, alias="provisionTimeout", le=7 * 86400)
    scale_up_after_s: DurationS = Field(default=30.0, alias="scaleUpAfter", le=86400)
    scale_down_after_s: DurationS = Field(default=600.0, alias="scaleDownAfter", le=30 * 86400)
    # empty: a node is idle when nothing is placed on it; gpus_idle: also when every job on it was
    # found idle by telemetry (`job.idle_detected`): it is cordoned, and removed once they end
    idle_when: Literal["empty", "gpus_idle"] = Field(default="gpus_idle", alias="idleWhen")

    @field_validator("max")
    @classmethod
    def _max_over_min(cls, v: int, info: ValidationInfo) -> int:
        lo = info.data.get("min")
        if lo is not None and v < lo:
            raise ValueError(f"must be >= min ({lo})")
        return v

    @field_validator("provision_timeout_s")
    @classmethod
    def _timeout_over_delay(cls, v: float | None, info: ValidationInfo) -> float | None:
        delay = info.data.get("provision_delay_s") or 0.0
        if v is not None and v <= delay:
            raise ValueError(f"must be longer than provisionDelay ({delay:g}s)")
        return v

    @property
    def give_up_after_s(self) -> float:
        """How long a node asked for may take to register before it is given up on."""
        if self.provision_timeout_s is not None:
            return self.provision_timeout_s
        return max(600.0, 2 * self.provision_delay_s)


class ClusterConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    tenants: dict[str, TenantPolicy] = Field(default_factory=dict)
    queues: dict[str, QueueConfig] = Field(default_factory=dict)
    cohorts: dict[str, CohortConfig] = Field(default_factory=dict)
    placement: PlacementConfig = PlacementConfig()
    priority_classes: dict[str, int] = Field(default_factory=dict, alias="priorityClasses")
    # a job that waited this long stops jobs of its priority or lower, queued after it in its
    # cohort, from taking what it needs (no starvation of big gangs by streams of small jobs)
    starvation_after_s: DurationS = Field(default=600.0, alias="starvationAfter")
    open_tenants: bool = Field(default=True, alias="openTenants")
    defaults: TenantPolicy = TenantPolicy()
    prices: PriceTable = LIST_PRICES  # (no `prices:` block: public list prices; see LIST_PRICES)
    budgets: BudgetsConfig = BudgetsConfig()
    node_pools: dict[str, NodePoolConfig] = Field(default_factory=dict, alias="nodePools")
    dataset_cache: DatasetCacheConfig = Field(default_factory=lambda: DatasetCacheConfig(), alias="datasetCache")

    def data_sources_for(self, tenant: str) -> tuple[str, ...]:
        """The source URI patterns the tenant's jobs may name as their dataset or model."""
        policy = self.policy(tenant)
        if policy is not None and policy.allowed_data_sources is not None:
            return policy.allowed_data_sources
        return self.dataset_cache.allowed_sources

    def policy(self, tenant: str) -> TenantPolicy | None:
        """The tenant's policy; None for a tenant the cluster does not know."""
        if tenant in self.tenants:
            return self.tenants[tenant]
        return self.defaults if self.open_tenants else None


def parse_config(data: Any) -> ClusterConfig:
    if data is None:
        return ClusterConfig()
    if not isinstance(data, dict):
        raise SpecError("config", f"must be a mapping, got {type(data).__name__}")
    try:
        cfg = ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise spec_error_from(exc) from None
    for name in cfg.tenants:
        check_token(name, "tenants")
    for name in cfg.node_pools:
        if not is_token(name) or len(name) > 48:  # node ids are `<pool>-<n>`, tokens of at most 64
            raise SpecError(f"nodePools.{name}", "a pool name is 1-48 letters, digits, '-' or '_'")
    for scope in ("tenants", "queues"):
        for name in getattr(cfg.budgets, scope):
            try:
                check_token(name, f"budgets.{scope}")
            except ValueError as exc:
                raise SpecError(f"budgets.{scope}.{name}", str(exc)) from None
    for name, cohort in cfg.cohorts.items():
        seen = [name]
        parent = cohort.parent
        while parent is not None:
            if parent in seen:
                raise SpecError(f"cohorts.{name}.parent", f"cohorts form a cycle: {' -> '.join([*seen, parent])}")
            seen.append(parent)
            parent = cfg.cohorts[parent].parent if parent in cfg.cohorts else None
    if cfg.tenants and "openTenants" not in data and "open_tenants" not in data:
        # listing tenants means closing the door to the others, unless said otherwise
        cfg = cfg.model_copy(update={"open_tenants": False})
    return cfg


def load_config(path: str | Path | None) -> ClusterConfig:
    if path is None:
        return ClusterConfig()
    text = Path(path).read_text()
    try:
        return parse_config(yaml.safe_load(text))
    except yaml.YAMLError as exc:
        raise SpecError("config", f"not valid YAML: {exc}") from None
