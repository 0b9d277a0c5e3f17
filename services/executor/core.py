"""Executor: run the replicas placed on this executor's nodes and report how they end.

folds: its nodes, job specs, running replicas     decides: node.registered, job.started,
                                                           job.exited (end, cancel, timeout)
On `sim` nodes this core is the driver: a replica "runs" for `spec.sim.duration` (or until its
max runtime) and exits with `spec.sim.exitCode`; one process can host thousands of sim nodes.
With `sim_pools`, it is also the `sim` provider of the autoscaler's node pools: a node asked for
(`node.provision_requested`, provider sim) registers here once its provision delay has passed and
is heartbeated like the others; asked to go (`node.removal_requested`) it deregisters
(`node.deregistered`), after reporting any replica still on it as lost.
On `process` / `docker` nodes it folds what *should* run there (`desired`), and the pure
`reconcile` compares that with what the driver sees, kubelet-style (services/executor/agent.py
does the I/O). A node the log says was lost registers again once its executor is back.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import dataclass, field
from datetime import datetime

from gpufleet.shared.contract.events import (
    SYS_TENANT,
    Envelope,
    ExitReason,
    JobExited,
    JobPlaced,
    JobPreemptionRequested,
    JobResumeRequested,
    JobStarted,
    JobSubmitted,
    NodeDeregistered,
    NodeInventory,
    NodeLost,
    NodeProvisionRequested,
    NodeRegistered,
    NodeRemovalRequested,
    Reason,
    ReplicaAllocation,
    resumed_attempt,
    utc,
)
from gpufleet.shared.contract.spec import JobSpec, SimSpec
from gpufleet.shared.node.checkpoints import CHECKPOINTED_TYPES
from gpufleet.shared.node.checkpoints import location as checkpoint_location
from gpufleet.shared.node.cluster import inventory_digest
from gpufleet.shared.runtime.loop import BaseCore, Ctx
from gpufleet.shared.runtime.retention import EndedJobs

from .drivers import Launch, Workload, workload_key

EXIT_TIMEOUT = 124
EXIT_KILLED = 137
_KILL_REASONS: dict[str, ExitReason] = {
    "job.preempted": "preempted", "job.preemption_requested": "preempted", "job.failed": "killed",
    "job.cancel_requested": "cancelled", "job.cancelled": "cancelled", "job.resume_requested": "killed",
    "job.succeeded": "killed"}


@dataclass(frozen=True, slots=True)
class RunPlan:
    """How a replica runs on a sim node."""

    duration_s: float
    exit_code: int
    max_runtime_s: float


@dataclass
class Running:
    job_id: str
    tenant: str
    replica: int
    node_id: str
    started_at_s: float
    started_event_id: str
    plan: RunPlan
    attempt: int = 1


@dataclass(frozen=True)
class Desired:
    """A replica placed on one of this executor's driver (non-sim) nodes, not yet ended."""

    alloc: ReplicaAllocation
    attempt: int
    tenant: str
    placed_event_id: str
    world_size: int = 1  # the replicas of its attempt (an elastic job's size now): GPUFLEET_WORLD_SIZE


@dataclass
class PoolNode:
    """A node of an autoscaler pool this executor provides (sim provider)."""

    inventory: NodeInventory
    ready_at_s: float
    requested_event_id: str
    removal_event_id: str | None = None


@dataclass(slots=True)
class DriverJob:
    """What `reconcile` needs of a job with replicas on the driver (`process` / `docker`) nodes: what
    should run there, what must stop, why and how gently, which exits the log has. A sim executor
    keeps none; a driver executor makes it when the job is first placed, asked to stop or resumed."""

    desired: dict[int, Desired] | None = None  # replica -> what should run
    abandoned: dict[int, Desired] | None = None  # replica -> an old attempt placed here, never started
    exits_logged: set[tuple[int, int]] | None = None  # (replica, attempt) whose exit the log has
    stop_reason: ExitReason | None = None  # why it must stop (kept past the end: a late exit's reason)
    stop_grace: float | None = None  # the grace its preemption gives
    resume_from: str | None = None  # the checkpoint its next run starts from


