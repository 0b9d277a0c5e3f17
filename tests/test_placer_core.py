"""The placer core with the framework: GPU topology on a DGX-like node, gangs across racks,
shares of a GPU, taints and labels, data locality, and EASY backfill (which never delays the
job it reserved for: a property test)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpufleet.services.placer.core import PlacerCore, PlacerState
from gpufleet.shared.contract.clusterconfig import parse_config
from gpufleet.shared.contract.events import (
    GpuDevice,
    JobBackfillReserved,
    JobPlaced,
    JobUnschedulable,
    NodeDatasetsCached,
    NodeInventory,
    NodeRegistered,
)

from .builders import T0, Harness, event, exited, make_job, node, placed, quota_reserved, submitted


def dgx(node_id: str, rack: str = "r1", leaf: str | None = None, nvswitch: bool = False,
        taints: tuple[str, ...] = ()) -> Any:
    """8 H100: 2 NVLink islands of 4 (or one NVSwitch), a PCIe switch per pair, 2 NUMA nodes."""
    gpus = tuple(GpuDevice(index=i, uuid=f"GPU-{node_id}-{i}", model="H100", memory_mib=80 * 1024,
                           nvlink_island=0 if nvswitch else i // 4, pcie_switch=i // 2, numa_node=i // 4)
                 for i in range(8))
    labels = {"rack": rack, "leaf": leaf or f"leaf-{rack}"}
    return event(NodeRegistered(node_id=node_id, inventory=NodeInventory(
        cpu_milli=96_000, memory_mib=1024 * 1024, gpus=gpus, numa_nodes=2, labels=labels, taints=taints)))


def place(h: Harness[PlacerState], job: Any, job_id: str, at_s: float = 0) -> list[Any]:
    h.given(submitted(job, job_id))
    return h.when(quota_reserved(job, job_id), T0 + timedelta(seconds=at_s))


def allocs(out: list[Any]) -> list[Any]:
    (p,) = [e.payload for e in out if isinstance(e.payload, JobPlaced)]
    return list(p.allocations)


# ---------------------------------------------------------------- topology


def test_a_four_gpu_job_gets_one_nvlink_island_and_the_next_one_the_other() -> None:
    h = Harness(PlacerCore()).given(dgx("d1"))

    (a,) = allocs(place(h, make_job().gpus(2), "two"))
    assert a.gpu_indices in ((0, 1), (2, 3), (4, 5), (6, 7))  # one PCIe switch, one island
    (b,) = allocs(place(h, make_job().gpus(4), "four"))
    island = {g // 4 for g in b.gpu_indices}
    assert len(island) == 1 and island != {a.gpu_indices[0] // 4}  # the whole other island, not 2 + 2


def test_a_two_gpu_job_fills_the_island_with_two_free_before_splitting_one_with_four() -> None:
    h = Harness(PlacerCore()).given(dgx("d1"))
    place(h, make_job().gpus(2), "a")  # island 0 has 2 left, island 1 has 4
    (b,) = allocs(place(h, make_job().gpus(2), "b"))
    assert {g // 4 for g in b.gpu_indices} == {0}  # best fit by island: island 1 stays whole
    (c,) = allocs(place(h, make_job().gpus(4), "c"))
    assert sorted(c.gpu_indices) == [4, 5, 6, 7]


def test_a_gang_keeps_to_one_leaf_switch() -> None:
    # node order interleaves the racks: without gang locality replica 1 would go to a1
    h = Harness(PlacerCore()).given(dgx("b1", rack="b"), dgx("a1", rack="a"), dgx("a2", rack="a"), dgx("b2", rack="b"))

    got = allocs(place(h, make_job().gpus(8).replicas(2), "gang"))

    racks = {a.node_id[0] for a in got}
    assert len(got) == 2 and len(racks) == 1 and len({a.node_id for a in got}) == 2


def test_a_gang_of_many_small_replicas_packs_onto_few_nodes() -> None:
    h = Harness(PlacerCore()).given(*(dgx(f"n{i}") for i in range(4)))

    got = allocs(place(h, make_job().gpus(2).replicas(4), "g"))

    assert len({a.node_id for a in got}) == 1  # 4 x 2 GPUs on one node, over NVLink


def spine_dgx(node_id: str, rack: str, spine: str) -> Any:
    env = dgx(node_id, rack=rack)
    inv = env.payload.inventory
    return event(NodeRegistered(node_id=node_id, inventory=inv.model_copy(
        update={"labels": {**inv.labels, "spine": spine}})))


def test_a_required_leaf_takes_the_leaf_that_fits_tightest_not_the_first() -> None:
    # leaf-a has 3 free nodes, leaf-b exactly 2: a 2 x 8 gang required within one leaf goes to b,
    # which keeps a's 3 whole nodes for a bigger gang (the first leaf found would be a)
    h = Harness(PlacerCore()).given(dgx("a1", rack="a"), dgx("a2", rack="a"), dgx("a3", rack="a"),
                                    dgx("b1", rack="b"), dgx("b2", rack="b"))
    gang = make_job().gpus(8).replicas(2).set("topology", {"required": "leaf"})

    got = allocs(place(h, gang, "g2"))
    assert sorted(a.node_id for a in got) == ["b1", "b2"]
    # then a 3 x 8 gang still has a leaf of its own
    assert sorted(a.node_id for a in allocs(place(h, gang.replicas(3), "g3"))) == ["a1", "a2", "a3"]


def test_a_required_rack_places_nothing_across_racks_and_says_which_rack_came_closest() -> None:
    h = Harness(PlacerCore()).given(dgx("a1", rack="a"), dgx("a2", rack="a"), dgx("b1", rack="b"),
                                    dgx("b2", rack="b"), dgx("b3", rack="b"))
    place(h, make_job().gpus(8).set("nodeSelector", {"rack": "b"}), "busy")  # b: 2 nodes left
    place(h, make_job().gpus(4).set("nodeSelector", {"rack": "a"}), "half")  # a: 1 whole node, 1 half
    bound = make_job().gpus(8).replicas(3).set("topology", {"required": "rack"})

    out = place(h, bound, "g")

    assert not [e for e in out if isinstance(e.payload, JobPlaced)]  # 3 whole nodes free in all, not in one rack
    [u] = [e.payload for e in out if isinstance(e.payload, JobUnschedulable)]
    [reason] = u.reasons
    assert reason.code == "topology", reason
    assert "no rack of 2 holds them all now; the closest, b (3 nodes), has room for 2" in reason.message
    assert "within one rack (topology.required)" in reason.message
    # unbound, the same gang fits across the racks
    assert len(allocs(place(h, make_job().gpus(8).replicas(3), "free"))) == 3


def test_a_gang_that_no_domain_could_ever_hold_fails_and_says_so() -> None:
    from gpufleet.shared.contract.events import JobFailed

    h = Harness(PlacerCore()).given(dgx("a1", rack="a"), dgx("a2", rack="a"), dgx("b1", rack="b"))
    out = place(h, make_job().gpus(8).replicas(3).set("topology", {"required": "leaf"}), "g")
    [f] = [e.payload for e in out if isinstance(e.payload, JobFailed)]
    assert f.reason.code == "never_fits" and "within one leaf (topology.required)" in f.reason.message


def test_required_spine_and_preferred_rack() -> None:
    # spine s1: 3 nodes (racks r1, r2, r1), s2: 4 nodes: a gang of 2 within one spine goes to the
    # tighter s1, and within it to one rack (preferred), not across r1 and r2
    nodes = [spine_dgx("y1", "r2", "s1"), spine_dgx("x1", "r1", "s1"), spine_dgx("x2", "r1", "s1"),
             *(spine_dgx(f"z{i}", "r3", "s2") for i in range(4))]
    h = Harness(PlacerCore()).given(*nodes)
    gang = make_job().gpus(8).replicas(2).set("topology", {"required": "spine", "preferred": "rack"})
    got = allocs(place(h, gang, "g"))
    assert {a.node_id for a in got} == {"x1", "x2"}


def test_required_leaf_on_the_sim_mix_keeps_every_gang_under_one_leaf() -> None:
    # the sim fleet of 64 nodes: 4 racks (leaf switches) of 16 in the default shape mix. Gangs
    # bound to a leaf fill it, every replica under one leaf; unbound gangs of the same size at
    # the same load may spread.
    from gpufleet.shared.node.cluster import sim_fleet

    fleet = sim_fleet(64)
    leaf_of = {n: inv.labels["leaf"] for n, inv in fleet.items()}

    def leaves(topology: dict[str, str] | None) -> list[set[str]]:
        h = Harness(PlacerCore()).given(*(event(NodeRegistered(node_id=n, inventory=inv)) for n, inv in fleet.items()))
        job = make_job().gpus(2).replicas(6)
        out = []
        for i in range(14):
            got = allocs(place(h, job.set("topology", topology) if topology else job, f"g{i}"))
            assert len(got) == 6
            out.append({leaf_of[a.node_id] for a in got})
        return out

    assert all(len(x) == 1 for x in leaves({"required": "leaf"}))
    assert any(len(x) > 1 for x in leaves(None))  # (greedy locality alone spreads some of them)


def test_preferred_wider_than_required_is_refused_naming_the_field() -> None:
    import pytest
    from pydantic import ValidationError

    from gpufleet.shared.contract.spec import JobSpec

    with pytest.raises(ValidationError, match="preferred: spine is wider than required: leaf"):
        JobSpec.model_validate({"name": "a", "tenant": "t", "topology": {"required": "leaf", "preferred": "spine"}})
    with pytest.raises(ValidationError, match="topology.required"):
        JobSpec.model_validate({"name": "a", "tenant": "t", "topology": {"required": "pod"}})


# ---------------------------------------------------------------- shares, taints, labels, locality


def test_shares_of_a_gpu_pack_onto_one_gpu_and_leave_whole_gpus_whole() -> None:
    h = Harness(PlacerCore()).given(node("n1", gpus=2))
    share = make_job().res("gpu", 0.5).res("gpuSharing", "shared")

    (a,) = allocs(place(h, share, "s1"))
    (b,) = allocs(place(h, share, "s2"))
    assert a.gpu_milli == b.gpu_milli == 500 and a.gpu_indices == b.gpu_indices  # the same GPU, shared
    (c,) = allocs(place(h, make_job().gpus(1), "whole"))
    assert c.gpu_indices != a.gpu_indices and c.gpu_milli == 1000
    out = place(h, share, "s3")
    assert not any(isinstance(e.payload, JobPlaced) for e in out)
    (d,) = allocs(h.when(exited("s1", "n1")))  # s1's half comes back, and the waiting share takes it
    assert d.gpu_indices == a.gpu_indices and h.state.nodes["n1"].left == [0, 0]


def test_taints_need_a_toleration_and_labels_a_selector() -> None:
    h = Harness(PlacerCore()).given(dgx("tainted", taints=("maintenance",)), dgx("plain", rack="zone-b"))

    (a,) = allocs(place(h, make_job().gpus(1).set("nodeSelector", {"rack": "zone-b"}), "sel"))
    assert a.node_id == "plain"
    (b,) = allocs(place(h, make_job().gpus(8).set("tolerations", ["maintenance"]), "tol"))
    assert b.node_id == "tainted"
    out = place(h, make_job().gpus(8), "plain-job")  # plain has 7 free; tainted is not tolerated
    unsched = [e.payload for e in out if e.type == "job.unschedulable"]
    assert unsched and unsched[0].filtered.get("taints") == 1


def test_a_job_goes_where_its_dataset_is_cached() -> None:
    h = Harness(PlacerCore()).given(dgx("n1"), dgx("n2"), dgx("n3"),
                                    event(NodeDatasetsCached(node_id="n3", datasets=("imagenet",))))

    (a,) = allocs(place(h, make_job().gpus(4).set("dataset", "imagenet"), "j"))

    assert a.node_id == "n3"


def test_a_job_whose_selector_no_node_matches_fails_instead_of_holding_quota() -> None:
    h = Harness(PlacerCore()).given(dgx("n1"))
    out = place(h, make_job().gpus(1).set("nodeSelector", {"rack": "nowhere"}), "j")
    assert [e.type for e in out] == ["job.failed"] and out[0].payload.reason.code == "never_fits"


# ---------------------------------------------------------------- backfill (EASY)

HOUR = 3600.0


def _busy_cluster(backfill: bool = True, reservations: int = 1) -> Harness[PlacerState]:
    """n1 and n2 (8 H100 each) run one 8-GPU job each, ending in 1 h and 3 h; n3 is free."""
    h = Harness(PlacerCore(parse_config({"placement": {"backfill": backfill, "reservations": reservations}}))).given(
        node("n1"), node("n2"), node("n3"))
    for job_id, node_id, hours in (("r1", "n1", 1), ("r2", "n2", 3)):
        job = make_job().gpus(8).max_runtime(f"{hours}h")
        # placed at T0 exactly (an event's default time drifts with the events made before it in the session)
        h.given(submitted(job, job_id), quota_reserved(job, job_id), placed(job_id, (node_id, range(8)), at=T0))
    return h


def test_the_head_job_gets_a_reservation_and_small_jobs_only_use_the_holes() -> None:
    h = _busy_cluster()
    head = make_job().gpus(8).replicas(2).max_runtime("10h")  # needs n1 (in 1 h) and n3
    out = place(h, head, "head")
    (res,) = [e.payload for e in out if isinstance(e.payload, JobBackfillReserved)]
    assert res.nodes == ("n1", "n3")
    assert abs((res.estimated_start - (T0 + timedelta(hours=1))).total_seconds()) < 1  # when r1 ends

    # n3 is free now, but reserved from 1 h: a 30-min job runs there, a 2-hour one does not
    short = allocs(place(h, make_job().gpus(4).max_runtime("30m"), "short"))
    assert short[0].node_id == "n3"
    out = place(h, make_job().gpus(4).max_runtime("2h"), "long")
    assert not any(isinstance(e.payload, JobPlaced) for e in out)
    # ...and it is told why, naming the job the nodes are held for (explain reads this)
    (why,) = [e.payload for e in out if isinstance(e.payload, JobUnschedulable)]
    assert [r.code for r in why.reasons] == ["backfill_reservation"] and "held for head" in why.reasons[0].message
    assert why.filtered == {"backfill_reservation": 2}
    # the short job ends: "long" is tried again, still waits, and does not say it again
    out = h.when(exited("short", "n3"), T0 + timedelta(minutes=30))
    assert not [e for e in out if e.job_id == "long"]
    # then r1 ends, on time, and the head starts, as estimated
    out = h.when(exited("r1", "n1"), T0 + timedelta(hours=1))
    assert [e.job_id for e in out if isinstance(e.payload, JobPlaced)] == ["head"]
    assert {a.node_id for a in allocs(out)} == {"n1", "n3"}


def test_a_reservation_holds_the_gpus_the_head_needs_not_the_whole_node() -> None:
    # n1 has 16 GPUs: "a" holds 8 for 1 h, "b" 4 for 5 h; the head needs 10, so it waits for "a"
    # (reserved: n1 from 1 h). A 4-hour job on 2 of the 4 free GPUs leaves the head its 10 at 1 h:
    # it runs now. One on all 4 would not: it waits. The head starts at 1 h as estimated.
    h = Harness(PlacerCore()).given(node("n1", gpus=16))
    for job_id, gpus, hours in (("a", 8, 1), ("b", 4, 5)):
        job = make_job().gpus(gpus).max_runtime(f"{hours}h")
        h.given(submitted(job, job_id), quota_reserved(job, job_id),
                placed(job_id, ("n1", range(8) if job_id == "a" else range(8, 12)), at=T0))
    head = make_job().gpus(10).max_runtime("10h")
    (res,) = [e.payload for e in place(h, head, "head") if isinstance(e.payload, JobBackfillReserved)]
    assert res.nodes == ("n1",)

    (small,) = allocs(place(h, make_job().gpus(2).max_runtime("4h"), "small"))
    assert small.node_id == "n1"
    out = place(h, make_job().gpus(2).max_runtime("4h"), "too-much")  # 12 - 4 = 8 < 10 at 1 h
    assert not any(isinstance(e.payload, JobPlaced) for e in out)
    assert [r.code for e in out if isinstance(e.payload, JobUnschedulable) for r in e.payload.reasons] == [
        "backfill_reservation"]
    out = h.when(exited("a", "n1"), T0 + timedelta(hours=1))
    assert [e.job_id for e in out if isinstance(e.payload, JobPlaced)] == ["head"]


def test_without_backfill_protection_a_small_job_delays_the_big_one() -> None:
    # the same story with backfill off: the 2-hour job takes n3 and the head's start slips
    h = _busy_cluster(backfill=False)
    core = h.core
    assert isinstance(core, PlacerCore)
    head = make_job().gpus(8).replicas(2).max_runtime("10h")
    place(h, head, "head")
    before = core.estimate(h.state, head.spec(), T0.timestamp())
    assert allocs(place(h, make_job().gpus(4).max_runtime("2h"), "long"))[0].node_id == "n3"
    after = core.estimate(h.state, head.spec(), T0.timestamp())
    assert before is not None and after is not None and after[0] > before[0]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    running=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 12)), min_size=1, max_size=6),
    heads=st.lists(st.tuples(st.integers(6, 8), st.integers(2, 3), st.integers(1, 6)), min_size=1, max_size=3),
    k=st.integers(1, 3),
    arrivals=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 16)), min_size=1, max_size=8),
)
# found by this test: b0 took GPUs of a reserved node, the head's start then rested on two other
# nodes, and b1 took one of them unchecked (the check ran only for jobs landing on reserved nodes)
@example(running=[(4, 2), (5, 1), (5, 1)], heads=[(6, 2, 1)], k=1, arrivals=[(3, 2), (3, 2)])
def test_backfill_never_delays_a_reserved_job(running: list[tuple[int, int]], heads: list[tuple[int, int, int]],
                                              k: int, arrivals: list[tuple[int, int]]) -> None:
    """Random running jobs (GPUs, hours left) on 4 nodes, up to three gangs (GPUs, replicas,
    hours) that do not fit now, the first `k` of them reserved (1: EASY, more: conservative
    backfill), then random smaller jobs (GPUs, hours): whatever backfill lets in, no reserved
    job's estimated start moves later."""
    core = PlacerCore(parse_config({"placement": {"reservations": k}}))
    h = Harness(core).given(*(node(f"n{i}") for i in range(4)))
    for i, (gpus, hours) in enumerate(running):
        job = make_job().gpus(gpus).max_runtime(f"{hours}h")
        out = place(h, job, f"r{i}")
        if not any(isinstance(e.payload, JobPlaced) for e in out):
            h.given(event(_ended(f"r{i}")))  # it did not fit: drop it
    for i, (gpus, replicas, hours) in enumerate(heads):
        out = place(h, make_job().gpus(gpus).replicas(replicas).max_runtime(f"{hours}h"), f"head{i}")
        if any(isinstance(e.payload, JobPlaced) for e in out):
            h.given(event(_ended(f"head{i}")))  # it fitted at once: nothing to protect; it goes
    reserved = h.state.reserved()
    assert len(reserved) <= k
    if not reserved:
        return  # nothing waits (or nothing could ever fit)
    starts = {r.job_id: r.start_s for r in reserved}
    for i, (gpus, hours) in enumerate(arrivals):
        place(h, make_job().gpus(gpus).max_runtime(f"{hours}h"), f"b{i}")
        for j, r in enumerate(reserved):
            spec = h.state.jobs[r.job_id].spec
            assert spec is not None
            est = core.estimate(h.state, spec, T0.timestamp(), reserved[:j])
            assert est is not None and est[0] <= starts[r.job_id], (i, r.job_id, est, starts)


