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

import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from gpufleet.shared.contract.clusterconfig import ClusterConfig
from gpufleet.shared.contract.events import (
    RUN_ENDED_JOB_TYPES,
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
    JobResized,
    JobResumeRequested,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NodeCordoned,
    NodeGpuUnhealthy,
    Reason,
    resumed_attempt,
    utc,
)
from gpufleet.shared.contract.spec import JobSpec
from gpufleet.shared.node.checkpoints import CHECKPOINTED_TYPES, Scanned, ephemeral_filesystem
from gpufleet.shared.runtime.loop import BaseCore, Ctx
from gpufleet.shared.runtime.retention import EndedJobs

# a resume for these spends none of the job's retries: the job did nothing wrong
NOT_A_FAILURE = frozenset({"preempted", "node_drained", "requeued", "resized"})


@dataclass(slots=True)
class Checkpoints:
    """What was said of one job's checkpoints: kept apart so that the jobs that never checkpoint
    (most of a backlog) cost none of it."""

    resume: tuple[str, float] | None = None  # (uri, saved at): the one to resume from
    step: int = -1  # the newest checkpoint step reported
    good: dict[int, tuple[str, float]] | None = None  # step -> (uri, at)
    verified: set[int] | None = None  # attempts whose location was verified
    invalid_said: set[int] | None = None  # steps reported bad
    overdue_said: set[tuple[int, int]] | None = None  # (attempt, last step) warned overdue


NO_CHECKPOINTS = Checkpoints()  # read only: what a job nothing was said of has


@dataclass(slots=True)
class GuardianJob:
    """Everything the guardian knows of one job that has not ended: one record, forgotten at once
    when the job ends (`GuardianState.end`). Collections stay None until needed: a pending job costs
    one small record."""

    tenant: str | None = None
    replicas: int = 1
    max_retries: int = 3
    spec: JobSpec | None = None  # training / finetune jobs only: their checkpoints are watched
    on_failure: float | None = None  # retry backoff base (restartPolicy OnFailure)
    attempt: int = 1
    failures: int = 0  # runs that failed (the retry budget)
    placed: tuple[int, frozenset[tuple[str, int]]] | None = None  # (attempt, its GPUs)
    placed_on: frozenset[str] = frozenset()  # the nodes of that placement (a drain finds its jobs by them)
    started: tuple[int, float, str] | None = None  # (attempt, at, event id) of a watched run
    exits: dict[int, JobExited] | None = None  # replica -> its exit, this attempt
    ckpt: Checkpoints | None = None  # what was said of its checkpoints (None: nothing yet)
    retry_at: tuple[float, int, JobExited, str] | None = None  # a crashed run waiting out its backoff
    idle_since: tuple[float, str] | None = None  # (warned idle at, event id)
    running: bool = False  # a watched run going now
    preempt_pending: bool = False  # asked to give quota back, not yet done
    reclaiming: bool = False  # idle, asked to stop: it ends, not resumes

    @property
    def said(self) -> Checkpoints:
        """What was said of its checkpoints, to read (nothing yet: an empty one, not kept)."""
        return self.ckpt if self.ckpt is not None else NO_CHECKPOINTS

    def checkpoints(self) -> Checkpoints:
        """What was said of its checkpoints, to add to."""
        if self.ckpt is None:
            self.ckpt = Checkpoints()
        return self.ckpt


