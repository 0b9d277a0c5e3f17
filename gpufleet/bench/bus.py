"""`gpufleet bench bus`: what a write costs nats-server, by fsync policy and by how it is sent.

A fresh nats-server per case (the embedded config: `sync_interval: always`, or lazy); N
`cmd.submit` envelopes written in chunks, pipelined (`Bus.publish_many` with batching off: an
ack each) or as atomic batches (`Bus.publish_batch`). Per case: the median time of one chunk,
events a second, and the server's CPU per event (from /proc). The crossover it shows is where
`ATOMIC_FROM` (shared/runtime/bus.py) comes from.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufleet.bench.e2e import _cpu_s
from gpufleet.sdk import new_job_id, submit_envelope
from gpufleet.shared.embedded.procs import start_nats, stop_process
from gpufleet.shared.runtime import bus as bus_mod
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.trust.authz import nats_config, write_nats_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _case(sync: str, mode: str, events: int, chunk: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-bus-") as tmp:
        d = Path(tmp)
        port = _free_port()
        conf = write_nats_config(d / "nats.conf", nats_config(d / "nats", port, None, sync_interval=sync))
        proc = start_nats(d / "nats", port, config=conf)
        try:
            bus = await Bus.connect(f"nats://127.0.0.1:{port}", name="bench-bus")
            await bus.ensure_streams()
            envs = [submit_envelope({"name": f"b{i}", "tenant": "t0", "resources": {"gpu": 1}}, new_job_id(),
                                    actor="bench") for i in range(events)]
            old, bus_mod.ATOMIC_FROM = bus_mod.ATOMIC_FROM, 0  # pipelined means pipelined here
            try:
                cpu0, times = _cpu_s(proc.pid), []
                t0 = time.perf_counter()
                for start in range(0, events, chunk):
                    part = envs[start:start + chunk]
                    t1 = time.perf_counter()
                    await (bus.publish_many(part) if mode == "pipelined" else bus.publish_batch(part))
                    times.append(time.perf_counter() - t1)
                wall = time.perf_counter() - t0
                server_s = _cpu_s(proc.pid) - cpu0
            finally:
                bus_mod.ATOMIC_FROM = old
            stored = int((await bus.js.stream_info("FLEET")).state.messages)
            await bus.close()
        finally:
            stop_process(proc)
    if stored != events:
        raise RuntimeError(f"{sync}/{mode}: {stored} of {events} events stored")
    return {"sync": sync, "mode": mode, "chunk": chunk, "events": events, "stored": stored,
            "chunk_ms_median": round(1000 * statistics.median(times), 2),
            "events_per_s": round(events / wall), "server_cpu_us_per_event": round(1e6 * server_s / events, 1)}


def run(events: int = 10_000, chunks: tuple[int, ...] = (2, 8, 32, 256), syncs: tuple[str, ...] = ("always", "lazy"),
        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    rows = []
    for sync in syncs:
        for chunk in chunks:
            for mode in ("pipelined", "batch"):
                n = min(events, max(chunk * 20, 200)) if chunk < 32 else events  # small chunks: fewer events
                row = asyncio.run(_case(sync, mode, n, chunk))
                rows.append(row)
                if progress:
                    progress(f"sync {sync:<6} {mode:<9} chunk {chunk:>4}: {row['chunk_ms_median']:>7.2f} ms a chunk, "
                             f"{row['events_per_s']:>6} events/s, server {row['server_cpu_us_per_event']} µs/event")
    return {"cases": rows, "atomic_from": bus_mod.ATOMIC_FROM, "cpus": os.cpu_count()}
