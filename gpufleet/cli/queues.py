"""Queues, pools, bills: `queues`, `pools`, `bill`, `report-load`."""

from __future__ import annotations

import os
from decimal import Decimal
from typing import Annotated, Any

import typer

from gpufleet.cli.common import (
    ConfigOpt,
    DataDir,
    JsonOut,
    _cluster_config,
    _mesh_config,
    _parse_time,
    _print_json,
    _rich_out,
    _rich_table,
    _run,
    _with_fleet,
    app,
)
from gpufleet.shared.contract.config import read_mesh
from gpufleet.shared.contract.errors import GpufleetError
from gpufleet.shared.contract.events import Envelope


async def _quota_state(fleet: Any, config: Any) -> tuple[Any, Any]:
    """The quota core's state at the head of the log: its newest snapshot and the tail after it."""
    from gpufleet.services.quota.core import QuotaCore
    from gpufleet.shared.runtime.engine import fold_log

    core = QuotaCore(config)
    engine, _ = await fold_log(fleet.bus, core)
    return core, engine.state


@app.command()
def queues(data_dir: DataDir = None, as_json: JsonOut = False) -> None:
    """Usage, nominal quota, borrowed and pending jobs per queue and cohort (folded from the log)."""
    config = _mesh_config(data_dir)
    core, state = _run(_with_fleet(data_dir, lambda f: _quota_state(f, config)))
    tree = core.tree

    def used(queue: str, r: str) -> int:
        return int(state.usage.get(queue, {}).get(r, 0))

    pending_in: dict[str, int] = {}
    for _, _, spec in state.waiting():
        pending_in[spec.queue] = pending_in.get(spec.queue, 0) + 1
    names = sorted(set(config.queues) | set(state.usage) | set(pending_in))
    rows: list[dict[str, Any]] = []
    for name in names:
        key = f"queue:{name}"
        node = tree.nodes.get(key)
        use = {r: v for r, v in state.usage.get(name, {}).items() if v}
        resources = sorted(tree.limited(name))
        rows.append({
            "queue": name, "cohort": node.parent.removeprefix("cohort:") if node and node.parent else None,
            "limited": node is not None, "usage": use, "nominal": dict(node.nominal) if node else {},
            "borrowed": {r: v for r in resources if (v := tree.borrowed(key, r, used))} if node else {},
            "lendable": {r: tree.lent(key, r, used) for r in resources if r in node.nominal} if node else {},
            "pending": pending_in.get(name, 0),
            "reserved_jobs": sum(1 for j in state.reserved if state.held(j)[0] == name),
        })
    cohorts: dict[str, dict[str, Any]] = {}  # (Any: the JSON document)
    for key, node in sorted(tree.nodes.items()):
        if node.is_queue:
            continue
        queues_under = tree.queues_under(key)
        resources = sorted({r for q in queues_under for r in tree.limited(q)} | set(node.nominal))
        cohorts[node.name] = {
            "cohort": node.name, "parent": node.parent.removeprefix("cohort:") if node.parent else None,
            "queues": sorted(queues_under), "children": sorted(c.split(":", 1)[1] for c in node.children),
            "nominal": dict(node.nominal),  # its own
            "quota": {r: tree.subtree(key, r) for r in resources},  # what it holds: its own + what below lend
            "usage": {r: v for r in resources if (v := tree.usage(key, r, used))},
            "borrowed": {r: v for r in resources if (v := tree.borrowed(key, r, used))},
            "lendable": {r: tree.lent(key, r, used) for r in resources},
            "pending": sum(pending_in.get(q, 0) for q in queues_under),
        }
    if as_json:
        _print_json({"queues": rows, "cohorts": list(cohorts.values())})
        return

    def fmt(d: dict[str, int]) -> str:
        return " ".join(f"{r}={v}" for r, v in sorted(d.items()) if r.startswith("gpu")) or "-"

    if _rich_out():
        _rich_table([("QUEUE", "left"), ("COHORT", "left"), ("PENDING", "right"), ("JOBS", "right"),
                     ("GPU USED / NOMINAL", "left")],
                    [[row["queue"], row["cohort"] or "-", str(row["pending"]), str(row["reserved_jobs"]),
                      f"{fmt(row['usage'])} / {fmt(row['nominal']) if row['limited'] else 'unlimited'}"] for row in rows])
        if cohorts:
            _rich_table([("COHORT", "left"), ("PARENT", "left"), ("PENDING", "right"), ("GPU USED / HELD", "left"),
                         ("BORROWED", "left")],
                        [[c["cohort"], c["parent"] or "-", str(c["pending"]), f"{fmt(c['usage'])} / {fmt(c['quota'])}",
                          fmt(c["borrowed"])] for c in cohorts.values()])
        return
    typer.echo(f"{'QUEUE':<14}{'COHORT':<10}{'PENDING':>8}{'JOBS':>6}  GPU USED / NOMINAL")
    for row in rows:
        typer.echo(f"{row['queue']:<14}{row['cohort'] or '-':<10}{row['pending']:>8}{row['reserved_jobs']:>6}  "
                   f"{fmt(row['usage'])} / {fmt(row['nominal']) if row['limited'] else 'unlimited'}")
    if cohorts:
        typer.echo(f"\n{'COHORT':<14}{'PARENT':<10}{'PENDING':>8}  GPU USED / HELD  BORROWED")
        for c in cohorts.values():
            typer.echo(f"{c['cohort']:<14}{c['parent'] or '-':<10}{c['pending']:>8}  "
                       f"{fmt(c['usage'])} / {fmt(c['quota'])}  {fmt(c['borrowed'])}")




