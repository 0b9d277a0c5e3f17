"""`gpufleet bench placement --dynamic`: the openb trace with its arrivals **and departures**, on a
simulated clock, through the placer's framework (the code the service runs).

The static experiment (gpufleet/bench/placement.py) places pods that never leave. Here every pod
arrives at its `creation_time` and, once placed, runs for its own run time — `deletion_time`
minus `scheduled_time` (minus `creation_time` for the pods the real cluster never scheduled),
at least 1 s — and then leaves.

The trace alone cannot load the cluster in time: its 8,152 pods together ask 98 % of the GPUs,
but they arrive over 149 days and most run minutes (median 8 min), so at no moment do they hold
even 2 % of it. Two knobs make a load, both seeded and printed with the figures:
- `tune` (default 2.0): as the static experiment resamples the trace up to 130 % of the GPUs,
  pods are drawn from the trace — one pod's shape and run time at another pod's creation time,
  so the arrival profile keeps its shape — until the GPU asked reaches `tune` x the cluster's;
- `compress` (default 3,000): pod i arrives at creation_time / compress, run times unchanged,
  which multiplies the load by the same factor. The defaults: the busiest moment asks ~1.2x the
  cluster (`demand_peak`, on a cluster without limits), the arrival window is 1.2 h.
The first `warmup` (10 %) of the arrivals, spread over the trace's first 80 % of time, only fill
the cluster; waits and allocation are measured over the pods after them.

The queue is kube-scheduler's (no gangs in the trace, so no reservations): a pod that arrives
is placed at once if it fits somewhere; one that fits nowhere waits; whenever pods leave,
the waiting pods are tried again in arrival order. Only the nodes that freed something can have
become feasible for a waiting pod (every other node was infeasible at its last try and has only
filled since), so the retry scores just those nodes — the same pick as scoring all, in a
fraction of the time. After the last arrival the cluster drains for `drain_s`; a pod still
waiting then never ran.

Per policy and seed (the seed draws the tuned pods, orders the nodes as the static experiment's,
and breaks ties): the mean, p50 and p95 wait of the pods that ran, the mean weighted by the GPU
each asked, the mean with the pods that never ran counted as waiting to the end, the pods that never ran (and of those, how many
fit no node even of the empty cluster), the time-weighted GPU allocation over the arrival
window, the same while a GPU pod is waiting (what fragmentation costs: GPUs free, yet a pod
waits), and an allocation curve over time for the plot.
"""

from __future__ import annotations

import csv
import heapq
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.bench.placement import Pod, load_nodes, load_pods, make_nodes
from gpufleet.services.placer.frag import MILLI, TaskShape, typical_tasks
from gpufleet.services.placer.framework import (
    Context,
    GpuClustering,
    Node,
    Profile,
    feasible,
    profiles,
    schedule,
)

DYNAMIC_POLICIES = ("leastallocated", "bestfit", "fgd", "fragaware")
TUNE = 2.0  # the GPU asked, as a share of the cluster's (the static experiment's 130 %, in time)
COMPRESS = 3000.0  # arrivals 3,000x closer together: the busiest hour asks ~1.2x the cluster
CURVE_POINTS = 120


@dataclass(frozen=True, slots=True)
class TimedPod:
    pod: Pod
    created: float  # trace seconds
    run_s: float  # how long it runs once placed


def load_timed(path: str | Path) -> list[TimedPod]:
    """The pods of a pod list with their creation time and run time, in creation order."""
    asks = {p.name: p for p in load_pods(path)}
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            created = float(row["creation_time"])
            start = float(row["scheduled_time"]) if row.get("scheduled_time") not in (None, "", "nan") else created
            run = max(1.0, float(row["deletion_time"]) - max(created, start))
            out.append(TimedPod(asks[row["name"]], created, run))
    out.sort(key=lambda t: (t.created, t.pod.name))
    return out


def tuned(pods: Sequence[TimedPod], capacity_milli: int, seed: int, ratio: float) -> list[TimedPod]:
    """The trace, plus pods drawn from it until the GPU asked reaches `ratio` of the cluster (the
    static experiment's tuning, in time): a draw takes one pod's shape and run time and another
    pod's creation time (plus up to a minute), so the arrivals keep the trace's profile."""
    rng = random.Random(seed * 104729 + 3)
    out = list(pods)
    total = sum(p.pod.ask.gpu_milli_total for p in pods)
    i = 0
    while total < ratio * capacity_milli:
        p = pods[rng.randrange(len(pods))]
        when = pods[rng.randrange(len(pods))].created + rng.uniform(0, 60)
        out.append(TimedPod(Pod(f"{p.pod.name}-tuned-{i}", p.pod.ask), when, p.run_s))
        total += p.pod.ask.gpu_milli_total
        i += 1
    out.sort(key=lambda t: (t.created, t.pod.name))
    return out


