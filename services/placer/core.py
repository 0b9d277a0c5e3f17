"""Placer: give every replica of a job a node and exact GPUs, all or nothing, in one CAS write.

folds: nodes (inventory, topology, health, cached datasets), allocations, jobs with reserved quota
decides: job.placed (compare-and-set on `fleet.evt.*.job.*.placed`) | job.unschedulable (per-filter
         counts) | job.backfill_reserved | job.failed (never fits) | job.cancelled / job.preempted
         (of jobs it has not placed)

Placement runs the framework (framework.py): filter plugins, then score plugins with the weights
of the configured profile (`placement.profile`), over at most `placement.candidates` feasible
nodes taken from an index (GPU model -> free whole GPUs -> nodes, and the nodes with a partly
used GPU), tightest buckets first: a decision looks at a few buckets, not at every node.

Backfill: when one of the first `placement.reservations` waiting jobs (1: EASY; more:
conservative) does not fit, it gets a reservation — the nodes it would use once enough running
jobs end (placement time + estimated run: the max runtime, or for a job without one the longest
of the tenant's last similar completed runs, `runtime_estimate`), with the reservations ahead of
it holding theirs, and that estimated start — and any other job is placed only where every
reserved job still fits at its start, or if it ends (by its estimate) before that start.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from datetime import datetime
from itertools import islice

from gpufleet.shared.contract.clusterconfig import ClusterConfig
from gpufleet.shared.contract.events import (
    Envelope,
    JobBackfillReserved,
    JobCancelled,
    JobCancelRequested,
    JobExited,
    JobFailed,
    JobPlaced,
    JobPreempted,
    JobPreemptionRequested,
    JobQuotaReserved,
    JobResized,
    JobResumeRequested,
    JobSubmitted,
    JobUnschedulable,
    NodeCordoned,
    NodeDatasetsCached,
    NodeDeregistered,
    NodeGpuCleared,
    NodeGpuUnhealthy,
    NodeGpuZombieDetected,
    NodeInventory,
    NodeLost,
    NodeRegistered,
    NodeUncordoned,
    Reason,
    ReplicaAllocation,
    capacity_subject,
    resumed_attempt,
    utc,
)
from gpufleet.shared.contract.spec import TOPOLOGY_LEVELS, JobSpec
from gpufleet.shared.node.checkpoints import CHECKPOINTED_TYPES
from gpufleet.shared.node.cluster import pool_shapes
from gpufleet.shared.runtime.loop import BaseCore, Ctx
from gpufleet.shared.runtime.retention import EndedJobs

from .frag import ANY_MODEL, MILLI, TaskShape, typical_tasks
from .framework import LASTING_CONSTRAINTS, Ask, Context, Node, Profile, feasible, profiles, schedule, why_not

CPU_ONLY = ""  # the model key of nodes without GPUs
SCAN_NODES_MAX = 2048  # per replica: bound the work of one decision
RETRY_PENDING_MAX = 64  # pending jobs retried when capacity frees
SHAPES_KEPT = 4096  # recent job shapes: the workload the fragmentation-aware profiles aim at
TYPICAL_EVERY = 256  # recompute the typical shapes every this many new jobs
PREFERRED_TRIES = 4  # domains of a gang's preferred topology level tried whole before it spreads
RESERVATION_SLACK_S = 60.0  # a new estimate within this of the last is not said again
RESERVATION_REFRESH_S = 30.0  # the head's estimate is recomputed at most this often (it plans on every node)


@dataclass
class MigSlot:
    """A node's MIG instances: GPUs in MIG mode are never handed out whole; their instances are."""

    free: dict[str, list[str]] = field(default_factory=dict)  # profile -> free instance UUIDs
    total: dict[str, int] = field(default_factory=dict)  # profile -> instances
    profile: dict[str, str] = field(default_factory=dict)  # instance UUID -> profile


@dataclass
class Reservation:
    job_id: str
    nodes: tuple[str, ...]
    start_s: float
    said_s: float = 0.0  # when it was said: re-estimated at most every RESERVATION_REFRESH_S


class PlacerScratch:
    """What the placer derives from its state to decide faster: the typical workload and the
    plugins' score caches (`Context`, rebuilt every TYPICAL_EVERY new job shapes), `ever_fits` per
    (job, fleet version). Held by the state it derives from, so a state restored from a snapshot or
    a rollback point never reads caches keyed on another history's node versions; never stored (it
    pickles empty and is rebuilt on first use)."""

    __slots__ = ("typical_at", "ctx", "fits")

    def __init__(self) -> None:
        self.typical_at = -1
        self.ctx = Context()
        self.fits: dict[tuple[str, int], bool] = {}

    def __reduce__(self) -> tuple[type[PlacerScratch], tuple[()]]:
        return (PlacerScratch, ())


@dataclass(slots=True)
class PlacerJob:
    """Everything the placer knows of one job that has not ended: one record, forgotten at once when
    the job ends (`PlacerState.end`); a pending job costs one small record and shares its spec."""

    spec: JobSpec | None = None  # as placed: on the GPU model its quota was taken from
    attempt: int = 1  # resumed jobs run again
    requota: bool = False  # preempted, to run again: waits for quota first
    unschedulable_said: str | None = None  # the reasons last said (not said again while they hold)
    # what it holds now (None: nothing), the attempt that holds it and when that ends at the latest
    # (placed at + max runtime); kept by `PlacerState.hold` / `release`
    allocations: tuple[ReplicaAllocation, ...] | None = None
    alloc_attempt: int = 0
    ends_at: float = 0.0
    placed_attempt: int = 0  # the last attempt placed: its run's end is the guardian's to say
    cancel_asked: str | None = None  # cancelled while its run was the guardian's: never placed again
    # an elastic job: the size its next placement aims at (set by a resize; None: the largest that
    # fits), the size a resize asked that is not yet in effect, and the nodes of the replicas a
    # shrink keeps (tried first when it is placed again, so the room it left stays where the
    # waiting job was planned)
    target: int | None = None
    resizing: int | None = None
    keep_nodes: frozenset[str] | None = None


