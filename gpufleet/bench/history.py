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
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufleet.bench.replay import _publish, synthetic_log
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.loop import ServiceRuntime

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


RESTARTS = 5
NODES = 300  # a fixed fleet: the cluster stays the size it is, the history grows
JOB_GAP_S = 10.0  # log time between jobs (a job every 10 s: 14k jobs = 40 h, past the 24 h window)


async def measure_size(events: int, cores: tuple[str, ...], progress: Callable[[str], None] | None,
                       nodes: int = NODES, job_gap_s: float = JOB_GAP_S) -> dict[str, Any]:
    from gpufleet.shared.embedded.procs import free_port, start_nats, stop_process
    from gpufleet.shared.trust.authz import ADMIN, ensure_realm, nats_config, write_nats_config

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
            envs = synthetic_log(events, nodes=nodes, job_gap_s=job_gap_s)
            if progress:
                progress(f"[{events:,}] writing {len(envs):,} events ...")
            await _publish(admin, envs, progress)
            head = await admin.last_seq()
            await admin.close()
            out: dict[str, Any] = {"events": head, "nodes": nodes, "job_gap_s": job_gap_s,
                                   "log_hours": round(len(envs) / 7 * job_gap_s / 3600, 1), "cores": {}}
            for name in cores:
                creds = realm.creds_path(f"svc-{name}")
                rss0 = _rss()
                rt, full_s = await _start(url, creds, name)
                full_events = rt.last_fold.events
                state_bytes = len(pickle.dumps(rt.state, protocol=5))
                held = _rss() - rss0
                await rt.flush_snapshot()
                size = len(rt._snap.packed()) if rt._snap is not None else 0
                await _decided_to_head(rt, head)
                await rt.bus.close()
                starts = []  # RESTARTS restarts, the median reported: one takes milliseconds
                for _ in range(RESTARTS):
                    rt2, one_s = await _start(url, creds, name)
                    await rt2.bus.close()
                    if rt2.last_fold.from_seq == 0:
                        raise RuntimeError(f"{name}: the restart did not start from its snapshot")
                    starts.append(one_s)
                snap_s = statistics.median(starts)
                row = {"full_fold_s": round(full_s, 3), "full_fold_events": full_events,
                       "snapshot_start_s": round(snap_s, 3), "snapshot_start_max_s": round(max(starts), 3),
                       "snapshot_from_seq": rt2.last_fold.from_seq,
                       "tail_events": rt2.last_fold.events, "snapshot_bytes": size, "state_bytes": state_bytes,
                       "rss_growth_bytes": held,
                       "speedup": round(full_s / max(snap_s, 1e-6), 1)}
                out["cores"][name] = row
                if progress:
                    progress(f"[{events:,}] {name}: full fold {full_s:.2f}s, from snapshot {snap_s:.3f}s")
            out["replay"], out["explain"] = await _reads(url, realm.creds_path(ADMIN), realm.creds_path("svc-view"),
                                                         head, events, progress)
            return out
        finally:
            stop_process(proc)


