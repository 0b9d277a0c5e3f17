"""The pure parts of the node services: executor reconcile, telemetry rules (no I/O, no NATS)."""

from __future__ import annotations

from typing import Any

from gpufleet.services.executor.core import (
    Adopt,
    Cleanup,
    ExecutorCore,
    ExecutorState,
    ReportExit,
    Start,
    Stop,
    reconcile,
)
from gpufleet.services.executor.drivers import Workload
from gpufleet.services.telemetry.core import JobUse, Rules, TelemetryCore, TelemetryState, Windows
from gpufleet.shared.contract.events import (
    Envelope,
    GpuDevice,
    JobExited,
    JobPlaced,
    JobStarted,
    JobSubmitted,
    NodeInventory,
    NodeRegistered,
    Payload,
    ReplicaAllocation,
    utc,
)
from gpufleet.shared.contract.spec import parse_spec
from gpufleet.shared.node.gpu import GpuProcess, GpuSample
from gpufleet.shared.runtime.loop import Ctx
from gpufleet.shared.trust.authz import owner_actor

T0 = 1_800_000_000.0
NODE = "n0"
INV = NodeInventory(cpu_milli=8000, memory_mib=16384, driver="process", gpus=tuple(
    GpuDevice(index=i, uuid=f"GPU-{i}", model="H100", memory_mib=81920) for i in range(2)))


def ctx(at: float = T0) -> Ctx:
    return Ctx(now=utc(at), actor="test/0")


def ev(payload: Payload, at: float = T0, tenant: str = "acme") -> Envelope:
    """`payload` as its owner service would have said it (shared/trust/authz.py)."""
    env = ctx(at).emit(payload, tenant=tenant, key=f"{payload.type}:{at}:{getattr(payload, 'replica', 0)}")
    return env.model_copy(update={"actor": owner_actor(env.type)})


def submitted(job: str, **spec: Any) -> Envelope:
    s = parse_spec({"name": "j", "tenant": "acme", "command": ["sleep", "9"], **spec})
    return ev(JobSubmitted(job_id=job, spec=s))


def placed(job: str, gpus: tuple[int, ...] = (0,), attempt: int = 1, cpu: int = 1000) -> Envelope:
    return ev(JobPlaced(job_id=job, attempt=attempt, allocations=(
        ReplicaAllocation(replica=0, node_id=NODE, gpu_indices=gpus, cpu_milli=cpu),)))


def fold(core: Any, state: Any, *envs: Envelope) -> Any:
    for e in envs:
        state = core.evolve(state, e)
    return state


def work(job: str, running: bool = True, code: int | None = None, attempt: int = 1, started: float = T0,
         by_us: bool = False) -> Workload:
    return Workload(job, 0, attempt, NODE, handle="42", running=running, exit_code=code, started_at=started, pid=42,
                    stopped_by_us=by_us)


# ---------------------------------------------------------------- executor reconcile


def executor(*envs: Envelope) -> tuple[ExecutorCore, ExecutorState]:
    core = ExecutorCore({NODE: INV})
    return core, fold(core, core.initial_state(), *envs)


def test_placed_and_not_running_is_started_with_exactly_its_gpus() -> None:
    core, st = executor(submitted("j"), placed("j", gpus=(1,)))
    (a,) = reconcile(st, core.nodes, [], T0)
    assert isinstance(a, Start)
    assert (a.launch.key, a.launch.gpu_uuids, a.launch.command) == ("j.0.1", ("GPU-1",), ("sleep", "9"))
    assert a.launch.job_env()["CUDA_VISIBLE_DEVICES"] == "GPU-1"


def test_running_but_not_in_the_log_is_adopted() -> None:
    core, st = executor(submitted("j"), placed("j"))
    actions = reconcile(st, core.nodes, [work("j")], T0 + 1)
    assert [type(a) for a in actions] == [Adopt]


def test_started_and_vanished_is_reported_lost() -> None:
    core, st = executor(submitted("j"), placed("j"), ev(JobStarted(job_id="j", node_id=NODE, driver="process")))
    (a,) = reconcile(st, core.nodes, [], T0 + 5)
    assert isinstance(a, ReportExit) and a.reason == "node_lost" and a.workload.exit_code == 137


