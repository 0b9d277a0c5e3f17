"""`gpufleet bench billing`: how fast the billing core folds the log, and how much it keeps.

N events of synthetic job lifecycles, built once (envelopes, not bytes: parsing is not timed):
64 nodes register, then jobs arrive every 2 s of log time and run 10 minutes (about 300 at
once; the log is cut at N events in log order, so it ends with jobs running), each `job.submitted`, `admitted`, `quota_reserved`, `placed`, `started`, `exited`,
`succeeded`; one in 8 is idle for a while (`idle_detected`, `idle_ended`), one in 16 is
preempted and resumes (a second attempt), and one in 10 is submitted and rejected. One in 20
events is a duplicate of an earlier event of its job, delivered again later (as a redelivery or
a re-published event would be). Every event goes to each fold (as in `gpufleet replay`).

Measured in the same run, on the same events, each fold `--repeat` times, the folds taking
turns after a warm-up (the median reported):
- `billing`: `BillingCore.evolve` (the service's fold: totals only);
- `billing+charges`: the same with `keep_charges` (the ledger's and `gpufleet bill`'s fold);
- `cluster view` (baseline): `shared.view.apply`, the fold of `gpufleet replay` and the read model.
Memory: tracemalloc's peak during one more fold, and what the state still holds at the end
(tracemalloc's current size after the fold), with the billing state's entry counts.
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from gpufleet.services.billing.core import BillingCore
from gpufleet.shared.contract.clusterconfig import parse_config
from gpufleet.shared.contract.events import (
    Envelope,
    GpuDevice,
    JobAdmitted,
    JobExited,
    JobIdleDetected,
    JobIdleEnded,
    JobPlaced,
    JobQuotaReserved,
    JobRejected,
    JobResumeRequested,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NodeInventory,
    NodeRegistered,
    Reason,
    ReplicaAllocation,
)
from gpufleet.shared.contract.ids import ulid
from gpufleet.shared.contract.spec import parse_spec
from gpufleet.shared.read.view import ClusterView, apply

T0 = datetime(2026, 1, 1, tzinfo=UTC)
NODES = 64
ARRIVAL_S = 2.0
RUNTIME_S = 600.0
PRICES = {"currency": "USD", "gpuHour": {"H100": "4.10", "*": "2"}, "cpuCoreHour": "0.04", "memoryGiBHour": "0.005"}


def synthetic_log(events: int) -> list[Envelope]:
    """`events` envelopes (about 8 per job), in log order (sorted by time)."""
    n = 0

    def env(payload: Any, at: datetime, tenant: str = "acme") -> tuple[datetime, int, Envelope]:
        nonlocal n
        n += 1
        return at, n, Envelope(event_id=ulid(int(at.timestamp() * 1000), n.to_bytes(10, "big")), type=payload.type,
                               occurred_at=at, tenant=tenant, actor="bench", payload=payload)

    out: list[tuple[datetime, int, Envelope]] = []
    for i in range(NODES):
        inv = NodeInventory(cpu_milli=128_000, memory_mib=1024 * 1024, gpus=tuple(
            GpuDevice(index=g, uuid=f"GPU-{i}-{g}", model="H100" if i % 2 else "A100", memory_mib=80 * 1024)
            for g in range(8)))
        out.append(env(NodeRegistered(node_id=f"n{i}", inventory=inv), T0, "sys"))
    spec = parse_spec({"name": "bench", "tenant": "acme", "queue": "q0", "resources": {"gpu": 1, "cpu": 4,
                                                                                     "memory": "16Gi"}})
    job = 0
    # more than asked, then cut in log order: the log ends mid-stream, with jobs still running
    while len(out) < events + (RUNTIME_S / ARRIVAL_S + 1) * 10:
        job_id = f"job{job:08d}"
        tenant, queue = f"t{job % 4}", f"q{job % 8}"
        s = spec.model_copy(update={"tenant": tenant, "queue": queue})
        t = T0 + timedelta(seconds=job * ARRIVAL_S)
        if job % 10 == 9:
            out += [env(JobSubmitted(job_id=job_id, spec=s), t, tenant),
                    env(JobRejected(job_id=job_id, reasons=(Reason(code="x", message="x"),)), t, tenant)]
            job += 1
            continue
        node = f"n{job % NODES}"
        gpu = (job // NODES) % 8
        alloc = (ReplicaAllocation(replica=0, node_id=node, gpu_indices=(gpu,), cpu_milli=4000, memory_mib=16384),)
        mine = [env(JobSubmitted(job_id=job_id, spec=s), t, tenant), env(JobAdmitted(job_id=job_id), t, tenant),
                env(JobQuotaReserved(job_id=job_id, queue=queue, cpu_milli=4000, memory_mib=16384, gpus=1), t, tenant),
                env(JobPlaced(job_id=job_id, allocations=alloc), t, tenant),
                env(JobStarted(job_id=job_id, node_id=node), t + timedelta(seconds=1), tenant)]
        end = t + timedelta(seconds=RUNTIME_S)
        attempt = 1
        if job % 16 == 5:  # preempted half-way, resumed: a second attempt
            mid = t + timedelta(seconds=RUNTIME_S / 2)
            mine += [env(JobExited(job_id=job_id, node_id=node, exit_code=143, reason="preempted"), mid, tenant),
                     env(JobResumeRequested(job_id=job_id, reason=Reason(code="preempted", message="x")), mid, tenant),
                     env(JobPlaced(job_id=job_id, attempt=2, allocations=alloc), mid, tenant),
                     env(JobStarted(job_id=job_id, node_id=node, attempt=2), mid + timedelta(seconds=1), tenant)]
            attempt = 2
        if job % 8 == 3:
            mine += [env(JobIdleDetected(job_id=job_id, node_id=node, gpu_util_pct=1.0, idle_s=60.0),
                         t + timedelta(seconds=200), tenant),
                     env(JobIdleEnded(job_id=job_id, node_id=node, gpu_util_pct=80.0), t + timedelta(seconds=400),
                         tenant)]
        mine += [env(JobExited(job_id=job_id, node_id=node, exit_code=0, reason="completed", attempt=attempt), end,
                     tenant),
                 env(JobSucceeded(job_id=job_id), end + timedelta(seconds=1), tenant)]
        if job % 2 == 0:  # a duplicate of one of its events, delivered again up to 20 minutes later
            _, _, dup = mine[(job // 2) % len(mine)]
            later = end + timedelta(seconds=(job * 37) % 1200)
            out.append((later, n + 1, dup))
            n += 1
        out += mine
        job += 1
    out.sort(key=lambda x: (x[0], x[1]))
    return [e for _, _, e in out[:events]]


def _fold_billing(core: BillingCore) -> Callable[[list[Envelope]], Any]:
    def run(log: list[Envelope]) -> Any:
        state = core.initial_state()
        for e in log:
            state = core.evolve(state, e)
        return state
    return run


def _fold_view(log: list[Envelope]) -> Any:
    view = ClusterView()
    for seq, e in enumerate(log, 1):
        apply(view, e, seq)
    return view


def _rates(folds: dict[str, Callable[[list[Envelope]], Any]], log: list[Envelope],
           repeat: int) -> dict[str, list[float]]:
    """Events per second of each fold, `repeat` times, taking turns (so a busy moment of the
    machine falls on all of them alike), after one untimed warm-up fold of a tenth of the log."""
    for fold in folds.values():
        fold(log[: len(log) // 10])
    rates: dict[str, list[float]] = {name: [] for name in folds}
    for _ in range(repeat):
        for name, fold in folds.items():
            gc.collect()
            t0 = time.perf_counter()
            fold(log)
            rates[name].append(len(log) / (time.perf_counter() - t0))
    return rates


def _memory(fold: Callable[[list[Envelope]], Any], log: list[Envelope]) -> tuple[Any, dict[str, int]]:
    """The state after one more fold, tracemalloc's peak during it and what the state keeps after."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    state = fold(log)
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return state, {"peak_kib": round((peak - base) / 1024), "kept_kib": round((current - base) / 1024)}


