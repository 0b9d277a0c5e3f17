"""`gpufleet bench replay --events N`: how fast the log folds back into the cluster state.

Builds a log of N events in a fresh nats-server (registered nodes, then job lifecycles:
submitted, admitted, quota reserved, placed, started, exited, succeeded; a tenth of the jobs
gangs of two), or reads the log of a running mesh (`--data-dir`). Then, in the same run and on
the same log, it measures:

- `raw_read`: JetStream's own read rate — fetching every message, nothing parsed (the baseline);
- `parse`: the same read, each message parsed and validated into its envelope;
- `fold`: read, parse and fold into the `ClusterView` — what `gpufleet replay` does.

Each is repeated (`--repeat`) and the median is reported, with the ratio of each rate to the
raw read rate of the same run.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufleet.shared.contract.events import (
    SYS_TENANT,
    Envelope,
    JobAdmitted,
    JobExited,
    JobPlaced,
    JobQuotaReserved,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NodeRegistered,
    ReplicaAllocation,
    parse_envelope,
    utc,
)
from gpufleet.shared.contract.ids import derive_id
from gpufleet.shared.contract.spec import parse_spec
from gpufleet.shared.node.cluster import shape_inventory
from gpufleet.shared.read.view import ClusterView, apply
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.log import read_stream
from gpufleet.shared.trust.authz import owner_actor

T0 = 1_767_225_600.0  # 2026-01-01, the synthetic log's clock
JOB_EVENTS = 7


def synthetic_log(events: int, nodes: int | None = None, job_gap_s: float = 0.01) -> list[Envelope]:
    """About `events` envelopes: nodes first (`nodes`, default one per 50 jobs), then whole job
    lifecycles, one every `job_gap_s` of log time."""
    jobs = max(1, events // JOB_EVENTS)
    n_nodes = nodes if nodes is not None else max(2, jobs // 50)
    out: list[Envelope] = []
    t = T0

    def env(payload: Any, tenant: str, key: str, job_id: str | None = None) -> Envelope:
        return Envelope(event_id=derive_id(key, payload.type, time_ms=int(t * 1000)), type=payload.type,
                        occurred_at=utc(t), tenant=tenant, actor=owner_actor(payload.type), correlation_id=job_id,
                        payload=payload)

    for i in range(n_nodes):
        node_id = f"n{i:05d}"
        out.append(env(NodeRegistered(node_id=node_id, inventory=shape_inventory("h100x8", node_id)),
                       SYS_TENANT, node_id))
    specs = [parse_spec({"name": "bench", "tenant": f"t{k}", "resources": {"gpu": 2, "cpu": 4, "memory": "16Gi"},
                         "replicas": 1 + (k == 0)}) for k in range(10)]
    for j in range(jobs):
        spec = specs[j % 10]
        job_id = f"job{j:07d}"
        node = j % n_nodes
        gpus = (2 * (j // n_nodes % 4), 2 * (j // n_nodes % 4) + 1)
        allocs = tuple(ReplicaAllocation(replica=r, node_id=f"n{(node + r) % n_nodes:05d}", gpu_indices=gpus,
                                         cpu_milli=4000, memory_mib=16384) for r in range(spec.replicas))
        t += job_gap_s
        for payload in (JobSubmitted(job_id=job_id, spec=spec), JobAdmitted(job_id=job_id),
                        JobQuotaReserved(job_id=job_id, queue="default", cpu_milli=4000, memory_mib=16384,
                                         gpus=spec.gpus_total),
                        JobPlaced(job_id=job_id, allocations=allocs),
                        *(JobStarted(job_id=job_id, node_id=a.node_id, replica=a.replica) for a in allocs[:1]),
                        *(JobExited(job_id=job_id, node_id=a.node_id, replica=a.replica, exit_code=0,
                                    runtime_s=60.0) for a in allocs[:1]),
                        JobSucceeded(job_id=job_id)):
            out.append(env(payload, spec.tenant, job_id, job_id))
        if len(out) >= events:
            break
    return out[:max(events, n_nodes + 1)]


async def _publish(bus: Bus, envs: list[Envelope], progress: Callable[[str], None] | None) -> None:
    step = 2000
    for i in range(0, len(envs), step):
        await bus.publish_many(envs[i:i + step])
        if progress and (i // step) % 25 == 0:
            progress(f"  wrote {min(i + step, len(envs)):,} / {len(envs):,} events")


async def _timed(bus: Bus, mode: str) -> tuple[float, int]:
    n = 0
    view = ClusterView()
    start = time.perf_counter()
    async for batch in read_stream(bus, ("fleet.evt.>",)):
        if mode == "raw_read":
            n += len(batch)
            continue
        for msg in batch:
            env = parse_envelope(msg.data)
            n += 1
            if mode == "fold":
                apply(view, env, msg.metadata.sequence.stream)
    return time.perf_counter() - start, n


async def measure(bus: Bus, repeat: int, progress: Callable[[str], None] | None) -> dict[str, Any]:
    modes = ("raw_read", "parse", "fold")
    times: dict[str, list[float]] = {m: [] for m in modes}
    counts: dict[str, int] = {}
    for r in range(repeat):
        for m in modes:  # interleaved, so a slow moment of the machine falls on all three
            s, n = await _timed(bus, m)
            times[m].append(s)
            counts[m] = n
        if progress:
            progress(f"  round {r + 1}/{repeat}: " + ", ".join(f"{m} {counts[m] / times[m][-1]:,.0f}/s" for m in modes))
    out: dict[str, Any] = {}
    raw = counts["raw_read"] / statistics.median(times["raw_read"])
    for m in modes:
        rate = counts[m] / statistics.median(times[m])
        out[m] = {"events": counts[m], "median_s": round(statistics.median(times[m]), 4),
                  "events_per_s": round(rate), "vs_raw_read": round(rate / raw, 3)}
    return out


async def run_replay_bench(events: int = 100_000, repeat: int = 5, nats_url: str | None = None,
                           progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure on a fresh log of `events` events, or on the log at `nats_url` if given."""
    from gpufleet.shared.embedded.procs import free_port, start_nats, stop_process

    proc = None
    tmp = None
    if nats_url is None:
        tmp = tempfile.TemporaryDirectory(prefix="gpufleet-bench-replay-")
        port = free_port()
        proc = start_nats(Path(tmp.name) / "nats", port)
        nats_url = f"nats://127.0.0.1:{port}"
    try:
        bus = await Bus.connect(nats_url, name="bench-replay")
        try:
            built = None
            if proc is not None:
                await bus.ensure_streams()
                if progress:
                    progress(f"building a log of {events:,} events ...")
                envs = synthetic_log(events)
                start = time.perf_counter()
                await _publish(bus, envs, progress)
                built = {"events": len(envs), "write_s": round(time.perf_counter() - start, 2)}
            doc = await measure(bus, repeat, progress)
            return {"source": "synthetic" if built else nats_url, "built": built, "repeat": repeat, **doc}
        finally:
            await bus.close()
    finally:
        if proc is not None:
            stop_process(proc)
        if tmp is not None:
            tmp.cleanup()


def run(events: int = 100_000, repeat: int = 5, nats_url: str | None = None,
        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    return asyncio.run(run_replay_bench(events, repeat, nats_url, progress))
