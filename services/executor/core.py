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

import heapq
from dataclasses import dataclass, field

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
    ReplicaAllocation,
    resumed_attempt,
    utc,
)
from gpufleet.shared.contract.spec import JobSpec
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


@dataclass(frozen=True)
class RunPlan:
    duration_s: float
    exit_code: int
    max_runtime_s: float
    runs: tuple[tuple[float, int], ...] = ()  # the first attempts, one by one (spec.sim.runs)

    def of(self, attempt: int) -> RunPlan:
        """The plan of that attempt."""
        if 1 <= attempt <= len(self.runs):
            duration, code = self.runs[attempt - 1]
            return RunPlan(duration, code, self.max_runtime_s)
        return self


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


@dataclass
class PoolNode:
    """A node of an autoscaler pool this executor provides (sim provider)."""

    inventory: NodeInventory
    ready_at_s: float
    requested_event_id: str
    removal_event_id: str | None = None


@dataclass
class ExecutorState:
    registered: dict[str, str] = field(default_factory=dict)  # node_id -> inventory digest
    plans: dict[str, RunPlan] = field(default_factory=dict)
    running: dict[tuple[str, int], Running] = field(default_factory=dict)
    replicas_of: dict[str, list[int]] = field(default_factory=dict)  # job_id -> running replicas
    # (when it ends, job_id, replica): a tick looks only at what is due, not at every replica
    deadlines: list[tuple[float, str, int]] = field(default_factory=list)
    ended: EndedJobs = field(default_factory=EndedJobs)  # forgotten after a window of log time
    cancelling: set[str] = field(default_factory=set)  # asked to stop: a late placement does not run
    # job_id -> (replica, attempt) started here: a placement redelivered after its replica exited starts nothing
    started: dict[str, set[tuple[int, int]]] = field(default_factory=dict)
    # driver nodes: what should run, why a job must stop, which exits the log already has
    desired: dict[tuple[str, int], Desired] = field(default_factory=dict)
    specs: dict[str, JobSpec] = field(default_factory=dict)
    stop_reason: dict[str, ExitReason] = field(default_factory=dict)
    exits_logged: set[str] = field(default_factory=set)  # workload keys
    attempt: dict[str, int] = field(default_factory=dict)  # job -> its current attempt (resumes)
    lost: dict[str, int] = field(default_factory=dict)  # node -> times the log said it was lost
    stop_grace: dict[str, float] = field(default_factory=dict)  # job -> the grace its preemption gives
    abandoned: dict[tuple[str, int], Desired] = field(default_factory=dict)  # old attempts never started
    resume_from: dict[str, str] = field(default_factory=dict)  # job -> the checkpoint its next run starts from
    pool_nodes: dict[str, PoolNode] = field(default_factory=dict)  # sim provider: nodes asked for, not gone


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
    tick_s = 0.2

    def __init__(self, nodes: dict[str, NodeInventory], sim_pools: bool = False) -> None:
        self.nodes = nodes
        self.driver_nodes = {n for n, inv in nodes.items() if inv.driver != "sim"}
        self.sim_pools = sim_pools  # the `sim` provider of node pools: one executor per mesh should be

    def hosts(self, state: ExecutorState, node_id: str) -> bool:
        """Whether the node is this executor's: one of its own, or a pool node it provides."""
        return node_id in self.nodes or node_id in state.pool_nodes

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
            spec = p.spec
            state.plans[job_id] = RunPlan(spec.sim.duration_s, spec.sim.exit_code, spec.max_runtime_s,
                                          tuple((r.duration_s, r.exit_code) for r in spec.sim.runs))
            if self.driver_nodes:
                state.specs[job_id] = spec
        elif isinstance(p, JobPlaced):
            if job_id not in state.ended and self.driver_nodes and p.attempt >= state.attempt.get(job_id, 1):
                for a in p.allocations:
                    if a.node_id in self.driver_nodes:
                        state.desired[(job_id, a.replica)] = Desired(a, p.attempt, env.tenant, env.event_id)
        elif isinstance(p, JobResumeRequested):
            nxt = resumed_attempt(state.attempt.get(job_id, 1), p)
            if nxt is None:  # a copy of an old resume: the run it started may be running now
                return state
            state.attempt[job_id] = nxt
            if p.checkpoint_uri:
                state.resume_from[job_id] = p.checkpoint_uri
            if p.reason.code == "preempted" and state.stop_reason.get(job_id) == "preempted":
                # it gave its quota back and waits for it again: that stop was for the run before
                del state.stop_reason[job_id]
                state.stop_grace.pop(job_id, None)
            for key in [k for k, d in state.desired.items() if k[0] == job_id and d.attempt < state.attempt[job_id]]:
                old = state.desired.pop(key)
                run = state.running.get(key)
                if run is None or run.attempt != old.attempt:
                    # placed here but never started: its allocation must still be given back
                    state.abandoned[key] = old
        elif isinstance(p, JobStarted):
            if self.hosts(state, p.node_id) and job_id not in state.ended:
                plan = state.plans.get(job_id, RunPlan(0.0, 0, 86400.0)).of(p.attempt)
                state.started.setdefault(job_id, set()).add((p.replica, p.attempt))
                run = Running(
                    job_id, env.tenant, p.replica, p.node_id,
                    env.occurred_at.timestamp(), env.event_id, plan, p.attempt,
                )
                stale = state.running.get((job_id, run.replica))
                if stale is not None and stale.attempt < run.attempt:
                    del state.running[(job_id, run.replica)]  # an earlier attempt whose exit never came
                if (job_id, run.replica) not in state.running:
                    state.running[(job_id, run.replica)] = run
                    state.replicas_of.setdefault(job_id, []).append(run.replica)
                    ends = run.started_at_s + min(plan.duration_s, plan.max_runtime_s)
                    heapq.heappush(state.deadlines, (ends, job_id, run.replica))
        elif isinstance(p, JobExited):
            if p.node_id in self.driver_nodes:
                state.exits_logged.add(workload_key(job_id, p.replica, p.attempt))
                gone = state.abandoned.get((job_id, p.replica))
                if gone is not None and gone.attempt == p.attempt:
                    del state.abandoned[(job_id, p.replica)]
                d = state.desired.get((job_id, p.replica))
                if d is not None and d.attempt == p.attempt:
                    del state.desired[(job_id, p.replica)]
            current = state.running.get((job_id, p.replica))
            if current is not None and current.attempt != p.attempt:
                return state  # the exit of an earlier attempt of this replica
            if state.running.pop((job_id, p.replica), None) is not None:
                while state.deadlines and (state.deadlines[0][1], state.deadlines[0][2]) not in state.running:
                    heapq.heappop(state.deadlines)  # entries of ended replicas, now at the top
                replicas = state.replicas_of.get(job_id, [])
                if p.replica in replicas:
                    replicas.remove(p.replica)
                if not replicas:
                    state.replicas_of.pop(job_id, None)
        elif t == "job.cancel_requested":
            state.cancelling.add(job_id)
            state.stop_reason.setdefault(job_id, "cancelled")
        elif isinstance(p, JobPreemptionRequested):
            state.stop_reason.setdefault(job_id, "preempted")
            state.stop_grace.setdefault(job_id, p.grace_s)
        elif t in ("job.succeeded", "job.failed", "job.cancelled", "job.preempted"):
            for forgotten in state.ended.add(job_id, env.occurred_at):
                state.stop_reason.pop(forgotten, None)  # (kept past the end: a late exit's reason)
            state.cancelling.discard(job_id)
            state.plans.pop(job_id, None)
            state.started.pop(job_id, None)
            state.specs.pop(job_id, None)
            state.attempt.pop(job_id, None)
            state.stop_grace.pop(job_id, None)
            state.resume_from.pop(job_id, None)
            state.stop_reason.setdefault(job_id, _KILL_REASONS.get(t, "killed"))
            for key in [k for k in state.desired if k[0] == job_id]:
                del state.desired[key]
            for key in [k for k in state.abandoned if k[0] == job_id]:
                del state.abandoned[key]
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
            for a in p.allocations:
                if a.node_id in self.driver_nodes:
                    continue  # started by the agent once its driver has it running (reconcile)
                if (self.hosts(state, a.node_id) and (job_id, a.replica) not in state.running
                        and (a.replica, p.attempt) not in state.started.get(job_id, ())):
                    if job_id in state.cancelling:
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
            return [
                self._exit(r, ctx, EXIT_KILLED, reason, "kill")
                for r in self._replicas(state, job_id)
                if r.node_id not in self.driver_nodes
                and (t != "job.resume_requested" or r.attempt < state.attempt.get(job_id, 1))
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
            run = state.running.get((job_id, replica))
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
                for r in sorted((r for r in state.running.values() if r.node_id == node_id),
                                key=lambda r: (r.job_id, r.replica)):
                    out.append(self._exit(r, ctx, EXIT_KILLED, "node_lost", "exit"))
                out.append(ctx.emit(NodeDeregistered(node_id=node_id, reason="removed by its pool's provider (sim)"),
                                    tenant=SYS_TENANT, cause_id=pn.removal_event_id, key="deregistered"))
            elif node_id not in state.registered and node_id not in state.lost and now >= pn.ready_at_s:
                out.append(ctx.emit(NodeRegistered(node_id=node_id, inventory=pn.inventory), tenant=SYS_TENANT,
                                    cause_id=pn.requested_event_id, key=f"register:{inventory_digest(pn.inventory)}"))
        return out

    @staticmethod
    def _replicas(state: ExecutorState, job_id: str) -> list[Running]:
        return [state.running[(job_id, i)] for i in state.replicas_of.get(job_id, ())]

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
    spec = state.specs.get(job_id)
    a = d.alloc
    uuids = {g.index: g.uuid for g in node.gpus}
    gpu_uuids = a.mig_devices or tuple(uuids[i] for i in a.gpu_indices if i in uuids)
    ckpt = None
    if checkpoint_root and spec is not None and spec.type in CHECKPOINTED_TYPES:
        ckpt = checkpoint_location(checkpoint_root, d.tenant, job_id, spec.checkpoint.path if spec.checkpoint else None)
    env = dict(spec.env) if spec else {}
    if spec is not None and spec.checkpoint is not None:
        env.setdefault("GPUFLEET_CHECKPOINT_KEEP", str(spec.checkpoint.keep))
    resume = state.resume_from.get(job_id)
    if resume:
        env["GPUFLEET_RESUME_FROM"] = resume
    return Launch(
        job_id=job_id, tenant=d.tenant, replica=a.replica, attempt=d.attempt, node_id=a.node_id,
        command=spec.command if spec else (), image=spec.image if spec else None,
        env=env, gpu_indices=a.gpu_indices, gpu_uuids=gpu_uuids,
        cpu_milli=a.cpu_milli, memory_mib=a.memory_mib,
        max_runtime_s=spec.max_runtime_s if spec else 86400.0, checkpoint_dir=ckpt,
        placed_event_id=d.placed_event_id,
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
        d = state.desired.get((w.job_id, w.replica))
        current = d is not None and d.attempt == w.attempt
        run = state.running.get((w.job_id, w.replica))
        run = run if run is not None and run.attempt == w.attempt else None
        if current:
            seen.add((w.job_id, w.replica))
        logged_exit = w.key in state.exits_logged
        if w.running:
            if current and run is None and not logged_exit and d is not None:
                actions.append(Adopt(w, d))
            spec = state.specs.get(w.job_id)
            if not current or logged_exit or w.job_id in state.stop_reason or w.job_id in state.ended:
                grace = state.stop_grace.get(w.job_id, grace_s)  # a preemption says how long the job has
                actions.append(Stop(w.key, state.stop_reason.get(w.job_id, "killed"), grace))
            elif spec is not None and now - w.started_at >= spec.max_runtime_s:
                actions.append(Stop(w.key, "timeout", grace_s))
        else:
            ab = state.abandoned.get((w.job_id, w.replica))
            ab = ab if ab is not None and ab.attempt == w.attempt else None
            if logged_exit or (not current and run is None and ab is None):
                actions.append(Cleanup(w.key))
            else:
                actions.append(ReportExit(w, exit_reason(state, w, now), run, d if current else ab))
    for (job_id, replica), d in sorted(state.abandoned.items()):
        key = workload_key(job_id, replica, d.attempt)
        if d.alloc.node_id in nodes and key not in state.exits_logged and key not in {w.key for w in observed}:
            never = Workload(job_id, replica, d.attempt, d.alloc.node_id, handle="", running=False,
                             exit_code=EXIT_KILLED, started_at=now)
            actions.append(ReportExit(never, "killed", None, d))
    for (job_id, replica), d in sorted(state.desired.items()):
        if (job_id, replica) in seen or d.alloc.node_id not in nodes:
            continue
        key = workload_key(job_id, replica, d.attempt)
        if key in state.exits_logged:
            continue
        run = state.running.get((job_id, replica))
        if run is not None and run.attempt == d.attempt:
            # started, and now the driver has no trace of it (the node rebooted, its data was lost)
            gone = Workload(job_id, replica, d.attempt, d.alloc.node_id, handle="", running=False,
                            exit_code=LOST_EXIT, started_at=run.started_at_s)
            actions.append(ReportExit(gone, "node_lost", run, d))
        elif job_id in state.stop_reason or job_id in state.ended:
            never = Workload(job_id, replica, d.attempt, d.alloc.node_id, handle="", running=False,
                             exit_code=EXIT_KILLED, started_at=now)
            actions.append(ReportExit(never, state.stop_reason.get(job_id, "cancelled"), None, d))
        else:
            actions.append(Start(launch_for(state, job_id, d, nodes[d.alloc.node_id], checkpoint_root), d))
    return actions


def exit_reason(state: ExecutorState, w: Workload, now: float) -> ExitReason:
    spec = state.specs.get(w.job_id)
    if w.stopped_by_us:
        if w.job_id in state.stop_reason:
            return state.stop_reason[w.job_id]
        if spec is not None and now - w.started_at >= spec.max_runtime_s:
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
                 checkpoint: tuple[str, int, float] | None = None) -> Envelope:
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
                        checkpoint_saved_at=utc(checkpoint[2]) if checkpoint and checkpoint[2] else None)
    if a.run is None and a.desired is not None:  # never started: the exit takes the start's slot
        return ctx.emit(payload, tenant=tenant, cause_id=cause, key=f"start:{w.replica}")
    return ctx.emit(payload, tenant=tenant, cause_id=cause, key=f"exit:{w.attempt}")
