"""Builders for test objects: job specs, envelopes, nodes, and a harness that plays a core like the runtime.

    spec = make_job("train").gpus(8).model("H100").replicas(2).queue("a").spec()
    env = event(JobAdmitted(job_id="j1"), tenant="acme", seq=3)
    h = Harness(PlacerCore()).given(node("n1", gpus=8), *reserved(spec, "j1"))
    out = h.when(event(...))          # evolve the input, decide, evolve own outputs (as the runtime does)

Everything here is deterministic: ids come from `seq`, time from T0.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar

from gpufleet.shared.contract.events import (
    SYS_TENANT,
    CancelRequestedCmd,
    Envelope,
    GpuDevice,
    JobAdmitted,
    JobCancelled,
    JobCancelRequested,
    JobExited,
    JobPlaced,
    JobQuotaReserved,
    JobStarted,
    JobSubmitted,
    NodeCordoned,
    NodeInventory,
    NodeRegistered,
    ReplicaAllocation,
    SubmitRequested,
    _Payload,
)
from gpufleet.shared.contract.ids import derive_id, ulid
from gpufleet.shared.contract.spec import JobSpec, parse_spec
from gpufleet.shared.runtime.engine import Engine
from gpufleet.shared.runtime.loop import Core, Ctx
from gpufleet.shared.trust.authz import owner_actor

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
T0_MS = int(T0.timestamp() * 1000)
S = TypeVar("S")

# ---------------------------------------------------------------- job specs


class JobBuilder:
    """A job spec as the YAML a person writes (aliases, quantities), built step by step."""

    def __init__(self, name: str = "job", tenant: str = "acme") -> None:
        self._data: dict[str, Any] = {
            "name": name, "tenant": tenant,
            "resources": {"cpu": 1, "memory": "1Gi", "gpu": 0},
            "sim": {"duration": "1s", "exitCode": 0},
        }

    def name(self, name: Any) -> JobBuilder:
        return self.set("name", name)

    def tenant(self, tenant: Any) -> JobBuilder:
        return self.set("tenant", tenant)

    def queue(self, queue: Any) -> JobBuilder:
        return self.set("queue", queue)

    def type(self, job_type: Any) -> JobBuilder:
        return self.set("type", job_type)

    def priority(self, priority: Any) -> JobBuilder:
        return self.set("priority", priority)

    def replicas(self, n: Any) -> JobBuilder:
        return self.set("replicas", n)

    def gpus(self, n: Any) -> JobBuilder:
        return self.res("gpu", n)

    def model(self, model: Any) -> JobBuilder:
        return self.res("gpuModel", model)

    def mig(self, profile: str, n: Any = 1) -> JobBuilder:
        """MIG instances of a profile per replica (instead of whole GPUs)."""
        self._data["resources"].pop("gpu", None)
        self._data["resources"].setdefault("mig", {})[profile] = n
        return self

    def cpu(self, cpu: Any) -> JobBuilder:
        return self.res("cpu", cpu)

    def memory(self, memory: Any) -> JobBuilder:
        return self.res("memory", memory)

    def max_runtime(self, value: Any) -> JobBuilder:
        return self.set("maxRuntime", value)

    def runs(self, duration: Any, exit_code: Any = 0) -> JobBuilder:
        """How the sim driver plays it."""
        self._data["sim"] = {"duration": duration, "exitCode": exit_code}
        return self

    def set(self, key: str, value: Any) -> JobBuilder:
        """Any top-level field, valid or not."""
        self._data[key] = value
        return self

    def res(self, key: str, value: Any) -> JobBuilder:
        """Any field under `resources`, valid or not."""
        self._data["resources"][key] = value
        return self

    def without(self, *keys: str) -> JobBuilder:
        for key in keys:
            self._data.pop(key, None)
        return self

    def dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._data)

    def spec(self) -> JobSpec:
        return parse_spec(self.dict())


def make_job(name: str = "job", tenant: str = "acme") -> JobBuilder:
    return JobBuilder(name, tenant)


# ---------------------------------------------------------------- envelopes

_seq = itertools.count(1_000_000)


def event_id(seq: int) -> str:
    """A deterministic, time-ordered event id for position `seq`."""
    return ulid(T0_MS + seq, seq.to_bytes(10, "big"))


def event(payload: _Payload, *, tenant: str | None = None, seq: int | None = None, at: datetime | None = None,
          actor: str | None = None, cause: Envelope | None = None) -> Envelope:
    """An envelope around `payload`: node and dead-letter facts default to tenant 'sys', the rest to 'acme'."""
    if seq is None:
        seq = next(_seq)
    if tenant is None:
        kind = str(payload.type)  # type: ignore[attr-defined]
        tenant = SYS_TENANT if kind.startswith(("node.", "sys.")) else "acme"
    job_id = getattr(payload, "job_id", None)
    if actor is None:  # by default the event is by its type's owner (shared/trust/authz.py)
        actor = owner_actor(str(payload.type))  # type: ignore[attr-defined]
    return Envelope(
        event_id=event_id(seq), type=payload.type,  # type: ignore[attr-defined]
        occurred_at=at or T0 + timedelta(milliseconds=seq % 1_000_000),
        tenant=tenant, actor=actor, correlation_id=job_id, payload=payload,  # type: ignore[arg-type]
        causation_id=cause.event_id if cause else None,
    )


def ctx(cause: Envelope | None = None, now: datetime = T0, actor: str = "t") -> Ctx:
    return Ctx(now=now, actor=actor, cause=cause)


# ---------------------------------------------------------------- commands and job facts


def submit(job: JobBuilder | dict[str, Any], job_id: str = "j1", *, tenant: str | None = None,
           seq: int | None = None) -> Envelope:
    data = job.dict() if isinstance(job, JobBuilder) else job
    tenant = tenant if tenant is not None else str(data.get("tenant", "acme"))
    return event(SubmitRequested(job_id=job_id, spec=data), tenant=tenant, seq=seq)


def cancel(job_id: str = "j1", *, tenant: str = "acme", seq: int | None = None, actor: str | None = None) -> Envelope:
    return event(CancelRequestedCmd(job_id=job_id), tenant=tenant, seq=seq, actor=actor)


def _spec(job: JobBuilder | JobSpec) -> JobSpec:
    return job.spec() if isinstance(job, JobBuilder) else job


def submitted(job: JobBuilder | JobSpec, job_id: str = "j1") -> Envelope:
    spec = _spec(job)
    return event(JobSubmitted(job_id=job_id, spec=spec), tenant=spec.tenant)


def admitted(job_id: str = "j1", tenant: str = "acme") -> Envelope:
    return event(JobAdmitted(job_id=job_id), tenant=tenant)


def quota_reserved(job: JobBuilder | JobSpec, job_id: str = "j1") -> Envelope:
    spec = _spec(job)
    r = spec.resources
    return event(JobQuotaReserved(
        job_id=job_id, queue=spec.queue, cpu_milli=r.cpu_milli * spec.replicas,
        memory_mib=r.memory_mib * spec.replicas, gpus=spec.gpus_total, mig=spec.mig_total,
    ), tenant=spec.tenant)


def reserved(job: JobBuilder | JobSpec, job_id: str = "j1") -> list[Envelope]:
    """What the placer sees of a job waiting for placement: its spec, then its reservation."""
    return [submitted(job, job_id), quota_reserved(job, job_id)]


def placed(job_id: str, *allocs: tuple[str, Iterable[int]], tenant: str = "acme", cpu_milli: int = 1000,
           memory_mib: int = 1024, attempt: int = 1, at: datetime | None = None) -> Envelope:
    """`placed("j1", ("n1", [0, 1]), ("n2", [0, 1]))`: replica i gets the i-th (node, GPUs)."""
    return event(JobPlaced(job_id=job_id, attempt=attempt, allocations=tuple(
        ReplicaAllocation(replica=i, node_id=n, gpu_indices=tuple(g), cpu_milli=cpu_milli, memory_mib=memory_mib)
        for i, (n, g) in enumerate(allocs)
    )), tenant=tenant, at=at)


def started(job_id: str, node_id: str, replica: int = 0, *, tenant: str = "acme", at: datetime = T0,
            seq: int | None = None) -> Envelope:
    return event(JobStarted(job_id=job_id, node_id=node_id, replica=replica), tenant=tenant, at=at, seq=seq)


def exited(job_id: str, node_id: str, replica: int = 0, exit_code: int = 0, reason: str = "completed", *,
           tenant: str = "acme") -> Envelope:
    return event(JobExited(job_id=job_id, node_id=node_id, replica=replica, exit_code=exit_code,
                           reason=reason), tenant=tenant)  # type: ignore[arg-type]


def cancelled(job_id: str = "j1", tenant: str = "acme") -> Envelope:
    return event(JobCancelled(job_id=job_id, reason="cancelled by user"), tenant=tenant)


def cancel_requested(job_id: str = "j1", tenant: str = "acme") -> Envelope:
    return event(JobCancelRequested(job_id=job_id, reason="cancelled by user", requested_by="test"), tenant=tenant)


# ---------------------------------------------------------------- nodes


def inventory(gpus: int = 8, model: str = "H100", cpu_milli: int = 64_000, memory_mib: int = 512 * 1024,
              ) -> NodeInventory:
    return NodeInventory(cpu_milli=cpu_milli, memory_mib=memory_mib, gpus=tuple(
        GpuDevice(index=i, uuid=f"GPU-{model}-{i}", model=model, memory_mib=80 * 1024) for i in range(gpus)
    ))


def node(node_id: str, gpus: int = 8, model: str = "H100", cpu_milli: int = 64_000,
         memory_mib: int = 512 * 1024) -> Envelope:
    """A node.registered fact."""
    return event(NodeRegistered(node_id=node_id, inventory=inventory(gpus, model, cpu_milli, memory_mib)))


def mig_node(node_id: str, shape: str = "h100mig") -> Envelope:
    """A node.registered fact for a sim shape with GPUs in MIG mode (shared.cluster.MIG_LAYOUTS)."""
    from gpufleet.shared.node.cluster import shape_inventory

    return event(NodeRegistered(node_id=node_id, inventory=shape_inventory(shape, node_id)))


def cordoned(node_id: str) -> Envelope:
    return event(NodeCordoned(node_id=node_id, reason="maintenance"))


def derived(cause: Envelope, key: str | int) -> str:
    """The id a core gives output `key` of its decision on `cause`."""
    return derive_id(cause.event_id, key)


# ---------------------------------------------------------------- a core, played like the runtime plays it


class Harness(Generic[S]):
    """Given events -> when event -> then events, with the runtime's rules and no NATS: the
    engine the runtime and the simulator play cores with (shared/runtime/engine.py). The input is
    evolved before the decision, and outputs on the core's own subjects are evolved at once (so
    the next decision sees them)."""

    actor = "t"  # who its outputs are by

    def __init__(self, core: Core[S]) -> None:
        self.core = core
        self.engine: Engine[S] = Engine(core)

    @property
    def state(self) -> S:
        return self.engine.state

    @state.setter
    def state(self, state: S) -> None:
        self.engine.state = state

    def given(self, *events: Envelope | Iterable[Envelope]) -> Harness[S]:
        for e in _flatten(events):
            self.engine.fold(e)
        return self

    def decide(self, env: Envelope, now: datetime = T0) -> list[Envelope]:
        """The pure decision on the current state; nothing evolved."""
        return self.engine.decide(env, ctx(env, now, self.actor))

    def when(self, env: Envelope, now: datetime = T0) -> list[Envelope]:
        return self.engine.deliver(env, None, ctx(env, now, self.actor))

    def tick(self, now: datetime) -> list[Envelope]:
        return self.engine.tick(ctx(None, now, self.actor))

    def start(self, now: datetime = T0) -> list[Envelope]:
        return self.engine.start(ctx(None, now, self.actor))


def _flatten(events: Iterable[Envelope | Iterable[Envelope]]) -> list[Envelope]:
    out: list[Envelope] = []
    for e in events:
        if isinstance(e, Envelope):
            out.append(e)
        else:
            out.extend(e)
    return out


def types(events: Iterable[Envelope]) -> list[str]:
    return [e.type for e in events]