def test_what_the_log_does_not_place_here_is_stopped_then_cleaned() -> None:
    core, st = executor()
    assert [type(a) for a in reconcile(st, core.nodes, [work("ghost")], T0)] == [Stop]
    assert [type(a) for a in reconcile(st, core.nodes, [work("ghost", running=False, code=0)], T0)] == [Cleanup]


def test_max_runtime_stops_with_timeout_and_the_exit_says_so() -> None:
    core, st = executor(submitted("j", maxRuntime="10s"), placed("j"),
                        ev(JobStarted(job_id="j", node_id=NODE, driver="process")))
    (a,) = reconcile(st, core.nodes, [work("j")], T0 + 11)
    assert isinstance(a, Stop) and a.reason == "timeout"
    (b,) = reconcile(st, core.nodes, [work("j", running=False, code=143, by_us=True)], T0 + 12)
    assert isinstance(b, ReportExit) and b.reason == "timeout"


def test_an_exit_already_in_the_log_is_only_cleaned_up() -> None:
    core, st = executor(submitted("j"), placed("j"), ev(JobStarted(job_id="j", node_id=NODE, driver="process")),
                        ev(JobExited(job_id="j", node_id=NODE, exit_code=0), at=T0 + 3))
    assert [type(a) for a in reconcile(st, core.nodes, [work("j", running=False, code=0)], T0 + 4)] == [Cleanup]


# ---------------------------------------------------------------- telemetry rules

RULES = Rules(lease_s=10, idle_pct=5, idle_after_s=60, starved_after_s=30)


def telemetry(*envs: Envelope) -> tuple[TelemetryCore, TelemetryState]:
    core = TelemetryCore(RULES)
    reg = ev(NodeRegistered(node_id=NODE, inventory=INV))
    return core, fold(core, core.initial_state(), reg, *envs)


def sample(index: int, util: float, procs: tuple[GpuProcess, ...] = (), ecc: int = 0,
           xids: tuple[int, ...] = ()) -> GpuSample:
    return GpuSample(index=index, uuid=f"GPU-{index}", util_pct=util, mem_used_mib=sum(p.used_mib for p in procs),
                     mem_total_mib=81920, ecc_uncorrected=ecc, xids=xids, processes=procs)


def owners(table: dict[int, tuple[str, int, int]]) -> Any:
    return table.get


def test_a_process_of_no_job_on_that_gpu_is_a_zombie_once() -> None:
    core, st = telemetry(submitted("j"), placed("j", gpus=(0,)), ev(JobStarted(job_id="j", node_id=NODE)))
    procs0 = (GpuProcess(42, 1000),)
    procs1 = (GpuProcess(42, 500), GpuProcess(77, 4096, "python"))  # j's pid on GPU 1 too: not its GPU
    samples = [sample(0, 80, procs0), sample(1, 0, procs1)]
    facts = core.observe(st, Windows(), NODE, samples, owners({42: ("j", 0, 1)}), {}, T0, ctx())
    assert sorted((f.payload.gpu_index, f.payload.pid) for f in facts) == [(1, 42), (1, 77)]  # type: ignore[union-attr]
    st = fold(core, st, *facts)
    assert core.observe(st, Windows(), NODE, samples, owners({42: ("j", 0, 1)}), {}, T0 + 1, ctx()) == []
    cleared = core.observe(st, Windows(), NODE, [sample(0, 80, procs0), sample(1, 0)], owners({42: ("j", 0, 1)}),
                           {}, T0 + 2, ctx())
    assert [(f.type, f.payload.gpu_index) for f in cleared] == [("node.gpu_cleared", 1)]  # type: ignore[union-attr]


def test_unclean_exit_quarantines_until_the_check_passes() -> None:
    core, st = telemetry(ev(JobExited(job_id="j", node_id=NODE, exit_code=137, reason="cancelled", unclean_gpus=(1,))))
    assert st.quarantined == {(NODE, 1): {"unclean"}}
    facts = core.observe(st, Windows(), NODE, [sample(0, 0), sample(1, 0)], owners({}), {}, T0, ctx())
    assert [f.type for f in facts] == ["node.gpu_cleared"]


