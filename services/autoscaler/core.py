"""Autoscaler: inference replicas from reported load, node pools from waiting demand and idle nodes.

folds: inference services (spec `autoscale`) and their replica jobs, load reports
       (`cmd.report_load`), unschedulable jobs, pool nodes and what is placed on them, idle facts
decides:
  - services: `job.scaled` (from -> to, the metrics and targets that drove it), then the replica
    jobs as ordinary `cmd.submit` / `cmd.cancel` commands, so admission, quota and the placer treat
    them like any job. Target tracking as the Kubernetes HPA: desired = ceil(replicas x metric /
    target) per metric, the largest wins, within [minReplicas, maxReplicas]; no change inside the
    tolerance; up at most once per scaleUpCooldown; down to the largest recommendation of the
    last scaleDownCooldown (a stabilisation window: load that dips and comes back does not flap);
    to zero after scaleToZeroAfter without requests, and back as soon as requests come.
  - pools: `node.provision_requested` for demand unschedulable past a pool's scaleUpAfter that
    the pool's node shape can hold (first fit over the nodes coming, gangs all or nothing, up to
    max); `node.cordoned` for a pool node idle past scaleDownAfter (down to min), then
    `node.removal_requested` once nothing is on it; `node.removal_requested` (provision_timeout)
    for a node asked for that has not registered within provisionTimeout, (lost) for a node lost
    that long. The provider (sim: the
    sim executor) makes the node, which registers like any other, and removes it (`node.deregistered`).

The service job itself holds nothing: quota never reserves it (services/quota), so it is never
placed; it lives from `job.admitted` until it is cancelled, and its replicas are jobs
`<service>-r<n>` (docs/autoscaling.md).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from gpufleet.shared.contract.clusterconfig import ClusterConfig, NodePoolConfig
from gpufleet.shared.contract.errors import SpecError
from gpufleet.shared.contract.events import (
    RUN_ENDED_JOB_TYPES,
    SYS_TENANT,
    CancelRequestedCmd,
    Envelope,
    JobExited,
    JobIdleDetected,
    JobIdleEnded,
    JobPlaced,
    JobQueued,
    JobQuotaReserved,
    JobRequestRefused,
    JobResumeRequested,
    JobScaled,
    JobStarted,
    JobSubmitted,
    JobUnschedulable,
    NodeCordoned,
    NodeDeregistered,
    NodeLost,
    NodeProvisionRequested,
    NodeRegistered,
    NodeRemovalRequested,
    NodeUncordoned,
    Reason,
    ReportLoadCmd,
    SubmitRequested,
)
from gpufleet.shared.contract.spec import AutoscaleSpec, JobSpec, spec_to_user
from gpufleet.shared.runtime.loop import BaseCore, Ctx
from gpufleet.shared.runtime.retention import EndedJobs

from .pools import Room, empty_room, pack, pool_inventory, replica_fits_shape

SERVICE_ENV = "GPUFLEET_SERVICE_ID"
REPLICA_ENV = "GPUFLEET_REPLICA_INDEX"
RECOMMENDATIONS_MAX = 1024  # per service: the scale-down window's history is bounded
REPLACE_BACKOFF_S = (2.0, 5.0, 15.0, 60.0, 300.0)  # a replica that keeps failing is replaced ever slower
DRAIN_SETTLE_S = 2.0  # after a cordon, a placement decided before the placer saw it may still land
PROVIDERS = ("sim",)  # built in (providers.py: the interface, and where a cloud provider is added)
ENDED = RUN_ENDED_JOB_TYPES


# ---------------------------------------------------------------- state


@dataclass
class ReplicaJob:
    job_id: str
    index: int
    running: bool = False
    submit_id: str | None = None  # the event id of our `cmd.submit` (admission's refusal names it)


@dataclass
class Service:
    job_id: str
    tenant: str
    spec: JobSpec
    auto: AutoscaleSpec
    active: bool = False  # admitted and not ended
    ended: bool = False
    desired: int = 0
    replicas: dict[str, ReplicaJob] = field(default_factory=dict)  # counted towards `desired`
    removing: set[str] = field(default_factory=set)  # cancelled by us, not ended yet
    next_index: int = 0
    last_change_s: float | None = None
    recommendations: list[tuple[float, int]] = field(default_factory=list)  # (when, replicas)
    rps: float | None = None
    p99_ms: float | None = None
    # the reporter's clock (the reports' occurred_at), never mixed with ours: a skewed load
    # balancer clock moves neither the stabilisation window nor the idle time
    report_s: float | None = None  # the latest report
    busy_s: float | None = None  # the latest report with requests (or the first report)
    failures: int = 0  # replicas that ended badly in a row
    retry_s: float = 0.0  # no replacement before this
    scale_events: int = 0


@dataclass
class PoolNode:
    node_id: str
    pool: str
    provider: str
    requested_s: float
    ready_after_s: float
    registered_s: float | None = None
    offered_s: float | None = None  # when it last became free to take work (registered, uncordoned)
    cordoned: bool = False
    drained_by_us_s: float | None = None  # when we cordoned it to remove it
    removal_requested: bool = False
    gone: bool = False
    lost: bool = False
    lost_s: float | None = None  # since when it has been lost (given up after provisionTimeout)


@dataclass
class Waiting:
    since_s: float
    event_id: str
    # pools whose node it waited through without being placed on it (one it fits alone): they do
    # not help it, and are not grown nor taken back for it while it waits (no buy / drain loop)
    passed_over: set[str] = field(default_factory=set)


@dataclass
class Alloc:
    node_id: str
    gpus: tuple[tuple[int, int], ...]  # (GPU index, milli of it)
    cpu_milli: int
    memory_mib: int
    attempt: int


@dataclass(slots=True)
class Run:
    """A job's placements and the runs they started (from its first `job.placed` or `job.started`)."""

    attempt: int | None = None  # the attempt of its latest placement
    allocs: dict[int, Alloc] = field(default_factory=dict)  # replica -> what it holds where, and by which attempt
    starts: dict[str, int] = field(default_factory=dict)  # its job.started ids -> attempt
    # (attempt, node) -> when telemetry found that run idle there (`job.idle_detected`)
    idle: dict[tuple[int, str], float] | None = None


