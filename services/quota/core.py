"""Quota: reserve a job's resources in its queue before placement, fairly, without starvation.

folds: admitted jobs, queue usage per resource (cpu, memory, gpu, gpu/<model>), what was said
decides: job.quota_reserved (with the GPU flavor the quota came from) | job.queued (reason)

The model is Kueue's: each queue has a nominal quota per resource, may borrow from the other
queues of its cohort (up to its borrowing limit) what they do not use, and lends at most its
lending limit. A queue the config does not list is unlimited (the open default).

One cycle, run when a job is admitted, when quota is released and every few seconds:
  1. order the pending jobs: priority (high first), then the DRF share of their queue (its
     dominant resource's usage / nominal: lowest first), then admission order;
  2. for each, find a GPU flavor (model) where all replicas fit, all or nothing, and reserve;
  3. a job that does not fit is skipped — smaller jobs behind it go ahead (no head-of-line
     blocking) — and told why (`job.queued`);
  4. except that a job which has waited longer than `starvationAfter` holds back the jobs of
     its priority or lower in its cohort that would take a resource it lacks: a stream of
     small jobs cannot starve a big gang for ever.
(Preemption and reclaim come next; see the issue.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufleet.shared.clusterconfig import ClusterConfig, QueueConfig
from gpufleet.shared.events import Envelope, JobQueued, JobQuotaReserved, JobSubmitted, Reason
from gpufleet.shared.runtime import BaseCore, Ctx
from gpufleet.shared.spec import JobSpec

CYCLE_JOBS_MAX = 512  # pending jobs looked at per cycle: bound the work of one decision
ENDED_TYPES = ("job.succeeded", "job.failed", "job.cancelled", "job.preempted", "job.rejected")


@dataclass
class Pending:
    job_id: str
    tenant: str
    queue: str
    priority: int
    order: int
    since_s: float


@dataclass
class QuotaState:
    specs: dict[str, JobSpec] = field(default_factory=dict)
    pending: dict[str, Pending] = field(default_factory=dict)
    reserved: dict[str, tuple[str, dict[str, int]]] = field(default_factory=dict)  # job -> (queue, demand)
    usage: dict[str, dict[str, int]] = field(default_factory=dict)  # queue -> resource -> amount
    ended: set[str] = field(default_factory=set)
    said: dict[str, str] = field(default_factory=dict)  # job -> the last reason told
    admitted_n: int = 0


def demand(spec: JobSpec, flavor: str | None) -> dict[str, int]:
    r = spec.resources
    d = {"cpu": r.cpu_milli * spec.replicas, "memory": r.memory_mib * spec.replicas, "gpu": spec.gpus_total}
    if r.gpu and flavor:
        d[f"gpu/{flavor}"] = r.gpu * spec.replicas
    return d


class QuotaCore(BaseCore[QuotaState]):
    name = "quota"
    subjects = (
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.admitted", "fleet.evt.*.job.*.quota_reserved",
        "fleet.evt.*.job.*.queued",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.preempted",
    )
    tick_s = 5.0

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self.cohorts: dict[str, list[str]] = {}
        for name, q in self.config.queues.items():
            self.cohorts.setdefault(q.cohort or f"queue:{name}", []).append(name)

    def initial_state(self) -> QuotaState:
        return QuotaState()

    # ------------------------------------------------------------ evolve

    def evolve(self, state: QuotaState, env: Envelope) -> QuotaState:
        t, job_id, p = env.type, env.job_id, env.payload
        if job_id is None:
            return state
        if isinstance(p, JobSubmitted):
            state.specs[job_id] = p.spec
        elif t == "job.admitted":
            spec = state.specs.get(job_id)
            if spec is not None and job_id not in state.reserved and job_id not in state.ended:
                state.admitted_n += 1
                state.pending.setdefault(job_id, Pending(
                    job_id, env.tenant, spec.queue, spec.priority, state.admitted_n, env.occurred_at.timestamp()))
        elif isinstance(p, JobQueued):
            state.said[job_id] = p.reason.message if p.reason else ""
        elif isinstance(p, JobQuotaReserved):
            if job_id not in state.reserved and job_id not in state.ended:
                d = {"cpu": p.cpu_milli, "memory": p.memory_mib, "gpu": p.gpus}
                if p.flavor and p.gpus:
                    d[f"gpu/{p.flavor}"] = p.gpus
                state.reserved[job_id] = (p.queue, d)
                use = state.usage.setdefault(p.queue, {})
                for r, v in d.items():
                    use[r] = use.get(r, 0) + v
                state.pending.pop(job_id, None)
                state.said.pop(job_id, None)
        elif t in ENDED_TYPES:
            state.ended.add(job_id)
            state.pending.pop(job_id, None)
            state.specs.pop(job_id, None)
            state.said.pop(job_id, None)
            held = state.reserved.pop(job_id, None)
            if held is not None:
                use = state.usage.setdefault(held[0], {})
                for r, v in held[1].items():
                    use[r] = use.get(r, 0) - v
        return state

    # ------------------------------------------------------------ decide

    def decide(self, state: QuotaState, env: Envelope, ctx: Ctx) -> list[Envelope]:
        if env.type == "job.admitted" or env.type in ENDED_TYPES and env.job_id in state.ended:
            return self.cycle(state, ctx)
        return []

    def tick(self, state: QuotaState, ctx: Ctx) -> list[Envelope]:
        return self.cycle(state, ctx) if state.pending else []

    def queue_config(self, queue: str) -> QueueConfig | None:
        return self.config.queues.get(queue)

    def share(self, state: QuotaState, queue: str) -> float:
        """DRF: the queue's dominant share, usage / nominal over its limited resources."""
        q = self.queue_config(queue)
        if q is None:
            return 0.0
        use = state.usage.get(queue, {})
        return max((use.get(r, 0) / n for r, n in q.nominal.items() if n > 0), default=0.0)

    def cycle(self, state: QuotaState, ctx: Ctx) -> list[Envelope]:
        now = ctx.now.timestamp()
        order = sorted(state.pending.values(),
                       key=lambda j: (-j.priority, self.share(state, j.queue), j.order))[:CYCLE_JOBS_MAX]
        out: list[Envelope] = []
        # what this cycle reserved so far, so later jobs in it see it (outputs evolve after)
        extra: dict[str, dict[str, int]] = {}
        blocked: dict[str, tuple[int, set[str], str]] = {}  # cohort -> (priority, resources, job)
        for job in order:
            spec = state.specs.get(job.job_id)
            if spec is None:
                continue
            cohort = self._cohort(job.queue)
            flavor, reason, lacking = self.fit(state, extra, job.queue, spec)
            hold = blocked.get(cohort)
            if flavor is not None and hold is not None and job.priority <= hold[0] and (
                    set(demand(spec, flavor or None)) & hold[1]):
                reason = Reason(code="behind_starving_job", message=(
                    f"waiting behind job {hold[2]}, which has waited over "
                    f"{self.config.starvation_after_s:.0f}s for the same resources"))
                flavor = None
            if flavor is not None:
                d = demand(spec, flavor or None)
                add = extra.setdefault(job.queue, {})
                for r, v in d.items():
                    add[r] = add.get(r, 0) + v
                out.append(ctx.emit(JobQuotaReserved(
                    job_id=job.job_id, queue=job.queue, cpu_milli=d["cpu"], memory_mib=d["memory"],
                    gpus=spec.gpus_total, flavor=flavor or None,
                ), tenant=job.tenant, cause_id=job.job_id, key="reserved"))
                continue
            if now - job.since_s >= self.config.starvation_after_s and cohort not in blocked:
                blocked[cohort] = (job.priority, lacking, job.job_id)
            if reason is not None and state.said.get(job.job_id) != reason.message:
                out.append(ctx.emit(JobQueued(job_id=job.job_id, queue=job.queue, reason=reason),
                                    tenant=job.tenant, cause_id=job.job_id, key=f"queued:{reason.message}"))
        return out

    def _cohort(self, queue: str) -> str:
        q = self.queue_config(queue)
        return (q.cohort if q and q.cohort else None) or f"queue:{queue}"

    def fit(self, state: QuotaState, extra: dict[str, dict[str, int]], queue: str, spec: JobSpec,
            ) -> tuple[str | None, Reason | None, set[str]]:
        """The GPU flavor to reserve ('' when GPUs are not limited), or None with the reason and
        the resources that do not fit."""
        q = self.queue_config(queue)
        if q is None:
            return "", None, set()
        limited_models = [r.removeprefix("gpu/") for r in q.nominal if r.startswith("gpu/")]
        if not spec.resources.gpu or not limited_models:
            flavors = [""]
        else:
            wanted = spec.resources.gpu_models
            flavors = [m for m in limited_models if not wanted or m in wanted]
            if not flavors:
                return None, Reason(code="no_flavor", field="resources.gpuModels", message=(
                    f"queue {queue} has no quota for GPU model {', '.join(wanted)} "
                    f"(it has {', '.join(limited_models)})")), {f"gpu/{m}" for m in wanted}
        first: tuple[Reason, set[str]] | None = None
        for flavor in flavors:
            problem = self._fits(state, extra, queue, q, demand(spec, flavor or None))
            if problem is None:
                return flavor, None, set()
            first = first or problem
        assert first is not None
        return None, first[0], first[1]

    def _used(self, state: QuotaState, extra: dict[str, dict[str, int]], queue: str, r: str) -> int:
        return state.usage.get(queue, {}).get(r, 0) + extra.get(queue, {}).get(r, 0)

    def _fits(self, state: QuotaState, extra: dict[str, dict[str, int]], queue: str, q: QueueConfig,
              d: dict[str, int]) -> tuple[Reason, set[str]] | None:
        for r, amount in d.items():
            nominal = q.nominal.get(r)
            if nominal is None:
                continue
            used = self._used(state, extra, queue, r)
            new = used + amount
            borrow_limit = q.borrowing_limit.get(r)
            if borrow_limit is not None and new > nominal + borrow_limit:
                return Reason(code="queue_limit", message=(
                    f"queue {queue}: {r} {used} used + {amount} requested > nominal {nominal} + borrowing "
                    f"limit {borrow_limit}")), {r}
            if new <= nominal:
                continue
            available = self._cohort_available(state, extra, queue, q, r)
            if new - nominal > available:
                cohort = q.cohort or "(none)"
                return Reason(code="cohort_limit", message=(
                    f"queue {queue}: {r} {used} used + {amount} requested > nominal {nominal}, and cohort "
                    f"{cohort} has {available} to lend")), {r}
        return None

    def _cohort_available(self, state: QuotaState, extra: dict[str, dict[str, int]], queue: str,
                          q: QueueConfig, r: str) -> int:
        """What the other queues of the cohort can lend of `r` now."""
        if not q.cohort:
            return 0
        lendable = 0
        borrowed = 0
        for other in self.cohorts.get(q.cohort, []):
            if other == queue:
                continue
            oq = self.config.queues[other]
            n = oq.nominal.get(r)
            if n is None:
                continue
            used = self._used(state, extra, other, r)
            lend = oq.lending_limit.get(r, n)
            lendable += min(lend, max(0, n - used))
            borrowed += max(0, used - n)
        return max(0, lendable - borrowed)