def test_only_fatal_xids_and_uncorrected_ecc_make_a_gpu_unhealthy() -> None:
    core, st = telemetry()
    quiet = core.observe(st, Windows(), NODE, [sample(0, 0, xids=(13, 31, 43)), sample(1, 0)], owners({}), {}, T0, ctx())
    assert quiet == []
    facts = core.observe(st, Windows(), NODE, [sample(0, 0, xids=(48,)), sample(1, 0, ecc=3)], owners({}), {}, T0, ctx())
    assert [(f.payload.gpu_index, f.payload.reason) for f in facts] == [  # type: ignore[union-attr]
        (0, "XID 48"), (1, "3 uncorrected ECC error(s)")]


def test_idle_needs_the_whole_window_and_rearms_when_busy() -> None:
    core, st = telemetry(submitted("j"), placed("j"), ev(JobStarted(job_id="j", node_id=NODE)))
    w = Windows()
    own = owners({})

    def at(t: float, util: float) -> list[str]:
        return [f.type for f in core.observe(st, w, NODE, [sample(0, util)], own, {}, t, ctx(t))]

    assert at(T0, 1) == [] and at(T0 + 59, 2) == []
    assert at(T0 + 61, 50) == []  # busy again: the window starts over
    assert at(T0 + 62, 1) == [] and at(T0 + 100, 1) == []
    assert at(T0 + 122, 1) == ["job.idle_detected"]


def test_starved_names_the_cause() -> None:
    core, st = telemetry(submitted("j"), placed("j"), ev(JobStarted(job_id="j", node_id=NODE)))
    w = Windows()
    use = {("j", 0): JobUse(cpu_pct=20, iowait_pct=60)}
    assert core.observe(st, w, NODE, [sample(0, 30)], owners({}), use, T0, ctx()) == []
    (f,) = core.observe(st, w, NODE, [sample(0, 30)], owners({}), use, T0 + 31, ctx(T0 + 31))
    assert (f.payload.cause, f.payload.iowait_pct) == ("io", 60)  # type: ignore[union-attr]
    busy = {("j", 0): JobUse(cpu_pct=99)}
    assert core.observe(st, Windows(), NODE, [sample(0, 90)], owners({}), busy, T0 + 99, ctx()) == []


def test_lease_expiry_loses_the_node_and_ends_its_replicas_once() -> None:
    core, st = telemetry(submitted("j"), placed("j"), ev(JobStarted(job_id="j", node_id=NODE), at=T0 + 1))
    assert core.check_leases(st, {NODE: T0 + 5}, T0 + 14, ctx()) == []
    facts = core.check_leases(st, {NODE: T0 + 5}, T0 + 16, ctx(T0 + 16))
    assert [f.type for f in facts] == ["node.lost", "job.exited"]
    assert (facts[1].payload.reason, facts[1].payload.runtime_s) == ("node_lost", 15.0)  # type: ignore[union-attr]
    st = fold(core, st, *facts)
    assert core.check_leases(st, {NODE: T0 + 5}, T0 + 30, ctx()) == []
    # registering again is a heartbeat: the node is back, with a fresh lease
    st = fold(core, st, ev(NodeRegistered(node_id=NODE, inventory=INV), at=T0 + 40))
    assert core.check_leases(st, {NODE: T0 + 5}, T0 + 45, ctx()) == []