def test_conservative_backfill_reserves_the_first_k_waiting_jobs_each_beside_those_ahead() -> None:
    """n1 frees in 1 h, n2 in 3 h, half of n3 in 5 h. g1 (2 x 8 GPUs, 2 h) is reserved on n1 + n2
    at 3 h; g2 (3 x 8 GPUs) can start only once g1 and n3's job end, at 5 h, on all three. A
    4-GPU job of 10 h fits now on n3's free half, beside g1's reservation but in g2's way: with
    reservations: 2 it waits, with EASY (the head only) it is placed and g2 starts later."""
    def cluster(k: int) -> Harness[PlacerState]:
        h = Harness(PlacerCore(parse_config({"placement": {"reservations": k}}))).given(
            node("n1"), node("n2"), node("n3"))
        for job_id, node_id, gpus, hours in (("r1", "n1", 8, 1), ("r2", "n2", 8, 3), ("r3", "n3", 4, 5)):
            job = make_job().gpus(gpus).max_runtime(f"{hours}h")
            h.given(submitted(job, job_id), quota_reserved(job, job_id), placed(job_id, (node_id, range(gpus)), at=T0))
        place(h, make_job().gpus(8).replicas(2).max_runtime("2h"), "g1")
        place(h, make_job().gpus(8).replicas(3).max_runtime("1h"), "g2")
        return h

    h = cluster(2)
    got = [(r.job_id, r.nodes, r.start_s - T0.timestamp()) for r in h.state.reserved()]
    assert got == [("g1", ("n1", "n2"), 3 * 3600.0), ("g2", ("n1", "n2", "n3"), 5 * 3600.0)]
    out = place(h, make_job().gpus(4).max_runtime("10h"), "x")
    assert [r.code for e in out if isinstance(e.payload, JobUnschedulable) for r in e.payload.reasons] == [
        "backfill_reservation"]
    assert "held for g2" in next(r.message for e in out if isinstance(e.payload, JobUnschedulable) for r in e.payload.reasons)
    assert [e.job_id for e in place(h, make_job().gpus(4).max_runtime("4h"), "short")] == ["short"]  # ends by 5 h
    easy = cluster(1)
    assert [r.job_id for r in easy.state.reserved()] == ["g1"]
    (x,) = allocs(place(easy, make_job().gpus(4).max_runtime("10h"), "x"))
    assert x.node_id == "n3"  # g2, unreserved, now waits for x too


