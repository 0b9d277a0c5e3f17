"""Quota: reserve a job's resources in its queue before placement, fairly, without starvation.

folds: admitted jobs, queue usage per resource (cpu, memory, gpu, gpu/<model>), what was said
decides: job.quota_reserved (with the GPU flavor the quota came from) | job.queued (reason)

The model is Kueue's: each queue has a nominal quota per resource, may borrow from the other
queues of its cohort (up to its borrowing limit) what they do not use, and lends at most its
lending limit. A queue the config does not list is unlimited (the open default).

One cycle, run when a job is admitted, when quota is released and every few seconds:
  1. order the pending jobs: priority (high first), then their queue's fair share (what it
     borrows / what its cohort holds, over its `fairSharing.weight`), then the DRF share of
     their queue (its dominant resource's usage / nominal), then their tenant's fair share (its
     usage / its cohort's quota, over the tenant's weight), lowest first, then admission order;
     the shares as they stand when the job comes up in the cycle;
  2. for each, find a GPU flavor (model) where all replicas fit, all or nothing, and reserve;
  3. a job that does not fit is skipped — smaller jobs behind it go ahead (no head-of-line
     blocking) — and told why (`job.queued`);
  4. except that a job which has waited longer than `starvationAfter` holds back the jobs of
     its priority or lower in its cohort that would take a resource it lacks: a stream of
     small jobs cannot starve a big gang for ever.
  5. a job that still does not fit may preempt: jobs of lower priority in its own queue, or —
     when its queue is within its nominal quota — jobs of queues that borrow in its cohort
     (reclaim). The victims are the fewest that make room, lowest priority first, then the
     most recently admitted; each gets `job.preemption_requested` with the reason, so the
     guardian can checkpoint it first. A job that got its quota only after starving is not
     reclaimed (else the jobs held back for it would take it straight back): the owner's
     nominal comes back when it ends, at most its max runtime later. A preempted job does not come back by itself (resume is
     the guardian's), and a job never preempts while its earlier victims are still ending, so
     preemption cannot loop.
"""

from __future__ import annotations

import heapq
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

from gpufleet.shared.contract.clusterconfig import ClusterConfig, QueueConfig
from gpufleet.shared.contract.events import (
    RUN_ENDED_JOB_TYPES,
    Envelope,
    JobPreemptionRequested,
    JobQueued,
    JobQuotaReserved,
    JobResumeRequested,
    JobSubmitted,
    Reason,
    resumed_attempt,
)
from gpufleet.shared.contract.spec import JobSpec
from gpufleet.shared.runtime.loop import BaseCore, Ctx
from gpufleet.shared.runtime.retention import EndedJobs

from .tree import QuotaTree

CYCLE_JOBS_MAX = 512  # pending jobs looked at per cycle: bound the work of one decision
PREEMPT_GRACE_S = 30.0
CYCLE_ON_EVENT_MAX = 64  # pending jobs up to which every admission or release runs a cycle
ENDED_TYPES = RUN_ENDED_JOB_TYPES  # (shared/contract/events.py: the contract's one definition)


@dataclass(slots=True)
class Hold:
    """The quota a job holds, from its reservation until it ends or gives it back."""

    queue: str
    demand: dict[str, int]
    order: int  # later = more recently admitted to run
    preempting_for: str | None = None  # asked to give it back, for this job ('' if unnamed)
    protected: bool = False  # reserved after starving: safe from reclaim
    tenant: str = ""  # whose it is (the tenant's usage, for fair sharing between tenants)


@dataclass(slots=True)
class QuotaJob:
    """Everything quota knows of one job that has not ended: one record, forgotten at once when the
    job ends (`QuotaState.end`). Its spec is the submitted event's own object, never a copy; what
    it holds is None until it holds quota, so a pending job costs one small record."""

    spec: JobSpec | None = None
    # while it waits for quota (in `QuotaState.pending`): the tenant told, its place in the
    # admission order, the log time it began to wait (the starvation clock) and the event that
    # made it wait (its `job.admitted`, or the `job.resume_requested` that put it back in line)
    tenant: str = ""
    order: int = 0
    since_s: float = 0.0
    cause: str | None = None
    hold: Hold | None = None
    said: str | None = None  # the last reason told
    told: int = 0  # how many reasons told
    attempt: int = 1  # the attempt its last resume started
    requeued: int = 0  # times it gave its quota back to run again