@dataclass(slots=True)
class AutoscalerJob:
    """What the autoscaler knows of one job that has not ended: one record, forgotten at once when
    the job ends (`AutoscalerState.end`). What it holds stays None until it is placed: a pending
    job costs one small record."""

    spec: JobSpec | None = None  # (pool demand)
    waiting: Waiting | None = None  # unschedulable: waiting for room, since
    # it waited for room and then for quota again (its reservation was taken back): when quota
    # reserves again it waits for room again (the placer does not repeat an unchanged reason)
    requota: bool = False
    run: Run | None = None


@dataclass
class AutoscalerState:
    # a service that ended stays while something refers to it (a replica not ended yet) and its id
    # is in `ended`; then it is forgotten (`forget`)
    services: dict[str, Service] = field(default_factory=dict)
    # replica job -> service: kept past the replica's end (the end's decision replaces it by its
    # service; a late copy of our submit of an ended replica counts nothing) until the ended
    # window forgets the replica
    replica_of: dict[str, str] = field(default_factory=dict)
    jobs: dict[str, AutoscalerJob] = field(default_factory=dict)
    ended: EndedJobs = field(default_factory=EndedJobs)  # forgotten after a window of log time
    # indexes of `jobs` (kept by `set_waiting`, `hold`, `drop` and `end`, nowhere else)
    unschedulable: set[str] = field(default_factory=set)  # jobs waiting for room (the tick walks them)
    on_node: dict[str, set[tuple[str, int]]] = field(default_factory=dict)  # node -> (job, replica) placed there
    pool_nodes: dict[str, PoolNode] = field(default_factory=dict)
    pool_seq: dict[str, int] = field(default_factory=dict)  # pool -> node ids handed out
    changed_s: dict[str, float] = field(default_factory=dict)  # node -> when what is on it last changed
    nodes: set[str] = field(default_factory=set)
    # pool node -> what was asked of its provider (for the provider agent; dropped once it is gone)
    requests: dict[str, tuple[NodeProvisionRequested, NodeRemovalRequested | None]] = field(default_factory=dict)
    # pool -> its latest decision: (when, event type, node, why) (for `gpufleet pools`)
    pool_last: dict[str, tuple[float, str, str, str]] = field(default_factory=dict)

    def job(self, job_id: str) -> AutoscalerJob:
        rec = self.jobs.get(job_id)
        if rec is None:
            rec = self.jobs[job_id] = AutoscalerJob()
        return rec

    def run(self, job_id: str) -> Run:
        rec = self.job(job_id)
        if rec.run is None:
            rec.run = Run()
        return rec.run

    def run_of(self, job_id: str) -> Run | None:
        rec = self.jobs.get(job_id)
        return rec.run if rec is not None else None

    def attempt(self, job_id: str) -> int:
        """The attempt of the job's latest placement (0: none)."""
        run = self.run_of(job_id)
        return (run.attempt or 0) if run is not None else 0

    def placed(self, job_id: str, replica: int) -> tuple[Run, Alloc]:
        """A replica placed on a node (`on_node`): its job's run, and what it holds there."""
        run = self.run_of(job_id)
        assert run is not None
        return run, run.allocs[replica]

    def waiting(self) -> list[tuple[str, Waiting, JobSpec | None]]:
        """The jobs waiting for room (job, since when, its spec), the longest waiting first."""
        out = []
        for job_id in self.unschedulable:
            rec = self.jobs[job_id]
            assert rec.waiting is not None
            out.append((job_id, rec.waiting, rec.spec))
        return sorted(out, key=lambda x: (x[1].since_s, x[0]))

    def end(self, job_id: str, when: datetime) -> None:
        """The job ended: remembered as ended for the window; what it held is freed and its record
        forgotten now. What was kept of the jobs the window forgets goes with them."""
        for gone in self.ended.add(job_id, when):
            self.forget(gone)
        rec = self.jobs.pop(job_id, None)
        if rec is None:
            return
        self.unschedulable.discard(job_id)
        if (run := rec.run) is not None:
            at = when.timestamp()
            for replica in list(run.allocs):
                self.drop(job_id, run, replica, at)

    def forget(self, job_id: str) -> None:
        """The ended window forgot `job_id`. A replica's link to its service goes (unless its
        service counts it still: the id of a user's job that ended, which we submitted as a replica
        and admission refuses); a service that ended goes once the window forgot it too and no
        replica of it is left."""
        service_id = self.replica_of.get(job_id)
        if service_id is not None:
            owner = self.services.get(service_id)
            if owner is None or (job_id not in owner.replicas and job_id not in owner.removing):
                del self.replica_of[job_id]
                self._forget_service(service_id)
        self._forget_service(job_id)

    def _forget_service(self, service_id: str) -> None:
        svc = self.services.get(service_id)
        if (svc is not None and svc.ended and service_id not in self.ended
                and not svc.replicas and not svc.removing):
            del self.services[service_id]

    def set_waiting(self, job_id: str, rec: AutoscalerJob, waiting: Waiting | None) -> None:
        rec.waiting = waiting
        (self.unschedulable.add if waiting is not None else self.unschedulable.discard)(job_id)

    def hold(self, job_id: str, run: Run, replica: int, alloc: Alloc, at: float) -> None:
        """The replica is placed (`alloc`), instead of what it held before."""
        self.drop(job_id, run, replica, at)
        run.allocs[replica] = alloc
        self.on_node.setdefault(alloc.node_id, set()).add((job_id, replica))
        self.changed_s[alloc.node_id] = at

    def drop(self, job_id: str, run: Run, replica: int, at: float) -> None:
        """The replica no longer holds its node."""
        held = run.allocs.pop(replica, None)
        if held is None:
            return
        on = self.on_node.get(held.node_id)
        if on is not None:
            on.discard((job_id, replica))
            if not on:
                del self.on_node[held.node_id]
        self.changed_s[held.node_id] = at


