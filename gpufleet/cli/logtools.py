"""The log tools: `replay` (and what-if), `sim`, `top`, `dashboard`, `audit`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import typer

from gpufleet.cli.common import (
    DataDir,
    JsonOut,
    _mesh_config,
    _parse_time,
    _print_json,
    _reading,
    _run,
    _steps_bar,
    _with_fleet,
    app,
)
from gpufleet.shared.contract.config import data_dir as resolve_data_dir
from gpufleet.shared.contract.errors import SpecError


@app.command()
def replay(data_dir: DataDir = None, as_json: JsonOut = False,
           seq: Annotated[int | None, typer.Option("--seq", help="fold up to this sequence")] = None,
           until: Annotated[str | None, typer.Option(help="the state at this time: 10m (ago), or an ISO time")] = None,
           what_if: Annotated[Path | None, typer.Option("--what-if", exists=True, dir_okay=False,
                                                        help="re-run the recorded workload under this cluster config")] = None,
           all_jobs: Annotated[bool, typer.Option("--all", help="list the jobs that had ended too (read from the "
                                                                "view's row segments: grows with the history)")] = False,
           ) -> None:
    """Fold the log (to the head, --seq or --until) and print the cluster state it gives: nodes,
    GPUs, queues, the jobs not ended and every job's count by status (--all: the ended jobs' rows
    too); or, with --what-if, run the recorded workload again through the real cores under another config."""
    if what_if is not None:
        _what_if(data_dir, what_if, as_json)
        return
    at = _parse_time(until) if until else None
    doc = _run(_reading(data_dir, lambda f: f.state_at(until_seq=seq, until_time=at, ended=all_jobs)))
    if as_json:
        _print_json(doc)
        return
    gpus = sum(n["gpus_total"] for n in doc["nodes"])
    used = sum(n["gpus_allocated"] for n in doc["nodes"])
    total = sum(doc["job_counts"].values())
    typer.echo(f"state at seq {doc['seq']}: {total} jobs {doc['job_counts']}, {len(doc['nodes'])} nodes, "
               f"GPUs {used}/{gpus} allocated")
    if all_jobs:
        for j in doc["jobs"]:
            typer.echo(f"  {j['job_id']:<28} {j['tenant']:<12} {j['status']:<10} {j['reason'][:60]}")
    for node_id, cells in doc["gpus"].items():
        held = [f"{c['gpu']}:{c['state']}" + (f"({c['job']})" if c["job"] else "") for c in cells if c["state"] != "free"]
        if held:
            typer.echo(f"  {node_id:<12} " + " ".join(held))
    for q in doc["queues"]:
        typer.echo(f"  queue {q['queue']:<12} GPUs used {q['gpus_used']}, placed {q['running_or_placed']}, "
                   f"pending {q['pending']}")


def _what_if(data_dir: str | None, path: Path, as_json: bool) -> None:
    from gpufleet.tools.sim import ScenarioError, what_if, what_if_file

    try:
        other, nodes = what_if_file(path)
    except (SpecError, ScenarioError) as exc:
        typer.echo(f"error: invalid what-if file {path}: {exc}", err=True)
        raise typer.Exit(2) from None
    hist = _run(_with_fleet(data_dir, lambda f: f.history()))
    try:
        with _steps_bar("what-if: the recorded workload, twice") as bar:
            doc = what_if(hist, _mesh_config(data_dir), other, nodes, progress=lambda done, of: bar(done, of, ""))
    except ScenarioError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        _print_json(doc)
        return
    logged, a, b = doc["logged"], doc["recorded"], doc["what_if"]
    typer.echo(f"{doc['jobs_compared']} jobs, the recorded workload run twice through the cores (simulated), "
               "beside the log as it happened:")
    typer.echo(f"{'':22}{'as logged':>12}{'recorded config':>18}{'what-if':>14}")
    for key, label in (("wait_mean_s", "wait mean (s)"), ("wait_p50_s", "wait p50 (s)"),
                       ("wait_p95_s", "wait p95 (s)"), ("never_ran", "never ran"),
                       ("gpu_allocation_pct", "GPU allocation (%)"), ("preemptions", "preemptions")):
        typer.echo(f"{label:22}{logged[key]!s:>12}{a[key]!s:>18}{b[key]!s:>14}")
    spark = " ▁▂▃▄▅▆▇█"

    def line(curve: list[float]) -> str:
        return "".join(spark[min(8, round(v / 100 * 8))] for v in curve)

    typer.echo(f"{'GPU allocation, over time':26}as logged {line(logged['gpu_allocation_curve'])}  "
               f"recorded {line(a['gpu_allocation_curve'])}  what-if {line(b['gpu_allocation_curve'])}")
    typer.echo(f"finished earlier: {doc['finished_earlier']}, later: {doc['finished_later']}; "
               f"would have failed: {', '.join(doc['would_have_failed']) or 'none'}")



@app.command()
def sim(scenario: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="scenario YAML (examples/sim/)")],
        seed: Annotated[int | None, typer.Option(help="the seed (default: the scenario's)")] = None,
        as_json: JsonOut = False,
        log: Annotated[Path | None, typer.Option(help="write the simulated log here (one envelope per line)")] = None,
        ) -> None:
    """Run the whole mesh on a simulated clock and bus, deterministically: same seed, same log."""
    from gpufleet.tools.sim import ScenarioError, run_file

    try:
        with _steps_bar("simulating: jobs submitted") as bar:
            result = run_file(scenario, seed, progress=lambda done, of: bar(done, of, ""))
    except (ScenarioError, SpecError) as exc:
        typer.echo(f"error: {scenario}: {exc}", err=True)
        raise typer.Exit(2) from None
    doc = result.report()
    if log is not None:
        log.write_bytes(result.log_bytes())
    if as_json:
        _print_json(doc)
    else:
        typer.echo(f"seed {doc['seed']}: {doc['events']} events over {doc['sim_seconds'] / 3600:.2f} h simulated, "
                   f"log sha256 {doc['log_sha256'][:16]}")
        typer.echo(f"jobs {doc['jobs']}; wait p50 {doc['wait_p50_s']} s, p95 {doc['wait_p95_s']} s; "
                   f"GPU allocation {doc['gpu_allocation_pct']} %; preemptions {doc['preemptions']}, "
                   f"resumes {doc['resumes']}, nodes lost {doc['nodes_lost']}")
        if doc["nodes_provisioned"] or doc["scale_events"]:
            typer.echo(f"autoscaler: {doc['nodes_provisioned']} nodes provisioned, {doc['nodes_removed']} removed; "
                       f"{doc['scale_events']} service scale events")
        if any(doc["chaos"].values()):
            typer.echo("chaos from the seed: " + ", ".join(f"{k} {v}" for k, v in doc["chaos"].items()))
        typer.echo("audit: " + ("every invariant holds" if doc["audit"]["ok"] else
                                f"{len(doc['audit']['violations'])} violation(s): {doc['audit']['violations'][0]}"))
    if not doc["audit"]["ok"]:
        raise typer.Exit(1)


@app.command()
def top(data_dir: DataDir = None, as_json: JsonOut = False,
        once: Annotated[bool, typer.Option("--once", help="print one frame and exit (also when not a terminal)")] = False,
        ) -> None:
    """A live full-screen view of the fleet from the stream: nodes and their GPUs, queues, the jobs
    that moved last. `q` quits. A tenant's credentials show its own jobs only."""
    from gpufleet.tools.top import run as run_top

    if as_json:  # one frame's data
        async def state(fleet: Any) -> Any:
            board, _ = await fleet.board_at(ended=False)
            return board.state(fleet.tenant)
        _print_json(_run(_reading(data_dir, state)))
        return
    try:
        _run(_with_fleet(data_dir, lambda f: run_top(f, once=once)))
    except KeyboardInterrupt:
        pass


