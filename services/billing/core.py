"""Billing: meter every allocation interval from the log's own events; watch budgets.

folds:   node inventories (GPU index -> model, MIG instance -> model and slices), placements,
         starts, exits and job ends (and rejections), idle facts, the job's queue, its own budget
         events
decides: budget.threshold_reached / budget.exceeded, once per (budget, amount, threshold)

An interval is one replica of one attempt of a job on its node, keyed `<job>:<replica>:<attempt>`:
from `job.started` (the executor's timestamp: placement-to-start latency is the control plane's,
not the job's) to the first of `job.exited` of that attempt, the job's end (succeeded, failed,
cancelled, preempted), or `node.lost` of its node: as long as the placer holds its GPUs. A
resume (`job.resume_requested`) ends nothing: the old attempt holds its GPUs until its own exit
(the grace period of a preemption, the stop of a gang's other replicas), and the placer places
the next attempt only after it (a `job.placed` of a later attempt closes, as `replaced`, an
earlier interval whose exit the log lacks). A preempted job that is resumed has two intervals. A
duplicated or replayed event finds its interval open already (a start) or closed (an end) and
changes nothing: no sampling, no double counting; a copy of a `job.idle_detected` is known by
its event id.

Idle cost: the GPU part of an interval while the job was idle, from `job.idle_detected` (minus
its `idle_s`: the GPUs were idle that long when it was said) to `job.idle_ended` or the end.

Budgets are checked on every event that starts or ends an interval of the tenant or queue, and
on `tick` for what running allocations have spent so far. Each threshold is said once per
budget amount: its event id derives from (scope, budget, amount, threshold), and the state
folds the events said, so a redelivery, a restart or a second instance says nothing new;
raising a budget in the config makes new thresholds to cross. A budget with `period: month`
counts what was spent in the calendar month (UTC) of the log's time: an interval's cost goes to
the months it ran in (split at the boundary), spending starts again from 0 each month, and each
threshold is said once per month (the month is part of the event's id).

Memory: what a job needs is dropped when it ends (its queue, placements, the keys of its closed
intervals). To stay exactly-once for a late duplicate (a `job.placed` and `job.started` copied
into the log again after the end), the ended job's id is kept for `ENDED_KEPT_S` of log time
(an hour: thirty times the stream's 120 s duplicate window), then forgotten. A replay folds the
log in order and rebuilds the same state.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal

from gpufleet.shared.contract.clusterconfig import BudgetConfig, ClusterConfig
from gpufleet.shared.contract.events import (
    RUN_ENDED_JOB_TYPES,
    SYS_TENANT,
    BudgetExceeded,
    BudgetThresholdReached,
    Envelope,
    JobExited,
    JobIdleDetected,
    JobIdleEnded,
    JobPlaced,
    JobStarted,
    JobSubmitted,
    NodeLost,
    NodeRegistered,
    ReplicaAllocation,
    _BudgetPayload,
)
from gpufleet.shared.contract.ids import derive_id
from gpufleet.shared.runtime.loop import BaseCore, Ctx

from .pricing import (
    MONEY_Q,
    ZERO,
    ChargeLine,
    Usage,
    hourly,
    lines,
    mig_share,
    money_key,
    month_of,
    month_start,
    next_month,
    seconds_between,
    share,
    total,
    usage,
)

JOB_ENDS = RUN_ENDED_JOB_TYPES  # (shared/contract/events.py: the contract's one definition)
Scope = tuple[str, str]  # ("tenant" | "queue", name)
ENDED_KEPT_S = 3600.0  # log seconds an ended job's id is kept to ignore its late duplicates


@dataclass
class OpenInterval:
    key: str
    job_id: str
    tenant: str
    queue: str
    replica: int
    attempt: int
    node_id: str
    started_at: datetime
    usage: Usage
    hourly: Decimal  # what it costs per hour (budgets' running estimate)
    idle_since: datetime | None = None
    idle_s: Decimal = ZERO  # idle seconds of idle periods already ended
    gpus: tuple[int, ...] = ()  # the GPU indices it holds on its node (the per-tenant gauges)


@dataclass(frozen=True)
class Charge:
    """A closed interval and what it cost, line by line."""

    key: str
    job_id: str
    tenant: str
    queue: str
    replica: int
    attempt: int
    node_id: str
    started_at: datetime
    ended_at: datetime
    end: str  # what closed it: exited:<reason>, succeeded, failed, cancelled, preempted, node_lost, replaced
    currency: str
    lines: tuple[ChargeLine, ...]
    open: bool = False  # a running interval charged up to a given time (reports only)

    @property
    def cost(self) -> Decimal:
        return sum((line.cost for line in self.lines), ZERO)

    @property
    def idle_cost(self) -> Decimal:
        return sum((line.idle_cost for line in self.lines), ZERO)

    @property
    def gpu_seconds(self) -> Decimal:
        return sum((line.unit_seconds for line in self.lines if line.resource.startswith("gpu/")), ZERO)

    @property
    def idle_gpu_seconds(self) -> Decimal:
        return sum((line.idle_unit_seconds for line in self.lines if line.resource.startswith("gpu/")), ZERO)


@dataclass(slots=True)
class BillingJob:
    """What billing knows of one job that has not ended: one record, forgotten at once when the job
    ends (`BillingState.end`). Collections stay None until needed: a pending job costs one small
    record."""

    queue: str | None = None  # from its job.submitted
    attempt: int = 1  # the latest attempt placed (from job.placed)
    # interval key -> (tenant, allocation) as placed (open or not started yet), None once it closed
    # (a late duplicate start reopens nothing)
    intervals: dict[str, tuple[str, ReplicaAllocation] | None] | None = None
    idle_seen: set[str] | None = None  # its job.idle_detected ids folded


@dataclass
class BillingState:
    gpu_models: dict[str, dict[int, str]] = field(default_factory=dict)  # node -> GPU index -> model
    mig_devices: dict[str, tuple[str, str]] = field(default_factory=dict)  # MIG UUID -> (model, profile)
    jobs: dict[str, BillingJob] = field(default_factory=dict)
    # interval key -> the running interval (of a job's `intervals`): what node losses, budgets and
    # reports walk; opened by `_start`, closed by `_close` (every one of a job before its `end`)
    open: dict[str, OpenInterval] = field(default_factory=dict)
    ended: OrderedDict[str, datetime] = field(default_factory=OrderedDict)  # ended job -> log time of its end
    # ended job -> its placements that had not started at the end (a gang's replica whose agent
    # lagged): its start may still come, and that run is charged like any other; kept with the id
    late: dict[str, BillingJob] = field(default_factory=dict)
    log_time: datetime | None = None  # the latest event time seen: the clock of the pruning
    charges: list[Charge] = field(default_factory=list)  # closed intervals, in log order (kept when asked)
    spent: dict[Scope, Decimal] = field(default_factory=dict)  # closed intervals' cost
    idle_spent: dict[Scope, Decimal] = field(default_factory=dict)  # what of it the GPUs were idle
    spent_month: dict[tuple[Scope, str], Decimal] = field(default_factory=dict)  # monthly budgets: (scope, YYYY-MM)
    intervals: int = 0  # closed intervals counted
    crossed: set[tuple[str, str, str, str, int]] = field(default_factory=set)  # (scope, budget, amount, period, pct)
    touched: set[Scope] = field(default_factory=set)  # scopes the last event changed (for decide)

    def size(self) -> dict[str, int]:
        """How many entries each growing part holds (for `gpufleet bench billing`)."""
        jobs = self.jobs.values()
        placed = [p for r in jobs for p in (r.intervals or {}).values()]
        return {"jobs": len(self.jobs), "placements": sum(p is not None for p in placed),
                "idle_seen": sum(len(r.idle_seen or ()) for r in jobs),
                "open": len(self.open), "closed": sum(p is None for p in placed),
                "ended": len(self.ended), "late": len(self.late), "spent": len(self.spent) + len(self.spent_month) + len(self.idle_spent),
                "crossed": len(self.crossed), "charges": len(self.charges)}

    def record(self, job_id: str) -> BillingJob | None:
        """The job's record: of a job not ended, or an ended one's placements that had not started."""
        rec = self.jobs.get(job_id)
        return rec if rec is not None else self.late.get(job_id)

    def job(self, job_id: str) -> BillingJob:
        rec = self.jobs.get(job_id)
        if rec is None:
            rec = self.jobs[job_id] = BillingJob()
        return rec

    def end(self, job_id: str, at: datetime) -> None:
        """The job ended (its intervals closed): all it held goes; only its id is kept, for
        ENDED_KEPT_S of log time, to ignore late copies of its events, with the placements that had
        not started (a start after the end is a run that happened: its agent lagged behind the end)."""
        rec = self.jobs.pop(job_id, None)
        unstarted: dict[str, tuple[str, ReplicaAllocation] | None] = {
            k: v for k, v in (rec.intervals or {}).items() if v is not None} if rec is not None else {}
        if rec is not None and unstarted:
            self.late[job_id] = BillingJob(queue=rec.queue, attempt=rec.attempt, intervals=unstarted)
        self.ended[job_id] = max(at, self.log_time or at)
        self.ended.move_to_end(job_id)


def interval_key(job_id: str, replica: int, attempt: int) -> str:
    return f"{job_id}:{replica}:{attempt}"


class BillingCore(BaseCore[BillingState]):
    name = "billing"
    subjects = (
        "fleet.evt.sys.node.*.registered", "fleet.evt.sys.node.*.lost",
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.placed", "fleet.evt.*.job.*.started",
        "fleet.evt.*.job.*.exited", "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed",
        "fleet.evt.*.job.*.cancelled", "fleet.evt.*.job.*.preempted", "fleet.evt.*.job.*.rejected",
        "fleet.evt.*.job.*.idle_detected", "fleet.evt.*.job.*.idle_ended",
        "fleet.evt.sys.budget.*.*.*",
    )
    tick_s = 5.0
    state_format = 2  # one record per job (BillingJob)

    def __init__(self, config: ClusterConfig | None = None, *, keep_charges: bool = False) -> None:
        self.config = config or ClusterConfig()
        self.prices = self.config.prices
        self.keep_charges = keep_charges  # the ledger and `gpufleet bill` keep every charge; the service only totals
        self._monthly = {scope for scope, b in self._budgets() if b.period == "month"}  # scopes counted per month

    def initial_state(self) -> BillingState:
        return BillingState()

    # ------------------------------------------------------------ evolve

    def evolve(self, state: BillingState, env: Envelope) -> BillingState:
        p = env.payload
        state.touched = set()
        if state.log_time is None or env.occurred_at > state.log_time:
            state.log_time = env.occurred_at
            self._prune(state)
        job_id = env.job_id
        if job_id is not None and job_id in state.ended:
            if job_id in state.late and isinstance(p, JobStarted):
                self._start(state, env, p)  # a placement that had not started when the job ended
            elif job_id in state.late and isinstance(p, JobExited):
                ending = state.open.get(interval_key(p.job_id, p.replica, p.attempt))
                if ending is not None:
                    self._close(state, ending, env.occurred_at, f"exited:{p.reason}")
            return state  # else a late copy of an ended job's event: it ended, nothing more to count
        if isinstance(p, NodeRegistered):
            state.gpu_models[p.node_id] = {g.index: g.model for g in p.inventory.gpus}
            for g in p.inventory.gpus:
                for m in g.mig_devices:
                    state.mig_devices[m.uuid] = (g.model, m.profile)
        elif isinstance(p, NodeLost):
            for iv in [iv for iv in state.open.values() if iv.node_id == p.node_id]:
                self._close(state, iv, env.occurred_at, "node_lost")
        elif isinstance(p, JobSubmitted):
            rec = state.job(p.job_id)
            if rec.queue is None:
                rec.queue = p.spec.queue
        elif isinstance(p, JobPlaced):
            rec = state.job(p.job_id)
            if p.attempt > rec.attempt:
                # a later attempt is placed only once the placer freed every GPU of the earlier ones
                # (their exits): one whose exit the log lacks ends here, not later
                rec.attempt = p.attempt
                for iv in [iv for iv in self._of_job(state, p.job_id, None) if iv.attempt < p.attempt]:
                    self._close(state, iv, env.occurred_at, "replaced")
            for a in p.allocations:
                if rec.intervals is None:
                    rec.intervals = {}
                rec.intervals.setdefault(interval_key(p.job_id, a.replica, p.attempt), (env.tenant, a))
        elif isinstance(p, JobStarted):
            self._start(state, env, p)
        elif isinstance(p, JobExited):
            ending = state.open.get(interval_key(p.job_id, p.replica, p.attempt))
            if ending is not None:
                self._close(state, ending, env.occurred_at, f"exited:{p.reason}")
        elif env.type in JOB_ENDS and job_id:
            for iv in self._of_job(state, job_id, None):
                self._close(state, iv, env.occurred_at, env.type.removeprefix("job."))
            state.end(job_id, env.occurred_at)
        elif isinstance(p, JobIdleDetected):
            rec0 = state.jobs.get(p.job_id)
            if rec0 is None or not rec0.intervals:
                return state  # nothing of it placed: nothing to be idle
            if rec0.idle_seen is None:
                rec0.idle_seen = set()
            if env.event_id in rec0.idle_seen:
                return state  # a copy of an idle period already counted (it may have ended since)
            rec0.idle_seen.add(env.event_id)
            since = env.occurred_at
            for iv in self._of_job(state, p.job_id, p.node_id):
                if iv.idle_since is None:
                    back = seconds_between(iv.started_at, env.occurred_at)
                    idle = min(Decimal(str(p.idle_s)), back) if p.idle_s > 0 else ZERO
                    iv.idle_since = since - _timedelta(idle)
        elif isinstance(p, JobIdleEnded):
            for iv in self._of_job(state, p.job_id, p.node_id):
                if iv.idle_since is not None:
                    iv.idle_s += seconds_between(iv.idle_since, env.occurred_at)
                    iv.idle_since = None
        elif isinstance(p, BudgetThresholdReached | BudgetExceeded):
            state.crossed.add(_crossing(p))
        return state

    @staticmethod
    def _of_job(state: BillingState, job_id: str, node_id: str | None) -> list[OpenInterval]:
        """The job's running intervals (on `node_id`), by attempt and replica."""
        rec = state.jobs.get(job_id)
        out = []
        for key in (rec.intervals or ()) if rec is not None else ():
            iv = state.open.get(key)
            if iv is not None and (node_id is None or iv.node_id == node_id):
                out.append(iv)
        return sorted(out, key=lambda iv: (iv.attempt, iv.replica))

    def _start(self, state: BillingState, env: Envelope, p: JobStarted) -> None:
        key = interval_key(p.job_id, p.replica, p.attempt)
        rec = state.record(p.job_id)
        placed = (rec.intervals or {}).get(key) if rec is not None else None
        if key in state.open or rec is None or placed is None:
            # a duplicate, a late copy of a start whose interval is over, or no placement in the log
            # (nothing was allocated to charge for)
            return
        tenant, a = placed
        u = self.usage_of(state, a)
        queue = rec.queue if rec.queue is not None else "default"
        state.open[key] = OpenInterval(
            key=key, job_id=p.job_id, tenant=tenant, queue=queue, replica=p.replica,
            attempt=p.attempt, node_id=a.node_id, started_at=env.occurred_at, usage=u, hourly=hourly(u, self.prices),
            gpus=tuple(a.gpu_indices),
        )
        state.touched |= {("tenant", tenant), ("queue", queue)}

    def usage_of(self, state: BillingState, a: ReplicaAllocation) -> Usage:
        """What an allocation holds, by GPU model (from its node's registered inventory)."""
        models = state.gpu_models.get(a.node_id, {})
        gpus: dict[str, Decimal] = {}
        for index in a.gpu_indices:
            model = models.get(index, "unknown")
            gpus[model] = gpus.get(model, ZERO) + share(a.gpu_milli)
        for uuid in a.mig_devices:
            model, profile = state.mig_devices.get(uuid, ("unknown", "1g"))
            gpus[model] = gpus.get(model, ZERO) + mig_share(profile)
        return usage(gpus, a.cpu_milli, a.memory_mib)

    def charge_of(self, iv: OpenInterval, end: datetime, why: str, *, open_: bool = False) -> Charge:
        seconds = seconds_between(iv.started_at, end)
        idle = iv.idle_s + (seconds_between(iv.idle_since, end) if iv.idle_since is not None else ZERO)
        return Charge(
            key=iv.key, job_id=iv.job_id, tenant=iv.tenant, queue=iv.queue, replica=iv.replica, attempt=iv.attempt,
            node_id=iv.node_id, started_at=iv.started_at, ended_at=max(end, iv.started_at), end=why,
            currency=self.prices.currency, lines=lines(iv.usage, self.prices, seconds, idle), open=open_,
        )

    def _close(self, state: BillingState, iv: OpenInterval, end: datetime, why: str) -> None:
        del state.open[iv.key]
        rec = state.record(iv.job_id)
        assert rec is not None and rec.intervals is not None  # (it opened from one of them)
        rec.intervals[iv.key] = None
        if iv.job_id in state.late and all(v is None for v in rec.intervals.values()):
            del state.late[iv.job_id]  # (a late run of an ended job, charged: nothing more can start)
        charge = self.charge_of(iv, end, why)
        state.intervals += 1
        for scope in (("tenant", iv.tenant), ("queue", iv.queue)):
            state.spent[scope] = state.spent.get(scope, ZERO) + charge.cost
            if charge.idle_cost:
                state.idle_spent[scope] = state.idle_spent.get(scope, ZERO) + charge.idle_cost
            state.touched.add(scope)
            if scope in self._monthly:
                for month, cost in self._by_month(iv, charge):
                    state.spent_month[(scope, month)] = state.spent_month.get((scope, month), ZERO) + cost
        if self.keep_charges:
            state.charges.append(charge)

    def _by_month(self, iv: OpenInterval, charge: Charge) -> list[tuple[str, Decimal]]:
        """The charge's cost by calendar month (UTC): split at month boundaries, each part priced."""
        start, end = charge.started_at, charge.ended_at
        if month_of(start) == month_of(end) or end <= start:
            return [(month_of(start), charge.cost)]
        out = []
        while start < end:
            edge = min(end, next_month(start))
            out.append((month_of(start), total(lines(iv.usage, self.prices, seconds_between(start, edge)))))
            start = edge
        return out

    @staticmethod
    def _prune(state: BillingState) -> None:
        """Forget ended jobs older than ENDED_KEPT_S of log time (oldest first: the dict is in end order)."""
        assert state.log_time is not None
        horizon = state.log_time - timedelta(seconds=ENDED_KEPT_S)
        while state.ended:
            job_id, at = next(iter(state.ended.items()))
            if at >= horizon:
                break
            state.ended.popitem(last=False)
            rec = state.late.get(job_id)
            if rec is not None and not any(k in state.open for k in rec.intervals or ()):
                del state.late[job_id]  # (one started late and still running stays until its exit)

    # ------------------------------------------------------------ reports

    def open_charges(self, state: BillingState, now: datetime) -> list[Charge]:
        """Every running interval as if it ended `now` (for reports and budgets)."""
        return [self.charge_of(iv, now, "running", open_=True) for iv in state.open.values()]

    def spending(self, state: BillingState, scope: Scope, now: datetime, *, monthly: bool = False) -> Decimal:
        """Closed charges plus what the scope's running intervals cost so far: all time, or (`monthly`)
        in the calendar month (UTC) of `now` only."""
        kind, name = scope
        since = month_start(now) if monthly else None
        running = ZERO
        for iv in state.open.values():
            if (iv.tenant if kind == "tenant" else iv.queue) == name:
                start = max(iv.started_at, since) if since is not None else iv.started_at
                running += iv.hourly * seconds_between(start, now) / Decimal(3600)
        closed = state.spent_month.get((scope, month_of(now)), ZERO) if monthly else state.spent.get(scope, ZERO)
        return closed + running

    # ------------------------------------------------------------ decide

    def _budgets(self) -> list[tuple[Scope, BudgetConfig]]:
        b = self.config.budgets
        return [(("tenant", n), c) for n, c in b.tenants.items()] + [(("queue", n), c) for n, c in b.queues.items()]

    def check_budgets(self, state: BillingState, ctx: Ctx, scopes: set[Scope] | None = None) -> list[Envelope]:
        """An event for every threshold crossed and not said yet (all budgets, or those of `scopes`)."""
        out: list[Envelope] = []
        for scope, budget in self._budgets():
            if scopes is not None and scope not in scopes:
                continue
            spent: Decimal | None = None
            amount = money_key(budget.amount)
            period = budget.period_of(ctx.now) or ""
            for pct in budget.percentages:
                if (scope[0], scope[1], amount, period, pct) in state.crossed:
                    continue
                if spent is None:
                    spent = self.spending(state, scope, ctx.now, monthly=bool(period))
                if spent * 100 < budget.amount * pct:
                    break  # sorted: no higher one is reached either
                out.append(self._crossing_event(ctx, scope, budget, pct, spent, period or None))
        return out

    def _crossing_event(self, ctx: Ctx, scope: Scope, budget: BudgetConfig, pct: int,
                        spent: Decimal, period: str | None = None) -> Envelope:
        kind, name = scope
        cls = BudgetExceeded if pct >= 100 else BudgetThresholdReached
        payload = cls(scope=kind, budget=name, amount=budget.amount,  # type: ignore[arg-type]
                      currency=self.prices.currency, spent=spent.quantize(MONEY_Q), threshold_pct=pct,
                      policy=budget.policy, period=period)
        # the id depends only on what is crossed (and the month, for a monthly budget): two
        # instances, or a re-decision, say it once
        parent = f"budget:{kind}:{name}:{money_key(budget.amount)}" + (f":{period}" if period else "")
        event_id = derive_id(parent, pct, time_ms=0)
        return Envelope(
            event_id=event_id, type=payload.type, occurred_at=ctx.now, tenant=SYS_TENANT,
            causation_id=ctx.cause.event_id if ctx.cause else None,
            correlation_id=ctx.cause.correlation_id if ctx.cause else None, actor=ctx.actor, payload=payload,
        )

    def decide(self, state: BillingState, env: Envelope, ctx: Ctx) -> list[Envelope]:
        if not state.touched or not self.config.budgets.tenants and not self.config.budgets.queues:
            return []
        return self.check_budgets(state, ctx, set(state.touched))

    def tick(self, state: BillingState, ctx: Ctx) -> list[Envelope]:
        if not state.open or not self.config.budgets.tenants and not self.config.budgets.queues:
            return []
        return self.check_budgets(state, ctx)

    def on_start(self, state: BillingState, ctx: Ctx) -> list[Envelope]:
        return self.check_budgets(state, ctx)


def _crossing(p: _BudgetPayload) -> tuple[str, str, str, str, int]:
    return (p.scope, p.budget, money_key(p.amount), p.period or "", p.threshold_pct)


def _timedelta(seconds: Decimal) -> timedelta:
    return timedelta(microseconds=int(seconds.scaleb(6)))
