"""The job spec: YAML in Kubernetes conventions, validated into a frozen model.

    name: resnet50
    tenant: acme
    queue: default
    type: training
    priority: 100
    replicas: 1            # > 1 is a gang: all replicas or none
    resources:             # per replica
      cpu: 8               # or "500m"
      memory: 64Gi
      gpu: 8               # or a share of one GPU: gpu: 0.25 with gpuSharing: shared
      gpuModel: H100       # or gpuModels: [H100, A100]
      gpuMemory: 80Gi      # per GPU, at least
      # or, instead of whole GPUs, MIG instances: mig: {1g.10gb: 2}
    maxRuntime: 2h
    checkpoint: {path: /ckpt/resnet50, interval: 30m}
    sim: {duration: 20s, exitCode: 0}   # for the sim driver
    autoscale:             # type: inference only: a service of replica jobs (docs/autoscaling.md)
      minReplicas: 1
      maxReplicas: 8
      targetRpsPerReplica: 100     # and / or targetP99Ms: 250
      scaleUpCooldown: 15s
      scaleDownCooldown: 5m
      scaleToZeroAfter: 10m        # optional: no requests this long -> 0 replicas

Every error names the field (`resources.gpu: must be >= 0`).
"""

from __future__ import annotations

import functools
import json
import math
import re
import typing
from decimal import Decimal
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gpufleet.shared.contract.errors import SpecError
from gpufleet.shared.contract.ids import check_token, is_token

JobType = Literal["training", "finetune", "batch", "inference", "interactive"]
JOB_TYPES: tuple[JobType, ...] = ("training", "finetune", "batch", "inference", "interactive")
CHECKPOINTED_JOB_TYPES = ("training", "finetune")  # (shared/node/checkpoints.py CHECKPOINTED_TYPES: the same)

_MEM_UNITS = {
    "": 1 / (1024 * 1024), "k": 1000 / 1048576, "M": 1e6 / 1048576, "G": 1e9 / 1048576, "T": 1e12 / 1048576,
    "Ki": 1 / 1024, "Mi": 1.0, "Gi": 1024.0, "Ti": 1024.0 * 1024,
}
_MEM_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(Ki|Mi|Gi|Ti|k|M|G|T)?\s*$")
_CPU_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(m)?\s*$")
_DUR_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d)?\s*$")
_DUR_UNITS = {"ms": 0.001, "s": 1.0, "": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}



DEFAULT_MAX_RUNTIME_S = 86400.0  # a run without maxRuntime is stopped after 24 h

class _Canonical(int):
    """A quantity given under its canonical wire name (cpu_milli, memory_mib): already in the
    unit, so it is taken as it is (every process parses each job.submitted's spec)."""


def parse_cpu_milli(value: Any) -> int:
    """'500m' -> 500, 2 -> 2000, '1.5' -> 1500."""
    if type(value) is _Canonical:
        return int(value)
    if isinstance(value, bool):
        raise ValueError("must be a CPU quantity such as 2 or '500m', not a boolean")
    if isinstance(value, int | float):
        text = repr(value)
    elif isinstance(value, str):
        text = value
    else:
        raise ValueError(f"must be a CPU quantity such as 2 or '500m', got {type(value).__name__}")
    m = _CPU_RE.match(text)
    if not m:
        raise ValueError(f"must be a CPU quantity such as 2 or '500m', got {value!r}")
    number = Decimal(m.group(1))  # exact: with floats, '1.001' * 1000 is not 1001
    milli = number if m.group(2) else number * 1000
    if milli != milli.to_integral_value():
        raise ValueError(f"finer than 1m: {value!r}")
    return int(milli)