def test_most_of_the_fleet_silent_at_once_is_a_hold_not_a_mass_loss() -> None:
    """Kubernetes' node lifecycle controller stops evicting when most of a zone goes dark at once:
    a switch or NATS between the nodes and telemetry is likelier than that many failures."""
    nodes = [f"n{i}" for i in range(6)]
    core, st = telemetry(*(ev(NodeRegistered(node_id=n, inventory=INV), at=T0) for n in nodes))
    heard = {n: T0 + 5 for n in nodes}
    late = T0 + 40  # past every lease
    assert core.silent_fleet(st, heard, late) == (6, 6)
    assert core.silent_fleet(st, {**heard, "n0": late, "n1": late, "n2": late}, late) is None  # half: a real loss
    lost = core.check_leases(st, {**heard, "n0": late, "n1": late, "n2": late}, late, ctx(late))
    assert sorted(f.node_id for f in lost if f.type == "node.lost") == ["n3", "n4", "n5"]
    assert core.silent_fleet(st, {**heard, "n0": late}, late) == (5, 6)  # 5 of 6: held
    # a node already lost does not count: of the three left, one silent is one loss
    st = fold(core, st, *lost)
    assert core.silent_fleet(st, {**heard, "n0": late, "n1": late}, late) is None
    # a small fleet (fewer than hold_min_nodes) is never held: two nodes down is two nodes down
    small, sst = telemetry(ev(NodeRegistered(node_id="b", inventory=INV), at=T0))  # (and n0)
    assert small.silent_fleet(sst, {}, late) is None


def test_preemption_stops_with_the_grace_it_gives() -> None:
    from gpufleet.shared.contract.events import JobPreemptionRequested, Reason

    core, st = executor(submitted("j"), placed("j"), ev(JobStarted(job_id="j", node_id=NODE, driver="process")),
                        ev(JobPreemptionRequested(job_id="j", reason=Reason(code="preempted", message="x"), grace_s=45)))
    (a,) = reconcile(st, core.nodes, [work("j")], T0 + 1, grace_s=10)
    assert isinstance(a, Stop) and (a.reason, a.grace_s) == ("preempted", 45)


def test_placer_ignores_the_late_exit_of_an_earlier_attempt() -> None:
    from gpufleet.services.placer.core import PlacerCore
    from gpufleet.shared.contract.events import JobQuotaReserved, JobResumeRequested, Reason

    core = PlacerCore()
    RESERVED = JobQuotaReserved(job_id="j", queue="default", cpu_milli=1000, memory_mib=1024, gpus=2)  # noqa: N806
    inv = NodeInventory(cpu_milli=8000, memory_mib=16384, gpus=INV.gpus)
    st = fold(core, core.initial_state(), ev(NodeRegistered(node_id="a", inventory=inv)),
              ev(NodeRegistered(node_id="b", inventory=inv)), submitted("j", resources={"gpu": 2}),
              ev(RESERVED))
    first = core.decide(st, ev(RESERVED), ctx())
    st = fold(core, st, *first)
    node1 = first[0].payload.allocations[0].node_id  # type: ignore[union-attr]
    lost = ev(JobExited(job_id="j", node_id=node1, exit_code=137, reason="node_lost"), at=T0 + 5)
    resume = ev(JobResumeRequested(job_id="j", reason=Reason(code="node_lost", message="x")), at=T0 + 6)
    st = fold(core, st, lost, resume)
    second = core.decide(st, resume, ctx(T0 + 6))
    assert second[0].payload.attempt == 2  # type: ignore[union-attr]
    st = fold(core, st, *second)
    held = st.jobs["j"].allocations
    assert held is not None
    # the lost node's executor comes back and reports attempt 1 completed: it frees nothing
    late = ev(JobExited(job_id="j", node_id=node1, exit_code=0, reason="completed", attempt=1), at=T0 + 9)
    st = fold(core, st, late)
    assert st.jobs["j"].allocations == held and "j" not in st.pending
    # attempt 2's own end frees it, and the job is not placed a third time
    st = fold(core, st, ev(JobExited(job_id="j", node_id=held[0].node_id, exit_code=0, attempt=2), at=T0 + 20))
    assert st.jobs["j"].allocations is None and "j" not in st.pending


