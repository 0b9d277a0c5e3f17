"""Bills and estimates for people: `gpufleet bill` and `gpufleet estimate`.

The bill folds the log with the billing core itself (`BillingCore.evolve`, the fold the service
and the ledger run), so it needs no PostgreSQL and says what the ledger says. Running
allocations are charged up to `now`. A `--since` / `--until` window cuts intervals at its edges
(an interval's idle time is then counted in proportion to the part inside).

The estimate prices a spec's resources for its max runtime (or a given duration), and asks the
quota's and the placer's folds when it could start (`wait.py`: the jobs ahead of it take quota
and nodes first, running jobs end at their max runtime).
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from gpufleet.shared.contract.clusterconfig import ClusterConfig
from gpufleet.shared.contract.events import Envelope
from gpufleet.shared.contract.spec import JobSpec
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.engine import Engine, fold_cores
from gpufleet.shared.runtime.loop import Core

from .core import BillingCore, BillingState, Charge
from .pricing import ZERO, ChargeLine, cost, estimate_cost, money, seconds_between, total
from .wait import Wait, expected_wait

log = logging.getLogger(__name__)

BY = ("tenant", "queue", "job", "gpu-model")
HOUR = Decimal(3600)


@dataclass
class Skipped:
    """An event a core's fold failed on (`fold` goes on without it)."""

    seq: int
    core: str
    event_type: str
    event_id: str
    error: str


async def fold(bus: Bus, cores: Sequence[Core[Any]], until_seq: int | None = None, *,
               skipped: list[Skipped] | None = None, snapshots: bool = False) -> list[Any]:
    """Each core's state folded over the log (read once), in the order of `cores`, by the
    engine's rules (shared/runtime/engine.py); with `snapshots`, each from its core's newest stored
    snapshot (the estimate's placer, quota and admission; never a bill's billing core, which keeps
    every charge, as the service's does not).

    An event a core fails on is skipped for that core alone (the rest of the log is folded): each
    is added to `skipped` when given, and their number is said in one warning at the end."""
    failed: list[Skipped] = [] if skipped is None else skipped
    before = len(failed)

    def on_error(engine: Engine[Any], seq: int, env: Envelope, exc: Exception) -> None:
        failed.append(Skipped(seq, engine.core.name, env.type, env.event_id, f"{type(exc).__name__}: {exc}"))
        log.debug("fold: %s failed on seq %d (%s)", engine.core.name, seq, env.type, exc_info=True)

    engines = await fold_cores(bus, cores, until_seq, snapshots=snapshots, on_error=on_error)
    if len(failed) > before:
        first = failed[before]
        log.warning("skipped %d event(s) a fold failed on (first: seq %d %s %s, in %s: %s)", len(failed) - before,
                    first.seq, first.event_type, first.event_id, first.core, first.error)
    return [e.state for e in engines]


# ------------------------------------------------------------------ bill


def _clip(c: Charge, since: datetime | None, until: datetime | None) -> Charge | None:
    """The part of a charge inside [since, until), or None when nothing of it is."""
    start = max(c.started_at, since) if since else c.started_at
    end = min(c.ended_at, until) if until else c.ended_at
    if c.ended_at > c.started_at and end <= start:
        return None
    if c.ended_at == c.started_at and ((since and c.started_at < since) or (until and c.started_at >= until)):
        return None
    if start == c.started_at and end == c.ended_at:
        return c
    seconds = seconds_between(start, end)
    out: list[ChargeLine] = []
    for line in c.lines:
        idle = line.idle_seconds * seconds / line.seconds if line.seconds else ZERO
        out.append(ChargeLine(line.resource, line.quantity, line.unit_price, seconds,
                              cost(line.quantity, line.unit_price, seconds), idle,
                              cost(line.quantity, line.unit_price, idle)))
    return Charge(c.key, c.job_id, c.tenant, c.queue, c.replica, c.attempt, c.node_id, start, end, c.end,
                  c.currency, tuple(out), c.open)


def charges(core: BillingCore, state: BillingState, now: datetime, *, tenant: str | None = None,
            since: datetime | None = None, until: datetime | None = None) -> list[Charge]:
    """Closed charges (kept by a `keep_charges` core) and running intervals up to `now`, cut to the window."""
    out = []
    for c in [*state.charges, *core.open_charges(state, min(now, until) if until else now)]:
        if tenant is not None and c.tenant != tenant:
            continue
        clipped = _clip(c, since, until)
        if clipped is not None:
            out.append(clipped)
    return out