@app.command()
def bill(
    data_dir: DataDir = None,
    tenant: Annotated[str | None, typer.Option(help="only this tenant")] = None,
    since: Annotated[str | None, typer.Option(help="from: 24h (ago) or an ISO time")] = None,
    until: Annotated[str | None, typer.Option(help="to: 1h (ago) or an ISO time (default: now)")] = None,
    by: Annotated[str, typer.Option(help="tenant | queue | job | gpu-model")] = "tenant",
    as_json: JsonOut = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="CSV")] = False,
    ledger: Annotated[bool, typer.Option("--ledger", help="read the PostgreSQL ledger instead of folding the log "
                                                            "(closed intervals only, by end time)")] = False,
    config: ConfigOpt = None,
) -> None:
    """GPU-hours, cost and idle cost, folded from the log (running jobs up to now)."""
    from datetime import UTC, datetime

    from gpufleet.services.billing import report

    if by not in report.BY:
        typer.echo(f"error: --by must be one of {', '.join(report.BY)}, not {by!r}", err=True)
        raise typer.Exit(2)
    cfg = _cluster_config(data_dir, config)
    t0 = datetime.fromtimestamp(_parse_time(since), UTC) if since else None
    t1 = datetime.fromtimestamp(_parse_time(until), UTC) if until else None
    now = datetime.now(UTC)
    if ledger:
        items = _run(_ledger_charges(data_dir, tenant, t0, t1))
    else:
        from gpufleet.services.billing.core import BillingCore

        core = BillingCore(cfg, keep_charges=True)

        async def go(fleet: Any) -> Any:
            [state] = await report.fold(fleet.bus, [core])
            return report.charges(core, state, now, tenant=tenant, since=t0, until=t1)

        items = _run(_with_fleet(data_dir, go))
    doc = report.bill_json(report.bill(items, by), by, cfg.prices.currency, tenant=tenant, since=t0, until=t1 or now,
                           source="ledger" if ledger else "log")
    if as_json:
        _print_json(doc)
    elif as_csv:
        typer.echo(report.bill_csv(doc), nl=False)
    elif _rich_out():
        total = doc["total"]
        _rich_table([(doc["by"].upper(), "left"), ("GPU-HOURS", "right"), (f"COST {doc['currency']}", "right"),
                     ("IDLE GPU-H", "right"), ("IDLE COST", "right"), ("INTERVALS", "right")],
                    [[r["key"] if r is not total else "TOTAL", f"{Decimal(r['gpu_hours']):.3f}", r["cost"],
                      f"{Decimal(r['idle_gpu_hours']):.3f}", r["idle_cost"],
                      f"{r['intervals']}" + (f" ({r['running']} running)" if r["running"] else "")]
                     for r in [*doc["rows"], total]])
    else:
        typer.echo(report.bill_text(doc))


async def _ledger_charges(data_dir: str | None, tenant: str | None, since: Any, until: Any) -> list[Any]:
    from collections import defaultdict

    from gpufleet.services.billing.core import Charge
    from gpufleet.services.billing.ledger import ledger_rows
    from gpufleet.services.billing.pricing import ChargeLine

    dsn = os.environ.get("GPUFLEET_PG_DSN") if not data_dir else None
    dsn = dsn or read_mesh(data_dir).get("pg_dsn")
    if not dsn:
        raise GpufleetError("the mesh runs without PostgreSQL: no ledger (leave out --ledger to fold the log)")
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in await ledger_rows(dsn, tenant=tenant, since=since, until=until):
        grouped[r["interval_key"]].append(r)
    out = []
    for key, rows in grouped.items():
        r0 = rows[0]
        out.append(Charge(key, r0["job_id"], r0["tenant"], r0["queue"], r0["replica"], r0["attempt"], r0["node_id"],
                          r0["started_at"], r0["ended_at"], r0["ended_by"], r0["currency"], tuple(
                              ChargeLine(r["resource"], r["quantity"], r["unit_price"], r["seconds"], r["cost"],
                                         r["idle_seconds"], r["idle_cost"]) for r in rows)))
    return out