def _ran(h: Harness[PlacerState], job: Any, job_id: str, node_id: str, gpus: int, runtime_s: float) -> None:
    """A job of the past: placed on node_id and completed after runtime_s."""
    from gpufleet.shared.contract.events import JobExited, JobSucceeded

    h.given(submitted(job, job_id), quota_reserved(job, job_id), placed(job_id, (node_id, range(gpus))),
            event(JobExited(job_id=job_id, node_id=node_id, exit_code=0, runtime_s=runtime_s)),
            event(JobSucceeded(job_id=job_id)))


def test_a_job_without_a_max_runtime_is_estimated_from_the_tenants_similar_runs() -> None:
    """etl (8 GPUs, no maxRuntime) completed in 600 and 1,200 s: a third etl running on n1 is
    expected to end 1,200 s after its placement, not 24 h; the head (3 x 8 GPUs) is reserved for
    then and says so. A job whose similar runs took 60 s backfills on the free n3; one with no
    history (24 h) waits, told why. Past its estimate, a job is expected at its limit."""
    from gpufleet.services.placer.core import runtime_estimate

    h = Harness(PlacerCore()).given(node("n1"), node("n2"), node("n3"))
    etl, quick = make_job("etl").gpus(8), make_job("quick").gpus(4)
    for i, (job, gpus, runtime) in enumerate(((etl, 8, 600.0), (etl, 8, 1200.0), (quick, 4, 60.0), (quick, 4, 45.0))):
        _ran(h, job, f"past-{i}", "n1", gpus, runtime)
    assert runtime_estimate(h.state, etl.spec()) == (1200.0, "the longest of 2 similar runs")
    assert runtime_estimate(h.state, make_job("etl", tenant="beta").gpus(8).spec())[0] == 86400.0  # not beta's
    assert runtime_estimate(h.state, make_job("etl").gpus(4).spec())[0] == 86400.0  # other GPUs: not similar
    assert runtime_estimate(h.state, make_job("etl").gpus(8).max_runtime("2h").spec()) == (7200.0, "maxRuntime")

    h.given(submitted(etl, "etl-3"), quota_reserved(etl, "etl-3"), placed("etl-3", ("n1", range(8)), at=T0))
    short = make_job("svc").gpus(8).max_runtime("10m")
    h.given(submitted(short, "svc"), quota_reserved(short, "svc"), placed("svc", ("n2", range(8)), at=T0))
    out = place(h, make_job("big").gpus(8).replicas(3).max_runtime("5h"), "head")
    (res,) = [e.payload for e in out if isinstance(e.payload, JobBackfillReserved)]
    assert abs((res.estimated_start - (T0 + timedelta(seconds=1200))).total_seconds()) < 1
    assert (res.after_job, res.after_from) == ("etl-3", "the longest of 2 similar runs")
    assert (res.runtime_s, res.runtime_from) == (5 * 3600.0, "maxRuntime")

    (q,) = allocs(place(h, quick, "quick-3"))  # expected to run 60 s: ends long before the head starts
    assert q.node_id == "n3"
    out = place(h, make_job("unknown").gpus(4), "unknown")
    (why,) = [e.payload for e in out if isinstance(e.payload, JobUnschedulable)]
    assert why.reasons[0].code == "backfill_reservation" and "the default limit" in why.reasons[0].message

    # etl-3 runs past its estimate: now it is expected at its limit, and the head's start moves with it
    late = T0.timestamp() + 1300
    assert dict((j, e) for e, j in h.state.ending(late))["etl-3"] == T0.timestamp() + 86400
    assert dict((j, e) for e, j in h.state.ending(T0.timestamp()))["etl-3"] == T0.timestamp() + 1200


