"""`gpufleet bench placement`: replay an Alibaba GPU trace (openb, cluster-trace-gpu-v2023) through
the placer's own framework (services/placer/framework.py, the code the service runs), the way the
FGD paper's simulator does, and measure the GPU allocation ratio and fragmentation.

Per seed: the pods, sorted by name, are shuffled with the seed; then pods drawn uniformly from the
original list are appended until the arrived GPU request would pass 130 % of the cluster's GPUs
(the simulator's workload tuning). Each pod is placed once, in order, and never leaves; a pod
that fits nowhere fails. After every pod the arrived GPU (failed pods included), the allocated
GPU and the fragmentation (FGD's definition, over the typical pods of the original list: the most
frequent shapes covering 95 %) are recorded; the value at an arrival of k % is the mean over the
pods whose arrival rounds to k % — the published analysis scripts' method.
"""

from __future__ import annotations

import csv
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpufleet.services.placer.frag import MILLI, TaskShape, typical_tasks
from gpufleet.services.placer.framework import Ask, Context, GpuClustering, Node, Profile, profiles, schedule

TUNE_RATIO = 1.3
PUBLISHED_NAMES = {"random": "01-Random", "dotprod": "02-DotProd", "clustering": "03-GpuClustering",
                   "packing": "04-GpuPacking", "bestfit": "05-BestFit", "fgd": "06-FGD"}


@dataclass(frozen=True, slots=True)
class Pod:
    name: str
    ask: Ask


def load_nodes(path: str | Path) -> list[tuple[str, int, int, int, str]]:
    """(name, cpu milli, memory MiB, GPUs, model) per node."""
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            gpus = int(row["gpu"])
            out.append((row["sn"], int(row["cpu_milli"]), int(row["memory_mib"]), gpus,
                        row["model"] if gpus and row["model"] not in ("", "nan") else ""))
    return out


def load_pods(path: str | Path) -> list[Pod]:
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            gpus = int(row["num_gpu"])
            milli = min(MILLI, max(0, int(row["gpu_milli"]))) if gpus else 0
            if gpus and milli == 0:
                gpus = 0
            spec = row.get("gpu_spec") or ""
            models = frozenset(m for m in spec.split("|") if m and m != "nan")
            out.append(Pod(row["name"], Ask(cpu=int(row["cpu_milli"]), mem=int(row["memory_mib"]), gpus=gpus,
                                            milli=milli if gpus else MILLI, models=models)))
    out.sort(key=lambda p: p.name)
    return out


VARIANTS = ("cpu-only", "cpu-per-gpu")


def variant(pods: Sequence[Pod], kind: str, factor: float, seed: int = 0) -> list[Pod]:
    """A CPU- or GPU-heavier workload of the same family, to check a policy on traces it was not
    tuned on. `cpu-only=F`: the CPU-only pods resampled (seeded) to F times their number — the
    trace's own cpu037 ... cpu235 workloads differ this way; `cpu-per-gpu=F`: every GPU pod asks F
    times its CPU (F < 1: GPU-heavier), capped at 128 cores."""
    if factor < 0:
        raise ValueError(f"variant {kind}: the factor must be at least 0, got {factor}")
    if kind == "cpu-only":
        cpu = [p for p in pods if not p.ask.gpus]
        rest = [p for p in pods if p.ask.gpus]
        rng = random.Random(seed * 15485863 + 11)
        n = round(len(cpu) * factor)
        whole, part = divmod(n, len(cpu)) if cpu else (0, 0)
        drawn = [Pod(f"{p.name}-v{k}", p.ask) for k in range(whole) for p in cpu]
        drawn += [Pod(f"{p.name}-v{whole}", p.ask) for p in rng.sample(cpu, part)]
        out = rest + drawn
    elif kind == "cpu-per-gpu":
        out = [Pod(p.name, replace(p.ask, cpu=min(128_000, round(p.ask.cpu * factor)))) if p.ask.gpus else p
               for p in pods]
    else:
        raise ValueError(f"variant: unknown kind {kind!r} (one of {', '.join(VARIANTS)})")
    out.sort(key=lambda p: p.name)
    return out


def make_nodes(spec: Sequence[tuple[str, int, int, int, str]], seed: int | None = None) -> list[Node]:
    """The nodes; with a seed, in the simulator's order (names get a random `%04d-` prefix)."""
    if seed is not None:
        rng = random.Random(seed * 31 + 7)
        spec = [s for _, s in sorted(zip(rng.sample(range(len(spec)), len(spec)), spec, strict=True))]
    return [Node(node_id=name, model=model, left=[MILLI] * gpus, gpu_ids=list(range(gpus)), cpu_left=cpu,
                 mem_left=mem, cpu_total=cpu, mem_total=mem) for name, cpu, mem, gpus, model in spec]