def _decimal(s: str) -> bool:
    """Digits 0-9 only (`str.isdigit` is true for "²", which `int` refuses)."""
    return s.isascii() and s.isdecimal()


def replica_job_id(service_id: str, index: int) -> str:
    suffix = f"-r{index}"
    if len(service_id) + len(suffix) <= 64:
        return service_id + suffix
    return hashlib.blake2b(service_id.encode(), digest_size=12).hexdigest() + suffix


# ---------------------------------------------------------------- HPA math


def recommend(auto: AutoscaleSpec, current: int, rps: float | None, p99_ms: float | None) -> tuple[int, str]:
    """The replicas the metrics ask for (within bounds) and which metric drove it.

    Per metric: within `tolerance` of its target -> `current`; else ceil(current x metric / target)
    (for requests per second: ceil(rps / target per replica)). The largest wins (as the HPA)."""
    base = max(current, 1)
    proposals: list[tuple[int, str]] = []
    if auto.target_rps_per_replica is not None and rps is not None:
        ratio = (rps / base) / auto.target_rps_per_replica
        proposals.append((current if abs(ratio - 1) <= auto.tolerance else math.ceil(base * ratio - 1e-9), "load"))
    if auto.target_p99_ms is not None and p99_ms is not None:
        ratio = p99_ms / auto.target_p99_ms
        proposals.append((current if abs(ratio - 1) <= auto.tolerance else math.ceil(base * ratio - 1e-9), "latency"))
    if not proposals:
        return current, "none"
    n, why = max(proposals, key=lambda p: p[0])
    bounded = min(auto.max_replicas, max(auto.min_replicas, n))
    return bounded, why if bounded == n else "bounds"


# ---------------------------------------------------------------- the core