@dataclass
class BillRow:
    key: str
    intervals: int = 0
    gpu_seconds: Decimal = ZERO
    cost: Decimal = ZERO
    idle_gpu_seconds: Decimal = ZERO
    idle_cost: Decimal = ZERO
    running: int = 0
    # the intervals counted (a total counts each once: by GPU model, one has lines in two groups)
    keys: set[str] = field(default_factory=set, repr=False, compare=False)
    running_keys: set[str] = field(default_factory=set, repr=False, compare=False)

    def as_json(self, currency: str) -> dict[str, Any]:
        return {"key": self.key, "intervals": self.intervals, "running": self.running,
                "gpu_hours": _hours(self.gpu_seconds), "cost": money(self.cost),
                "idle_gpu_hours": _hours(self.idle_gpu_seconds), "idle_cost": money(self.idle_cost),
                "currency": currency}


def _hours(seconds: Decimal) -> str:
    return format((seconds / HOUR).quantize(Decimal("0.000001")), "f")


def bill(items: Iterable[Charge], by: str = "tenant") -> list[BillRow]:
    """Totals per tenant, queue, job or GPU model (CPU and memory lines under `-`)."""
    if by not in BY:
        raise ValueError(f"--by must be one of {', '.join(BY)}, not {by!r}")
    rows: dict[str, BillRow] = {}
    for c in items:
        groups: dict[str, list[ChargeLine]] = {}
        for line in c.lines:
            if by == "gpu-model":
                key = line.resource.removeprefix("gpu/") if line.resource.startswith("gpu/") else "-"
            else:
                key = {"tenant": c.tenant, "queue": c.queue, "job": c.job_id}[by]
            groups.setdefault(key, []).append(line)
        for key, ls in groups.items():
            row = rows.setdefault(key, BillRow(key))
            row.intervals += 1
            row.running += int(c.open)
            row.keys.add(c.key)
            if c.open:
                row.running_keys.add(c.key)
            row.cost += total(ls)
            row.idle_cost += sum((line.idle_cost for line in ls), ZERO)
            gpu = [line for line in ls if line.resource.startswith("gpu/")]
            row.gpu_seconds += sum((line.unit_seconds for line in gpu), ZERO)
            row.idle_gpu_seconds += sum((line.idle_unit_seconds for line in gpu), ZERO)
    return [rows[k] for k in sorted(rows)]


def bill_json(rows: list[BillRow], by: str, currency: str, **window: Any) -> dict[str, Any]:
    tot = BillRow("total")
    for r in rows:
        tot.keys |= r.keys
        tot.running_keys |= r.running_keys
        tot.gpu_seconds += r.gpu_seconds
        tot.cost += r.cost
        tot.idle_gpu_seconds += r.idle_gpu_seconds
        tot.idle_cost += r.idle_cost
    tot.intervals, tot.running = len(tot.keys), len(tot.running_keys)
    return {"by": by, "currency": currency, **{k: (v.isoformat() if isinstance(v, datetime) else v)
                                               for k, v in window.items()},
            "rows": [r.as_json(currency) for r in rows], "total": tot.as_json(currency)}


