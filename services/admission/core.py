"""Admission: validate submitted jobs and cancellations; every outcome is an event with reasons.

folds: jobs (tenant, life-cycle phase)     decides: job.submitted + job.admitted | job.rejected,
                                                     job.cancelled | job.cancel_requested
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufleet.shared.errors import SpecError
from gpufleet.shared.events import (
    CancelRequestedCmd,
    Envelope,
    JobAdmitted,
    JobCancelRequested,
    JobRejected,
    JobSubmitted,
    Reason,
    SubmitRequested,
)
from gpufleet.shared.runtime import BaseCore, Ctx
from gpufleet.shared.spec import parse_spec

PENDING, PLACED, CANCELLING, ENDED = "pending", "placed", "cancelling", "ended"


@dataclass
class AdmissionState:
    # job_id -> (tenant, phase)
    jobs: dict[str, tuple[str, str]] = field(default_factory=dict)
    # submitted, admitted not yet seen: a publish cut short between the two is finished on redelivery
    unadmitted: set[str] = field(default_factory=set)


class AdmissionCore(BaseCore[AdmissionState]):
    name = "admission"
    subjects = (
        "fleet.cmd.*.*",
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.admitted", "fleet.evt.*.job.*.rejected",
        "fleet.evt.*.job.*.placed",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.cancel_requested",
    )

    def initial_state(self) -> AdmissionState:
        return AdmissionState()

    def evolve(self, state: AdmissionState, env: Envelope) -> AdmissionState:
        t = env.type
        job_id = env.job_id
        if job_id is None or t.startswith("cmd."):
            return state
        if t == "job.submitted":
            if job_id not in state.jobs:
                state.jobs[job_id] = (env.tenant, PENDING)
                state.unadmitted.add(job_id)
        elif t == "job.admitted":
            state.unadmitted.discard(job_id)
        elif t == "job.rejected":
            state.jobs[job_id] = (env.tenant, ENDED)
        elif t == "job.placed":
            known = state.jobs.get(job_id)
            if known and known[1] == PENDING:
                state.jobs[job_id] = (known[0], PLACED)
        elif t == "job.cancel_requested":
            known = state.jobs.get(job_id)
            if known and known[1] in (PENDING, PLACED):
                state.jobs[job_id] = (known[0], CANCELLING)
        elif t in ("job.succeeded", "job.failed", "job.cancelled"):
            state.jobs[job_id] = (env.tenant, ENDED)
            state.unadmitted.discard(job_id)
        return state

    def decide(self, state: AdmissionState, env: Envelope, ctx: Ctx) -> list[Envelope]:
        p = env.payload
        if isinstance(p, SubmitRequested):
            return self._submit(state, env, p, ctx)
        if isinstance(p, CancelRequestedCmd):
            return self._cancel(state, env, p, ctx)
        return []

    def _submit(self, state: AdmissionState, env: Envelope, p: SubmitRequested, ctx: Ctx) -> list[Envelope]:
        if p.job_id in state.jobs:
            if p.job_id in state.unadmitted and state.jobs[p.job_id][1] == PENDING:
                # job.submitted was written, job.admitted not (a publish cut short): finish the
                # decision, with the id the first try gave it
                return [ctx.emit(JobAdmitted(job_id=p.job_id), key="1")]
            return []  # a retried or duplicated submit: the job exists, do nothing twice
        try:
            spec = parse_spec(p.spec)
        except SpecError as exc:
            reason = Reason(code="invalid_spec", field=exc.field, message=exc.reason)
            return [ctx.emit(JobRejected(job_id=p.job_id, reasons=(reason,)))]
        if spec.tenant != env.tenant:
            reason = Reason(
                code="tenant_mismatch", field="tenant",
                message=f"spec.tenant {spec.tenant!r} is not the submitting tenant {env.tenant!r}",
            )
            return [ctx.emit(JobRejected(job_id=p.job_id, reasons=(reason,)))]
        return [
            ctx.emit(JobSubmitted(job_id=p.job_id, spec=spec)),
            ctx.emit(JobAdmitted(job_id=p.job_id)),
        ]

    def _cancel(self, state: AdmissionState, env: Envelope, p: CancelRequestedCmd, ctx: Ctx) -> list[Envelope]:
        known = state.jobs.get(p.job_id)
        if known is None or known[0] != env.tenant or known[1] in (ENDED, CANCELLING):
            return []
        # Admission may lag behind the job: it only asks. The placer, which alone places jobs,
        # cancels one it has not placed; the executor stops one that runs; the guardian ends it.
        return [ctx.emit(JobCancelRequested(job_id=p.job_id, reason=p.reason, requested_by=env.actor))]