def parse_memory_mib(value: Any) -> int:
    """'128Gi' -> 131072 (MiB). A bare number is bytes, as in Kubernetes."""
    if type(value) is _Canonical:
        return int(value)
    if isinstance(value, bool):
        raise ValueError("must be a memory quantity such as '128Gi', not a boolean")
    if isinstance(value, int | float):
        text = repr(value)
    elif isinstance(value, str):
        text = value
    else:
        raise ValueError(f"must be a memory quantity such as '128Gi', got {type(value).__name__}")
    m = _MEM_RE.match(text)
    if not m:
        raise ValueError(f"must be a memory quantity such as '512Mi' or '128Gi', got {value!r}")
    mib = float(m.group(1)) * _MEM_UNITS[m.group(2) or ""]
    return int(-(-mib // 1))  # round up: never under-reserve


def parse_duration_s(value: Any) -> float:
    """'90s', '30m', '2h', '1d' or a number of seconds."""
    if isinstance(value, bool):
        raise ValueError("must be a duration such as '30m', not a boolean")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        m = _DUR_RE.match(value)
        if not m:
            raise ValueError(f"must be a duration such as '90s', '30m' or '2h', got {value!r}")
        seconds = float(m.group(1)) * _DUR_UNITS[m.group(2) or ""]
    else:
        raise ValueError(f"must be a duration such as '30m', got {type(value).__name__}")
    if not math.isfinite(seconds):  # JSON has no infinity: the event would not parse downstream
        raise ValueError(f"must be a finite duration, got {value!r}")
    if seconds < 0:
        raise ValueError("must not be negative")
    return seconds


def _canonical_to_quantities(data: dict[str, Any]) -> dict[str, Any]:
    """Accept the canonical wire names (cpu_milli, memory_mib, ...) as the quantities they are."""
    names = (("cpu_milli", "m"), ("memory_mib", "Mi"), ("gpu_memory_mib", "Mi"), ("gpu_mem_used_mib", "Mi"))
    if not any(k in data for k, _ in names):
        return data
    data = dict(data)
    for name, unit in names:
        v = data.get(name)
        if type(v) is int:
            data[name] = _Canonical(v) if v >= 0 else f"{v}{unit}"  # (a negative one: refused as before)
    return data


CpuMilli = Annotated[int, BeforeValidator(parse_cpu_milli)]
MemoryMiB = Annotated[int, BeforeValidator(parse_memory_mib)]
DurationS = Annotated[float, BeforeValidator(parse_duration_s)]


MIG_PROFILE = re.compile(r"[1-8]g\.[1-9][0-9]{0,3}gb(\+me|\+gfx|-me)?")


def _token(field: str) -> BeforeValidator:
    return BeforeValidator(lambda v: check_token(v, field))


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, strict=False)


class Resources(_Spec):
    """Per replica."""

    cpu_milli: CpuMilli = Field(default=1000, alias="cpu", ge=0)
    memory_mib: MemoryMiB = Field(default=1024, alias="memory", ge=0)
    # shared: `gpu` may be a fraction of one GPU (0.001 .. 1), placed beside other shares on a GPU
    gpu_sharing: Literal["exclusive", "shared"] = Field(default="exclusive", alias="gpuSharing")
    gpu: int = Field(default=0, ge=0, le=1024)
    gpu_milli: int = Field(default=1000, ge=1, le=1000, alias="gpuMilli")  # of each GPU; < 1000: a share
    # MIG instances by profile (`1g.10gb`, `3g.40gb`, `1g.18gb+me`): the sharing mode for less
    # than a GPU; not together with whole GPUs
    mig: dict[str, StrictInt] = Field(default_factory=dict)
    gpu_models: tuple[str, ...] = Field(default=(), alias="gpuModels")
    gpu_memory_mib: MemoryMiB = Field(default=0, alias="gpuMemory", ge=0)

    @model_validator(mode="before")
    @classmethod
    def _one_model(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = _canonical_to_quantities(data)
        if isinstance(data, dict) and data.get("gpuSharing", data.get("gpu_sharing")) == "shared":
            gpu = data.get("gpu")
            if isinstance(gpu, int | float | Decimal) and not isinstance(gpu, bool) and 0 < gpu < 1:
                data = {**data, "gpu": 1, "gpuMilli": math.ceil(gpu * 1000)}  # (the alias: taken in both spellings)
        if isinstance(data, dict) and "gpuModel" in data:
            data = dict(data)
            model = data.pop("gpuModel")
            if "gpuModels" in data or "gpu_models" in data:
                raise ValueError("give gpuModel or gpuModels, not both")
            data["gpuModels"] = [model] if isinstance(model, str) else model
        return data

    @field_validator("gpu", mode="before")
    @classmethod
    def _whole_gpus(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, bool) or (isinstance(v, float) and v != int(v)):
            if info.data.get("gpu_sharing") == "shared":
                raise ValueError("a shared GPU is a fraction of one GPU (0.001 to 1), or whole GPUs")
            raise ValueError("must be a whole number of GPUs (fractional GPUs need gpuSharing: shared)")
        if isinstance(v, str):
            raise ValueError("must be a whole number of GPUs, not a string")
        return v

    @field_validator("gpu_milli")
    @classmethod
    def _share(cls, v: int, info: ValidationInfo) -> int:
        if v < 1000 and (info.data.get("gpu_sharing") != "shared" or info.data.get("gpu") != 1):
            raise ValueError("a share of a GPU needs gpuSharing: shared and one GPU")
        return v

    @field_validator("mig")
    @classmethod
    def _mig_profiles(cls, v: dict[str, int], info: ValidationInfo) -> dict[str, int]:
        for profile, n in v.items():
            if not MIG_PROFILE.fullmatch(profile):
                raise ValueError(f"{profile!r} is not a MIG profile (like 1g.10gb, 3g.40gb, 1g.18gb+me)")
            if not 1 <= n <= 64:
                raise ValueError(f"{profile}: must be a whole number of instances from 1 to 64")
        if v and info.data.get("gpu"):
            raise ValueError("give whole GPUs (gpu) or MIG instances (mig), not both")
        return v

    @field_validator("gpu_models")
    @classmethod
    def _models_need_gpus(cls, v: Any, info: ValidationInfo) -> Any:
        # a field validator (not a model one) so that the error names the field
        if v and info.data.get("gpu") == 0 and not info.data.get("mig"):
            raise ValueError("given but gpu is 0: ask for at least one GPU (or MIG instance)")
        return v

    @field_validator("gpu_memory_mib")
    @classmethod
    def _memory_needs_gpus(cls, v: Any, info: ValidationInfo) -> Any:
        if v and info.data.get("gpu") == 0:
            raise ValueError("given but gpu is 0: ask for at least one GPU")
        return v


class CheckpointSpec(_Spec):
    path: str | None = None
    interval_s: DurationS = Field(default=1800.0, alias="interval")
    keep: int = Field(default=3, ge=1, le=1000)


TopologyLevel = Literal["node", "leaf", "rack", "spine"]
TOPOLOGY_LEVELS: tuple[str, ...] = ("node", "leaf", "rack", "spine")  # finest first (node labels `leaf`, `rack`, `spine`)


class TopologySpec(_Spec):
    """Where a gang's replicas go, by the nodes' network labels (`leaf`, `rack`, `spine`; `node`:
    one machine). `required`: all replicas within one domain of that level or none placed (Kueue's
    required topology, Slurm's `--switches`); the placer picks the domain that fits tightest.
    `preferred`: as close as that level where it can (a score); finer than or equal to `required`."""

    required: TopologyLevel | None = None
    preferred: TopologyLevel | None = None

    @model_validator(mode="after")
    def _nested(self) -> TopologySpec:
        if (self.required and self.preferred
                and TOPOLOGY_LEVELS.index(self.preferred) > TOPOLOGY_LEVELS.index(self.required)):
            raise ValueError(f"preferred: {self.preferred} is wider than required: {self.required} "
                             f"(every replica is within one {self.required} already)")
        return self


class ElasticSpec(_Spec):
    """An elastic training job's sizes: `replicas: {min: 2, max: 8, step: 2}` (the spec's
    `replicas` is the min, the gang quota reserves; written back as `replicas: 2, elastic: {max: 8,
    step: 2}`). The job starts as soon as `min` fits, at the largest size that fits then; it grows
    a step or more into capacity nothing waiting needs, and gives back replicas above `min` (shrinks)
    when a job holding quota needs their room, instead of being preempted whole. Each resize is a
    `job.resized` event and a restart from the job's checkpoint at the new world size
    (`GPUFLEET_WORLD_SIZE`). `step`: replicas added or removed at a time, or `pow2` (each size twice
    the last: min, 2 min, 4 min ... max)."""

    max: int = Field(ge=1, le=4096)
    step: int | Literal["pow2"] = 1

    @field_validator("max", mode="before")
    @classmethod
    def _whole(cls, v: Any) -> Any:
        if isinstance(v, bool) or isinstance(v, str) or (isinstance(v, float) and v != int(v)):
            raise ValueError("must be a whole number")
        return v

    @field_validator("step", mode="before")
    @classmethod
    def _a_step(cls, v: Any) -> Any:
        if v == "pow2":
            return v
        if isinstance(v, bool) or isinstance(v, str) or (isinstance(v, float) and v != int(v)) or (
                isinstance(v, int | float) and v < 1):
            raise ValueError("a whole number of replicas >= 1, or 'pow2'")
        return v

    def sizes(self, least: int) -> tuple[int, ...]:
        """The world sizes the job may run at, smallest first (`least`: the spec's replicas, its min)."""
        out = [least]
        while True:
            nxt = out[-1] * 2 if self.step == "pow2" else out[-1] + int(self.step)
            if nxt > self.max:
                return tuple(out)
            out.append(nxt)


class SimRun(_Spec):
    """One run of a job on the sim driver (a what-if replays each run as it went)."""

    duration_s: DurationS = Field(alias="duration")
    exit_code: int = Field(default=0, alias="exitCode", ge=0, le=255)

    @model_validator(mode="before")
    @classmethod
    def _wire(cls, data: Any) -> Any:
        return _canonical_to_quantities(data) if isinstance(data, dict) else data


class SimSpec(_Spec):
    """How the sim driver plays the job: how long it runs and how it ends. `runs` plays the first
    runs (attempts) one by one; later ones play `duration` and `exitCode`."""

    duration_s: DurationS = Field(default=10.0, alias="duration")
    exit_code: int = Field(default=0, alias="exitCode", ge=0, le=255)
    # what the simulated GPUs and CPUs show while it runs (telemetry's sim backend)
    gpu_util_pct: float = Field(default=90.0, alias="gpuUtil", ge=0, le=100)
    cpu_util_pct: float = Field(default=50.0, alias="cpuUtil", ge=0, le=100)  # of the CPUs it asked for
    iowait_pct: float = Field(default=0.0, alias="ioWait", ge=0, le=100)
    gpu_mem_used_mib: MemoryMiB = Field(default=2048, alias="gpuMemoryUsed", ge=0)
    leave_zombie: bool = Field(default=False, alias="leaveZombie")  # its GPU process outlives it
    runs: tuple[SimRun, ...] = Field(default=(), max_length=100)

    @model_validator(mode="before")
    @classmethod
    def _wire(cls, data: Any) -> Any:
        return _canonical_to_quantities(data) if isinstance(data, dict) else data


class AutoscaleSpec(_Spec):
    """An inference service's replicas, driven by the load reported for it (`cmd.report_load`).

    Kubernetes HPA target tracking: desired = ceil(replicas x metric / target) per metric, the
    largest wins, within [minReplicas, maxReplicas]; no change while every metric is within
    `tolerance` of its target; scale-up waits `scaleUpCooldown` after the last change, scale-down
    takes the largest recommendation of the last `scaleDownCooldown` (no flapping)."""

    min_replicas: int = Field(default=1, alias="minReplicas", ge=1, le=1024)
    max_replicas: int = Field(default=1, alias="maxReplicas", ge=1, le=1024)
    target_rps_per_replica: float | None = Field(default=None, alias="targetRpsPerReplica", gt=0, le=1e9,
                                                 allow_inf_nan=False)
    target_p99_ms: float | None = Field(default=None, alias="targetP99Ms", gt=0, le=3_600_000, allow_inf_nan=False,
                                        validate_default=True)
    tolerance: float = Field(default=0.1, ge=0, le=1, allow_inf_nan=False)
    scale_up_cooldown_s: DurationS = Field(default=15.0, alias="scaleUpCooldown", le=86400)
    scale_down_cooldown_s: DurationS = Field(default=300.0, alias="scaleDownCooldown", le=86400)
    # no requests for this long: 0 replicas; the next report with requests starts them again
    scale_to_zero_after_s: DurationS | None = Field(default=None, alias="scaleToZeroAfter", gt=0, le=30 * 86400)

    @field_validator("min_replicas", "max_replicas", mode="before")
    @classmethod
    def _whole(cls, v: Any) -> Any:
        if isinstance(v, bool) or isinstance(v, str) or (isinstance(v, float) and v != int(v)):
            raise ValueError("must be a whole number")
        if v == 0:
            raise ValueError("must be >= 1 (to scale to zero when idle, give scaleToZeroAfter)")
        return v

    @field_validator("max_replicas")
    @classmethod
    def _max_over_min(cls, v: int, info: ValidationInfo) -> int:
        lo = info.data.get("min_replicas")
        if lo is not None and v < lo:
            raise ValueError(f"must be >= minReplicas ({lo})")
        return v

    @field_validator("target_p99_ms")
    @classmethod
    def _a_target(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v is None and info.data.get("target_rps_per_replica") is None and "target_rps_per_replica" in info.data:
            raise ValueError("give targetRpsPerReplica or targetP99Ms (or both): what to scale on")
        return v


def _replicas_schema(schema: dict[str, Any]) -> None:
    """`replicas` as a client may write it: a number, or an elastic job's {min, max, step}."""
    for k in ("type", "minimum", "maximum"):
        schema.pop(k, None)
    schema["description"] = ("replicas, all placed at once (> 1 is a gang); or an elastic training job's "
                             "{min, max, step}: min is the gang, read back as replicas: min, elastic: {max, step}")
    schema["anyOf"] = [
        {"type": "integer", "minimum": 1, "maximum": 4096},
        {"type": "object", "required": ["min", "max"], "additionalProperties": False, "properties": {
            "min": {"type": "integer", "minimum": 1, "maximum": 4096},
            "max": {"type": "integer", "minimum": 1, "maximum": 4096},
            "step": {"anyOf": [{"type": "integer", "minimum": 1}, {"const": "pow2"}], "default": 1}}},
    ]


class JobSpec(_Spec):
    name: Annotated[str, _token("name")]
    tenant: Annotated[str, _token("tenant")]
    queue: Annotated[str, _token("queue")] = "default"
    type: JobType = "batch"
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    # a named class from the cluster config (priorityClasses); admission turns it into `priority`
    priority_class: Annotated[str, _token("priorityClass")] | None = Field(default=None, alias="priorityClass")
    replicas: int = Field(default=1, ge=1, le=4096, json_schema_extra=lambda s: _replicas_schema(s))
    resources: Resources = Resources()
    # the hard limit: the run is stopped (exit 124) past it. Not given: 24 h (`runtime_limit_s`),
    # and the placer estimates the run from the tenant's similar jobs for backfill
    max_runtime_s: DurationS | None = Field(default=None, alias="maxRuntime", gt=0, json_schema_extra={"description": (
        "how long a run may last, a duration: seconds (90), or with a unit ('500ms', '90s', '30m', '2h', '1d'); "
        "past it the run is stopped (exit 124). Not given: 24 h, and backfill estimates the run from the "
        "tenant's last completed jobs of the same name and GPUs")})
    # how often the job is run again after its node was lost or its GPU failed under it
    max_retries: int = Field(default=3, alias="maxRetries", ge=0, le=100)
    # OnFailure: a replica that exits with an error runs again too (same budget), after a backoff
    # that doubles from retryBackoff (capped at 10 minutes); Never: an error fails the job
    restart_policy: Literal["Never", "OnFailure"] = Field(default="Never", alias="restartPolicy")
    retry_backoff_s: DurationS = Field(default=10.0, alias="retryBackoff", ge=0)
    image: str | None = Field(default=None, max_length=512)
    command: tuple[str, ...] = Field(default=(), max_length=256)
    env: dict[str, str] = Field(default_factory=dict)
    checkpoint: CheckpointSpec | None = None
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")  # node labels required
    tolerations: tuple[str, ...] = ()  # node taints tolerated
    # a source URI (file://, or an object store's) the executor stages into its node's cache before
    # the job starts, or a bare name the node may hold; the placer prefers nodes that hold it
    dataset: str | None = Field(default=None, max_length=256)
    model: str | None = Field(default=None, max_length=256)  # the same, for the job's model (weights)
    topology: TopologySpec | None = None  # a gang's replicas within one leaf / rack / spine (required, preferred)
    sim: SimSpec = SimSpec()
    # type: inference only: the job is a service whose replicas the autoscaler runs as jobs of their own
    autoscale: AutoscaleSpec | None = None
    # training / finetune only: the sizes an elastic job may run at (`replicas: {min, max, step}`)
    elastic: ElasticSpec | None = Field(default=None, json_schema_extra={"description": (
        "an elastic training job's sizes (max, step: a number of replicas or 'pow2'); `replicas` is its "
        "min. Written `replicas: {min: 2, max: 8, step: 2}` or `replicas: 2, elastic: {max: 8, step: 2}`")})

    @model_validator(mode="before")
    @classmethod
    def _elastic_replicas(cls, data: Any) -> Any:
        """`replicas: {min, max, step}`: the min is `replicas`, the rest `elastic`."""
        if isinstance(data, dict) and isinstance(data.get("replicas"), dict):
            r = dict(data["replicas"])
            unknown = sorted(set(r) - {"min", "max", "step"})
            if unknown:
                raise ValueError(f"replicas: unknown field(s) {', '.join(unknown)} (min, max, step)")
            if "min" not in r or "max" not in r:
                raise ValueError("replicas: an elastic job gives min and max (and step)")
            if data.get("elastic") is not None:
                raise ValueError("replicas: give {min, max, step} or replicas and elastic, not both")
            data = {**data, "replicas": r["min"], "elastic": {k: v for k, v in r.items() if k != "min"}}
        return data

    @field_validator("elastic")
    @classmethod
    def _elastic_fits(cls, v: ElasticSpec | None, info: ValidationInfo) -> ElasticSpec | None:
        if v is None:
            return v
        if info.data.get("type") not in CHECKPOINTED_JOB_TYPES:
            raise ValueError(f"only for type: training or finetune (this job is {info.data.get('type')}): "
                             "a resize restarts the job from its checkpoint at the new size")
        least = info.data.get("replicas")
        if isinstance(least, int):
            if v.max < least:
                raise ValueError(f"max {v.max} is below min {least}")
            if v.sizes(least)[-1] != v.max:
                raise ValueError(f"max {v.max} is not a size of min {least} and step {v.step} "
                                 f"(the sizes: {', '.join(map(str, v.sizes(least)))})")
        return v

    @field_validator("replicas", "priority", mode="before")
    @classmethod
    def _ints(cls, v: Any) -> Any:
        if isinstance(v, bool) or isinstance(v, str) or (isinstance(v, float) and v != int(v)):
            raise ValueError("must be a whole number")
        return v

    @field_validator("tenant")
    @classmethod
    def _not_sys(cls, v: str) -> str:
        if v == "sys":
            raise ValueError("'sys' is reserved for cluster events")
        return v

    @field_validator("autoscale")
    @classmethod
    def _inference_only(cls, v: AutoscaleSpec | None, info: ValidationInfo) -> AutoscaleSpec | None:
        if v is not None and info.data.get("type") not in (None, "inference"):
            raise ValueError(f"only for type: inference (this job is {info.data.get('type')})")
        return v

    @property
    def runtime_limit_s(self) -> float:
        """How long a run may last: `maxRuntime`, or 24 h where the spec gives none."""
        return self.max_runtime_s if self.max_runtime_s is not None else DEFAULT_MAX_RUNTIME_S

    @model_validator(mode="wrap")
    @classmethod
    def _known_shape(cls, data: Any, handler: ModelWrapValidatorHandler[JobSpec], info: ValidationInfo) -> JobSpec:
        """A spec read from an event whose every field but its name equals one read before is that
        spec under its own name (`known_shape`): validated once per shape, not once per job."""
        if info.mode != "json" or type(data) is not dict:
            return _compacted(handler(data))
        return known_shape(data, handler)

    @property
    def gpus_total(self) -> int:
        return self.resources.gpu * self.replicas

    @property
    def sizes(self) -> tuple[int, ...]:
        """The world sizes it may run at, smallest first: `replicas` alone unless elastic."""
        return self.elastic.sizes(self.replicas) if self.elastic is not None else (self.replicas,)

    def sized(self, replicas: int) -> JobSpec:
        """The spec as it runs at `replicas` (an elastic job's size now): a copy, not validated again."""
        return self if replicas == self.replicas else self.model_copy(update={"replicas": replicas})

    @property
    def mig_total(self) -> dict[str, int]:
        """MIG instances by profile, all replicas together."""
        return {p: n * self.replicas for p, n in self.resources.mig.items()}


# ---------------------------------------------------------------- compact specs
#
# A pending job's spec is most of what a core keeps of it: 4 KB as parsed, of which the
# resources and the sim behaviour are 1.1 KB each and the set of fields given 0.7 KB. Jobs of a
# backlog share a few shapes, so equal parts are shared: a frozen model never changes, and its
# set of given fields is copied (not shared) by `model_copy`. Bounded: past INTERN_MAX distinct
# parts of a kind the table starts again (what was shared stays shared).

INTERN_MAX = 4096
_INTERNED: dict[type, dict[Any, Any]] = {}
_FIELDS_SETS: dict[frozenset[str], set[str]] = {}


_PLAIN = frozenset({str, int, float, bool, type(None)})


def _key(v: Any) -> Any:
    """A hashable value equal for equal parts (the intern table's key). Plain values stand for
    themselves without a call: a spec's parts are mostly those (parsed for every job.submitted
    each process reads, so this is on the hot path)."""
    t = type(v)
    if t in _PLAIN:
        return v
    if isinstance(v, BaseModel):
        return (t, frozenset(v.__pydantic_fields_set__),
                tuple([x if type(x) in _PLAIN else _key(x) for x in v.__dict__.values()]))
    if isinstance(v, dict):
        return ("dict", tuple([(k, x if type(x) in _PLAIN else _key(x)) for k, x in v.items()]))
    if isinstance(v, list | tuple):
        return (t.__name__, tuple([x if type(x) in _PLAIN else _key(x) for x in v]))
    return v


def _shared(v: Any) -> Any:
    table = _INTERNED.setdefault(type(v), {})
    k = _key(v)
    try:
        got = table.get(k)
    except TypeError:  # a value that does not hash: kept as it is
        return v
    if got is not None:
        return got
    if len(table) >= INTERN_MAX:
        table.clear()
    table[k] = v
    return v


def _shared_fields_set(m: BaseModel) -> None:
    fs = frozenset(m.__pydantic_fields_set__)
    got = _FIELDS_SETS.get(fs)
    if got is None:
        if len(_FIELDS_SETS) >= INTERN_MAX:
            _FIELDS_SETS.clear()
        got = _FIELDS_SETS[fs] = set(fs)
    object.__setattr__(m, "__pydantic_fields_set__", got)


class FrozenMap(dict):  # type: ignore[type-arg]
    """A spec's mapping (`env`, `nodeSelector`) once compacted: shared by equal specs, so it
    refuses to change (a spec is frozen; one changed in place would change every job of its
    shape). Serialises, compares and copies as the dict it is."""

    __slots__ = ()

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a job spec's mapping is read-only (model_copy(update=...) makes a changed spec)")

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = clear = setdefault = _read_only

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenMap, (dict(self),))

    def __copy__(self) -> FrozenMap:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> FrozenMap:
        return self


# the plain values jobs of a backlog repeat (a job's name is its own): one copy of each. A JobSpec's
# __dict__ past 21 fields costs 832 bytes instead of 464 (CPython's dict sizes), so what the
# parts repeat is what keeps a pending job's spec small (tests/test_retention.py).
_PLAIN_SHARED = ("tenant", "queue", "type", "priority_class", "restart_policy", "image", "dataset", "model",
                 "max_runtime_s", "retry_backoff_s")  # strings and floats: never equal across kinds
_PLAIN_VALUES: dict[Any, Any] = {}
_MAPS_SHARED = ("env", "node_selector")
_EMPTY_MAP = FrozenMap()


def compact(spec: JobSpec) -> None:
    """Share the spec's resources, sim behaviour, checkpoint and autoscale settings, its repeated
    plain values and mappings, and its set of given fields, with equal ones of other specs (they
    are frozen)."""
    d = spec.__dict__
    for name in ("resources", "sim", "checkpoint", "autoscale", "topology"):
        part = d.get(name)
        if isinstance(part, BaseModel):
            _shared_fields_set(part)
            d[name] = _shared(part)
    plain = _PLAIN_VALUES
    if len(plain) >= INTERN_MAX:
        plain.clear()
    for name in _PLAIN_SHARED:
        v = d[name]
        if v is not None:
            d[name] = plain.setdefault(v, v)
    for name in _MAPS_SHARED:
        v = d[name]
        if type(v) is dict:
            d[name] = _shared(FrozenMap(v)) if v else _EMPTY_MAP
    _shared_fields_set(spec)
    if _SPLIT_DICTS:
        global _TEMPLATE
        if _TEMPLATE is None:
            _TEMPLATE = _split(d)
        fields = _TEMPLATE.copy()  # (a copy of a key-sharing dict shares the keys too)
        fields.update(d)
        if len(fields) == len(d):
            object.__setattr__(spec, "__dict__", fields)


# ---------------------------------------------------------------- known shapes
#
# Every process that reads the log parses every job.submitted (five processes in the embedded
# mesh), and the spec is most of that parse: 47 us of a 61 us envelope, in the Python validators
# of its quantities and the sharing of its parts above. Jobs come in few shapes, so a spec read
# from JSON whose fields but `name` are, as JSON, those of one validated before is that one's
# copy under its own (checked) name. Keyed by the fields' JSON text: 1 and 1.0 and true differ
# there as they do to the validators. Only in JSON mode (an event's bytes: plain JSON values,
# every field spelling the events may carry); a mapping from Python (parse_spec, with its
# user-only spellings) is always validated in full. Bounded as the tables above.

_SHAPES: dict[str, JobSpec] = {}


def _compacted(spec: JobSpec) -> JobSpec:
    """Share what equals another spec's (`compact`): a backlog of jobs of a few shapes holds each
    shape once."""
    compact(spec)
    return spec


def known_shape(data: dict[str, Any], handler: ModelWrapValidatorHandler[JobSpec]) -> JobSpec:
    name = data.get("name")
    if type(name) is not str or not is_token(name):
        return _compacted(handler(data))  # (its error names the field)
    rest = dict(data)
    del rest["name"]
    try:
        key = json.dumps(rest, separators=(",", ":"))
    except (TypeError, ValueError):
        return _compacted(handler(data))
    seen = _SHAPES.get(key)
    if seen is None:
        seen = _compacted(handler(data))
        if len(_SHAPES) >= INTERN_MAX:
            _SHAPES.clear()
        _SHAPES[key] = seen
        return seen
    spec = seen.model_copy(update={"name": name})  # (its fields' dict still shares its keys)
    _shared_fields_set(spec)  # (model_copy copies the set of given fields: shared, as compact does)
    return spec


class _Fields:
    """Holds a JobSpec's fields so that CPython makes their dict one of its key-sharing dicts
    (the keys once for every spec, the values alone per spec: 288 bytes instead of 832 for the
    22 fields). Pydantic reads and writes `__dict__` as any dict; a key added later turns it
    into a plain dict again, nothing else changes. (The class's shared keys are JobSpec's: no
    other dict goes through it.)"""


def _split(d: dict[str, Any], holder: type = _Fields) -> dict[str, Any]:
    h = holder()
    for k, v in d.items():
        setattr(h, k, v)
    fields: dict[str, Any] = h.__dict__
    return fields


def _splits_smaller() -> bool:
    """Whether this interpreter shares the keys of such a dict (CPython 3.11+ does; elsewhere a
    spec keeps pydantic's own dict)."""
    import sys

    class Probe:
        pass

    plain = {f"f{i}": i for i in range(len(JobSpec.model_fields))}
    _split(plain, Probe)
    return sys.getsizeof(_split(plain, Probe)) < sys.getsizeof(plain)


_SPLIT_DICTS = _splits_smaller()
_TEMPLATE: dict[str, Any] | None = None  # the first spec's fields, in a key-sharing dict


def _field_path(loc: tuple[int | str, ...]) -> str:
    aliases = {
        "cpu_milli": "cpu", "memory_mib": "memory", "gpu_models": "gpuModels", "gpu_memory_mib": "gpuMemory",
        "gpu_sharing": "gpuSharing", "gpu_milli": "gpuMilli", "node_selector": "nodeSelector",
        "max_runtime_s": "maxRuntime", "interval_s": "interval", "duration_s": "duration", "exit_code": "exitCode",
        "priority_class": "priorityClass", "max_retries": "maxRetries", "restart_policy": "restartPolicy", "retry_backoff_s": "retryBackoff", "gpu_util_pct": "gpuUtil",
        "cpu_util_pct": "cpuUtil", "iowait_pct": "ioWait", "gpu_mem_used_mib": "gpuMemoryUsed",
        "leave_zombie": "leaveZombie",
        "min_replicas": "minReplicas", "max_replicas": "maxReplicas",
        "target_rps_per_replica": "targetRpsPerReplica", "target_p99_ms": "targetP99Ms",
        "scale_up_cooldown_s": "scaleUpCooldown", "scale_down_cooldown_s": "scaleDownCooldown",
        "scale_to_zero_after_s": "scaleToZeroAfter",
    }
    parts = [str(aliases.get(str(p), p)) for p in loc if not str(p).startswith("function-")]
    return ".".join(parts) or "spec"


def spec_error_from(exc: ValidationError) -> SpecError:
    """The first validation error as a SpecError naming the field; all of them in the reason."""
    errs = exc.errors()
    each: list[tuple[str, str]] = []
    for e in errs:
        msg = str(e["msg"]).removeprefix("Value error, ")
        loc = tuple(e["loc"])
        if e["type"] == "extra_forbidden":
            name = str(loc[-1]) if loc else ""
            alias = _normalised_names().get(name)
            msg = (f"unknown field: write `{alias}` (`{name}` is the normalised name inside the events)"
                   if alias else "unknown field")
            path = ".".join([_field_path(loc[:-1]), name] if loc[:-1] else [name])  # (as it was written)
            each.append((path, msg))
            continue
        each.append((_field_path(loc), msg))
    return SpecError(each[0][0], "; ".join(f"{f}: {m}" for f, m in each), errors=each)


def parse_spec(data: Any, user: bool = True) -> JobSpec:
    """Validate a mapping into a JobSpec, or raise SpecError naming the field.

    A spec a person or a client wrote (`user`, the default: `cmd.submit`, YAML files, the SDK) has
    one spelling per field, the one docs/schemas/jobspec.schema.json publishes (`cpu`, `memory`,
    `sim.duration`, `maxRuntime`, ...); the normalised names (`cpu_milli`, `duration_s`, ...) are
    refused there. `user=False` reads a spec as the events carry it (normalised, `spec_to_wire`)."""
    if not isinstance(data, dict):
        raise SpecError("spec", f"must be a mapping, got {type(data).__name__}")
    try:
        if user:
            return JobSpec.model_validate(data, by_alias=True, by_name=False)
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise spec_error_from(exc) from None


@functools.cache
def _normalised_names() -> dict[str, str]:
    """Each spec field whose user-facing spelling differs: normalised name -> the one to write."""
    out: dict[str, str] = {}
    todo: list[type[BaseModel]] = [JobSpec]
    seen: set[type[BaseModel]] = set()
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, f in model.model_fields.items():
            if f.alias and f.alias != name:
                out.setdefault(name, f.alias)
            for arg in typing.get_args(f.annotation) or (f.annotation,):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    todo.append(arg)
    return out


def load_spec_yaml(text: str) -> JobSpec:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError("spec", f"not valid YAML: {exc}") from None
    return parse_spec(data)


def spec_to_user(spec: JobSpec) -> dict[str, Any]:
    """The spec as a person writes it (the one spelling `parse_spec` takes): aliases, CPUs as
    milli-CPU quantities ("1500m"), memory as MiB quantities ("512Mi"), durations in seconds.
    `parse_spec(spec_to_user(s)) == s`. What a service submits for a client (the autoscaler's
    replicas) is written this way, as any client's would be."""
    doc = spec.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    res = doc.get("resources")
    if isinstance(res, dict):
        if "cpu" in res:
            res["cpu"] = f"{res['cpu']}m"
        for key in ("memory", "gpuMemory"):
            if key in res:
                res[key] = f"{res[key]}Mi"
    if "priorityClass" in doc:  # admission writes the class's number into priority: a person gives one of them
        doc.pop("priority", None)
    sim = doc.get("sim")
    if isinstance(sim, dict) and "gpuMemoryUsed" in sim:  # (a bare number would be bytes)
        sim["gpuMemoryUsed"] = f"{sim['gpuMemoryUsed']}Mi"
    return doc


def set_path(doc: dict[str, Any], assignment: str) -> None:
    """`PATH=VALUE` into a spec as a person writes it (`submit --set resources.gpu=4`): the path
    in the spec's own spelling, dots between levels; the value read as YAML (4, 2h, true, [a, b]).
    Raises SpecError naming the assignment when it is not PATH=VALUE or its path runs through
    something that is not a mapping; what the value means is checked by `parse_spec`."""
    path, eq, raw = assignment.partition("=")
    keys = path.strip().split(".")
    if not eq or not all(keys):
        raise SpecError("--set", f"{assignment!r}: write PATH=VALUE, e.g. resources.gpu=4 or sim.duration=2h")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise SpecError("--set", f"{assignment!r}: the value is not valid YAML: {exc}") from None
    at: Any = doc
    for i, key in enumerate(keys[:-1]):
        nxt = at.get(key)
        if nxt is None:
            nxt = at[key] = {}
        if not isinstance(nxt, dict):
            raise SpecError(".".join(keys[:i + 1]), f"{assignment!r}: {'.'.join(keys[:i + 1])} is not a mapping")
        at = nxt
    at[keys[-1]] = value


def spec_to_wire(spec: JobSpec) -> dict[str, Any]:
    """The canonical JSON form (aliases, quantities normalised to milli-CPU / MiB / seconds)."""
    return spec.model_dump(mode="json", by_alias=False)
