"""`gpufleet bench e2e`: the sustained submit -> placed rate of the whole mesh, and its latency.

A fresh embedded mesh (nats-server, the services as separate processes, optionally the
PostgreSQL read model) with N simulated nodes; M jobs are submitted as fast as the mesh takes
them (atomic batches of commands); a core-NATS subscription on `fleet.evt.*.job.*.placed`
timestamps every placement.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufleet.sdk import new_job_id, submit_envelope
from gpufleet.shared.runtime.bus import Bus

SUBMIT_BATCH = 500
GPU_MIX = (1, 1, 1, 2)  # per job, cycled: 1.25 GPUs on average


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _wait_nodes(bus: Bus, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = await bus.js.stream_info("FLEET", subjects_filter="fleet.evt.sys.node.*.registered")
        registered = len(info.state.subjects or {})
        if registered >= n:
            placer = await bus.js.consumer_info("FLEET", "placer")
            if placer.num_pending == 0 and placer.num_ack_pending == 0:
                return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{n} nodes not registered and folded by the placer in {timeout_s}s")


RATE_TICK_S = 0.01  # with --rate: a publish every 10 ms of what the rate allows by then


async def _drive(nats_url: str, sim_nodes: int, jobs: int, progress: Callable[[str], None] | None,
                 on_ready: Callable[[], None] | None = None, creds: Path | None = None,
                 rate: float | None = None, duration: str = "1h", until_ended: bool = False) -> dict[str, Any]:
    bus = await Bus.connect(nats_url, name="bench", creds=creds)
    await _wait_nodes(bus, sim_nodes, timeout_s=180)
    if on_ready:
        on_ready()
    placed_at: dict[str, float] = {}
    unschedulable: set[str] = set()
    queued: set[str] = set()  # waiting for quota, told so
    refused: dict[str, str] = {}  # job -> the code it was rejected or failed with (counted, never hidden)
    ended_at: dict[str, float] = {}  # with until_ended: placed jobs that then ended (succeeded, failed, cancelled)

    async def on_msg(msg: Any) -> None:
        job_id = msg.subject.split(".")[4]
        kind = msg.subject.rsplit(".", 1)[1]
        if kind == "placed":
            placed_at.setdefault(job_id, time.perf_counter())
        elif job_id in placed_at and kind in ("succeeded", "failed", "cancelled"):
            ended_at.setdefault(job_id, time.perf_counter())
        elif kind in ("succeeded", "cancelled"):
            pass  # the end of a job never placed in this run (none is): nothing to count
        elif kind == "unschedulable":
            unschedulable.add(job_id)
        elif kind == "queued":
            queued.add(job_id)
        else:  # rejected, failed (never fits)
            try:
                payload = json.loads(msg.data)["payload"]
                reasons = payload.get("reasons") or [payload.get("reason") or {}]
                refused[job_id] = f"{kind}:{reasons[0].get('code', '?')}"
            except (ValueError, KeyError, IndexError, AttributeError):
                refused[job_id] = f"{kind}:?"

    subs = [await bus.nc.subscribe(f"fleet.evt.*.job.*.{kind}", cb=on_msg)
            for kind in ("placed", "unschedulable", "queued", "rejected", "failed",
                         *(("succeeded", "cancelled") if until_ended else ()))]
    envs = []
    job_ids: list[str] = []
    for i in range(jobs):
        spec = {
            "name": f"bench-{i}", "tenant": f"team{i % 4}", "type": "batch",
            "resources": {"cpu": 1, "memory": "4Gi", "gpu": GPU_MIX[i % len(GPU_MIX)]},
            "sim": {"duration": duration},
        }
        job_ids.append(new_job_id())
        envs.append(submit_envelope(spec, job_ids[-1], actor="bench"))
    submitted_at: dict[str, float] = {}
    t0 = time.perf_counter()
    last_report = t0
    start = 0
    while start < jobs:
        now = time.perf_counter()
        if rate is None:  # as fast as the mesh takes them
            end = start + SUBMIT_BATCH
        else:  # a steady offered load: what the rate allows by now, every RATE_TICK_S
            end = max(start, min(jobs, int((now - t0) * rate) + 1))
            if end == start:
                await asyncio.sleep(RATE_TICK_S)
                continue
        chunk = envs[start:end]
        for job_id in job_ids[start:end]:
            submitted_at[job_id] = now
        # as the services publish (shared/runtime/bus.py): a few at a time pipelined, a burst as
        # atomic batches. A steady offer's 2-3 jobs every 10 ms as an atomic batch cost the server
        # ~900 us of CPU an event (`bench bus`), which no client of the mesh pays submitting one by one
        await bus.publish_many(chunk)
        start += len(chunk)
        if progress and now - last_report > 2:
            last_report = now
            progress(f"submitted {start}/{jobs}, placed {len(placed_at)}")
    t_submitted = time.perf_counter()
    idle_deadline = time.monotonic() + 60
    seen = -1

    def outcomes() -> set[str]:
        return placed_at.keys() | unschedulable | queued | refused.keys()

    while len(outcomes()) < jobs and time.monotonic() < idle_deadline:
        await asyncio.sleep(0.25)
        if len(placed_at) != seen:
            seen = len(placed_at)
            idle_deadline = time.monotonic() + 60
            if progress and time.perf_counter() - last_report > 2:
                last_report = time.perf_counter()
                progress(f"placed {seen}/{jobs}")
    t_placed = time.perf_counter()
    if until_ended:  # the whole life of every placed job: its run and its end are in the CPU counted
        idle_deadline = time.monotonic() + 60
        seen = -1
        while len(ended_at) < len(placed_at) and time.monotonic() < idle_deadline:
            await asyncio.sleep(0.25)
            if len(ended_at) != seen:
                seen = len(ended_at)
                idle_deadline = time.monotonic() + 60
                if progress and time.perf_counter() - last_report > 2:
                    last_report = time.perf_counter()
                    progress(f"ended {seen}/{len(placed_at)}")
    for sub in subs:
        await sub.unsubscribe()
    await bus.close()
    lat = [placed_at[j] - submitted_at[j] for j in placed_at if j in submitted_at]
    t_last = max(placed_at.values()) if placed_at else t0
    span = t_last - t0
    ended = {"ended": len(ended_at), "not_ended": len(placed_at) - len(ended_at),
             "ended_wall_s": round(max(ended_at.values(), default=t_placed) - t0, 2)} if until_ended else {}
    return {
        "sim_nodes": sim_nodes,
        "jobs": jobs,
        "placed": len(placed_at),
        "unschedulable": len(unschedulable - set(placed_at)),
        "queued": len(queued - set(placed_at) - unschedulable),
        # every job's outcome is counted: refused work is reported, and a job with none fails the run
        "refused": len(set(refused) - set(placed_at)),
        "refused_by_code": dict(Counter(c for j, c in refused.items() if j not in placed_at)),
        "unaccounted": jobs - len(outcomes()),
        "offered_rate_jobs_s": rate,
        "submit_rate_jobs_s": round(jobs / max(1e-9, t_submitted - t0), 1),
        "placed_rate_jobs_s": round(len(placed_at) / max(1e-9, span), 1),
        "latency_p50_ms": round(_pct(lat, 0.50) * 1000, 1),
        "latency_p99_ms": round(_pct(lat, 0.99) * 1000, 1),
        "latency_mean_ms": round(statistics.fmean(lat) * 1000, 1) if lat else None,
        "wall_s": round(span, 2),
        "cpus": os.cpu_count(),
        **ended,
    }


def _cpu_s(pid: int, children: bool = False) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc); with `children`, those of
    its living children and of the ones it has reaped too (PostgreSQL's backends: one per connection)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])
        if children:
            ticks += int(fields[13]) + int(fields[14])  # reaped children
            for stat in Path("/proc").glob("[0-9]*/stat"):
                try:
                    f = stat.read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue  # gone meanwhile
                if f[1] == str(pid):
                    ticks += int(f[11]) + int(f[12])
        return round(ticks / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, IndexError, ValueError):
        return float("nan")


def _limits(config: Path | None = None) -> str:
    """What an open cluster still refuses: each tenant's default policy (its refusals are counted)."""
    from gpufleet.shared.contract.clusterconfig import TenantPolicy, load_config

    if config is not None:
        c = load_config(config)
        p = c.defaults
        return (f"config {config}: tenants {sorted(c.tenants) or 'none listed'}, open {c.open_tenants}; an unlisted "
                f"tenant's policy {p.submit_rate_per_s:g} submits/s, burst {p.submit_burst}, {p.max_pending_jobs} pending: "
                "what it refuses is counted")
    p = TenantPolicy()
    return (f"open cluster: no tenants or queues configured; each tenant has the default policy "
            f"({p.submit_rate_per_s:g} submits/s, burst {p.submit_burst}, {p.max_pending_jobs} pending): "
            "what it refuses is counted")