@dataclass(slots=True)
class ExecutorJob:
    """Everything the executor knows of one job: one record. Collections stay None until needed: a
    pending job costs one small record. When the job ends, what its replicas still need (they are
    stopped, and say how they ended, after the end) stays until the window forgets the job; the rest
    goes at once (`ExecutorState.end`)."""

    sim: SimSpec | None = None  # how its replicas run on sim nodes (the spec's own, shared)
    max_runtime_s: float = 86400.0
    spec: JobSpec | None = None  # driver executors only: what its replicas run (the event's, shared)
    attempt: int = 1  # its current attempt (resumes)
    # (replica, attempt) started or ended here: a placement redelivered after its replica exited (or
    # after telemetry ended it with its lost node) starts nothing
    started: set[tuple[int, int]] | None = None
    # (replica, attempt) placed on a node the log had declared lost: nobody else ends them (telemetry
    # ends what a node held when it was lost), so the executor does, instead of starting them
    placed_on_lost: set[tuple[int, int]] | None = None
    running: dict[int, Running] | None = None  # replica -> its run here, in the order they started
    cancelling: bool = False  # asked to stop: a late placement does not run
    driver: DriverJob | None = None

    def plan(self, attempt: int) -> RunPlan:
        """How a replica of that attempt runs on a sim node (`sim.runs` plays the first attempts)."""
        sim = self.sim
        if sim is None:
            return RunPlan(0.0, 0, 86400.0)
        run = sim.runs[attempt - 1] if 1 <= attempt <= len(sim.runs) else sim
        return RunPlan(run.duration_s, run.exit_code, self.max_runtime_s)


@dataclass
class ExecutorState:
    registered: dict[str, str] = field(default_factory=dict)  # node_id -> inventory digest
    jobs: dict[str, ExecutorJob] = field(default_factory=dict)
    ended: EndedJobs = field(default_factory=EndedJobs)  # forgotten after a window of log time
    # indexes of `jobs` (kept by the methods below, nowhere else):
    # (when it ends, job_id, replica): a tick looks only at what is due, not at every replica
    # (the entries of replicas that ended go as they come to the top)
    deadlines: list[tuple[float, str, int]] = field(default_factory=list)
    on_node: dict[str, set[tuple[str, int]]] = field(default_factory=dict)  # node -> (job, replica) running there
    placed: set[str] = field(default_factory=set)  # jobs with a desired or abandoned replica: what reconcile walks
    lost: dict[str, int] = field(default_factory=dict)  # node -> times the log said it was lost
    pool_nodes: dict[str, PoolNode] = field(default_factory=dict)  # sim provider: nodes asked for, not gone

    def job(self, job_id: str) -> ExecutorJob:
        rec = self.jobs.get(job_id)
        if rec is None:
            rec = self.jobs[job_id] = ExecutorJob()
        return rec

    def driver(self, job_id: str) -> DriverJob:
        rec = self.job(job_id)
        if rec.driver is None:
            rec.driver = DriverJob()
        return rec.driver

    def peek(self, job_id: str) -> ExecutorJob:
        """The job's record to read, or an empty one (not kept) when there is none."""
        rec = self.jobs.get(job_id)
        return rec if rec is not None else ExecutorJob()

    def peek_driver(self, job_id: str) -> DriverJob:
        """The job's driver part to read, or an empty one (not kept) when there is none."""
        rec = self.jobs.get(job_id)
        return rec.driver if rec is not None and rec.driver is not None else DriverJob()

    def run(self, job_id: str, replica: int) -> Running | None:
        rec = self.jobs.get(job_id)
        return rec.running.get(replica) if rec is not None and rec.running is not None else None

    def exit_logged(self, job_id: str, replica: int, attempt: int) -> bool:
        return (replica, attempt) in (self.peek_driver(job_id).exits_logged or ())

    def add_run(self, rec: ExecutorJob, run: Running) -> None:
        """It runs (in place of an earlier attempt of the same replica, whose exit never came)."""
        if rec.running is None:
            rec.running = {}
        stale = rec.running.get(run.replica)
        if stale is not None:
            self._off_node(stale)
        rec.running[run.replica] = run
        self.on_node.setdefault(run.node_id, set()).add((run.job_id, run.replica))
        heapq.heappush(self.deadlines, (run.started_at_s + min(run.plan.duration_s, run.plan.max_runtime_s),
                                        run.job_id, run.replica))

    def drop_run(self, rec: ExecutorJob, run: Running) -> None:
        """It exited."""
        assert rec.running is not None
        del rec.running[run.replica]
        if not rec.running:
            rec.running = None
        self._off_node(run)
        while self.deadlines and self.run(self.deadlines[0][1], self.deadlines[0][2]) is None:
            heapq.heappop(self.deadlines)  # entries of ended replicas, now at the top

    def _off_node(self, run: Running) -> None:
        on = self.on_node.get(run.node_id)
        if on is not None:
            on.discard((run.job_id, run.replica))
            if not on:
                del self.on_node[run.node_id]

    def set_desired(self, job_id: str, dj: DriverJob, replica: int, d: Desired | None) -> None:
        dj.desired = _put(dj.desired, replica, d)
        self._index_placed(job_id, dj)

    def set_abandoned(self, job_id: str, dj: DriverJob, replica: int, d: Desired | None) -> None:
        dj.abandoned = _put(dj.abandoned, replica, d)
        self._index_placed(job_id, dj)

    def _index_placed(self, job_id: str, dj: DriverJob) -> None:
        (self.placed.add if dj.desired or dj.abandoned else self.placed.discard)(job_id)

    def end(self, job_id: str, at: datetime, reason: ExitReason | None) -> None:
        """The job ended: remembered as ended for the window. Its replicas running stay (they are
        stopped, then their exits folded), and on driver nodes (`reason` given) why it stopped, unless
        it was asked to stop for another reason, and the exits the log has, until the window forgets
        the job; the rest of its record goes now. The jobs the window forgets go with their indexes."""
        for gone in self.ended.add(job_id, at):
            self._forget(gone)
        self.placed.discard(job_id)
        rec = self.jobs.pop(job_id, None)
        dj = rec.driver if rec is not None else None
        kept = ExecutorJob(running=rec.running if rec is not None else None)
        if reason is not None:
            kept.driver = DriverJob(exits_logged=dj.exits_logged if dj else None,
                                    stop_reason=(dj.stop_reason if dj else None) or reason)
        if kept.running is not None or kept.driver is not None:
            self.jobs[job_id] = kept

    def _forget(self, job_id: str) -> None:
        rec = self.jobs.pop(job_id, None)
        self.placed.discard(job_id)
        for run in (rec.running or {}).values() if rec is not None else ():
            self._off_node(run)  # (its deadline entries go as they come to the top)


