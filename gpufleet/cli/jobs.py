"""Jobs: `submit` (with its estimate), `cancel`, `jobs`, `nodes`, `watch`, `explain`, `estimate`."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from gpufleet.cli.common import (
    ConfigOpt,
    DataDir,
    JsonOut,
    _cluster_config,
    _parse_time,
    _print_json,
    _reading,
    _rich_out,
    _rich_table,
    _run,
    _with_fleet,
    app,
)
from gpufleet.shared.contract.config import data_dir as resolve_data_dir
from gpufleet.shared.contract.config import read_mesh
from gpufleet.shared.contract.errors import SpecError
from gpufleet.shared.contract.events import Envelope
from gpufleet.shared.contract.spec import load_spec_yaml


@app.command()
def submit(
    file: Annotated[Path | None, typer.Argument(exists=True, dir_okay=False, help="job spec YAML")] = None,
    from_job: Annotated[str | None, typer.Option(
        "--from", help="copy the spec a past job was submitted with (changed by --set)")] = None,
    sets: Annotated[list[str] | None, typer.Option(
        "--set", help="PATH=VALUE: change the spec, e.g. --set resources.gpu=4 --set sim.duration=2h")] = None,
    data_dir: DataDir = None,
    as_json: JsonOut = False,
    wait: Annotated[bool, typer.Option("--wait", help="follow the job to its end, showing progress")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="submit without showing the cost estimate first")] = False,
    config: ConfigOpt = None,
) -> None:
    """Submit a job; prints its id. Shows its cost estimate first (on a terminal: and asks) unless --yes.
    With a tenant's credentials a spec without `tenant` is that tenant's. `--from JOB` submits a copy
    of a past job's spec instead of a file; `--set` changes either, validated like any spec."""
    from gpufleet.shared.contract.spec import parse_spec, set_path
    from gpufleet.shared.trust.authz import find_creds

    if (file is None) == (from_job is None):
        typer.echo("error: give a job spec file or --from JOB (one of them)", err=True)
        raise typer.Exit(2)
    where = str(file) if file is not None else f"--from {from_job}"
    if from_job is not None:
        job = from_job

        async def spec_of(fleet: Any) -> dict[str, Any] | None:
            got: dict[str, Any] | None = await fleet.spec_of(job)
            return got

        try:
            found = _run(_reading(data_dir, spec_of))
        except ValueError as exc:
            typer.echo(f"error: --from: {exc}", err=True)
            raise typer.Exit(2) from None
        if found is None:
            typer.echo(f"error: --from: no job {from_job} in the log (or not one of yours)", err=True)
            raise typer.Exit(1)
        text = yaml.safe_dump(found)
    else:
        assert file is not None
        text = file.read_text()
    try:
        spec = yaml.safe_load(text)
        ident = find_creds(None, resolve_data_dir(data_dir))
        if isinstance(spec, dict) and ident is not None and ident.tenant is not None and "tenant" not in spec:
            spec["tenant"] = ident.tenant
        if sets and not isinstance(spec, dict):
            raise SpecError("spec", f"must be a mapping, got {type(spec).__name__}")
        for assignment in sets or ():
            set_path(spec, assignment)
        parsed = parse_spec(spec) if isinstance(spec, dict) else load_spec_yaml(text)
    except yaml.YAMLError as exc:
        typer.echo(f"error: invalid job spec {where}: spec: not valid YAML: {exc}", err=True)
        raise typer.Exit(2) from None
    except SpecError as exc:
        typer.echo(f"error: invalid job spec {where}: {exc}", err=True)
        raise typer.Exit(2) from None
    est = None if yes else _submit_estimate(parsed, data_dir, config, as_json, spec)

    async def go(fleet: Any) -> str:
        from gpufleet.sdk import job_filter

        if not wait:
            return str(await fleet.submit(spec))
        from gpufleet.sdk import new_job_id

        job_id = new_job_id()
        events = fleet.watch(job_filter(job_id=job_id), from_start=True, until_terminal=job_id)
        await fleet.submit(spec, job_id=job_id)
        typer.echo(job_id if not as_json else json.dumps({"job_id": job_id, **({"estimate": est} if est else {})}))
        async for seq, env in events:
            _echo_event(seq, env, as_json)
        return job_id

    job_id = _run(_with_fleet(data_dir, go))
    if not wait:
        typer.echo(json.dumps({"job_id": job_id, **({"estimate": est} if est else {})}) if as_json else job_id)