@dataclass
class PlacerState:
    nodes: dict[str, Node] = field(default_factory=dict)
    mig: dict[str, MigSlot] = field(default_factory=dict)  # nodes with MIG instances
    # model -> free whole GPUs -> node ids; model -> nodes with a partly used GPU (ordered sets)
    index: dict[str, dict[int, dict[str, None]]] = field(default_factory=dict)
    partial: dict[str, dict[str, None]] = field(default_factory=dict)
    jobs: dict[str, PlacerJob] = field(default_factory=dict)
    ended: EndedJobs = field(default_factory=EndedJobs)  # forgotten after a window of log time
    # indexes of `jobs`, kept by the methods below (and a node's entry dropped with the node): the
    # jobs waiting for nodes, oldest first; the jobs holding allocations (what `estimate` walks);
    # node -> jobs holding something there
    pending: OrderedDict[str, None] = field(default_factory=OrderedDict)
    placed: set[str] = field(default_factory=set)
    jobs_on: dict[str, set[str]] = field(default_factory=dict)
    reservations: dict[str, Reservation] = field(default_factory=dict)  # job -> its backfill reservation
    shapes: Counter[TaskShape] = field(default_factory=Counter)
    recent: deque[TaskShape] = field(default_factory=deque)
    shapes_seen: int = 0
    fleet_version: int = 0  # bumped when nodes join, leave, or change health: `ever_fits` holds until then
    inventories: dict[str, NodeInventory] = field(default_factory=dict)
    # node -> GPU index -> why it takes no new work (unhealthy, zombie memory, left unclean by a
    # job); `node.gpu_cleared` lifts zombie and unclean, never unhealthy, unless an operator
    # returned the GPU (`returned`: every reason)
    quarantined: dict[str, dict[int, set[str]]] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)
    cordoned: set[str] = field(default_factory=set)
    # (tenant, job name, GPUs a replica) -> the run times of its last completed runs, newest last:
    # what a job without a maxRuntime is estimated by (bounded: RUNTIME_KEYS keys, RUNTIME_RUNS each)
    runtimes: dict[tuple[str, str, int], tuple[float, ...]] = field(default_factory=dict)
    # the elastic jobs holding allocations -> (their placement's event id, its log time): the jobs a
    # shrink or a growth looks at (never the whole backlog)
    elastic: dict[str, tuple[str, float]] = field(default_factory=dict)
    scratch: PlacerScratch = field(default_factory=lambda: PlacerScratch(), compare=False, repr=False)

    def job(self, job_id: str) -> PlacerJob:
        rec = self.jobs.get(job_id)
        if rec is None:
            rec = self.jobs[job_id] = PlacerJob()
        return rec

    def end(self, job_id: str, at: datetime) -> None:
        """The job ended: remembered as ended for the window; what it held given back, its record
        and its place in every index forgotten now."""
        self.ended.add(job_id, at)
        self.unqueue(job_id)
        rec = self.jobs.pop(job_id, None)
        if rec is not None:
            self.release(job_id, rec)

    def queue(self, job_id: str) -> None:
        """The job waits for nodes (a job already waiting keeps its place)."""
        self.pending[job_id] = None

    def unqueue(self, job_id: str) -> None:
        """The job waits for nodes no more: the reservation held for it goes with it."""
        self.pending.pop(job_id, None)
        self.reservations.pop(job_id, None)

    def reserved(self) -> list[Reservation]:
        """The reservations of waiting jobs, in the order the jobs wait (oldest first)."""
        if not self.reservations:
            return []
        out = [self.reservations[j] for j in islice(self.pending, RETRY_PENDING_MAX) if j in self.reservations]
        if len(out) < len(self.reservations):  # (a reserved job further back: only after the config lowered K)
            seen = {r.job_id for r in out}
            out += [r for j, r in self.reservations.items() if j not in seen and j in self.pending]
        return out

    def hold(self, job_id: str, rec: PlacerJob, allocs: tuple[ReplicaAllocation, ...], attempt: int,
             ends_at: float) -> None:
        """The job placed: `allocs` taken on their nodes."""
        rec.allocations, rec.alloc_attempt, rec.ends_at = allocs, attempt, ends_at
        rec.placed_attempt = max(rec.placed_attempt, attempt)
        self.placed.add(job_id)
        for a in allocs:
            _take(self, a)
            self.jobs_on.setdefault(a.node_id, set()).add(job_id)

    def release(self, job_id: str, rec: PlacerJob, keep: tuple[ReplicaAllocation, ...] = ()) -> None:
        """What the job holds given back, but `keep` (one replica's exit frees that replica's
        resources only: the rest of a gang still runs)."""
        for a in rec.allocations or ():
            if a not in keep:
                _give_back(self, a)
                if not any(k.node_id == a.node_id for k in keep):
                    on = self.jobs_on.get(a.node_id)
                    if on is not None:
                        on.discard(job_id)
                        if not on:
                            del self.jobs_on[a.node_id]
        if keep:
            rec.allocations = keep
        else:
            rec.allocations, rec.alloc_attempt, rec.ends_at = None, 0, 0.0
            self.placed.discard(job_id)
            self.elastic.pop(job_id, None)

    def ending(self, now: float | None = None) -> list[tuple[float, str]]:
        """The jobs holding allocations, by when they are estimated to end, then id: a job with a
        maxRuntime at its limit; one without, at its placement plus the estimate from its similar
        runs (`runtime_estimate`) — or at its limit once it has run past that estimate."""
        out = []
        for j in self.placed:
            rec = self.jobs[j]
            end = rec.ends_at
            if rec.spec is not None and rec.spec.max_runtime_s is None:
                est, _ = runtime_estimate(self, rec.spec)
                learned = rec.ends_at - rec.spec.runtime_limit_s + est
                if now is None or learned > now:
                    end = learned
            out.append((end, j))
        out.sort()
        return out

    def learn_runtime(self, spec: JobSpec, runtime_s: float) -> None:
        key = runtime_key(spec)
        runs = self.runtimes.pop(key, ())
        self.runtimes[key] = (*runs[-(RUNTIME_RUNS - 1):], runtime_s)
        if len(self.runtimes) > RUNTIME_KEYS:
            del self.runtimes[next(iter(self.runtimes))]  # the least recently run kind


RUNTIME_RUNS = 5  # completed runs remembered per kind of job
RUNTIME_KEYS = 4096  # kinds of job remembered (the least recently completed forgotten first)
RUNTIME_MIN_RUNS = 2  # completed runs before an estimate is learned


def runtime_key(spec: JobSpec) -> tuple[str, str, int]:
    """Similar jobs: the tenant's jobs of the same name asking the same GPUs a replica."""
    return (spec.tenant, spec.name or "", spec.resources.gpu)


def runtime_estimate(state: PlacerState, spec: JobSpec) -> tuple[float, str]:
    """How long a run of the job is expected to take, and from what: its `maxRuntime` where it has
    one (a limit the executor enforces); else the longest of the tenant's last completed runs of
    similar jobs (at least RUNTIME_MIN_RUNS of them), capped at the 24 h limit; else that limit."""
    if spec.max_runtime_s is not None:
        return spec.max_runtime_s, "maxRuntime"
    runs = state.runtimes.get(runtime_key(spec), ())
    if len(runs) >= RUNTIME_MIN_RUNS:
        return min(spec.runtime_limit_s, max(runs)), f"the longest of {len(runs)} similar runs"
    return spec.runtime_limit_s, "the default limit (no maxRuntime, too few similar runs)"


# ---------------------------------------------------------------- node bookkeeping


def _unindex(state: PlacerState, node: Node) -> None:
    bucket = state.index.get(node.model, {}).get(node.free_whole)
    if bucket is not None:
        bucket.pop(node.node_id, None)
    state.partial.get(node.model, {}).pop(node.node_id, None)


def _reindex(state: PlacerState, node: Node) -> None:
    if node.healthy:
        state.index.setdefault(node.model, {}).setdefault(node.free_whole, {})[node.node_id] = None
        if any(0 < x < MILLI for x in node.left):
            state.partial.setdefault(node.model, {})[node.node_id] = None


def _positions(node: Node, gpu_indices: tuple[int, ...]) -> list[int]:
    return [node.gpu_ids.index(g) for g in gpu_indices if g in node.gpu_ids]


def with_flavor(spec: JobSpec, flavor: str | None) -> JobSpec:
    """The spec as placed once quota was taken from GPU model `flavor`: on that model only."""
    if flavor and spec.resources.gpu_models != (flavor,):
        return spec.model_copy(update={"resources": spec.resources.model_copy(update={"gpu_models": (flavor,)})})
    return spec


def _take(state: PlacerState, alloc: ReplicaAllocation) -> None:
    node = state.nodes.get(alloc.node_id)
    if node is None:
        return
    _unindex(state, node)
    node.take(_positions(node, alloc.gpu_indices), alloc.gpu_milli, alloc.cpu_milli, alloc.memory_mib)
    _take_mig(state.mig.get(alloc.node_id), alloc.mig_devices)
    _reindex(state, node)


def _take_mig(slot: MigSlot | None, uuids: tuple[str, ...]) -> None:
    if slot is None:
        return
    for uuid in uuids:
        profile = slot.profile.get(uuid)
        if profile is not None and uuid in slot.free[profile]:
            slot.free[profile].remove(uuid)


def _give_back(state: PlacerState, alloc: ReplicaAllocation) -> None:
    node = state.nodes.get(alloc.node_id)
    if node is None:
        return
    _unindex(state, node)
    node.give(_positions(node, alloc.gpu_indices), alloc.gpu_milli, alloc.cpu_milli, alloc.memory_mib)
    slot = state.mig.get(alloc.node_id)
    if slot is not None:
        for uuid in alloc.mig_devices:
            profile = slot.profile.get(uuid)
            if profile is not None and uuid not in slot.free[profile]:
                slot.free[profile].append(uuid)
    _reindex(state, node)