@dataclass
class QuotaState:
    jobs: dict[str, QuotaJob] = field(default_factory=dict)
    usage: dict[str, dict[str, int]] = field(default_factory=dict)  # queue -> resource -> amount
    tenant_usage: dict[str, dict[str, int]] = field(default_factory=dict)  # tenant -> resource -> amount
    ended: EndedJobs = field(default_factory=EndedJobs)  # forgotten after a window of log time
    admitted_n: int = 0
    reserved_n: int = 0
    # indexes of `jobs` for what the cycle walks (kept by the methods below, nowhere else)
    pending: set[str] = field(default_factory=set)  # waiting for quota
    reserved: set[str] = field(default_factory=set)  # holding quota
    preempting: set[str] = field(default_factory=set)  # holding it, asked to give it back
    protected: set[str] = field(default_factory=set)  # holding it after starving

    def job(self, job_id: str) -> QuotaJob:
        rec = self.jobs.get(job_id)
        if rec is None:
            rec = self.jobs[job_id] = QuotaJob()
        return rec

    def end(self, job_id: str, at: datetime) -> None:
        """The job ended: remembered as ended for the window, its quota given back, its record forgotten now."""
        self.ended.add(job_id, at)
        rec = self.jobs.pop(job_id, None)
        if rec is not None:
            self.release(job_id, rec)
            self.pending.discard(job_id)

    def wait(self, job_id: str, rec: QuotaJob, tenant: str, since_s: float, cause: str) -> None:
        """The job waits for quota (admitted, or preempted to run again: `cause`, that event's id):
        last in the admission order."""
        self.admitted_n += 1
        # (tenants are few: one copy of each name, not one per job waiting)
        rec.tenant, rec.order, rec.since_s, rec.cause = sys.intern(tenant), self.admitted_n, since_s, cause
        self.pending.add(job_id)

    def reserve(self, job_id: str, rec: QuotaJob, queue: str, d: dict[str, int]) -> Hold:
        """The job holds `d` of the queue's quota now; it waits no more."""
        self.reserved_n += 1
        tenant = rec.spec.tenant if rec.spec is not None else rec.tenant
        hold = rec.hold = Hold(queue, d, self.reserved_n, tenant=sys.intern(tenant))
        use = self.usage.setdefault(queue, {})
        mine = self.tenant_usage.setdefault(hold.tenant, {})
        for r, v in d.items():
            use[r] = use.get(r, 0) + v
            mine[r] = mine.get(r, 0) + v
        self.reserved.add(job_id)
        self.pending.discard(job_id)
        return hold

    def release(self, job_id: str, rec: QuotaJob) -> None:
        """The job gives back the quota it holds (it ended, or runs again later)."""
        if rec.hold is not None:
            use = self.usage.setdefault(rec.hold.queue, {})
            mine = self.tenant_usage.setdefault(rec.hold.tenant, {})
            for r, v in rec.hold.demand.items():
                use[r] = use.get(r, 0) - v
                mine[r] = mine.get(r, 0) - v
            if not any(mine.values()):
                del self.tenant_usage[rec.hold.tenant]  # (a tenant holding nothing costs nothing)
            rec.hold = None
        for index in (self.reserved, self.preempting, self.protected):
            index.discard(job_id)

    def preempt(self, job_id: str, hold: Hold, by_job_id: str) -> None:
        if hold.preempting_for is None:
            hold.preempting_for = by_job_id
            self.preempting.add(job_id)

    def protect(self, job_id: str, hold: Hold) -> None:
        hold.protected = True
        self.protected.add(job_id)

    def held(self, job_id: str) -> tuple[str, dict[str, int]] | None:
        """The (queue, demand) of the quota the job holds, if it holds any."""
        rec = self.jobs.get(job_id)
        return (rec.hold.queue, rec.hold.demand) if rec is not None and rec.hold is not None else None

    def waiting(self) -> list[tuple[str, QuotaJob, JobSpec]]:
        """The jobs waiting for quota, with their records and specs."""
        return [(job_id, rec, rec.spec) for job_id in self.pending if (rec := self.jobs[job_id]).spec is not None]