def test_the_runtimes_learned_are_bounded() -> None:
    from gpufleet.services.placer.core import RUNTIME_KEYS, RUNTIME_RUNS

    state = PlacerState()
    for i in range(RUNTIME_KEYS + 10):
        for k in range(RUNTIME_RUNS + 3):
            state.learn_runtime(make_job(f"kind-{i}").gpus(1).spec(), float(k))
    assert len(state.runtimes) == RUNTIME_KEYS
    assert ("acme", "kind-0", 1) not in state.runtimes  # the least recently completed kinds went first
    assert state.runtimes[("acme", f"kind-{RUNTIME_KEYS + 9}", 1)] == tuple(
        float(k) for k in range(3, RUNTIME_RUNS + 3))  # the last RUNTIME_RUNS runs, newest last


def _ended(job_id: str) -> Any:
    from gpufleet.shared.contract.events import JobCancelled

    return JobCancelled(job_id=job_id, reason="test: did not fit")


def test_a_quarantined_gpu_takes_nothing_new_and_what_ran_there_ends_cleanly() -> None:
    from gpufleet.shared.contract.events import NodeGpuUnhealthy, NodeGpuZombieDetected

    h = Harness(PlacerCore()).given(dgx("d1"))
    (a,) = allocs(place(h, make_job().gpus(1), "before"))
    h.given(event(NodeGpuZombieDetected(node_id="d1", gpu_index=a.gpu_indices[0], pid=4242, used_mib=2048)),
            event(NodeGpuUnhealthy(node_id="d1", gpu_index=7, reason="XID 79")))
    (b,) = allocs(place(h, make_job().gpus(6), "six"))
    assert a.gpu_indices[0] not in b.gpu_indices and 7 not in b.gpu_indices
    out = place(h, make_job().gpus(1), "one-more")  # 8 - 2 quarantined - 6 = 0 left
    assert not any(isinstance(e.payload, JobPlaced) for e in out)
    h.when(exited("before", "d1"))  # the zombie's GPU does not come back with the job's end
    assert h.state.nodes["d1"].gpus_total == 6