class AutoscalerCore(BaseCore[AutoscalerState]):
    name = "autoscaler"
    subjects = (
        "fleet.cmd.*.report_load", "fleet.cmd.*.submit", "fleet.cmd.*.cancel",
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.admitted", "fleet.evt.*.job.*.rejected",
        "fleet.evt.*.job.*.request_refused", "fleet.evt.*.job.*.unschedulable", "fleet.evt.*.job.*.placed",
        "fleet.evt.*.job.*.started", "fleet.evt.*.job.*.exited", "fleet.evt.*.job.*.scaled",
        "fleet.evt.*.job.*.idle_detected", "fleet.evt.*.job.*.idle_ended",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.preempted", "fleet.evt.*.job.*.queued", "fleet.evt.*.job.*.quota_reserved",
        "fleet.evt.*.job.*.resume_requested",
        "fleet.evt.sys.node.*.registered", "fleet.evt.sys.node.*.lost", "fleet.evt.sys.node.*.cordoned",
        "fleet.evt.sys.node.*.uncordoned", "fleet.evt.sys.node.*.provision_requested",
        "fleet.evt.sys.node.*.removal_requested", "fleet.evt.sys.node.*.deregistered",
    )
    tick_s = 0.5
    state_format = 3  # one record per job (AutoscalerJob); the ended window

    def __init__(self, config: ClusterConfig | None = None, providers: tuple[str, ...] = PROVIDERS) -> None:
        self.config = config or ClusterConfig()
        self.pools: dict[str, NodePoolConfig] = dict(sorted(self.config.node_pools.items()))
        for name, pool in self.pools.items():
            if pool.provider not in providers:
                raise SpecError(f"nodePools.{name}.provider",
                                f"unknown provider {pool.provider!r} (known: {', '.join(providers)})")

    def initial_state(self) -> AutoscalerState:
        return AutoscalerState()

    def _ours(self, env: Envelope) -> bool:
        return env.actor.split("/", 1)[0] == self.name

    # ------------------------------------------------------------ evolve

    def evolve(self, state: AutoscalerState, env: Envelope) -> AutoscalerState:
        p, t = env.payload, env.type
        at = env.occurred_at.timestamp()
        if t.startswith("node."):
            self._evolve_node(state, env, at)
            return state
        job_id = env.job_id
        if job_id is None:
            return state
        if job_id in state.ended and t.startswith("job.") and t not in ENDED and not isinstance(p, JobRequestRefused):
            # a late or copied fact about a job that ended changes nothing (a placement would hold
            # its node for ever). Not commands: our own submit of a replica under the id of a job
            # that ended is counted, and admission's refusal of it (on that id) replaces it.
            return state
        svc = state.services.get(job_id)
        if isinstance(p, ReportLoadCmd):
            if svc is not None and svc.active and env.tenant == svc.tenant:
                svc.rps, svc.p99_ms = p.rps, p.p99_ms
                svc.report_s = at if svc.report_s is None else max(svc.report_s, at)
                if p.rps > 0 or svc.busy_s is None:
                    svc.busy_s = svc.report_s
                n, _ = recommend(svc.auto, svc.desired, p.rps, p.p99_ms)
                svc.recommendations.append((at, n))
                horizon = at - svc.auto.scale_down_cooldown_s
                svc.recommendations = [r for r in svc.recommendations if r[0] >= horizon][-RECOMMENDATIONS_MAX:]
        elif isinstance(p, SubmitRequested):
            self._evolve_replica_submit(state, env, p)
        elif isinstance(p, CancelRequestedCmd):
            owner = state.services.get(state.replica_of.get(job_id, ""))
            if owner is not None and self._ours(env) and job_id in owner.replicas:
                del owner.replicas[job_id]
                owner.removing.add(job_id)
        elif isinstance(p, JobSubmitted):
            rec = state.job(job_id)
            if rec.spec is None:
                rec.spec = p.spec
            if p.spec.autoscale is not None and svc is None and job_id not in state.replica_of:
                state.services[job_id] = Service(job_id, env.tenant, p.spec, p.spec.autoscale)
        elif t == "job.admitted":
            if svc is not None and not svc.ended and not svc.active:
                svc.active = True
        elif isinstance(p, JobScaled):
            if svc is not None:
                svc.desired = p.to_replicas
                svc.last_change_s = at
                svc.scale_events += 1
        elif isinstance(p, JobUnschedulable):
            if (rec0 := state.jobs.get(job_id)) is not None:
                rec0.requota = False
                if rec0.spec is not None and rec0.waiting is None:
                    state.set_waiting(job_id, rec0, Waiting(at, env.event_id))
        elif isinstance(p, JobQueued) or (isinstance(p, JobResumeRequested) and p.reason.code == "preempted"):
            # its quota was taken back before it was placed: it waits for quota, not for nodes
            # (a resume for another reason keeps its quota and waits for room again, if it did)
            if (rec0 := state.jobs.get(job_id)) is not None and rec0.waiting is not None:
                state.set_waiting(job_id, rec0, None)
                rec0.requota = True
        elif isinstance(p, JobQuotaReserved):
            if (rec0 := state.jobs.get(job_id)) is not None and rec0.requota and rec0.spec is not None:
                # reserved again: the placer tries it now and, if its reason is unchanged, says nothing
                rec0.requota = False
                if rec0.waiting is None:
                    state.set_waiting(job_id, rec0, Waiting(at, env.event_id))
        elif isinstance(p, JobPlaced):
            if p.attempt < state.attempt(job_id):
                return state  # a placement of an earlier attempt, redelivered late
            rec = state.job(job_id)
            state.set_waiting(job_id, rec, None)
            rec.requota = False
            run = state.run(job_id)
            run.attempt = p.attempt
            run.idle = None  # a new run: telemetry judges it afresh
            if run.starts:
                run.starts = {k: a for k, a in run.starts.items() if a >= p.attempt}
            for a in p.allocations:
                gpus = tuple((i, a.gpu_milli) for i in a.gpu_indices)
                state.hold(job_id, run, a.replica, Alloc(a.node_id, gpus, a.cpu_milli, a.memory_mib, p.attempt), at)
        elif isinstance(p, JobStarted):
            if p.attempt >= state.attempt(job_id):
                state.run(job_id).starts[env.event_id] = p.attempt
            owner = state.services.get(state.replica_of.get(job_id, ""))
            if owner is not None and job_id in owner.replicas:
                owner.replicas[job_id].running = True
                owner.failures = 0
        elif isinstance(p, JobExited):
            if (run0 := state.run_of(job_id)) is not None:
                held = run0.allocs.get(p.replica)
                if held is not None and held.attempt == p.attempt:
                    # (the exit of an earlier attempt frees nothing: the current one holds the node now)
                    state.drop(job_id, run0, p.replica, at)
        elif isinstance(p, JobIdleDetected):
            self._evolve_idle(state, env, p, at)
        elif isinstance(p, JobIdleEnded):
            if (run0 := state.run_of(job_id)) is not None:
                run0.idle = None
                for held in run0.allocs.values():
                    state.changed_s[held.node_id] = at  # busy again: its node's idle clock restarts
        elif isinstance(p, JobRequestRefused):
            self._evolve_refused(state, env, p, at)
        elif t in ENDED:
            state.end(job_id, env.occurred_at)
            if svc is not None:
                svc.active, svc.ended = False, True
            service_id = state.replica_of.get(job_id)
            owner = state.services.get(service_id or "")
            if owner is not None and (job_id in owner.replicas or job_id in owner.removing):
                was_ours = job_id in owner.removing
                owner.replicas.pop(job_id, None)
                owner.removing.discard(job_id)
                if not was_ours and t in ("job.failed", "job.rejected"):
                    self._replica_failed(owner, at)
        return state

    @staticmethod
    def _replica_failed(owner: Service, at: float) -> None:
        owner.failures += 1
        owner.retry_s = at + REPLACE_BACKOFF_S[min(owner.failures, len(REPLACE_BACKOFF_S)) - 1]

    def _refusal_of_our_submit(self, state: AutoscalerState, env: Envelope, p: JobRequestRefused) -> bool:
        """Whether admission refused our own `cmd.submit` of a replica we count. Admission answers a
        refusal on the requester's tenant subject: another tenant's cancel of a replica id, or a user's
        submit under an id a replica has, are refused there, and say nothing about our replica."""
        owner = state.services.get(state.replica_of.get(p.job_id, ""))
        if owner is None or p.command != "submit" or env.tenant != owner.tenant:
            return False
        rep = owner.replicas.get(p.job_id)
        return rep is not None and rep.submit_id is not None and p.command_id == rep.submit_id

    def _evolve_refused(self, state: AutoscalerState, env: Envelope, p: JobRequestRefused, at: float) -> None:
        if not self._refusal_of_our_submit(state, env, p):
            return
        owner = state.services[state.replica_of[p.job_id]]
        del owner.replicas[p.job_id]  # its id is taken (duplicate_job_id): another index replaces it
        self._replica_failed(owner, at)

    @staticmethod
    def _evolve_idle(state: AutoscalerState, env: Envelope, p: JobIdleDetected, at: float) -> None:
        """Telemetry's idle fact is about one run (job, attempt: the `job.started` it is caused by)
        on one node (its replica's there); a fact of an earlier run, or of no node we know the
        current run on, marks nothing."""
        run = state.run_of(p.job_id)
        if run is None or run.attempt is None:
            return
        current = run.attempt
        attempt = run.starts.get(env.causation_id or "", current)
        if attempt != current:
            return
        nodes = {a.node_id for a in run.allocs.values() if a.attempt == current}
        for node_id in sorted(nodes if p.node_id is None else nodes & {p.node_id}):
            if run.idle is None:
                run.idle = {}
            run.idle.setdefault((current, node_id), at)

    def _evolve_replica_submit(self, state: AutoscalerState, env: Envelope, p: SubmitRequested) -> None:
        """Our own submit of a replica (the spec names its service and index)."""
        if not self._ours(env):
            return
        env_vars = p.spec.get("env") if isinstance(p.spec, dict) else None
        if not isinstance(env_vars, dict):
            return
        svc = state.services.get(str(env_vars.get(SERVICE_ENV, "")))
        index = str(env_vars.get(REPLICA_ENV, ""))
        if svc is None or svc.tenant != env.tenant or not _decimal(index) or p.job_id in state.replica_of:
            return
        state.replica_of[p.job_id] = svc.job_id
        svc.replicas[p.job_id] = ReplicaJob(p.job_id, int(index), submit_id=env.event_id)
        svc.next_index = max(svc.next_index, int(index) + 1)

    def _evolve_node(self, state: AutoscalerState, env: Envelope, at: float) -> None:
        p = env.payload
        if isinstance(p, NodeProvisionRequested):
            if p.node_id not in state.pool_nodes:
                state.pool_nodes[p.node_id] = PoolNode(p.node_id, p.pool, p.provider, at, p.ready_after_s)
                state.requests[p.node_id] = (p, None)
                state.pool_last[p.pool] = (at, p.type, p.node_id, p.reason.message)
                prefix = f"{p.pool}-"
                if p.node_id.startswith(prefix) and _decimal(p.node_id[len(prefix):]):
                    n = int(p.node_id[len(prefix):]) + 1
                    state.pool_seq[p.pool] = max(state.pool_seq.get(p.pool, 0), n)
            return
        node = state.pool_nodes.get(env.node_id or "")
        if isinstance(p, NodeRegistered):
            state.nodes.add(p.node_id)
            state.changed_s.setdefault(p.node_id, at)
            if node is not None:
                node.lost, node.lost_s = False, None
                if node.registered_s is None:
                    node.registered_s = node.offered_s = at
                    state.changed_s[p.node_id] = at
        elif node is None:
            if isinstance(p, NodeDeregistered):
                state.nodes.discard(p.node_id)
            return
        elif isinstance(p, NodeLost):
            if not node.lost:
                node.lost, node.lost_s = True, at
        elif isinstance(p, NodeCordoned):
            node.cordoned = True
            if self._ours(env):
                node.drained_by_us_s = at
                state.pool_last[node.pool] = (at, p.type, p.node_id, p.reason)
                self._pass_over(state, node)
        elif isinstance(p, NodeUncordoned):
            if self._ours(env) and node.drained_by_us_s is not None:
                state.pool_last[node.pool] = (at, p.type, p.node_id, "taken back for waiting demand")
            node.cordoned = False
            node.drained_by_us_s = None
            node.offered_s = at
            state.changed_s[p.node_id] = at
        elif isinstance(p, NodeRemovalRequested):
            if not node.removal_requested:
                state.pool_last[node.pool] = (at, p.type, p.node_id, p.reason.message)
            node.removal_requested = True
            made = state.requests.get(p.node_id)
            if made is not None:
                state.requests[p.node_id] = (made[0], p)
        elif isinstance(p, NodeDeregistered):
            node.gone = True
            state.nodes.discard(p.node_id)
            state.requests.pop(p.node_id, None)
            del state.pool_nodes[p.node_id]  # (its id is never handed out again: pool_seq only grows)

    def _pass_over(self, state: AutoscalerState, node: PoolNode) -> None:
        """We drain `node` (idle for scaleDownAfter): a job that has waited since before the node
        was offered, and that fits what is free on it alone, was not placed there (the placer
        retries waiting jobs when a node comes or frees): the pool's nodes do not help it (a
        reservation, a constraint the pool's shape does not show). The pool is neither grown nor
        taken back for it while it waits: buying, draining and buying again would never end."""
        pool = self.pools.get(node.pool)
        if pool is None or node.offered_s is None:
            return
        room = self._free_room(state, pool, node.node_id)
        for _, w, spec in state.waiting():
            if (spec is not None and w.since_s < node.offered_s and replica_fits_shape(node.pool, pool, spec)
                    and pack([room], spec, pool, 0) is not None):
                w.passed_over.add(node.pool)

    @staticmethod
    def _free_room(state: AutoscalerState, pool: NodePoolConfig, node_id: str) -> Room:
        room = empty_room(pool)
        room.node_id = node_id
        for job_id, replica in state.on_node.get(node_id, ()):
            _, held = state.placed(job_id, replica)
            room.cpu_milli -= held.cpu_milli
            room.memory_mib -= held.memory_mib
            for i, m in held.gpus:
                if 0 <= i < len(room.gpu_milli):
                    room.gpu_milli[i] -= m
        room.gpu_milli.sort(reverse=True)
        return room

    # ------------------------------------------------------------ decide

    def decide(self, state: AutoscalerState, env: Envelope, ctx: Ctx) -> list[Envelope]:
        p, t = env.payload, env.type
        job_id = env.job_id
        if job_id is None:
            return []
        now = ctx.now.timestamp()
        svc = state.services.get(job_id)
        if svc is not None:
            if t == "job.admitted" and svc.active and svc.desired == 0 and svc.scale_events == 0:
                return self._scale(state, svc, svc.auto.min_replicas, Reason(
                    code="initial", message=f"service admitted: minReplicas {svc.auto.min_replicas}"), ctx)
            if isinstance(p, ReportLoadCmd) and svc.active and env.tenant == svc.tenant:
                return self._evaluate(state, svc, now, ctx)
            if t in ENDED and (svc.replicas or svc.removing):
                return self._cancel_all(svc, ctx, "service ended")
            return []
        owner = state.services.get(state.replica_of.get(job_id, ""))
        if owner is not None and (t in ENDED or isinstance(p, JobRequestRefused)
                                  and p.command == "submit" and env.tenant == owner.tenant):
            return self._reconcile(state, owner, now, ctx)
        return []

    def tick(self, state: AutoscalerState, ctx: Ctx) -> list[Envelope]:
        now = ctx.now.timestamp()
        out: list[Envelope] = []
        for svc in state.services.values():
            if not svc.active:
                continue
            if self._idle_for_zero(svc) or self._up_held(svc, now):
                out += self._evaluate(state, svc, now, ctx)
            else:
                out += self._reconcile(state, svc, now, ctx)
        if self.pools:
            out += self._give_up(state, now, ctx)
            up = self._scale_pools_up(state, now, ctx)
            taken_back = {e.node_id for e in up if e.type == "node.uncordoned"}
            out += up + self._scale_pools_down(state, now, ctx, taken_back)
        return out

    # ------------------------------------------------------------ services

    @staticmethod
    def _idle_for_zero(svc: Service) -> bool:
        """No requests in the reports of the last scaleToZeroAfter (by the reporter's clock)."""
        after = svc.auto.scale_to_zero_after_s
        return (after is not None and svc.desired > 0 and svc.rps == 0 and svc.report_s is not None
                and svc.busy_s is not None and svc.report_s - svc.busy_s >= after)

    @staticmethod
    def _up_held(svc: Service, now: float) -> bool:
        """The last report asks for more replicas than the service has, and the scale-up cooldown
        that held it back is over: scale now, as the HPA's periodic evaluation would, instead of
        waiting for the next report (a one-off report would otherwise change nothing)."""
        if svc.desired == 0 or svc.rps is None or svc.last_change_s is None:
            return False
        if now - svc.last_change_s < svc.auto.scale_up_cooldown_s:
            return False
        return recommend(svc.auto, svc.desired, svc.rps, svc.p99_ms)[0] > svc.desired

    def _evaluate(self, state: AutoscalerState, svc: Service, now: float, ctx: Ctx) -> list[Envelope]:
        """Scale on the latest load report: to zero, from zero, up, or (stabilised) down."""
        a = svc.auto
        cur = svc.desired
        metrics = _metrics(svc)
        if self._idle_for_zero(svc):
            idle_s = (svc.report_s or 0.0) - (svc.busy_s or 0.0)
            return self._scale(state, svc, 0, Reason(code="scale_to_zero", message=(
                f"no requests for {idle_s:.0f}s (scaleToZeroAfter {a.scale_to_zero_after_s:.0f}s)")), ctx)
        if cur == 0:
            if svc.rps is None or svc.rps <= 0:
                return []
            n = math.ceil(svc.rps / a.target_rps_per_replica - 1e-9) if a.target_rps_per_replica else 1
            to = min(a.max_replicas, max(a.min_replicas, n))
            return self._scale(state, svc, to, Reason(code="from_zero", message=f"requests again: {metrics}"), ctx)
        rec, why = recommend(a, cur, svc.rps, svc.p99_ms)
        since = now - svc.last_change_s if svc.last_change_s is not None else math.inf
        if rec > cur:
            if since < a.scale_up_cooldown_s:
                return []
            return self._scale(state, svc, rec, Reason(code=why, message=(
                f"{metrics}: {cur} -> {rec} replicas (max {a.max_replicas})")), ctx)
        if rec < cur:
            # the stabilisation window: the largest recommendation of the last scaleDownCooldown
            # (of reports, by their clock)
            horizon = (svc.report_s or now) - a.scale_down_cooldown_s
            window = [n for at, n in svc.recommendations if at >= horizon]
            if since < a.scale_down_cooldown_s:
                window.append(cur)  # the last change is recent: nothing lower yet
            to = max([rec, *window])
            if to >= cur:
                return []
            return self._scale(state, svc, to, Reason(code=why, message=(
                f"{metrics}: {cur} -> {to} replicas (largest recommendation of the last "
                f"{a.scale_down_cooldown_s:.0f}s; min {a.min_replicas})")), ctx)
        return []

    def _scale(self, state: AutoscalerState, svc: Service, to: int, reason: Reason, ctx: Ctx) -> list[Envelope]:
        cur = svc.desired
        if to == cur:
            return []
        added, removed = self._plan(svc, to)
        scaled = ctx.emit(JobScaled(job_id=svc.job_id, from_replicas=cur, to_replicas=to, reason=reason,
                                    rps=svc.rps, p99_ms=svc.p99_ms, added=tuple(r for r, _ in added),
                                    removed=tuple(removed)),
                          tenant=svc.tenant, key=f"scaled:{svc.job_id}:{svc.scale_events}")
        out = [scaled]
        for rid, index in added:
            out.append(self._submit(svc, rid, index, ctx, scaled.event_id))
        for rid in removed:
            out.append(self._cancel(svc, rid, ctx, scaled.event_id, f"scaled down {cur} -> {to}"))
        return out

    @staticmethod
    def _plan(svc: Service, to: int) -> tuple[list[tuple[str, int]], list[str]]:
        """Replica jobs to add (id, index) and to cancel so that `to` are counted."""
        have = len(svc.replicas)
        added = [(replica_job_id(svc.job_id, svc.next_index + i), svc.next_index + i) for i in range(max(0, to - have))]
        # newest first, and those not running yet before those that serve
        order = sorted(svc.replicas.values(), key=lambda r: (r.running, -r.index))
        removed = [r.job_id for r in order[: max(0, have - to)]]
        return added, removed

    def _reconcile(self, state: AutoscalerState, svc: Service, now: float, ctx: Ctx) -> list[Envelope]:
        """Replace replicas that ended (after a backoff if they keep failing); cancel extra ones."""
        if not svc.active:
            return []
        have = len(svc.replicas)
        if have > svc.desired:
            _, removed = self._plan(svc, svc.desired)
            return [self._cancel(svc, rid, ctx, None, f"more replicas than desired ({svc.desired})") for rid in removed]
        if have < svc.desired and now >= svc.retry_s:
            added, _ = self._plan(svc, svc.desired)
            return [self._submit(svc, rid, index, ctx, None) for rid, index in added]
        return []

    def _submit(self, svc: Service, rid: str, index: int, ctx: Ctx, cause: str | None) -> Envelope:
        wire = spec_to_user(svc.spec)  # (the spelling a client writes: admission takes no other)
        wire.pop("autoscale", None)
        wire["name"] = f"{svc.spec.name[:50]}-r{index}"[-64:]
        wire["env"] = {**svc.spec.env, SERVICE_ENV: svc.job_id, REPLICA_ENV: str(index)}
        return ctx.emit(SubmitRequested(job_id=rid, spec=wire), tenant=svc.tenant,
                        cause_id=cause, key=f"submit:{rid}")

    def _cancel(self, svc: Service, rid: str, ctx: Ctx, cause: str | None, why: str) -> Envelope:
        return ctx.emit(CancelRequestedCmd(job_id=rid, reason=f"autoscaler: {why}"), tenant=svc.tenant,
                        cause_id=cause, key=f"cancel:{rid}")

    def _cancel_all(self, svc: Service, ctx: Ctx, why: str) -> list[Envelope]:
        return [self._cancel(svc, rid, ctx, None, why) for rid in sorted(svc.replicas)]

    # ------------------------------------------------------------ pools: up

    def _rooms(self, state: AutoscalerState, pool_name: str, now: float) -> list[Room]:
        """What the pool's nodes could still take: nodes coming (empty), nodes that came lately (what
        is free on them: the placer may not have retried yet), nodes we are draining (uncordoned
        if used)."""
        pool = self.pools[pool_name]
        rooms: list[Room] = []
        for n in sorted(state.pool_nodes.values(), key=lambda n: n.node_id):
            if n.pool != pool_name or n.removal_requested or n.gone or n.lost:
                continue
            if n.cordoned and n.drained_by_us_s is None:
                continue  # cordoned by someone else (maintenance): not ours to take back
            fresh = n.offered_s is None or now - n.offered_s < pool.scale_up_after_s
            if not fresh and n.drained_by_us_s is None:
                continue
            rooms.append(self._free_room(state, pool, n.node_id))
        return rooms

    def _pool_count(self, state: AutoscalerState, pool_name: str) -> int:
        return sum(1 for n in state.pool_nodes.values()
                   if n.pool == pool_name and not n.removal_requested and not n.gone)

    def _scale_pools_up(self, state: AutoscalerState, now: float, ctx: Ctx) -> list[Envelope]:
        out: list[Envelope] = []
        rooms = {name: self._rooms(state, name, now) for name in self.pools}
        count = {name: self._pool_count(state, name) for name in self.pools}
        reuse: dict[str, set[str]] = {name: set() for name in self.pools}
        served: dict[str, list[tuple[str, float]]] = {name: [] for name in self.pools}
        # smallest node shapes first: an 8-GPU job does not get a bigger node than it needs
        order = sorted(self.pools, key=lambda n: (self.pools[n].shape.gpus, self.pools[n].shape.cpu_milli,
                                                  self.pools[n].shape.memory_mib, n))
        for job_id, w, spec in state.waiting():
            if spec is None:
                continue
            for name in order:
                pool = self.pools[name]
                if (now - w.since_s < pool.scale_up_after_s or name in w.passed_over
                        or not replica_fits_shape(name, pool, spec)):
                    continue
                new_before = sum(1 for r in rooms[name] if r.node_id is None)
                packed = pack(rooms[name], spec, pool, pool.max - count[name] - new_before)
                if packed is None:
                    continue
                rooms[name], used = packed
                reuse[name] |= used
                served[name].append((job_id, now - w.since_s))
                break
        for name in order:
            pool = self.pools[name]
            for node_id in sorted(reuse[name]):
                n = state.pool_nodes[node_id]
                if n.drained_by_us_s is not None and n.cordoned:
                    out.append(ctx.emit(NodeUncordoned(node_id=node_id), tenant=SYS_TENANT,
                                        key=f"uncordon:{node_id}:{n.drained_by_us_s}"))
            new = sum(1 for r in rooms[name] if r.node_id is None)
            jobs = served[name]
            if new:
                waited = max(s for _, s in jobs)
                ids = ", ".join(j for j, _ in jobs[:5]) + (f" and {len(jobs) - 5} more" if len(jobs) > 5 else "")
                reason = Reason(code="unschedulable", message=(
                    f"{len(jobs)} job(s) unschedulable for up to {waited:.0f}s (scaleUpAfter "
                    f"{pool.scale_up_after_s:.0f}s) fit a {name} node: {ids}; pool {name} "
                    f"{count[name]} -> {count[name] + new} node(s) (max {pool.max})"))
                out += self._provision(state, name, new, reason, tuple(j for j, _ in jobs), ctx)
            elif count[name] < pool.min:
                reason = Reason(code="below_min", message=f"pool {name} has {count[name]} node(s), min {pool.min}")
                out += self._provision(state, name, pool.min - count[name], reason, (), ctx)
        return out

    def _provision(self, state: AutoscalerState, pool_name: str, n: int, reason: Reason, jobs: tuple[str, ...],
                   ctx: Ctx) -> list[Envelope]:
        pool = self.pools[pool_name]
        out = []
        seq = state.pool_seq.get(pool_name, 0)
        for i in range(n):
            node_id = f"{pool_name}-{seq + i:04d}"
            out.append(ctx.emit(NodeProvisionRequested(
                node_id=node_id, pool=pool_name, provider=pool.provider,
                inventory=pool_inventory(pool_name, pool, node_id), ready_after_s=pool.provision_delay_s,
                reason=reason, for_jobs=jobs[:64]), tenant=SYS_TENANT, key=f"provision:{node_id}"))
        return out

    def _give_up(self, state: AutoscalerState, now: float, ctx: Ctx) -> list[Envelope]:
        """Nodes asked for that have not registered within their pool's provisionTimeout, and
        nodes lost (no heartbeat) for as long: their removal is requested (the provider deletes
        whatever it made), so they stop counting as room coming and towards the pool's size, and
        the next tick may ask for another."""
        out: list[Envelope] = []
        count: dict[str, int] = {}
        for n in sorted(state.pool_nodes.values(), key=lambda n: n.node_id):
            pool = self.pools.get(n.pool)
            if pool is None or n.removal_requested or n.gone:
                continue
            if n.registered_s is None:
                waited, code, what = now - n.requested_s, "provision_timeout", "asked for {:.0f}s ago and never registered"
            elif n.lost and n.lost_s is not None:
                waited, code, what = now - n.lost_s, "lost", "lost {:.0f}s ago (no heartbeat) and not back"
            else:
                continue
            if waited < pool.give_up_after_s:
                continue
            have = count[n.pool] = count.get(n.pool, self._pool_count(state, n.pool)) - 1
            out.append(ctx.emit(NodeRemovalRequested(
                node_id=n.node_id, pool=n.pool, provider=n.provider, reason=Reason(
                    code=code, message=(
                        f"{what.format(waited)} (provisionTimeout {pool.give_up_after_s:.0f}s): given up; "
                        f"pool {n.pool} {have + 1} -> {have} node(s)"))),
                tenant=SYS_TENANT, key=f"remove:{n.node_id}"))
        return out

    # ------------------------------------------------------------ pools: down

    def idle_since(self, state: AutoscalerState, node_id: str, pool: NodePoolConfig) -> float | None:
        """Since when the node has been idle: nothing on it, or (idleWhen: gpus_idle) only jobs
        telemetry found idle. None: busy."""
        changed = state.changed_s.get(node_id, 0.0)
        on = state.on_node.get(node_id)
        if not on:
            return changed
        if pool.idle_when != "gpus_idle":
            return None
        # each run on it found idle on this node: an idle fact of an earlier attempt, or of another
        # node of a gang, says nothing about what runs here
        idle = [(run.idle or {}).get((held.attempt, node_id)) for run, held in (state.placed(j, r) for j, r in on)]
        if any(s is None for s in idle):
            return None
        return max(changed, *(s for s in idle if s is not None))

    def _scale_pools_down(self, state: AutoscalerState, now: float, ctx: Ctx,
                          taken_back: set[str | None]) -> list[Envelope]:
        out: list[Envelope] = []
        for name, pool in self.pools.items():
            nodes = sorted((n for n in state.pool_nodes.values()
                            if n.pool == name and not n.removal_requested and not n.gone),
                           key=lambda n: n.node_id, reverse=True)  # the newest go first
            keep = sum(1 for n in nodes if n.drained_by_us_s is None)
            for n in nodes:
                if n.registered_s is None or n.lost or n.node_id in taken_back:
                    continue
                if n.drained_by_us_s is not None:
                    if not state.on_node.get(n.node_id) and now - n.drained_by_us_s >= DRAIN_SETTLE_S:
                        out.append(ctx.emit(NodeRemovalRequested(
                            node_id=n.node_id, pool=name, provider=n.provider, reason=Reason(
                                code="idle", message=f"drained: nothing on it since it was cordoned "
                                                     f"{now - n.drained_by_us_s:.0f}s ago")),
                            tenant=SYS_TENANT, key=f"remove:{n.node_id}"))
                    continue
                since = self.idle_since(state, n.node_id, pool)
                if n.cordoned or since is None or now - since < pool.scale_down_after_s or keep <= pool.min:
                    continue
                keep -= 1
                what = "nothing placed on it" if not state.on_node.get(n.node_id) else "its jobs' GPUs idle"
                out.append(ctx.emit(NodeCordoned(node_id=n.node_id, reason=(
                    f"autoscaler: {what} for {now - since:.0f}s (pool {name} scaleDownAfter "
                    f"{pool.scale_down_after_s:.0f}s, {keep + 1} -> {keep} node(s), min {pool.min}); "
                    f"draining to remove it")), tenant=SYS_TENANT, key=f"drain:{n.node_id}:{since}"))
        return out