@app.command("report-load")
def report_load(
    job_id: Annotated[str, typer.Argument(help="the inference service's job id")],
    rps: Annotated[float, typer.Option("--rps", help="requests per second, all replicas together")],
    p99_ms: Annotated[float | None, typer.Option("--p99-ms", help="p99 latency over the window, in ms")] = None,
    window: Annotated[str, typer.Option(help="the window the figures cover: 30s, 1m")] = "10s",
    tenant: Annotated[str | None, typer.Option(help="the service's tenant (default: looked up)")] = None,
    data_dir: DataDir = None,
    as_json: JsonOut = False,
) -> None:
    """Report the load an inference service is under (cmd.report_load), as its load balancer would."""
    from pydantic import ValidationError

    from gpufleet.shared.contract.spec import parse_duration_s

    try:
        window_s = parse_duration_s(window)
    except (ValueError, TypeError):
        typer.echo(f"error: --window: {window!r} is not a duration (30s, 1m)", err=True)
        raise typer.Exit(2) from None

    async def go(fleet: Any) -> Envelope:
        t = tenant
        if t is None:
            from gpufleet.shared.contract.events import JobSubmitted

            found = await fleet.submitted(job_id)
            if found is None or not isinstance(found.payload, JobSubmitted):
                raise GpufleetError(f"no job {job_id}")
            if found.payload.spec.autoscale is None:
                raise GpufleetError(f"job {job_id} is not an inference service (no autoscale): "
                                    "the autoscaler would ignore its load")
            t = found.tenant
        sent: Envelope = await fleet.report_load(job_id, t, rps, p99_ms=p99_ms, window_s=window_s, actor="cli")
        return sent

    try:
        env = _run(_with_fleet(data_dir, go))
    except ValidationError as exc:
        typer.echo(f"error: {'; '.join(str(e['loc'][-1]) + ': ' + e['msg'] for e in exc.errors())}", err=True)
        raise typer.Exit(2) from None
    doc = {"job_id": job_id, "tenant": env.tenant, "rps": rps, "p99_ms": p99_ms, "window_s": window_s,
           "event_id": env.event_id}
    if as_json:
        _print_json(doc)
        return
    p99 = f", p99 {p99_ms:g} ms" if p99_ms is not None else ""
    typer.echo(f"load reported for {job_id} ({env.tenant}): {rps:g} req/s{p99} over {window_s:g}s")


async def _pools_state(fleet: Any, config: Any) -> list[dict[str, Any]]:
    from gpufleet.services.autoscaler.core import AutoscalerCore, pool_summary
    from gpufleet.services.autoscaler.providers import PROVIDERS
    from gpufleet.shared.runtime.engine import fold_log

    core = AutoscalerCore(config, providers=tuple(PROVIDERS))
    engine, _ = await fold_log(fleet.bus, core)
    return pool_summary(core, engine.state)


@app.command()
def pools(data_dir: DataDir = None, as_json: JsonOut = False, config: ConfigOpt = None) -> None:
    """Each node pool: its nodes ready / provisioning / draining, min, max and the autoscaler's
    latest decision about it (folded from the log)."""
    from gpufleet.shared.contract.events import utc

    cfg = _cluster_config(data_dir, config)
    rows = _run(_with_fleet(data_dir, lambda f: _pools_state(f, cfg)))
    for r in rows:
        if r["last_decision"] is not None:
            r["last_decision"]["at"] = utc(r["last_decision"]["at"]).isoformat()
    if as_json:
        _print_json(rows)
        return
    if not rows:
        typer.echo("no node pools (nodePools in the cluster config: docs/config.md)")
        return
    table: list[list[str]] = []
    for r in rows:
        shape = r["shape"] or {}
        what = f"{shape.get('gpuModel') or 'cpu'}x{shape.get('gpus', 0)}" if shape else "(not configured)"
        last = r["last_decision"]
        said = (f"{last['at'][11:19]} {last['type'].removeprefix('node.')} {last['node_id']}: {last['reason']}"
                if last else "-")
        table.append([r["pool"], what, str(r["ready"]), str(r["provisioning"]), str(r["draining"] + r["removing"]),
                      "-" if r["min"] is None else str(r["min"]), "-" if r["max"] is None else str(r["max"]), said])
    if _rich_out():
        _rich_table([("POOL", "left"), ("SHAPE", "left"), ("READY", "right"), ("PROV", "right"), ("DRAIN", "right"),
                     ("MIN", "right"), ("MAX", "right"), ("LAST DECISION", "left")], table)
        return
    typer.echo(f"{'POOL':<14}{'SHAPE':<14}{'READY':>6}{'PROV':>6}{'DRAIN':>6}{'MIN':>5}{'MAX':>5}  LAST DECISION")
    for pool, what, ready, prov, drain, lo, hi, said in table:
        typer.echo(f"{pool:<14}{what:<14}{ready:>6}{prov:>6}{drain:>6}{lo:>5}{hi:>5}  {said}")