@app.command()
def cancel(job_id: str, data_dir: DataDir = None,
           tenant: Annotated[str | None, typer.Option(
               help="only on a server without auth: the job's tenant (with credentials you act as yourself)")] = None,
           ) -> None:
    """Cancel a job, as your own identity: a tenant's credentials cancel only its own jobs; the
    admin's cancel any job, and the log records it as the admin's."""

    async def go(fleet: Any) -> None:
        await fleet.cancel(job_id, tenant)

    _run(_with_fleet(data_dir, go))
    typer.echo(f"cancel requested for {job_id}")


def _rows(kind: str, data_dir: str | None, **page: Any) -> list[dict[str, Any]]:
    """The live read model (PostgreSQL), or the fold of the log when the mesh has none. A tenant
    (its --creds) reads only its own events: the fold of them, never the shared read model."""
    from gpufleet.shared.trust.authz import find_creds

    ident = find_creds(None, resolve_data_dir(data_dir))
    dsn = os.environ.get("GPUFLEET_PG_DSN") if not data_dir else None
    if ident is not None and ident.tenant is not None:
        dsn = None
    elif dsn is None:
        dsn = read_mesh(data_dir).get("pg_dsn") or None
    if dsn:
        from gpufleet.shared.read.readmodel import query_rows

        try:
            return asyncio.run(asyncio.wait_for(query_rows(dsn, kind, **page), 5))
        except Exception as exc:  # noqa: BLE001 - PostgreSQL down or stopped: the log still answers
            typer.echo(f"warning: the read model (PostgreSQL) does not answer ({type(exc).__name__}: {exc}); "
                       "folding the log instead", err=True)
    view = _run(_reading(data_dir, lambda f: f.fold()))
    rows = list(view.as_json()[kind])
    if kind == "jobs":  # the same filter and page as the read model's query
        rows = [r for r in rows if (page.get("tenant") is None or r["tenant"] == page["tenant"])
                and (page.get("status") is None or r["status"] == page["status"])
                and (page.get("after") is None or r["job_id"] > page["after"])]
        rows = rows[:page["limit"]] if page.get("limit") is not None else rows
    return rows


@app.command()
def jobs(data_dir: DataDir = None, as_json: JsonOut = False,
         tenant: Annotated[str | None, typer.Option()] = None,
         state: Annotated[str | None, typer.Option("--status", help="only jobs in this status")] = None,
         limit: Annotated[int, typer.Option(help="at most this many rows (0: all)", min=0)] = 1000,
         after: Annotated[str | None, typer.Option(help="the page after this job id (the last one shown)")] = None,
         ) -> None:
    """Jobs and their status, from the live read model, by job id, a page at a time."""
    rows = _rows("jobs", data_dir, tenant=tenant, status=state, after=after, limit=limit + 1 if limit else None)
    more = bool(limit) and len(rows) > limit
    rows = rows[:limit] if limit else rows
    if more:
        typer.echo(f"(the first {limit:,} rows; the next page: --after {rows[-1]['job_id']})", err=True)
    if as_json:
        _print_json(rows)
        return
    if _rich_out():
        _rich_table([("JOB", "left"), ("TENANT", "left"), ("QUEUE", "left"), ("NAME", "left"), ("GPUS", "right"),
                     ("STATUS", "left"), ("REASON", "left")],
                    [[r["job_id"], r["tenant"], r["queue"] or "-", r["name"], f"{r['gpus']:g}", r["status"],
                      r["reason"] or ""] for r in rows], status_col="STATUS")
        return
    w = max([28, *(len(r["job_id"]) + 2 for r in rows)])  # (a service's replicas: <service id>-r<n>)
    tw = max([10, *(len(r["tenant"]) + 2 for r in rows)])  # a long tenant does not run into the queue
    qw = max([10, *(len(r["queue"] or "") + 2 for r in rows)])
    typer.echo(f"{'JOB':<{w}}{'TENANT':<{tw}}{'QUEUE':<{qw}}{'NAME':<16}{'GPUS':>5}  {'STATUS':<10} REASON")
    for r in rows:
        typer.echo(f"{r['job_id']:<{w}}{r['tenant']:<{tw}}{r['queue'] or '-':<{qw}}{r['name'][:15]:<16}{r['gpus']:>5}  "
                   f"{r['status']:<10} {r['reason']}")


