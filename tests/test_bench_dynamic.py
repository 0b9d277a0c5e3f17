"""`gpufleet bench placement --dynamic`: pods that arrive and leave, on a simulated clock."""

from __future__ import annotations

import heapq
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.bench.dynamic import TimedPod, bench_dynamic, demand, load_timed, run_dynamic, tuned
from gpufleet.bench.placement import Pod, make_nodes
from gpufleet.services.placer.frag import TaskShape, typical_tasks
from gpufleet.services.placer.framework import Ask, Context, feasible, profiles, schedule

SHARED = Path(os.environ.get("GPUFLEET_SHARED", Path(__file__).resolve().parents[2] / "shared"))
TRACE = SHARED / "data" / "openb-v2023"
HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time"


def _write(tmp_path: Path, rows: list[str], nodes: list[str]) -> tuple[Path, Path]:
    p = tmp_path / "openb_pod_list_toy.csv"
    p.write_text("\n".join([HEADER, *rows]) + "\n")
    n = tmp_path / "nodes.csv"
    n.write_text("\n".join(["sn,cpu_milli,memory_mib,gpu,model", *nodes]) + "\n")
    return p, n


def test_a_pod_waits_until_the_gpu_it_needs_is_given_back(tmp_path: Path) -> None:
    # one node of 2 GPUs; a 2-GPU pod runs 0..100 s, a 1-GPU pod arriving at 10 s waits 90 s, the
    # pod arriving at 20 s (never scheduled in the trace: run time = deletion - creation) waits
    # behind it, and a 4-GPU pod fits no node of the cluster at all
    pods, nodes = _write(tmp_path, [
        "p0,1000,1024,2,1000,,LS,Succeeded,0,100,0",
        "p1,1000,1024,1,1000,,LS,Succeeded,10,60,10",
        "p2,1000,1024,2,1000,,LS,Pending,20,70,",
        "p3,1000,1024,4,1000,,LS,Pending,30,40,",
        "p4,1000,1024,0,0,,LS,Running,40,100,40",
    ], ["n0,8000,65536,2,V100M16"])
    timed = load_timed(pods)
    assert [t.run_s for t in timed] == [100, 50, 50, 10, 60]
    doc = bench_dynamic(pods, nodes, ["bestfit", "leastallocated"], [1], tune=0.01, compress=1, drain_s=1000,
                        warmup=0)
    for r in doc["policies"].values():
        # p0 starts at 0, p1 at 100 (waits 90), p2 at 150 (when p1 leaves; waits 130), p4 at once
        assert r["ran"] == 4 and r["never_ran"] == 1 and r["never_fit"] == 1
        assert r["wait_mean_s"] == pytest.approx((0 + 90 + 130 + 0) / 4)
        assert r["wait_gpu_weighted_s"] == pytest.approx((0 * 2 + 90 * 1 + 130 * 2) / 5)
        assert r["waited"] == 2
        # the window is 0..40 s: 2 of 2 GPUs allocated all the time, and a GPU pod waits from 10 s
        assert r["alloc_mean"] == pytest.approx(100.0)
        assert r["alloc_while_waiting"] == pytest.approx(100.0)
        assert r["waiting_share"] == pytest.approx(30 / 40)


def _reference(node_spec: list[tuple[str, int, int, int, str]], pods: list[TimedPod], policy: str, seed: int,
               end: float) -> list[float]:
    """The same queue, scoring every node at every retry (the slow, obvious way): each pod's start."""
    nodes = make_nodes(node_spec, seed)
    shapes = tuple(TaskShape(p.pod.ask.cpu, p.pod.ask.gpus, p.pod.ask.milli if p.pod.ask.gpus else 0,
                             p.pod.ask.models) for p in pods)
    ctx = Context(typical=typical_tasks(shapes), shapes=shapes, rng=random.Random(seed * 7919 + 1))
    profile = profiles()[policy]
    arrive = [p.created - pods[0].created for p in pods]
    start = [float("nan")] * len(pods)
    deps: list[tuple[float, int, object, tuple[int, ...]]] = []
    waiting: list[int] = []
    nxt = 0

    def go(i: int, t: float) -> bool:
        a = pods[i].pod.ask
        pick = schedule(nodes, a, profile, ctx)
        if pick is None:
            return False
        pick.node.take(pick.positions, a.milli if a.gpus else 0, a.cpu, a.mem)
        start[i] = t
        heapq.heappush(deps, (t + pods[i].run_s, i, pick.node, pick.positions))
        return True

    while True:
        t = min(arrive[nxt] if nxt < len(pods) else float("inf"), deps[0][0] if deps else float("inf"))
        if t > end or t == float("inf"):
            return start
        if deps and deps[0][0] <= t:
            while deps and deps[0][0] <= t:
                _, i, n, pos = heapq.heappop(deps)
                a = pods[i].pod.ask
                n.give(pos, a.milli if a.gpus else 0, a.cpu, a.mem)  # type: ignore[attr-defined]
            waiting = [i for i in waiting if not go(i, t)]
            continue
        while nxt < len(pods) and arrive[nxt] <= t:
            if not go(nxt, t):
                waiting.append(nxt)
            nxt += 1