def arrivals(pods: Sequence[Pod], gpu_capacity_milli: int, seed: int, ratio: float = TUNE_RATIO) -> list[Pod]:
    """The seed's order: the pods shuffled, then uniform draws appended up to `ratio` of the GPUs."""
    rng = random.Random(seed)
    order = list(pods)
    rng.shuffle(order)
    total = sum(p.ask.gpu_milli_total for p in pods)
    i = 0
    while total < ratio * gpu_capacity_milli:
        p = pods[rng.randrange(len(pods))]
        # (the simulator's test adds the per-GPU milli, not the total: a multi-GPU draw may overshoot)
        if total + p.ask.milli * (1 if p.ask.gpus else 0) > ratio * gpu_capacity_milli:
            break
        total += p.ask.gpu_milli_total
        order.append(Pod(f"{p.name}-tuned-{i}", p.ask))
        i += 1
    return order


@dataclass
class SeedResult:
    alloc: dict[int, float]  # arrival % -> allocation %
    frag: dict[int, float]  # arrival % -> fragmentation % of the cluster's GPUs
    failed: int
    pods: int
    seconds: float


def run_seed(node_spec: Sequence[tuple[str, int, int, int, str]], pods: Sequence[Pod], profile_name: str,
             seed: int, make_profile: Callable[[str], Profile] | None = None) -> SeedResult:
    nodes = make_nodes(node_spec, seed)
    capacity = sum(n.gpus_total for n in nodes) * MILLI
    shapes = tuple(TaskShape(p.ask.cpu, p.ask.gpus, p.ask.milli if p.ask.gpus else 0, p.ask.models) for p in pods)
    ctx = Context(typical=typical_tasks(shapes), shapes=shapes, rng=random.Random(seed * 7919 + 1))
    profile = (make_profile or (lambda name: profiles()[name]))(profile_name)
    clustering = [p for p, _ in profile.plugins if isinstance(p, GpuClustering)]
    frag_of = {n.node_id: ctx.frag(n.model, n.cpu_left, n.left) for n in nodes}
    frag_total = sum(frag_of.values())
    arrived = used = 0
    sums: dict[int, list[float]] = {}  # arrival % -> [allocation sum, fragmentation sum, pods]
    failed = 0
    order = arrivals(pods, capacity, seed)
    t0 = time.perf_counter()
    for pod in order:
        a = pod.ask
        arrived += a.gpu_milli_total
        pick = schedule(nodes, a, profile, ctx)
        if pick is None:
            failed += 1
        else:
            n = pick.node
            n.take(pick.positions, a.milli if a.gpus else 0, a.cpu, a.mem)
            used += a.gpu_milli_total
            new = ctx.frag(n.model, n.cpu_left, n.left)
            frag_total += new - frag_of[n.node_id]
            frag_of[n.node_id] = new
            for c in clustering:
                c.placed(n, a)
        k = round(arrived * 100 / capacity)  # round half to even, as the published scripts
        acc = sums.setdefault(k, [0.0, 0.0, 0.0])
        acc[0] += round(used * 100 / capacity, 2)
        acc[1] += frag_total * 100 / capacity
        acc[2] += 1
    seconds = time.perf_counter() - t0
    alloc = {k: v[0] / v[2] for k, v in sums.items()}
    frag = {k: v[1] / v[2] for k, v in sums.items()}
    return SeedResult(alloc, frag, failed, len(order), seconds)


def at(curve: dict[int, float], k: int) -> float:
    if k in curve:
        return curve[k]
    near = [curve[j] for j in (k - 1, k + 1) if j in curve]
    return sum(near) / len(near) if near else float("nan")


def published(path: str | Path, workload: str) -> dict[str, dict[str, float]]:
    """The published means at 130 % (allocation) and 80 % (fragmentation) per policy."""
    out: dict[str, dict[str, float]] = {}
    base = Path(path)
    for metric, file, k in (("alloc_130_mean", "analysis_allo_discrete.csv", "130"),
                            ("frag_80_mean", "analysis_frag_discrete.csv", "80")):
        if not (base / file).exists():
            continue
        values: dict[str, list[float]] = {}
        with open(base / file, newline="") as f:
            for row in csv.DictReader(f):
                if row["workload"] == workload and row["tune"] == "1.3" and row.get(k):
                    values.setdefault(row["sc_policy"], []).append(float(row[k]))
        for ours, theirs in PUBLISHED_NAMES.items():
            if theirs in values:
                out.setdefault(ours, {})[metric] = statistics.mean(values[theirs])
    return out