def _put(d: dict[int, Desired] | None, replica: int, value: Desired | None) -> dict[int, Desired] | None:
    """`d` with `replica` set to `value` (or removed, with None); None once empty."""
    if value is not None:
        if d is None:
            d = {}
        d[replica] = value
        return d
    if d is not None:
        d.pop(replica, None)
    return d or None


class ExecutorCore(BaseCore[ExecutorState]):
    name = "executor"
    subjects = (
        "fleet.evt.sys.node.*.registered",
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.placed", "fleet.evt.*.job.*.started",
        "fleet.evt.*.job.*.exited", "fleet.evt.*.job.*.cancel_requested",
        "fleet.evt.*.job.*.preemption_requested",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.preempted", "fleet.evt.*.job.*.resume_requested", "fleet.evt.sys.node.*.lost",
        "fleet.evt.sys.node.*.provision_requested", "fleet.evt.sys.node.*.removal_requested",
        "fleet.evt.sys.node.*.deregistered",
    )
    # A start or an exit is published only if no node was declared lost since the executor decided
    # it: one that was frozen past its lease, or decided on a state the loss had not reached yet,
    # decides again on the log as it is (a run its node lost is neither started nor reported twice)
    cas_subject = "fleet.evt.sys.node.*.lost"
    cas_outputs = ("fleet.evt.*.job.*.started", "fleet.evt.*.job.*.exited")
    tick_s = 0.2
    state_format = 3  # one record per job (ExecutorJob), with the placements on lost nodes

    def __init__(self, nodes: dict[str, NodeInventory], sim_pools: bool = False) -> None:
        self.nodes = nodes
        self.driver_nodes = {n for n, inv in nodes.items() if inv.driver != "sim"}
        self.sim_pools = sim_pools  # the `sim` provider of node pools: one executor per mesh should be
        # its state holds what its own nodes run: an executor of other nodes (one per GPU node)
        # must not start from its snapshot (shared/runtime/snapshots.py)
        self.snapshot_identity = hashlib.sha256(json.dumps(
            [sim_pools, sorted((n, inv.model_dump(mode="json")) for n, inv in nodes.items())],
            sort_keys=True, default=str).encode()).hexdigest()

    def hosts(self, state: ExecutorState, node_id: str) -> bool:
        """Whether the node is this executor's: one of its own, or a pool node it provides."""
        return node_id in self.nodes or node_id in state.pool_nodes

    @staticmethod
    def is_lost(state: ExecutorState, node_id: str) -> bool:
        """The log declared the node lost, and it has not registered again since."""
        return node_id in state.lost and node_id not in state.registered

    def inventory(self, state: ExecutorState, node_id: str) -> NodeInventory:
        pool = state.pool_nodes.get(node_id)
        return pool.inventory if pool is not None else self.nodes[node_id]

    def hosted(self, state: ExecutorState) -> list[str]:
        """Every node it heartbeats: its own, and the pool nodes that registered."""
        return sorted({*self.nodes, *(n for n in state.pool_nodes if n in state.registered)})

    def initial_state(self) -> ExecutorState:
        return ExecutorState()

    def evolve(self, state: ExecutorState, env: Envelope) -> ExecutorState:
        t, p = env.type, env.payload
        if isinstance(p, NodeProvisionRequested):
            if self.sim_pools and p.provider == "sim" and p.node_id not in self.nodes:
                state.pool_nodes.setdefault(p.node_id, PoolNode(
                    p.inventory, env.occurred_at.timestamp() + p.ready_after_s, env.event_id))
            return state
        if isinstance(p, NodeRemovalRequested):
            pool_node = state.pool_nodes.get(p.node_id)
            if pool_node is not None and pool_node.removal_event_id is None:
                pool_node.removal_event_id = env.event_id
            return state
        if isinstance(p, NodeDeregistered):
            if state.pool_nodes.pop(p.node_id, None) is not None:
                state.registered.pop(p.node_id, None)
                state.lost.pop(p.node_id, None)
            return state
        if isinstance(p, NodeRegistered):
            if self.hosts(state, p.node_id):
                state.registered[p.node_id] = inventory_digest(p.inventory)
            return state
        if isinstance(p, NodeLost):
            if self.hosts(state, p.node_id):
                state.registered.pop(p.node_id, None)  # registers again (tick): the node is back
                state.lost[p.node_id] = state.lost.get(p.node_id, 0) + 1
            return state
        job_id = env.job_id
        if job_id is None:
            return state
        if isinstance(p, JobSubmitted):
            rec = state.job(job_id)
            rec.sim, rec.max_runtime_s = p.spec.sim, p.spec.runtime_limit_s
            if self.driver_nodes:
                rec.spec = p.spec
        elif isinstance(p, JobPlaced):
            if job_id in state.ended:
                return state
            for a in p.allocations:
                if self.hosts(state, a.node_id) and self.is_lost(state, a.node_id):
                    rec = state.job(job_id)
                    if rec.placed_on_lost is None:
                        rec.placed_on_lost = set()
                    rec.placed_on_lost.add((a.replica, p.attempt))
            if self.driver_nodes and p.attempt >= state.peek(job_id).attempt:
                for a in p.allocations:
                    if a.node_id in self.driver_nodes and not self.is_lost(state, a.node_id):
                        state.set_desired(job_id, state.driver(job_id), a.replica,
                                          Desired(a, p.attempt, env.tenant, env.event_id, len(p.allocations)))
        elif isinstance(p, JobResumeRequested):
            nxt = resumed_attempt(state.peek(job_id).attempt, p)
            if nxt is None:  # a copy of an old resume: the run it started may be running now
                return state
            rec = state.job(job_id)
            rec.attempt = nxt
            if self.driver_nodes:
                dj = state.driver(job_id)
                if p.reason.code == "preempted" and dj.stop_reason == "preempted":
                    # it gave its quota back and waits for it again: that stop was for the run before
                    dj.stop_reason = dj.stop_grace = None
                if p.checkpoint_uri:
                    dj.resume_from = p.checkpoint_uri
                for replica, old in [(r, d) for r, d in (dj.desired or {}).items() if d.attempt < nxt]:
                    state.set_desired(job_id, dj, replica, None)
                    run = (rec.running or {}).get(replica)
                    if run is None or run.attempt != old.attempt:
                        # placed here but never started: its allocation must still be given back
                        state.set_abandoned(job_id, dj, replica, old)
        elif isinstance(p, JobStarted):
            if self.hosts(state, p.node_id) and job_id not in state.ended:
                rec = state.job(job_id)
                plan = rec.plan(p.attempt)
                if rec.started is None:
                    rec.started = set()
                rec.started.add((p.replica, p.attempt))
                current = (rec.running or {}).get(p.replica)
                # (in place of an earlier attempt whose exit never came)
                if current is None or current.attempt < p.attempt:
                    state.add_run(rec, Running(job_id, env.tenant, p.replica, p.node_id,
                                               env.occurred_at.timestamp(), env.event_id, plan, p.attempt))
        elif isinstance(p, JobExited):
            if self.hosts(state, p.node_id) and job_id not in state.ended:
                rec = state.job(job_id)
                if rec.started is None:
                    rec.started = set()
                rec.started.add((p.replica, p.attempt))  # ended: never started again
            if p.node_id in self.driver_nodes:
                dj = state.driver(job_id)
                if dj.exits_logged is None:
                    dj.exits_logged = set()
                dj.exits_logged.add((p.replica, p.attempt))
                gone = (dj.abandoned or {}).get(p.replica)
                if gone is not None and gone.attempt == p.attempt:
                    state.set_abandoned(job_id, dj, p.replica, None)
                d = (dj.desired or {}).get(p.replica)
                if d is not None and d.attempt == p.attempt:
                    state.set_desired(job_id, dj, p.replica, None)
            current = state.run(job_id, p.replica)
            if current is not None and current.attempt != p.attempt:
                return state  # the exit of an earlier attempt of this replica
            if current is not None:
                state.drop_run(state.jobs[job_id], current)
        elif t == "job.cancel_requested":
            state.job(job_id).cancelling = True
            if self.driver_nodes and (dj := state.driver(job_id)).stop_reason is None:
                dj.stop_reason = "cancelled"
        elif isinstance(p, JobPreemptionRequested):
            if self.driver_nodes:
                dj = state.driver(job_id)
                if dj.stop_reason is None:
                    dj.stop_reason = "preempted"
                if dj.stop_grace is None:
                    dj.stop_grace = p.grace_s
        elif t in ("job.succeeded", "job.failed", "job.cancelled", "job.preempted"):
            state.end(job_id, env.occurred_at, _KILL_REASONS.get(t, "killed") if self.driver_nodes else None)
        return state

    def on_start(self, state: ExecutorState, ctx: Ctx) -> list[Envelope]:
        out = []
        for node_id, inv in self.nodes.items():
            digest = inventory_digest(inv)
            if state.registered.get(node_id) != digest:
                n_lost = state.lost.get(node_id, 0)
                out.append(ctx.emit(NodeRegistered(node_id=node_id, inventory=inv), tenant=SYS_TENANT,
                                    key=f"register:{node_id}:{digest}" + (f":{n_lost}" if n_lost else "")))
        return out

    def decide(self, state: ExecutorState, env: Envelope, ctx: Ctx) -> list[Envelope]:
        t, p = env.type, env.payload
        job_id = env.job_id
        if job_id is None:
            return []
        if isinstance(p, JobPlaced):
            if job_id in state.ended:
                return []
            out = []
            rec = state.peek(job_id)
            for a in p.allocations:
                if (a.replica, p.attempt) in (rec.placed_on_lost or ()) and (a.replica, p.attempt) not in (rec.started or ()):
                    # placed on a node the log had declared lost: never started; what it holds is freed
                    out.append(ctx.emit(JobExited(
                        job_id=job_id, node_id=a.node_id, replica=a.replica, exit_code=LOST_EXIT,
                        reason="node_lost", attempt=p.attempt,
                    ), key=f"start:{a.replica}"))
                    continue
                if self.hosts(state, a.node_id) and self.is_lost(state, a.node_id):
                    continue  # lost after it was placed: telemetry ended it with the node
                if a.node_id in self.driver_nodes:
                    continue  # started by the agent once its driver has it running (reconcile)
                if (self.hosts(state, a.node_id) and a.replica not in (rec.running or {})
                        and (a.replica, p.attempt) not in (rec.started or ())):
                    if rec.cancelling:
                        # the cancel overtook this placement: never start it, free what it holds
                        out.append(ctx.emit(JobExited(
                            job_id=job_id, node_id=a.node_id, replica=a.replica, exit_code=EXIT_KILLED,
                            reason="cancelled", attempt=p.attempt,
                        ), key=f"start:{a.replica}"))
                        continue
                    out.append(ctx.emit(JobStarted(
                        job_id=job_id, node_id=a.node_id, replica=a.replica, driver="sim",
                        attempt=p.attempt,
                    ), key=f"start:{a.replica}"))
            return out
        # (the grace period of a preemption is the guardian's to use for a checkpoint; the sim
        # driver has nothing to save and stops at once)
        if t in ("job.cancel_requested", "job.cancelled", "job.preempted", "job.failed", "job.preemption_requested",
                 "job.resume_requested"):
            # a cancelled / preempted job, the rest of a gang one of whose replicas failed, or
            # replicas of an attempt that is started again elsewhere (driver nodes: reconcile stops them)
            reason = _KILL_REASONS.get(t, "cancelled")
            rec = state.peek(job_id)
            return [
                self._exit(r, ctx, EXIT_KILLED, reason, "kill")
                for r in (rec.running or {}).values()
                if r.node_id not in self.driver_nodes
                and (t != "job.resume_requested" or r.attempt < rec.attempt)
            ]
        return []

    def tick(self, state: ExecutorState, ctx: Ctx) -> list[Envelope]:
        now = ctx.now.timestamp()
        out = []
        for node_id, n_lost in state.lost.items():
            pool_node = state.pool_nodes.get(node_id)
            if pool_node is not None and pool_node.removal_event_id is not None:
                continue  # a pool node being removed: not registered again, only deregistered (_pool_tick)
            if node_id not in state.registered and self.hosts(state, node_id):  # lost, but here it is
                inv = self.inventory(state, node_id)
                out.append(ctx.emit(NodeRegistered(node_id=node_id, inventory=inv), tenant=SYS_TENANT,
                                    key=f"register:{node_id}:{inventory_digest(inv)}:{n_lost}"))
        out += self._pool_tick(state, ctx, now)
        due: list[Running] = []
        # walk the heap down from its root to every entry that is due, without changing it
        # (tick is pure; evolve drops the entries of replicas that ended)
        heap = state.deadlines
        stack = [0] if heap else []
        while stack:
            i = stack.pop()
            ends, job_id, replica = heap[i]
            if ends > now:
                continue
            run = state.run(job_id, replica)
            if run is not None and run.node_id not in self.driver_nodes and ends == run.started_at_s + min(run.plan.duration_s, run.plan.max_runtime_s):
                due.append(run)  # (an entry of an earlier run of the same replica does not count)
            stack.extend(c for c in (2 * i + 1, 2 * i + 2) if c < len(heap))
        due.sort(key=lambda r: (r.started_at_s, r.job_id, r.replica))
        for r in due:
            elapsed = now - r.started_at_s
            if elapsed >= r.plan.max_runtime_s and r.plan.max_runtime_s < r.plan.duration_s:
                out.append(self._exit(r, ctx, EXIT_TIMEOUT, "timeout", "exit"))
            elif elapsed >= r.plan.duration_s:
                out.append(self._exit(r, ctx, r.plan.exit_code, "completed" if r.plan.exit_code == 0 else "error", "exit"))
        return out

    def _pool_tick(self, state: ExecutorState, ctx: Ctx, now: float) -> list[Envelope]:
        """The sim provider: pool nodes come up after their delay, and go when asked to."""
        out: list[Envelope] = []
        for node_id, pn in sorted(state.pool_nodes.items()):
            if pn.removal_event_id is not None:
                # replicas still there (placed as it was being drained) are lost with it
                for job_id, replica in sorted(state.on_node.get(node_id, ())):
                    r = state.run(job_id, replica)
                    assert r is not None
                    out.append(self._exit(r, ctx, EXIT_KILLED, "node_lost", "exit"))
                out.append(ctx.emit(NodeDeregistered(node_id=node_id, reason="removed by its pool's provider (sim)"),
                                    tenant=SYS_TENANT, cause_id=pn.removal_event_id, key="deregistered"))
            elif node_id not in state.registered and node_id not in state.lost and now >= pn.ready_at_s:
                out.append(ctx.emit(NodeRegistered(node_id=node_id, inventory=pn.inventory), tenant=SYS_TENANT,
                                    cause_id=pn.requested_event_id, key=f"register:{inventory_digest(pn.inventory)}"))
        return out

    @staticmethod
    def _exit(r: Running, ctx: Ctx, code: int, reason: ExitReason, key: str) -> Envelope:
        runtime = max(0.0, ctx.now.timestamp() - r.started_at_s)
        return ctx.emit(
            JobExited(job_id=r.job_id, node_id=r.node_id, replica=r.replica, exit_code=code,
                      reason=reason, runtime_s=round(runtime, 3), attempt=r.attempt),
            tenant=r.tenant, cause_id=r.started_event_id, key=key,
        )


