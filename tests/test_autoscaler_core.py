"""The autoscaler's pure core: HPA math, bounds, cooldowns, scale to zero, replica jobs, node pools;
and the sim provider's side in the executor and telemetry cores. No NATS: given -> when -> then."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import pytest

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.autoscaler.core import (
    REPLICA_ENV,
    SERVICE_ENV,
    AutoscalerCore,
    AutoscalerState,
    recommend,
    replica_job_id,
)
from gpufleet.services.autoscaler.pools import pool_inventory, replica_fits_shape
from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.placer.core import PlacerCore
from gpufleet.services.telemetry.core import Rules, TelemetryCore
from gpufleet.shared.contract.clusterconfig import parse_config
from gpufleet.shared.contract.errors import SpecError
from gpufleet.shared.contract.events import (
    CancelRequestedCmd,
    Envelope,
    JobCancelled,
    JobExited,
    JobFailed,
    JobIdleDetected,
    JobPlaced,
    JobQueued,
    JobQuotaReserved,
    JobRejected,
    JobRequestRefused,
    JobResumeRequested,
    JobScaled,
    JobStarted,
    JobUnschedulable,
    NodeDeregistered,
    NodeLost,
    NodeProvisionRequested,
    NodeRegistered,
    NodeRemovalRequested,
    Reason,
    ReplicaAllocation,
    ReportLoadCmd,
    SubmitRequested,
)
from gpufleet.shared.contract.spec import AutoscaleSpec, parse_spec
from gpufleet.shared.runtime.loop import Ctx

from .builders import (
    T0,
    Harness,
    admitted,
    event,
    exited,
    make_job,
    node,
    placed,
    quota_reserved,
    started,
    submit,
    submitted,
    types,
)

ACTOR = "autoscaler/0"
SVC = "svc1"


class Play(Harness[Any]):
    """The harness, with the autoscaler's actor on its outputs (it recognises its own commands)."""

    actor = ACTOR


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def auto(**kw: Any) -> dict[str, Any]:
    return {"minReplicas": 1, "maxReplicas": 10, "targetRpsPerReplica": 100, "scaleUpCooldown": "10s",
            "scaleDownCooldown": "60s", **kw}


def service(h: Play, **kw: Any) -> list[Envelope]:
    spec = make_job("web").type("inference").gpus(1).runs("1h").set("autoscale", auto(**kw)).spec()
    h.given(submitted(spec, SVC))
    return h.when(admitted(SVC), at(0))


def load(rps: float, p99: float | None = None, s: float = 0, tenant: str = "acme") -> Envelope:
    return event(ReportLoadCmd(job_id=SVC, rps=rps, p99_ms=p99), tenant=tenant, at=at(s))


def scaled(out: list[Envelope]) -> list[JobScaled]:
    return [e.payload for e in out if isinstance(e.payload, JobScaled)]


def replicas(h: Play) -> int:
    return len(h.state.services[SVC].replicas)


# ---------------------------------------------------------------- HPA math


@pytest.mark.parametrize(("current", "rps", "p99", "want", "why"), [
    (2, 200.0, None, 2, "load"),  # exactly on target
    (2, 215.0, None, 2, "load"),  # within the 10 % tolerance
    (2, 300.0, None, 3, "load"),  # ceil(300 / 100)
    (2, 301.0, None, 4, "load"),
    (4, 100.0, None, 1, "load"),
    (4, 0.0, None, 1, "bounds"),  # ceil(0) = 0, held at minReplicas
    (2, 5000.0, None, 10, "bounds"),  # held at maxReplicas
    (2, 200.0, 400.0, 4, "latency"),  # p99 twice its target: ceil(2 x 2), the larger proposal wins
    (3, 100.0, 100.0, 2, "latency"),  # load says 1, latency says ceil(3 x 0.5): the larger
    (0, 250.0, None, 3, "load"),  # from nothing: the load alone
])
def test_recommend_is_target_tracking(current: int, rps: float, p99: float | None, want: int, why: str) -> None:
    a = AutoscaleSpec.model_validate(auto(targetP99Ms=200))
    assert recommend(a, current, rps, p99) == (want, why)


def test_recommend_without_a_metric_for_its_target_keeps_the_count() -> None:
    a = AutoscaleSpec.model_validate(auto(targetRpsPerReplica=None, targetP99Ms=200))
    assert recommend(a, 3, 900.0, None) == (3, "none")


@pytest.mark.parametrize(("section", "field"), [
    ({"minReplicas": 3, "maxReplicas": 2, "targetP99Ms": 9}, "autoscale.maxReplicas"),
    ({"maxReplicas": 3}, "autoscale.targetP99Ms"),
    ({"minReplicas": 0, "targetP99Ms": 9}, "autoscale.minReplicas"),
    ({"targetRpsPerReplica": 0}, "autoscale.targetRpsPerReplica"),
    ({"targetP99Ms": 9, "scaleToZeroAfter": "soon"}, "autoscale.scaleToZeroAfter"),
    ({"targetP99Ms": 9, "replicasMax": 3}, "autoscale.replicasMax"),
])
def test_a_bad_autoscale_section_names_the_field(section: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "s", "tenant": "acme", "type": "inference", "autoscale": section})
    assert err.value.field == field


def test_autoscale_is_for_inference_only() -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "s", "tenant": "acme", "type": "training", "autoscale": {"targetP99Ms": 9}})
    assert err.value.field == "autoscale" and "inference" in str(err.value)