@app.command()
def dashboard(data_dir: DataDir = None,
              port: Annotated[int, typer.Option(help="HTTP port")] = 8080,
              host: Annotated[str, typer.Option("--host", "--bind", help=(
                  "address to listen on (default: this machine only; any other is reachable from other "
                  "machines, the token still needed)"))] = "127.0.0.1",
              token: Annotated[str | None, typer.Option("--token", envvar="GPUFLEET_DASHBOARD_TOKEN", help=(
                  "the admin token, instead of the one in <data-dir>/dashboard-tokens.json "
                  "(made there on first use)"))] = None,
              tenant: Annotated[str | None, typer.Option("--tenant", help=(
                  "print the URL with this tenant's token (made when it has none) and exit: that page "
                  "shows only the tenant's own jobs, read-only; a running dashboard takes it at once"))] = None,
              ) -> None:
    """A live web dashboard from the event stream: cluster map, charts over time (allocation and
    utilisation per GPU model, queue depth and wait, cost and idle cost per tenant, preemptions and
    failures), queues, event feed, job pages.

    Every request needs a token: open the URL it prints (?token=... sets the page's cookie), or
    send `Authorization: Bearer TOKEN`."""
    from gpufleet.tools.dashboard import (
        Tokens,
        check_admin_token,
        ensure_admin_token,
        exposure_warning,
        page_url,
        serve,
        tenant_token,
        tokens_path,
    )

    ddir = resolve_data_dir(data_dir)
    try:
        if tenant is not None:
            url = page_url(host, port, tenant_token(ddir, tenant))
            typer.echo(f"dashboard of tenant {tenant} (its own jobs only, read-only): {url}")
            typer.echo(f"(the token is in {tokens_path(ddir)}; `gpufleet dashboard` serves it)")
            return
        admin = check_admin_token(token) if token is not None else ensure_admin_token(ddir)
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None

    async def go(fleet: Any) -> None:
        _, server, follow = await serve(fleet.bus, host, port, tokens=Tokens.of(ddir, admin=token),
                                        prices=_mesh_config(data_dir).prices)  # (the charts' costs)
        bound = server.sockets[0].getsockname()[1] if server.sockets else port
        if (warning := exposure_warning(host, bound)) is not None:
            typer.echo(warning, err=True)
        typer.echo(f"dashboard on {page_url(host, bound, admin)} (admin: every tenant; Ctrl-C stops it)")
        typer.echo("a tenant's own view: gpufleet dashboard --tenant NAME")
        async with server:
            await asyncio.gather(server.serve_forever(), follow)

    try:
        _run(_with_fleet(data_dir, go))
    except KeyboardInterrupt:
        pass