def test_a_clear_lifts_zombie_and_unclean_but_never_unhealthy() -> None:
    from gpufleet.shared.contract.events import NodeGpuCleared

    core, st = telemetry()
    facts = core.observe(st, Windows(), NODE, [sample(0, 0, xids=(79,)), sample(1, 0)], owners({}), {}, T0, ctx())
    st = fold(core, st, *facts)
    zombie = core.observe(st, Windows(), NODE, [sample(0, 0, (GpuProcess(9, 900),)), sample(1, 0)], owners({}), {},
                          T0 + 1, ctx(T0 + 1))
    assert [f.type for f in zombie] == ["node.gpu_zombie_detected"]
    st = fold(core, st, *zombie)
    assert st.quarantined[(NODE, 0)] == {"unhealthy", "zombie"}
    cleared = core.observe(st, Windows(), NODE, [sample(0, 0), sample(1, 0)], owners({}), {}, T0 + 2, ctx(T0 + 2))
    assert [f.type for f in cleared] == ["node.gpu_cleared"]
    st = fold(core, st, *cleared)
    assert st.quarantined[(NODE, 0)] == {"unhealthy"}
    # and the placer keeps the GPU out as well
    from gpufleet.services.placer.core import PlacerCore

    placer = PlacerCore()
    ps = fold(placer, placer.initial_state(), ev(NodeRegistered(node_id=NODE, inventory=INV)), *facts, *zombie,
              ev(NodeGpuCleared(node_id=NODE, gpu_index=0), at=T0 + 3))
    assert ps.nodes[NODE].gpu_ids == [1]


def test_facts_decided_again_get_the_same_ids() -> None:
    core, st = telemetry(submitted("j"), placed("j"), ev(JobStarted(job_id="j", node_id=NODE), at=T0 + 1))
    once = core.check_leases(st, {NODE: T0}, T0 + 20, ctx(T0 + 20))
    again = core.check_leases(st, {NODE: T0}, T0 + 25, ctx(T0 + 25))  # a retry, or a second telemetry
    assert [e.event_id for e in once] == [e.event_id for e in again] and len(once) == 2
    z = [sample(0, 0, (GpuProcess(9, 900),))]
    assert ([e.event_id for e in core.observe(st, Windows(), NODE, z, owners({}), {}, T0, ctx(T0))]
            == [e.event_id for e in core.observe(st, Windows(), NODE, z, owners({}), {}, T0 + 7, ctx(T0 + 7))])


def test_a_resumed_attempt_never_started_here_still_gives_its_allocation_back() -> None:
    from gpufleet.shared.contract.events import JobResumeRequested, Reason

    core, st = executor(submitted("j"), placed("j"))  # placed here, not started yet
    st = fold(core, st, ev(JobResumeRequested(job_id="j", reason=Reason(code="node_lost", message="x"))))
    (a,) = reconcile(st, core.nodes, [], T0 + 1)
    assert isinstance(a, ReportExit) and (a.workload.attempt, a.reason) == (1, "killed")
    st = fold(core, st, ev(JobExited(job_id="j", node_id=NODE, exit_code=137, reason="killed"), at=T0 + 2))
    assert reconcile(st, core.nodes, [], T0 + 3) == []
    # attempt 2 placed here again: started as attempt 2
    (b,) = reconcile(fold(core, st, placed("j", attempt=2)), core.nodes, [], T0 + 4)
    assert isinstance(b, Start) and b.launch.key == "j.0.2"


# ---------------------------------------------------------------- recovery races (the guardian)


def _guardian(job_type: str = "training", **spec: Any) -> tuple[Any, Any]:
    from gpufleet.services.guardian.core import GuardianCore
    from gpufleet.shared.contract.clusterconfig import parse_config

    core = GuardianCore(parse_config({"tenants": {"acme": {"idleAction": "reclaim", "idleReclaimAfter": "60s"}}}))
    st = fold(core, core.initial_state(), submitted("j", type=job_type, **spec), placed("j"),
              ev(JobStarted(job_id="j", node_id=NODE, driver="process")))
    return core, st


def test_a_lost_node_during_a_preemption_gives_the_quota_back_anyway() -> None:
    from gpufleet.shared.contract.events import JobPreemptionRequested, Reason

    preempt = ev(JobPreemptionRequested(job_id="j", reason=Reason(code="priority", message="x"), by_job_id="p"))
    lost = ev(JobExited(job_id="j", node_id=NODE, exit_code=137, reason="node_lost"), at=T0 + 3)
    core, st = _guardian()
    st = fold(core, st, preempt, lost)
    (r,) = core.decide(st, lost, ctx(T0 + 3))
    assert r.type == "job.resume_requested" and r.payload.reason.code == "preempted"  # type: ignore[union-attr]
    core, st = _guardian("batch")
    st = fold(core, st, preempt, lost)
    (e,) = core.decide(st, lost, ctx(T0 + 3))
    assert e.type == "job.preempted"