@app.command()
def nodes(data_dir: DataDir = None, as_json: JsonOut = False) -> None:
    """Nodes, their GPUs and what is allocated, from the live read model."""
    rows = _rows("nodes", data_dir)
    if as_json:
        _print_json(rows)
        return
    if _rich_out():
        _rich_table([("NODE", "left"), ("STATUS", "left"), ("MODEL", "left"), ("GPUS", "right"), ("CPU", "right"),
                     ("MEM GiB", "right"), ("JOBS", "right")],
                    [[r["node_id"], r["status"], r["gpu_model"] or "-", f"{r['gpus_allocated']}/{r['gpus_total']}",
                      str(r["cpu_milli"] // 1000), str(r["memory_mib"] // 1024), str(len(r["running_jobs"]))]
                     for r in rows], status_col="STATUS")
        return
    typer.echo(f"{'NODE':<14}{'STATUS':<9}{'MODEL':<8}{'GPUS':>10}  {'CPU':>6} {'MEM GiB':>8}  JOBS")
    for r in rows:
        typer.echo(f"{r['node_id']:<14}{r['status']:<9}{r['gpu_model'] or '-':<8}"
                   f"{r['gpus_allocated']:>4}/{r['gpus_total']:<5}  {r['cpu_milli'] // 1000:>6} "
                   f"{r['memory_mib'] // 1024:>8}  {len(r['running_jobs'])}")


def _echo_event(seq: int, env: Envelope, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({"seq": seq, **env.model_dump(mode="json", exclude_none=True)}))
        return
    p = env.payload.model_dump(exclude={"type", "job_id", "node_id", "spec", "inventory"}, exclude_none=True)
    subject = env.job_id or env.node_id or ""
    detail = " ".join(f"{k}={v}" for k, v in p.items())
    typer.echo(f"{seq:>8} {env.occurred_at:%H:%M:%S.%f}"[:-3] + f" {env.tenant:<8} {env.type:<26} {subject}  {detail}")


@app.command()
def watch(data_dir: DataDir = None, as_json: JsonOut = False,
          tenant: Annotated[str | None, typer.Option()] = None,
          job: Annotated[str | None, typer.Option()] = None,
          type_: Annotated[str | None, typer.Option("--type", help="event type, e.g. placed or job.placed")] = None,
          from_start: Annotated[bool, typer.Option("--from-start")] = False,
          since: Annotated[str | None, typer.Option(help="from this time on: 10m (ago), or an ISO time")] = None,
          ) -> None:
    """Live tail of the log, filtered; one JSON object per line with --json."""
    from gpufleet.sdk import job_filter

    start = _parse_time(since) if since else None

    async def go(fleet: Any) -> None:
        async for seq, env in fleet.watch(job_filter(tenant, job, type_), from_start=from_start, since=start):
            _echo_event(seq, env, as_json)

    try:
        _run(_with_fleet(data_dir, go))
    except KeyboardInterrupt:
        pass




@app.command()
def logs(job_id: str, data_dir: DataDir = None, as_json: JsonOut = False,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="stream on until the run ends")] = False,
         replica: Annotated[int, typer.Option(min=0, help="which replica (0 first)")] = 0,
         attempt: Annotated[int | None, typer.Option(min=1, help="which run (default: the latest)")] = None,
         tail: Annotated[int | None, typer.Option(min=0, help="only the last N lines")] = None,
         ) -> None:
    """A run's stdout and stderr, from the executor of its node (wherever it runs); each attempt
    is kept, so a resumed job's earlier runs stay readable (--attempt)."""
    from gpufleet.shared.contract.errors import GpufleetError

    async def pick(fleet: Any) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        runs = await fleet.runs_of(job_id)
        mine = [r for r in runs if r["replica"] == replica and (attempt is None or r["attempt"] == attempt)]
        if not mine:
            return None
        return max(mine, key=lambda r: (r["attempt"], r["seq"])), runs

    async def go(fleet: Any) -> None:
        chosen = await pick(fleet)
        told = False
        while chosen is None and follow:  # -f on a job still waiting: until its run starts
            if not told:
                typer.echo(f"job {job_id} has no run {'' if attempt is None else f'{attempt} '}of replica {replica} "
                           "started yet; waiting for it (`gpufleet explain` says why it waits)", err=True)
                told = True
            await asyncio.sleep(1.0)
            chosen = await pick(fleet)
        if chosen is None:
            runs = await fleet.runs_of(job_id)
            have = ", ".join(f"replica {r['replica']} attempt {r['attempt']}" for r in runs) or "none"
            raise GpufleetError(f"job {job_id}: no run of replica {replica}"
                                + (f" attempt {attempt}" if attempt is not None else "")
                                + f" started (runs that started: {have}; `gpufleet explain {job_id}`)")
        run, runs = chosen
        offset, first = 0, True
        while True:
            doc = await fleet.logs(job_id, run["tenant"], run["node_id"], run["replica"], run["attempt"],
                                   offset=offset, tail=tail if first else None)
            first = False
            if as_json:
                _print_json({**doc, "runs": [{k: v for k, v in r.items() if k != "seq"} for r in runs]})
            elif doc["data"]:
                sys.stdout.write(doc["data"])
                sys.stdout.flush()
            offset = doc["next"]
            if not follow:
                return
            if offset < doc["size"]:
                continue  # more than one reply's worth
            if not doc["running"]:
                return
            await asyncio.sleep(0.5)

    try:
        _run(_reading(data_dir, go))
    except KeyboardInterrupt:
        pass