def bill_csv(doc: dict[str, Any]) -> str:
    out = io.StringIO()
    cols = ["key", "intervals", "running", "gpu_hours", "cost", "idle_gpu_hours", "idle_cost", "currency"]
    w = csv.DictWriter(out, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    for r in [*doc["rows"], doc["total"]]:
        w.writerow({k: r[k] for k in cols})
    return out.getvalue()


def bill_text(doc: dict[str, Any]) -> str:
    head = f"{doc['by'].upper():<28}{'GPU-HOURS':>12}{'COST':>14}{'IDLE GPU-H':>12}{'IDLE COST':>14}  INTERVALS"
    lines_ = [head]
    for r in [*doc["rows"], doc["total"]]:
        key = r["key"] if r is not doc["total"] else "TOTAL"
        run = f" ({r['running']} running)" if r["running"] else ""
        lines_.append(f"{key[:27]:<28}{Decimal(r['gpu_hours']):>12.3f}{r['cost']:>14}{Decimal(r['idle_gpu_hours']):>12.3f}"
                      f"{r['idle_cost']:>14}  {r['intervals']}{run}")
    lines_.append(f"(currency {doc['currency']})")
    return "\n".join(lines_)


# ------------------------------------------------------------------ estimate


def gpu_models_for(spec: JobSpec, config: ClusterConfig, cluster_models: Iterable[str]) -> tuple[str, ...]:
    """The GPU models the job could run on: those it names, else those the cluster has (else priced)."""
    r = spec.resources
    if not r.gpu and not r.mig:
        return ()
    if r.gpu_models:
        return tuple(r.gpu_models)
    models = tuple(sorted(set(cluster_models))) or tuple(sorted(m for m in config.prices.gpu_hour if m != "*"))
    return models or ("*",)


def estimate(spec: JobSpec, config: ClusterConfig, *, duration_s: float | None = None,
             cluster_models: Iterable[str] = (), wait_s: float | None = None,
             wait_note: str = "", wait: Wait | None = None) -> dict[str, Any]:
    """The expected cost of `spec` (every replica for its max runtime, or `duration_s`), and its
    wait (`wait`: the model's answer and its parts, else `wait_s` and `wait_note`)."""
    if wait is not None:
        wait_s, wait_note = wait.wait_s, wait.note
    seconds = Decimal(str(duration_s if duration_s is not None else spec.runtime_limit_s))
    models = gpu_models_for(spec, config, cluster_models)
    per_model = estimate_cost(spec, config.prices, seconds, models)
    costs = {m: total(ls) for m, ls in per_model.items()}
    worst = max(costs, key=lambda m: (costs[m], m))
    lines_ = per_model[worst]
    gpu_seconds = sum((line.unit_seconds for line in lines_ if line.resource.startswith("gpu/")), ZERO)
    return {
        "name": spec.name, "tenant": spec.tenant, "queue": spec.queue, "replicas": spec.replicas,
        "duration_s": float(seconds), "currency": config.prices.currency,
        "gpu_model": worst or None, "gpu_hours": _hours(gpu_seconds),
        "cost": money(costs[worst]), "cost_min": money(min(costs.values())),
        "by_model": {m or "-": money(c) for m, c in sorted(costs.items())},
        "lines": [{"resource": line.resource, "quantity": str(line.quantity), "unit_price": str(line.unit_price),
                   "hours": _hours(line.seconds), "cost": money(line.cost)} for line in lines_],
        "wait_s": wait_s, "wait_note": wait_note, "wait": wait.as_json() if wait is not None else None,
    }


def estimate_text(doc: dict[str, Any]) -> str:
    out = [f"estimate for {doc['name']} ({doc['tenant']}/{doc['queue']}, {doc['replicas']} replica(s), "
           f"{doc['duration_s'] / 3600:.3f} h):"]
    for line in doc["lines"]:
        out.append(f"  {line['resource']:<14} {line['quantity']:>10} x {line['hours']} h x {line['unit_price']}/h"
                   f" = {line['cost']} {doc['currency']}")
    span = "" if doc["cost"] == doc["cost_min"] else f" (from {doc['cost_min']}, by GPU model: {doc['by_model']})"
    out.append(f"  cost: {doc['cost']} {doc['currency']}{span}")
    wait = doc["wait_s"]
    start = (doc.get("wait") or {}).get("start")
    out.append("  expected wait: " + ("unknown" if wait is None else "none, it fits now" if wait == 0
                                      else f"{_span(wait)}, starting about {start}" if start else _span(wait))
               + (f" ({doc['wait_note']})" if doc["wait_note"] else ""))
    for r in doc.get("admission") or ():
        out.append(f"  admission would reject it now: {r['message']} [{r['code']}, {r['field']}]")
    return "\n".join(out)


def _span(seconds: float) -> str:
    """3725 -> '1 h 2 min'; 95 -> '95 s'."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"


__all__ = ["BY", "BillRow", "Skipped", "bill", "bill_csv", "bill_json", "bill_text", "charges", "estimate", "estimate_text",
           "expected_wait", "fold", "gpu_models_for"]
