"""The expected wait of a job not submitted yet: a small, explainable model over the quota's and
the placer's folds of the log (`gpufleet estimate`, and `submit` on a terminal).

The model, step by step on a simulated clock that starts now:

- Running jobs end at their max runtime (placement time + `maxRuntime`, as the placer's backfill
  assumes), each giving back its nodes' resources and its queue's quota.
- The jobs ahead of this one wait in the quota's and the placer's order: first those holding
  quota already and waiting for nodes (the placer's pending jobs, in its order), then the jobs
  waiting for quota with a priority at least this job's (priority, then admission order; this
  job, submitted now, comes after every job of its priority).
- At each step (now, then each time a job ends) every waiting job, in that order, starts if its
  queue (and cohorts) has quota room for it (`QuotaCore.fit`) and its replicas fit the nodes
  (`PlacerCore.plan`, on copies); a job that does not fit does not hold back the ones behind it
  (the quota has no head-of-line blocking). A job that starts runs its max runtime.
- This job's wait is the time of the step at which it starts.

Not modelled: preemption (a higher-priority job may take a lower one's quota sooner), the
placer's backfill reservation for the head job, the DRF share between queues of one priority,
jobs submitted later with a higher priority, jobs ending before their max runtime (the wait is
then shorter), and MIG instances held by running jobs (never given back, as in the placer's own
estimate). The estimate is an upper bound in the usual case, not a promise.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpufleet.services.placer.core import PlacerCore, PlacerState, Plan, ask_of, runtime_estimate, with_flavor
from gpufleet.services.quota.core import QuotaCore, QuotaState, demand
from gpufleet.shared.contract.events import ReplicaAllocation
from gpufleet.shared.contract.spec import JobSpec

AHEAD_MAX = 512  # waiting jobs modelled (the quota's cycle looks at as many)
PLANS_MAX = 20_000  # placement attempts per estimate: bound the work of one `gpufleet estimate`
THIS = ""  # the job estimated, in the waiting list
ASSUMES = ("running jobs end at their max runtime; jobs ahead start in priority, then admission order, "
           "as soon as quota and nodes allow; no preemption")


@dataclass
class Waiting:
    job_id: str
    queue: str
    spec: JobSpec
    needs_quota: bool  # False: it holds its quota already (waiting for nodes)


@dataclass
class Wait:
    """The expected wait and what it assumed (`as_json` for --json, `note` for people)."""

    wait_s: float | None
    note: str
    start: datetime | None = None
    nodes: tuple[str, ...] = ()
    ahead: int = 0  # jobs waiting ahead of this one
    ahead_first: int = 0  # of them, those that start before it in the model
    running_ends: int = 0  # running jobs it waits for to end
    quota_queue: str | None = None
    quota_full: str | None = None  # why the queue (or its cohort) has no room for it now
    quota_until: datetime | None = None  # when it has room, in the model
    quota_ends: int = 0  # running jobs of the queue's tree that end before it has room
    truncated: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "wait_s": self.wait_s, "start": _iso(self.start), "nodes": list(self.nodes), "ahead": self.ahead,
            "ahead_first": self.ahead_first, "running_ends": self.running_ends,
            "quota": None if self.quota_queue is None else {
                "queue": self.quota_queue, "full_now": self.quota_full is not None, "reason": self.quota_full,
                "until": _iso(self.quota_until), "running_ends": self.quota_ends},
            "truncated": self.truncated, "assumes": ASSUMES,
        }


def _iso(t: datetime | None) -> str | None:
    return t.isoformat().replace("+00:00", "Z") if t is not None else None


def _utc(s: float) -> datetime:
    return datetime.fromtimestamp(s, UTC)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _add(extra: dict[str, dict[str, int]], queue: str, d: dict[str, int], sign: int) -> None:
    use = extra.setdefault(queue, {})
    for r, v in d.items():
        use[r] = use.get(r, 0) + sign * v


def waiting_ahead(pstate: PlacerState, qstate: QuotaState, priority: int) -> list[Waiting]:
    """The jobs ahead of a new job of `priority`: those holding quota and waiting for nodes, then
    those waiting for quota with a priority at least `priority` (priority, then admission order)."""
    out: list[Waiting] = []
    for job_id in pstate.pending:
        rec = pstate.jobs[job_id]
        spec = rec.spec
        if spec is not None and rec.allocations is None:
            held = qstate.held(job_id)
            out.append(Waiting(job_id, held[0] if held else spec.queue, spec, needs_quota=False))
    queued = sorted((w for w in qstate.waiting() if w[2].priority >= priority),
                    key=lambda w: (-w[2].priority, w[1].order))
    out += [Waiting(j, s.queue, s, needs_quota=True) for j, _, s in queued]
    return out


def expected_wait(placer: PlacerCore, pstate: PlacerState, quota: QuotaCore, qstate: QuotaState, spec: JobSpec,
                  now_s: float) -> Wait:
    """When `spec`, submitted now, would start (see the module's docstring for the model)."""
    if not pstate.nodes:
        return Wait(None, "no nodes registered")
    if not placer.ever_fits(pstate, spec):
        return Wait(None, "no set of healthy nodes could ever hold it")
    never = quota.fit(QuotaState(), {}, spec.queue, spec)
    if never[0] is None:
        why = never[1].message if never[1] else ""
        return Wait(None, f"the quota of queue {spec.queue} could never hold it ({why})")
    ahead = waiting_ahead(pstate, qstate, spec.priority)
    w = Wait(None, "", ahead=len(ahead))
    if len(ahead) > AHEAD_MAX:
        ahead, w.truncated = ahead[:AHEAD_MAX], True
    waiting = [*ahead, Waiting(THIS, spec.queue, spec, needs_quota=True)]

    flavor_now, why_now, _ = quota.fit(qstate, {}, spec.queue, spec)
    limited = quota.tree.is_limited(spec.queue)
    if limited:
        w.quota_queue = spec.queue
        if flavor_now is None and why_now is not None:
            w.quota_full = why_now.message
    tree = quota.tree.root(spec.queue) if limited else None
    same_tree = set(quota.tree.queues_under(tree)) if tree else set()

    # the clock: (time, order, job, its allocations, its quota, was it running now)
    ends: list[tuple[float, int, str, tuple[ReplicaAllocation, ...], tuple[str, dict[str, int]] | None, bool]] = []
    for n, (end_s, job_id) in enumerate(pstate.ending(now_s)):
        ends.append((max(now_s, end_s), n, job_id, pstate.jobs[job_id].allocations or (), qstate.held(job_id),
                     True))
    heapq.heapify(ends)
    order = len(ends)
    plan = Plan()
    extra: dict[str, dict[str, int]] = {}
    t = now_s
    plans = 0
    while True:
        failed: set[Any] = set()  # shapes that did not fit at this step: the same shape fails again
        for job in list(waiting):
            flavor: str | None = ""
            if job.needs_quota:
                flavor = quota.fit(qstate, extra, job.queue, job.spec)[0]
                if flavor is None:
                    continue
                if job.job_id == THIS and w.quota_until is None:
                    w.quota_until = _utc(t)
            s = with_flavor(job.spec, flavor)
            shape = (ask_of(s), s.replicas, tuple(sorted(s.resources.mig.items())))
            if shape in failed:
                continue
            plans += 1
            if plans > PLANS_MAX:
                w.note = f"not known: more than {PLANS_MAX} placement attempts to model ({len(ahead)} jobs ahead)"
                return w
            trial = plan.fork()
            allocs = placer.plan(pstate, s, trial, full_scan=True)
            if allocs is None:
                failed.add(shape)
                continue
            plan = trial
            if job.job_id == THIS:
                w.wait_s, w.start, w.nodes = t - now_s, _utc(t), tuple(sorted({a.node_id for a in allocs}))
                w.note = _note(w)
                return w
            waiting.remove(job)
            w.ahead_first += 1
            held: tuple[str, dict[str, int]] | None
            if job.needs_quota:
                d = demand(s, flavor or None)
                _add(extra, job.queue, d, +1)
                held = (job.queue, d)
            else:
                held = qstate.held(job.job_id)
            heapq.heappush(ends, (t + runtime_estimate(pstate, s)[0], order, job.job_id, allocs, held, False))
            order += 1
        if not ends:
            w.note = "does not fit, even once every running and waiting job has ended"
            return w
        t = ends[0][0]
        while ends and ends[0][0] == t:
            _, _, _, allocs, held, was_running = heapq.heappop(ends)
            plan.give_back(pstate, allocs)
            if held is not None:
                _add(extra, held[0], held[1], -1)
            if was_running:
                w.running_ends += 1
                if w.quota_until is None and held is not None and held[0] in same_tree:
                    w.quota_ends += 1


def _note(w: Wait) -> str:
    """What the estimate assumed, in words: `3 jobs ahead (2 start first); waits for 2 running
    jobs to end; quota of queue research full until 2026-05-01T13:00:00Z (1 of its running jobs ends)`."""
    parts = []
    if w.ahead:
        parts.append(f"{_plural(w.ahead, 'job')} ahead ({w.ahead_first} start first)"
                     + (f", the first {AHEAD_MAX} modelled" if w.truncated else ""))
    if w.running_ends:
        parts.append(f"waits for {_plural(w.running_ends, 'running job')} to end")
    if w.quota_full is not None:
        until = _iso(w.quota_until)
        parts.append(f"quota of queue {w.quota_queue} full until {until}"
                     + (f" ({_plural(w.quota_ends, 'running job')} of its cohort end)" if w.quota_ends else "")
                     + f": {w.quota_full}")
    if w.wait_s == 0 and not parts:
        return "fits the free capacity and quota now"
    if w.wait_s == 0:
        parts.append("fits now")
    elif w.nodes:
        parts.append(f"then on {', '.join(w.nodes)}")
    return "; ".join(parts) + f" (assumes {ASSUMES})"


__all__ = ["AHEAD_MAX", "ASSUMES", "Wait", "Waiting", "expected_wait", "waiting_ahead"]