def run_e2e(sim_nodes: int = 5000, jobs: int = 20000, postgres: bool = True,
            progress: Callable[[str], None] | None = None, layouts: tuple[str, ...] = ("grouped", "separate"),
            syncs: tuple[str, ...] = ("always",), rate: float | None = None, nats_cluster: int = 1,
            instances: int = 1, duration: str = "1h", until_ended: bool = False,
            config: Path | None = None) -> dict[str, Any]:
    """Run the bench once per layout, the first being the one reported; the others are baselines.
    With several `syncs` (JetStream fsync policies: `always`, or `lazy` for the server's default),
    the first layout also runs under each further one, as a baseline of the same run. With `rate`
    the jobs are offered at that many a second instead of as fast as the mesh takes them. Each job runs
    `duration` on its sim node; with `until_ended` the run (and the CPU it counts) lasts until every
    placed job has ended, so that the cost per job is its whole life's, whatever the run's length.
    `config`: the mesh's cluster config (None: the embedded default, an open cluster)."""
    settings = {"sim_nodes": sim_nodes, "jobs": jobs, "postgres": postgres, "layouts": list(layouts),
                "nats_sync": list(syncs), "offered_rate_jobs_s": rate, "submit_batch": SUBMIT_BATCH if rate is None else None,
                "service_batch": int(os.environ.get("GPUFLEET_BATCH", "256")), "cpus": os.cpu_count(),
                "nats_cluster": nats_cluster, "instances": instances, "sim_duration": duration,
                "until_ended": until_ended, "cluster_config": str(config) if config else None,
                "limits": _limits(config)}
    if progress:
        progress(f"config: {json.dumps(settings)}")
    layout_run = functools.partial(run_layout, sim_nodes, jobs, postgres, progress=progress, rate=rate,
                                   nats_cluster=nats_cluster, instances=instances, duration=duration,
                                   until_ended=until_ended, config=config)
    runs = {layout: _with_sync(syncs[0], functools.partial(layout_run, layout=layout)) for layout in layouts}
    main = dict(runs[layouts[0]])
    main["config"] = settings
    main["layout"] = layouts[0]
    main["nats_sync"] = syncs[0]
    for layout in layouts[1:]:
        base = runs[layout]
        main[f"baseline_{layout}"] = base
        main[f"ratio_vs_{layout}"] = round(main["placed_rate_jobs_s"] / max(1e-9, base["placed_rate_jobs_s"]), 2)
    for sync in syncs[1:]:
        base = _with_sync(sync, functools.partial(layout_run, layout=layouts[0]))
        main[f"baseline_sync_{sync}"] = base
        main[f"ratio_vs_sync_{sync}"] = round(main["placed_rate_jobs_s"] / max(1e-9, base["placed_rate_jobs_s"]), 2)
    return main