def _register(state: PlacerState, node_id: str, inv: NodeInventory) -> None:
    old = state.nodes.get(node_id)
    if old is not None:
        _unindex(state, old)
    state.inventories[node_id] = inv
    node = node_of(node_id, inv, state.quarantined.get(node_id, {}),
                   healthy=node_id not in state.lost and node_id not in state.cordoned,
                   datasets=old.datasets if old is not None else frozenset())
    state.nodes[node_id] = node
    slot = MigSlot()
    for g in inv.gpus:
        if g.mig_enabled:
            for m in g.mig_devices:
                slot.free.setdefault(m.profile, []).append(m.uuid)
                slot.total[m.profile] = slot.total.get(m.profile, 0) + 1
                slot.profile[m.uuid] = m.profile
    if slot.total:
        state.mig[node_id] = slot
    else:
        state.mig.pop(node_id, None)
    for job_id in sorted(state.jobs_on.get(node_id, ())):  # re-registration keeps what is already held
        for a in state.jobs[job_id].allocations or ():
            if a.node_id == node_id:
                node.take(_positions(node, a.gpu_indices), a.gpu_milli, a.cpu_milli, a.memory_mib)
                _take_mig(state.mig.get(node_id), a.mig_devices)
    _reindex(state, node)


def node_of(node_id: str, inv: NodeInventory, held: dict[int, set[str]] | None = None, healthy: bool = True,
            datasets: frozenset[str] = frozenset()) -> Node:
    """The placer's node for an inventory, empty (its quarantined GPUs `held` left out)."""
    held = held or {}
    whole = [g for g in inv.gpus if not g.mig_enabled and g.index not in held]
    models = sorted({g.model for g in inv.gpus})
    return Node(
        node_id=node_id, model=models[0] if models else CPU_ONLY, gpu_ids=[g.index for g in whole],
        left=[MILLI] * len(whole), cpu_left=inv.cpu_milli, mem_left=inv.memory_mib, cpu_total=inv.cpu_milli,
        mem_total=inv.memory_mib, gpu_mem_mib=min((g.memory_mib for g in whole), default=0),
        island=[g.nvlink_island for g in whole], switch=[g.pcie_switch for g in whole],
        numa=[g.numa_node for g in whole], labels=dict(inv.labels), taints=frozenset(inv.taints),
        healthy=healthy, datasets=datasets,
    )


def _deregister(state: PlacerState, node_id: str) -> None:
    """A node its pool's provider removed: gone from every book (its id is never reused)."""
    node = state.nodes.pop(node_id, None)
    if node is not None:
        _unindex(state, node)
    state.inventories.pop(node_id, None)
    state.mig.pop(node_id, None)
    state.quarantined.pop(node_id, None)
    state.lost.discard(node_id)
    state.cordoned.discard(node_id)
    state.jobs_on.pop(node_id, None)  # (whatever ran there was reported lost before it went)


def ask_of(spec: JobSpec) -> Ask:
    r = spec.resources
    return Ask(cpu=r.cpu_milli, mem=r.memory_mib, gpus=r.gpu, milli=r.gpu_milli if r.gpu else MILLI,
               models=frozenset(r.gpu_models), gpu_mem=r.gpu_memory_mib,
               selector=tuple(sorted(spec.node_selector.items())), tolerations=frozenset(spec.tolerations),
               dataset=spec.dataset)


def shape_of(spec: JobSpec) -> TaskShape:
    r = spec.resources
    models = frozenset(r.gpu_models) if r.gpu_models else ANY_MODEL
    return TaskShape(r.cpu_milli, r.gpu, r.gpu_milli if r.gpu else 0, models)


@dataclass
class Plan:
    """What the plans of one decision took so far: copies of the nodes they touched, MIG instances."""

    nodes: dict[str, Node] = field(default_factory=dict)
    mig_taken: dict[str, set[str]] = field(default_factory=dict)

    def node(self, state: PlacerState, node_id: str) -> Node:
        return self.nodes.get(node_id) or state.nodes[node_id]

    def fork(self) -> Plan:
        return Plan({k: v.copy() for k, v in self.nodes.items()}, {k: set(v) for k, v in self.mig_taken.items()})

    def give_back(self, state: PlacerState, allocs: tuple[ReplicaAllocation, ...]) -> None:
        """`allocs` end: give them back on this plan's copies of their nodes (and the MIG
        instances this plan took for them)."""
        for a in allocs:
            node = self.nodes.get(a.node_id)
            if node is None:
                real = state.nodes.get(a.node_id)
                if real is None:
                    continue
                node = self.nodes[a.node_id] = real.copy()
            node.give(_positions(node, a.gpu_indices), a.gpu_milli, a.cpu_milli, a.memory_mib)
            if a.mig_devices:
                self.mig_taken.get(a.node_id, set()).difference_update(a.mig_devices)