# ---------------------------------------------------------------- driver nodes: reconcile


@dataclass(frozen=True)
class Start:
    launch: Launch
    desired: Desired


@dataclass(frozen=True)
class Stop:
    key: str
    reason: ExitReason
    grace_s: float


@dataclass(frozen=True)
class ReportExit:
    """The workload ended: report it (checking its GPUs first), then clean it up."""

    workload: Workload
    reason: ExitReason
    run: Running | None  # its started event, if the log has one
    desired: Desired | None


@dataclass(frozen=True)
class Cleanup:
    key: str


@dataclass(frozen=True)
class Adopt:
    """Running, but its start is not in the log (the executor died between the two): say it."""

    workload: Workload
    desired: Desired


Action = Start | Stop | ReportExit | Cleanup | Adopt
LOST_EXIT = 137


def launch_for(state: ExecutorState, job_id: str, d: Desired, node: NodeInventory,
               checkpoint_root: str | None = None) -> Launch:
    spec = state.peek(job_id).spec
    a = d.alloc
    uuids = {g.index: g.uuid for g in node.gpus}
    gpu_uuids = a.mig_devices or tuple(uuids[i] for i in a.gpu_indices if i in uuids)
    ckpt = None
    if checkpoint_root and spec is not None and spec.type in CHECKPOINTED_TYPES:
        ckpt = checkpoint_location(checkpoint_root, d.tenant, job_id, spec.checkpoint.path if spec.checkpoint else None)
    env = dict(spec.env) if spec else {}
    if spec is not None and spec.checkpoint is not None:
        env.setdefault("GPUFLEET_CHECKPOINT_KEEP", str(spec.checkpoint.keep))
    resume = state.peek_driver(job_id).resume_from
    if resume:
        env["GPUFLEET_RESUME_FROM"] = resume
    return Launch(
        job_id=job_id, tenant=d.tenant, replica=a.replica, attempt=d.attempt, node_id=a.node_id,
        command=spec.command if spec else (), image=spec.image if spec else None,
        env=env, gpu_indices=a.gpu_indices, gpu_uuids=gpu_uuids,
        cpu_milli=a.cpu_milli, memory_mib=a.memory_mib,
        max_runtime_s=spec.runtime_limit_s if spec else 86400.0, checkpoint_dir=ckpt,
        placed_event_id=d.placed_event_id, world_size=d.world_size,
    )


