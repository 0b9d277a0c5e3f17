"""The placement framework: filters, fragmentation (FGD's definition), score plugins, topology,
and `gpufleet bench placement` on a slice of the real trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpufleet.services.placer.frag import TaskShape, Typical, node_frag, task_frag, typical_tasks
from gpufleet.services.placer.framework import (
    FGD,
    Ask,
    BestFit,
    Context,
    FragAware,
    Node,
    Profile,
    Topology,
    profiles,
    schedule,
    spread,
    topology_gpus,
    why_not,
)

SHARED = Path(os.environ.get("GPUFLEET_SHARED", Path(__file__).resolve().parents[2] / "shared"))
TRACE = SHARED / "data" / "openb-v2023"


def node(name: str = "n", gpus: int = 8, model: str = "G2", cpu: int = 96_000, mem: int = 393_216,
         left: list[int] | None = None, **kw: Any) -> Node:
    return Node(node_id=name, model=model, gpu_ids=list(range(gpus)), left=list(left or [1000] * gpus),
                cpu_left=cpu, mem_left=mem, cpu_total=cpu, mem_total=mem, **kw)


def dgx(name: str = "dgx", nvswitch: bool = False) -> Node:
    """8 GPUs; 2 NVLink islands of 4 (or one NVSwitch fabric); 4 PCIe switches; 2 NUMA nodes."""
    return node(name, island=[0] * 8 if nvswitch else [0, 0, 0, 0, 1, 1, 1, 1],
                switch=[0, 0, 1, 1, 2, 2, 3, 3], numa=[0, 0, 0, 0, 1, 1, 1, 1])


# ---------------------------------------------------------------- filters


@pytest.mark.parametrize(("n", "ask", "removed_by"), [
    (node(healthy=False), Ask(gpus=1), "unhealthy"),
    (node(taints=frozenset({"maintenance"})), Ask(gpus=1), "taints"),
    (node(labels={"zone": "b"}), Ask(gpus=1, selector=(("zone", "a"),)), "labels"),
    (node(model="T4"), Ask(gpus=1, models=frozenset({"G2", "A100"})), "gpu_model"),
    (node(gpus=0, model=""), Ask(gpus=1), "gpu_model"),
    (node(cpu=4000), Ask(cpu=8000), "cpu"),
    (node(mem=1024), Ask(mem=2048), "memory"),
    (node(left=[1000] * 3 + [500] * 5), Ask(gpus=4), "gpu_count"),  # whole GPUs must be whole
    (node(left=[400] * 8), Ask(gpus=1, milli=500), "gpu_count"),  # no GPU with 500 milli free
], ids=["unhealthy", "tainted", "labels", "model", "cpu-node", "cpu", "memory", "whole-gpus", "share"])
def test_each_filter_removes_the_node_and_is_counted_by_name(n: Node, ask: Ask, removed_by: str) -> None:
    assert why_not([n], ask) == {removed_by: 1}
    assert schedule([n], ask, profiles()["bestfit"], Context()) is None


@pytest.mark.parametrize(("n", "ask"), [
    (node(taints=frozenset({"gpu-test"})), Ask(gpus=1, tolerations=frozenset({"gpu-test"}))),
    (node(labels={"zone": "a"}), Ask(gpus=1, selector=(("zone", "a"),))),
    (node(left=[1000] * 4 + [500] * 4), Ask(gpus=4)),
    (node(left=[300, 600]), Ask(gpus=1, milli=500)),
    (node(gpus=0, model=""), Ask(cpu=1000)),
], ids=["tolerated", "labels", "whole-gpus", "share", "cpu-only-on-cpu-node"])
def test_a_node_that_passes_every_filter_is_chosen(n: Node, ask: Ask) -> None:
    assert why_not([n], ask) == {}
    assert schedule([n], ask, profiles()["bestfit"], Context()) is not None


# ---------------------------------------------------------------- fragmentation (FGD's definition)

SHARE = TaskShape(cpu=4000, gpus=1, milli=500)
WHOLE2 = TaskShape(cpu=4000, gpus=2, milli=1000)


@pytest.mark.parametrize(("cpu_left", "left", "task", "frag"), [
    (96_000, [1000, 1000], SHARE, 0),  # it fits, and every GPU could take it
    (96_000, [1000, 300], SHARE, 300),  # the 300 left on GPU 1 cannot take a 500 share
    (96_000, [400, 300], SHARE, 700),  # it fits nowhere: all idle GPU is a fragment
    (2_000, [1000, 1000], SHARE, 2000),  # not enough CPU: all of it
    (96_000, [1000, 1000], WHOLE2, 0),
    (96_000, [1000, 900], WHOLE2, 1900),  # 2 whole GPUs do not fit
    (96_000, [1000, 1000], TaskShape(cpu=1000, gpus=0, milli=0), 2000),  # a CPU job uses no GPU
    (96_000, [1000, 1000], TaskShape(cpu=1000, gpus=1, milli=1000, models=frozenset({"T4"})), 2000),
], ids=["fits", "partial", "fits-nowhere", "no-cpu", "whole", "whole-no-fit", "cpu-task", "no-access"])
def test_task_fragmentation_follows_the_paper(cpu_left: int, left: list[int], task: TaskShape, frag: int) -> None:
    assert task_frag("G2", cpu_left, left, task) == frag
    assert node_frag("G2", cpu_left, left, (Typical(task, 1.0),)) == frag


def test_node_fragmentation_weights_the_typical_tasks() -> None:
    typical = (Typical(SHARE, 0.75), Typical(WHOLE2, 0.25))
    assert node_frag("G2", 96_000, [1000, 300], typical) == pytest.approx(0.75 * 300 + 0.25 * 1300)


def test_typical_tasks_are_the_most_frequent_covering_95_percent() -> None:
    shapes = [SHARE] * 90 + [WHOLE2] * 6 + [TaskShape(1, 1, 100)] * 4
    typical = typical_tasks(shapes)
    assert [t.shape for t in typical] == [SHARE, WHOLE2]  # 96 % covered, the rare one left out
    assert sum(t.weight for t in typical) == pytest.approx(1.0)
    assert typical[0].weight == pytest.approx(90 / 96)


# ---------------------------------------------------------------- scores


def test_fgd_puts_a_share_where_it_fragments_least() -> None:
    # typical: 500-milli shares. A 500 share on the node with a 500 hole fills it exactly;
    # on the empty node it would leave 500 (still usable) — both fine; on the 700 node it
    # would leave 200 that no typical task can use: the worst.
    ctx = Context(typical=(Typical(SHARE, 1.0),))
    a = Ask(cpu=1000, gpus=1, milli=500)
    nodes = [node("a", gpus=1, left=[700]), node("b", gpus=1, left=[500]), node("c", gpus=1, left=[1000])]
    scores = {n.node_id: FGD().evaluate(n, a, ctx)[0] for n in nodes}
    assert scores["a"] < scores["b"] and scores["a"] < scores["c"]
    pick = schedule(nodes, a, Profile("fgd", ((FGD(), 1.0),), chooser="fgd"), ctx)
    assert pick is not None and pick.node.node_id in ("b", "c")


def test_fgd_chooses_the_gpu_within_the_node_too() -> None:
    ctx = Context(typical=(Typical(SHARE, 1.0),))
    n = node("n", gpus=2, left=[700, 500])
    score, pos = FGD().evaluate(n, Ask(cpu=1000, gpus=1, milli=500), ctx)
    assert pos == (1,)  # the 500 hole, not the 700 GPU (which would leave a useless 200)


def test_fragaware_keeps_shared_gpus_apart_from_whole_ones() -> None:
    ctx = Context(typical=(Typical(SHARE, 0.5), Typical(TaskShape(4000, 1, 1000), 0.5)))
    shared = node("shared", gpus=4, left=[600, 1000, 1000, 1000])  # first in order
    clean = node("clean", gpus=4)
    fgd = Profile("fgd", ((FGD(), 1.0),), chooser="fgd")
    ours = Profile("ours", ((FragAware(), 1.0),), chooser="fragaware")
    whole = Ask(cpu=1000, gpus=1)
    assert schedule([shared, clean], whole, fgd, ctx).node is shared  # type: ignore[union-attr]  # a tie: first
    assert schedule([shared, clean], whole, ours, ctx).node is clean  # type: ignore[union-attr]
    share = Ask(cpu=1000, gpus=1, milli=500)
    pick = schedule([clean, shared], share, ours, ctx)
    assert pick is not None and pick.node is shared and pick.positions == (0,)  # the 600 GPU, not a whole one


def test_fragaware_drops_the_sharing_bonus_where_shares_are_the_majority() -> None:
    ctx = Context(typical=(Typical(SHARE, 0.6), Typical(TaskShape(4000, 1, 1000), 0.4)))
    shared = node("shared", gpus=4, left=[600, 1000, 1000, 1000])  # first in order
    clean = node("clean", gpus=4)
    whole = Ask(cpu=1000, gpus=1)
    ours = Profile("ours", ((FragAware(), 1.0),), chooser="fragaware")
    assert schedule([shared, clean], whole, ours, ctx).node is shared  # type: ignore[union-attr]  # as FGD: a tie
    always = Profile("always", ((FragAware(adapt="none"), 1.0),), chooser="fragaware")
    assert schedule([shared, clean], whole, always, ctx).node is clean  # type: ignore[union-attr]


def test_packing_prefers_partly_used_gpus_then_partly_used_nodes_then_idle_ones() -> None:
    idle = node("idle", gpus=4)
    some = node("some", gpus=4, left=[0, 0, 1000, 1000])
    shared = node("shared", gpus=4, left=[0, 600, 0, 0])
    share = Ask(cpu=1000, gpus=1, milli=500)
    p = profiles()["packing"]
    assert schedule([idle, some, shared], share, p, Context()).node is shared  # type: ignore[union-attr]
    assert schedule([idle, some], share, p, Context()).node is some  # type: ignore[union-attr]
    assert schedule([idle, some], Ask(cpu=1000, gpus=2), p, Context()).node is some  # type: ignore[union-attr]


def test_bestfit_prefers_the_fullest_node_and_normalises() -> None:
    a = Ask(cpu=1000, gpus=1)
    nodes = [node("empty"), node("half", left=[0] * 4 + [1000] * 4), node("full-ish", left=[0] * 7 + [1000])]
    pick = schedule(nodes, a, profiles()["bestfit"], Context())
    assert pick is not None and pick.node.node_id == "full-ish" and pick.score == 100
    assert BestFit().normalize


# ---------------------------------------------------------------- topology


@pytest.mark.parametrize(("left", "gpus", "islands"), [
    ([1000] * 8, 4, 1),  # one island
    ([1000] * 8, 2, 1),
    ([0, 1000, 1000, 1000, 0, 0, 1000, 1000], 2, 1),  # the island with exactly 2 free (best fit)
    ([0, 1000, 1000, 1000, 0, 1000, 1000, 1000], 4, 2),  # 3 + 3 free: it must span both
    ([1000] * 8, 8, 2),
], ids=["4-of-8", "2-of-8", "best-fit-island", "must-span", "all"])
def test_multi_gpu_jobs_span_the_fewest_nvlink_islands(left: list[int], gpus: int, islands: int) -> None:
    n = dgx()
    n.left = list(left)
    pos = topology_gpus(n, Ask(gpus=gpus))
    assert len(pos) == gpus and all(n.left[p] == 1000 for p in pos)
    assert spread(n, pos)[0] == islands


def test_a_two_gpu_job_stays_under_one_pcie_switch_and_numa_node() -> None:
    n = dgx(nvswitch=True)
    pos = topology_gpus(n, Ask(gpus=2))
    assert spread(n, pos) == (1, 1, 1)


def test_the_topology_score_prefers_the_node_where_the_job_fits_one_island() -> None:
    split = dgx("split")
    split.left = [0, 0, 1000, 1000, 0, 0, 1000, 1000]  # 4 free, 2 per island
    whole = dgx("whole")
    whole.left = [0, 0, 0, 0, 1000, 1000, 1000, 1000]  # 4 free in one island
    a = Ask(gpus=4)
    assert Topology().evaluate(whole, a, Context())[0] > Topology().evaluate(split, a, Context())[0]
    pick = schedule([split, whole], a, profiles()["topology"], Context())
    assert pick is not None and pick.node is whole and spread(whole, pick.positions)[0] == 1


def test_data_locality_prefers_the_node_with_the_dataset_cached() -> None:
    plain, cached = node("plain"), node("cached", datasets=frozenset({"imagenet"}))
    pick = schedule([plain, cached], Ask(gpus=1, dataset="imagenet"), profiles()["topology"], Context())
    assert pick is not None and pick.node is cached


# ---------------------------------------------------------------- the benchmark, on a slice of the trace

needs_trace = pytest.mark.skipif(not (TRACE / "openb_node_list_gpu_node.csv").exists(),
                                 reason=f"the openb trace is not at {TRACE} (set GPUFLEET_SHARED)")


def _slice(tmp_path: Path, nodes: int = 120, pods: int = 900) -> tuple[Path, Path]:
    """Every 10th node and the first pods, so a seed replays in a second."""
    node_lines = (TRACE / "openb_node_list_gpu_node.csv").read_text().splitlines()
    pod_lines = (TRACE / "openb_pod_list_default.csv").read_text().splitlines()
    n = tmp_path / "nodes.csv"
    n.write_text("\n".join([node_lines[0], *node_lines[1::10][:nodes]]) + "\n")
    p = tmp_path / "openb_pod_list_slice.csv"
    p.write_text("\n".join([pod_lines[0], *pod_lines[1:pods + 1]]) + "\n")
    return n, p


@needs_trace
def test_the_benchmark_replays_a_trace_and_fgd_beats_random(tmp_path: Path) -> None:
    from gpufleet.bench.placement import bench

    nodes, pods = _slice(tmp_path)
    doc = bench(pods, nodes, ["random", "bestfit", "fgd"], [42, 43])
    res = doc["policies"]
    for r in res.values():
        curve = [r["curve"][k] for k in range(0, 131)]
        assert all(0 <= v <= 100 for v in curve)
        assert all(r["curve"][k] <= k + 1.5 for k in range(0, 131))  # never more allocated than arrived
        assert r["alloc_130_mean"] > 50
    assert res["fgd"]["alloc_130_mean"] > res["random"]["alloc_130_mean"]
    assert res["fgd"]["frag_80_mean"] < res["random"]["frag_80_mean"]


@needs_trace
def test_the_benchmark_is_deterministic_per_seed(tmp_path: Path) -> None:
    from gpufleet.bench.placement import bench

    nodes, pods = _slice(tmp_path, nodes=60, pods=400)
    a = bench(pods, nodes, ["fgd"], [7])["policies"]["fgd"]
    b = bench(pods, nodes, ["fgd"], [7])["policies"]["fgd"]
    assert a["curve"] == b["curve"]


@needs_trace
def test_bench_placement_cli_json_and_plot(tmp_path: Path) -> None:
    nodes, pods = _slice(tmp_path, nodes=60, pods=400)
    plot = tmp_path / "curves.png"
    out = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli", "bench", "placement", "--pods", str(pods), "--nodes", str(nodes),
         "--policies", "bestfit,fgd,fragaware", "--seeds", "42-43", "--json", "--plot", str(plot),
         "--published", str(SHARED / "data" / "fgd-expected")],
        capture_output=True, text=True, timeout=300, check=True)
    doc = json.loads(out.stdout)
    assert set(doc["policies"]) == {"bestfit", "fgd", "fragaware"}
    for r in doc["policies"].values():
        assert {"alloc_130_mean", "alloc_130_std", "frag_80_mean", "seconds_per_seed"} <= set(r)
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert "seed 43" in out.stderr  # progress, per seed
    bad = subprocess.run([sys.executable, "-m", "gpufleet.cli", "bench", "placement", "--pods", str(pods),
                          "--nodes", str(nodes), "--policies", "magic"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown magic" in bad.stderr


def test_bench_decide_times_decisions_against_scoring_every_node() -> None:
    out = subprocess.run([sys.executable, "-m", "gpufleet.cli", "bench", "decide", "--nodes", "40", "--jobs", "30",
                          "--json"], capture_output=True, text=True, timeout=300, check=True)
    doc = json.loads(out.stdout)
    assert doc["nodes"] == 40 and doc["filled_gpus"] > 0
    for name in ("default", "default (every node)", "fragaware", "fragaware (every node)"):
        r = doc["profiles"][name]
        assert r["decisions"] == 30 and 0 < r["median_ms"] <= r["p99_ms"]
    assert doc["profiles"]["default"]["speedup_vs_every_node"] > 0


def test_every_profile_the_config_accepts_exists_and_a_bad_one_names_the_field() -> None:
    from typing import get_args

    from gpufleet.services.placer.core import PlacerCore
    from gpufleet.shared.contract.clusterconfig import PlacementConfig, parse_config
    from gpufleet.shared.contract.errors import SpecError

    names = get_args(PlacementConfig.model_fields["profile"].annotation)
    assert set(names) <= set(profiles())
    for name in names:
        assert PlacerCore(parse_config({"placement": {"profile": name}})).profile.name == name
    with pytest.raises(SpecError) as err:
        parse_config({"placement": {"profile": "magic"}})
    assert err.value.field == "placement.profile"


def test_trace_variants_are_cpu_or_gpu_heavier_workloads_of_the_same_family() -> None:
    from gpufleet.bench.placement import Pod, variant

    pods = [Pod(f"c{i}", Ask(cpu=4000, mem=1024)) for i in range(10)] + \
           [Pod(f"g{i}", Ask(cpu=8000, mem=1024, gpus=1, milli=500)) for i in range(5)]
    heavier = variant(pods, "cpu-only", 2.5, seed=1)
    assert sum(1 for p in heavier if not p.ask.gpus) == 25 and sum(1 for p in heavier if p.ask.gpus) == 5
    assert len({p.name for p in heavier}) == len(heavier)  # every draw named apart
    assert heavier == variant(pods, "cpu-only", 2.5, seed=1) != variant(pods, "cpu-only", 2.5, seed=2)
    assert sum(1 for p in variant(pods, "cpu-only", 0) if not p.ask.gpus) == 0
    lighter = variant(pods, "cpu-per-gpu", 0.5)
    assert {p.ask.cpu for p in lighter if p.ask.gpus} == {4000} and {p.ask.cpu for p in lighter if not p.ask.gpus} == {4000}
    with pytest.raises(ValueError, match="unknown kind"):
        variant(pods, "memory", 2)
