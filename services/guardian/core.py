"""Checkpoint guardian: turn how replicas exited into how the job ended.

folds: job gangs (replica count), exits      decides: job.succeeded | job.failed | job.cancelled
(Checkpoint locations, verification and resume come with the guardian issue.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufleet.shared.events import (
    Envelope,
    JobCancelled,
    JobExited,
    JobFailed,
    JobPreempted,
    JobSubmitted,
    JobSucceeded,
    Reason,
)
from gpufleet.shared.runtime import BaseCore, Ctx


@dataclass
class GuardianState:
    replicas: dict[str, int] = field(default_factory=dict)
    exits: dict[str, dict[int, JobExited]] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)


class GuardianCore(BaseCore[GuardianState]):
    name = "guardian"
    subjects = (
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.exited",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.rejected", "fleet.evt.*.job.*.preempted",
    )

    def initial_state(self) -> GuardianState:
        return GuardianState()

    def evolve(self, state: GuardianState, env: Envelope) -> GuardianState:
        p, job_id = env.payload, env.job_id
        if job_id is None:
            return state
        if isinstance(p, JobSubmitted):
            state.replicas[job_id] = p.spec.replicas
        elif isinstance(p, JobExited):
            if job_id not in state.ended:
                state.exits.setdefault(job_id, {})[p.replica] = p
        else:
            state.ended.add(job_id)
            state.exits.pop(job_id, None)
            state.replicas.pop(job_id, None)
        return state

    def decide(self, state: GuardianState, env: Envelope, ctx: Ctx) -> list[Envelope]:
        if env.type != "job.exited" or env.job_id in state.ended:
            return []
        p = env.payload
        assert isinstance(p, JobExited)
        if p.reason == "cancelled":
            return [ctx.emit(JobCancelled(job_id=p.job_id, reason="cancelled by user"), key="end")]
        if p.reason == "preempted":
            return [ctx.emit(JobPreempted(job_id=p.job_id, reason=Reason(
                code="preempted", message=f"replica {p.replica} on {p.node_id} stopped to give its quota back")),
                key="end")]
        if p.exit_code != 0:
            code = "timeout" if p.reason == "timeout" else "exit_code"
            message = (f"ran past its max runtime ({p.runtime_s:.0f}s)" if p.reason == "timeout"
                       else f"replica {p.replica} on {p.node_id} exited with code {p.exit_code} ({p.reason})")
            return [ctx.emit(JobFailed(job_id=p.job_id, reason=Reason(code=code, message=message),
                                       exit_code=p.exit_code), key="end")]
        exits = state.exits.get(p.job_id, {})
        if len(exits) >= state.replicas.get(p.job_id, 1) and all(e.exit_code == 0 for e in exits.values()):
            return [ctx.emit(JobSucceeded(job_id=p.job_id), key="end")]
        return []