def test_an_operator_returns_an_unhealthy_gpu_and_telemetrys_check_does_not() -> None:
    from gpufleet.shared.contract.events import NodeGpuCleared, NodeGpuUnhealthy

    h = Harness(PlacerCore()).given(dgx("d1"), event(NodeGpuUnhealthy(node_id="d1", gpu_index=7, reason="XID 79")))
    assert h.state.nodes["d1"].gpus_total == 7
    h.given(event(NodeGpuCleared(node_id="d1", gpu_index=7)))  # telemetry's occupancy check: not for unhealthy
    assert h.state.nodes["d1"].gpus_total == 7
    h.given(event(NodeGpuCleared(node_id="d1", gpu_index=7, reason="replaced", returned=True), actor="admin/ops"))
    assert h.state.nodes["d1"].gpus_total == 8 and "d1" not in h.state.quarantined
    (a,) = allocs(place(h, make_job().gpus(8), "all"))
    assert 7 in a.gpu_indices


def test_an_allocation_names_the_numa_node_of_its_gpus() -> None:
    h = Harness(PlacerCore()).given(dgx("d1"))
    place(h, make_job().gpus(4), "first")
    (b,) = allocs(place(h, make_job().gpus(4), "second"))
    assert b.numa_node == b.gpu_indices[0] // 4 and {g // 4 for g in b.gpu_indices} == {b.numa_node}


