"""`gpufleet bench history --events 100000,1000000`: what a restart costs as the log grows.

For each size, a log of that many events (bench replay's synthetic lifecycles: nodes, then jobs
submitted -> succeeded, a tenth of them gangs) is written to a fresh nats-server running the
generated authorization. Then, per service core, with the service's own identity, as a
restart would:

- `full_fold_s`: start with no snapshot: fold the whole log (the baseline, the old behaviour);
- `snapshot_start_s`: start again after the first stored its snapshot: restore it, fold the tail;
- the ratio of the two, the events each start folded, and the snapshot's size.

Then, as the admin: the view process's snapshots are built (`view_snapshots_s`, every
`--view-every` events), and `replay --seq` (`Fleet.state_at`) is timed at three random points
(seeded) with them and, at the same points, folding from sequence 1; `explain` of three random
jobs (it reads only the job's subjects and the commands of its window).

Figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufleet.bench_replay import _publish, synthetic_log
from gpufleet.shared.bus import Bus
from gpufleet.shared.runtime import ServiceRuntime

CORES = ("admission", "quota", "placer", "guardian", "billing", "telemetry")


def _core(name: str) -> Any:
    import argparse

    from gpufleet.services.registry import make_core

    return make_core(name, argparse.Namespace(config=None, sim_nodes=0))


async def _start(nats_url: str, creds: Path, name: str) -> tuple[ServiceRuntime[Any], float]:
    bus = await Bus.connect(nats_url, name=f"bench-{name}", creds=creds)
    rt: ServiceRuntime[Any] = ServiceRuntime(_core(name), bus)
    t0 = time.perf_counter()
    await rt.start()
    return rt, time.perf_counter() - t0


async def measure_size(events: int, cores: tuple[str, ...], progress: Callable[[str], None] | None) -> dict[str, Any]:
    from gpufleet.shared.authz import ADMIN, ensure_realm, nats_config, write_nats_config
    from gpufleet.shared.procs import free_port, start_nats, stop_process

    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-history-") as tmp:
        d = Path(tmp)
        realm = ensure_realm(d)
        port = free_port()
        conf = write_nats_config(d / "nats.conf", nats_config(d / "nats", port, realm, sync_interval="lazy"))
        proc = start_nats(d / "nats", port, config=conf, log_file=d / "nats.log")
        url = f"nats://127.0.0.1:{port}"
        try:
            admin = await Bus.connect(url, name="bench-history", creds=realm.creds_path(ADMIN))
            await admin.ensure_streams()
            envs = synthetic_log(events)
            if progress:
                progress(f"[{events:,}] writing {len(envs):,} events ...")
            await _publish(admin, envs, progress)
            head = await admin.last_seq()
            await admin.close()
            out: dict[str, Any] = {"events": head, "cores": {}}
            for name in cores:
                creds = realm.creds_path(f"svc-{name}")
                rt, full_s = await _start(url, creds, name)
                full_events = rt.last_fold.events
                await rt.flush_snapshot()
                size = len(rt._snap.blob) if rt._snap is not None else 0
                await rt.bus.close()
                rt2, snap_s = await _start(url, creds, name)
                row = {"full_fold_s": round(full_s, 3), "full_fold_events": full_events,
                       "snapshot_start_s": round(snap_s, 3), "snapshot_from_seq": rt2.last_fold.from_seq,
                       "tail_events": rt2.last_fold.events, "snapshot_bytes": size,
                       "speedup": round(full_s / max(snap_s, 1e-6), 1)}
                await rt2.bus.close()
                if rt2.last_fold.from_seq == 0:
                    raise RuntimeError(f"{name}: the restart did not start from its snapshot")
                out["cores"][name] = row
                if progress:
                    progress(f"[{events:,}] {name}: full fold {full_s:.2f}s, from snapshot {snap_s:.3f}s")
            out["replay"], out["explain"] = await _reads(url, realm.creds_path(ADMIN), realm.creds_path("svc-view"),
                                                         head, events, progress)
            return out
        finally:
            stop_process(proc)


async def _reads(url: str, admin_creds: Path, view_creds: Path, head: int, events: int,
                 progress: Callable[[str], None] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """replay at three random points, from view snapshots and from sequence 1; explain of three jobs."""
    import random

    from gpufleet.dashboard import Board
    from gpufleet.sdk import Fleet
    from gpufleet.viewsnap import EVERY, VIEW, ViewSnapshots, catch_up

    view = await Bus.connect(url, name="bench-view", creds=view_creds)
    every = min(EVERY, max(1000, head // 20))
    t0 = time.perf_counter()
    await catch_up(view, ViewSnapshots(view, view.creds.snapshot_key(VIEW) if view.creds else None), Board(), 0, every)
    built_s = time.perf_counter() - t0
    fleet = await Fleet.connect(nats_url=url, creds=str(admin_creds))
    try:
        rng = random.Random(f"history:{events}")
        points = sorted(rng.sample(range(1, head + 1), 3))
        rows = []
        for seq in points:
            t1 = time.perf_counter()
            doc = await fleet.state_at(until_seq=seq)
            snap_s = time.perf_counter() - t1
            t1 = time.perf_counter()
            await _full_state(fleet, seq)
            full_s = time.perf_counter() - t1
            rows.append({"seq": seq, "from_snapshot": doc["from_snapshot"], "snapshot_s": round(snap_s, 3),
                         "full_fold_s": round(full_s, 3), "jobs": len(doc["jobs"])})
            if progress:
                progress(f"[{events:,}] replay --seq {seq}: {snap_s:.2f}s from the view snapshot at "
                         f"{doc['from_snapshot']}, {full_s:.2f}s from seq 1")
        jobs = [e.job_id for _, e in await fleet.history("fleet.evt.*.job.*.succeeded", until_seq=min(head, 20_000))]
        explain = []
        for job_id in rng.sample([j for j in jobs if j], min(3, len(jobs))):
            t1 = time.perf_counter()
            ex = await fleet.explain(job_id)
            explain.append({"job_id": job_id, "s": round(time.perf_counter() - t1, 3),
                            "events": len(ex.history) if ex is not None else 0})
        return ({"view_snapshot_every": every, "view_snapshots_s": round(built_s, 2), "points": rows},
                {"jobs": explain})
    finally:
        await fleet.close()
        await view.close()


async def _full_state(fleet: Any, seq: int) -> Any:
    """The same state_at with no view snapshot (a fold from sequence 1)."""
    from gpufleet.dashboard import Board
    from gpufleet.viewsnap import fold_board

    board = Board()
    await fold_board(fleet.bus, board, until_seq=seq)
    return board.state()


def run(sizes: list[int], cores: tuple[str, ...] = CORES,
        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    runs = [asyncio.run(measure_size(n, cores, progress)) for n in sizes]
    doc: dict[str, Any] = {"sizes": runs}
    if len(runs) > 1:
        first, last = runs[0], runs[-1]
        doc["growth"] = {name: {
            "full_fold": round(last["cores"][name]["full_fold_s"] / max(first["cores"][name]["full_fold_s"], 1e-6), 2),
            "snapshot_start": round(last["cores"][name]["snapshot_start_s"]
                                    / max(first["cores"][name]["snapshot_start_s"], 1e-6), 2)}
            for name in cores}
    return doc