def reconcile(state: ExecutorState, nodes: dict[str, NodeInventory], observed: list[Workload], now: float,
              grace_s: float = 10.0, checkpoint_root: str | None = None) -> list[Action]:
    """What to do so that what runs on the driver nodes is what the log says should run there.

    Pure: the agent calls it with the folded state and what its driver sees, then does the actions.
    """
    actions: list[Action] = []
    seen: set[tuple[str, int]] = set()
    for w in observed:
        if w.node_id not in nodes:
            continue
        rec = state.peek(w.job_id)
        dj = rec.driver or DriverJob()
        d = (dj.desired or {}).get(w.replica)
        current = d is not None and d.attempt == w.attempt
        run = (rec.running or {}).get(w.replica)
        run = run if run is not None and run.attempt == w.attempt else None
        if current:
            seen.add((w.job_id, w.replica))
        logged_exit = state.exit_logged(w.job_id, w.replica, w.attempt)
        if w.running:
            if current and run is None and not logged_exit and d is not None:
                actions.append(Adopt(w, d))
            if not current or logged_exit or dj.stop_reason is not None or w.job_id in state.ended:
                # (a preemption says how long the job has)
                grace = dj.stop_grace if dj.stop_grace is not None else grace_s
                actions.append(Stop(w.key, dj.stop_reason or "killed", grace))
            elif rec.spec is not None and now - w.started_at >= rec.spec.runtime_limit_s:
                actions.append(Stop(w.key, "timeout", grace_s))
        else:
            ab = (dj.abandoned or {}).get(w.replica)
            ab = ab if ab is not None and ab.attempt == w.attempt else None
            if logged_exit or (not current and run is None and ab is None):
                actions.append(Cleanup(w.key))
            else:
                actions.append(ReportExit(w, exit_reason(state, w, now), run, d if current else ab))
    placed = [(job_id, state.jobs[job_id]) for job_id in sorted(state.placed)]
    observed_keys = {w.key for w in observed}
    for job_id, rec in placed:
        assert rec.driver is not None
        for replica, d in sorted((rec.driver.abandoned or {}).items()):
            if (d.alloc.node_id in nodes and not state.exit_logged(job_id, replica, d.attempt)
                    and workload_key(job_id, replica, d.attempt) not in observed_keys):
                never = Workload(job_id, replica, d.attempt, d.alloc.node_id, handle="", running=False,
                                 exit_code=EXIT_KILLED, started_at=now)
                actions.append(ReportExit(never, "killed", None, d))
    for job_id, rec in placed:
        assert rec.driver is not None
        for replica, d in sorted((rec.driver.desired or {}).items()):
            if ((job_id, replica) in seen or d.alloc.node_id not in nodes
                    or state.exit_logged(job_id, replica, d.attempt)):
                continue
            run = (rec.running or {}).get(replica)
            if run is not None and run.attempt == d.attempt:
                # started, and now the driver has no trace of it (the node rebooted, its data was lost)
                gone = Workload(job_id, replica, d.attempt, d.alloc.node_id, handle="", running=False,
                                exit_code=LOST_EXIT, started_at=run.started_at_s)
                actions.append(ReportExit(gone, "node_lost", run, d))
            elif rec.driver.stop_reason is not None or job_id in state.ended:
                never = Workload(job_id, replica, d.attempt, d.alloc.node_id, handle="", running=False,
                                 exit_code=EXIT_KILLED, started_at=now)
                actions.append(ReportExit(never, rec.driver.stop_reason or "cancelled", None, d))
            else:
                actions.append(Start(launch_for(state, job_id, d, nodes[d.alloc.node_id], checkpoint_root), d))
    return actions