def demand(pods: Sequence[TimedPod], capacity_milli: int, c: float) -> tuple[float, float]:
    """The peak and the time-weighted mean, over the arrival window, of the GPU the pods would hold
    on a cluster without limits (fractions of this one's): the load offered."""
    t0 = pods[0].created
    window = (pods[-1].created - t0) / c
    ev = []
    for p in pods:
        a = (p.created - t0) / c
        ev.append((a, p.pod.ask.gpu_milli_total))
        ev.append((a + p.run_s, -p.pod.ask.gpu_milli_total))
    ev.sort()
    cur = peak = 0
    area = last = 0.0
    for t, g in ev:
        if t > window:
            break
        area += cur * (t - last)
        last = t
        cur += g
        peak = max(peak, cur)
    area += cur * max(0.0, window - last)
    return peak / capacity_milli, (area / window / capacity_milli) if window > 0 else 0.0


@dataclass
class DynamicResult:
    waits: list[float]  # of the measured pods that ran, seconds
    waits_censored: list[float]  # of every measured pod: a pod that never ran waited until the end
    wait_gpu: float  # the mean wait of the pods that ran, weighted by the GPU each asked
    by_size: dict[str, tuple[int, float, int]]  # "cpu" | "share" | "<n> GPU" -> (ran, mean wait, never ran)
    never_ran: int
    never_fit: int  # of never_ran: fit no node of the empty cluster
    alloc_mean: float  # % of GPU capacity, time-weighted over the arrival window
    alloc_waiting: float  # the same, over the time a GPU pod was waiting
    waiting_share: float  # of the window, the share of time a GPU pod was waiting
    curve: list[float]  # allocation % per equal slice of the window
    pods: int
    seconds: float