@app.command()
def audit(data_dir: DataDir = None, as_json: JsonOut = False,
          grace: Annotated[float, typer.Option(help="seconds a waiting job may go untold (its answer in flight)")] = 10.0,
          full: Annotated[bool, typer.Option("--full", help="read the whole log, not only what came since the "
                                                            "last audit's record")] = False,
          ) -> None:
    """Check invariants over the whole log; name the first event that breaks each. Exit 1 if any breaks.
    Goes on from the last audit's record (its books at the sequence it had checked) and reads only
    the log after it; --full reads it all."""
    from gpufleet.tools.audit import INVARIANTS, audit_log

    config = _mesh_config(data_dir)
    report, from_seq = _run(_with_fleet(data_dir, lambda f: audit_log(f.bus, config, grace, full)))
    if as_json:
        _print_json({**report.as_json(), "read_from_seq": from_seq + 1})
    else:
        first = report.first()
        for name in INVARIANTS:
            v = first[name]
            n = sum(1 for x in report.violations if x.invariant == name)
            if v is None:
                typer.echo(f"ok    {name}")
            else:
                typer.echo(f"FAIL  {name}: {n} violation(s); first at seq {v.seq} ({v.event_type} "
                           f"{v.job_id or v.node_id or ''}): {v.message}")
        since = f" (read from seq {from_seq + 1}: the last audit's record covered the rest)" if from_seq else ""
        typer.echo(f"{report.events} events to seq {report.head_seq}{since}: "
                   + ("every invariant holds" if report.ok else f"{len(report.violations)} violation(s)"))
    if not report.ok:
        raise typer.Exit(1)
