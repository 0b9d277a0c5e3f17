"""Checkpoint guardian: turn how replicas exited into how the job ended.

folds: job gangs (replica count), exits, attempts      decides: job.succeeded | job.failed |
                                                       job.cancelled | job.resume_requested
A replica lost with its node is not the job's fault: the job runs again (`job.resume_requested`,
from its last checkpoint if it saved one) while its retry budget (`maxRetries`) lasts, then fails
with `retries_exhausted`.

Checkpoints: `watch` (called by the agent with what it found in a running training job's
location) verifies the location at the start of every run (`job.checkpoint_verified`, naming
the latest good checkpoint and the partial / corrupt ones it skips, or `job.failed` when the
location cannot be written), reports each new good checkpoint (`job.checkpoint_saved`), each bad
one once (`job.checkpoint_invalid`), and warns when the last one is older than the job's policy
(`job.checkpoint_overdue`). A resume names the last good checkpoint and the work lost since.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufleet.shared.checkpoints import CHECKPOINTED_TYPES, Scanned
from gpufleet.shared.events import (
    Envelope,
    JobCancelled,
    JobCheckpointInvalid,
    JobCheckpointOverdue,
    JobCheckpointSaved,
    JobCheckpointVerified,
    JobExited,
    JobFailed,
    JobPreempted,
    JobResumeRequested,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    Reason,
    utc,
)
from gpufleet.shared.runtime import BaseCore, Ctx
from gpufleet.shared.spec import JobSpec


@dataclass
class GuardianState:
    replicas: dict[str, int] = field(default_factory=dict)
    exits: dict[str, dict[int, JobExited]] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)
    max_retries: dict[str, int] = field(default_factory=dict)
    attempt: dict[str, int] = field(default_factory=dict)
    checkpoint: dict[str, tuple[str, float]] = field(default_factory=dict)  # job -> (uri, saved at)
    specs: dict[str, JobSpec] = field(default_factory=dict)  # training / finetune jobs only
    tenants: dict[str, str] = field(default_factory=dict)
    started: dict[str, tuple[int, float, str]] = field(default_factory=dict)  # job -> (attempt, at, event id)
    step: dict[str, int] = field(default_factory=dict)  # job -> the newest checkpoint step reported
    verified: set[tuple[str, int]] = field(default_factory=set)  # (job, attempt)
    invalid_said: set[tuple[str, int]] = field(default_factory=set)  # (job, step)
    overdue_said: set[tuple[str, int, int]] = field(default_factory=set)  # (job, attempt, last step)

    def watched(self) -> list[str]:
        """Training / finetune jobs running now: their locations are watched."""
        return sorted(j for j in self.started if j in self.specs and j not in self.ended)


class GuardianCore(BaseCore[GuardianState]):
    name = "guardian"
    subjects = (
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.exited",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.rejected", "fleet.evt.*.job.*.preempted", "fleet.evt.*.job.*.resume_requested",
        "fleet.evt.*.job.*.checkpoint_saved", "fleet.evt.*.job.*.started", "fleet.evt.*.job.*.checkpoint_verified",
        "fleet.evt.*.job.*.checkpoint_invalid", "fleet.evt.*.job.*.checkpoint_overdue",
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
            state.tenants[job_id] = env.tenant
            if p.spec.type in CHECKPOINTED_TYPES:
                state.specs[job_id] = p.spec
        elif isinstance(p, JobStarted):
            # (a sim run writes no checkpoints: only real drivers' runs are watched)
            if (job_id in state.specs and p.driver != "sim" and job_id not in state.ended
                    and p.attempt >= state.started.get(job_id, (0, 0.0, ""))[0]):
                state.started[job_id] = (p.attempt, env.occurred_at.timestamp(), env.event_id)
        elif isinstance(p, JobCheckpointVerified):
            state.verified.add((job_id, p.attempt))
        elif isinstance(p, JobCheckpointInvalid):
            state.invalid_said.add((job_id, p.step))
        elif isinstance(p, JobCheckpointOverdue):
            attempt = state.started.get(job_id, (1, 0.0, ""))[0]
            state.overdue_said.add((job_id, attempt, state.step.get(job_id, -1)))
        elif isinstance(p, JobExited):
            if job_id not in state.ended and p.attempt >= state.attempt.get(job_id, 1):
                state.exits.setdefault(job_id, {})[p.replica] = p
        elif isinstance(p, JobResumeRequested):
            if job_id not in state.ended:
                state.attempt[job_id] = state.attempt.get(job_id, 1) + 1
                state.exits.pop(job_id, None)
        elif isinstance(p, JobCheckpointSaved):
            at = p.saved_at.timestamp() if p.saved_at else env.occurred_at.timestamp()
            if p.step >= state.step.get(job_id, -1):
                state.checkpoint[job_id] = (p.uri, at)
                state.step[job_id] = p.step
        else:
            state.ended.add(job_id)
            for d in (state.exits, state.replicas, state.max_retries, state.attempt, state.checkpoint, state.specs,
                      state.tenants, state.started, state.step):
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

    # ------------------------------------------------------------ checkpoints (the agent's observations)

    def watch(self, state: GuardianState, job_id: str, location: str, unwritable: str | None,
              scans: list[Scanned], now: float, ctx: Ctx) -> list[Envelope]:
        """Facts about a running training job's checkpoint location, from what the agent found."""
        spec = state.specs.get(job_id)
        started = state.started.get(job_id)
        if spec is None or started is None or job_id in state.ended:
            return []
        attempt, started_at, started_id = started
        tenant = state.tenants.get(job_id, spec.tenant)
        out: list[Envelope] = []
        good = [s for s in scans if s.checkpoint is not None]
        latest = good[0] if good else None
        newer_bad = [s for s in scans if s.checkpoint is None and (latest is None or s.step > latest.step)]
        if (job_id, attempt) not in state.verified:
            if unwritable is not None:
                return [ctx.emit(JobFailed(job_id=job_id, reason=Reason(
                    code="checkpoint_location_unwritable", message=unwritable, field="checkpoint.path")),
                    tenant=tenant, cause_id=started_id, key="end")]
            out.append(ctx.emit(JobCheckpointVerified(
                job_id=job_id, location=location, attempt=attempt,
                latest_uri=latest.checkpoint.uri if latest and latest.checkpoint else None,
                latest_step=latest.step if latest else None,
                skipped=tuple(Reason(code="checkpoint_invalid", message=s.reason, field=s.path.resolve().as_uri())
                              for s in newer_bad)), tenant=tenant, cause_id=started_id, key=f"verify:{attempt}"))
        reported = state.step.get(job_id, -1)
        for s in sorted(good, key=lambda s: s.step):
            c = s.checkpoint
            if c is not None and s.step > reported:
                out.append(ctx.emit(JobCheckpointSaved(
                    job_id=job_id, uri=c.uri, step=c.step, size_bytes=c.size_bytes, sha256=c.sha256,
                    saved_at=utc(c.created_at) if c.created_at else None),
                    tenant=tenant, cause_id=started_id, key=f"ckpt:{c.step}"))
        for s in newer_bad:
            if (job_id, s.step) not in state.invalid_said and s.step > reported:
                out.append(ctx.emit(JobCheckpointInvalid(
                    job_id=job_id, uri=s.path.resolve().as_uri(), step=s.step, reason=s.reason),
                    tenant=tenant, cause_id=started_id, key=f"invalid:{s.step}"))
        limit = 2 * (spec.checkpoint.interval_s if spec.checkpoint else 1800.0)
        last = state.checkpoint.get(job_id)
        since = max(last[1] if last else 0.0, started_at)
        last_step = max([state.step.get(job_id, -1), *(s.step for s in good)])
        if now - since > limit and (job_id, attempt, last_step) not in state.overdue_said and not any(
                s.step > state.step.get(job_id, -1) for s in good):
            out.append(ctx.emit(JobCheckpointOverdue(
                job_id=job_id, age_s=round(now - since, 3), limit_s=limit, last_uri=last[0] if last else None),
                tenant=tenant, cause_id=started_id, key=f"overdue:{attempt}:{last_step}"))
        return out