def bench(pods_csv: str | Path, nodes_csv: str | Path, policies: Sequence[str], seeds: Sequence[int],
          progress: Callable[[str], None] | None = None,
          make_profile: Callable[[str], Profile] | None = None,
          vary: tuple[str, float] | None = None) -> dict[str, Any]:
    node_spec = load_nodes(nodes_csv)
    pods = load_pods(pods_csv)
    name = Path(pods_csv).stem
    if vary is not None:
        pods = variant(pods, vary[0], vary[1])
        name = f"{name}+{vary[0]}={vary[1]:g}"
    out: dict[str, Any] = {"workload": name, "nodes": len(node_spec),
                           "gpus": sum(s[3] for s in node_spec), "pods": len(pods), "seeds": list(seeds),
                           "policies": {}}
    for policy in policies:
        results = []
        for seed in seeds:
            r = run_seed(node_spec, pods, policy, seed, make_profile)
            results.append(r)
            if progress:
                progress(f"{out['workload']} {policy} seed {seed}: alloc@130 {at(r.alloc, 130):.2f} % "
                         f"({r.failed} of {r.pods} pods failed, {r.seconds:.1f} s)")
        allocs = [at(r.alloc, 130) for r in results]
        frags = [at(r.frag, 80) for r in results]
        curve = {k: statistics.mean(at(r.alloc, k) for r in results) for k in range(0, 131)}
        out["policies"][policy] = {
            "alloc_130_mean": round(statistics.mean(allocs), 3),
            "alloc_130_std": round(statistics.pstdev(allocs), 3),
            "alloc_130_seeds": [round(x, 3) for x in allocs],
            "frag_80_mean": round(statistics.mean(frags), 3),
            "failed_mean": statistics.mean(r.failed for r in results),
            "seconds_per_seed": round(statistics.mean(r.seconds for r in results), 2),
            "curve": {k: round(v, 2) for k, v in curve.items()},
        }
    return out


