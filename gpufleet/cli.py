"""The `gpufleet` command line. Every client command finds the mesh through --data-dir
(or GPUFLEET_DATA_DIR, default ~/.gpufleet); commands that scripts use take --json."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
import yaml

from gpufleet.shared.config import data_dir as resolve_data_dir
from gpufleet.shared.config import read_mesh
from gpufleet.shared.errors import GpufleetError, SpecError
from gpufleet.shared.events import Envelope
from gpufleet.shared.spec import load_spec_yaml

app = typer.Typer(add_completion=False, no_args_is_help=True, help="gpufleet: a control plane for GPU clusters, on one event log.")
schema_app = typer.Typer(no_args_is_help=True, help="The message contract (JSON Schema, AsyncAPI).")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks; figures go to docs/benchmarks.md.")
tenant_app = typer.Typer(no_args_is_help=True, help="Tenants' identities: credentials to submit and watch as a tenant.")
app.add_typer(schema_app, name="schema")
app.add_typer(bench_app, name="bench")
app.add_typer(tenant_app, name="tenant")


@app.callback()
def _identity(creds: Annotated[str | None, typer.Option(
        "--creds", envvar="GPUFLEET_CREDS",
        help="credentials file: who you are to NATS (default: the data dir's admin credentials)")] = None) -> None:
    """Every client command connects as --creds (or $GPUFLEET_CREDS), else as the data dir's admin."""
    if creds:
        from gpufleet.shared.authz import CredsError, load_creds

        try:
            load_creds(creds)
        except CredsError as exc:
            typer.echo(f"error: --creds: {exc}", err=True)
            raise typer.Exit(2) from None
        os.environ["GPUFLEET_CREDS"] = str(Path(creds).resolve())

T = TypeVar("T")
DataDir = Annotated[str | None, typer.Option("--data-dir", envvar="GPUFLEET_DATA_DIR", help="the mesh's data dir")]
JsonOut = Annotated[bool, typer.Option("--json", help="machine-readable output")]
ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", help="cluster config with prices and budgets (default: GPUFLEET_CONFIG, else the mesh's copy)")]


def _run(coro: Coroutine[Any, Any, T]) -> T:
    import nats.errors
    import nats.js.errors

    try:
        return asyncio.run(coro)
    except GpufleetError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
        # connected, but JetStream does not answer: a cluster electing its leader, a server restarting
        typer.echo(f"error: JetStream does not answer ({type(exc).__name__}): the stream may have no leader "
                   "yet or its server is restarting; try again in a few seconds (`gpufleet status`)", err=True)
        raise typer.Exit(1) from None


def _print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=None, default=str))


async def _with_fleet(data_dir: str | None, fn: Callable[[Any], Awaitable[T]]) -> T:
    from gpufleet.sdk import Fleet
    from gpufleet.shared.archive import ARCHIVE_DIR_ENV

    archive = resolve_data_dir(data_dir) / "archive"
    if ARCHIVE_DIR_ENV not in os.environ and archive.is_dir():
        os.environ[ARCHIVE_DIR_ENV] = str(archive)  # what left the stream is read back from its archive
    fleet = await Fleet.connect(data_dir=data_dir)
    try:
        return await fn(fleet)
    finally:
        await fleet.close()


async def _reading(data_dir: str | None, fn: Callable[[Any], Awaitable[T]], within_s: float = 10.0) -> T:
    """`_with_fleet` for a command that only reads: again while JetStream does not answer (a
    cluster electing a leader, a server restarting), for up to `within_s`."""
    import nats.errors
    import nats.js.errors

    deadline = time.monotonic() + within_s
    while True:
        try:
            return await _with_fleet(data_dir, fn)
        except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


# ------------------------------------------------------------------ the mesh