def run_dynamic(node_spec: Sequence[tuple[str, int, int, int, str]], pods: Sequence[TimedPod], profile_name: str,
                seed: int, c: float, drain_s: float, warmup: float = 0.1,
                make_profile: Callable[[str], Profile] | None = None) -> DynamicResult:
    nodes = make_nodes(node_spec, seed)
    capacity = sum(n.gpus_total for n in nodes) * MILLI
    shapes = tuple(TaskShape(p.pod.ask.cpu, p.pod.ask.gpus, p.pod.ask.milli if p.pod.ask.gpus else 0,
                             p.pod.ask.models) for p in pods)
    ctx = Context(typical=typical_tasks(shapes), shapes=shapes, rng=random.Random(seed * 7919 + 1))
    profile = (make_profile or (lambda name: profiles()[name]))(profile_name)
    if any(isinstance(p, GpuClustering) for p, _ in profile.plugins):
        raise ValueError(f"{profile_name}: its plugin keeps per-node tags that never forget a pod that left")
    empty = make_nodes(node_spec)
    order = {n.node_id: k for k, n in enumerate(nodes)}
    t0 = pods[0].created
    arrive = [(p.created - t0) / c for p in pods]
    first = int(warmup * len(pods))  # the pods before it fill the cluster; not measured
    w0 = arrive[first] if first < len(pods) else arrive[-1]
    window = arrive[-1]
    end = window + drain_s
    started = [float("nan")] * len(pods)
    departures: list[tuple[float, int, Node, tuple[int, ...]]] = []  # (time, pod, node, positions)
    waiting: list[int] = []  # pod indices, arrival order
    waiting_gpu = 0  # of them, GPU pods
    used = 0
    now = 0.0
    area = area_waiting = time_waiting = 0.0
    slice_s = (window - w0) / CURVE_POINTS if window > w0 else 1.0
    curve = [0.0] * CURVE_POINTS

    def advance(to: float) -> None:
        nonlocal now, area, area_waiting, time_waiting
        to_w = min(to, window)
        frm = max(now, w0)
        if to_w > frm:
            dt = to_w - frm
            area += used * dt
            if waiting_gpu:
                area_waiting += used * dt
                time_waiting += dt
            t = frm
            while t < to_w:  # the curve: each slice's time-weighted mean
                k = min(CURVE_POINTS - 1, int((t - w0) / slice_s))
                nxt = min(to_w, w0 + (k + 1) * slice_s)
                curve[k] += used * (nxt - t)
                t = nxt if nxt > t else to_w
        now = to

    def place(i: int, at: float, candidates: Sequence[Node]) -> bool:
        nonlocal used
        a = pods[i].pod.ask
        pick = schedule(candidates, a, profile, ctx)
        if pick is None:
            return False
        milli = a.milli if a.gpus else 0
        pick.node.take(pick.positions, milli, a.cpu, a.mem)
        used += a.gpu_milli_total
        started[i] = at
        heapq.heappush(departures, (at + pods[i].run_s, i, pick.node, pick.positions))
        return True

    t_start = time.perf_counter()
    nxt = 0
    while True:
        t_arr = arrive[nxt] if nxt < len(pods) else float("inf")
        t_dep = departures[0][0] if departures else float("inf")
        t = min(t_arr, t_dep)
        if t > end or t == float("inf"):
            break
        advance(t)
        if t_dep <= t_arr:  # departures first at equal times: what they free is there for the arrivals
            changed: dict[str, Node] = {}
            while departures and departures[0][0] <= t:
                _, i, node, positions = heapq.heappop(departures)
                a = pods[i].pod.ask
                node.give(positions, a.milli if a.gpus else 0, a.cpu, a.mem)
                used -= a.gpu_milli_total
                changed[node.node_id] = node
            if waiting:
                cands = sorted(changed.values(), key=lambda n: order[n.node_id])  # ties: the cluster's order
                still = []
                for i in waiting:
                    if place(i, t, cands):
                        if pods[i].pod.ask.gpus:
                            waiting_gpu -= 1
                    else:
                        still.append(i)
                waiting = still
            continue
        while nxt < len(pods) and arrive[nxt] <= t:
            if not place(nxt, t, nodes):
                waiting.append(nxt)
                if pods[nxt].pod.ask.gpus:
                    waiting_gpu += 1
            nxt += 1
    advance(max(now, window))
    measured = range(first, len(pods))
    never = [i for i in measured if started[i] != started[i]]  # (nan: never started)
    never_set = set(never)
    never_fit = sum(1 for i in never if not any(feasible(n, pods[i].pod.ask) for n in empty))
    waits = [started[i] - arrive[i] for i in measured if i not in never_set]
    censored = waits + [max(0.0, min(now, end) - arrive[i]) for i in never]
    gpu_w = [(started[i] - arrive[i], pods[i].pod.ask.gpu_milli_total) for i in measured if i not in never_set]
    weight = sum(g for _, g in gpu_w)
    wait_gpu = sum(w * g for w, g in gpu_w) / weight if weight else 0.0
    by_size: dict[str, tuple[int, float, int]] = {}
    for i in measured:
        a = pods[i].pod.ask
        key = "cpu" if not a.gpus else "share" if a.milli < MILLI else f"{a.gpus} GPU"
        ran, mean, no = by_size.get(key, (0, 0.0, 0))
        if i in never_set:
            by_size[key] = (ran, mean, no + 1)
        else:
            w = started[i] - arrive[i]
            by_size[key] = (ran + 1, mean + (w - mean) / (ran + 1), no)
    span = window - w0
    scale = 100 / capacity
    return DynamicResult(
        waits=waits, waits_censored=censored, wait_gpu=wait_gpu, by_size=by_size, never_ran=len(never), never_fit=never_fit,
        alloc_mean=area * scale / span if span > 0 else 0.0,
        alloc_waiting=area_waiting * scale / time_waiting if time_waiting else float("nan"),
        waiting_share=time_waiting / span if span > 0 else 0.0,
        curve=[x * scale / slice_s for x in curve], pods=len(pods), seconds=time.perf_counter() - t_start)


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def bench_dynamic(pods_csv: str | Path, nodes_csv: str | Path, policies: Sequence[str], seeds: Sequence[int],
                  tune: float = TUNE, compress: float = COMPRESS, drain_s: float | None = None,
                  warmup: float = 0.1, progress: Callable[[str], None] | None = None,
                  make_profile: Callable[[str], Profile] | None = None) -> dict[str, Any]:
    if tune <= 0 or compress <= 0 or not 0 <= warmup < 1:
        raise ValueError("tune and compress must be above 0, warmup in [0, 1)")
    node_spec = load_nodes(nodes_csv)
    base = load_timed(pods_csv)
    if not base:
        raise ValueError(f"{pods_csv}: no pods")
    capacity = sum(s[3] for s in node_spec) * MILLI
    window = (base[-1].created - base[0].created) / compress
    drain = window * 0.1 if drain_s is None else drain_s
    out: dict[str, Any] = {
        "workload": Path(pods_csv).stem, "mode": "dynamic", "nodes": len(node_spec),
        "gpus": sum(s[3] for s in node_spec), "trace_pods": len(base), "seeds": list(seeds),
        "tune": tune, "compress": compress, "warmup": warmup, "window_s": round(window, 1),
        "drain_s": round(drain, 1), "run_s_median": statistics.median(p.run_s for p in base), "policies": {}}
    workloads = {seed: tuned(base, capacity, seed, tune) for seed in seeds}
    offered = [demand(w, capacity, compress) for w in workloads.values()]
    out["pods"] = round(statistics.mean(len(w) for w in workloads.values()))
    out["demand_peak"] = round(statistics.mean(o[0] for o in offered), 3)
    out["demand_mean"] = round(statistics.mean(o[1] for o in offered), 3)
    for policy in policies:
        results = []
        for seed in seeds:
            pods = workloads[seed]
            r = run_dynamic(node_spec, pods, policy, seed, compress, drain, warmup, make_profile)
            results.append(r)
            if progress:
                progress(f"{out['workload']} {policy} seed {seed}: mean wait {statistics.mean(r.waits or [0]):.1f} s, "
                         f"alloc {r.alloc_mean:.2f} %, never ran {r.never_ran} ({r.seconds:.1f} s)")
        out["policies"][policy] = {
            "wait_mean_s": round(statistics.mean(statistics.mean(r.waits or [0.0]) for r in results), 2),
            "wait_p50_s": round(statistics.mean(_pct(r.waits, 0.50) for r in results), 2),
            "wait_p95_s": round(statistics.mean(_pct(r.waits, 0.95) for r in results), 2),
            "wait_gpu_weighted_s": round(statistics.mean(r.wait_gpu for r in results), 2),
            "wait_censored_mean_s": round(statistics.mean(statistics.mean(r.waits_censored or [0.0])
                                                          for r in results), 2),
            "waited": round(statistics.mean(sum(1 for w in r.waits if w > 0) for r in results), 1),
            "ran": statistics.mean(len(r.waits) for r in results),
            "never_ran": statistics.mean(r.never_ran for r in results),
            "never_fit": statistics.mean(r.never_fit for r in results),
            "alloc_mean": round(statistics.mean(r.alloc_mean for r in results), 3),
            "alloc_while_waiting": round(statistics.mean(r.alloc_waiting for r in results), 3),
            "waiting_share": round(statistics.mean(r.waiting_share for r in results), 4),
            "wait_mean_s_seeds": [round(statistics.mean(r.waits or [0.0]), 2) for r in results],
            "alloc_mean_seeds": [round(r.alloc_mean, 3) for r in results],
            "seconds_per_seed": round(statistics.mean(r.seconds for r in results), 2),
            "by_size": {k: {"ran": statistics.mean(r.by_size.get(k, (0, 0.0, 0))[0] for r in results),
                            "wait_mean_s": round(statistics.mean(r.by_size.get(k, (0, 0.0, 0))[1] for r in results), 1),
                            "never_ran": statistics.mean(r.by_size.get(k, (0, 0.0, 0))[2] for r in results)}
                        for k in sorted({k for r in results for k in r.by_size})},
            "curve": [round(statistics.mean(r.curve[k] for r in results), 2) for k in range(CURVE_POINTS)],
            "wait_cdf": [round(_pct([w for r in results for w in r.waits], q / 100), 1) for q in range(0, 101, 2)],
        }
    return out