def run(events: int, repeat: int = 5) -> dict[str, Any]:
    log = synthetic_log(events)
    config = parse_config({"prices": PRICES, "budgets": {"tenants": {"t0": {"amount": "1000000"}}}})
    folds = {"billing": _fold_billing(BillingCore(config)),
             "billing+charges": _fold_billing(BillingCore(config, keep_charges=True)),
             "cluster view (baseline)": _fold_view}
    doc: dict[str, Any] = {"events": len(log), "jobs": sum(1 for e in log if e.type == "job.submitted"),
                           "log_hours": round((log[-1].occurred_at - log[0].occurred_at).total_seconds() / 3600, 2),
                           "repeat": repeat, "folds": {}}
    rates = _rates(folds, log, repeat)
    for name, fold in folds.items():
        state, mem = _memory(fold, log)
        r: dict[str, Any] = {"events_per_s_median": round(statistics.median(rates[name])),
                             "events_per_s": [round(x) for x in rates[name]], **mem}
        if hasattr(state, "size"):
            r["entries"] = state.size()
            r["intervals"] = state.intervals
        else:
            r["entries"] = {"jobs": len(state.jobs), "nodes": len(state.nodes)}
        doc["folds"][name] = r
    base = doc["folds"]["cluster view (baseline)"]["events_per_s_median"]
    for r in doc["folds"].values():
        r["rate_vs_baseline"] = round(r["events_per_s_median"] / base, 2) if base else None
    return doc