@app.command()
def up(
    data_dir: DataDir = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="run in the background")] = False,
    sim_nodes: Annotated[int, typer.Option(help="simulated nodes")] = 16,
    nats_port: Annotated[int, typer.Option(help="0: a free port")] = 0,
    pg_port: Annotated[int, typer.Option(help="0: a free port")] = 0,
    postgres: Annotated[bool, typer.Option(help="run the PostgreSQL read model")] = True,
    layout: Annotated[str, typer.Option(help="grouped: light services share a process; separate: one process each")] = "grouped",
    config: Annotated[Path | None, typer.Option(help="cluster config YAML: tenants and policies (docs/config.md)")] = None,
    sim_mix: Annotated[str, typer.Option(help="node shapes cycled over the sim nodes, e.g. h100x8,h100mig "
                                              "(default: h100x8/a100x8/a10x4/cpu64 4:3:2:1)")] = "",
    driver: Annotated[str, typer.Option(help="sim: N simulated nodes; process / docker: run jobs for real on "
                                             "this machine, as one node with its own GPUs (NVML)")] = "sim",
    retention: Annotated[str, typer.Option(help="keep this long in the stream (30d); older events are archived "
                                                "under the data dir first, then purged ('': keep everything)")] = "",
    nats_cluster: Annotated[int, typer.Option(help="nats-servers: 1, or a JetStream cluster of 3 (or 5) on this "
                                                   "machine's loopback with FLEET replicated 3 times")] = 1,
    instances: Annotated[int, typer.Option(help="2: every service twice (with --layout separate): one instance of "
                                                "each decides while holding its lease, the other waits; two placers "
                                                "decide side by side (compare-and-set); one executor per node")] = 1,
) -> None:
    """Start nats-server, PostgreSQL, the eight services and N simulated nodes (or this machine as a node)."""
    from gpufleet.mesh import MeshOptions, Supervisor, running_supervisor, up_detached

    ddir = resolve_data_dir(data_dir)
    running = running_supervisor(ddir)
    if running:
        typer.echo(f"already running in {ddir} (supervisor pid {running['supervisor_pid']}, NATS {running['nats_url']})", err=True)
        raise typer.Exit(1)
    if config is not None:
        from gpufleet.shared.clusterconfig import load_config

        try:
            load_config(config)
        except SpecError as exc:
            typer.echo(f"error: invalid cluster config {config}: {exc}", err=True)
            raise typer.Exit(2) from None
    try:
        from gpufleet.shared.cluster import parse_mix

        parse_mix(sim_mix)
    except ValueError as exc:
        typer.echo(f"error: --sim-mix: {exc}", err=True)
        raise typer.Exit(2) from None
    if driver not in ("sim", "process", "docker"):
        typer.echo(f"error: --driver must be sim, process or docker, not {driver!r}", err=True)
        raise typer.Exit(2)
    if retention:
        from gpufleet.shared.archive import retention_s

        try:
            retention_s(retention)
        except (SpecError, ValueError) as exc:
            typer.echo(f"error: --retention: {exc}", err=True)
            raise typer.Exit(2) from None
    if instances not in (1, 2) or (instances == 2 and layout != "separate"):
        typer.echo("error: --instances: 1, or 2 with --layout separate (each service its own processes)", err=True)
        raise typer.Exit(2)
    if nats_cluster not in (1, 3, 5):
        typer.echo(f"error: --nats-cluster: 1, 3 or 5 servers (a quorum needs an odd number), not {nats_cluster}", err=True)
        raise typer.Exit(2)
    opts = MeshOptions(ddir, sim_nodes, nats_port, pg_port, postgres, layout=layout, config=config, sim_mix=sim_mix,
                       driver=driver, retention=retention, nats_cluster=nats_cluster, instances=instances)
    if detach:
        doc = up_detached(opts)
        typer.echo(f"gpufleet running in {ddir}: NATS {doc['nats_url']}, PostgreSQL {doc['pg_dsn'] or '-'}, "
                   f"{sim_nodes} sim nodes")
        _up_notes(ddir, config)
        return

    def ready(sup: Supervisor) -> None:
        typer.echo(f"gpufleet running in {ddir}: NATS {sup.nats_url}, PostgreSQL {sup.pg_dsn or '-'}, "
                   f"{sim_nodes} sim nodes. Ctrl-C stops it.")
        _up_notes(ddir, config)

    Supervisor(opts).run(on_ready=ready)


def _up_notes(ddir: Path, config: Path | None) -> None:
    """What `up` says once: who may connect, the dashboard's token (first start only), an open cluster."""
    from gpufleet.dashboard import TOKENS_FILE, ensure_admin_token
    from gpufleet.shared.authz import ADMIN, Realm

    typer.echo(f"auth: nkeys; you are the admin ({Realm(ddir).creds_path(ADMIN)}); tenants: "
               f"`gpufleet tenant add NAME`, then `gpufleet --creds NAME.creds ...`")
    first = not (ddir / TOKENS_FILE).exists()
    token = ensure_admin_token(ddir)
    if first:
        typer.echo(f"dashboard token (shown once; kept in {ddir / TOKENS_FILE}): {token}")
    if config is None:
        typer.echo(f"open cluster: any tenant with credentials may submit, to any queue ({ddir / 'cluster.yaml'}); "
                   "`gpufleet up --config` with tenants and queues closes it (docs/config.md)")


@app.command()
def down(data_dir: DataDir = None) -> None:
    """Stop the mesh of this data dir."""
    from gpufleet.mesh import down as mesh_down

    ddir = resolve_data_dir(data_dir)
    if not mesh_down(ddir):
        typer.echo(f"no mesh running in {ddir}", err=True)
        raise typer.Exit(1)
    typer.echo(f"stopped the mesh in {ddir}")


@app.command()
def status(data_dir: DataDir = None, as_json: JsonOut = False) -> None:
    """Each part of the mesh: alive or not, with its pid; the stream's size."""
    from gpufleet.mesh import running_supervisor
    from gpufleet.shared.procs import pid_alive

    ddir = resolve_data_dir(data_dir)
    doc = running_supervisor(ddir)
    if doc is None:
        out: dict[str, Any] = {"running": False, "data_dir": str(ddir), "parts": {}}
    else:
        parts = {
            name: {"pid": p.get("pid"), "alive": bool(p.get("pid")) and pid_alive(int(p["pid"])),
                   "restarts": p.get("restarts", 0)}
            for name, p in doc.get("parts", {}).items()
        }
        out = {"running": True, "state": doc.get("state"), "data_dir": str(ddir), "nats_url": doc["nats_url"],
               "pg_dsn": doc.get("pg_dsn"), "parts": parts}
        try:
            out["stream"] = _run(_with_fleet(str(ddir), _stream_status))
            out["stream_seq"] = out["stream"]["last_seq"]
        except Exception as exc:  # noqa: BLE001 - report, do not fail
            out["stream_error"] = str(exc) or type(exc).__name__
    if as_json:
        _print_json(out)
        return
    if not out["running"]:
        typer.echo(f"not running ({ddir})")
        raise typer.Exit(1)
    typer.echo(f"running in {ddir}  NATS {out['nats_url']}  log seq {out.get('stream_seq')}")
    st = out.get("stream")
    if st:
        arch = st.get("archive") or {}
        covered = arch.get("archived_to", 0) >= st["first_seq"] - 1
        typer.echo(f"  log: seqs {st['first_seq']}..{st['last_seq']}, {st['bytes'] / 1e6:.1f} MB; limits: {st['limits']}"
                   + ("" if st["first_seq"] <= 1 or covered else "  (the head is gone: see `gpufleet audit`)"))
        if arch.get("segments"):
            typer.echo(f"  archive: seqs 1..{arch['archived_to']} in {arch['segments']} segments under {arch['dir']}"
                       + (f" (retention {arch['retention_s']:.0f} s)" if arch.get("retention_s") else ""))
    elif "stream_error" in out:
        typer.echo(f"  log: cannot read it ({out['stream_error']})")
    for name, p in out["parts"].items():
        typer.echo(f"  {name:<11} {'up' if p['alive'] else 'DOWN':<5} pid {p['pid']}  restarts {p['restarts']}")