async def test_gpu_shares_run_side_by_side_through_the_mesh(bus: Any, nats_url: str) -> None:
    """Four quarter-GPU jobs on a node with one GPU: all placed at once, on the same GPU."""
    from gpufleet.services.admission.core import AdmissionCore
    from gpufleet.services.executor.core import ExecutorCore
    from gpufleet.services.guardian.core import GuardianCore
    from gpufleet.services.quota.core import QuotaCore
    from gpufleet.shared.contract.events import GpuDevice, NodeInventory

    from .helpers import new_id, nodes_registered, read_log, running, submit_cmd, wait_until

    fleet = {"one": NodeInventory(cpu_milli=32_000, memory_mib=65_536, gpus=(
        GpuDevice(index=0, uuid="GPU-one-0", model="A10", memory_mib=24 * 1024),))}
    spec = {"name": "q", "tenant": "acme", "resources": {"gpu": 0.25, "gpuSharing": "shared", "cpu": 1},
            "sim": {"duration": "1s"}}
    ids = [new_id() for _ in range(5)]
    async with running(nats_url, [AdmissionCore(), QuotaCore(), PlacerCore(), ExecutorCore(fleet), GuardianCore()]):
        await wait_until(lambda: nodes_registered(bus), timeout_s=10)
        for job_id in ids:
            await bus.publish(submit_cmd(spec, job_id=job_id))

        async def done() -> bool:
            return sum(1 for _, e in await read_log(bus) if e.type == "job.succeeded") == len(ids)

        await wait_until(done, timeout_s=30)
    log = [e for _, e in await read_log(bus)]
    placements = [e.payload for e in log if isinstance(e.payload, JobPlaced)]
    assert all(p.allocations[0].gpu_indices == (0,) and p.allocations[0].gpu_milli == 250 for p in placements)
    # the first four ran together: each was placed before any of them ended
    first_end = next(i for i, e in enumerate(log) if e.type == "job.exited")
    assert sum(1 for e in log[:first_end] if e.type == "job.placed") == 4


