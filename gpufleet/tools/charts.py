"""The dashboard's charts: time series folded from the stream, a point every `step_s` of log time.

Each point (`Charts.points`, the last `keep` of them) says, for the step that ended at `t`:

- `alloc` / `total`: GPUs allocated (shares as fractions) and GPUs registered, per GPU model;
- `util`: the mean utilisation (%) of the allocated GPUs per model, from the nodes' samples
  (`fleet.tel.node.<node>.gpu`, FLEET_TELEMETRY) no older than 30 s at `t` (none while the board
  folds old history: a sample says what is now, not what was);
- `pending`: jobs waiting per queue (submitted, admitted, queued, reserved);
- `wait_p50` / `wait_p95`: seconds from `job.submitted` to the first placement, of the jobs of
  each queue placed in the step;
- `cost` / `idle_cost`: what each tenant's allocated GPUs cost in the step at the config's
  prices (the list prices without any: shared/contract/clusterconfig.py), and the part of it on
  GPUs whose last sample said under 5 % busy;
- `preempted` / `failed`: jobs preempted (and resumed later) and jobs failed in the step.

Log time, not the wall clock, so a board folding an hour of history draws that hour; while
live, `advance` (the dashboard's ticker) adds the points of steps in which nothing was logged.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from gpufleet.shared.contract.clusterconfig import LIST_PRICES, PriceTable
from gpufleet.shared.contract.events import (
    RUN_ENDED_JOB_TYPES,
    Envelope,
    JobPlaced,
    JobResumeRequested,
    JobSubmitted,
)

if TYPE_CHECKING:
    from gpufleet.tools.dashboard import Board

STEP_S = 10.0  # a point per 10 s of log time
KEEP = 360  # points kept: an hour at 10 s
SAMPLE_FRESH_S = 30.0  # a GPU sample older than this says nothing of now
IDLE_PCT = 5.0  # an allocated GPU busy less than this is idle (its cost is idle cost)
WAITING = ("submitted", "admitted", "queued", "reserved")


@dataclass
class Charts:
    enabled: bool = False  # the dashboard's board draws them; a view snapshot's or a replay's does not
    clock: Callable[[], float] | None = None  # the wall clock: no point is made for a step out of the window
    step_s: float = STEP_S
    keep: int = KEEP
    prices: PriceTable = LIST_PRICES
    points: deque[dict[str, Any]] = field(default_factory=deque)
    next_at: float = 0.0  # the end of the step being gathered (0: no event yet)
    made: int = 0  # points made so far (the page is sent the series again when it grows)
    submitted_at: dict[str, float] = field(default_factory=dict)  # job -> when submitted, until first placed
    waits: dict[str, list[float]] = field(default_factory=dict)  # queue -> waits of jobs placed in the step
    preempted: int = 0
    failed: int = 0
    util: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)  # (node, gpu) -> (%, at)

    def observe(self, board: Board, env: Envelope) -> None:
        """An event of the log, before the board folds it: the steps it closes first."""
        if not self.enabled:
            return
        t = env.occurred_at.timestamp()
        self.advance(board, t)
        p = env.payload
        if isinstance(p, JobSubmitted):
            self.submitted_at.setdefault(p.job_id, t)
        elif isinstance(p, JobPlaced):
            since = self.submitted_at.pop(p.job_id, None)
            if since is not None:
                row = board.view.jobs.get(p.job_id)
                self.waits.setdefault(row.queue if row else "-", []).append(max(0.0, t - since))
        elif isinstance(p, JobResumeRequested) and p.reason.code == "preempted":
            self.preempted += 1
        if env.type == "job.preempted":
            self.preempted += 1
        elif env.type == "job.failed":
            self.failed += 1
        if env.type in RUN_ENDED_JOB_TYPES and env.job_id:
            self.submitted_at.pop(env.job_id, None)

    def sample(self, doc: dict[str, Any], now: float) -> None:
        """A node's GPU sample document (FLEET_TELEMETRY)."""
        node = str(doc.get("node_id", ""))
        for g in doc.get("gpus", ()):
            try:
                self.util[(node, int(g["index"]))] = (float(g["util_pct"]), now)
            except (KeyError, TypeError, ValueError):
                continue

    def advance(self, board: Board, t: float) -> bool:
        """Close every step that ended by `t` (a point each, from the board as it is); True if any.
        A step that ended before the window the page shows (by the wall clock) makes no point:
        folding a long history costs nothing for the steps that would fall out anyway."""
        if not self.enabled:
            return False
        if not self.next_at:
            self.next_at = (t // self.step_s + 1) * self.step_s
            return False
        if t < self.next_at:
            return False
        if t - self.next_at > self.keep * self.step_s:  # a long silence: the empty steps before the window go
            self.next_at += ((t - self.next_at) // self.step_s - self.keep) * self.step_s
        horizon = self.clock() - self.keep * self.step_s if self.clock is not None else None
        while self.next_at <= t:
            if horizon is not None and self.next_at < horizon:
                self.waits, self.preempted, self.failed = {}, 0, 0
                self.next_at += self.step_s
                continue
            self.points.append(self._point(board, self.next_at, live=abs(t - self.next_at) < SAMPLE_FRESH_S))
            self.made += 1
            while len(self.points) > self.keep:
                self.points.popleft()
            self.next_at += self.step_s
        return True

    def _point(self, board: Board, at: float, live: bool) -> dict[str, Any]:
        alloc: dict[str, float] = {}
        total: dict[str, int] = {}
        busy: dict[str, list[float]] = {}
        cost: dict[str, Decimal] = {}
        idle: dict[str, Decimal] = {}
        hours = Decimal(str(self.step_s)) / 3600
        for node_id, gpus in board.gpus.items():
            row = board.view.nodes.get(node_id)
            model = (row.gpu_model if row is not None else "") or "-"
            total[model] = total.get(model, 0) + len(gpus)
            held = board.held.get(node_id, {})
            for g in gpus:
                jobs = held.get(g, {})
                milli = sum(jobs.values())
                if not milli:
                    continue
                alloc[model] = alloc.get(model, 0.0) + milli / 1000
                sample = self.util.get((node_id, g))
                fresh = live and sample is not None and at - sample[1] < SAMPLE_FRESH_S
                if fresh:
                    assert sample is not None
                    busy.setdefault(model, []).append(sample[0])
                for job_id, m in jobs.items():
                    tenant = board.owner(job_id) or "-"
                    c = self.prices.gpu(model) * Decimal(m) / 1000 * hours
                    cost[tenant] = cost.get(tenant, Decimal(0)) + c
                    if fresh and sample is not None and sample[0] < IDLE_PCT:
                        idle[tenant] = idle.get(tenant, Decimal(0)) + c
        pending: dict[str, int] = {}
        for (_tenant, queue, status), n in board.counts.items():
            if status in WAITING:
                pending[queue] = pending.get(queue, 0) + n
        point = {
            "t": datetime.fromtimestamp(at, UTC).isoformat(), "alloc": {k: round(v, 3) for k, v in alloc.items()},
            "total": total, "util": {k: round(statistics.fmean(v), 1) for k, v in busy.items()},
            "pending": pending,
            "wait_p50": {q: round(_pct(w, 50), 2) for q, w in self.waits.items()},
            "wait_p95": {q: round(_pct(w, 95), 2) for q, w in self.waits.items()},
            "cost": {k: float(round(v, 6)) for k, v in cost.items()},
            "idle_cost": {k: float(round(v, 6)) for k, v in idle.items()},
            "preempted": self.preempted, "failed": self.failed,
        }
        self.waits, self.preempted, self.failed = {}, 0, 0
        return point

    def series(self, tenant: str | None = None, queues: set[str] | None = None) -> list[dict[str, Any]]:
        """The points as a page shows them; a tenant's: its own cost and its queues only."""
        if tenant is None:
            return list(self.points)
        qs = queues or set()
        return [{**p, "pending": {q: n for q, n in p["pending"].items() if q in qs},
                 "wait_p50": {q: v for q, v in p["wait_p50"].items() if q in qs},
                 "wait_p95": {q: v for q, v in p["wait_p95"].items() if q in qs},
                 "cost": {k: v for k, v in p["cost"].items() if k == tenant},
                 "idle_cost": {k: v for k, v in p["idle_cost"].items() if k == tenant},
                 "preempted": None, "failed": None} for p in self.points]


def _pct(values: list[float], pct: float) -> float:
    """The nearest-rank percentile."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(pct / 100 * len(s) + 0.5)) - 1))]