# ------------------------------------------------------------------ jobs


async def _stream_status(fleet: Any) -> dict[str, Any]:
    """The log's extent and the limits that would stop it (or, with another discard, drop its head)."""
    from gpufleet.shared.events import STREAM

    info = await fleet.bus.js.stream_info(STREAM)
    c, st = info.config, info.state
    limits = {k: v for k, v in (("max_bytes", c.max_bytes), ("max_msgs", c.max_msgs), ("max_age_s", c.max_age))
              if v not in (None, -1, 0)}
    desc = ", ".join(f"{k} {v}" for k, v in limits.items()) or "none (keeps everything)"
    discard = getattr(c.discard, "value", c.discard)
    from gpufleet.shared.archive import Archive, archive_dir, retention_s

    root = archive_dir()
    segs = Archive(root).segments() if root is not None and root.is_dir() else []
    keep = retention_s()
    return {"first_seq": st.first_seq, "last_seq": st.last_seq, "messages": st.messages, "bytes": st.bytes,
            "limits": f"{desc}; at a limit: {'refuse new events' if discard == 'new' else 'drop the oldest'}",
            "deny_purge": bool(c.deny_purge), "deny_delete": bool(c.deny_delete),
            "archive": {"retention_s": keep, "segments": len(segs), "archived_to": segs[-1].last if segs else 0,
                        "dir": str(root) if root is not None else None}}


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="job spec YAML")],
    data_dir: DataDir = None,
    as_json: JsonOut = False,
    wait: Annotated[bool, typer.Option("--wait", help="follow the job to its end, showing progress")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="submit without showing the cost estimate first")] = False,
    config: ConfigOpt = None,
) -> None:
    """Submit a job; prints its id. Shows its cost estimate first (on a terminal: and asks) unless --yes.
    With a tenant's credentials a spec without `tenant` is that tenant's."""
    from gpufleet.shared.authz import find_creds
    from gpufleet.shared.spec import parse_spec

    text = file.read_text()
    try:
        spec = yaml.safe_load(text)
        ident = find_creds(None, resolve_data_dir(data_dir))
        if isinstance(spec, dict) and ident is not None and ident.tenant is not None and "tenant" not in spec:
            spec["tenant"] = ident.tenant
        parsed = parse_spec(spec) if isinstance(spec, dict) else load_spec_yaml(text)
    except yaml.YAMLError as exc:
        typer.echo(f"error: invalid job spec {file}: spec: not valid YAML: {exc}", err=True)
        raise typer.Exit(2) from None
    except SpecError as exc:
        typer.echo(f"error: invalid job spec {file}: {exc}", err=True)
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
    from gpufleet.shared.authz import find_creds

    ident = find_creds(None, resolve_data_dir(data_dir))
    dsn = os.environ.get("GPUFLEET_PG_DSN") if not data_dir else None
    if ident is not None and ident.tenant is not None:
        dsn = None
    elif dsn is None:
        dsn = read_mesh(data_dir).get("pg_dsn") or None
    if dsn:
        from gpufleet.shared.readmodel import query_rows

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
def replay(data_dir: DataDir = None, as_json: JsonOut = False,
           seq: Annotated[int | None, typer.Option("--seq", help="fold up to this sequence")] = None,
           until: Annotated[str | None, typer.Option(help="the state at this time: 10m (ago), or an ISO time")] = None,
           what_if: Annotated[Path | None, typer.Option("--what-if", exists=True, dir_okay=False,
                                                        help="re-run the recorded workload under this cluster config")] = None,
           ) -> None:
    """Fold the log (to the head, --seq or --until) and print the cluster state it gives; or,
    with --what-if, run the recorded workload again through the real cores under another config."""
    if what_if is not None:
        _what_if(data_dir, what_if, as_json)
        return
    at = _parse_time(until) if until else None
    doc = _run(_reading(data_dir, lambda f: f.state_at(until_seq=seq, until_time=at)))
    if as_json:
        _print_json(doc)
        return
    by_status: dict[str, int] = {}
    for j in doc["jobs"]:
        by_status[j["status"]] = by_status.get(j["status"], 0) + 1
    gpus = sum(n["gpus_total"] for n in doc["nodes"])
    used = sum(n["gpus_allocated"] for n in doc["nodes"])
    typer.echo(f"state at seq {doc['seq']}: {len(doc['jobs'])} jobs {by_status}, {len(doc['nodes'])} nodes, "
               f"GPUs {used}/{gpus} allocated")
    for node_id, cells in doc["gpus"].items():
        held = [f"{c['gpu']}:{c['state']}" + (f"({c['job']})" if c["job"] else "") for c in cells if c["state"] != "free"]
        if held:
            typer.echo(f"  {node_id:<12} " + " ".join(held))
    for q in doc["queues"]:
        typer.echo(f"  queue {q['queue']:<12} GPUs used {q['gpus_used']}, placed {q['running_or_placed']}, "
                   f"pending {q['pending']}")


def _what_if(data_dir: str | None, path: Path, as_json: bool) -> None:
    from gpufleet.sim import ScenarioError, what_if, what_if_file

    try:
        other, nodes = what_if_file(path)
    except (SpecError, ScenarioError) as exc:
        typer.echo(f"error: invalid what-if file {path}: {exc}", err=True)
        raise typer.Exit(2) from None
    hist = _run(_with_fleet(data_dir, lambda f: f.history()))
    try:
        doc = what_if(hist, _mesh_config(data_dir), other, nodes)
    except ScenarioError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        _print_json(doc)
        return
    a, b = doc["recorded"], doc["what_if"]
    typer.echo(f"{doc['jobs_compared']} jobs, the recorded workload run twice through the cores (simulated):")
    typer.echo(f"{'':22}{'recorded config':>18}{'what-if':>14}")
    for key, label in (("wait_p50_s", "wait p50 (s)"), ("wait_p95_s", "wait p95 (s)"),
                       ("gpu_allocation_pct", "GPU allocation (%)"), ("preemptions", "preemptions")):
        typer.echo(f"{label:22}{a[key]!s:>18}{b[key]!s:>14}")
    typer.echo(f"finished earlier: {doc['finished_earlier']}, later: {doc['finished_later']}; "
               f"would have failed: {', '.join(doc['would_have_failed']) or 'none'}")