def write_plot(docs: Sequence[dict[str, Any]], path: str | Path) -> None:
    """The allocation curves, one panel per workload, the published means as dashed lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - the dev extra has it
        raise SystemExit(f"--plot needs matplotlib (pip install 'gpufleet[plot]'): {exc}") from None
    cols = min(4, len(docs))
    rows = (len(docs) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    colors = {"random": "tab:gray", "dotprod": "tab:olive", "clustering": "tab:purple", "packing": "tab:brown",
              "bestfit": "tab:green", "fgd": "tab:blue", "fragaware": "tab:red"}
    for ax, doc in zip(axes.flat, docs, strict=False):
        for name, r in doc["policies"].items():
            xs = sorted(int(k) for k in r["curve"])
            color = colors.get(name)
            ax.plot(xs, [r["curve"][k] if k in r["curve"] else r["curve"][str(k)] for k in xs], label=name,
                    color=color, lw=1.2)
            pub = doc.get("published", {}).get(name)
            if pub and "alloc_130_mean" in pub:
                ax.axhline(pub["alloc_130_mean"], ls="--", lw=0.7, color=color)
        ax.set_title(doc["workload"].removeprefix("openb_pod_list_") + "  (dashed: published)", fontsize=9)
        ax.set_xlim(85, 131)
        ax.set_ylim(84, 98)
        ax.set_xlabel("arrived GPU (% of capacity)", fontsize=8)
        ax.set_ylabel("allocated GPU (%)", fontsize=8)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(docs):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- decision speed at scale


def decide_speed(nodes: int = 5000, jobs: int = 2000, fill: float = 0.6, seed: int = 1,
                 profiles_: Sequence[str] = ("default", "fragaware"),
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Milliseconds per placement decision of the placer core on a sim fleet of `nodes`, filled
    to `fill` of its GPUs, for a stream of mixed jobs (whole GPUs, shares, gangs); each profile
    with the candidate cap (`placement.candidates`) and, as the baseline in the same run, with
    every node scored (the cap lifted)."""
    from datetime import timedelta

    from gpufleet.services.placer.core import PlacerCore
    from gpufleet.shared.contract.clusterconfig import parse_config
    from gpufleet.shared.contract.events import (
        Envelope,
        JobPlaced,
        JobQuotaReserved,
        JobSubmitted,
        JobSucceeded,
        NodeRegistered,
        utc,
    )
    from gpufleet.shared.contract.spec import parse_spec
    from gpufleet.shared.node.cluster import sim_fleet
    from gpufleet.shared.runtime.loop import Ctx

    fleet = sim_fleet(nodes)
    rng = random.Random(seed)
    shapes: list[dict[str, Any]] = [{"gpu": 1}, {"gpu": 1}, {"gpu": 2}, {"gpu": 4}, {"gpu": 8},
              {"gpu": 0.5, "gpuSharing": "shared"}, {"gpu": 0.25, "gpuSharing": "shared"}, {"gpu": 0, "cpu": 4}]
    t0 = utc(1_800_000_000)

    def env(payload: Any, i: int) -> Envelope:
        return Envelope(event_id=f"{i:026d}", type=payload.type, occurred_at=t0 + timedelta(milliseconds=i),
                        tenant="bench", actor="bench", payload=payload)

    def make_spec(i: int) -> Any:
        res: dict[str, Any] = dict(rng.choice(shapes))
        res.setdefault("cpu", 4)
        res["memory"] = "16Gi"
        replicas = 2 if res.get("gpu") == 8 and rng.random() < 0.2 else 1
        return parse_spec({"name": f"j{i}", "tenant": "bench", "resources": res, "replicas": replicas})

    specs = [make_spec(i) for i in range(int(fill * sum(len(inv.gpus) for inv in fleet.values())) + 2 * jobs)]
    total_gpus = sum(len(inv.gpus) for inv in fleet.values())
    out: dict[str, Any] = {"nodes": nodes, "gpus": total_gpus, "jobs": jobs, "fill": fill, "profiles": {}}

    def reserved(k: int, n: int) -> tuple[list[Envelope], Envelope]:
        spec = specs[k]
        r = spec.resources
        job_id = f"job{k:07d}"
        return [env(JobSubmitted(job_id=job_id, spec=spec), n)], env(JobQuotaReserved(
            job_id=job_id, queue="default", cpu_milli=r.cpu_milli, memory_mib=r.memory_mib, gpus=spec.gpus_total), n + 1)

    # one fill history (the default profile's placements up to `fill`), folded by every variant
    filler = PlacerCore(parse_config({"placement": {"backfill": False}}))
    state = filler.initial_state()
    history: list[Envelope] = []
    n = 0
    for node_id, inv in fleet.items():
        n += 1
        history.append(env(NodeRegistered(node_id=node_id, inventory=inv), n))
        state = filler.evolve(state, history[-1])
    used = 0.0
    k = 0
    while used < fill * total_gpus and k < len(specs) - jobs:
        before, cause = reserved(k, n)
        n += 2
        k += 1
        for e in (*before, cause):
            state = filler.evolve(state, e)
        history += [*before, cause]
        for e in filler.decide(state, cause, Ctx(now=cause.occurred_at, actor="placer", cause=cause)):
            state = filler.evolve(state, e)
            history.append(e)
            if isinstance(e.payload, JobPlaced):
                used += sum(len(a.gpu_indices) * a.gpu_milli / 1000 for a in e.payload.allocations)
    out["filled_gpus"] = round(used)
    for name in profiles_:
        for capped in (True, False):
            cfg = {"placement": {"profile": name, "backfill": False, **({} if capped else {"candidates": 100_000})}}
            core = PlacerCore(parse_config(cfg))
            st = core.initial_state()
            for e in history:
                st = core.evolve(st, e)
            times: list[float] = []
            for j in range(jobs):  # each decided on the filled state, then forgotten (the fill stays)
                before, cause = reserved(k + j, n + 2 * j)
                for e in (*before, cause):
                    st = core.evolve(st, e)
                start = time.perf_counter()
                core.decide(st, cause, Ctx(now=cause.occurred_at, actor="placer", cause=cause))
                times.append(time.perf_counter() - start)
                st = core.evolve(st, env(JobSucceeded(job_id=cause.job_id or ""), n + 2 * j + 1))
            times.sort()
            key = name if capped else f"{name} (every node)"
            out["profiles"][key] = {
                "decisions": len(times),
                "median_ms": round(statistics.median(times) * 1000, 3),
                "p99_ms": round(times[max(0, int(len(times) * 0.99) - 1)] * 1000, 3),
            }
            if progress:
                progress(f"decide {key}: median {out['profiles'][key]['median_ms']} ms, "
                         f"p99 {out['profiles'][key]['p99_ms']} ms over {len(times)} decisions")
        capped_ms = out["profiles"][name]["median_ms"]
        full_ms = out["profiles"][f"{name} (every node)"]["median_ms"]
        if capped_ms and full_ms:
            out["profiles"][name]["speedup_vs_every_node"] = round(full_ms / capped_ms, 1)
    return out
