"""Executor: run the replicas placed on this executor's nodes and report how they end.

folds: its nodes, job specs, running replicas     decides: node.registered, job.started,
                                                           job.exited (end, cancel, timeout)
This core is the `sim` driver: a replica "runs" for `spec.sim.duration` (or until its max
runtime) and exits with `spec.sim.exitCode`; one process can host thousands of sim nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufleet.shared.cluster import inventory_digest
from gpufleet.shared.events import SYS_TENANT, Envelope, JobExited, JobStarted, NodeInventory, NodeRegistered
from gpufleet.shared.runtime import BaseCore, Ctx

EXIT_TIMEOUT = 124
EXIT_KILLED = 137


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
    ended: set[str] = field(default_factory=set)


class ExecutorCore(BaseCore[ExecutorState]):
    name = "executor"
    subjects = (
        "fleet.evt.sys.node.*.registered",
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.placed", "fleet.evt.*.job.*.started",
        "fleet.evt.*.job.*.exited", "fleet.evt.*.job.*.cancel_requested",
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
        if t == "node.registered":
            if p.node_id in self.nodes:  # type: ignore[union-attr]
                state.registered[p.node_id] = inventory_digest(p.inventory)  # type: ignore[union-attr]
            return state
        job_id = env.job_id
        if job_id is None:
            return state
        if t == "job.submitted":
            spec = p.spec  # type: ignore[union-attr]
            state.plans[job_id] = RunPlan(spec.sim.duration_s, spec.sim.exit_code, spec.max_runtime_s)
        elif t == "job.started":
            if p.node_id in self.nodes and job_id not in state.ended:  # type: ignore[union-attr]
                plan = state.plans.get(job_id, RunPlan(0.0, 0, 86400.0))
                state.running[(job_id, p.replica)] = Running(  # type: ignore[union-attr]
                    job_id, env.tenant, p.replica, p.node_id,  # type: ignore[union-attr]
                    env.occurred_at.timestamp(), env.event_id, plan,
                )
        elif t == "job.exited":
            state.running.pop((job_id, p.replica), None)  # type: ignore[union-attr]
        elif t in ("job.succeeded", "job.failed", "job.cancelled", "job.preempted"):
            state.ended.add(job_id)
            state.plans.pop(job_id, None)
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
        if t == "job.placed":
            if job_id in state.ended:
                return []
            out = []
            for a in p.allocations:  # type: ignore[union-attr]
                if a.node_id in self.nodes and (job_id, a.replica) not in state.running:
                    out.append(ctx.emit(JobStarted(
                        job_id=job_id, node_id=a.node_id, replica=a.replica, driver="sim",
                        attempt=p.attempt,  # type: ignore[union-attr]
                    ), key=f"start:{a.replica}"))
            return out
        if t in ("job.cancel_requested", "job.cancelled", "job.preempted", "job.failed"):
            # a cancelled / preempted job, or the rest of a gang one of whose replicas failed
            reason = {"job.preempted": "preempted", "job.failed": "killed"}.get(t, "cancelled")
            return [
                self._exit(r, ctx, EXIT_KILLED, reason, "kill")
                for r in self._replicas(state, job_id)
            ]
        return []

    def tick(self, state: ExecutorState, ctx: Ctx) -> list[Envelope]:
        now = ctx.now.timestamp()
        out = []
        for r in list(state.running.values()):
            elapsed = now - r.started_at_s
            if elapsed >= r.plan.max_runtime_s and r.plan.max_runtime_s < r.plan.duration_s:
                out.append(self._exit(r, ctx, EXIT_TIMEOUT, "timeout", "exit"))
            elif elapsed >= r.plan.duration_s:
                out.append(self._exit(r, ctx, r.plan.exit_code, "completed" if r.plan.exit_code == 0 else "error", "exit"))
        return out

    @staticmethod
    def _replicas(state: ExecutorState, job_id: str) -> list[Running]:
        return [r for (j, _), r in state.running.items() if j == job_id]

    @staticmethod
    def _exit(r: Running, ctx: Ctx, code: int, reason: str, key: str) -> Envelope:
        runtime = max(0.0, ctx.now.timestamp() - r.started_at_s)
        return ctx.emit(
            JobExited(job_id=r.job_id, node_id=r.node_id, replica=r.replica, exit_code=code,
                      reason=reason, runtime_s=round(runtime, 3)),  # type: ignore[arg-type]
            tenant=r.tenant, cause_id=r.started_event_id, key=key,
        )
