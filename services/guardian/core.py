"""Checkpoint guardian: turn how replicas exited into how the job ended.

folds: job gangs (replica count), exits, attempts      decides: job.succeeded | job.failed |
                                                       job.cancelled | job.resume_requested
A replica lost with its node is not the job's fault: the job runs again (`job.resume_requested`,
from its last checkpoint if it saved one) while its retry budget (`maxRetries`) lasts, then fails
with `retries_exhausted`. (Checkpoint locations, verification and backoff come with the guardian issue.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufleet.shared.events import (
    Envelope,
    JobCancelled,
    JobCheckpointSaved,
    JobExited,
    JobFailed,
    JobPreempted,
    JobResumeRequested,
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
    max_retries: dict[str, int] = field(default_factory=dict)
    attempt: dict[str, int] = field(default_factory=dict)
    checkpoint: dict[str, tuple[str, float]] = field(default_factory=dict)  # job -> (uri, saved at)


class GuardianCore(BaseCore[GuardianState]):
    name = "guardian"
    subjects = (
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.exited",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.rejected", "fleet.evt.*.job.*.preempted", "fleet.evt.*.job.*.resume_requested",
        "fleet.evt.*.job.*.checkpoint_saved",
    )

    def initial_state(self) -> GuardianState:
        return GuardianState()

    def evolve(self, state: GuardianState, env: Envelope) -> GuardianState:
        p, job_id = env.payload, env.job_id
        if job_id is None:
            return state
        if isinstance(p, JobSubmitted):
            state.replicas[job_id] = p.spec.replicas
            state.max_retries[job_id] = p.spec.max_retries
        elif isinstance(p, JobExited):
            if job_id not in state.ended and p.attempt >= state.attempt.get(job_id, 1):
                state.exits.setdefault(job_id, {})[p.replica] = p
        elif isinstance(p, JobResumeRequested):
            if job_id not in state.ended:
                state.attempt[job_id] = state.attempt.get(job_id, 1) + 1
                state.exits.pop(job_id, None)
        elif isinstance(p, JobCheckpointSaved):
            state.checkpoint[job_id] = (p.uri, env.occurred_at.timestamp())
        else:
            state.ended.add(job_id)
            for d in (state.exits, state.replicas, state.max_retries, state.attempt, state.checkpoint):
                d.pop(job_id, None)
        return state

    def decide(self, state: GuardianState, env: Envelope, ctx: Ctx) -> list[Envelope]:
        if env.type != "job.exited" or env.job_id in state.ended:
            return []
        p = env.payload
        assert isinstance(p, JobExited)
        attempt = state.attempt.get(p.job_id, 1)
        if p.attempt < attempt:
            return []  # a replica of an attempt that was already started again
        if p.reason == "node_lost":
            retries = attempt - 1
            budget = state.max_retries.get(p.job_id, 3)
            if retries >= budget:
                return [ctx.emit(JobFailed(job_id=p.job_id, reason=Reason(code="retries_exhausted", message=(
                    f"replica {p.replica} lost with node {p.node_id}, and its {budget} retries are used up")),
                    exit_code=p.exit_code), key="end")]
            ckpt = state.checkpoint.get(p.job_id)
            now = ctx.now.timestamp()
            lost = now - ckpt[1] if ckpt else p.runtime_s
            return [ctx.emit(JobResumeRequested(
                job_id=p.job_id, checkpoint_uri=ckpt[0] if ckpt else None, lost_work_s=round(max(0.0, lost), 3),
                reason=Reason(code="node_lost", message=(
                    f"replica {p.replica} lost with node {p.node_id}; run {attempt + 1} of at most {budget + 1}, "
                    + (f"from checkpoint {ckpt[0]}" if ckpt else "from the start")))), key=f"resume:{attempt}")]
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