# ---------------------------------------------------------------- random histories


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.one_of(
    st.tuples(st.just("job"), st.sampled_from([1, 2, 4, 8, 0.25, 0.5, 0.75, 0]), st.integers(1, 3)),
    st.tuples(st.just("end"), st.integers(0, 40), st.just(0)),
    st.tuples(st.just("cordon"), st.integers(0, 3), st.just(0)),
), min_size=1, max_size=40))
def test_no_gpu_is_ever_given_beyond_its_capacity(steps: list[tuple[str, Any, int]]) -> None:
    """Random jobs (whole GPUs, shares, CPU-only, gangs), ends and cordons on 4 nodes: the milli
    handed out per GPU never exceeds 1000, CPU and memory never go below zero, and the placer's
    free resources always equal capacity minus what the live allocations hold."""
    from gpufleet.shared.contract.events import JobSucceeded

    h = Harness(PlacerCore()).given(dgx("d0"), dgx("d1"), node("n2", gpus=2), node("n3", gpus=4, model="A100"))
    live: list[str] = []
    for i, (kind, value, replicas) in enumerate(steps):
        if kind == "job":
            res: dict[str, Any] = {"cpu": 8, "memory": "64Gi"}
            if value and value < 1:
                res |= {"gpu": value, "gpuSharing": "shared"}
            else:
                res["gpu"] = value
            job = make_job().set("resources", res).replicas(replicas if value and value >= 1 else 1)
            out = place(h, job, f"j{i}", at_s=i)
            if any(isinstance(e.payload, JobPlaced) for e in out):
                live.append(f"j{i}")
        elif kind == "end" and live:
            gone = live.pop(value % len(live))
            out = h.when(event(JobSucceeded(job_id=gone)), T0 + timedelta(seconds=i))
            live += [e.job_id for e in out if isinstance(e.payload, JobPlaced)]
        elif kind == "cordon":
            from .builders import cordoned

            h.given(cordoned(["d0", "d1", "n2", "n3"][value]))
        # invariants, recomputed from the allocations
        held: dict[tuple[str, int], int] = {}
        cpu: dict[str, int] = {}
        holding = {j: r.allocations for j, r in h.state.jobs.items() if r.allocations is not None}
        for allocs_ in holding.values():
            for a in allocs_:
                for g in a.gpu_indices:
                    held[(a.node_id, g)] = held.get((a.node_id, g), 0) + a.gpu_milli
                cpu[a.node_id] = cpu.get(a.node_id, 0) + a.cpu_milli
        assert all(v <= 1000 for v in held.values()), held
        for node_id, n in h.state.nodes.items():
            assert n.cpu_left == n.cpu_total - cpu.get(node_id, 0) >= 0
            assert n.mem_left >= 0
            for g, left in zip(n.gpu_ids, n.left, strict=True):
                assert left == 1000 - held.get((node_id, g), 0), (node_id, g, left, held)
        assert set(holding) == set(live) == h.state.placed  # every placed, unended job holds, and no other


