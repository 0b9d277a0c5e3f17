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

Without a config file the mesh is open: every tenant gets the default policy (any queue).
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from .errors import SpecError
from .ids import check_token
from .spec import JOB_TYPES, MIG_PROFILE, DurationS, JobType, spec_error_from

MAX_PAYLOAD_BYTES = 64 * 1024  # a submit larger than this is refused before it is parsed


def _tokens(field: str) -> BeforeValidator:
    return BeforeValidator(lambda v: tuple(check_token(x, field) for x in v) if isinstance(v, list | tuple) else v)


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

    def image_allowed(self, image: str) -> bool:
        return self.allowed_images is None or any(fnmatch.fnmatchcase(image, p) for p in self.allowed_images)


def _quantities(v: Any) -> Any:
    """{cpu: 64, memory: 4Ti, gpu/H100: 16} -> cpu in milli, memory in MiB, GPUs as counts."""
    if not isinstance(v, dict):
        return v
    from .spec import parse_cpu_milli, parse_memory_mib

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


class CohortConfig(BaseModel):
    """A cohort: its parent cohort (a tree), quota of its own shared by everything under it, and
    how much it may borrow from / lend to its parent. A cohort that is named but not listed is a
    root without quota of its own."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    parent: str | None = None
    nominal: Resources = Field(default_factory=dict)
    borrowing_limit: Resources = Field(default_factory=dict, alias="borrowingLimit")
    lending_limit: Resources = Field(default_factory=dict, alias="lendingLimit")


class PlacementConfig(BaseModel):
    """How the placer scores nodes (docs/config.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    # default: best fit + topology + gang locality + data locality; fragaware / fgd: fragmentation
    # aware (the FGD paper's gradient); bestfit; topology
    profile: Literal["default", "fragaware", "fgd", "bestfit", "topology", "packing", "dotprod", "clustering",
                     "random"] = "default"
    candidates: int = Field(default=64, ge=1, le=100_000)  # feasible nodes scored per replica
    backfill: bool = True  # EASY backfill with a reservation for the head job


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