def write_dynamic_plot(doc: dict[str, Any], path: str | Path) -> None:
    """Two panels: GPU allocation over the arrival window, and the distribution of waits."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - the dev extra has it
        raise SystemExit(f"--plot needs matplotlib (pip install 'gpufleet[plot]'): {exc}") from None
    colors = {"leastallocated": "tab:gray", "bestfit": "tab:green", "fgd": "tab:blue", "fragaware": "tab:red",
              "default": "tab:orange", "dotprod": "tab:olive", "packing": "tab:brown", "random": "tab:pink"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    hours = doc["window_s"] * (1 - doc["warmup"]) / 3600  # (roughly: the warm-up is by pods, not time)
    for name, r in doc["policies"].items():
        xs = [(k + 0.5) * hours / len(r["curve"]) for k in range(len(r["curve"]))]
        ax1.plot(xs, r["curve"], label=f"{name} (mean {r['alloc_mean']:.1f} %)", color=colors.get(name), lw=1.1)
        qs = list(range(0, 101, 2))
        ax2.plot([max(w, 0.1) for w in r["wait_cdf"]], qs, label=f"{name} (mean {r['wait_mean_s']:.0f} s)",
                 color=colors.get(name), lw=1.1)
    ax1.set_xlabel("simulated time (h)")
    ax1.set_ylabel("allocated GPU (% of capacity)")
    ax1.set_title(f"{doc['workload'].removeprefix('openb_pod_list_')}: tune {doc['tune']}, arrivals "
                  f"{doc['compress']:.0f}x closer, peak demand {doc['demand_peak']:.2f}x", fontsize=9)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    ax2.set_xscale("log")
    ax2.set_xlabel("wait (s, log; 0 drawn at 0.1)")
    ax2.set_ylabel("pods that ran (%)")
    ax2.set_title("waits (pooled over seeds)", fontsize=9)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
