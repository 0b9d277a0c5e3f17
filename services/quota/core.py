"""Quota: reserve a job's resources in its queue before placement.

folds: admitted jobs, reservations      decides: job.quota_reserved
(The foundation reserves at once, in one unlimited queue; queues, cohorts, fair share and
preemption come with the quota issue.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufleet.shared.events import Envelope, JobQuotaReserved
from gpufleet.shared.runtime import BaseCore, Ctx
from gpufleet.shared.spec import JobSpec


@dataclass
class QuotaState:
    specs: dict[str, JobSpec] = field(default_factory=dict)
    reserved: dict[str, str] = field(default_factory=dict)  # job_id -> queue
    ended: set[str] = field(default_factory=set)
    usage_gpus: dict[str, int] = field(default_factory=dict)  # queue -> GPUs reserved


class QuotaCore(BaseCore[QuotaState]):
    name = "quota"
    subjects = (
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.admitted", "fleet.evt.*.job.*.quota_reserved",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.preempted",
    )

    def initial_state(self) -> QuotaState:
        return QuotaState()

    def evolve(self, state: QuotaState, env: Envelope) -> QuotaState:
        t, job_id = env.type, env.job_id
        if job_id is None:
            return state
        if t == "job.submitted":
            state.specs[job_id] = env.payload.spec  # type: ignore[union-attr]
        elif t == "job.quota_reserved":
            if job_id not in state.reserved and job_id not in state.ended:
                queue = env.payload.queue  # type: ignore[union-attr]
                state.reserved[job_id] = queue
                state.usage_gpus[queue] = state.usage_gpus.get(queue, 0) + env.payload.gpus  # type: ignore[union-attr]
        elif t in ("job.succeeded", "job.failed", "job.cancelled", "job.preempted"):
            state.ended.add(job_id)
            queue = state.reserved.pop(job_id, None)
            spec = state.specs.pop(job_id, None)
            if queue is not None and spec is not None:
                state.usage_gpus[queue] -= spec.gpus_total
        return state

    def decide(self, state: QuotaState, env: Envelope, ctx: Ctx) -> list[Envelope]:
        if env.type != "job.admitted":
            return []
        job_id = env.payload.job_id  # type: ignore[union-attr]
        spec = state.specs.get(job_id)
        if spec is None or job_id in state.reserved or job_id in state.ended:
            return []
        r = spec.resources
        return [ctx.emit(JobQuotaReserved(
            job_id=job_id, queue=spec.queue, cpu_milli=r.cpu_milli * spec.replicas,
            memory_mib=r.memory_mib * spec.replicas, gpus=spec.gpus_total,
        ))]