class PlacerCore(BaseCore[PlacerState]):
    name = "placer"
    state_format = 5  # 5: its guard names a sys.capacity_committed (it named a job.placed); 4: elastic jobs (`elastic`, PlacerJob.target/resizing/keep_nodes); 3: the run times of similar jobs (`runtimes`); 2: one record per job (`PlacerJob`) for the parallel maps keyed by job
    # A placement is published only if no other placer committed since this state: each commit
    # ends with a sys.capacity_committed on this literal subject (BaseCore.cas_marker).
    cas_subject = capacity_subject(name)
    cas_outputs = ("fleet.evt.*.job.*.placed",)
    cas_marker = True
    subjects = (
        cas_subject,
        "fleet.evt.sys.node.*.*",
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.quota_reserved", "fleet.evt.*.job.*.placed",
        "fleet.evt.*.job.*.unschedulable", "fleet.evt.*.job.*.exited", "fleet.evt.*.job.*.cancel_requested",
        "fleet.evt.*.job.*.preemption_requested", "fleet.evt.*.job.*.backfill_reserved",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.preempted", "fleet.evt.*.job.*.resume_requested", "fleet.evt.*.job.*.resized",
    )
    tick_s = 5.0  # elastic jobs grow into free capacity (only when some run below their max)

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self.placement = self.config.placement
        self.profile: Profile = profiles()[self.placement.profile]
        # node pools that may have nodes: (pool, max nodes, an empty node of its shape). A job only
        # a pool's shape can hold is not `never_fits`: it waits (unschedulable) and the pool grows.
        # Computed once per config; `ever_fits` alone reads it, and only when a job does not fit now.
        self.pools: tuple[tuple[str, int, Node], ...] = tuple(
            (name, self.config.node_pools[name].max, node_of(f"{name}-shape", inv))
            for name, inv in pool_shapes(self.config).items())

    def initial_state(self) -> PlacerState:
        return PlacerState()

    # ------------------------------------------------------------ evolve

    def evolve(self, state: PlacerState, env: Envelope) -> PlacerState:
        t = env.type
        p = env.payload
        if isinstance(p, NodeRegistered):
            state.lost.discard(p.node_id)  # a lost node registering again is back
            _register(state, p.node_id, p.inventory)
            state.fleet_version += 1
            return state
        if isinstance(p, NodeDeregistered):
            known = p.node_id in state.nodes
            _deregister(state, p.node_id)
            if known:
                state.fleet_version += 1
            return state
        if isinstance(p, NodeLost | NodeCordoned | NodeUncordoned):
            (state.lost if isinstance(p, NodeLost) else state.cordoned).add(p.node_id)
            if isinstance(p, NodeUncordoned):
                state.cordoned.discard(p.node_id)
            node = state.nodes.get(p.node_id)
            healthy = p.node_id not in state.lost and p.node_id not in state.cordoned
            if node is not None and node.healthy != healthy:
                _unindex(state, node)
                node.healthy = healthy
                _reindex(state, node)
                state.fleet_version += 1
            return state
        if isinstance(p, NodeGpuUnhealthy | NodeGpuZombieDetected | NodeGpuCleared):
            # quarantined: the GPU leaves the placer's view (no new work; what runs there keeps
            # going) until an occupancy check clears it
            why = (("returned" if p.returned else "cleared") if isinstance(p, NodeGpuCleared)
                   else p.type.removeprefix("node."))
            self._quarantine(state, p.node_id, (p.gpu_index,), why)
            return state
        if isinstance(p, NodeDatasetsCached):
            node = state.nodes.get(p.node_id)
            if node is not None:
                node.datasets = frozenset(p.datasets)
            return state
        job_id = env.job_id
        if job_id is None:
            return state
        if isinstance(p, JobSubmitted):
            if job_id not in state.ended:  # (a copy of an ended job's submission brings no record back)
                state.job(job_id).spec = p.spec
            shape = shape_of(p.spec)
            state.shapes[shape] += 1
            state.recent.append(shape)
            state.shapes_seen += 1
            if len(state.recent) > SHAPES_KEPT:
                old = state.recent.popleft()
                state.shapes[old] -= 1
                if state.shapes[old] <= 0:
                    del state.shapes[old]
        elif isinstance(p, JobQuotaReserved):
            rec0 = state.jobs.get(job_id)
            if rec0 is not None:
                rec0.requota = False
            if job_id not in state.ended and (rec0 is None or rec0.allocations is None):
                rec = state.job(job_id)
                state.queue(job_id)
                if rec.spec is not None:
                    # quota was taken from this GPU model: place on it, or quota and placement disagree
                    rec.spec = with_flavor(rec.spec, p.flavor)
        elif isinstance(p, JobCancelRequested):
            rec0 = state.jobs.get(job_id)
            if rec0 is not None:
                rec0.cancel_asked = p.reason
        elif isinstance(p, JobUnschedulable):
            if job_id in state.pending:
                state.jobs[job_id].unschedulable_said = "; ".join(r.message for r in p.reasons)
        elif isinstance(p, JobBackfillReserved):
            if job_id in state.pending:
                state.reservations[job_id] = Reservation(job_id, p.nodes, p.estimated_start.timestamp(),
                                                         env.occurred_at.timestamp())
        elif isinstance(p, JobPlaced):
            if job_id in state.ended:
                return state
            rec = state.job(job_id)
            if rec.allocations is not None or p.attempt < rec.attempt:
                return state
            state.unqueue(job_id)
            rec.unschedulable_said = None
            state.hold(job_id, rec, p.allocations, p.attempt,
                       env.occurred_at.timestamp() + (rec.spec.runtime_limit_s if rec.spec else 86400.0))
            rec.target = rec.resizing = rec.keep_nodes = None
            if rec.spec is not None and rec.spec.elastic is not None:
                state.elastic[job_id] = (env.event_id, env.occurred_at.timestamp())
        elif isinstance(p, JobResized):
            rec0 = state.jobs.get(job_id)
            if rec0 is not None and rec0.allocations is not None and rec0.alloc_attempt == p.attempt:
                rec0.resizing = p.to_replicas
                rec0.keep_nodes = frozenset(a.node_id for a in rec0.allocations if a.replica < p.to_replicas) \
                    if p.to_replicas < p.from_replicas else None
        elif isinstance(p, JobResumeRequested):
            rec0 = state.jobs.get(job_id)
            nxt = resumed_attempt(rec0.attempt if rec0 is not None else 1, p)
            if job_id in state.ended or nxt is None:  # (a copy of an old resume changes nothing)
                return state
            rec = state.job(job_id)
            rec.attempt = nxt
            if p.reason.code == "resized" and rec.resizing is not None:
                rec.target = rec.resizing  # placed again at the size the resize asked
            rec.resizing = None
            # after a preemption the job waits for quota again (job.quota_reserved makes it pending);
            # after a failure it kept its quota and is placed again as soon as its old run is gone
            if p.reason.code == "preempted":
                rec.requota = True
                state.unqueue(job_id)  # its quota is taken back
            elif not rec.allocations:
                state.queue(job_id)
        elif t in ("job.succeeded", "job.failed", "job.cancelled", "job.preempted"):
            state.end(job_id, env.occurred_at)
        elif isinstance(p, JobExited):
            rec0 = state.jobs.get(job_id)
            # the exit of another attempt than the one holding GPUs now (a late report from a node
            # that was lost) frees nothing, but its leftovers are still quarantined
            if rec0 is not None and rec0.spec is not None and p.reason == "completed" and p.runtime_s > 0:
                state.learn_runtime(rec0.spec, p.runtime_s)
            if rec0 is not None and (rec0.allocations is None or p.attempt == rec0.alloc_attempt):
                state.release(job_id, rec0, tuple(a for a in rec0.allocations or () if a.replica != p.replica))
                if (rec0.allocations is None and p.attempt < rec0.attempt and job_id not in state.ended
                        and job_id not in state.pending and not rec0.requota):
                    state.queue(job_id)  # the last replica of a resumed job's old attempt is gone
                    if rec0.target is not None:
                        # a resized job is placed again first (a shrunk one on the nodes it kept: the
                        # job it made room for was planned beside those replicas): the quota of its
                        # min is still its own
                        state.pending.move_to_end(job_id, last=False)
            if p.unclean_gpus:
                self._quarantine(state, p.node_id, p.unclean_gpus, "unclean")
        return state

    def _quarantine(self, state: PlacerState, node_id: str, gpus: tuple[int, ...], why: str) -> None:
        held = state.quarantined.setdefault(node_id, {})
        for g in gpus:
            if why in ("cleared", "returned"):
                left = set() if why == "returned" else held.get(g, set()) - {"gpu_zombie_detected", "unclean"}
                if left:
                    held[g] = left
                else:
                    held.pop(g, None)
            else:
                held.setdefault(g, set()).add(why)
        if not held:
            state.quarantined.pop(node_id, None)
        inv = state.inventories.get(node_id)
        if inv is not None:
            _register(state, node_id, inv)
            state.nodes[node_id].version += 1
            state.fleet_version += 1

    # ------------------------------------------------------------ decide

    def decide(self, state: PlacerState, env: Envelope, ctx: Ctx) -> list[Envelope]:
        t, p = env.type, env.payload
        if isinstance(p, JobCancelRequested):
            job_id = p.job_id
            rec = state.jobs.get(job_id)
            if (rec is not None and rec.spec is not None and rec.allocations is None and job_id not in state.ended
                    and rec.placed_attempt < rec.attempt):
                # its attempt never placed (and, placements being ours alone, it never will be):
                # cancelled here. One that ran and exited holds nothing either, but its end is the
                # guardian's (it may be deciding a success right now): a second end would be told.
                return [ctx.emit(JobCancelled(job_id=job_id, reason=p.reason), key="cancelled")]
            return []  # placed: the executor stops it, the guardian ends it
        if isinstance(p, JobPreemptionRequested):
            job_id = p.job_id
            rec = state.jobs.get(job_id)
            if rec is not None and rec.spec is not None and rec.allocations is None and job_id not in state.ended:
                if rec.spec.type in CHECKPOINTED_TYPES:  # not started: it simply waits for quota again
                    return [ctx.emit(JobResumeRequested(job_id=job_id, attempt=rec.attempt + 1,
                                                        reason=Reason(
                        code="preempted", message=f"{p.reason.message}; not placed yet, it waits for quota again")),
                        key="preempted")]
                return [ctx.emit(JobPreempted(job_id=job_id, reason=p.reason), key="preempted")]
            return []
        self._refresh_typical(state)
        now = ctx.now.timestamp()
        if isinstance(p, JobQuotaReserved):
            job_id = p.job_id
            if job_id in state.pending:
                return self._try(state, job_id, ctx, Plan(), now, say_unschedulable=True)
            return []
        if isinstance(p, JobResumeRequested) and p.job_id in state.pending:
            return self._try(state, p.job_id, ctx, Plan(), now, say_unschedulable=True)
        if t in ("job.exited", "job.succeeded", "job.failed", "job.cancelled", "job.preempted",
                 "node.registered", "node.uncordoned", "node.gpu_cleared"):
            out: list[Envelope] = []
            plan = Plan()  # what earlier plans in this decision took
            # the oldest few: a copy of the first RETRY_PENDING_MAX, not of the whole backlog (a
            # list of every pending job at every job's end made each end dearer as the backlog grew)
            for job_id in list(islice(state.pending, RETRY_PENDING_MAX)):
                out.extend(self._try(state, job_id, ctx, plan, now, say_unschedulable=False))
            return out
        return []

    def _refresh_typical(self, state: PlacerState) -> None:
        at = state.shapes_seen // TYPICAL_EVERY
        scratch = state.scratch
        if at != scratch.typical_at:
            scratch.typical_at = at
            shapes = tuple(state.recent)
            scratch.ctx = Context(typical=typical_tasks(shapes), shapes=shapes)

    def _try(self, state: PlacerState, job_id: str, ctx: Ctx, plan: Plan, now: float,
             say_unschedulable: bool) -> list[Envelope]:
        rec = state.jobs.get(job_id)
        if rec is None or rec.spec is None:
            return []
        spec = rec.spec
        if rec.cancel_asked is not None and rec.allocations is None:
            # asked to cancel while its run was ending (the guardian resumed it after): it ends here
            return [ctx.emit(JobCancelled(job_id=job_id, reason=rec.cancel_asked), tenant=spec.tenant, key="cancelled")]
        trial, allocs, spec = self._sized_plan(state, rec, spec, plan)
        reserved = state.reserved() if self.placement.backfill else []
        if allocs is not None and reserved:
            # backfill: a job that runs past a reserved start must leave that job room at its start.
            # Checked wherever it lands, not only on the reserved nodes: once a backfill job took
            # part of a reserved node, the head's start may rest on other nodes than those it was
            # reserved on (the property test found a second job taking them unchecked)
            blocked = self._delays(state, reserved, job_id, spec, trial, now)
            if blocked is not None:
                # keep off the nodes of every reservation (a job on GPUs of reserved nodes that
                # no reserved job needs passed above)
                trial = plan.fork()
                allocs = self.plan(state, spec, trial, avoid=frozenset(n for r in reserved for n in r.nodes))
                if allocs is None or self._delays(state, reserved, job_id, spec, trial, now) is not None:
                    # it would delay a reserved job: it waits, and says so (once per reservation)
                    return self._backfill_wait(state, job_id, spec, blocked, ctx)
        if allocs is not None:
            plan.nodes, plan.mig_taken = trial.nodes, trial.mig_taken
            # The runtime evolves this output at once, so the next decision sees the GPUs taken.
            attempt = rec.attempt
            key = f"placed:{job_id}" + (f":{attempt}" if attempt > 1 else "")
            return [ctx.emit(JobPlaced(job_id=job_id, allocations=allocs, attempt=attempt), tenant=spec.tenant, key=key)]
        out: list[Envelope] = []
        if state.nodes and not self._ever_fits_cached(state, job_id, spec):
            # Quota and placement must agree: a job no healthy node set could ever hold must not
            # keep its quota (and block others) while it waits; it fails, and says why.
            return [ctx.emit(JobFailed(job_id=job_id, reason=Reason(code="never_fits", message=(
                f"{spec.replicas} x {_ask(spec)} ({', '.join(spec.resources.gpu_models) or 'any model'}) cannot "
                f"fit{_within(spec)} even on the empty cluster of {len(state.nodes) - len(state.cordoned)} nodes "
                "not cordoned"
                + (f" nor on nodes its pools may add ({', '.join(f'{n} up to {m}' for n, m, _ in self.pools)})"
                   if self.pools else "")))),
                tenant=spec.tenant, key=f"never:{job_id}")]
        if state.elastic:
            room = self._make_room(state, job_id, spec, plan, ctx)
            if room is not None:
                return room  # elastic jobs give back replicas above their min (or are doing so) for it
        if self.placement.backfill and state.nodes:
            out += self._reserve(state, job_id, spec, ctx, now)
        if not say_unschedulable:
            return out  # a retry that still does not fit: the reason was said when it first failed
        reasons = self._reasons(state, job_id, spec)
        filtered = self._filtered(state, spec)
        message = "; ".join(r.message for r in reasons)
        if rec.unschedulable_said == message:
            return out
        return out + [ctx.emit(JobUnschedulable(
            job_id=job_id, reasons=tuple(reasons), filtered=filtered, nodes_total=len(state.nodes),
        ), tenant=spec.tenant, key=f"unsched:{job_id}:{len(state.nodes)}:{message}")]

    # ------------------------------------------------------------ elastic jobs

    def _sized_plan(self, state: PlacerState, rec: PlacerJob, spec: JobSpec, plan: Plan,
                    ) -> tuple[Plan, tuple[ReplicaAllocation, ...] | None, JobSpec]:
        """The job's replicas on a fork of `plan`, and the spec as placed. An elastic job: the
        largest of its sizes up to its target (a resize's) that fits now, a shrunk one first on the
        nodes it kept; none fits: the spec at its min (what it waits for)."""
        if spec.elastic is None:
            trial = plan.fork()
            return trial, self.plan(state, spec, trial), spec
        sizes = [n for n in reversed(spec.sizes) if rec.target is None or n <= rec.target]
        if rec.keep_nodes is not None and sizes:
            trial = plan.fork()
            allocs = self._plan(state, spec.sized(sizes[0]), trial, within=rec.keep_nodes)
            if allocs is not None:
                return trial, allocs, spec.sized(sizes[0])
        for n in sizes:
            trial = plan.fork()
            allocs = self.plan(state, spec.sized(n), trial)
            if allocs is not None:
                return trial, allocs, spec.sized(n)
        return plan.fork(), None, spec

    def _elastic_running(self, state: PlacerState) -> list[tuple[str, PlacerJob, JobSpec, int]]:
        """The elastic jobs holding allocations for their current run: (id, record, spec, replicas
        now), lowest priority first, then the most recently placed. (A run being stopped for a
        resume, its replicas exiting one by one, is not one: it is neither shrunk nor grown again.)"""
        out = []
        for job_id, (_, at) in state.elastic.items():
            rec = state.jobs.get(job_id)
            if rec is not None and rec.spec is not None and rec.allocations and rec.attempt == rec.alloc_attempt:
                out.append((rec.spec.priority, -at, job_id, rec))
        out.sort(key=lambda x: (x[0], x[1], x[2]))
        return [(j, r, r.spec, len(r.allocations or ())) for _, _, j, r in out if r.spec is not None]

    def _make_room(self, state: PlacerState, job_id: str, spec: JobSpec, plan: Plan,
                   ctx: Ctx) -> list[Envelope] | None:
        """A job holding quota that does not fit: the fewest replicas above their min that elastic
        jobs give back to make room for it (lowest priority first, then the most recently placed),
        as `job.resized` (shrink) events; [] while resizes asked before already make room (it waits
        for them); None when even every elastic job at its min leaves it no room (nothing is asked)."""
        running = [r for r in self._elastic_running(state) if r[0] != job_id and r[3] > r[2].replicas]
        if not running:
            return None  # (no elastic job runs above its min: nothing to give back)
        trial = plan.fork()
        for other in state.elastic:  # runs stopping for a resize free what the next run will not take
            rec = state.jobs.get(other)
            if rec is not None and rec.target is not None and rec.attempt != rec.alloc_attempt:
                trial.give_back(state, tuple(a for a in rec.allocations or () if a.replica >= (rec.target or 0)))
        for other, rec, _, size in running:  # resizes already asked free what they drop
            if other != job_id and rec.resizing is not None and rec.resizing < size:
                trial.give_back(state, tuple(a for a in rec.allocations or () if a.replica >= rec.resizing))
        if trial.nodes and self.plan(state, spec, trial.fork()) is not None:
            return []
        asked: list[tuple[str, PlacerJob, int, int]] = []
        for other, rec, espec, size in running:
            if other == job_id or rec.resizing is not None or size <= espec.replicas:
                continue
            smaller = [n for n in espec.sizes if n < size]  # ascending
            fit_at = None
            for n in reversed(smaller):  # the least it gives back first
                attempt = trial.fork()
                attempt.give_back(state, tuple(a for a in rec.allocations or () if a.replica >= n))
                if self.plan(state, spec, attempt.fork()) is not None:
                    fit_at = n
                    break
            n = fit_at if fit_at is not None else smaller[0]
            trial.give_back(state, tuple(a for a in rec.allocations or () if a.replica >= n))
            asked.append((other, rec, size, n))
            if fit_at is not None:
                return [ctx.emit(JobResized(
                    job_id=o, from_replicas=frm, to_replicas=to, attempt=r.alloc_attempt, for_job=job_id,
                    reason=Reason(code="shrink", message=(
                        f"{frm} -> {to} replicas: {job_id} holds quota and needs the room of its replicas above "
                        f"{to} (an elastic job's replicas above its min are best effort)"))),
                    tenant=r.spec.tenant if r.spec else None, cause_id=state.elastic[o][0],
                    key=f"resize:{r.alloc_attempt}") for o, r, frm, to in asked]
        return None

    def tick(self, state: PlacerState, ctx: Ctx) -> list[Envelope]:
        """An elastic job below its max grows, one a tick, into capacity nothing waiting needs
        (no job waits for nodes), once it ran `placement.elasticGrowAfter` at its size."""
        if not state.elastic or state.pending:
            return []
        now = ctx.now.timestamp()
        for job_id, rec, spec, size in reversed(self._elastic_running(state)):  # the highest priority first
            placed_id, at = state.elastic[job_id]
            if rec.resizing is not None or spec.elastic is None or size >= spec.elastic.max \
                    or now - at < self.placement.elastic_grow_after_s:
                continue
            trial = Plan()
            trial.give_back(state, rec.allocations or ())
            for n in reversed(spec.sizes):
                if n <= size:
                    break
                if self.plan(state, spec.sized(n), trial.fork()) is not None:
                    return [ctx.emit(JobResized(
                        job_id=job_id, from_replicas=size, to_replicas=n, attempt=rec.alloc_attempt,
                        reason=Reason(code="grow", message=(
                            f"{size} -> {n} replicas: free capacity no waiting job needs (after "
                            f"{now - at:.0f} s at {size})"))),
                        tenant=spec.tenant, cause_id=placed_id, key=f"resize:{rec.alloc_attempt}")]
        return []

    # ------------------------------------------------------------ backfill

    def _delays(self, state: PlacerState, reserved: list[Reservation], job_id: str, spec: JobSpec,
                trial: Plan, now: float) -> Reservation | None:
        """The first reservation (of another job) that `trial`, holding the job being tried, would
        delay: the job runs past its start and the reserved job no longer fits there then."""
        for i, res in enumerate(reserved):
            if res.job_id != job_id and now + runtime_estimate(state, spec)[0] > res.start_s \
                    and not self._fits_at_start(state, [r for r in reserved[:i] if r.job_id != job_id], res, trial, now):
                return res
        return None

    def _fits_at_start(self, state: PlacerState, ahead: list[Reservation], res: Reservation, trial: Plan,
                       now: float) -> bool:
        """Whether the reserved job still fits at its estimated start with `trial` holding what it
        holds: the jobs that end by then give their GPUs back and the reserved jobs ahead of it
        that still run then hold theirs, as its estimate counted them. A reservation so holds the
        GPUs, cores and memory the job needs, not whole nodes: a backfill job on the rest of a
        reserved node delays nothing."""
        head = state.jobs.get(res.job_id)
        if head is None or head.spec is None:
            return False
        at_start = trial.fork()
        for end_s, job_id in state.ending(now):
            if end_s > res.start_s:
                break
            at_start.give_back(state, state.jobs[job_id].allocations or ())
        for r in ahead:
            before = state.jobs.get(r.job_id)
            if before is None or before.spec is None or r.start_s + runtime_estimate(state, before.spec)[0] <= res.start_s:
                continue
            if self.plan(state, before.spec, at_start, full_scan=True) is None:
                return False
        topo = head.spec.topology
        if topo is None or (topo.required is None and topo.preferred is None):
            # first on the nodes it was reserved on (a few, not the whole fleet): where it usually still fits
            if self._plan(state, head.spec, at_start.fork(), full_scan=True, within=frozenset(res.nodes)) is not None:
                return True
        return self.plan(state, head.spec, at_start, full_scan=True) is not None

    def _backfill_wait(self, state: PlacerState, job_id: str, spec: JobSpec, res: Reservation,
                       ctx: Ctx) -> list[Envelope]:
        """`job.unschedulable` for a job that fits now only where a reserved job needs room at its start."""
        # (the reservation's estimated start is not in the message: it moves as running jobs are
        # re-estimated, and each move would tell every held job again; `explain` shows it)
        est, source = runtime_estimate(state, spec)
        reason = Reason(code="backfill_reservation", message=(
            f"it fits now only on nodes held for {res.job_id} ({', '.join(res.nodes)}); expected to run "
            f"{est:.0f} s ({source}), it would delay that job's start (backfill)"))
        if state.jobs[job_id].unschedulable_said == reason.message:
            return []
        return [ctx.emit(JobUnschedulable(job_id=job_id, reasons=(reason,),
                                          filtered={"backfill_reservation": len(res.nodes)},
                                          nodes_total=len(state.nodes)),
                         tenant=spec.tenant, key=f"unsched:{job_id}:backfill:{res.job_id}:{','.join(res.nodes)}")]

    def _reserve(self, state: PlacerState, job_id: str, spec: JobSpec, ctx: Ctx, now: float) -> list[Envelope]:
        """Reserve for one of the first `placement.reservations` waiting jobs: nodes and an
        estimated start, with the reservations ahead of it holding what they need."""
        first = list(islice(state.pending, self.placement.reservations))
        if job_id not in first:
            return []
        reserved = state.reserved()
        res = state.reservations.get(job_id)
        if res is None and len(reserved) >= self.placement.reservations:
            return []  # (all taken: by jobs now further back, only after the config lowered K)
        if res is not None and now - res.said_s < RESERVATION_REFRESH_S:
            return []  # said lately: planning on every node again on every event would stall the placer
        ahead = [r for r in reserved if r.job_id in first[:first.index(job_id)]]
        est = self.estimate(state, spec, now, ahead)
        if est is None:
            return []
        start, nodes = est
        if res is not None and res.nodes == nodes and abs(res.start_s - start) < RESERVATION_SLACK_S:
            return []
        runtime_s, runtime_from = runtime_estimate(state, spec)
        after = next((j for end_s, j in state.ending(now) if abs(end_s - start) < 1e-6), None)
        after_spec = state.jobs[after].spec if after is not None else None
        return [ctx.emit(JobBackfillReserved(
            job_id=job_id, nodes=nodes, estimated_start=utc(start), runtime_s=runtime_s, runtime_from=runtime_from,
            after_job=after, after_from=runtime_estimate(state, after_spec)[1] if after_spec is not None else None,
        ), tenant=spec.tenant, key=f"reserve:{job_id}:{int(start)}:{','.join(nodes)}")]

    def estimate(self, state: PlacerState, spec: JobSpec, now: float,
                 ahead: list[Reservation] | None = None) -> tuple[float, tuple[str, ...]] | None:
        """When the job could start, and on which nodes, if running jobs end at their max runtime
        and the reserved jobs `ahead` of it start at their estimated starts (it starts no earlier
        than the last of them, and beside those still running then).

        The first time it fits is found by doubling then bisecting over the times something ends:
        a few plans, not one per running job."""
        ending = state.ending(now)
        held: list[tuple[float, float, JobSpec]] = []  # (start, end, spec) of the reserved jobs ahead
        for r in ahead or ():
            rec = state.jobs.get(r.job_id)
            if rec is not None and rec.spec is not None:
                held.append((r.start_s, r.start_s + runtime_estimate(state, rec.spec)[0], rec.spec))
        floor = max([now] + [h[0] for h in held])
        times = sorted({floor} | {e for e, _ in ending if e > floor} | {h[1] for h in held if h[1] > floor})

        def at(t: float) -> tuple[ReplicaAllocation, ...] | None:
            plan = Plan()
            for end_s, job_id in ending:
                if end_s > t:
                    break
                plan.give_back(state, state.jobs[job_id].allocations or ())
            for _, end_s, s in held:
                if end_s > t and self.plan(state, s, plan, full_scan=True) is None:
                    return None
            return self.plan(state, spec, plan, full_scan=True)

        if not ending and not held:
            return None
        # (the first time is `now` only when something ahead holds it back or a run is overdue:
        # the job was tried now and did not fit)
        hi = 0 if held or (ending and ending[0][0] <= now) else 1
        hi = min(hi, len(times) - 1)
        step = 1
        while hi < len(times) - 1 and at(times[hi]) is None:
            hi = min(hi + step, len(times) - 1)
            step *= 2
        allocs = at(times[hi])
        if allocs is None:
            return None
        lo = hi - step // 2 if step > 1 else hi - 1  # at(times[lo]) did not fit (or lo < 0)
        lo = max(lo, -1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            got = at(times[mid])
            if got is None:
                lo = mid
            else:
                hi, allocs = mid, got
        return times[hi], tuple(sorted({a.node_id for a in allocs}))

    # ------------------------------------------------------------ planning

    def plan(self, state: PlacerState, spec: JobSpec, plan: Plan, avoid: frozenset[str] = frozenset(),
             full_scan: bool = False) -> tuple[ReplicaAllocation, ...] | None:
        """All replicas or nothing, on `plan` (copies of the nodes it touches); None if they do not fit.
        With a required topology level, all within one domain of it: the domains that could hold
        the gang now are tried tightest first (the least room left over), and the first that
        takes it wins (Kueue's required topology picks the same way; not the first domain found)."""
        topo = spec.topology
        required = topo.required if topo is not None else None
        preferred = topo.preferred if topo is not None and spec.replicas > 1 and topo.preferred != required else None
        if required is None and preferred is None:
            return self._plan(state, spec, plan, avoid, full_scan)
        outer: list[frozenset[str] | None] = [None] if required is None else [
            m for _, _, m in self.domains(state, spec, required, plan, avoid)]
        for members in outer:
            tries: list[frozenset[str] | None] = []
            if preferred is not None:  # the whole gang within one domain of the preferred level, if one holds it
                tries += [m for _, _, m in self.domains(state, spec, preferred, plan, avoid, members)[:PREFERRED_TRIES]]
            tries.append(members)  # else anywhere in the required domain (None: anywhere), close where it can
            for within in tries:
                trial = plan.fork()
                got = self._plan(state, spec, trial, avoid, full_scan or within is not None, within)
                if got is not None:
                    plan.nodes, plan.mig_taken = trial.nodes, trial.mig_taken
                    return got
        return None

    def domains(self, state: PlacerState, spec: JobSpec, level: str, plan: Plan | None = None,
                avoid: frozenset[str] = frozenset(), within: frozenset[str] | None = None,
                ) -> list[tuple[int, str, frozenset[str]]]:
        """The domains of `level` (among the nodes `within`) with room for every replica now, by
        replica slots counted node by node (GPUs, cores, memory, MIG instances): (slots left over,
        domain, its nodes), the tightest first. One pass over the nodes: a topology-bound gang only."""
        slots, members = self._room(state, spec, level, plan or Plan(), avoid, within)
        return sorted((n - spec.replicas, d, frozenset(members[d])) for d, n in slots.items() if n >= spec.replicas)

    def _room(self, state: PlacerState, spec: JobSpec, level: str, plan: Plan, avoid: frozenset[str] = frozenset(),
              within: frozenset[str] | None = None) -> tuple[dict[str, int], dict[str, list[str]]]:
        """Replica slots free now per domain of `level`, and each domain's nodes."""
        a = ask_of(spec)
        slots: dict[str, int] = {}
        members: dict[str, list[str]] = {}
        for node_id in state.nodes if within is None else sorted(within):
            node = plan.node(state, node_id)
            d = node.domain(level)
            if not d or node_id in avoid:
                continue
            members.setdefault(d, []).append(node_id)
            slots[d] = slots.get(d, 0) + (self._slots(state, node, a, spec, plan) if feasible(node, a) else 0)
        return slots, members

    @staticmethod
    def _slots(state: PlacerState, node: Node, a: Ask, spec: JobSpec, plan: Plan) -> int:
        r = spec.resources
        per = [node.cpu_left // a.cpu if a.cpu else spec.replicas, node.mem_left // a.mem if a.mem else spec.replicas]
        if a.gpus:
            units = sum(x // a.milli for x in node.left) if a.milli < MILLI else node.free_whole
            per.append(units // a.gpus)
        if r.mig:
            slot = state.mig.get(node.node_id)
            taken = plan.mig_taken.get(node.node_id, set())
            per += [len([u for u in (slot.free.get(p, ()) if slot else ()) if u not in taken]) // n
                    for p, n in r.mig.items()]
        return max(0, min(per))

    def _plan(self, state: PlacerState, spec: JobSpec, plan: Plan, avoid: frozenset[str] = frozenset(),
              full_scan: bool = False, within: frozenset[str] | None = None) -> tuple[ReplicaAllocation, ...] | None:
        a = ask_of(spec)
        r = spec.resources
        allocs: list[ReplicaAllocation] = []
        ctx = state.scratch.ctx
        ctx.gang = {}
        ctx.prefer = spec.topology.preferred if spec.topology is not None and spec.topology.preferred else "leaf"
        ctx.rng.seed(state.shapes_seen)  # ties drawn from the state alone: any replica, any restart
        for replica in range(spec.replicas):
            if r.mig:
                got = self._pick_mig(state, a, r.mig, plan, avoid, within)
                if got is None:
                    return None
                node_id, uuids = got
                if node_id not in plan.nodes:
                    plan.nodes[node_id] = state.nodes[node_id].copy()
                plan.nodes[node_id].take((), 0, a.cpu, a.mem)
                plan.mig_taken.setdefault(node_id, set()).update(uuids)
                allocs.append(ReplicaAllocation(replica=replica, node_id=node_id, cpu_milli=a.cpu,
                                                memory_mib=a.mem, mig_devices=tuple(uuids)))
                continue
            cands = self.candidates(state, a, plan, avoid, full_scan, within)
            pick = schedule(cands, a, self.profile, ctx, filtered=True)  # (candidates() filtered them)
            if pick is None:
                return None
            if pick.node.node_id not in plan.nodes:
                plan.nodes[pick.node.node_id] = pick.node.copy()
            node = plan.nodes[pick.node.node_id]
            node.take(pick.positions, a.milli if a.gpus else 0, a.cpu, a.mem)
            for level in TOPOLOGY_LEVELS:
                key = (level, node.domain(level))
                ctx.gang[key] = ctx.gang.get(key, 0) + 1
            numas = [node.numa[i] for i in pick.positions if i < len(node.numa)]
            allocs.append(ReplicaAllocation(
                replica=replica, node_id=node.node_id, gpu_indices=tuple(node.gpu_ids[i] for i in pick.positions),
                cpu_milli=a.cpu, memory_mib=a.mem, gpu_milli=a.milli if a.gpus else MILLI,
                numa_node=max(set(numas), key=numas.count) if numas else 0,
            ))
        ctx.gang = {}
        return tuple(allocs)

    def candidates(self, state: PlacerState, a: Ask, plan: Plan, avoid: frozenset[str] = frozenset(),
                   full_scan: bool = False, within: frozenset[str] | None = None) -> list[Node]:
        """Up to `placement.candidates` feasible nodes, tightest first (nodes this decision touched
        first); only those of `within` when given (a required topology's domain)."""
        limit = len(state.nodes) if full_scan else self.placement.candidates
        if within is not None:  # (a topology domain: its own nodes, touched first, then the fewest GPUs free)
            nodes = [plan.node(state, n) for n in sorted(within) if n not in avoid]
            nodes = [n for n in nodes if feasible(n, a)]
            nodes.sort(key=lambda n: (n.node_id not in plan.nodes, n.free_whole))
            return nodes[:limit]
        out: list[Node] = []
        seen: set[str] = set()
        for node in plan.nodes.values():  # packs, keeps a gang together
            if node.node_id not in avoid and feasible(node, a):
                out.append(node)
                seen.add(node.node_id)
        models = sorted(a.models) if a.models else sorted(m for m in state.index if m != CPU_ONLY)
        order: list[dict[str, None]] = []
        if not a.gpus:
            order += [b for _, b in sorted(state.index.get(CPU_ONLY, {}).items())]  # CPU-only nodes first
            for m in models:  # then GPU nodes, those with the fewest free GPUs first
                order += [b for _, b in sorted(state.index.get(m, {}).items())]
        else:
            for m in models:
                if a.milli < MILLI:
                    order.append(state.partial.get(m, {}))
                order += [b for k, b in sorted(state.index.get(m, {}).items()) if k >= (1 if a.milli < MILLI else a.gpus)]
        scanned = 0
        for bucket in order:
            for node_id in bucket:
                if node_id in seen or node_id in avoid:
                    continue
                seen.add(node_id)
                node = plan.node(state, node_id)
                scanned += 1
                if feasible(node, a):
                    out.append(node)
                    if len(out) >= limit:
                        return out
                if scanned > max(SCAN_NODES_MAX, limit) and out:
                    return out
        return out

    def _pick_mig(self, state: PlacerState, a: Ask, mig: dict[str, int], plan: Plan,
                  avoid: frozenset[str], within: frozenset[str] | None = None) -> tuple[str, list[str]] | None:
        """A node with the MIG instances one replica asks for: best fit (the fewest free instances
        of those profiles left over), nodes this decision touched first."""
        best: tuple[tuple[int, int], str, list[str]] | None = None
        for node_id, slot in state.mig.items():
            node = plan.node(state, node_id)
            if (node_id in avoid or (within is not None and node_id not in within) or not node.healthy or (a.models and node.model not in a.models)
                    or node.cpu_left < a.cpu or node.mem_left < a.mem):
                continue
            taken = plan.mig_taken.get(node_id, set())
            chosen: list[str] = []
            left = 0
            for profile, n in mig.items():
                free = [u for u in slot.free.get(profile, ()) if u not in taken]
                if len(free) < n:
                    break
                chosen += free[:n]
                left += len(free) - n
            else:
                rank = (0 if node_id in plan.nodes else 1, left)
                if best is None or rank < best[0]:
                    best = (rank, node_id, chosen)
        return (best[1], best[2]) if best is not None else None

    def _ever_fits_cached(self, state: PlacerState, job_id: str, spec: JobSpec) -> bool:
        """`ever_fits`, remembered per job until the fleet changes (it looks at every node)."""
        key = (job_id, state.fleet_version)
        memo = state.scratch.fits
        hit = memo.get(key)
        if hit is None:
            if len(memo) > 100_000:
                memo.clear()
            hit = memo[key] = self.ever_fits(state, spec)
        return hit

    def ever_fits(self, state: PlacerState, spec: JobSpec) -> bool:
        """Whether all replicas would fit if every node not cordoned were empty (a lost node, or
        a quarantined GPU, counts: it may come back, and a job must not fail for a passing fault),
        together with the nodes the node pools may still add (each pool up to its max)."""
        a = ask_of(spec)
        r = spec.resources
        room = 0
        level = spec.topology.required if spec.topology is not None else None
        by_domain: dict[str, int] = {}  # (a required topology: the room of each domain, which must hold all)
        in_pool: dict[str, int] = {}
        for node in state.nodes.values():
            if node.node_id in state.cordoned:
                continue
            if self.pools and (pool := node.labels.get("pool")):
                in_pool[pool] = in_pool.get(pool, 0) + 1
            if not all(ok(node, a) for ok in LASTING_CONSTRAINTS):
                continue
            if (a.gpus or r.mig) and a.models and node.model not in a.models:
                continue
            inv = state.inventories.get(node.node_id)
            gpus_total = sum(1 for g in inv.gpus if not g.mig_enabled) if inv is not None else node.gpus_total
            if a.gpus and (not gpus_total or (a.gpu_mem and node.gpu_mem_mib < a.gpu_mem)):
                continue
            per_gpu = MILLI // a.milli if a.milli < MILLI else 1
            per = [gpus_total * per_gpu // a.gpus if a.gpus else spec.replicas,
                   node.cpu_total // a.cpu if a.cpu else spec.replicas,
                   node.mem_total // a.mem if a.mem else spec.replicas]
            slot = state.mig.get(node.node_id)
            per += [(slot.total.get(profile, 0) if slot else 0) // n for profile, n in r.mig.items()]
            if level is not None:
                d = node.domain(level)
                by_domain[d] = by_domain.get(d, 0) + max(0, min(per))
                if d and by_domain[d] >= spec.replicas:
                    return True
                continue
            room += max(0, min(per))
            if room >= spec.replicas:
                return True
        for name, most, shape in self.pools:
            more = most - in_pool.get(name, 0)  # its registered nodes were counted above
            if more > 0:
                if level is not None:  # (a pool's nodes share their shape's labels: one domain)
                    d = shape.domain(level)
                    by_domain[d] = by_domain.get(d, 0) + more * _replicas_on(shape, a, spec)
                    if d and by_domain[d] >= spec.replicas:
                        return True
                    continue
                room += more * _replicas_on(shape, a, spec)
                if room >= spec.replicas:
                    return True
        return False

    def _filtered(self, state: PlacerState, spec: JobSpec) -> dict[str, int]:
        a = ask_of(spec)
        if not spec.resources.mig:
            return why_not(state.nodes.values(), a)
        counts: dict[str, int] = {}
        cpu_ask = Ask(cpu=a.cpu, mem=a.mem, selector=a.selector, tolerations=a.tolerations)
        for node in state.nodes.values():
            slot = state.mig.get(node.node_id)
            why = next(iter(why_not([node], cpu_ask)), None)
            if why is None and a.models and node.model not in a.models:
                why = "gpu_model"
            if why is None and (slot is None or any(len(slot.free.get(p, ())) < n for p, n in spec.resources.mig.items())):
                why = "mig"
            if why is not None:
                counts[why] = counts.get(why, 0) + 1
        return counts

    def _reasons(self, state: PlacerState, job_id: str, spec: JobSpec) -> list[Reason]:
        if not state.nodes:
            return [Reason(code="no_nodes", message="no nodes registered")]
        filtered = self._filtered(state, spec)
        parts = ", ".join(f"{v} {k}" for k, v in filtered.items()) or "replicas do not fit together"
        res = next((r for r in state.reserved() if r.job_id != job_id), None)
        held = ""
        if res is not None:
            held = f"; job {res.job_id} holds {len(res.nodes)} node(s) from {utc(res.start_s).isoformat()}"
        level = spec.topology.required if spec.topology is not None else None
        if level is not None:  # which domain came closest, and how close
            slots, members = self._room(state, spec, level, Plan())
            if slots:
                best = max(slots, key=lambda d: (slots[d], d))
                return [Reason(code="topology", message=(
                    f"{spec.replicas} x {_ask(spec)}{_within(spec)}: no {level} of {len(slots)} holds them all "
                    f"now; the closest, {best} ({len(members[best])} nodes), has room for {slots[best]}{held}"))]
        return [Reason(
            code="no_fit",
            message=f"{spec.replicas} x {_ask(spec)}: no fit on {len(state.nodes)} nodes ({parts}){held}",
        )]


def _replicas_on(shape: Node, a: Ask, spec: JobSpec) -> int:
    """How many replicas of the job an empty node of a pool's shape could hold (as `ever_fits`
    counts a registered node; a pool node has no MIG instances)."""
    r = spec.resources
    if r.mig or not all(ok(shape, a) for ok in LASTING_CONSTRAINTS):
        return 0
    if a.gpus and ((a.models and shape.model not in a.models) or not shape.gpus_total
                   or (a.gpu_mem and shape.gpu_mem_mib < a.gpu_mem)):
        return 0
    per_gpu = MILLI // a.milli if a.milli < MILLI else 1
    return max(0, min(shape.gpus_total * per_gpu // a.gpus if a.gpus else spec.replicas,
                      shape.cpu_total // a.cpu if a.cpu else spec.replicas,
                      shape.mem_total // a.mem if a.mem else spec.replicas))


def _within(spec: JobSpec) -> str:
    level = spec.topology.required if spec.topology is not None else None
    return f" within one {level} (topology.required)" if level else ""


def _ask(spec: JobSpec) -> str:
    """What one replica asks for, in words: `8 GPU`, `0.25 GPU`, `2 MIG 1g.10gb`, `CPU`."""
    r = spec.resources
    if r.mig:
        return ", ".join(f"{n} MIG {profile}" for profile, n in r.mig.items())
    if r.gpu and r.gpu_milli < MILLI:
        return f"{r.gpu_milli / MILLI:g} GPU"
    return f"{r.gpu} GPU"