NODE_STATES = ("ready", "provisioning", "draining", "removing", "given_up", "cordoned", "lost")


def node_state(n: PoolNode) -> str:
    """One word for where a pool node is: provisioning, ready, draining, cordoned (by someone
    else), lost, given_up (never registered; its removal was asked for) or removing."""
    if n.removal_requested:
        return "given_up" if n.registered_s is None else "removing"
    if n.registered_s is None:
        return "provisioning"
    if n.lost:
        return "lost"
    if n.drained_by_us_s is not None:
        return "draining"
    return "cordoned" if n.cordoned else "ready"


def pool_summary(core: AutoscalerCore, state: AutoscalerState) -> list[dict[str, Any]]:
    """Each configured pool (and any pool the log names that the config no longer has): its nodes
    and their states, min, max and the autoscaler's latest decision about it (`gpufleet pools`)."""
    names = sorted(set(core.pools) | {n.pool for n in state.pool_nodes.values()} | set(state.pool_last))
    out: list[dict[str, Any]] = []
    for name in names:
        pool = core.pools.get(name)
        nodes = sorted((n for n in state.pool_nodes.values() if n.pool == name), key=lambda n: n.node_id)
        states = {n.node_id: node_state(n) for n in nodes}
        counts = {k: sum(1 for v in states.values() if v == k) for k in NODE_STATES}
        last = state.pool_last.get(name)
        out.append({
            "pool": name, "configured": pool is not None, "provider": pool.provider if pool else None,
            "shape": pool.shape.model_dump(by_alias=True) if pool else None,
            "min": pool.min if pool else None, "max": pool.max if pool else None, **counts,
            "nodes": [{"node_id": k, "state": v} for k, v in states.items()],
            "last_decision": None if last is None else {"at": last[0], "type": last[1], "node_id": last[2],
                                                        "reason": last[3]},
        })
    return out


def _metrics(svc: Service) -> str:
    a = svc.auto
    parts = []
    if svc.rps is not None:
        per = svc.rps / max(svc.desired, 1)
        parts.append(f"{svc.rps:g} req/s ({per:.1f} per replica"
                     + (f", target {a.target_rps_per_replica:g})" if a.target_rps_per_replica else ")"))
    if svc.p99_ms is not None:
        parts.append(f"p99 {svc.p99_ms:g} ms" + (f" (target {a.target_p99_ms:g})" if a.target_p99_ms else ""))
    return ", ".join(parts) or "no load reported"