@pytest.mark.parametrize(("pools", "field"), [
    ({"p": {"min": 2, "max": 1}}, "nodePools.p.max"),
    ({"p": {"shape": {"gpus": 65}}}, "nodePools.p.shape.gpus"),
    ({"p": {"provisionDelay": -1}}, "nodePools.p.provisionDelay"),
    ({"p.q": {}}, "nodePools.p.q"),
])
def test_a_bad_node_pool_names_the_field(pools: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_config({"nodePools": pools})
    assert err.value.field == field


def test_an_unknown_provider_is_refused_by_the_autoscaler() -> None:
    with pytest.raises(SpecError) as err:
        AutoscalerCore(parse_config({"nodePools": {"p": {"provider": "gcp", "max": 1}}}))
    assert err.value.field == "nodePools.p.provider"


# ---------------------------------------------------------------- services


def test_an_admitted_service_starts_min_replicas_as_ordinary_submits() -> None:
    h = Play(AutoscalerCore())
    out = service(h, minReplicas=2)
    assert [e.type for e in out] == ["job.scaled", "cmd.submit", "cmd.submit"]
    s = scaled(out)[0]
    assert (s.from_replicas, s.to_replicas, s.reason.code) == (0, 2, "initial")
    assert s.added == (replica_job_id(SVC, 0), replica_job_id(SVC, 1))
    sub = out[1].payload
    assert isinstance(sub, SubmitRequested) and out[1].subject() == "fleet.cmd.acme.submit"
    spec = parse_spec(sub.spec)  # a plain job spec admission takes as it is
    assert spec.autoscale is None and spec.type == "inference" and spec.resources.gpu == 1
    assert spec.env[SERVICE_ENV] == SVC and spec.env[REPLICA_ENV] == "0"
    assert replicas(h) == 2
    assert h.when(admitted(SVC), at(1)) == []  # redelivered: decided already


def test_load_scales_up_with_a_reason_and_the_cooldown_holds_the_next_step() -> None:
    h = Play(AutoscalerCore())
    service(h)
    out = h.when(load(420, s=20), at(20))
    s = scaled(out)[0]
    assert (s.from_replicas, s.to_replicas, s.reason.code, s.rps) == (1, 5, "load", 420)
    assert "420 req/s" in s.reason.message and "target 100" in s.reason.message
    assert [e.type for e in out].count("cmd.submit") == 4 and replicas(h) == 5
    assert h.when(load(900, s=25), at(25)) == []  # within scaleUpCooldown (10s) of the last change
    assert scaled(h.when(load(900, s=31), at(31)))[0].to_replicas == 9


def test_a_scale_up_held_by_the_cooldown_happens_when_it_ends_without_another_report() -> None:
    h = Play(AutoscalerCore())
    service(h)
    h.when(load(420, s=20), at(20))  # 1 -> 5
    assert h.when(load(900, s=25), at(25)) == []  # held: within the 10 s cooldown
    assert scaled(h.tick(at(29))) == []  # still within it
    s = scaled(h.tick(at(30.5)))  # over: the held report is acted on, once
    assert [(x.from_replicas, x.to_replicas) for x in s] == [(5, 9)]
    assert scaled(h.tick(at(45))) == [] and replicas(h) == 9


def test_scale_down_waits_for_the_stabilisation_window_and_cancels_the_newest_not_running_first() -> None:
    h = Play(AutoscalerCore())
    service(h)
    h.when(load(400, s=20), at(20))  # -> 4
    h.given(started(replica_job_id(SVC, 0), "n1"), started(replica_job_id(SVC, 3), "n1"))
    assert h.when(load(100, s=30), at(30)) == []  # 1 is enough, but 400 was asked 10s ago
    assert h.when(load(100, s=70), at(70)) == []  # the 20s recommendation (4) is still in the window
    out = h.when(load(190, s=81), at(81))
    s = scaled(out)[0]
    assert (s.from_replicas, s.to_replicas) == (4, 2)  # the largest of the last 60s: ceil(190 / 100)
    assert set(s.removed) == {replica_job_id(SVC, 2), replica_job_id(SVC, 1)}  # not running yet: first
    cancels = [e.payload for e in out if isinstance(e.payload, CancelRequestedCmd)]
    assert {c.job_id for c in cancels} == set(s.removed)
    assert replicas(h) == 2


def test_bounds_and_tolerance() -> None:
    h = Play(AutoscalerCore())
    service(h, maxReplicas=3)
    assert scaled(h.when(load(5000, s=20), at(20)))[0].to_replicas == 3
    assert scaled(h.when(load(5000, s=40), at(40))) == []  # at max: nothing more to say
    assert h.when(load(310, s=50), at(50)) == []  # 310 / 3 per replica is within 10 % of 100


def test_scale_to_zero_after_idle_and_back_on_the_first_request() -> None:
    h = Play(AutoscalerCore())
    service(h, minReplicas=2, scaleToZeroAfter="30s")
    h.when(load(0, s=10), at(10))
    assert scaled(h.when(load(0, s=25), at(25))) == []  # no requests in 15s of reports
    assert scaled(h.tick(at(30))) == []  # no new report: nothing new known, nothing done
    out = h.when(load(0, s=41), at(41))  # 31s of reports without requests
    s = scaled(out)[0]
    assert (s.to_replicas, s.reason.code) == (0, "scale_to_zero") and replicas(h) == 0
    assert h.tick(at(40)) == []
    assert h.when(load(0, s=50), at(50)) == []  # still idle: stays at zero
    s = scaled(h.when(load(350, s=60), at(60)))[0]
    assert (s.from_replicas, s.to_replicas, s.reason.code) == (0, 4, "from_zero")  # ceil(350/100), >= min


def test_without_scale_to_zero_idle_holds_min() -> None:
    h = Play(AutoscalerCore())
    service(h, minReplicas=2)
    h.when(load(0, s=10), at(10))
    assert h.tick(at(10_000)) == []
    assert h.state.services[SVC].desired == 2


def test_a_failed_replica_is_replaced_after_a_backoff_and_a_cancelled_service_cancels_its_replicas() -> None:
    h = Play(AutoscalerCore())
    service(h, minReplicas=2)
    r0 = replica_job_id(SVC, 0)
    h.when(event(JobFailed(job_id=r0, reason=Reason(code="error", message="exit 1")), at=at(5)), at(5))
    assert replicas(h) == 1
    assert h.tick(at(6)) == []  # backoff (2s after the first failure)
    out = h.tick(at(7.5))
    assert [e.type for e in out] == ["cmd.submit"] and out[0].job_id == replica_job_id(SVC, 2)
    assert replicas(h) == 2 and h.state.services[SVC].desired == 2  # a replacement is not a scale event
    out = h.when(event(JobCancelled(job_id=SVC, reason="user"), at=at(9)), at(9))
    assert sorted(e.job_id or "" for e in out) == [replica_job_id(SVC, 1), replica_job_id(SVC, 2)]
    assert all(e.type == "cmd.cancel" for e in out)
    assert h.tick(at(20)) == []


def test_load_of_another_tenant_or_an_unknown_job_is_ignored() -> None:
    h = Play(AutoscalerCore())
    service(h)
    assert h.when(load(5000, tenant="evil", s=20), at(20)) == []
    assert h.when(event(ReportLoadCmd(job_id="nope", rps=10), at=at(20)), at(20)) == []


def test_a_forged_replica_submit_is_not_counted() -> None:
    h = Play(AutoscalerCore())
    service(h)
    forged = event(SubmitRequested(job_id="x-r9", spec={"env": {SERVICE_ENV: SVC, REPLICA_ENV: "9"}}), actor="mallory")
    h.given(forged)
    assert replicas(h) == 1


# ---------------------------------------------------------------- node pools

POOLS = {
    "a10": {"shape": {"gpuModel": "A10", "gpus": 4, "cpu": 32, "memory": "256Gi"}, "max": 4,
            "provisionDelay": "5s", "scaleUpAfter": "10s", "scaleDownAfter": "60s"},
    "h100": {"shape": {"gpuModel": "H100", "gpus": 8, "cpu": 96, "memory": "1Ti"}, "max": 2,
             "provisionDelay": "5s", "scaleUpAfter": "10s", "scaleDownAfter": "60s"},
}


def pools(**over: Any) -> AutoscalerCore:
    cfg = {name: {**p, **over.get(name, {})} for name, p in POOLS.items()}
    return AutoscalerCore(parse_config({"nodePools": cfg}))


def waiting(h: Play, job_id: str, gpus: int, s: float, replicas_n: int = 1, model: str | None = None) -> None:
    b = make_job(job_id).gpus(gpus).replicas(replicas_n)
    if model:
        b = b.model(model)
    h.given(submitted(b, job_id), event(JobUnschedulable(
        job_id=job_id, reasons=(Reason(code="no_fit", message="no fit"),)), at=at(s)))


def provisions(out: list[Envelope]) -> list[NodeProvisionRequested]:
    return [e.payload for e in out if isinstance(e.payload, NodeProvisionRequested)]


def test_pool_fit_and_inventory() -> None:
    core = pools()
    spec = make_job().gpus(8).model("H100").spec()
    assert replica_fits_shape("h100", core.pools["h100"], spec)
    assert not replica_fits_shape("a10", core.pools["a10"], spec)
    assert not replica_fits_shape("h100", core.pools["h100"], make_job().mig("1g.10gb").spec())
    assert not replica_fits_shape("h100", core.pools["h100"], make_job().gpus(1).set("nodeSelector", {"zone": "b"}).spec())
    inv = pool_inventory("h100", core.pools["h100"], "h100-0000")
    assert len(inv.gpus) == 8 and inv.gpus[0].model == "H100" and inv.labels["pool"] == "h100"


def test_unschedulable_demand_past_scale_up_after_asks_the_smallest_fitting_pool() -> None:
    h = Play(pools())
    waiting(h, "big", 8, s=0)
    waiting(h, "small", 2, s=0)
    assert h.tick(at(9)) == []  # not waited scaleUpAfter yet
    out = h.tick(at(10))
    got = {(p.pool, p.node_id, tuple(p.for_jobs)) for p in provisions(out)}
    assert got == {("h100", "h100-0000", ("big",)), ("a10", "a10-0000", ("small",))}
    p = next(p for p in provisions(out) if p.pool == "h100")
    assert p.reason.code == "unschedulable" and "0 -> 1" in p.reason.message and p.ready_after_s == 5
    assert p.inventory.gpus[0].model == "H100" and out[0].subject().startswith("fleet.evt.sys.node.")
    assert h.tick(at(11)) == []  # the nodes coming take that demand: not asked twice
    waiting(h, "big2", 8, s=12)
    assert [p.node_id for p in provisions(h.tick(at(22)))] == ["h100-0001"]
    waiting(h, "big3", 8, s=12)
    assert h.tick(at(23)) == []  # h100 is at max 2


def test_a_gang_gets_all_its_nodes_or_none() -> None:
    h = Play(pools())
    waiting(h, "gang", 8, s=0, replicas_n=2, model="H100")
    assert [p.node_id for p in provisions(h.tick(at(10)))] == ["h100-0000", "h100-0001"]
    h2 = Play(pools())
    waiting(h2, "gang3", 8, s=0, replicas_n=3, model="H100")
    assert h2.tick(at(10)) == []  # 3 nodes, max 2: never half a gang


def test_min_nodes_are_kept() -> None:
    h = Play(pools(a10={"min": 2}))
    out = provisions(h.tick(at(0)))
    assert [(p.node_id, p.reason.code) for p in out] == [("a10-0000", "below_min"), ("a10-0001", "below_min")]
    assert h.tick(at(1)) == []


def registered_pool_node(h: Play, pool: str, node_id: str, s: float) -> None:
    core: AutoscalerCore = h.core
    inv = pool_inventory(pool, core.pools[pool], node_id)
    h.given(event(NodeProvisionRequested(node_id=node_id, pool=pool, provider="sim", inventory=inv,
                                         reason=Reason(code="unschedulable", message="x")), at=at(s), actor=ACTOR),
            event(NodeRegistered(node_id=node_id, inventory=inv), at=at(s + 5)))


def test_an_idle_pool_node_is_cordoned_then_removed_once_drained_and_never_below_min() -> None:
    h = Play(pools(h100={"min": 1}))
    registered_pool_node(h, "h100", "h100-0000", 0)
    registered_pool_node(h, "h100", "h100-0001", 0)
    h.given(placed("j1", ("h100-0001", [0, 1])))
    h.given(exited("j1", "h100-0001"))
    state: AutoscalerState = h.state
    state.changed_s["h100-0001"] = T0.timestamp() + 20  # (its job left at 20s)
    assert h.tick(at(64)) == []  # idle since 5s: not 60s yet
    out = h.tick(at(66))
    assert [(e.type, e.node_id) for e in out] == [("node.cordoned", "h100-0000")]
    assert "nothing placed on it" in out[0].payload.reason  # type: ignore[union-attr]
    assert h.tick(at(67)) == []  # drain settling; and 0001 stays: min 1
    out = h.tick(at(90))
    assert [(e.type, e.node_id) for e in out] == [("node.removal_requested", "h100-0000")]
    assert h.tick(at(91)) == []


def test_a_busy_node_stays_and_one_whose_jobs_are_all_idle_is_drained() -> None:
    h = Play(pools())
    registered_pool_node(h, "h100", "h100-0000", 0)
    h.given(submitted(make_job("j").gpus(8), "j1"), placed("j1", ("h100-0000", range(8))))
    h.state.changed_s["h100-0000"] = T0.timestamp() + 6
    assert h.tick(at(200)) == []
    h.given(event(JobIdleDetected(job_id="j1", gpu_util_pct=1, idle_s=30), at=at(210)))
    assert h.tick(at(260)) == []
    out = h.tick(at(271))
    assert [e.type for e in out] == ["node.cordoned"] and "idle" in out[0].payload.reason  # type: ignore[union-attr]
    assert h.tick(at(300)) == []  # cordoned, but j1 is still on it: no removal yet
    h.given(exited("j1", "h100-0000"))
    assert [e.type for e in h.tick(at(301))] == ["node.removal_requested"]


def test_demand_takes_back_a_draining_node_before_asking_for_a_new_one() -> None:
    h = Play(pools())
    registered_pool_node(h, "h100", "h100-0000", 0)
    out = h.tick(at(70))
    assert [e.type for e in out] == ["node.cordoned"]
    waiting(h, "big", 8, s=70)
    out = h.tick(at(80))
    assert [(e.type, e.node_id) for e in out] == [("node.uncordoned", "h100-0000")]
    assert h.tick(at(81)) == []


# ---------------------------------------------------------------- the sim provider (executor) and telemetry


def _ex_ctx(s: float, cause: Envelope | None = None) -> Ctx:
    return Ctx(now=at(s), actor="executor/0", cause=cause)


def test_the_sim_executor_registers_a_pool_node_after_its_delay_and_deregisters_it_on_removal() -> None:
    core = ExecutorCore({}, sim_pools=True)
    h: Harness[Any] = Harness(core)
    inv = pool_inventory("h100", pools().pools["h100"], "h100-0000")
    h.given(event(NodeProvisionRequested(node_id="h100-0000", pool="h100", provider="sim", inventory=inv,
                                         ready_after_s=5, reason=Reason(code="x", message="x")), at=at(0)))
    assert h.tick(at(4)) == []
    out = h.tick(at(5))
    assert [e.type for e in out] == ["node.registered"] and out[0].payload == NodeRegistered(node_id="h100-0000",
                                                                                            inventory=inv)
    assert core.hosted(h.state) == ["h100-0000"]  # heartbeated from now on
    assert h.tick(at(6)) == []
    h.given(submitted(make_job().runs("1h"), "j1"), started("j1", "h100-0000", at=at(7)))
    h.given(event(NodeRemovalRequested(node_id="h100-0000", pool="h100", provider="sim",
                                       reason=Reason(code="idle", message="x")), at=at(8)))
    out = h.tick(at(9))
    assert [e.type for e in out] == ["job.exited", "node.deregistered"]
    assert out[0].payload.reason == "node_lost"  # type: ignore[union-attr]
    assert core.hosted(h.state) == [] and h.tick(at(10)) == []


def test_an_executor_without_sim_pools_leaves_pool_nodes_alone() -> None:
    h: Harness[Any] = Harness(ExecutorCore({}))
    inv = pool_inventory("h100", pools().pools["h100"], "h100-0000")
    h.given(event(NodeProvisionRequested(node_id="h100-0000", pool="h100", provider="sim", inventory=inv,
                                         reason=Reason(code="x", message="x")), at=at(0)))
    assert h.tick(at(100)) == []


def test_telemetry_does_not_lose_a_deregistered_node() -> None:
    core = TelemetryCore(Rules(lease_s=5))
    inv = pool_inventory("h100", pools().pools["h100"], "h100-0000")
    state = core.initial_state()
    for e in (event(NodeRegistered(node_id="h100-0000", inventory=inv), at=at(0)),
              event(NodeDeregistered(node_id="h100-0000"), at=at(1))):
        state = core.evolve(state, e)
    assert core.check_leases(state, {}, at(100).timestamp(), _ex_ctx(100)) == []


def test_replica_started_resets_failures() -> None:
    h = Play(AutoscalerCore())
    service(h)
    h.given(event(JobStarted(job_id=replica_job_id(SVC, 0), node_id="n"), at=at(1)))
    assert h.state.services[SVC].replicas[replica_job_id(SVC, 0)].running


def test_an_oscillating_load_pattern_gives_a_bounded_number_of_scale_events() -> None:
    """Load swinging between 50 and 350 req/s (target 100) every second for an hour: up once, then held by the
    stabilisation window; a square wave slower than the window moves it, at most twice a period."""
    h = Play(AutoscalerCore())
    service(h)
    for i in range(3600):
        h.when(load(350 if i % 2 == 0 else 50, s=1 + i), at(1 + i))
    assert h.state.services[SVC].scale_events == 2  # initial, then 1 -> 4 once
    h2 = Play(AutoscalerCore())
    service(h2)
    for i in range(3600):  # a 4-minute square wave (2 high, 2 low), window 60s: follows, no faster
        h2.when(load(350 if (i // 120) % 2 == 0 else 50, s=1 + i), at(1 + i))
        h2.tick(at(1.5 + i))
    events = h2.state.services[SVC].scale_events
    assert 1 < events <= 1 + 2 * (3600 // 240)


class RecordingProvider:
    """A provider that keeps what it was asked (a cloud provider would call its API here)."""

    name = "rec"

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def create(self, request: NodeProvisionRequested) -> None:
        self.calls.append(("create", request.node_id))

    async def delete(self, request: NodeRemovalRequested) -> None:
        self.calls.append(("delete", request.node_id))


async def test_the_provider_agent_hands_each_decision_to_its_pool_provider_once() -> None:
    from types import SimpleNamespace

    from gpufleet.services.autoscaler.providers import PROVIDERS, ProviderAgent

    assert set(PROVIDERS) == {"sim"}
    core = AutoscalerCore(parse_config({"nodePools": {"p": {**POOLS["h100"], "provider": "rec"}}}),
                          providers=("sim", "rec"))
    h = Play(core)
    waiting(h, "big", 8, s=0)
    h.tick(at(10))
    rec = RecordingProvider()
    agent = ProviderAgent(SimpleNamespace(state=h.state), {"rec": rec})  # type: ignore[arg-type]
    await agent.once()
    await agent.once()
    assert rec.calls == [("create", "p-0000")]
    h.given(event(NodeRemovalRequested(node_id="p-0000", pool="p", provider="rec",
                                       reason=Reason(code="idle", message="x")), at=at(99)))
    await agent.once()
    assert rec.calls == [("create", "p-0000"), ("delete", "p-0000")]


# ---------------------------------------------------------------- what the pools may add counts as capacity


def pool_config(**over: Any) -> Any:
    return parse_config({"nodePools": {name: {**p, **over.get(name, {})} for name, p in POOLS.items()}})


def codes(out: list[Envelope]) -> list[str]:
    return [r.code for e in out if isinstance(e.payload, JobRejected) for r in e.payload.reasons]


@pytest.mark.parametrize(("job", "with_pools", "want"), [
    (make_job().gpus(8).model("H100"), True, []),  # no H100 node, but the h100 pool's shape holds it
    (make_job().gpus(8).model("H100"), False, ["gpu_model_unknown"]),  # as before: no pool
    (make_job().gpus(16).model("H100"), True, ["exceeds_node"]),  # more than a pool node has
    (make_job().gpus(8).model("B200"), True, ["gpu_model_unknown"]),  # neither a node nor a pool has it
    (make_job().gpus(1).cpu(100), True, ["exceeds_node"]),  # 100 cores: no node (64) nor pool node (96)
    (make_job().gpus(1).cpu(90), True, []),  # 90 cores: an h100 pool node has 96
])
def test_admission_counts_the_pools_node_shapes_as_capacity(job: Any, with_pools: bool, want: list[str]) -> None:
    h = Harness(AdmissionCore(pool_config() if with_pools else None)).given(node("a1", model="A100"))
    assert codes(h.when(submit(job, "j1"))) == want


def test_a_pool_with_max_0_adds_no_capacity_and_a_removed_node_none_either() -> None:
    h = Harness(AdmissionCore(pool_config(h100={"max": 0}))).given(node("a1", model="A100"), node("h1"))
    assert codes(h.when(submit(make_job().gpus(8).model("H100"), "j1"))) == []
    h.given(event(NodeDeregistered(node_id="h1")))
    assert codes(h.when(submit(make_job().gpus(8).model("H100"), "j2"))) == ["gpu_model_unknown"]


def test_an_inference_service_does_not_count_towards_max_pending_jobs() -> None:
    cfg = parse_config({"tenants": {"acme": {"maxPendingJobs": 1}}})
    h = Harness(AdmissionCore(cfg)).given(node("n1"))
    svc = make_job("web").type("inference").gpus(1).set("autoscale", auto())
    assert types(h.when(submit(svc, "svc"))) == ["job.submitted", "job.admitted"]
    assert types(h.when(submit(make_job().gpus(1), "r0"))) == ["job.submitted", "job.admitted"]  # its replica
    assert codes(h.when(submit(make_job().gpus(1), "j2"))) == ["too_many_pending"]  # r0 waits: 1 of 1


def _placer(cfg: Any = None) -> Harness[Any]:
    return Harness(PlacerCore(cfg)).given(node("a1", model="A100"))


def test_the_placer_keeps_waiting_a_job_only_a_pool_can_hold_and_fails_one_no_pool_can() -> None:
    big = make_job().gpus(8).model("H100")
    h = _placer(pool_config()).given(submitted(big, "j1"))
    out = h.when(quota_reserved(big, "j1"))
    assert types(out) == ["job.unschedulable"]  # the autoscaler grows the pool for it
    h0 = _placer().given(submitted(big, "j1"))
    assert [e.payload.reason.code for e in h0.when(quota_reserved(big, "j1"))  # type: ignore[union-attr]
            if isinstance(e.payload, JobFailed)] == ["never_fits"]  # as before without pools
    gang = make_job().gpus(8).model("H100").replicas(3)  # 3 nodes: the pool has at most 2
    h.given(submitted(gang, "g"))
    failed = [e.payload for e in h.when(quota_reserved(gang, "g")) if isinstance(e.payload, JobFailed)]
    assert failed and failed[0].reason.code == "never_fits" and "h100 up to 2" in failed[0].reason.message


def test_registered_pool_nodes_are_not_counted_twice() -> None:
    core = pools()
    h = _placer(pool_config())
    for node_id in ("h100-0000", "h100-0001"):  # the pool is at its max: 2 nodes, both busy
        h.given(event(NodeRegistered(node_id=node_id, inventory=pool_inventory("h100", core.pools["h100"], node_id))))
    filler = make_job().gpus(8).model("H100").replicas(2)
    h.given(submitted(filler, "f"), placed("f", ("h100-0000", range(8)), ("h100-0001", range(8))))
    two, three = make_job().gpus(8).model("H100").replicas(2), make_job().gpus(8).model("H100").replicas(3)
    h.given(submitted(two, "two"), submitted(three, "three"))
    assert "job.unschedulable" in types(h.when(quota_reserved(two, "two")))  # fits once f ends: waits
    assert types(h.when(quota_reserved(three, "three"))) == ["job.failed"]  # 2 + 0 more, never 3


def test_a_deregistered_node_leaves_the_placer() -> None:
    h = _placer()
    h.given(node("h1"))
    version = h.state.fleet_version
    h.given(event(NodeDeregistered(node_id="h1")))
    s = h.state
    assert "h1" not in s.nodes and "h1" not in s.inventories and s.fleet_version == version + 1
    assert all("h1" not in bucket for by_free in s.index.values() for bucket in by_free.values())
    job = make_job().gpus(8).model("H100")
    h.given(submitted(job, "j1"))
    assert types(h.when(quota_reserved(job, "j1"))) == ["job.failed"]  # no H100 left, no pool: never fits


# ---------------------------------------------------------------- a node that never registers


def test_a_node_that_never_registers_is_given_up_and_another_asked_for() -> None:
    h = Play(pools(h100={"provisionTimeout": "60s"}))
    waiting(h, "big", 8, s=0, model="H100")
    assert [p.node_id for p in provisions(h.tick(at(10)))] == ["h100-0000"]
    assert h.tick(at(69)) == []  # asked at 10s: not 60s yet
    out = h.tick(at(70))
    assert [(e.type, e.node_id) for e in out] == [("node.removal_requested", "h100-0000")]
    reason = out[0].payload.reason  # type: ignore[union-attr]
    assert reason.code == "provision_timeout" and "never registered" in reason.message and "1 -> 0" in reason.message
    assert h.state.requests["h100-0000"][1] is not None  # the provider is told to delete what it made
    assert [p.node_id for p in provisions(h.tick(at(71)))] == ["h100-0001"]  # its room no longer counts
    registered_pool_node(h, "h100", "h100-0001", 0)  # (registered: never given up)
    assert [e.type for e in h.tick(at(200)) if e.type == "node.removal_requested"] == []


def test_the_default_provision_timeout_is_10_minutes_and_at_least_twice_the_delay() -> None:
    assert pools().pools["h100"].give_up_after_s == 600
    assert pools(h100={"provisionDelay": "20m"}).pools["h100"].give_up_after_s == 2400
    with pytest.raises(SpecError) as err:
        parse_config({"nodePools": {"p": {"provisionDelay": "1m", "provisionTimeout": "30s"}}})
    assert err.value.field == "nodePools.p.provisionTimeout"


def test_pool_summary_counts_nodes_by_state_with_the_last_decision() -> None:
    from gpufleet.services.autoscaler.core import pool_summary

    h = Play(pools(h100={"provisionTimeout": "60s"}))
    registered_pool_node(h, "h100", "h100-0000", 0)
    waiting(h, "big", 8, s=10, model="H100")
    h.tick(at(20))  # h100-0001 asked for
    rows = {r["pool"]: r for r in pool_summary(h.core, h.state)}
    assert set(rows) == {"a10", "h100"}
    h100 = rows["h100"]
    assert (h100["ready"], h100["provisioning"], h100["draining"], h100["min"], h100["max"]) == (1, 1, 0, 0, 2)
    assert h100["last_decision"]["type"] == "node.provision_requested"
    assert h100["last_decision"]["node_id"] == "h100-0001" and "unschedulable" in h100["last_decision"]["reason"]
    assert rows["a10"]["last_decision"] is None and rows["a10"]["nodes"] == []
    h.tick(at(80))  # h100-0001 given up; h100-0000 idle since 5s: cordoned to drain
    h100 = {r["pool"]: r for r in pool_summary(h.core, h.state)}["h100"]
    assert {n["node_id"]: n["state"] for n in h100["nodes"]} == {"h100-0000": "draining", "h100-0001": "given_up"}
    assert h100["last_decision"]["type"] == "node.cordoned"


# ---------------------------------------------------------------- review: refusals, attempts, idle facts, stale demand


def _admission_answer(given: list[Envelope], cmd: Envelope) -> Envelope:
    """What admission answers `cmd` with (a `job.request_refused`), after `given`."""
    adm = Harness(AdmissionCore(parse_config({"tenants": {"acme": {}, "evil": {}}})))
    adm.given(*given)
    out = [e for e in adm.when(cmd) if isinstance(e.payload, JobRequestRefused)]
    assert len(out) == 1, types(out)
    return out[0]


def _running_service() -> tuple[Play, Envelope]:
    """A service at 1 replica, r0 running; and our own `cmd.submit` of r0."""
    h = Play(AutoscalerCore())
    ours = next(e for e in service(h, minReplicas=1) if e.type == "cmd.submit")
    r0 = replica_job_id(SVC, 0)
    h.given(submitted(make_job("web-r0").type("inference").gpus(1), r0), admitted(r0),
            placed(r0, ("n1", [0])), started(r0, "n1", at=at(2)))
    return h, ours


@pytest.mark.parametrize("who", ["another tenant cancels it", "a user submits under its id"])
def test_a_refusal_of_someone_elses_command_about_a_replica_changes_nothing(who: str) -> None:
    """Admission answers a refused command on the requester's subject; only a refusal of our own
    submit means the replica will not be: anything else leaves the running replica counted (it was
    forgotten, a replacement submitted, and the replica never cancelled)."""
    h, _ = _running_service()
    r0 = replica_job_id(SVC, 0)
    known = [submitted(make_job("web-r0").type("inference").gpus(1), r0), admitted(r0)]
    cmd = (event(CancelRequestedCmd(job_id=r0, reason="x"), tenant="evil") if who.startswith("another")
           else submit(make_job("mine").gpus(1), r0))
    refusal = _admission_answer(known, cmd)
    assert h.when(refusal, at(3)) == [] and h.tick(at(10)) == []
    assert list(h.state.services[SVC].replicas) == [r0]
    out = h.when(event(JobCancelled(job_id=SVC, reason="user"), at=at(20)), at(20))
    assert [(e.type, e.job_id) for e in out] == [("cmd.cancel", r0)]


def test_a_refusal_of_our_own_replica_submit_replaces_it_under_another_index() -> None:
    h = Play(AutoscalerCore())
    ours = next(e for e in service(h, minReplicas=1) if e.type == "cmd.submit")
    r0 = replica_job_id(SVC, 0)
    # a user's job took the id first: our submit is refused as a duplicate
    refusal = _admission_answer([submitted(make_job("theirs").gpus(1), r0), admitted(r0)], ours)
    assert refusal.payload.command_id == ours.event_id  # type: ignore[union-attr]
    h.when(refusal, at(1))
    assert replicas(h) == 0
    assert h.tick(at(1.5)) == []  # the backoff after a refusal (2 s from it)
    assert [(e.type, e.job_id) for e in h.tick(at(2.5))] == [("cmd.submit", replica_job_id(SVC, 1))]


def _placed(job_id: str, attempt: int, *nodes: str, s: float) -> Envelope:
    return event(JobPlaced(job_id=job_id, attempt=attempt, allocations=tuple(
        ReplicaAllocation(replica=i, node_id=n, gpu_indices=tuple(range(8))) for i, n in enumerate(nodes))), at=at(s))


def _started(job_id: str, node_id: str, attempt: int, s: float, replica: int = 0) -> Envelope:
    return event(JobStarted(job_id=job_id, node_id=node_id, replica=replica, attempt=attempt), at=at(s))


def test_a_late_exit_of_an_earlier_attempt_frees_nothing() -> None:
    """Attempt 1 ran on n1; the job resumed on pool node h100-0000 (attempt 2). The exit of
    attempt 1 reported late must not make h100-0000 look empty: it is neither cordoned nor removed."""
    h = Play(pools())
    registered_pool_node(h, "h100", "h100-0000", 0)
    h.given(node("n1"), submitted(make_job("j").gpus(8), "j1"), _placed("j1", 1, "n1", s=6))
    h.given(event(JobResumeRequested(job_id="j1", reason=Reason(code="node_lost", message="x")), at=at(100)))
    h.given(_placed("j1", 2, "h100-0000", s=101), _started("j1", "h100-0000", 2, s=102))
    h.given(event(JobExited(job_id="j1", node_id="n1", attempt=1, exit_code=137, reason="node_lost"), at=at(103)))
    assert h.state.on_node["h100-0000"] == {("j1", 0)}
    assert h.tick(at(170)) == [] and h.tick(at(175)) == [] and h.tick(at(10_000)) == []
    h.given(event(JobExited(job_id="j1", node_id="h100-0000", attempt=2, exit_code=0), at=at(10_001)))
    assert "h100-0000" not in h.state.on_node  # its own attempt's exit frees it


def _idle(job_id: str, node_id: str | None, s: float, cause: Envelope | None = None) -> Envelope:
    return event(JobIdleDetected(job_id=job_id, node_id=node_id, gpu_util_pct=1, idle_s=30), at=at(s), cause=cause)


def _story_resumed(h: Play) -> None:
    """j1's attempt 1 on n1, found idle there, reclaimed; attempt 2 placed on h100-0000 (busy)."""
    h.given(node("n1"), submitted(make_job("j").gpus(8), "j1"), _placed("j1", 1, "n1", s=6))
    run1 = _started("j1", "n1", 1, s=7)
    h.given(run1, _idle("j1", "n1", s=50, cause=run1))
    h.given(event(JobExited(job_id="j1", node_id="n1", attempt=1, exit_code=137, reason="preempted"), at=at(90)),
            event(JobResumeRequested(job_id="j1", reason=Reason(code="preempted", message="x")), at=at(90)),
            _placed("j1", 2, "h100-0000", s=100), _started("j1", "h100-0000", 2, s=101))


def _story_late_idle_of_attempt_1(h: Play) -> None:
    """An idle fact of attempt 1 (caused by its job.started) arrives after attempt 2 was placed."""
    h.given(node("n1"), submitted(make_job("j").gpus(8), "j1"), _placed("j1", 1, "n1", s=6))
    run1 = _started("j1", "n1", 1, s=7)
    h.given(run1, _placed("j1", 2, "h100-0000", s=100), _started("j1", "h100-0000", 2, s=101))
    h.given(_idle("j1", "n1", s=102, cause=run1))


def _story_gang_one_idle(h: Play) -> None:
    """A gang on both pool nodes; telemetry found its replica on h100-0001 idle, not the one on h100-0000."""
    registered_pool_node(h, "h100", "h100-0001", 0)
    h.given(submitted(make_job("g").gpus(8).replicas(2), "j1"), _placed("j1", 1, "h100-0000", "h100-0001", s=6))
    run = _started("j1", "h100-0001", 1, s=7, replica=1)
    h.given(_started("j1", "h100-0000", 1, s=7), run, _idle("j1", "h100-0001", s=50, cause=run))


@pytest.mark.parametrize("story", [_story_resumed, _story_late_idle_of_attempt_1, _story_gang_one_idle])
def test_an_idle_fact_marks_only_its_own_run_on_its_own_node(story: Any) -> None:
    h = Play(pools())
    registered_pool_node(h, "h100", "h100-0000", 0)
    story(h)
    core: AutoscalerCore = h.core
    assert core.idle_since(h.state, "h100-0000", core.pools["h100"]) is None  # what runs there is busy
    assert [e for e in h.tick(at(1000)) if e.node_id == "h100-0000"] == []


def test_an_idle_fact_of_the_current_run_on_its_node_still_drains_it() -> None:
    h = Play(pools())
    registered_pool_node(h, "h100", "h100-0000", 0)
    h.given(submitted(make_job("j").gpus(8), "j1"), _placed("j1", 1, "h100-0000", s=6))
    run = _started("j1", "h100-0000", 1, s=7)
    h.given(run, _idle("j1", "h100-0000", s=50, cause=run))
    assert [(e.type, e.node_id) for e in h.tick(at(111))] == [("node.cordoned", "h100-0000")]


def test_a_job_that_ends_leaves_no_record_and_frees_its_node() -> None:
    """One record per job: its spec, its wait, its runs, its idle facts and what it holds go when it
    ends; the node it ran on is empty from then."""
    h = Play(pools())
    registered_pool_node(h, "h100", "h100-0000", 0)
    waiting(h, "j1", 8, s=5, model="H100")
    assert h.state.unschedulable == {"j1"}
    h.given(_placed("j1", 1, "h100-0000", s=6))
    run = _started("j1", "h100-0000", 1, s=7)
    h.given(run, _idle("j1", "h100-0000", s=50, cause=run))
    rec = h.state.jobs["j1"]
    assert rec.waiting is None and not h.state.unschedulable and rec.spec is not None
    assert (rec.run.attempt, set(rec.run.allocs), rec.run.starts) == (1, {0}, {run.event_id: 1})
    assert rec.run.idle == {(1, "h100-0000"): at(50).timestamp()}
    h.given(event(JobCancelled(job_id="j1", reason="x"), at=at(60)))
    assert h.state.jobs == {} and "h100-0000" not in h.state.on_node
    assert h.state.changed_s["h100-0000"] == at(60).timestamp()


def test_a_late_fact_about_a_job_that_ended_holds_no_pool_node_and_brings_no_record_back() -> None:
    """A copy of j1's `job.placed` (and `job.started`, `job.submitted`) redelivered after j1 ended:
    before, it put j1 back on h100-0000 for ever (a ghost allocation: the node never idle, never
    drained) and brought back a record nothing would forget."""
    h = Play(pools())
    registered_pool_node(h, "h100", "h100-0000", 0)
    sub, place = submitted(make_job("j").gpus(8), "j1"), _placed("j1", 1, "h100-0000", s=6)
    run = _started("j1", "h100-0000", 1, s=7)
    h.given(sub, place, run, event(JobExited(job_id="j1", node_id="h100-0000", attempt=1, exit_code=0), at=at(20)),
            event(JobCancelled(job_id="j1", reason="x"), at=at(20)))
    assert h.state.jobs == {} and "h100-0000" not in h.state.on_node
    h.given(place, run, sub)  # late copies, after the end
    assert "h100-0000" not in h.state.on_node, "a late job.placed of an ended job holds its node"
    assert h.state.jobs == {} and not h.state.unschedulable
    assert h.tick(at(79)) == []  # idle since 20 s: not 60 s yet
    assert [(e.type, e.node_id) for e in h.tick(at(81))] == [("node.cordoned", "h100-0000")]


def _queued(job_id: str, s: float) -> Envelope:
    return event(JobQueued(job_id=job_id, queue="default", reason=Reason(code="queue_limit", message="full")),
                 at=at(s))


def _requota(job_id: str, s: float) -> Envelope:
    return event(JobResumeRequested(job_id=job_id, reason=Reason(code="preempted", message="waits for quota")),
                 at=at(s))


@pytest.mark.parametrize("back_to_quota", [[_queued], [_requota], [_requota, _queued]])
def test_a_job_that_waits_for_quota_again_is_no_demand_until_quota_reserves_it(back_to_quota: list[Any]) -> None:
    h = Play(pools())
    waiting(h, "big", 8, s=0, model="H100")
    h.given(*(f("big", 3) for f in back_to_quota))
    assert "big" not in h.state.unschedulable
    assert h.tick(at(10)) == [] and h.tick(at(500)) == []
    # reserved again at 600: the placer tries it, and says nothing new if the reason is unchanged
    h.given(event(JobQuotaReserved(job_id="big", queue="default", cpu_milli=0, memory_mib=0, gpus=8), at=at(600)))
    assert h.tick(at(609)) == []  # waits for nodes again from 600: scaleUpAfter from then
    assert [p.node_id for p in provisions(h.tick(at(610)))] == ["h100-0000"]


def _hour_of_pool_events(h: Play, place: bool = False, s0: int = 0) -> Counter[str]:
    """Ticks for an hour with the sim provider's behaviour (a node registers 5 s after it is asked
    for, goes 1 s after its removal is); with `place`, the waiting job lands on the first new node."""
    pending: list[tuple[int, Envelope]] = []
    counts: Counter[str] = Counter()
    for s in range(s0, s0 + 3600):
        for due, env in [x for x in pending if x[0] <= s]:
            pending.remove((due, env))
            h.given(env)
        for e in h.tick(at(s)):
            counts[e.type] += 1
            p = e.payload
            if isinstance(p, NodeProvisionRequested):
                pending.append((s + 5, event(NodeRegistered(node_id=p.node_id, inventory=p.inventory), at=at(s + 5))))
                if place and p.for_jobs:
                    pending.append((s + 6, _placed(p.for_jobs[0], 1, p.node_id, s=s + 6)))
            if isinstance(p, NodeRemovalRequested):
                pending.append((s + 1, event(NodeDeregistered(node_id=p.node_id), at=at(s + 1))))
    return counts


def test_an_hour_of_a_job_waiting_for_quota_gives_no_pool_events() -> None:
    """The reviewer's story: quota took the job's reservation back at 3 s; it no longer waits for
    nodes (before: 2 nodes bought, then 116 cordons and 116 uncordons in the hour)."""
    h = Play(pools())
    waiting(h, "big", 8, s=0, model="H100")
    h.given(_requota("big", 3), _queued("big", 3))
    assert _hour_of_pool_events(h) == Counter()


def test_an_hour_of_a_job_the_pools_nodes_do_not_help_gives_a_bounded_number_of_pool_events() -> None:
    """A job that waits for nodes and is never placed on those bought for it (the placer sees a
    reason the pool's shape does not show): bought for (up to max), drained, removed, and neither
    taken back nor bought for again."""
    h = Play(pools())
    waiting(h, "big", 8, s=0, model="H100")
    counts = _hour_of_pool_events(h)
    assert counts == Counter({"node.provision_requested": 2, "node.cordoned": 2, "node.removal_requested": 2})
    assert h.state.jobs["big"].waiting.passed_over == {"h100"}


def test_a_draining_node_is_not_taken_back_for_a_job_that_waited_through_it() -> None:
    h = Play(pools(h100={"max": 1}))
    waiting(h, "old", 8, s=0, model="H100")
    registered_pool_node(h, "h100", "h100-0000", 0)  # free from 5 s: the placer did not put "old" there
    out = h.tick(at(70))
    assert [(e.type, e.node_id) for e in out] == [("node.cordoned", "h100-0000")]
    assert h.state.jobs["old"].waiting.passed_over == {"h100"}
    assert h.tick(at(71)) == []  # not taken back for "old" (before: uncordoned, cordoned again, ...)
    assert [(e.type, e.node_id) for e in h.tick(at(80))] == [("node.removal_requested", "h100-0000")]
    h.given(event(NodeDeregistered(node_id="h100-0000"), at=at(91)))
    assert h.tick(at(200)) == []  # nor a node bought for it again
    waiting(h, "new", 8, s=200, model="H100")  # a job that came after: the pool grows for it
    assert [p.for_jobs for p in provisions(h.tick(at(210)))] == [("new",)]


def test_a_job_held_back_only_by_a_backfill_reservation_grows_the_pool_once() -> None:
    """The placer says `backfill_reservation`: the job fits, but only on nodes held for the head
    job. A pool node lets it run now; it lands there, and nothing more is asked."""
    h = Play(pools())
    h.given(submitted(make_job("small").gpus(8).model("H100"), "small"), event(JobUnschedulable(
        job_id="small", reasons=(Reason(code="backfill_reservation", message="held for head"),),
        filtered={"backfill_reservation": 1}), at=at(0)))
    counts = _hour_of_pool_events(h, place=True)
    assert counts == Counter({"node.provision_requested": 1})  # (the node stays busy: 1h sim duration)
    assert "small" not in h.state.unschedulable and h.state.on_node["h100-0000"] == {("small", 0)}


def test_the_sim_provider_does_not_register_again_a_lost_pool_node_being_removed() -> None:
    inv = pool_inventory("h100", pools().pools["h100"], "h100-0000")
    story = [event(NodeProvisionRequested(node_id="h100-0000", pool="h100", provider="sim", inventory=inv,
                                          ready_after_s=5, reason=Reason(code="x", message="x")), at=at(0)),
             event(NodeRegistered(node_id="h100-0000", inventory=inv), at=at(5)),
             event(NodeLost(node_id="h100-0000"), at=at(100))]
    lost: Harness[Any] = Harness(ExecutorCore({}, sim_pools=True)).given(*story)
    assert types(lost.tick(at(101))) == ["node.registered"]  # lost, but here it is: back (as before)
    removed: Harness[Any] = Harness(ExecutorCore({}, sim_pools=True)).given(*story, event(NodeRemovalRequested(
        node_id="h100-0000", pool="h100", provider="sim", reason=Reason(code="idle", message="x")), at=at(101)))
    assert types(removed.tick(at(102))) == ["node.deregistered"]  # (before: registered and deregistered)


@pytest.mark.parametrize("index", ["²", "٣", "1²", "", "-1", "x"])
def test_a_replica_index_that_is_not_plain_digits_is_ignored(index: str) -> None:
    h = Play(AutoscalerCore())
    service(h)
    h.given(event(SubmitRequested(job_id="x-r9", spec={"env": {SERVICE_ENV: SVC, REPLICA_ENV: index}}), actor=ACTOR))
    assert replicas(h) == 1 and h.state.services[SVC].next_index == 1


def test_a_pool_node_lost_for_the_provision_timeout_is_given_up() -> None:
    from gpufleet.services.autoscaler.core import pool_summary

    h = Play(pools(h100={"provisionTimeout": "60s"}))
    registered_pool_node(h, "h100", "h100-0000", 0)
    registered_pool_node(h, "h100", "h100-0001", 0)
    h.given(submitted(make_job("j").gpus(8), "j1"), _placed("j1", 1, "h100-0000", "h100-0001", s=6))
    h.given(event(NodeLost(node_id="h100-0000"), at=at(100)), event(NodeLost(node_id="h100-0001"), at=at(100)))
    h.given(event(NodeLost(node_id="h100-0000"), at=at(130)))  # (said again: the clock runs from the first)
    assert h.tick(at(159)) == []
    h.given(event(NodeRegistered(node_id="h100-0001", inventory=pool_inventory(
        "h100", h.core.pools["h100"], "h100-0001")), at=at(150)))  # back in time: never given up
    out = h.tick(at(160))
    assert [(e.type, e.node_id) for e in out] == [("node.removal_requested", "h100-0000")]
    reason = out[0].payload.reason  # type: ignore[union-attr]
    assert reason.code == "lost" and "lost 60s ago" in reason.message and "2 -> 1" in reason.message
    row = {r["pool"]: r for r in pool_summary(h.core, h.state)}["h100"]
    assert {n["node_id"]: n["state"] for n in row["nodes"]} == {"h100-0000": "removing", "h100-0001": "ready"}
    assert h.tick(at(1000)) == []  # asked once


def test_gpufleet_pools_takes_a_config_option(tmp_path: Any) -> None:
    from typer.testing import CliRunner

    from gpufleet.cli import app

    res = CliRunner().invoke(app, ["pools", "--data-dir", str(tmp_path), "--config", str(tmp_path / "nope.yaml")])
    assert res.exit_code == 2 and "nope.yaml" in res.output  # read before anything is asked of the mesh