@dataclass
class GuardianState:
    jobs: dict[str, GuardianJob] = field(default_factory=dict)
    ended: EndedJobs = field(default_factory=EndedJobs)  # forgotten after a window of log time
    # indexes of `jobs` for what the tick and the agent walk (kept by `job`/`end`, nowhere else)
    running: set[str] = field(default_factory=set)
    idle: set[str] = field(default_factory=set)
    retrying: set[str] = field(default_factory=set)

    def job(self, job_id: str) -> GuardianJob:
        rec = self.jobs.get(job_id)
        if rec is None:
            rec = self.jobs[job_id] = GuardianJob()
        return rec

    def end(self, job_id: str, at: datetime) -> None:
        """The job ended: remembered as ended for the window, its record forgotten now."""
        self.ended.add(job_id, at)
        self.jobs.pop(job_id, None)
        for index in (self.running, self.idle, self.retrying):
            index.discard(job_id)

    def set_running(self, job_id: str, rec: GuardianJob, on: bool) -> None:
        rec.running = on
        (self.running.add if on else self.running.discard)(job_id)

    def set_idle(self, job_id: str, rec: GuardianJob, since: tuple[float, str] | None) -> None:
        rec.idle_since = since
        (self.idle.add if since is not None else self.idle.discard)(job_id)

    def set_retry(self, job_id: str, rec: GuardianJob, at: tuple[float, int, JobExited, str] | None) -> None:
        rec.retry_at = at
        (self.retrying.add if at is not None else self.retrying.discard)(job_id)

    def watched(self) -> list[str]:
        """Training / finetune jobs running now: their locations are watched."""
        return sorted(j for j in self.running if (r := self.jobs.get(j)) is not None and r.spec is not None)


ENDS = RUN_ENDED_JOB_TYPES  # (a preempted job that runs again is a resume_requested, not a preempted)


def _saved(rec: GuardianJob, step: int, uri: str, at: float) -> None:
    """A good checkpoint reported (saved, or seen as the run ended): the newest is the one to resume from."""
    ck = rec.checkpoints()
    if ck.good is None:
        ck.good = {}
    ck.good[step] = (uri, at)
    if step >= ck.step:
        ck.resume, ck.step = (uri, at), step