def test_an_idle_warning_of_a_run_does_not_reclaim_the_next_one() -> None:
    from gpufleet.shared.contract.events import JobIdleDetected, JobResumeRequested, Reason

    core, st = _guardian()
    st = fold(core, st, ev(JobIdleDetected(job_id="j", gpu_util_pct=1, idle_s=900), at=T0 + 10),
              ev(JobResumeRequested(job_id="j", reason=Reason(code="node_lost", message="x")), at=T0 + 20))
    assert core.tick(st, ctx(T0 + 200)) == []


def test_executor_keeps_a_preemption_stop_across_a_resume_for_another_reason() -> None:
    from gpufleet.shared.contract.events import JobPreemptionRequested, JobResumeRequested, Reason

    core, st = executor(submitted("j"), placed("j"), ev(JobStarted(job_id="j", node_id=NODE, driver="process")),
                        ev(JobPreemptionRequested(job_id="j", reason=Reason(code="priority", message="x"))),
                        ev(JobResumeRequested(job_id="j", reason=Reason(code="node_lost", message="x"))))
    assert st.peek_driver("j").stop_reason == "preempted"
    _, st2 = executor(submitted("j"), placed("j"), ev(JobStarted(job_id="j", node_id=NODE, driver="process")),
                      ev(JobPreemptionRequested(job_id="j", reason=Reason(code="priority", message="x"))),
                      ev(JobResumeRequested(job_id="j", reason=Reason(code="preempted", message="x"))))
    assert st2.peek_driver("j").stop_reason is None


def test_executor_keeps_an_ended_jobs_stop_and_exits_only_for_the_window() -> None:
    """One record per job: an ended job keeps what its replicas still need (why it stopped, the exits
    the log has) until the ended window forgets it; then nothing of it is left. (The exits logged
    were kept for ever before, and a later job of the same id would not have been started.)"""
    from datetime import timedelta

    from gpufleet.shared.contract.events import JobCancelled, JobSucceeded

    core, st = executor(submitted("j"), placed("j"), ev(JobStarted(job_id="j", node_id=NODE, driver="process")),
                        ev(JobExited(job_id="j", node_id=NODE, exit_code=137, reason="cancelled")),
                        ev(JobCancelled(job_id="j", reason="x"), at=T0 + 1))
    assert st.exit_logged("j", 0, 1) and st.peek_driver("j").stop_reason == "cancelled"
    assert st.jobs["j"].spec is None and not st.placed
    later = ev(JobSucceeded(job_id="other"), at=T0 + timedelta(hours=36).total_seconds())
    st = fold(core, st, later)
    assert "j" not in st.jobs and "j" not in st.ended and not st.on_node
    assert [type(a) for a in reconcile(fold(core, st, submitted("j"), placed("j")), core.nodes, [], T0 + 2e5)] == [Start]


def test_executor_kills_a_replica_started_again_once() -> None:
    """A replica started again (a later attempt) before the exit of the earlier one came is one replica:
    a cancel stops it once (it was listed twice, and once it exited a cancel raised a KeyError)."""
    from gpufleet.shared.contract.events import JobCancelRequested

    core = ExecutorCore({"s0": INV.model_copy(update={"driver": "sim"})})
    st = fold(core, core.initial_state(), submitted("j"),
              *(ev(JobStarted(job_id="j", node_id="s0", driver="sim", attempt=a), at=T0 + a) for a in (1, 2)))
    cancel = ev(JobCancelRequested(job_id="j", reason="x", requested_by="u"), at=T0 + 5)
    (e,) = core.decide(fold(core, st, cancel), cancel, ctx(T0 + 5))
    assert e.payload.attempt == 2  # type: ignore[union-attr]
    st = fold(core, st, ev(JobExited(job_id="j", node_id="s0", exit_code=0, attempt=2), at=T0 + 6))
    assert core.decide(fold(core, st, cancel), cancel, ctx(T0 + 7)) == []


# ---------------------------------------------------------------- a node lost past its lease (the executor)