def exit_reason(state: ExecutorState, w: Workload, now: float) -> ExitReason:
    spec = state.peek(w.job_id).spec
    stop_reason = state.peek_driver(w.job_id).stop_reason
    if w.stopped_by_us:
        if stop_reason is not None:
            return stop_reason
        if spec is not None and now - w.started_at >= spec.runtime_limit_s:
            return "timeout"
        return "killed"
    if w.exit_code is None:
        return "killed"
    return "completed" if w.exit_code == 0 else "error"


def started_event(ctx: Ctx, w: Workload, d: Desired, driver: str) -> Envelope:
    """`job.started` for a workload the driver runs (the same id however often it is said)."""
    return ctx.emit(JobStarted(job_id=w.job_id, node_id=w.node_id, replica=w.replica, driver=driver,
                               attempt=w.attempt, pid=w.pid, container_id=w.container_id),
                    tenant=d.tenant, cause_id=d.placed_event_id, key=f"start:{w.replica}")


def exited_event(ctx: Ctx, a: ReportExit, unclean: tuple[int, ...] = (),
                 checkpoint: tuple[str, int, float] | None = None, detail: Reason | None = None) -> Envelope:
    w = a.workload
    code = w.exit_code if w.exit_code is not None else EXIT_KILLED
    if a.reason == "timeout":
        code = EXIT_TIMEOUT
    tenant = a.run.tenant if a.run else (a.desired.tenant if a.desired else SYS_TENANT)
    cause = a.run.started_event_id if a.run else (a.desired.placed_event_id if a.desired else None)
    started = a.run.started_at_s if a.run else w.started_at
    payload = JobExited(job_id=w.job_id, node_id=w.node_id, replica=w.replica, exit_code=code, reason=a.reason,
                        runtime_s=round(max(0.0, ctx.now.timestamp() - started), 3), attempt=w.attempt,
                        unclean_gpus=unclean, checkpoint_uri=checkpoint[0] if checkpoint else None,
                        checkpoint_step=checkpoint[1] if checkpoint else None,
                        checkpoint_saved_at=utc(checkpoint[2]) if checkpoint and checkpoint[2] else None,
                        detail=detail)
    if a.run is None and a.desired is not None:  # never started: the exit takes the start's slot
        return ctx.emit(payload, tenant=tenant, cause_id=cause, key=f"start:{w.replica}")
    return ctx.emit(payload, tenant=tenant, cause_id=cause, key=f"exit:{w.attempt}")