class GuardianCore(BaseCore[GuardianState]):
    name = "guardian"
    subjects = (
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.exited",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.rejected", "fleet.evt.*.job.*.preempted", "fleet.evt.*.job.*.resume_requested",
        "fleet.evt.*.job.*.checkpoint_saved", "fleet.evt.*.job.*.started", "fleet.evt.*.job.*.checkpoint_verified",
        "fleet.evt.*.job.*.checkpoint_invalid", "fleet.evt.*.job.*.checkpoint_overdue", "fleet.evt.*.job.*.placed",
        "fleet.evt.sys.node.*.gpu_unhealthy", "fleet.evt.sys.node.*.cordoned",
        "fleet.evt.*.job.*.idle_detected", "fleet.evt.*.job.*.idle_ended",
        "fleet.evt.*.job.*.preemption_requested", "fleet.evt.*.job.*.resized",
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
        if env.type in ENDS:
            state.end(job_id, env.occurred_at)
            return state
        if job_id in state.ended:
            return state  # a late or copied fact about a job that ended changes nothing
        if isinstance(p, JobPlaced):
            rec = state.job(job_id)
            rec.placed = (p.attempt, frozenset((a.node_id, g) for a in p.allocations for g in a.gpu_indices))
            rec.placed_on = frozenset(a.node_id for a in p.allocations)
            if p.attempt == rec.attempt:
                rec.replicas = len(p.allocations)  # (an elastic job's size now: its run ends when all of them exit)
        elif isinstance(p, JobSubmitted):
            rec = state.job(job_id)
            rec.replicas, rec.max_retries, rec.tenant = p.spec.replicas, p.spec.max_retries, env.tenant
            if p.spec.restart_policy == "OnFailure":
                rec.on_failure = p.spec.retry_backoff_s
            if p.spec.type in CHECKPOINTED_TYPES:
                rec.spec = p.spec
        elif isinstance(p, JobStarted):
            # (a sim run writes no checkpoints: only real drivers' runs are watched)
            rec = state.job(job_id)
            if rec.spec is not None and p.driver != "sim" and p.attempt >= (rec.started[0] if rec.started else 0):
                rec.started = (p.attempt, env.occurred_at.timestamp(), env.event_id)
                state.set_running(job_id, rec, True)
        elif isinstance(p, JobIdleDetected):
            policy = self.config.policy(env.tenant)
            if policy is not None and policy.idle_action == "reclaim":
                rec = state.job(job_id)
                if rec.idle_since is None:
                    state.set_idle(job_id, rec, (env.occurred_at.timestamp(), env.event_id))
        elif isinstance(p, JobIdleEnded):
            if (rec0 := state.jobs.get(job_id)) is not None:
                state.set_idle(job_id, rec0, None)
        elif isinstance(p, JobPreemptionRequested):
            rec = state.job(job_id)
            if p.reason.code == "idle_reclaimed":
                rec.reclaiming = True
            state.set_idle(job_id, rec, None)
            rec.preempt_pending = True
        elif isinstance(p, JobCheckpointVerified):
            rec = state.job(job_id)
            ck = rec.checkpoints()
            ck.verified = (ck.verified or set()) | {p.attempt}
        elif isinstance(p, JobCheckpointInvalid):
            rec = state.job(job_id)
            ck = rec.checkpoints()
            ck.invalid_said = (ck.invalid_said or set()) | {p.step}
            good = ck.good or {}
            if good.pop(p.step, None) is not None and ck.step == p.step:
                # a checkpoint reported good went bad: the previous good one is the one to resume from
                if good:
                    step = max(good)
                    ck.resume, ck.step = good[step], step
                else:
                    ck.resume, ck.step = None, -1
        elif isinstance(p, JobCheckpointOverdue):
            rec = state.job(job_id)
            attempt = rec.started[0] if rec.started else 1
            ck = rec.checkpoints()
            ck.overdue_said = (ck.overdue_said or set()) | {(attempt, ck.step)}
        elif isinstance(p, JobExited):
            rec = state.job(job_id)
            if p.attempt >= rec.attempt:
                if rec.exits is None:
                    rec.exits = {}
                rec.exits[p.replica] = p
                if len(rec.exits) >= rec.replicas:
                    state.set_running(job_id, rec, False)
                if p.checkpoint_uri and p.checkpoint_step is not None:  # what the node saw as it ended
                    at = p.checkpoint_saved_at.timestamp() if p.checkpoint_saved_at else env.occurred_at.timestamp()
                    _saved(rec, p.checkpoint_step, p.checkpoint_uri, at)
                if (p.reason == "error" and rec.on_failure is not None and rec.retry_at is None
                        and rec.failures < rec.max_retries):
                    backoff = min(600.0, rec.on_failure * 2 ** rec.failures)
                    state.set_retry(job_id, rec, (env.occurred_at.timestamp() + backoff, rec.attempt, p, env.event_id))
        elif isinstance(p, JobResumeRequested):
            rec = state.job(job_id)
            nxt = resumed_attempt(rec.attempt, p)
            if nxt is not None:  # (a copy of an old resume changes nothing)
                rec.attempt, rec.exits = nxt, None
                state.set_retry(job_id, rec, None)
                state.set_idle(job_id, rec, None)  # warnings and stops were about the run before
                rec.reclaiming = rec.preempt_pending = False
                state.set_running(job_id, rec, False)
                if p.reason.code not in NOT_A_FAILURE:
                    rec.failures += 1
        elif isinstance(p, JobCheckpointSaved):
            _saved(state.job(job_id), p.step, p.uri, p.saved_at.timestamp() if p.saved_at else env.occurred_at.timestamp())
        return state

    def decide(self, state: GuardianState, env: Envelope, ctx: Ctx) -> list[Envelope]:
        p = env.payload
        if isinstance(p, NodeCordoned) and p.drain:
            # drained (`gpufleet node drain`): every job placed there runs again elsewhere (the placer
            # keeps the node out), from its last checkpoint; the executor stops what runs (SIGTERM,
            # its grace: a checkpointing job saves then); no retry is spent
            node = p.node_id
            return self._resume_placed(state, lambda r: node in r.placed_on, "node_drained",
                                       f"node {node} drained by {env.actor} ({p.reason})", ctx, "drain")
        if isinstance(p, NodeGpuUnhealthy):
            # the jobs running on that GPU run again elsewhere (the placer keeps the GPU out)
            gpu = (p.node_id, p.gpu_index)
            return self._resume_placed(state, lambda r: r.placed is not None and gpu in r.placed[1], "gpu_unhealthy",
                                       f"GPU {p.gpu_index} of {p.node_id} failed under it ({p.reason})", ctx, "resume")
        if isinstance(p, JobResized):
            # an elastic job's new size: its run stops (the executor sends SIGTERM; a checkpointing
            # job saves) and the next starts from its last checkpoint at `to_replicas`
            rec0 = state.jobs.get(p.job_id)
            if (rec0 is None or p.job_id in state.ended or rec0.attempt != p.attempt or rec0.placed is None
                    or rec0.placed[0] != p.attempt):
                return []  # (the run it resizes is over already)
            return self._resume(state, p.job_id, "resized", f"resized ({p.reason.code}) {p.reason.message}", None, ctx,
                                key=f"resized:{p.attempt}")
        if env.type != "job.exited" or env.job_id in state.ended:
            return []
        assert isinstance(p, JobExited)
        rec = state.job(p.job_id)
        attempt = rec.attempt
        if p.attempt < attempt:
            return []  # a replica of an attempt that was already started again
        if p.reason == "node_lost":
            return self._resume(state, p.job_id, "node_lost", f"replica {p.replica} lost with node {p.node_id}",
                                p, ctx, key=f"resume:{attempt}")
        if p.reason == "error" and rec.retry_at is not None:
            return []  # restartPolicy OnFailure: it runs again once its backoff is over (tick)
        if p.reason == "error" and rec.on_failure is not None:  # ... and no retry is left
            return self._resume(state, p.job_id, "crashed", f"replica {p.replica} on {p.node_id} exited with code "
                                f"{p.exit_code}", p, ctx, key=f"resume:{attempt}")
        if p.reason == "cancelled":
            return [ctx.emit(JobCancelled(job_id=p.job_id, reason="cancelled by user"), key="end")]
        if p.reason == "preempted" and rec.reclaiming:
            return [ctx.emit(JobPreempted(job_id=p.job_id, reason=Reason(code="idle_reclaimed", message=(
                f"its GPUs stayed idle past the tenant's policy; released (replica {p.replica} on {p.node_id} "
                "was asked to checkpoint first)"))), key="end")]
        if p.reason == "preempted" and rec.spec is not None:
            # a training / finetune job gives its quota back and runs again later from its checkpoint
            if len(rec.exits or {}) < rec.replicas:
                return []  # the rest of its gang is still stopping
            return self._resume(state, p.job_id, "preempted", "preempted: its quota went to a higher-priority job; "
                                "it runs again when quota frees", p, ctx, key=f"resume:{attempt}")
        if p.reason == "preempted":
            return [ctx.emit(JobPreempted(job_id=p.job_id, reason=Reason(
                code="preempted", message=f"replica {p.replica} on {p.node_id} stopped to give its quota back")),
                key="end")]
        if p.exit_code != 0 and p.detail is not None:  # it could not start (its dataset could not be staged)
            return [ctx.emit(JobFailed(job_id=p.job_id, reason=p.detail, exit_code=p.exit_code), key="end")]
        if p.exit_code != 0:
            code = "timeout" if p.reason == "timeout" else "exit_code"
            message = (f"ran past its max runtime ({p.runtime_s:.0f}s)" if p.reason == "timeout"
                       else f"replica {p.replica} on {p.node_id} exited with code {p.exit_code} ({p.reason})")
            return [ctx.emit(JobFailed(job_id=p.job_id, reason=Reason(code=code, message=message),
                                       exit_code=p.exit_code), key="end")]
        exits = rec.exits or {}
        if len(exits) >= rec.replicas and all(e.exit_code == 0 for e in exits.values()):
            return [ctx.emit(JobSucceeded(job_id=p.job_id), key="end")]
        return []

    def tick(self, state: GuardianState, ctx: Ctx) -> list[Envelope]:
        now = ctx.now.timestamp()
        out: list[Envelope] = []
        for job_id in sorted(state.idle):
            rec = state.jobs[job_id]
            assert rec.idle_since is not None
            since, idle_event = rec.idle_since
            tenant = rec.tenant
            policy = self.config.policy(tenant or "")
            if policy is None or now - since < policy.idle_reclaim_after_s:
                continue
            out.append(ctx.emit(JobPreemptionRequested(job_id=job_id, grace_s=30.0, reason=Reason(
                code="idle_reclaimed", message=(
                    f"idle {now - since:.0f}s after the warning (policy: reclaim after "
                    f"{policy.idle_reclaim_after_s:.0f}s): checkpoint, then release its GPUs"))),
                tenant=tenant, cause_id=idle_event, key="reclaim"))
        for job_id in sorted(state.retrying):
            retry = state.jobs[job_id].retry_at
            assert retry is not None
            due, _attempt, ex, exit_event = retry
            if due <= now:
                out += self._resume(state, job_id, "crashed", f"replica {ex.replica} on {ex.node_id} exited with code "
                                    f"{ex.exit_code}", ex, ctx, key="retry", cause_id=exit_event)
        return out

    def _resume_placed(self, state: GuardianState, where: Callable[[GuardianJob], bool], code: str, what: str,
                       ctx: Ctx, key: str) -> list[Envelope]:
        """Every job whose current attempt is placed `where` runs again elsewhere (`_resume`)."""
        hit = [(job_id, r.attempt) for job_id, r in state.jobs.items()
               if r.placed is not None and r.placed[0] == r.attempt and where(r)]
        out: list[Envelope] = []
        for job_id, attempt in sorted(hit):
            out += self._resume(state, job_id, code, what, None, ctx, key=f"{key}:{job_id}:{attempt}")
        return out

    def _resume(self, state: GuardianState, job_id: str, code: str, what: str, ex: JobExited | None, ctx: Ctx,
                key: str, cause_id: str | None = None) -> list[Envelope]:
        """Run the job again from its last checkpoint, or fail it when its retries are used up.

        A job that was asked to give its quota back meanwhile does so now: it resumes as preempted
        (a training job, waiting for quota again) or ends preempted, whatever else happened."""
        rec = state.job(job_id)
        budget, tenant, failures = rec.max_retries, rec.tenant, rec.failures
        if rec.preempt_pending:
            if rec.spec is None or rec.reclaiming:
                return [ctx.emit(JobPreempted(job_id=job_id, reason=Reason(
                    code="idle_reclaimed" if rec.reclaiming else "preempted",
                    message=f"{what} while it was giving its quota back")), tenant=tenant, cause_id=cause_id,
                    key="end" if ex else f"end:{job_id}")]
            code, what = "preempted", f"{what} while it was giving its quota back"
        elif failures >= budget and code not in NOT_A_FAILURE:
            return [ctx.emit(JobFailed(job_id=job_id, reason=Reason(code="retries_exhausted", message=(
                f"{what}, and its {budget} retries are used up")), exit_code=ex.exit_code if ex else None),
                tenant=tenant, cause_id=cause_id, key="end" if ex else f"end:{job_id}")]
        ckpt = rec.said.resume
        now = ctx.now.timestamp()
        started = rec.started
        run_start = started[1] if started else now - (ex.runtime_s if ex else 0.0)
        since = max(ckpt[1], run_start) if ckpt else run_start  # work of this run only, not time queued
        retry = "" if code in NOT_A_FAILURE else f"retry {failures + 1} of {budget}, "
        return [ctx.emit(JobResumeRequested(
            job_id=job_id, checkpoint_uri=ckpt[0] if ckpt else None, lost_work_s=round(max(0.0, now - since), 3),
            attempt=rec.attempt + 1,
            reason=Reason(code=code, message=(
                f"{what}; {retry}" + (f"from checkpoint {ckpt[0]}" if ckpt else "from the start")))),
            tenant=tenant, cause_id=cause_id, key=key)]

    # ------------------------------------------------------------ checkpoints (the agent's observations)

    def watch(self, state: GuardianState, job_id: str, location: str, unwritable: str | None,
              scans: list[Scanned], now: float, ctx: Ctx, filesystem: tuple[str, str] | None = None) -> list[Envelope]:
        """Facts about a running training job's checkpoint location, from what the agent found
        (`filesystem`: the (type, mount point) it is on, looked at with the writability)."""
        rec = state.jobs.get(job_id)  # (none once the job ended)
        if rec is None or rec.spec is None or rec.started is None:
            return []
        spec = rec.spec
        attempt, started_at, started_id = rec.started
        tenant = rec.tenant or spec.tenant
        out: list[Envelope] = []
        good = [s for s in scans if s.checkpoint is not None]
        latest = good[0] if good else None
        newer_bad = [s for s in scans if s.checkpoint is None and (latest is None or s.step > latest.step)]
        said = rec.said
        if attempt not in (said.verified or ()):
            if unwritable is not None:
                return [ctx.emit(JobFailed(job_id=job_id, reason=Reason(
                    code="checkpoint_location_unwritable", message=unwritable, field="checkpoint.path")),
                    tenant=tenant, cause_id=started_id, key="end")]
            gone = ephemeral_filesystem(filesystem, location)
            own = spec.checkpoint.path.removeprefix("file://") if spec.checkpoint and spec.checkpoint.path else None
            if gone is not None and own is not None and posixpath.normpath(own) == posixpath.normpath(location):
                # the job's own path (the root is the operator's: reported when the guardian starts)
                return [ctx.emit(JobFailed(job_id=job_id, reason=Reason(
                    code="checkpoint_location_ephemeral", message=f"checkpoint.path {gone}: nothing could be "
                    "resumed from it; name a persistent path or leave it out (the cluster's checkpoint root)",
                    field="checkpoint.path")), tenant=tenant, cause_id=started_id, key="end")]
            out.append(ctx.emit(JobCheckpointVerified(
                job_id=job_id, location=location, attempt=attempt,
                filesystem=f"{filesystem[0]} at {filesystem[1]}" if filesystem else None,
                latest_uri=latest.checkpoint.uri if latest and latest.checkpoint else None,
                latest_step=latest.step if latest else None,
                skipped=tuple(Reason(code="checkpoint_invalid", message=s.reason, field=s.path.resolve().as_uri())
                              for s in newer_bad)), tenant=tenant, cause_id=started_id, key=f"verify:{attempt}"))
        reported = said.step
        for s in sorted(good, key=lambda s: s.step):
            c = s.checkpoint
            if c is not None and s.step > reported:
                out.append(ctx.emit(JobCheckpointSaved(
                    job_id=job_id, uri=c.uri, step=c.step, size_bytes=c.size_bytes, sha256=c.sha256,
                    saved_at=utc(c.created_at) if c.created_at else None),
                    tenant=tenant, cause_id=started_id, key=f"ckpt:{c.step}"))
        reported_good = said.good or {}
        for s in scans:  # newer bad ones, and reported ones that went bad since (then not resumed from)
            if s.checkpoint is None and s.step not in (said.invalid_said or ()) and (
                    s.step > reported or s.step in reported_good):
                out.append(ctx.emit(JobCheckpointInvalid(
                    job_id=job_id, uri=s.path.resolve().as_uri(), step=s.step, reason=s.reason),
                    tenant=tenant, cause_id=started_id, key=f"invalid:{s.step}"))
        limit = 2 * (spec.checkpoint.interval_s if spec.checkpoint else 1800.0)
        last = said.resume
        since = max(last[1] if last else 0.0, started_at)
        last_step = max([said.step, *(s.step for s in good)])
        if now - since > limit and (attempt, last_step) not in (said.overdue_said or ()) and not any(
                s.step > said.step for s in good):
            out.append(ctx.emit(JobCheckpointOverdue(
                job_id=job_id, age_s=round(now - since, 3), limit_s=limit, last_uri=last[0] if last else None),
                tenant=tenant, cause_id=started_id, key=f"overdue:{attempt}:{last_step}"))
        return out