def _parse_time(text: str) -> float:
    """'10m' / '2h' / '30s' ago, or an ISO 8601 time (UTC when it names no zone) -> unix seconds."""
    from datetime import UTC, datetime

    from gpufleet.shared.spec import parse_duration_s

    try:
        return time.time() - parse_duration_s(text)
    except (ValueError, TypeError):
        pass
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        typer.echo(f"error: {text!r} is neither a duration (10m) nor an ISO time (2026-11-30T05:00:00)", err=True)
        raise typer.Exit(2) from None
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


@app.command()
def sim(scenario: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="scenario YAML (examples/sim/)")],
        seed: Annotated[int | None, typer.Option(help="the seed (default: the scenario's)")] = None,
        as_json: JsonOut = False,
        log: Annotated[Path | None, typer.Option(help="write the simulated log here (one envelope per line)")] = None,
        ) -> None:
    """Run the whole mesh on a simulated clock and bus, deterministically: same seed, same log."""
    from gpufleet.sim import ScenarioError, run_file

    try:
        result = run_file(scenario, seed)
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
    """A live web dashboard from the event stream: cluster map, queues, event feed, job pages.

    Every request needs a token: open the URL it prints (?token=... sets the page's cookie), or
    send `Authorization: Bearer TOKEN`."""
    from gpufleet.dashboard import (
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
        _, server, follow = await serve(fleet.bus, host, port, tokens=Tokens.of(ddir, admin=token))
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
    from gpufleet.audit import INVARIANTS, audit_log

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
    for it in doc.interruptions:
        typer.echo(it["text"])
    for p in doc.pending:
        typer.echo(p["text"])


def _mesh_config(data_dir: str | None) -> Any:
    from gpufleet.shared.clusterconfig import load_config

    path = resolve_data_dir(data_dir) / "cluster.yaml"
    return load_config(path if path.exists() else os.environ.get("GPUFLEET_CONFIG"))


async def _quota_state(fleet: Any, config: Any) -> tuple[Any, Any]:
    """The quota core's state at the head of the log: its newest snapshot and the tail after it."""
    from gpufleet.services.quota.core import QuotaCore
    from gpufleet.shared.engine import fold_log

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
    for p in state.pending.values():
        pending_in[p.queue] = pending_in.get(p.queue, 0) + 1
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
            "reserved_jobs": sum(1 for held in state.reserved.values() if held[0] == name),
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

    typer.echo(f"{'QUEUE':<14}{'COHORT':<10}{'PENDING':>8}{'JOBS':>6}  GPU USED / NOMINAL")
    for row in rows:
        typer.echo(f"{row['queue']:<14}{row['cohort'] or '-':<10}{row['pending']:>8}{row['reserved_jobs']:>6}  "
                   f"{fmt(row['usage'])} / {fmt(row['nominal']) if row['limited'] else 'unlimited'}")
    if cohorts:
        typer.echo(f"\n{'COHORT':<14}{'PARENT':<10}{'PENDING':>8}  GPU USED / HELD  BORROWED")
        for c in cohorts.values():
            typer.echo(f"{c['cohort']:<14}{c['parent'] or '-':<10}{c['pending']:>8}  "
                       f"{fmt(c['usage'])} / {fmt(c['quota'])}  {fmt(c['borrowed'])}")


# ------------------------------------------------------------------ schema, bench


@schema_app.command("export")
def schema_export(out_dir: Annotated[Path, typer.Argument(help="where to write the schemas")]) -> None:
    """Write a JSON Schema per message type and one AsyncAPI document."""
    from gpufleet.shared.schema import export

    files = export(out_dir)
    typer.echo(f"wrote {len(files)} files to {out_dir}")


@bench_app.command("e2e")
def bench_e2e(
    sim_nodes: Annotated[int, typer.Option(help="simulated nodes")] = 5000,
    jobs_n: Annotated[int, typer.Option("--jobs", help="jobs to submit")] = 20000,
    as_json: JsonOut = False,
    postgres: Annotated[bool, typer.Option(help="include the PostgreSQL read model in the mesh")] = True,
    layouts: Annotated[str, typer.Option(help="layouts to run, the first reported, the rest as baselines")] = "grouped,separate",
    nats_sync: Annotated[str, typer.Option(
        help="JetStream fsync policies: always (the mesh's), lazy (the server's default: every 2 min); "
             "the first reported, the rest as baselines of the first layout")] = "always",
) -> None:
    """Submit jobs as fast as the mesh takes them; report submit->placed rate and latency."""
    from gpufleet.bench import run_e2e

    syncs = tuple(x.strip() for x in nats_sync.split(",") if x.strip())
    if not syncs or any(x not in ("always", "lazy") for x in syncs):
        typer.echo("error: --nats-sync: a list of always / lazy", err=True)
        raise typer.Exit(2)
    result = run_e2e(sim_nodes=sim_nodes, jobs=jobs_n, postgres=postgres,
                     progress=None if as_json else (lambda s: typer.echo(s, err=True)),
                     layouts=tuple(x.strip() for x in layouts.split(",") if x.strip()), syncs=syncs)
    if as_json:
        _print_json(result)
    else:
        for k, v in result.items():
            typer.echo(f"{k:>24}: {v}")
    runs = [result, *(v for k, v in result.items() if k.startswith("baseline_") and isinstance(v, dict))]
    lost = sum(int(r.get("unaccounted", 0)) for r in runs)
    refused = sum(int(r.get("refused", 0)) for r in runs)
    if refused:
        typer.echo(f"warning: {refused} job(s) refused ({result.get('refused_by_code')}): the rate counts placed jobs only",
                   err=True)
    if lost:
        typer.echo(f"error: {lost} job(s) have no outcome (neither placed, told why it waits, nor refused)", err=True)
        raise typer.Exit(1)


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


@bench_app.command("placement")
def bench_placement(
    pods: Annotated[Path, typer.Option(help="pod list CSV (openb_pod_list_*.csv), or a folder: every pod list in it")],
    nodes: Annotated[Path, typer.Option(help="node list CSV (openb_node_list_gpu_node.csv)")],
    policies: Annotated[str, typer.Option(help="random,dotprod,clustering,packing,bestfit,fgd,fragaware")] = "bestfit,fgd,fragaware",
    seeds: Annotated[str, typer.Option(help="e.g. 42-51 or 42,43")] = "42-51",
    published: Annotated[Path | None, typer.Option(help="folder of the published results (fgd-expected)")] = None,
    plot: Annotated[Path | None, typer.Option(help="write the allocation curves to this PNG")] = None,
    as_json: JsonOut = False,
) -> None:
    """Replay an Alibaba GPU trace through the placer's framework, as the FGD paper's simulator does:
    GPU allocation ratio at 130 % arrived GPU, fragmentation at 80 %, side by side with the
    published numbers."""
    from gpufleet.bench_placement import bench, write_plot
    from gpufleet.bench_placement import published as published_results

    files = sorted(pods.glob("openb_pod_list_*.csv")) if pods.is_dir() else [pods]
    if not files:
        typer.echo(f"error: no pod lists in {pods}", err=True)
        raise typer.Exit(2)
    if not nodes.exists():
        typer.echo(f"error: --nodes: {nodes} does not exist", err=True)
        raise typer.Exit(2)
    names = [p.strip() for p in policies.split(",") if p.strip()]
    from gpufleet.services.placer.framework import profiles

    unknown = [n for n in names if n not in profiles()]
    if unknown:
        typer.echo(f"error: --policies: unknown {', '.join(unknown)} (one of {', '.join(profiles())})", err=True)
        raise typer.Exit(2)
    docs = []
    for f in files:
        doc = bench(f, nodes, names, _seeds(seeds), progress=lambda m: typer.echo(m, err=True))
        if published is not None:
            doc["published"] = published_results(published, doc["workload"])
        docs.append(doc)
    if plot is not None:
        write_plot(docs, plot)
    if as_json:
        _print_json(docs[0] if len(docs) == 1 else {"workloads": docs})
        return
    for doc in docs:
        typer.echo(f"{doc['workload']}: {doc['nodes']} nodes, {doc['gpus']} GPUs, {doc['pods']} pods, "
                   f"seeds {doc['seeds'][0]}-{doc['seeds'][-1]}")
        typer.echo(f"  {'policy':<12}{'alloc@130':>10}{'±':>6}{'published':>11}{'frag@80':>9}{'published':>11}{'s/seed':>8}")
        pub = doc.get("published", {})
        for name, r in doc["policies"].items():
            p = pub.get(name, {})
            typer.echo(f"  {name:<12}{r['alloc_130_mean']:>10.2f}{r['alloc_130_std']:>6.2f}"
                       f"{p.get('alloc_130_mean', float('nan')):>11.2f}{r['frag_80_mean']:>9.2f}"
                       f"{p.get('frag_80_mean', float('nan')):>11.2f}{r['seconds_per_seed']:>8.1f}")


@bench_app.command("history")
def bench_history(
    events: Annotated[str, typer.Option(help="log sizes, comma-separated (100000,1000000)")] = "100000",
    services: Annotated[str, typer.Option(help="the service cores to restart")] = "admission,quota,placer,guardian,billing,telemetry",
    pending: Annotated[str | None, typer.Option(
        help="instead: a backlog of this many waiting jobs (1000000), folded by every core in one process: "
             "memory per job and the cost of a decision against 1,000")] = None,
    as_json: JsonOut = False,
) -> None:
    """Restart cost as the log grows: each core's full fold beside its start from a snapshot (+ tail),
    replay at three points from view snapshots, explain; or, with --pending, a deep backlog."""
    from gpufleet.bench_history import run as run_history

    try:
        sizes = [int(x.replace("_", "")) for x in (pending or events).split(",") if x.strip()]
    except ValueError:
        typer.echo("error: --events / --pending: comma-separated counts, e.g. 100000,1000000", err=True)
        raise typer.Exit(2) from None
    if pending is not None:
        from gpufleet.bench_history import pending as run_pending

        doc = run_pending(sizes, progress=None if as_json else (lambda s: typer.echo(s, err=True)))
        if as_json:
            _print_json(doc)
            return
        for row in doc["sizes"]:
            per_core = ", ".join(f"{k} {v}" for k, v in row["snapshot_bytes_per_job"].items())
            typer.echo(f"{row['pending']:>9,} pending: {row['rss_bytes_per_job']:,} bytes of memory per job "
                       f"(all eight cores), a delivered submit {row['decide_us']} us ({row['decide_vs_1000']}x 1,000); "
                       f"snapshot bytes per job: {per_core}")
        return
    doc = run_history(sizes, tuple(x.strip() for x in services.split(",") if x.strip()),
                      progress=None if as_json else (lambda s: typer.echo(s, err=True)))
    if as_json:
        _print_json(doc)
        return
    for size in doc["sizes"]:
        typer.echo(f"{size['events']:,} events")
        for name, row in size["cores"].items():
            typer.echo(f"  {name:<11} full fold {row['full_fold_s']:>7.2f} s ({row['full_fold_events']:,} events)   "
                       f"from snapshot {row['snapshot_start_s']:>6.3f} s (+{row['tail_events']} events, "
                       f"{row['snapshot_bytes'] / 1e6:.1f} MB)   {row['speedup']}x")
        rp = size.get("replay", {})
        for p in rp.get("points", []):
            typer.echo(f"  replay --seq {p['seq']:<9,} {p['snapshot_s']:>6.2f} s from the view snapshot at "
                       f"{p['from_snapshot']:,}   {p['full_fold_s']:>6.2f} s from seq 1")
        for j in size.get("explain", {}).get("jobs", []):
            typer.echo(f"  explain {j['job_id']}: {j['s']:.3f} s ({j['events']} events)")
    for name, g in doc.get("growth", {}).items():
        typer.echo(f"  growth {name}: full fold {g['full_fold']}x, snapshot start {g['snapshot_start']}x")


@bench_app.command("replay")
def bench_replay(
    events: Annotated[int, typer.Option(help="events in the synthetic log to build")] = 100_000,
    repeat: Annotated[int, typer.Option(help="rounds; the median is reported")] = 5,
    mesh_log: Annotated[bool, typer.Option("--mesh-log", help="read the running mesh's log instead (--data-dir)")] = False,
    data_dir: DataDir = None,
    as_json: JsonOut = False,
) -> None:
    """Fold speed of the log (what `replay` does) beside the raw JetStream read rate, same run."""
    from gpufleet.bench_replay import run
    from gpufleet.shared.config import resolve_nats_url

    doc = run(events, repeat, resolve_nats_url(data_dir) if mesh_log else None,
              progress=None if as_json else (lambda m: typer.echo(m, err=True)))
    if as_json:
        _print_json(doc)
        return
    typer.echo(f"{doc['raw_read']['events']:,} events ({doc['source']}), median of {doc['repeat']} rounds:")
    for m in ("raw_read", "parse", "fold"):
        r = doc[m]
        typer.echo(f"  {m:<9} {r['events_per_s']:>10,} events/s   {r['median_s']:>8} s   x{r['vs_raw_read']} of raw read")


@bench_app.command("decide")
def bench_decide(
    nodes: Annotated[int, typer.Option(help="sim nodes")] = 5000,
    jobs: Annotated[int, typer.Option(help="decisions to time")] = 2000,
    fill: Annotated[float, typer.Option(help="GPU fill kept while timing")] = 0.6,
    profiles_: Annotated[str, typer.Option("--profiles", help="placement profiles")] = "default,fragaware",
    as_json: JsonOut = False,
) -> None:
    """Milliseconds per placement decision at scale: the candidate cap vs scoring every node."""
    from gpufleet.bench_placement import decide_speed

    doc = decide_speed(nodes=nodes, jobs=jobs, fill=fill, profiles_=[p.strip() for p in profiles_.split(",")],
                       progress=None if as_json else (lambda m: typer.echo(m, err=True)))
    if as_json:
        _print_json(doc)
        return
    typer.echo(f"{doc['nodes']} nodes, {doc['gpus']} GPUs, filled to {doc['fill']:.0%}, {doc['jobs']} decisions each")
    for name, r in doc["profiles"].items():
        extra = f"  ({r['speedup_vs_every_node']}x faster than every node)" if "speedup_vs_every_node" in r else ""
        typer.echo(f"  {name:<28} median {r['median_ms']:>8} ms   p99 {r['p99_ms']:>8} ms{extra}")


@bench_app.command("billing")
def bench_billing(
    events: Annotated[int, typer.Option("--events", help="events of synthetic job lifecycles to fold")] = 200_000,
    repeat: Annotated[int, typer.Option(help="folds timed per fold kind (the median reported)")] = 5,
    as_json: JsonOut = False,
) -> None:
    """The billing core's fold rate (events/s) and state size, beside the cluster view's fold of the same events."""
    from gpufleet.bench_billing import run as run_billing

    if events < 100 or repeat < 1:
        typer.echo("error: --events must be at least 100 and --repeat at least 1", err=True)
        raise typer.Exit(2)
    doc = run_billing(events, repeat)
    if as_json:
        _print_json(doc)
        return
    typer.echo(f"{doc['events']} events, {doc['jobs']} jobs, {doc['log_hours']} h of log; median of {doc['repeat']}")
    typer.echo(f"  {'fold':<26}{'events/s':>10}{'x baseline':>11}{'peak KiB':>10}{'kept KiB':>10}  entries")
    for name, r in doc["folds"].items():
        entries = " ".join(f"{k}={v}" for k, v in r["entries"].items() if v)
        typer.echo(f"  {name:<26}{r['events_per_s_median']:>10}{r['rate_vs_baseline']:>11}{r['peak_kib']:>10}"
                   f"{r['kept_kib']:>10}  {entries}")


# ------------------------------------------------------------------ billing (docs/billing.md)


def _cluster_config(data_dir: str | None, path: Path | None) -> Any:
    """--config, else GPUFLEET_CONFIG, else the copy `gpufleet up --config` keeps in the data dir."""
    from gpufleet.shared.clusterconfig import ClusterConfig, load_config

    candidates = [path, Path(os.environ["GPUFLEET_CONFIG"]) if os.environ.get("GPUFLEET_CONFIG") else None,
                  resolve_data_dir(data_dir) / "cluster.yaml"]
    for c in candidates:
        if c is not None and (c is path or c.exists()):
            try:
                return load_config(c)
            except (SpecError, OSError) as exc:
                typer.echo(f"error: cluster config {c}: {exc}", err=True)
                raise typer.Exit(2) from None
    return ClusterConfig()


async def _estimate_doc(spec: Any, cfg: Any, data_dir: str | None, duration_s: float | None,
                        with_wait: bool, spec_doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """The estimate; the wait (and the cluster's GPU models) from the quota's and the placer's folds
    of the log (services/billing/wait.py)."""
    from gpufleet.services.admission.core import AdmissionCore
    from gpufleet.services.billing.report import estimate, expected_wait, fold
    from gpufleet.services.placer.core import PlacerCore
    from gpufleet.services.quota.core import QuotaCore
    from gpufleet.shared.events import utc
    from gpufleet.shared.runtime import Ctx

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
    from gpufleet.shared.spec import parse_duration_s

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


# ------------------------------------------------------------------ autoscaling (docs/autoscaling.md)


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

    from gpufleet.shared.spec import parse_duration_s

    try:
        window_s = parse_duration_s(window)
    except (ValueError, TypeError):
        typer.echo(f"error: --window: {window!r} is not a duration (30s, 1m)", err=True)
        raise typer.Exit(2) from None

    async def go(fleet: Any) -> Envelope:
        t = tenant
        if t is None:
            from gpufleet.shared.events import JobSubmitted

            found = [e for _, e in await fleet.history(f"fleet.evt.*.job.{job_id}.submitted")
                     if isinstance(e.payload, JobSubmitted)]
            if not found:
                raise GpufleetError(f"no job {job_id}")
            spec = found[0].payload.spec
            if spec.autoscale is None:
                raise GpufleetError(f"job {job_id} is not an inference service (no autoscale): "
                                    "the autoscaler would ignore its load")
            t = found[0].tenant
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
    from gpufleet.shared.engine import fold_log

    core = AutoscalerCore(config, providers=tuple(PROVIDERS))
    engine, _ = await fold_log(fleet.bus, core)
    return pool_summary(core, engine.state)


@app.command()
def pools(data_dir: DataDir = None, as_json: JsonOut = False, config: ConfigOpt = None) -> None:
    """Each node pool: its nodes ready / provisioning / draining, min, max and the autoscaler's
    latest decision about it (folded from the log)."""
    from gpufleet.shared.events import utc

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
    typer.echo(f"{'POOL':<14}{'SHAPE':<14}{'READY':>6}{'PROV':>6}{'DRAIN':>6}{'MIN':>5}{'MAX':>5}  LAST DECISION")
    for r in rows:
        shape = r["shape"] or {}
        what = f"{shape.get('gpuModel') or 'cpu'}x{shape.get('gpus', 0)}" if shape else "(not configured)"
        last = r["last_decision"]
        said = (f"{last['at'][11:19]} {last['type'].removeprefix('node.')} {last['node_id']}: {last['reason']}"
                if last else "-")
        draining = r["draining"] + r["removing"]
        typer.echo(f"{r['pool']:<14}{what:<14}{r['ready']:>6}{r['provisioning']:>6}{draining:>6}"
                   f"{r['min'] if r['min'] is not None else '-':>5}{r['max'] if r['max'] is not None else '-':>5}  {said}")


# ------------------------------------------------------------------ tenants


def _realm_and_reload(data_dir: str | None, change: Callable[[Any], T]) -> tuple[T, bool]:
    """Apply `change` to the data dir's realm, rewrite nats.conf's authorization and, when the mesh
    runs, have nats-server reload it (SIGHUP). Returns change's result and whether it reloaded."""
    import signal

    from gpufleet.mesh import running_supervisor
    from gpufleet.shared.authz import NATS_CONF, Realm, write_nats_config

    ddir = resolve_data_dir(data_dir)
    realm = Realm.load(ddir)
    if not realm.exists():
        raise GpufleetError(f"no identities in {ddir}: start the mesh there first (`gpufleet up`)")
    out = change(realm)
    conf_path = ddir / NATS_CONF
    reloaded = False
    if conf_path.exists():
        conf = json.loads(conf_path.read_text())
        conf["authorization"] = realm.authorization()
        write_nats_config(conf_path, conf)
        doc = running_supervisor(ddir)
        pid = ((doc or {}).get("parts", {}).get("nats") or {}).get("pid")
        if pid:
            os.kill(int(pid), signal.SIGHUP)
            reloaded = True
    return out, reloaded


@tenant_app.command("add")
def tenant_add(name: str, data_dir: DataDir = None, as_json: JsonOut = False) -> None:
    """Create a tenant's identity (an nkey; its credentials file is mode 0600) and let the server admit it."""
    from gpufleet.shared.authz import Realm

    def add(realm: Realm) -> Path:
        try:
            realm.add("tenant", name)
        except ValueError as exc:
            raise GpufleetError(str(exc)) from None
        return realm.creds_path(f"tenant-{name}")

    try:
        path, reloaded = _realm_and_reload(data_dir, add)
    except GpufleetError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        _print_json({"tenant": name, "creds": str(path), "reloaded": reloaded})
        return
    typer.echo(f"tenant {name}: credentials in {path}" + ("" if reloaded else " (the mesh is not running: "
                                                             "its next start admits them)"))
    typer.echo(f"  give that file to {name}; they run e.g.  gpufleet --creds {name}.creds submit job.yaml")


@tenant_app.command("creds")
def tenant_creds(name: str, data_dir: DataDir = None,
                 output: Annotated[Path | None, typer.Option("--output", "-o", help="copy the credentials here (mode 0600)")] = None,
                 ) -> None:
    """Where a tenant's credentials are (or a copy of them, with -o)."""
    from gpufleet.shared.authz import Realm
    from gpufleet.shared.config import write_private

    realm = Realm.load(resolve_data_dir(data_dir))
    path = realm.creds_path(f"tenant-{name}")
    if not path.exists():
        known = ", ".join(realm.tenants()) or "none"
        typer.echo(f"error: no tenant {name!r} (known: {known}); create it with `gpufleet tenant add {name}`", err=True)
        raise typer.Exit(1)
    if output is not None:
        write_private(output, path.read_text())
        typer.echo(str(output))
        return
    typer.echo(str(path))


@tenant_app.command("list")
def tenant_list(data_dir: DataDir = None, as_json: JsonOut = False) -> None:
    """The tenants that have credentials."""
    from gpufleet.shared.authz import Realm

    names = Realm.load(resolve_data_dir(data_dir)).tenants()
    if as_json:
        _print_json(names)
        return
    for n in names:
        typer.echo(n)


# ------------------------------------------------------------------ TLS and cluster configs (distributed mode)

certs_app = typer.Typer(no_args_is_help=True, help="Distributed mode: a test CA and NATS server certificates, "
                                                   "the authorization include, a local TLS cluster's configs.")
app.add_typer(certs_app, name="certs")


@certs_app.command("make")
def certs_make(
    out: Annotated[Path, typer.Option("--out", help="folder for ca.pem, <server>.pem, <server>-key.pem (never commit it)")],
    server: Annotated[list[str], typer.Option("--server", help="a NATS server's name (repeat): its certificate names it")],
    host: Annotated[list[str] | None, typer.Option(
        "--host", help="another DNS name or IP every certificate names (repeat), e.g. the alias all servers share")] = None,
    days: Annotated[int, typer.Option(help="validity of new certificates")] = 365,
    new_ca: Annotated[bool, typer.Option("--new-ca", help="make a new CA even if --out has one")] = False,
    as_json: JsonOut = False,
) -> None:
    """A test CA and one certificate per NATS server.

    Each certificate serves and dials (serverAuth + clientAuth: routes are mutual TLS) and names the server, every --host, localhost and 127.0.0.1. Keys are mode 0600. A CA already in
    --out is reused, so existing clients keep trusting the new certificates."""
    from gpufleet.shared.tls import make_test_pki

    try:
        pki = make_test_pki(out, server, host or [], days=days, new_ca=new_ca)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        _print_json(pki.to_json())
        return
    typer.echo(f"CA {pki.ca_file} ({'reused' if pki.ca_reused else 'new'}; its key {pki.ca_key_file})")
    for s in pki.servers.values():
        typer.echo(f"  {s.name}: {s.cert_file}  {s.key_file}")
    typer.echo("clients trust the CA: SSL_CERT_FILE=" + str(pki.ca_file) + " (or tls= ssl.create_default_context(cafile=...))")


def _deploy_realm(realm_dir: Path, tenants: list[str] | None) -> Any:
    from gpufleet.shared.authz import ensure_realm

    try:
        return ensure_realm(realm_dir, tenants=tenants or [])
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


RealmOpt = Annotated[Path, typer.Option("--realm", help="the identities' folder (creds/ under it; made if missing, keys kept)")]
TenantOpt = Annotated[list[str] | None, typer.Option("--tenant", help="also a tenant identity (repeat)")]


@certs_app.command("authorization")
def certs_authorization(
    realm_dir: RealmOpt,
    out: Annotated[Path, typer.Option("--out", help="the file deploy/nats/*.conf include (authorization.conf)")],
    tenant: TenantOpt = None,
    as_json: JsonOut = False,
) -> None:
    """The identities and the authorization block the deploy/ NATS configs include.

    The identities: admin, every service, the read model, --tenant, under --realm. The
    `authorization` block the deploy/ NATS configs include (mode 0600): the same users and
    permissions as the embedded mesh."""
    from gpufleet.shared.config import write_private

    realm = _deploy_realm(realm_dir, tenant)
    write_private(out, "# generated by `gpufleet certs authorization`; do not edit, do not commit\n"
                       "authorization: " + json.dumps(realm.authorization(), indent=2) + "\n")
    if as_json:
        _print_json({"authorization": str(out), "creds_dir": str(realm.creds_dir),
                     "identities": sorted(realm.identities)})
        return
    typer.echo(f"{out}: {len(realm.identities)} users; their credentials in {realm.creds_dir}")


@certs_app.command("cluster-config")
def certs_cluster_config(
    realm_dir: RealmOpt,
    out: Annotated[Path, typer.Option("--out", help="folder for nats-<i>.conf and the nodes' stores (data/)")],
    nodes: Annotated[int, typer.Option(help="servers in the cluster")] = 3,
    certs: Annotated[Path | None, typer.Option(
        help="certificates from `gpufleet certs make` for nats-1..N (default: made in OUT/certs)")] = None,
    client_port: Annotated[int, typer.Option(help="node i listens for clients on this + i - 1")] = 4222,
    cluster_port: Annotated[int, typer.Option(help="node i listens for routes on this + i - 1")] = 6222,
    tenant: TenantOpt = None,
    as_json: JsonOut = False,
) -> None:
    """The configs of a local N-node JetStream cluster with TLS.

    On 127.0.0.1: the realm's authorization, TLS for clients, mutual TLS on the routes. Start each node with `nats-server -c OUT/nats-<i>.conf`."""
    from gpufleet.shared.tls import load_pki, node_names, write_local_cluster

    realm = _deploy_realm(realm_dir.resolve(), tenant)
    try:
        pki = None
        if certs is not None:
            pki = load_pki(certs)
            missing = [n for n in node_names(nodes) if n not in pki.servers]
            if missing:
                raise ValueError(f"{certs} has no certificate for {', '.join(missing)}")
        cluster = write_local_cluster(realm, out, nodes, pki,
                                      [client_port + i for i in range(nodes)], [cluster_port + i for i in range(nodes)])
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        _print_json({**cluster.to_json(), "creds_dir": str(realm.creds_dir)})
        return
    for n in cluster.nodes:
        typer.echo(f"{n.name}: {n.config}  (clients {n.url}, routes {n.cluster_port})  nats-server -c {n.config}")
    typer.echo(f"clients: GPUFLEET_NATS_URL={cluster.url} SSL_CERT_FILE={cluster.pki.ca_file} "
               f"GPUFLEET_CREDS={realm.creds_path('admin')} GPUFLEET_STREAM_REPLICAS={min(nodes, 3)}")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()