def _with_sync(sync: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run with the embedded nats-server's fsync policy `sync` (shared/trust/authz.py nats_config)."""
    old = os.environ.get("GPUFLEET_NATS_SYNC")
    os.environ["GPUFLEET_NATS_SYNC"] = sync
    try:
        return run()
    finally:
        if old is None:
            os.environ.pop("GPUFLEET_NATS_SYNC", None)
        else:
            os.environ["GPUFLEET_NATS_SYNC"] = old


def run_layout(sim_nodes: int, jobs: int, postgres: bool, layout: str,
               progress: Callable[[str], None] | None = None, rate: float | None = None, nats_cluster: int = 1,
               instances: int = 1, duration: str = "1h", until_ended: bool = False,
               config: Path | None = None) -> dict[str, Any]:
    from gpufleet.mesh import MeshOptions, Supervisor, wait_services_ready

    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        stats_dir = Path(tmp) / "stats"
        stats_dir.mkdir()
        old_stats = os.environ.get("GPUFLEET_STATS_DIR")
        os.environ["GPUFLEET_STATS_DIR"] = str(stats_dir)  # each service's counters, written at its stop
        sup = Supervisor(MeshOptions(Path(tmp), sim_nodes=sim_nodes, postgres=postgres, log_level="WARNING",
                                     layout=layout, nats_cluster=nats_cluster, instances=instances, config=config))
        result: dict[str, Any] = {}
        try:
            sup.start_infra()
            sup.start_services()
            wait_services_ready(sup.nats_url, timeout_s=120, layout=layout, data_dir=Path(tmp))
            if progress:
                progress(f"[{layout}] mesh up with {sim_nodes} sim nodes; registering")
            pids = {name: c.proc.pid for name, c in sup.children.items() if c.proc}
            servers = [n["proc"] for n in sup.cluster if n.get("proc") is not None] or (
                [sup.nats_proc] if sup.nats_proc else [])
            for i, proc in enumerate(servers):  # every server of a cluster counts
                pids["nats-server" if len(servers) == 1 else f"nats-server-{i + 1}"] = proc.pid
            pg_pid = sup.pg.running_pid() if sup.pg is not None else None
            before: dict[str, float] = {}

            def cpu_now() -> dict[str, float]:
                # (with their children: a large rollback point is pickled by a forked child)
                now = {name: _cpu_s(pid, children=not name.startswith("nats-server")) for name, pid in pids.items()}
                if pg_pid:  # PostgreSQL: the postmaster and its backends (the read model's writes)
                    now["postgres"] = _cpu_s(pg_pid, children=True)
                return now

            def ready() -> None:  # CPU used by start-up and node registration is not the run's
                before.update(cpu_now())

            result = asyncio.run(_drive(sup.nats_url, sim_nodes, jobs, progress, ready,
                                        creds=sup.realm.creds_path("admin") if sup.realm else None, rate=rate,
                                        duration=duration, until_ended=until_ended))
            result["cpu_us_per_job"] = {}  # filled below, from the CPU seconds
            result["postgres"] = postgres
            result["service_restarts"] = sum(c.restarts for c in sup.children.values())
            # CPU seconds each process spent from the first submit to the end of the run
            result["cpu_s"] = {name: round(s - before.get(name, 0.0), 2) for name, s in cpu_now().items()}
            # the budget table's unit: CPU-µs each process spent per submitted job
            result["cpu_us_per_job"] = {name: round(1e6 * s / max(1, jobs)) for name, s in result["cpu_s"].items()}
            result["cpu_us_per_job"]["total"] = round(1e6 * sum(result["cpu_s"].values()) / max(1, jobs))
        finally:
            sup.stop_all()
            if old_stats is None:
                os.environ.pop("GPUFLEET_STATS_DIR", None)
            else:
                os.environ["GPUFLEET_STATS_DIR"] = old_stats
        stats = {f.stem: json.loads(f.read_text()) for f in sorted(stats_dir.glob("*.json"))}
        # lost compare-and-sets (two placers side by side, or a placer racing a preemption) and refolds
        result["cas_conflicts"] = {actor: st["cas_conflicts"] for actor, st in stats.items() if st.get("cas_conflicts")}
        result["cas_conflicts_total"] = sum(st.get("cas_conflicts", 0) for st in stats.values())
        result["refolds"] = {actor: st["refolds"] for actor, st in stats.items() if st.get("refolds", 0) > 1}
        result["stats_from"] = sorted(stats)  # the runtimes that reported (every one that stopped cleanly)
        return result