# ---------------------------------------------------------------- retention


def test_the_placer_forgets_every_fact_of_a_job_when_it_ends() -> None:
    """One record per job: its spec, attempt, allocations and what it said go with it when it ends,
    and so does its place in every index; only the id stays, in the ended window. (The parallel
    maps this replaced kept the attempt of every resumed job for ever.)"""
    from gpufleet.shared.contract.events import JobResumeRequested, JobSucceeded, Reason

    from .builders import cancelled

    h = Harness(PlacerCore()).given(dgx("d1"))
    big = make_job().gpus(8)
    assert [e.type for e in place(h, big, "j1")] == ["job.placed"]
    assert "job.unschedulable" in [e.type for e in place(h, big, "j2")]
    assert h.state.jobs["j2"].unschedulable_said and list(h.state.pending) == ["j2"]
    h.given(event(JobResumeRequested(job_id="j1", reason=Reason(code="node_lost", message="x"))))
    rec = h.state.jobs["j1"]
    assert rec.attempt == 2 and rec.allocations is not None and h.state.jobs_on == {"d1": {"j1"}}
    h.given(event(JobSucceeded(job_id="j1")), cancelled("j2"))
    assert not (h.state.jobs or h.state.pending or h.state.placed or h.state.jobs_on or h.state.reservations)
    assert "j1" in h.state.ended and "j2" in h.state.ended and len(h.state.nodes["d1"].free_gpus) == 8
    h.given(submitted(big, "j1"), exited("j1", "d1"), quota_reserved(big, "j2"))
    assert not h.state.jobs, "a late fact about an ended job brought its record back"


# ---------------------------------------------------------------- cancel


def test_a_cancel_after_the_run_exited_is_the_guardians_to_end_and_a_resumed_copy_ends_here() -> None:
    """The placer cancels a job only while its attempt was never placed. Once a run exited, it
    holds nothing, but its end is the guardian's (a success being decided right now must not be
    followed by a second end, seen in `bench chaos` with two placers); should the guardian run
    it again instead (a retry), the cancel asked meanwhile ends it before it is placed again."""
    from gpufleet.shared.contract.events import JobResumeRequested, Reason

    from .builders import cancel_requested, types

    h = Harness(PlacerCore()).given(dgx("d1"))
    job = make_job().gpus(2)
    assert types(place(h, job, "ok")) == ["job.placed"]
    h.given(exited("ok", "d1"))
    assert h.when(cancel_requested("ok")) == []  # the guardian says `succeeded`
    assert types(place(h, job, "flaky")) == ["job.placed"]
    h.given(exited("flaky", "d1", exit_code=1, reason="error"))
    assert h.when(cancel_requested("flaky")) == []
    out = h.when(event(JobResumeRequested(job_id="flaky", attempt=2, reason=Reason(code="crashed", message="x"))))
    assert types(out) == ["job.cancelled"]
    h.given(submitted(job, "waiting"))
    assert types(h.when(cancel_requested("waiting"))) == ["job.cancelled"]  # never placed: here, at once
