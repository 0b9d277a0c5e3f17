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
from gpufleet.shared.clusterconfig import ClusterConfig
from gpufleet.shared.events import (
    Envelope,
    JobCancelled,
    JobCheckpointInvalid,
    JobCheckpointOverdue,
    JobCheckpointSaved,
    JobCheckpointVerified,
    JobExited,
    JobFailed,
    JobIdleDetected,
    JobIdleEnded,
    JobPlaced,
    JobPreempted,
    JobPreemptionRequested,
    JobResumeRequested,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NodeGpuUnhealthy,
    Reason,
    resumed_attempt,
    utc,
)
from gpufleet.shared.retention import EndedJobs
from gpufleet.shared.runtime import BaseCore, Ctx
from gpufleet.shared.spec import JobSpec


@dataclass
class GuardianState:
    replicas: dict[str, int] = field(default_factory=dict)
    exits: dict[str, dict[int, JobExited]] = field(default_factory=dict)
    ended: EndedJobs = field(default_factory=EndedJobs)  # forgotten after a window of log time
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
    placed: dict[str, tuple[int, frozenset[tuple[str, int]]]] = field(default_factory=dict)  # job -> (attempt, GPUs)
    on_failure: dict[str, float] = field(default_factory=dict)  # job -> retry backoff base (restartPolicy OnFailure)
    # job -> (due, attempt, exit): a crashed run waiting out its backoff before it runs again
    retry_at: dict[str, tuple[float, int, JobExited, str]] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)  # job -> runs that failed (the retry budget)
    idle_since: dict[str, tuple[float, str]] = field(default_factory=dict)  # job -> (warned idle at, event id)
    running: set[str] = field(default_factory=set)  # watched jobs with a run going now
    preempt_pending: set[str] = field(default_factory=set)  # asked to give quota back, not yet done
    good: dict[str, dict[int, tuple[str, float]]] = field(default_factory=dict)  # job -> step -> (uri, at)
    reclaiming: set[str] = field(default_factory=set)  # idle jobs asked to stop: they end, not resume

    def watched(self) -> list[str]:
        """Training / finetune jobs running now: their locations are watched."""
        return sorted(j for j in self.running if j in self.specs and j not in self.ended)


