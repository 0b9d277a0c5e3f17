"""Executor: run the replicas placed on this executor's nodes and report how they end.

folds: its nodes, job specs, running replicas     decides: node.registered, job.started,
                                                           job.exited (end, cancel, timeout)
This core is the `sim` driver: a replica "runs" for `spec.sim.duration` (or until its max
runtime) and exits with `spec.sim.exitCode`; one process can host thousands of sim nodes.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from gpufleet.shared.cluster import inventory_digest
from gpufleet.shared.events import (
    SYS_TENANT,
    Envelope,
    ExitReason,
    JobExited,
    JobPlaced,
    JobStarted,
    JobSubmitted,
    NodeInventory,
    NodeRegistered,
)
from gpufleet.shared.runtime import BaseCore, Ctx

EXIT_TIMEOUT = 124
EXIT_KILLED = 137
_KILL_REASONS: dict[str, ExitReason] = {
    "job.preempted": "preempted", "job.preemption_requested": "preempted", "job.failed": "killed"}


@dataclass(frozen=True)
class RunPlan:
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


@dataclass
class ExecutorState:
    registered: dict[str, str] = field(default_factory=dict)  # node_id -> inventory digest
    plans: dict[str, RunPlan] = field(default_factory=dict)
    running: dict[tuple[str, int], Running] = field(default_factory=dict)
    replicas_of: dict[str, list[int]] = field(default_factory=dict)  # job_id -> running replicas
    # (when it ends, job_id, replica): a tick looks only at what is due, not at every replica
    deadlines: list[tuple[float, str, int]] = field(default_factory=list)
    ended: set[str] = field(default_factory=set)
    cancelling: set[str] = field(default_factory=set)  # asked to stop: a late placement does not run
    # job_id -> (replica, attempt) started here: a placement redelivered after its replica exited starts nothing
    started: dict[str, set[tuple[int, int]]] = field(default_factory=dict)


class ExecutorCore(BaseCore[ExecutorState]):
    name = "executor"
    subjects = (
        "fleet.evt.sys.node.*.registered",
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.placed", "fleet.evt.*.job.*.started",
        "fleet.evt.*.job.*.exited", "fleet.evt.*.job.*.cancel_requested",
        "fleet.evt.*.job.*.preemption_requested",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.preempted",
    )
    tick_s = 0.2

    def __init__(self, nodes: dict[str, NodeInventory]) -> None:
        self.nodes = nodes

    def initial_state(self) -> ExecutorState:
        return ExecutorState()

    def evolve(self, state: ExecutorState, env: Envelope) -> ExecutorState:
        t, p = env.type, env.payload
        if isinstance(p, NodeRegistered):
            if p.node_id in self.nodes:
                state.registered[p.node_id] = inventory_digest(p.inventory)
            return state
        job_id = env.job_id
        if job_id is None:
            return state
        if isinstance(p, JobSubmitted):
            spec = p.spec
            state.plans[job_id] = RunPlan(spec.sim.duration_s, spec.sim.exit_code, spec.max_runtime_s)
        elif isinstance(p, JobStarted):
            if p.node_id in self.nodes and job_id not in state.ended:
                plan = state.plans.get(job_id, RunPlan(0.0, 0, 86400.0))
                state.started.setdefault(job_id, set()).add((p.replica, p.attempt))
                run = Running(
                    job_id, env.tenant, p.replica, p.node_id,
                    env.occurred_at.timestamp(), env.event_id, plan,
                )
                if (job_id, run.replica) not in state.running:
                    state.running[(job_id, run.replica)] = run
                    state.replicas_of.setdefault(job_id, []).append(run.replica)
                    ends = run.started_at_s + min(plan.duration_s, plan.max_runtime_s)
                    heapq.heappush(state.deadlines, (ends, job_id, run.replica))
        elif isinstance(p, JobExited):
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
        elif t in ("job.succeeded", "job.failed", "job.cancelled", "job.preempted"):
            state.ended.add(job_id)
            state.cancelling.discard(job_id)
            state.plans.pop(job_id, None)
            state.started.pop(job_id, None)
        return state

    def on_start(self, state: ExecutorState, ctx: Ctx) -> list[Envelope]:
        out = []
        for node_id, inv in self.nodes.items():
            digest = inventory_digest(inv)
            if state.registered.get(node_id) != digest:
                out.append(ctx.emit(NodeRegistered(node_id=node_id, inventory=inv), tenant=SYS_TENANT,
                                    key=f"register:{node_id}:{digest}"))
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
                if (a.node_id in self.nodes and (job_id, a.replica) not in state.running
                        and (a.replica, p.attempt) not in state.started.get(job_id, ())):
                    if job_id in state.cancelling:
                        # the cancel overtook this placement: never start it, free what it holds
                        out.append(ctx.emit(JobExited(
                            job_id=job_id, node_id=a.node_id, replica=a.replica, exit_code=EXIT_KILLED,
                            reason="cancelled",
                        ), key=f"start:{a.replica}"))
                        continue
                    out.append(ctx.emit(JobStarted(
                        job_id=job_id, node_id=a.node_id, replica=a.replica, driver="sim",
                        attempt=p.attempt,
                    ), key=f"start:{a.replica}"))
            return out
        # (the grace period of a preemption is the guardian's to use for a checkpoint; the sim
        # driver has nothing to save and stops at once)
        if t in ("job.cancel_requested", "job.cancelled", "job.preempted", "job.failed", "job.preemption_requested"):
            # a cancelled / preempted job, or the rest of a gang one of whose replicas failed
            reason = _KILL_REASONS.get(t, "cancelled")
            return [
                self._exit(r, ctx, EXIT_KILLED, reason, "kill")
                for r in self._replicas(state, job_id)
            ]
        return []

    def tick(self, state: ExecutorState, ctx: Ctx) -> list[Envelope]:
        now = ctx.now.timestamp()
        out = []
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
            if run is not None and ends == run.started_at_s + min(run.plan.duration_s, run.plan.max_runtime_s):
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

    @staticmethod
    def _replicas(state: ExecutorState, job_id: str) -> list[Running]:
        return [state.running[(job_id, i)] for i in state.replicas_of.get(job_id, ())]

    @staticmethod
    def _exit(r: Running, ctx: Ctx, code: int, reason: ExitReason, key: str) -> Envelope:
        runtime = max(0.0, ctx.now.timestamp() - r.started_at_s)
        return ctx.emit(
            JobExited(job_id=r.job_id, node_id=r.node_id, replica=r.replica, exit_code=code,
                      reason=reason, runtime_s=round(runtime, 3)),
            tenant=r.tenant, cause_id=r.started_event_id, key=key,
        )