SIM_INV = INV.model_copy(update={"driver": "sim"})


def _lost(node: str = NODE) -> Envelope:
    from gpufleet.shared.contract.events import NodeLost

    return ev(NodeLost(node_id=node, reason="no heartbeat for 15s (lease 15s)"), tenant="sys")


def _sim_executor(*envs: Envelope) -> tuple[ExecutorCore, ExecutorState]:
    core = ExecutorCore({NODE: SIM_INV})
    return core, fold(core, core.initial_state(), *envs)


def test_a_placement_on_a_node_already_lost_is_ended_not_started() -> None:
    """Nobody else ends it: telemetry ended what the node held when it was lost."""
    reg = ev(NodeRegistered(node_id=NODE, inventory=SIM_INV), tenant="sys")
    p = placed("j")
    for core, st in (_sim_executor(reg, submitted("j"), _lost(), p),
                     executor(reg, submitted("j"), _lost(), p)):  # a driver node: nothing to reconcile either
        (out,) = core.decide(st, p, ctx())
        assert out.type == "job.exited" and out.payload.reason == "node_lost"  # type: ignore[union-attr]
        assert reconcile(st, core.nodes, [], T0) == [] or not core.driver_nodes
        st = fold(core, st, out)  # its own exit, back: a redelivered placement says nothing again
        assert core.decide(st, p, ctx()) == []


def test_a_placement_its_node_lost_since_is_not_started_even_once_the_node_is_back() -> None:
    """The executor decided on a state the loss had not reached (frozen past its lease): its start
    conflicts on the guard and is decided again on the log as it is: telemetry ended that run."""
    reg = ev(NodeRegistered(node_id=NODE, inventory=SIM_INV), tenant="sys")
    p = placed("j")
    ended = ev(JobExited(job_id="j", node_id=NODE, exit_code=137, reason="node_lost"))
    core, st = _sim_executor(reg, submitted("j"), p, _lost(), ended)
    assert core.decide(st, p, ctx()) == []  # lost: telemetry's exit covers it
    st = fold(core, st, ev(NodeRegistered(node_id=NODE, inventory=SIM_INV), tenant="sys", at=T0 + 30))
    assert core.decide(st, p, ctx()) == []  # back, but that run ended
    core, fresh = _sim_executor(reg, submitted("j"), p)
    assert [o.type for o in core.decide(fresh, p, ctx())] == ["job.started"]


def test_the_executor_guards_its_starts_and_exits_by_the_nodes_losses() -> None:
    from gpufleet.shared.runtime.engine import Engine

    core, st = _sim_executor(submitted("j"))
    eng = Engine(core, st)
    start = ev(JobStarted(job_id="j", node_id=NODE, driver="sim"))
    assert eng.takes_capacity([start]) and eng.takes_capacity([ev(JobExited(job_id="j", node_id=NODE, exit_code=0))])
    assert not eng.takes_capacity([ev(NodeRegistered(node_id=NODE, inventory=SIM_INV), tenant="sys")])
    assert eng.takes(_lost().subject()) and not eng.takes(start.subject())
    eng.fold(_lost(), seq=7)
    assert eng.last_cas_seq == 7  # the guard a start decided now is published under


def test_the_process_parses_an_event_of_the_log_once_and_never_a_changed_one() -> None:
    """A grouped process's ledger reads what its cores parsed (shared/runtime/engine.py
    `parse_logged`); a stream created again reuses sequences, so a hit must carry the same bytes."""
    from gpufleet.shared.runtime import engine as eng

    a, b = submitted("pa").to_json(), submitted("pb").to_json()
    first = eng.parse_logged(10**12, a)
    assert eng.parse_logged(10**12, bytes(a)) is first  # equal bytes, another object: the same parse
    other = eng.parse_logged(10**12, b)  # the same sequence, other bytes: parsed anew
    assert other.job_id == "pb" and first.job_id == "pa"
    for seq in range(eng.PARSED_RECENT + 1):  # bounded: the oldest leaves
        eng.parse_logged(10**12 + 1 + seq, a)
    assert len(eng._parsed) <= eng.PARSED_RECENT and 10**12 not in eng._parsed