@app.command()
def explain(job_id: str, data_dir: DataDir = None, as_json: JsonOut = False) -> None:
    """The job's timeline: each event with its sequence, time, actor and cause."""
    doc = _run(_reading(data_dir, lambda f: f.explain(job_id)))
    if doc is None:
        typer.echo(f"no events for job {job_id}", err=True)
        raise typer.Exit(1)
    if as_json:
        _print_json(doc.to_json())
        return
    for s, e in doc.history:
        _echo_event(s, e, False)
    for st in doc.staging:
        typer.echo(st["text"])
    for it in doc.interruptions:
        typer.echo(it["text"])
    for p in doc.pending:
        typer.echo(p["text"])



async def _estimate_doc(spec: Any, cfg: Any, data_dir: str | None, duration_s: float | None,
                        with_wait: bool, spec_doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """The estimate; the wait (and the cluster's GPU models) from the quota's and the placer's folds
    of the log (services/billing/wait.py)."""
    from gpufleet.services.admission.core import AdmissionCore
    from gpufleet.services.billing.report import estimate, expected_wait, fold
    from gpufleet.services.placer.core import PlacerCore
    from gpufleet.services.quota.core import QuotaCore
    from gpufleet.shared.contract.events import utc
    from gpufleet.shared.runtime.loop import Ctx

    if not with_wait:
        return estimate(spec, cfg, duration_s=duration_s, wait_note="not asked: `gpufleet estimate` asks the cluster")
    try:
        from gpufleet.sdk import Fleet

        fleet = await Fleet.connect(data_dir=data_dir)
    except Exception as exc:  # noqa: BLE001 - no mesh: the cost alone
        return estimate(spec, cfg, duration_s=duration_s, wait_note=f"no mesh to ask ({exc})")
    if fleet.tenant is not None:  # it may read its own events only, not the queues and nodes
        await fleet.close()
        return estimate(spec, cfg, duration_s=duration_s,
                        wait_note="a tenant's credentials do not read the cluster's queues and nodes: cost only")
    try:
        placer, quota, admission = PlacerCore(cfg), QuotaCore(cfg), AdmissionCore(cfg)
        pstate, qstate, astate = await fold(fleet.bus, [placer, quota, admission], snapshots=True)
        # would admission take it now? (tenant policy, capacity, budgets, limits: the same checks)
        refused = (admission.refusals(astate, spec.tenant, spec_doc, Ctx(now=utc(time.time()), actor="estimate"))
                   if spec_doc is not None else [])
        models = {g.model for inv in pstate.inventories.values() for g in inv.gpus}
        if spec.priority_class in cfg.priority_classes:  # as admission records it
            spec = spec.model_copy(update={"priority": cfg.priority_classes[spec.priority_class]})
        wait = expected_wait(placer, pstate, quota, qstate, spec, time.time())
        doc = estimate(spec, cfg, duration_s=duration_s, cluster_models=models, wait=wait)
        doc["admission"] = [{"code": r.code, "field": r.field, "message": r.message} for r in refused]
        return doc
    finally:
        await fleet.close()


def _submit_estimate(spec: Any, data_dir: str | None, config: Path | None, as_json: bool,
                     spec_doc: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Before a submit: on a terminal, show the estimate (with the wait) and ask; in a script, the
    cost goes to stderr (or into --json) without folding the log; the submit goes on."""
    from gpufleet.services.billing.report import estimate_text

    interactive = sys.stdin.isatty() and sys.stdout.isatty() and not as_json
    try:
        doc = _run(_estimate_doc(spec, _cluster_config(data_dir, config), data_dir, None, interactive, spec_doc))
    except typer.Exit:
        raise
    except Exception as exc:  # noqa: BLE001 - an estimate must never stop a submit
        typer.echo(f"(no estimate: {exc})", err=True)
        return None
    if as_json:
        return doc
    typer.echo(estimate_text(doc), err=not interactive)
    if interactive and not typer.confirm("submit?", default=True):
        raise typer.Exit(1)
    return None


@app.command()
def estimate(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="job spec YAML")],
    data_dir: DataDir = None,
    as_json: JsonOut = False,
    duration: Annotated[str | None, typer.Option(help="how long it runs (30m, 2h; default: its maxRuntime)")] = None,
    config: ConfigOpt = None,
) -> None:
    """The expected cost of a job before it is submitted, and its expected wait from the current state."""
    from gpufleet.services.billing.report import estimate_text
    from gpufleet.shared.contract.spec import parse_duration_s

    try:
        spec = load_spec_yaml(file.read_text())
    except SpecError as exc:
        typer.echo(f"error: invalid job spec {file}: {exc}", err=True)
        raise typer.Exit(2) from None
    duration_s = None
    if duration is not None:
        try:
            duration_s = parse_duration_s(duration)
        except (ValueError, TypeError) as exc:
            typer.echo(f"error: --duration: {exc}", err=True)
            raise typer.Exit(2) from None
        if duration_s <= 0:
            typer.echo("error: --duration: must be more than 0", err=True)
            raise typer.Exit(2)
    doc = _run(_estimate_doc(spec, _cluster_config(data_dir, config), data_dir, duration_s, True,
                             yaml.safe_load(file.read_text())))
    if as_json:
        _print_json(doc)
    else:
        typer.echo(estimate_text(doc))