class GuardianCore(BaseCore[GuardianState]):
    name = "guardian"
    subjects = (
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.exited",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.rejected", "fleet.evt.*.job.*.preempted", "fleet.evt.*.job.*.resume_requested",
        "fleet.evt.*.job.*.checkpoint_saved", "fleet.evt.*.job.*.started", "fleet.evt.*.job.*.checkpoint_verified",
        "fleet.evt.*.job.*.checkpoint_invalid", "fleet.evt.*.job.*.checkpoint_overdue", "fleet.evt.*.job.*.placed",
        "fleet.evt.sys.node.*.gpu_unhealthy", "fleet.evt.*.job.*.idle_detected", "fleet.evt.*.job.*.idle_ended",
        "fleet.evt.*.job.*.preemption_requested",
    )
    tick_s = 1.0

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()

    def initial_state(self) -> GuardianState:
        return GuardianState()

    def evolve(self, state: GuardianState, env: Envelope) -> GuardianState:
        p, job_id = env.payload, env.job_id
        if job_id is None:
            return state
        if isinstance(p, JobPlaced):
            if job_id not in state.ended:
                state.placed[job_id] = (p.attempt, frozenset((a.node_id, g) for a in p.allocations
                                                             for g in a.gpu_indices))
            return state
        if isinstance(p, JobSubmitted):
            state.replicas[job_id] = p.spec.replicas
            state.max_retries[job_id] = p.spec.max_retries
            state.tenants[job_id] = env.tenant
            if p.spec.restart_policy == "OnFailure":
                state.on_failure[job_id] = p.spec.retry_backoff_s
            if p.spec.type in CHECKPOINTED_TYPES:
                state.specs[job_id] = p.spec
        elif isinstance(p, JobStarted):
            # (a sim run writes no checkpoints: only real drivers' runs are watched)
            if (job_id in state.specs and p.driver != "sim" and job_id not in state.ended
                    and p.attempt >= state.started.get(job_id, (0, 0.0, ""))[0]):
                state.started[job_id] = (p.attempt, env.occurred_at.timestamp(), env.event_id)
                state.running.add(job_id)
        elif isinstance(p, JobIdleDetected):
            policy = self.config.policy(env.tenant)
            if policy is not None and policy.idle_action == "reclaim" and job_id not in state.ended:
                state.idle_since.setdefault(job_id, (env.occurred_at.timestamp(), env.event_id))
        elif isinstance(p, JobIdleEnded):
            state.idle_since.pop(job_id, None)
        elif isinstance(p, JobPreemptionRequested):
            if p.reason.code == "idle_reclaimed":
                state.reclaiming.add(job_id)
            state.idle_since.pop(job_id, None)
            if job_id not in state.ended:
                state.preempt_pending.add(job_id)
        elif isinstance(p, JobCheckpointVerified):
            state.verified.add((job_id, p.attempt))
        elif isinstance(p, JobCheckpointInvalid):
            state.invalid_said.add((job_id, p.step))
            good = state.good.get(job_id, {})
            if good.pop(p.step, None) is not None and state.step.get(job_id) == p.step:
                # a checkpoint reported good went bad: the previous good one is the one to resume from
                if good:
                    step = max(good)
                    state.checkpoint[job_id], state.step[job_id] = good[step], step
                else:
                    state.checkpoint.pop(job_id, None)
                    state.step.pop(job_id, None)
        elif isinstance(p, JobCheckpointOverdue):
            attempt = state.started.get(job_id, (1, 0.0, ""))[0]
            state.overdue_said.add((job_id, attempt, state.step.get(job_id, -1)))
        elif isinstance(p, JobExited):
            attempt = state.attempt.get(job_id, 1)
            if job_id not in state.ended and p.attempt >= attempt:
                state.exits.setdefault(job_id, {})[p.replica] = p
                if len(state.exits[job_id]) >= state.replicas.get(job_id, 1):
                    state.running.discard(job_id)
                if p.checkpoint_uri and p.checkpoint_step is not None:  # what the node saw as it ended
                    at = p.checkpoint_saved_at.timestamp() if p.checkpoint_saved_at else env.occurred_at.timestamp()
                    state.good.setdefault(job_id, {})[p.checkpoint_step] = (p.checkpoint_uri, at)
                    if p.checkpoint_step >= state.step.get(job_id, -1):
                        state.checkpoint[job_id] = (p.checkpoint_uri, at)
                        state.step[job_id] = p.checkpoint_step
                failures = state.failures.get(job_id, 0)
                if (p.reason == "error" and job_id in state.on_failure and job_id not in state.retry_at
                        and failures < state.max_retries.get(job_id, 3)):
                    backoff = min(600.0, state.on_failure[job_id] * 2 ** failures)
                    state.retry_at[job_id] = (env.occurred_at.timestamp() + backoff, attempt, p, env.event_id)
        elif isinstance(p, JobResumeRequested):
            nxt = resumed_attempt(state.attempt.get(job_id, 1), p)
            if job_id not in state.ended and nxt is not None:  # (a copy of an old resume changes nothing)
                state.attempt[job_id] = nxt
                state.exits.pop(job_id, None)
                state.retry_at.pop(job_id, None)
                state.idle_since.pop(job_id, None)  # warnings and stops were about the run before
                state.reclaiming.discard(job_id)
                state.preempt_pending.discard(job_id)
                state.running.discard(job_id)
                if p.reason.code != "preempted":
                    state.failures[job_id] = state.failures.get(job_id, 0) + 1
        elif isinstance(p, JobCheckpointSaved):
            at = p.saved_at.timestamp() if p.saved_at else env.occurred_at.timestamp()
            state.good.setdefault(job_id, {})[p.step] = (p.uri, at)
            if p.step >= state.step.get(job_id, -1):
                state.checkpoint[job_id] = (p.uri, at)
                state.step[job_id] = p.step
        else:
            state.ended.add(job_id, env.occurred_at)
            for d in (state.exits, state.replicas, state.max_retries, state.attempt, state.checkpoint, state.specs,
                      state.tenants, state.started, state.step, state.placed, state.on_failure, state.retry_at,
                      state.failures, state.idle_since, state.good):
                d.pop(job_id, None)
            for st in (state.reclaiming, state.running, state.preempt_pending):
                st.discard(job_id)
            state.verified = {v for v in state.verified if v[0] != job_id} if state.verified else state.verified
        return state

    def decide(self, state: GuardianState, env: Envelope, ctx: Ctx) -> list[Envelope]:
        p = env.payload
        if isinstance(p, NodeGpuUnhealthy):
            # the jobs running on that GPU run again elsewhere (the placer keeps the GPU out)
            out: list[Envelope] = []
            for job_id, (attempt, gpus) in sorted(state.placed.items()):
                if (p.node_id, p.gpu_index) in gpus and attempt == state.attempt.get(job_id, 1) \
                        and job_id not in state.ended:
                    out += self._resume(state, job_id, "gpu_unhealthy",
                                        f"GPU {p.gpu_index} of {p.node_id} failed under it ({p.reason})", None, ctx,
                                        key=f"resume:{job_id}:{attempt}")
            return out
        if env.type != "job.exited" or env.job_id in state.ended:
            return []
        assert isinstance(p, JobExited)
        attempt = state.attempt.get(p.job_id, 1)
        if p.attempt < attempt:
            return []  # a replica of an attempt that was already started again
        if p.reason == "node_lost":
            return self._resume(state, p.job_id, "node_lost", f"replica {p.replica} lost with node {p.node_id}",
                                p, ctx, key=f"resume:{attempt}")
        if p.reason == "error" and p.job_id in state.retry_at:
            return []  # restartPolicy OnFailure: it runs again once its backoff is over (tick)
        if p.reason == "error" and p.job_id in state.on_failure:  # ... and no retry is left
            return self._resume(state, p.job_id, "crashed", f"replica {p.replica} on {p.node_id} exited with code "
                                f"{p.exit_code}", p, ctx, key=f"resume:{attempt}")
        if p.reason == "cancelled":
            return [ctx.emit(JobCancelled(job_id=p.job_id, reason="cancelled by user"), key="end")]
        if p.reason == "preempted" and p.job_id in state.reclaiming:
            return [ctx.emit(JobPreempted(job_id=p.job_id, reason=Reason(code="idle_reclaimed", message=(
                f"its GPUs stayed idle past the tenant's policy; released (replica {p.replica} on {p.node_id} "
                "was asked to checkpoint first)"))), key="end")]
        if p.reason == "preempted" and p.job_id in state.specs:
            # a training / finetune job gives its quota back and runs again later from its checkpoint
            exits = state.exits.get(p.job_id, {})
            if len(exits) < state.replicas.get(p.job_id, 1):
                return []  # the rest of its gang is still stopping
            return self._resume(state, p.job_id, "preempted", "preempted: its quota went to a higher-priority job; "
                                "it runs again when quota frees", p, ctx, key=f"resume:{attempt}")
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

    def tick(self, state: GuardianState, ctx: Ctx) -> list[Envelope]:
        now = ctx.now.timestamp()
        out: list[Envelope] = []
        for job_id, (since, idle_event) in sorted(state.idle_since.items()):
            tenant = state.tenants.get(job_id)
            policy = self.config.policy(tenant or "")
            if policy is None or job_id in state.ended or now - since < policy.idle_reclaim_after_s:
                continue
            out.append(ctx.emit(JobPreemptionRequested(job_id=job_id, grace_s=30.0, reason=Reason(
                code="idle_reclaimed", message=(
                    f"idle {now - since:.0f}s after the warning (policy: reclaim after "
                    f"{policy.idle_reclaim_after_s:.0f}s): checkpoint, then release its GPUs"))),
                tenant=tenant, cause_id=idle_event, key="reclaim"))
        for job_id, (due, _attempt, ex, exit_event) in sorted(state.retry_at.items()):
            if due <= now and job_id not in state.ended:
                out += self._resume(state, job_id, "crashed", f"replica {ex.replica} on {ex.node_id} exited with code "
                                    f"{ex.exit_code}", ex, ctx, key="retry", cause_id=exit_event)
        return out

    def _resume(self, state: GuardianState, job_id: str, code: str, what: str, ex: JobExited | None, ctx: Ctx,
                key: str, cause_id: str | None = None) -> list[Envelope]:
        """Run the job again from its last checkpoint, or fail it when its retries are used up.

        A job that was asked to give its quota back meanwhile does so now: it resumes as preempted
        (a training job, waiting for quota again) or ends preempted, whatever else happened."""
        budget = state.max_retries.get(job_id, 3)
        tenant = state.tenants.get(job_id)
        failures = state.failures.get(job_id, 0)
        if job_id in state.preempt_pending:
            if job_id not in state.specs or job_id in state.reclaiming:
                return [ctx.emit(JobPreempted(job_id=job_id, reason=Reason(
                    code="idle_reclaimed" if job_id in state.reclaiming else "preempted",
                    message=f"{what} while it was giving its quota back")), tenant=tenant, cause_id=cause_id,
                    key="end" if ex else f"end:{job_id}")]
            code, what = "preempted", f"{what} while it was giving its quota back"
        elif failures >= budget:
            return [ctx.emit(JobFailed(job_id=job_id, reason=Reason(code="retries_exhausted", message=(
                f"{what}, and its {budget} retries are used up")), exit_code=ex.exit_code if ex else None),
                tenant=tenant, cause_id=cause_id, key="end" if ex else f"end:{job_id}")]
        ckpt = state.checkpoint.get(job_id)
        now = ctx.now.timestamp()
        started = state.started.get(job_id)
        run_start = started[1] if started else now - (ex.runtime_s if ex else 0.0)
        since = max(ckpt[1], run_start) if ckpt else run_start  # work of this run only, not time queued
        retry = "" if code == "preempted" else f"retry {failures + 1} of {budget}, "
        return [ctx.emit(JobResumeRequested(
            job_id=job_id, checkpoint_uri=ckpt[0] if ckpt else None, lost_work_s=round(max(0.0, now - since), 3),
            attempt=state.attempt.get(job_id, 1) + 1,
            reason=Reason(code=code, message=(
                f"{what}; {retry}" + (f"from checkpoint {ckpt[0]}" if ckpt else "from the start")))),
            tenant=tenant, cause_id=cause_id, key=key)]

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
        reported_good = state.good.get(job_id, {})
        for s in scans:  # newer bad ones, and reported ones that went bad since (then not resumed from)
            if s.checkpoint is None and (job_id, s.step) not in state.invalid_said and (
                    s.step > reported or s.step in reported_good):
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
