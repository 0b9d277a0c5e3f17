"""`bench ...`: the benchmarks; figures go to docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpufleet.cli.common import (
    DataDir,
    JsonOut,
    _print_json,
    _steps_bar,
    app,
)

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks; figures go to docs/benchmarks.md.")
app.add_typer(bench_app, name="bench")


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
    rate: Annotated[float | None, typer.Option(
        help="offer this many jobs a second, steadily (the latency of a loaded mesh), instead of as fast as it takes them")] = None,
    nats_cluster: Annotated[int, typer.Option(help="nats-servers: 1, or a JetStream cluster of 3 (FLEET at R3)")] = 1,
    instances: Annotated[int, typer.Option(
        help="2: every service twice (separate layout): placers side by side, their lost compare-and-sets counted")] = 1,
    duration: Annotated[str, typer.Option(help="how long each job runs on its sim node (e.g. 30s, 1h)")] = "1h",
    until_ended: Annotated[bool, typer.Option(
        "--until-ended", help="run until every placed job has ended: the CPU per job is its whole life's "
                              "(compare runs of different lengths; give a --duration the fleet can turn over)")] = False,
    config: Annotated[Path | None, typer.Option(
        help="the mesh's cluster config (default: the embedded default, an open cluster whose tenants get the "
             "default policy: its rate limit refuses part of a burst, counted)")] = None,
) -> None:
    """Submit jobs as fast as the mesh takes them (or at --rate); report submit->placed rate and latency."""
    from gpufleet.bench.e2e import run_e2e

    if rate is not None and rate <= 0:
        typer.echo("error: --rate: jobs a second, above 0", err=True)
        raise typer.Exit(2)
    from gpufleet.shared.contract.spec import parse_duration_s

    if config is not None and not config.is_file():
        typer.echo(f"error: --config: no such file {config}", err=True)
        raise typer.Exit(2)

    try:
        if parse_duration_s(duration) <= 0:
            raise ValueError("must be above 0")
    except ValueError as e:
        typer.echo(f"error: --duration: {e}", err=True)
        raise typer.Exit(2) from None
    syncs = tuple(x.strip() for x in nats_sync.split(",") if x.strip())
    if not syncs or any(x not in ("always", "lazy") for x in syncs):
        typer.echo("error: --nats-sync: a list of always / lazy", err=True)
        raise typer.Exit(2)
    result = run_e2e(sim_nodes=sim_nodes, jobs=jobs_n, postgres=postgres,
                     progress=None if as_json else (lambda s: typer.echo(s, err=True)),
                     layouts=tuple(x.strip() for x in layouts.split(",") if x.strip()), syncs=syncs, rate=rate,
                     nats_cluster=nats_cluster, instances=instances, duration=duration, until_ended=until_ended,
                     config=config)
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


@bench_app.command("bus")
def bench_bus(
    events: Annotated[int, typer.Option(help="events per case (chunks under 32: fewer)")] = 10_000,
    chunks: Annotated[str, typer.Option(help="events per write, comma-separated")] = "2,8,32,256",
    nats_sync: Annotated[str, typer.Option(help="fsync policies: always, lazy")] = "always,lazy",
    as_json: JsonOut = False,
) -> None:
    """What a write costs nats-server: pipelined vs atomic batches, by fsync policy."""
    from gpufleet.bench.bus import run

    doc = run(events, tuple(int(x) for x in chunks.split(",") if x.strip()),
              tuple(x.strip() for x in nats_sync.split(",") if x.strip()),
              progress=None if as_json else (lambda s: typer.echo(s, err=True)))
    if as_json:
        _print_json(doc)
    else:
        typer.echo(f"atomic batches from {doc['atomic_from']} events (GPUFLEET_ATOMIC_FROM)")


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
    policies: Annotated[str | None, typer.Option(
        help="random,dotprod,clustering,packing,bestfit,fgd,fragaware,leastallocated,default "
             "(default: bestfit,fgd,fragaware; with --dynamic: leastallocated,bestfit,fgd,fragaware)")] = None,
    seeds: Annotated[str | None, typer.Option(help="e.g. 42-51 or 42,43 (default: 42-51; with --dynamic: 42-44)")] = None,
    published: Annotated[Path | None, typer.Option(help="folder of the published results (fgd-expected)")] = None,
    plot: Annotated[Path | None, typer.Option(help="write the allocation curves (--dynamic: over time, and the waits) to this PNG")] = None,
    dynamic: Annotated[bool, typer.Option(
        "--dynamic", help="pods arrive at their creation time and leave after their run time: waits and "
                          "allocation over time, per policy")] = False,
    tune: Annotated[float, typer.Option(help="--dynamic: pods drawn from the trace until the GPU asked is this "
                                             "multiple of the cluster's")] = 2.0,
    compress: Annotated[float, typer.Option(help="--dynamic: arrivals this many times closer together "
                                                 "(run times unchanged)")] = 3000.0,
    drain: Annotated[str | None, typer.Option(help="--dynamic: how long the cluster runs after the last arrival "
                                                   "(default: a tenth of the arrival window)")] = None,
    vary: Annotated[str | None, typer.Option(
        "--variant", help="a CPU- or GPU-heavier workload of the same family: cpu-only=F (the CPU-only pods "
                          "resampled to F times their number) or cpu-per-gpu=F (each GPU pod asks F times its CPU)")] = None,
    as_json: JsonOut = False,
) -> None:
    """Replay an Alibaba GPU trace through the placer's framework, as the FGD paper's simulator does:
    GPU allocation ratio at 130 % arrived GPU, fragmentation at 80 %, side by side with the
    published numbers. With --dynamic, pods also leave: waits and allocation over time."""
    from gpufleet.bench.placement import bench, write_plot
    from gpufleet.bench.placement import published as published_results

    files = sorted(pods.glob("openb_pod_list_*.csv")) if pods.is_dir() else [pods]
    if not files:
        typer.echo(f"error: no pod lists in {pods}", err=True)
        raise typer.Exit(2)
    if not nodes.exists():
        typer.echo(f"error: --nodes: {nodes} does not exist", err=True)
        raise typer.Exit(2)
    if policies is None:
        policies = "leastallocated,bestfit,fgd,fragaware" if dynamic else "bestfit,fgd,fragaware"
    if seeds is None:
        seeds = "42-44" if dynamic else "42-51"
    names = [p.strip() for p in policies.split(",") if p.strip()]
    from gpufleet.services.placer.framework import profiles

    unknown = [n for n in names if n not in profiles()]
    if unknown:
        typer.echo(f"error: --policies: unknown {', '.join(unknown)} (one of {', '.join(profiles())})", err=True)
        raise typer.Exit(2)
    variant_ = None
    if vary is not None:
        from gpufleet.bench.placement import VARIANTS

        kind, _, factor = vary.partition("=")
        try:
            variant_ = (kind.strip(), float(factor))
            if variant_[0] not in VARIANTS or variant_[1] < 0:
                raise ValueError
        except ValueError:
            typer.echo(f"error: --variant: KIND=F with KIND one of {', '.join(VARIANTS)} and F >= 0, got {vary!r}",
                       err=True)
            raise typer.Exit(2) from None
        if dynamic:
            typer.echo("error: --variant: for the static experiment only (--dynamic has --tune)", err=True)
            raise typer.Exit(2)
    if dynamic:
        _bench_dynamic(files, nodes, names, _seeds(seeds), tune, compress, drain, plot, as_json)
        return
    docs = []
    runs = len(files) * len(names) * len(_seeds(seeds))
    done = [0]
    with _steps_bar("placement runs") as bar:
        def step(message: str) -> None:
            if " seed " in message:  # one (workload, policy, seed) run finished
                done[0] += 1
            bar(done[0], runs, message)

        for f in files:
            doc = bench(f, nodes, names, _seeds(seeds), progress=step, vary=variant_)
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


def _bench_dynamic(files: list[Path], nodes: Path, names: list[str], seeds: list[int], tune: float,
                   compress: float, drain: str | None, plot: Path | None, as_json: bool) -> None:
    from gpufleet.bench.dynamic import bench_dynamic, write_dynamic_plot
    from gpufleet.shared.contract.spec import parse_duration_s

    if "clustering" in names:
        typer.echo("error: --policies: clustering keeps per-node tags that never forget a pod that left; "
                   "it has no --dynamic form", err=True)
        raise typer.Exit(2)
    for flag, v in (("--tune", tune), ("--compress", compress)):
        if not v > 0:
            typer.echo(f"error: {flag}: must be above 0, got {v}", err=True)
            raise typer.Exit(2)
    drain_s = None
    if drain is not None:
        try:
            drain_s = float(parse_duration_s(drain))
        except ValueError as e:
            typer.echo(f"error: --drain: {e}", err=True)
            raise typer.Exit(2) from None
    docs = []
    runs = len(files) * len(names) * len(seeds)
    done = [0]
    with _steps_bar("dynamic placement runs") as bar:
        def step(message: str) -> None:
            done[0] += 1
            bar(done[0], runs, message)

        for f in files:
            docs.append(bench_dynamic(f, nodes, names, seeds, tune=tune, compress=compress, drain_s=drain_s,
                                      progress=step))
    if plot is not None:
        write_dynamic_plot(docs[0], plot)
    if as_json:
        _print_json(docs[0] if len(docs) == 1 else {"workloads": docs})
        return
    for doc in docs:
        typer.echo(f"{doc['workload']} (dynamic): {doc['nodes']} nodes, {doc['gpus']} GPUs, {doc['pods']} pods "
                   f"(trace {doc['trace_pods']}, tune {doc['tune']}), arrivals {doc['compress']:g}x closer: "
                   f"window {doc['window_s'] / 3600:.2f} h + drain {doc['drain_s'] / 60:.1f} min, demand peak "
                   f"{doc['demand_peak']:.2f}x / mean {doc['demand_mean']:.2f}x, seeds {doc['seeds'][0]}-{doc['seeds'][-1]}")
        typer.echo(f"  {'policy':<15}{'wait mean':>10}{'p50':>7}{'p95':>8}{'GPU-wtd':>9}{'waited':>8}"
                   f"{'never ran':>10}{'alloc %':>9}{'while waiting':>14}{'s/seed':>8}")
        for name, r in doc["policies"].items():
            typer.echo(f"  {name:<15}{r['wait_mean_s']:>9.1f}s{r['wait_p50_s']:>6.0f}s{r['wait_p95_s']:>7.0f}s"
                       f"{r['wait_gpu_weighted_s']:>8.1f}s{r['waited']:>8.0f}{r['never_ran']:>10.1f}"
                       f"{r['alloc_mean']:>9.2f}{r['alloc_while_waiting']:>14.2f}{r['seconds_per_seed']:>8.1f}")
        typer.echo("  mean wait (never ran) by pod size:")
        for name, r in doc["policies"].items():
            sizes = sorted(r["by_size"].items(), key=lambda kv: (kv[0] != "cpu", kv[0] != "share",
                                                                 int(kv[0].split()[0]) if kv[0][0].isdigit() else 0))
            typer.echo(f"  {name:<15}" + "  ".join(f"{k} {v['wait_mean_s']:.0f}s ({v['never_ran']:g})" for k, v in sizes))


@bench_app.command("history")
def bench_history(
    events: Annotated[str, typer.Option(help="log sizes, comma-separated (100000,1000000)")] = "100000",
    services: Annotated[str, typer.Option(help="the service cores to restart")] = "admission,quota,placer,guardian,billing,telemetry",
    pending: Annotated[str | None, typer.Option(
        help="instead: a backlog of this many waiting jobs (1000000), folded by every core in one process: "
             "memory per job and the cost of a decision against 1,000")] = None,
    nodes: Annotated[int, typer.Option(help="the fleet's size (fixed: the history grows, the cluster does not)")] = 300,
    job_gap_s: Annotated[float, typer.Option(help="log time between jobs (10 s: 14k jobs span 40 h, past the "
                                                  "24 h window in which ended jobs are remembered)")] = 10.0,
    as_json: JsonOut = False,
) -> None:
    """Restart cost as the log grows: each core's full fold beside its start from a snapshot (+ tail),
    replay at three points from view snapshots, explain; or, with --pending, a deep backlog."""
    from gpufleet.bench.history import run as run_history

    try:
        sizes = [int(x.replace("_", "")) for x in (pending or events).split(",") if x.strip()]
    except ValueError:
        typer.echo("error: --events / --pending: comma-separated counts, e.g. 100000,1000000", err=True)
        raise typer.Exit(2) from None
    if pending is not None:
        from gpufleet.bench.history import pending as run_pending

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
                      progress=None if as_json else (lambda s: typer.echo(s, err=True)), nodes=nodes, job_gap_s=job_gap_s)
    if as_json:
        _print_json(doc)
        return
    for size in doc["sizes"]:
        typer.echo(f"{size['events']:,} events")
        for name, row in size["cores"].items():
            typer.echo(f"  {name:<11} full fold {row['full_fold_s']:>7.2f} s ({row['full_fold_events']:,} events)   "
                       f"from snapshot {row['snapshot_start_s']:>6.3f} s (+{row['tail_events']} events, "
                       f"{row['snapshot_bytes'] / 1e6:.2f} MB stored, state {row['state_bytes'] / 1e6:.2f} MB)   "
                       f"{row['speedup']}x")
        rp = size.get("replay", {})
        for p in rp.get("points", []):
            typer.echo(f"  replay --seq {p['seq']:<9,} {p['snapshot_s']:>6.2f} s from the view snapshot at "
                       f"{p['from_snapshot']:,}   {p['full_fold_s']:>6.2f} s from seq 1")
        if "all_rows_s" in rp:
            typer.echo(f"  replay --all          {rp['all_rows_s']:>6.2f} s ({rp['all_rows']:,} rows, ended jobs too)")
        for j in size.get("explain", {}).get("jobs", []):
            typer.echo(f"  explain {j['job_id']}: {j['s']:.3f} s ({j['events']} events)")
    for name, g in doc.get("growth", {}).items():
        if isinstance(g, dict):
            typer.echo(f"  growth {name}: full fold {g['full_fold']}x, snapshot start {g['snapshot_start']}x, "
                       f"state {g['state_bytes']}x")
        else:
            typer.echo(f"  growth {name}: {g}x")


@bench_app.command("replay")
def bench_replay(
    events: Annotated[int, typer.Option(help="events in the synthetic log to build")] = 100_000,
    repeat: Annotated[int, typer.Option(help="rounds; the median is reported")] = 5,
    mesh_log: Annotated[bool, typer.Option("--mesh-log", help="read the running mesh's log instead (--data-dir)")] = False,
    data_dir: DataDir = None,
    as_json: JsonOut = False,
) -> None:
    """Fold speed of the log (what `replay` does) beside the raw JetStream read rate, same run."""
    from gpufleet.bench.replay import run
    from gpufleet.shared.contract.config import resolve_nats_url

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
    from gpufleet.bench.placement import decide_speed

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
    from gpufleet.bench.billing import run as run_billing

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




@bench_app.command("chaos")
def bench_chaos(
    seed: Annotated[int, typer.Option(help="draws the workload and the faults' order")] = 1,
    jobs: Annotated[int, typer.Option(help="jobs in the workload")] = 300,
    sim_nodes: Annotated[int, typer.Option(help="simulated nodes")] = 8,
    extra_faults: Annotated[int, typer.Option(help="faults beyond one of each kind")] = 3,
    keep: Annotated[Path | None, typer.Option(help="keep the mesh's data dir here (logs, stores) for a "
                                                   "review of the run: the log replays after it")] = None,
    as_json: JsonOut = False,
) -> None:
    """A seeded fault campaign on a 3-node NATS cluster with every service twice: kill -9 of
    service instances, NATS nodes (the stream's leader too) and PostgreSQL, a frozen node agent,
    a node lost past its heartbeat lease, a node agent cut off from NATS past it, the whole fleet
    silent at once (no node may be lost for it), NATS partitions (network namespaces, root);
    then every job ended once, the audit, replay = read model, each run billed once. Exit 1 if not.
    Progress goes to stderr, with --json too."""
    from gpufleet.bench.chaos import run as run_chaos

    doc = run_chaos(seed, jobs, sim_nodes=sim_nodes, extra_faults=extra_faults, keep=keep,
                    progress=lambda s: typer.echo(s, err=True))
    if as_json:
        _print_json(doc)
    else:
        typer.echo(f"seed {doc['seed']}: {doc['submitted']} jobs acknowledged ({doc['not_acknowledged']} not), "
                   f"ended {doc['ended_by_type']}; mesh up in {doc['mesh_start_s']} s")
        for f in doc["faults"]:
            rec = f"placed a probe {f['recovery_s']} s later" if f["recovery_s"] is not None else "probe NOT placed"
            typer.echo(f"  {f['at_s']:>6.1f}s {f['kind']:<17} {f['hit']:<40} {rec}")
        typer.echo(f"not ended {doc['not_ended_count']}, ended twice {len(doc['ended_twice'])}, audit "
                   f"{'ok' if doc['audit_ok'] else 'FAILED'}, replay = read model: {doc['replay_equals_read_model']}, "
                   f"runs started {doc['runs_started']}, charged twice {len(doc['runs_charged_twice'])}, "
                   f"not charged {doc['runs_not_charged']}, nodes declared lost {doc['nodes_lost']} "
                   f"({len(doc['nodes_lost_elsewhere'])} outside a lose_node fault)")
    if not doc["ok"]:
        raise typer.Exit(1)
