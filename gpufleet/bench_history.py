"""`gpufleet bench history --events 100000,1000000`: what a restart costs as the log grows.

For each size, a log of that many events (bench replay's synthetic lifecycles: nodes, then jobs
submitted -> succeeded, a tenth of them gangs) is written to a fresh nats-server running the
generated authorization. Then, per service core, with the service's own identity, as a
restart would:

- `full_fold_s`: start with no snapshot: fold the whole log (the baseline, the old behaviour);
- `snapshot_start_s`: start again after the first stored its snapshot: restore it, fold the tail;
- the ratio of the two, the events each start folded, and the snapshot's size.

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
            return out
        finally:
            stop_process(proc)


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