@pytest.mark.parametrize("policy", ["fgd", "bestfit", "leastallocated"])
def test_retrying_only_the_nodes_that_freed_something_picks_as_scoring_every_node(policy: str) -> None:
    rng = random.Random(5)
    node_spec = [(f"n{i}", rng.choice([16000, 32000, 64000]), 262144, rng.choice([2, 4, 8]), rng.choice(["A", "B"]))
                 for i in range(12)]
    pods = []
    for i in range(400):
        gpus = rng.choice([0, 1, 1, 1, 2, 4, 8])
        milli = rng.choice([250, 500, 1000]) if gpus == 1 else 1000
        ask = Ask(cpu=rng.choice([1000, 4000, 8000]), mem=4096, gpus=gpus, milli=milli,
                  models=frozenset({"A"}) if rng.random() < 0.2 else frozenset())
        pods.append(TimedPod(Pod(f"p{i:03d}", ask), float(i * 3 + rng.randrange(3)), float(rng.randrange(1, 400))))
    pods.sort(key=lambda t: (t.created, t.pod.name))
    end = pods[-1].created - pods[0].created + 500
    r = run_dynamic(node_spec, pods, policy, 3, 1.0, 500, warmup=0)
    ref = _reference(node_spec, pods, policy, 3, end)
    arrive = [p.created - pods[0].created for p in pods]
    ref_waits = [s - a for s, a in zip(ref, arrive, strict=True) if s == s]
    assert r.waits == ref_waits and r.never_ran == sum(1 for s in ref if s != s)
    assert sum(1 for w in r.waits if w > 0) > 20  # the case is loaded enough that retries matter


def test_tuning_draws_pods_until_the_asked_gpu_reaches_the_ratio_and_keeps_their_shapes() -> None:
    base = [TimedPod(Pod(f"p{i}", Ask(gpus=1 + i % 2)), float(i * 10), 5.0 + i) for i in range(20)]
    out = tuned(base, 10_000, seed=1, ratio=6.0)
    assert sum(p.pod.ask.gpu_milli_total for p in out) >= 60_000
    assert sum(p.pod.ask.gpu_milli_total for p in out[:-1]) < 60_000 + 2_000  # no more than it takes
    shapes = {(p.pod.ask, p.run_s) for p in base}
    assert all((p.pod.ask, p.run_s) in shapes for p in out)
    assert [p.created for p in out] == sorted(p.created for p in out)
    assert out == tuned(base, 10_000, seed=1, ratio=6.0) and out != tuned(base, 10_000, seed=2, ratio=6.0)
    peak, mean = demand(base, 10_000, 1.0)
    assert peak == pytest.approx(0.5)  # pods 17, 18 and 19 (2 + 1 + 2 GPUs of 10) at 190 s
    assert 0 < mean < peak


needs_trace = pytest.mark.skipif(not (TRACE / "openb_node_list_gpu_node.csv").exists(),
                                 reason=f"the openb trace is not at {TRACE} (set GPUFLEET_SHARED)")


@needs_trace
def test_bench_placement_dynamic_cli_on_a_slice_of_the_trace(tmp_path: Path) -> None:
    node_lines = (TRACE / "openb_node_list_gpu_node.csv").read_text().splitlines()
    pod_lines = (TRACE / "openb_pod_list_default.csv").read_text().splitlines()
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("\n".join([node_lines[0], *node_lines[1::20]]) + "\n")
    pods = tmp_path / "openb_pod_list_slice.csv"
    pods.write_text("\n".join([pod_lines[0], *pod_lines[1::10]]) + "\n")
    plot = tmp_path / "dynamic.png"
    out = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli", "bench", "placement", "--dynamic", "--pods", str(pods),
         "--nodes", str(nodes), "--seeds", "1", "--json", "--plot", str(plot)],
        capture_output=True, text=True, timeout=300, check=True)
    doc = json.loads(out.stdout)
    assert doc["mode"] == "dynamic" and set(doc["policies"]) == {"leastallocated", "bestfit", "fgd", "fragaware"}
    measured = doc["pods"] - int(doc["warmup"] * doc["pods"])
    for r in doc["policies"].values():
        assert r["ran"] + r["never_ran"] == measured  # every pod accounted for
        assert 0 < r["alloc_mean"] <= 100 and len(r["curve"]) == 120
        assert r["wait_p50_s"] <= r["wait_p95_s"]
    assert doc["demand_peak"] > 1.0  # the defaults load the cluster past its size at the busiest time
    assert any(r["waited"] > 0 for r in doc["policies"].values())
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert "seed 1" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "gpufleet.cli", "bench", "placement", "--dynamic", "--pods",
                          str(pods), "--nodes", str(nodes), "--policies", "clustering"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "clustering" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "gpufleet.cli", "bench", "placement", "--dynamic", "--pods",
                          str(pods), "--nodes", str(nodes), "--compress", "0"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--compress" in bad.stderr


def test_least_allocated_spreads_where_best_fit_packs() -> None:
    busy = make_nodes([("busy", 32000, 65536, 4, "A")])[0]
    busy.take((0, 1), 1000, 8000, 8192)
    idle = make_nodes([("idle", 32000, 65536, 4, "A")])[0]
    ask = Ask(cpu=1000, mem=1024, gpus=1)
    assert feasible(busy, ask) and feasible(idle, ask)
    assert schedule([busy, idle], ask, profiles()["leastallocated"], Context()).node is idle  # type: ignore[union-attr]
    assert schedule([busy, idle], ask, profiles()["bestfit"], Context()).node is busy  # type: ignore[union-attr]
