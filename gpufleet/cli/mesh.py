"""`up`, `down`, `status`: the embedded mesh."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from gpufleet.cli.common import (
    DataDir,
    JsonOut,
    _print_json,
    _run,
    _with_fleet,
    app,
)
from gpufleet.shared.contract.config import data_dir as resolve_data_dir
from gpufleet.shared.contract.errors import SpecError


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
    nats_netns: Annotated[bool, typer.Option("--nats-netns", help="with --nats-cluster: each nats-server in a network "
                                             "namespace of its own (root), so that bench chaos can partition them")] = False,
    sim_executors: Annotated[int, typer.Option(help="sim: the sim nodes split over this many executor processes "
                                                    "(as real nodes each run their own)")] = 1,
) -> None:
    """Start nats-server, PostgreSQL, the eight services and N simulated nodes (or this machine as a node)."""
    from gpufleet.mesh import MeshOptions, Supervisor, running_supervisor, up_detached

    ddir = resolve_data_dir(data_dir)
    running = running_supervisor(ddir)
    if running:
        typer.echo(f"already running in {ddir} (supervisor pid {running['supervisor_pid']}, NATS {running['nats_url']})", err=True)
        raise typer.Exit(1)
    if config is not None:
        from gpufleet.shared.contract.clusterconfig import load_config

        try:
            load_config(config)
        except SpecError as exc:
            typer.echo(f"error: invalid cluster config {config}: {exc}", err=True)
            raise typer.Exit(2) from None
    try:
        from gpufleet.shared.node.cluster import parse_mix

        parse_mix(sim_mix)
    except ValueError as exc:
        typer.echo(f"error: --sim-mix: {exc}", err=True)
        raise typer.Exit(2) from None
    if driver not in ("sim", "process", "docker"):
        typer.echo(f"error: --driver must be sim, process or docker, not {driver!r}", err=True)
        raise typer.Exit(2)
    if retention:
        from gpufleet.shared.runtime.archive import retention_s

        try:
            retention_s(retention)
        except (SpecError, ValueError) as exc:
            typer.echo(f"error: --retention: {exc}", err=True)
            raise typer.Exit(2) from None
    if instances not in (1, 2) or (instances == 2 and layout != "separate"):
        typer.echo("error: --instances: 1, or 2 with --layout separate (each service its own processes)", err=True)
        raise typer.Exit(2)
    if not 1 <= sim_executors <= max(1, sim_nodes) or (sim_executors > 1 and driver != "sim"):
        typer.echo(f"error: --sim-executors: 1 to --sim-nodes ({sim_nodes}) executors, with the sim driver", err=True)
        raise typer.Exit(2)
    if nats_cluster not in (1, 3, 5):
        typer.echo(f"error: --nats-cluster: 1, 3 or 5 servers (a quorum needs an odd number), not {nats_cluster}", err=True)
        raise typer.Exit(2)
    if nats_netns:
        from gpufleet.shared.embedded import netns

        why = "it partitions a cluster: give --nats-cluster 3 or 5" if nats_cluster == 1 else netns.available()
        if why is not None:
            typer.echo(f"error: --nats-netns: {why}", err=True)
            raise typer.Exit(2)
    opts = MeshOptions(ddir, sim_nodes, nats_port, pg_port, postgres, layout=layout, config=config, sim_mix=sim_mix,
                       driver=driver, retention=retention, nats_cluster=nats_cluster, instances=instances,
                       nats_netns=nats_netns, sim_executors=sim_executors)
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
    from gpufleet.shared.trust.authz import ADMIN, Realm
    from gpufleet.tools.dashboard import TOKENS_FILE, ensure_admin_token

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
    from gpufleet.shared.embedded.procs import pid_alive

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
    from gpufleet.shared.contract.events import STREAM

    info = await fleet.bus.js.stream_info(STREAM)
    c, st = info.config, info.state
    limits = {k: v for k, v in (("max_bytes", c.max_bytes), ("max_msgs", c.max_msgs), ("max_age_s", c.max_age))
              if v not in (None, -1, 0)}
    desc = ", ".join(f"{k} {v}" for k, v in limits.items()) or "none (keeps everything)"
    discard = getattr(c.discard, "value", c.discard)
    from gpufleet.shared.runtime.archive import Archive, archive_dir, retention_s

    root = archive_dir()
    segs = Archive(root).segments() if root is not None and root.is_dir() else []
    keep = retention_s()
    return {"first_seq": st.first_seq, "last_seq": st.last_seq, "messages": st.messages, "bytes": st.bytes,
            "limits": f"{desc}; at a limit: {'refuse new events' if discard == 'new' else 'drop the oldest'}",
            "deny_purge": bool(c.deny_purge), "deny_delete": bool(c.deny_delete),
            "archive": {"retention_s": keep, "segments": len(segs), "archived_to": segs[-1].last if segs else 0,
                        "dir": str(root) if root is not None else None}}