def demand(spec: JobSpec, flavor: str | None) -> dict[str, int]:
    r = spec.resources
    d = {"cpu": r.cpu_milli * spec.replicas, "memory": r.memory_mib * spec.replicas, "gpu": spec.gpus_total}
    if r.gpu and flavor:
        d[f"gpu/{flavor}"] = r.gpu * spec.replicas
    for profile, n in spec.mig_total.items():
        d[f"mig/{profile}"] = n
    return d


class QuotaCore(BaseCore[QuotaState]):
    name = "quota"
    subjects = (
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.admitted", "fleet.evt.*.job.*.quota_reserved",
        "fleet.evt.*.job.*.queued", "fleet.evt.*.job.*.preemption_requested", "fleet.evt.*.job.*.resume_requested",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.preempted",
    )
    tick_s = 1.0
    state_format = 4  # one record per job (QuotaJob), with the event it waits since; tenants' usage

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self.tree = QuotaTree(self.config)

    def initial_state(self) -> QuotaState:
        return QuotaState()

    # ------------------------------------------------------------ evolve

    def evolve(self, state: QuotaState, env: Envelope) -> QuotaState:
        t, job_id, p = env.type, env.job_id, env.payload
        if job_id is None:
            return state
        if t in ENDED_TYPES:
            state.end(job_id, env.occurred_at)
            return state
        if job_id in state.ended:
            return state  # a late or copied fact about a job that ended changes nothing
        if isinstance(p, JobSubmitted):
            state.job(job_id).spec = p.spec
        elif t == "job.admitted":
            rec = state.jobs.get(job_id)
            # an autoscaled inference service holds nothing itself: its replicas are jobs of their own
            if (rec is not None and rec.spec is not None and rec.spec.autoscale is None and rec.hold is None
                    and job_id not in state.pending):
                state.wait(job_id, rec, env.tenant, env.occurred_at.timestamp(), env.event_id)
        elif isinstance(p, JobQueued):
            rec = state.job(job_id)
            rec.said = p.reason.message if p.reason else ""
            rec.told += 1
        elif isinstance(p, JobQuotaReserved):
            rec = state.job(job_id)
            if rec.hold is None:
                d = {"cpu": p.cpu_milli, "memory": p.memory_mib, "gpu": p.gpus}
                if p.flavor and p.gpus:
                    d[f"gpu/{p.flavor}"] = p.gpus
                for profile, n in p.mig.items():
                    d[f"mig/{profile}"] = n
                waited = job_id in state.pending
                hold = state.reserve(job_id, rec, p.queue, d)
                if waited and env.occurred_at.timestamp() - rec.since_s >= self.config.starvation_after_s:
                    state.protect(job_id, hold)  # got its quota after starving: not reclaimed
                rec.said = None
        elif isinstance(p, JobPreemptionRequested):
            rec = state.jobs.get(job_id)
            if rec is not None and rec.hold is not None:
                state.preempt(job_id, rec.hold, p.by_job_id or "")
        elif isinstance(p, JobResumeRequested):
            rec = state.job(job_id)
            nxt = resumed_attempt(rec.attempt, p)
            if nxt is None:
                return state  # a copy of an old resume: the quota it gave back was taken again since
            rec.attempt = nxt
            if p.reason.code != "preempted":
                return state
            # a preempted job that will run again from its checkpoint: its quota goes back now, and
            # it waits for quota again (at the back of its queue) like a newly admitted job
            state.release(job_id, rec)
            if rec.spec is not None:
                rec.requeued += 1
                state.wait(job_id, rec, env.tenant, env.occurred_at.timestamp(), env.event_id)
        return state

    # ------------------------------------------------------------ decide

    def decide(self, state: QuotaState, env: Envelope, ctx: Ctx) -> list[Envelope]:
        resumed = isinstance(env.payload, JobResumeRequested) and env.payload.reason.code == "preempted"
        if env.type == "job.admitted" or resumed or env.type in ENDED_TYPES and env.job_id in state.ended:
            # A cycle per event while few jobs wait (the usual case: quota at once). With a backlog
            # of P, a cycle every P / CYCLE_ON_EVENT_MAX admissions (and one per tick): each costs
            # O(P log P), so an event pays a bounded share of one, and a trickle that piled up past
            # the threshold for a moment (a pause of the process) waits a few events, not the tick
            # (with a cycle only per tick, 200 jobs/s offered waited 0.8 s at the median).
            pending = len(state.pending)
            if pending <= CYCLE_ON_EVENT_MAX or (
                    env.type == "job.admitted" and state.admitted_n % -(-pending // CYCLE_ON_EVENT_MAX) == 0):
                return self.cycle(state, ctx)
        return []

    def tick(self, state: QuotaState, ctx: Ctx) -> list[Envelope]:
        return self.cycle(state, ctx) if state.pending else []

    def queue_config(self, queue: str) -> QueueConfig | None:
        return self.config.queues.get(queue)

    def share(self, state: QuotaState, queue: str, extra: dict[str, dict[str, int]] | None = None) -> float:
        """DRF: the queue's dominant share, usage / nominal over its limited resources."""
        q = self.queue_config(queue)
        if q is None:
            return 0.0
        use, more = state.usage.get(queue, {}), (extra or {}).get(queue, {})
        return max(((use.get(r, 0) + more.get(r, 0)) / n for r, n in q.nominal.items() if n > 0), default=0.0)

    def fair_share(self, state: QuotaState, queue: str, extra: dict[str, dict[str, int]] | None = None) -> float:
        """Fair sharing (Kueue's): what the queue borrows beyond its own quota, as a share of what
        its cohort holds, dominant resource, over the queue's weight. 0 for a queue within its
        nominal or outside any cohort; a queue of weight 0 that borrows comes last."""
        q = self.queue_config(queue)
        node = self.tree.nodes.get(f"queue:{queue}")
        if q is None or node is None or node.parent is None:
            return 0.0
        use, more = state.usage.get(queue, {}), (extra or {}).get(queue, {})
        share, full = 0.0, False
        for r in self.tree.limited(queue):
            borrowed = use.get(r, 0) + more.get(r, 0) - self.tree.subtree(node.key, r)
            pool = self.tree.subtree(node.parent, r)
            if pool > 0:
                full = full or borrowed >= 0
                if borrowed > 0:
                    share = max(share, borrowed / pool)
        if q.fair_sharing.weight == 0:  # its next job borrows: after every queue of weight > 0
            return float("inf") if full else 0.0
        return share / q.fair_sharing.weight

    def tenant_share(self, state: QuotaState, tenant: str, queue: str,
                     extra: dict[str, dict[str, int]] | None = None) -> float:
        """Fair sharing between tenants: the tenant's dominant share of the quota of the queue's
        root cohort (or of the queue), over the tenant's weight (`extra`: tenant -> what this
        cycle reserved)."""
        use, more = state.tenant_usage.get(tenant, {}), (extra or {}).get(tenant, {})
        if not use and not more:
            return 0.0
        root = self.tree.root(queue) if self.tree.is_limited(queue) else None
        share = 0.0
        if root is not None:
            for r in self.tree.limited(queue):
                pool = self.tree.subtree(root, r)
                if pool > 0:
                    share = max(share, (use.get(r, 0) + more.get(r, 0)) / pool)
        policy = self.config.policy(tenant)
        weight = policy.fair_sharing.weight if policy is not None else 1.0
        return share / weight if weight > 0 else float("inf")  # (0: after every tenant of weight > 0)

    def _fair_order(self, state: QuotaState, first: list[tuple[str, QuotaJob, JobSpec]],
                    extra: dict[str, dict[str, int]], extra_t: dict[str, dict[str, int]], now: float,
                    starve_s: float) -> Iterator[tuple[str, QuotaJob, JobSpec]]:
        """The jobs of `first` (sorted by the shares at the cycle's start) in the order the cycle
        looks at them: one lane per (priority, starving, queue, tenant), each in admission order;
        the next job is the head of the lane whose shares are lowest now, with what the cycle
        reserved so far (`extra`, `extra_t`) counted. A share only grows within a cycle, so a lane's
        key from before is a lower bound: a lane whose key grew goes back and the next is looked at."""
        lanes: dict[tuple[int, bool, str, str], deque[tuple[str, QuotaJob, JobSpec]]] = {}
        for w in first:
            lanes.setdefault((-w[2].priority, now - w[1].since_s < starve_s, w[2].queue, w[2].tenant), deque()).append(w)

        def key(lane: tuple[int, bool, str, str]) -> tuple[int, bool, float, float, float, int]:  # (as `cycle` sorts)
            prio, fresh, queue, tenant = lane
            return (prio, fresh, self.fair_share(state, queue, extra), self.share(state, queue, extra),
                    self.tenant_share(state, tenant, queue, extra_t), lanes[lane][0][1].order)

        heap = [(key(lane), lane) for lane in lanes]
        heapq.heapify(heap)
        while heap:
            was, lane = heapq.heappop(heap)
            now_key = key(lane)
            if now_key > was and heap and now_key > heap[0][0]:
                heapq.heappush(heap, (now_key, lane))
                continue
            jobs = lanes[lane]
            yield jobs.popleft()
            if jobs:
                heapq.heappush(heap, (key(lane), lane))

    def cycle(self, state: QuotaState, ctx: Ctx) -> list[Envelope]:
        now = ctx.now.timestamp()
        starve_s = self.config.starvation_after_s
        # a starving job goes first within its priority: were a queue with a lower DRF share looked
        # at before it, that queue's jobs would take what frees before it could be held for it
        # then fair sharing: the queue's weighted share of what its cohort lends, DRF within the
        # queue's own nominal, then the tenant's weighted share of its cohort's quota, as they stand when the job
        # comes up (each reservation of the cycle raises its queue's and tenant's shares)
        shares: dict[tuple[str, str], tuple[float, float, float]] = {}

        def share_of(queue: str, tenant: str) -> tuple[float, float, float]:
            got = shares.get((queue, tenant))
            if got is None:
                got = shares[(queue, tenant)] = (self.fair_share(state, queue), self.share(state, queue),
                                                 self.tenant_share(state, tenant, queue))
            return got

        first = sorted(state.waiting(), key=lambda w: (
            -w[2].priority, now - w[1].since_s < starve_s, share_of(w[2].queue, w[2].tenant), w[1].order))[:CYCLE_JOBS_MAX]
        out: list[Envelope] = []
        # what this cycle reserved so far, so later jobs in it see it (outputs evolve after), per
        # queue and per tenant
        extra: dict[str, dict[str, int]] = {}
        extra_t: dict[str, dict[str, int]] = {}
        order = self._fair_order(state, first, extra, extra_t, now, starve_s)
        # cohort -> (priority, resources, job, queue, why): a starving job, or one waiting for the
        # jobs it preempts, that later jobs must not take what it lacks from
        blocked: dict[str, tuple[int, set[str], str, str, str]] = {}
        taken: set[str] = set()  # victims chosen in this cycle
        for job_id, rec, spec in order:
            queue, priority = spec.queue, spec.priority
            # What the cycle says of a job is caused by the event that made it wait (its
            # job.admitted, or the job.resume_requested that put it back in line), whatever ran
            # the cycle (that event, another job's end, a tick): its ids are derived from that event,
            # so a re-decision says the same under the same ids (docs/clients.md).
            cause = rec.cause or job_id
            cohort = self._cohort(queue)
            flavor, reason, lacking = self.fit(state, extra, queue, spec)
            hold = blocked.get(cohort)
            # Held back: jobs of the starving job's queue, and jobs that would borrow, that need
            # what it lacks. A job within its own queue's nominal is never held: that quota is
            # its queue's, and holding it would only let the starving job borrow it, to be
            # reclaimed from it at once (the nominal guarantee wins over the starvation guard).
            if flavor is not None and hold is not None and priority <= hold[0] and (
                    {r for r, v in demand(spec, flavor or None).items() if v > 0} & hold[1]) and (
                    queue == hold[3] or self._would_borrow(state, extra, queue, demand(spec, flavor or None))):
                reason = Reason(code="behind_starving_job", message=(
                    f"waiting behind job {hold[2]}, which has waited over "
                    f"{self.config.starvation_after_s:.0f}s for the same resources")) if hold[4] == "starving" else \
                    Reason(code="behind_preemptor", message=(
                        f"waiting behind job {hold[2]}, which preempts jobs to get the same resources: what they "
                        "give back is its"))
                flavor = None
            if flavor is not None:
                d = demand(spec, flavor or None)
                add, add_t = extra.setdefault(queue, {}), extra_t.setdefault(spec.tenant, {})
                for r, v in d.items():
                    add[r] = add.get(r, 0) + v
                    add_t[r] = add_t.get(r, 0) + v
                out.append(ctx.emit(JobQuotaReserved(
                    job_id=job_id, queue=queue, cpu_milli=d["cpu"], memory_mib=d["memory"],
                    gpus=spec.gpus_total, flavor=flavor or None, mig=spec.mig_total,
                ), tenant=rec.tenant, cause_id=cause,
                    key="reserved" + (f":{rec.requeued}" if rec.requeued else "")))
                continue
            if reason is not None and reason.code in ("queue_limit", "cohort_limit"):
                n = sum(1 for v in state.preempting
                        if (h := state.jobs[v].hold) is not None and h.preempting_for == job_id)
                preempting = n > 0
                if preempting:
                    reason = Reason(code="preempting", message=(
                        f"waiting for {n} preempted job(s) to give back quota in queue {queue}"))
                else:
                    victims = self.victims(state, extra, job_id, spec, taken)
                    if victims:
                        preempting = True
                        taken.update(v for v, _ in victims)
                        for victim, why in victims:
                            vhold = state.jobs[victim].hold
                            out.append(ctx.emit(JobPreemptionRequested(
                                job_id=victim, by_job_id=job_id, reason=why, grace_s=PREEMPT_GRACE_S,
                            ), tenant=self._tenant(state, victim), cause_id=cause,
                                key=f"preempt:{victim}:{vhold.order if vhold else 0}"))
                        reason = Reason(code="preempting", message=(
                            f"waiting for {len(victims)} preempted job(s) to give back quota in queue {queue}"))
                if preempting and cohort not in blocked:
                    # what its victims give back is for it: a job after it that would borrow the same
                    # resources (or a lower one of its queue) must not take it, to be preempted in turn
                    blocked[cohort] = (priority, lacking, job_id, queue, "preempting")
            if now - rec.since_s >= starve_s and cohort not in blocked and (
                    self.fit(QuotaState(), {}, queue, spec)[0] is not None):
                blocked[cohort] = (priority, lacking, job_id, queue, "starving")
            if reason is not None and rec.said != reason.message:
                # the count keeps ids apart when a reason comes back (A, B, A): the server's
                # duplicate window would otherwise drop the second A
                out.append(ctx.emit(JobQueued(job_id=job_id, queue=queue, reason=reason),
                                    tenant=rec.tenant, cause_id=cause, key=f"queued:{rec.told}:{reason.message}"))
        return out

    @staticmethod
    def _tenant(state: QuotaState, job_id: str) -> str:
        spec = state.jobs[job_id].spec
        return spec.tenant if spec else "sys"

    def victims(self, state: QuotaState, extra: dict[str, dict[str, int]], job_id: str, spec: JobSpec,
                taken: set[str]) -> list[tuple[str, Reason]]:
        """The fewest running jobs whose quota lets `job_id` in: lower priority in its own queue, or
        any priority in a queue that borrows from this one's cohort while this queue is under its
        nominal (reclaim), or — where the root cohort has `fairSharingPreemption` — in a queue that
        borrows and whose fair share without the victim stays at least this queue's with the job.
        Lowest priority first, then the most recently admitted. [] if none do."""
        q = self.queue_config(spec.queue)
        if q is None:
            return []
        # (a resource limited for it by a cohort above, with no nominal of its own: its nominal is 0)
        limited = self.tree.limited(spec.queue)
        within_nominal = all(
            self._used(state, extra, spec.queue, r) + v <= q.nominal.get(r, 0)
            for r, v in demand(spec, self._flavor_hint(spec.queue, spec)).items() if r in limited and v > 0
        )
        root = self.config.cohorts.get(self._cohort(spec.queue).removeprefix("cohort:"))
        fair = root is not None and root.fair_sharing_preemption
        candidates: list[tuple[int, int, str, Reason | None, Hold]] = []  # (None: for fair shares, checked below)
        for victim in state.reserved:
            vspec, hold = state.jobs[victim].spec, state.jobs[victim].hold
            if victim in taken or vspec is None or hold is None or hold.preempting_for is not None:
                continue
            queue, held = hold.queue, hold.demand
            if queue == spec.queue and vspec.priority < spec.priority:
                why = Reason(code="priority", message=(
                    f"preempted for job {job_id} (priority {spec.priority} > {vspec.priority}) in queue {queue}"))
            elif (within_nominal and queue != spec.queue and not hold.protected
                  and self._cohort(queue) == self._cohort(spec.queue) and self._borrowing(state, queue, held)):
                why = Reason(code="reclaim", message=(
                    f"queue {spec.queue} reclaims its nominal quota from {queue}, which borrows it"))
            elif (fair and queue != spec.queue and not hold.protected and self._cohort(queue) == self._cohort(spec.queue)
                  and self._borrowing(state, queue, held)):
                why = None
            else:
                continue
            candidates.append((vspec.priority, -hold.order, victim, why, hold))
        candidates.sort(key=lambda c: (c[0], c[1], c[2]))
        chosen: list[tuple[str, Reason]] = []
        freed: dict[str, dict[str, int]] = {k: dict(v) for k, v in extra.items()}
        mine = demand(spec, self._flavor_hint(spec.queue, spec))
        for _prio, _order, victim, maybe, hold in candidates:
            if maybe is None:
                # fair sharing: only while this queue with the job stays at most at the victim's queue without it
                with_job = {k: dict(v) for k, v in freed.items()}
                add = with_job.setdefault(spec.queue, {})
                for r, v in mine.items():
                    add[r] = add.get(r, 0) + v
                without = {k: dict(v) for k, v in freed.items()}
                sub = without.setdefault(hold.queue, {})
                for r, v in hold.demand.items():
                    sub[r] = sub.get(r, 0) - v
                ours, theirs = self.fair_share(state, spec.queue, with_job), self.fair_share(state, hold.queue, without)
                if ours > theirs:  # (at most: the victim's queue could not take it back, its job would raise it above ours)
                    continue
                maybe = Reason(code="fair_share", message=(
                    f"queue {spec.queue} is below its fair share of the cohort ({ours:.2f} with job {job_id}, "
                    f"weighted); {hold.queue} borrows more ({theirs:.2f} without this job)"))
            why = maybe
            sub = freed.setdefault(hold.queue, {})
            for r, v in hold.demand.items():
                sub[r] = sub.get(r, 0) - v
            chosen.append((victim, why))
            if self.fit(state, freed, spec.queue, spec)[0] is not None:
                return self._fewest(state, extra, spec, chosen)
        return []

    def _fewest(self, state: QuotaState, extra: dict[str, dict[str, int]], spec: JobSpec,
                chosen: list[tuple[str, Reason]]) -> list[tuple[str, Reason]]:
        """Drop any victim the job does not need after all (the first ones chosen may be redundant)."""
        keep = list(chosen)
        for victim in [v for v, _ in chosen[:-1]]:
            trial = [c for c in keep if c[0] != victim]
            freed: dict[str, dict[str, int]] = {k: dict(v) for k, v in extra.items()}
            for v, _ in trial:
                hold = state.jobs[v].hold
                assert hold is not None  # (a victim holds quota)
                sub = freed.setdefault(hold.queue, {})
                for r, amount in hold.demand.items():
                    sub[r] = sub.get(r, 0) - amount
            if self.fit(state, freed, spec.queue, spec)[0] is not None:
                keep = trial
        return keep

    def _borrowing(self, state: QuotaState, queue: str, held: dict[str, int]) -> bool:
        """Whether the queue borrows what `held` uses, not counting jobs protected from reclaim."""
        q = self.queue_config(queue)
        if q is None:
            return False
        use = dict(state.usage.get(queue, {}))
        for job_id in state.protected:
            owner = state.jobs[job_id].hold
            if owner is not None and owner.queue == queue:
                for r, v in owner.demand.items():
                    use[r] = use.get(r, 0) - v
        # (a resource limited for it by a cohort above, with no nominal of its own: all it uses is borrowed)
        limited = self.tree.limited(queue)
        return any(r in limited and use.get(r, 0) > q.nominal.get(r, 0) for r in held)

    def _models(self, queue: str) -> list[str]:
        """The GPU models (flavors) limited for the queue, in the config's order (queue, then cohorts)."""
        return self.tree.flavors(queue)

    def _flavor_hint(self, queue: str, spec: JobSpec) -> str | None:
        models = self._models(queue)
        wanted = [m for m in models if not spec.resources.gpu_models or m in spec.resources.gpu_models]
        return wanted[0] if spec.resources.gpu and wanted else None

    def _cohort(self, queue: str) -> str:
        """The root of the queue's tree (its cohort tree, or the queue itself)."""
        return self.tree.root(queue) if self.tree.is_limited(queue) else f"queue:{queue}"

    def fit(self, state: QuotaState, extra: dict[str, dict[str, int]], queue: str, spec: JobSpec,
            ) -> tuple[str | None, Reason | None, set[str]]:
        """The GPU flavor to reserve ('' when GPUs are not limited), or None with the reason and
        the resources that do not fit."""
        q = self.queue_config(queue)
        if q is None:
            return "", None, set()
        limited_models = self._models(queue)
        if not spec.resources.gpu or not limited_models:
            flavors = [""]
        else:
            wanted = spec.resources.gpu_models
            flavors = [m for m in limited_models if not wanted or m in wanted]
            if not flavors:
                return None, Reason(code="no_flavor", field="resources.gpuModels", message=(
                    f"queue {queue} has no quota for GPU model {', '.join(wanted)} "
                    f"(it has {', '.join(limited_models)})")), {f"gpu/{m}" for m in wanted}
        first: Reason | None = None
        lacking: set[str] = set()
        for flavor in flavors:
            problem = self._fits(state, extra, queue, demand(spec, flavor or None))
            if problem is None:
                return flavor, None, set()
            first = first or problem[0]
            lacking |= problem[1]
        assert first is not None
        return None, first, lacking

    def _used(self, state: QuotaState, extra: dict[str, dict[str, int]], queue: str, r: str) -> int:
        return state.usage.get(queue, {}).get(r, 0) + extra.get(queue, {}).get(r, 0)

    def _fits(self, state: QuotaState, extra: dict[str, dict[str, int]], queue: str,
              d: dict[str, int]) -> tuple[Reason, set[str]] | None:
        limited = self.tree.limited(queue)

        def used(q: str, r: str) -> int:
            return self._used(state, extra, q, r)

        for r, amount in d.items():
            if r not in limited or amount == 0:  # (0: a queue over a shrunk quota still runs CPU-only jobs)
                continue
            free, limit = self.tree.available(f"queue:{queue}", r, used)
            if amount <= free:
                continue
            node = limit.node
            mine = used(queue, r)
            nominal = self.tree.nodes[f"queue:{queue}"].nominal.get(r, 0)
            if node.is_queue and node.name == queue:
                code = "queue_limit"
                if limit.kind == "borrowing_limit":
                    why = f"> nominal {nominal} + borrowing limit {node.borrowing_limit[r]}"
                else:
                    why = f"> nominal {nominal}"
            else:
                code = "cohort_limit"
                key = node.key
                if limit.kind == "borrowing_limit":
                    why = (f"> {free} available: {node.label} may borrow at most {node.borrowing_limit[r]} "
                           f"beyond its {self.tree.subtree(key, r)}")
                else:
                    why = (f"> {free} available: {node.label} holds {self.tree.subtree(key, r)} and its queues use "
                           f"{self.tree.usage(key, r, used)}")
                    if mine + amount <= nominal:
                        why += " (others borrow this queue's share)"
                kept = self._kept_by_lenders(queue, r)
                if kept:
                    why += f"; {kept} kept back by lending limits"
            return Reason(code=code, message=f"queue {queue}: {r} {mine} used + {amount} requested {why}"), {r}
        return None

    def _kept_by_lenders(self, queue: str, r: str) -> int:
        """What the other queues of the tree keep for themselves (nominal - lending limit)."""
        root = self.tree.root(queue)
        return sum(self.tree.local(f"queue:{q}", r) for q in self.tree.queues_under(root) if q != queue)

    def _would_borrow(self, state: QuotaState, extra: dict[str, dict[str, int]], queue: str,
                      d: dict[str, int]) -> bool:
        q = self.queue_config(queue)
        return q is not None and any(
            v > 0 and r in q.nominal and self._used(state, extra, queue, r) + v > q.nominal[r] for r, v in d.items())