async def _decided_to_head(rt: ServiceRuntime[Any], head: int) -> None:
    """The service's durable consumer as a running service leaves it: everything to the head
    decided and acknowledged (its ack floor at the head). The bench folds the log but decides
    nothing; restarted with a floor at 0 the durable would be recreated from sequence 1, which
    costs the server O(messages) and is not what a restart of a running service meets."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    from gpufleet.shared.contract.events import STREAM

    js = rt.bus.js
    try:
        await js.delete_consumer(STREAM, rt.durable)
    except Exception:  # noqa: BLE001 - not created yet
        pass
    await js.add_consumer(STREAM, ConsumerConfig(
        durable_name=rt.durable, filter_subject=rt.filter_subject, ack_policy=AckPolicy.ALL,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=head + 1, max_deliver=-1,
        ack_wait=rt.ack_wait_s, max_ack_pending=20_000))


async def _reads(url: str, admin_creds: Path, view_creds: Path, head: int, events: int,
                 progress: Callable[[str], None] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """replay at three random points, from view snapshots and from sequence 1; explain of three jobs."""
    import random

    from gpufleet.sdk import Fleet
    from gpufleet.tools.dashboard import Board
    from gpufleet.tools.viewsnap import EVERY, VIEW, ViewSnapshots, catch_up

    view = await Bus.connect(url, name="bench-view", creds=view_creds)
    every = EVERY  # as the mesh's view process keeps them, whatever the log's length
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
                         "full_fold_s": round(full_s, 3), "live_jobs": len(doc["jobs"]),
                         "jobs": sum(doc["job_counts"].values())})
            if progress:
                progress(f"[{events:,}] replay --seq {seq}: {snap_s:.2f}s from the view snapshot at "
                         f"{doc['from_snapshot']}, {full_s:.2f}s from seq 1")
        t1 = time.perf_counter()
        every_row = await fleet.state_at(until_seq=points[-1], ended=True)  # `replay --all`: grows with the jobs
        all_s = time.perf_counter() - t1
        jobs = [e.job_id for _, e in await fleet.history("fleet.evt.*.job.*.succeeded", until_seq=min(head, 20_000))]
        explain = []
        for job_id in rng.sample([j for j in jobs if j], min(3, len(jobs))):
            t1 = time.perf_counter()
            ex = await fleet.explain(job_id)
            explain.append({"job_id": job_id, "s": round(time.perf_counter() - t1, 3),
                            "events": len(ex.history) if ex is not None else 0})
        return ({"view_snapshot_every": every, "view_snapshots_s": round(built_s, 2), "points": rows,
                 "all_rows_s": round(all_s, 3), "all_rows": len(every_row["jobs"])},
                {"jobs": explain})
    finally:
        await fleet.close()
        await view.close()


async def _full_state(fleet: Any, seq: int) -> Any:
    """The same state_at with no view snapshot (a fold from sequence 1)."""
    from gpufleet.tools.dashboard import Board
    from gpufleet.tools.viewsnap import fold_board

    board = Board()
    await fold_board(fleet.bus, board, until_seq=seq)
    return board.state()


def run(sizes: list[int], cores: tuple[str, ...] = CORES,
        progress: Callable[[str], None] | None = None, nodes: int = NODES, job_gap_s: float = JOB_GAP_S) -> dict[str, Any]:
    runs = [asyncio.run(measure_size(n, cores, progress, nodes, job_gap_s)) for n in sizes]
    doc: dict[str, Any] = {"sizes": runs}
    if len(runs) > 1:
        first, last = runs[0], runs[-1]
        doc["growth"] = {name: {
            "full_fold": round(last["cores"][name]["full_fold_s"] / max(first["cores"][name]["full_fold_s"], 1e-6), 2),
            "snapshot_start": round(last["cores"][name]["snapshot_start_s"]
                                    / max(first["cores"][name]["snapshot_start_s"], 1e-6), 2),
            "state_bytes": round(last["cores"][name]["state_bytes"] / max(first["cores"][name]["state_bytes"], 1), 2)}
            for name in cores}

        def worst_replay(run: dict[str, Any]) -> float:
            return float(max(p["snapshot_s"] for p in run["replay"]["points"]))

        def median_explain(run: dict[str, Any]) -> float:
            return float(statistics.median(j["s"] for j in run["explain"]["jobs"]))

        doc["growth"]["replay_worst"] = round(worst_replay(last) / max(worst_replay(first), 1e-6), 2)
        doc["growth"]["explain_median"] = round(median_explain(last) / max(median_explain(first), 1e-6), 2)
    return doc


# ---------------------------------------------------------------- a deep backlog


def pending(sizes: list[int], cores: tuple[str, ...] = ("admission", "quota", "placer", "guardian", "executor",
                                                        "telemetry", "autoscaler", "billing"),
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`bench history --pending 1000000`: a backlog of that many admitted jobs that wait for
    quota (a queue whose nominal quota is 8 GPUs, full), folded from the wire format by every core
    in one process, as a grouped service process receives them. Per size: the process's resident
    memory per pending job, each core's snapshot (pickled) bytes per job, and the cost of one
    delivered submit (admission, quota and placer deciding on it) at that backlog against 1,000
    (median of 200)."""
    import argparse
    import gc
    import pickle
    import statistics

    from gpufleet.services.registry import make_core
    from gpufleet.shared.contract.events import parse_envelope, utc
    from gpufleet.shared.runtime.engine import Engine
    from gpufleet.shared.runtime.loop import Ctx

    out: dict[str, Any] = {"sizes": []}
    tmp = tempfile.TemporaryDirectory(prefix="gpufleet-bench-pending-")
    conf = Path(tmp.name) / "cluster.yaml"
    conf.write_text("queues:\n  default: {nominal: {gpu: 8}}\n")  # full after one 8-GPU job: the rest wait
    for n in sorted({1000, *sizes}):
        gc.collect()
        rss0 = _rss()
        engines = [Engine(make_core(name, argparse.Namespace(config=str(conf), sim_nodes=0))) for name in cores]
        seq = 0
        for i, data in enumerate(_backlog(n)):
            env = parse_envelope(data)
            seq += 1
            for e in engines:
                if e.wants(env.subject()):
                    e.fold(env, seq)
            if progress and i and i % 200_000 == 0:
                progress(f"[{n:,} pending] {i:,} events folded")
        del env
        gc.collect()
        rss = _rss() - rss0
        costs = []
        for data in _probe(200):
            env = parse_envelope(data)
            seq += 1
            t0 = time.perf_counter()
            for e in engines:
                if e.wants(env.subject()):
                    e.deliver(env, seq, Ctx(now=utc(env.occurred_at.timestamp()), actor=f"{e.core.name}/0", cause=env))
            costs.append(time.perf_counter() - t0)
        row = {"pending": n, "rss_bytes_per_job": round(rss / n), "decide_us": round(1e6 * statistics.median(costs), 1),
               "snapshot_bytes_per_job": {e.core.name: round(len(pickle.dumps(e.state, protocol=5)) / n)
                                          for e in engines}}
        out["sizes"].append(row)
        if progress:
            progress(f"[{n:,} pending] {row['rss_bytes_per_job']:,} bytes of memory per job, "
                     f"a delivered event {row['decide_us']} us")
        del engines
    tmp.cleanup()
    base = out["sizes"][0]["decide_us"]
    for row in out["sizes"]:
        row["decide_vs_1000"] = round(row["decide_us"] / max(base, 1e-9), 2)
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _backlog(n: int) -> Any:
    """n jobs of a few shapes, each with its own name, submitted and admitted (wire format)."""
    from gpufleet.shared.contract.events import Envelope, JobAdmitted, JobSubmitted, utc
    from gpufleet.shared.contract.ids import derive_id
    from gpufleet.shared.contract.spec import parse_spec

    t0 = 1_767_268_800.0
    shapes = [parse_spec({"name": "x", "tenant": "acme", "resources": {"gpu": g, "cpu": c}})
              for g in (1, 2, 4, 8) for c in (2, 8)]
    for i in range(n):
        job = f"p{i:07d}"
        spec = shapes[i % len(shapes)].model_copy(update={"name": f"train-{i}"})
        at = utc(t0 + i * 0.001)
        sub = Envelope(event_id=derive_id(job, "submitted", time_ms=int(at.timestamp() * 1000)), type="job.submitted",
                       occurred_at=at, tenant="acme", correlation_id=job, actor="admission/0",
                       payload=JobSubmitted(job_id=job, spec=spec))
        yield sub.to_json()
        yield Envelope(event_id=derive_id(job, "admitted"), type="job.admitted", occurred_at=at, tenant="acme",
                       correlation_id=job, actor="admission/0", payload=JobAdmitted(job_id=job)).to_json()


def _probe(n: int) -> Any:
    from gpufleet.shared.contract.events import Envelope, SubmitRequested, utc
    from gpufleet.shared.contract.ids import ulid

    for i in range(n):
        at = utc(1_767_268_800.0 + 10_000 + i)
        doc = {"name": f"probe-{i}", "tenant": "acme", "resources": {"gpu": 1}}
        yield Envelope(event_id=ulid(int(at.timestamp() * 1000), i.to_bytes(10, "big")), type="cmd.submit", occurred_at=at, tenant="acme",
                       actor="acme/cli", payload=SubmitRequested(job_id=f"probe{i:04d}", spec=doc)).to_json()
