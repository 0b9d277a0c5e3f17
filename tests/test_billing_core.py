"""Billing, pure: given events -> the charges, the budget events, the admission hold, the estimate."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.billing import report
from gpufleet.services.billing.core import BillingCore
from gpufleet.services.billing.pricing import mig_share
from gpufleet.shared.clusterconfig import ClusterConfig, parse_config
from gpufleet.shared.errors import SpecError
from gpufleet.shared.events import (
    Envelope,
    JobExited,
    JobIdleDetected,
    JobIdleEnded,
    JobPlaced,
    JobResumeRequested,
    JobStarted,
    NodeLost,
    Reason,
    ReplicaAllocation,
)

from .builders import T0, Harness, cancelled, event, make_job, mig_node, node, placed, submit, submitted

PRICES = {"currency": "EUR", "gpuHour": {"H100": "3.60", "A100": "1.80", "*": "1"}, "cpuCoreHour": "0.036",
          "memoryGiBHour": "0.0036"}
H = timedelta(hours=1)


def config(**extra: object) -> ClusterConfig:
    return parse_config({"prices": PRICES, **extra})


def harness(cfg: ClusterConfig | None = None) -> Harness:  # type: ignore[type-arg]
    return Harness(BillingCore(cfg or config(), keep_charges=True))


def start(job: str, at: timedelta, replica: int = 0, attempt: int = 1, node_id: str = "n1") -> Envelope:
    return event(JobStarted(job_id=job, node_id=node_id, replica=replica, attempt=attempt), at=T0 + at)


def exit_(job: str, at: timedelta, replica: int = 0, attempt: int = 1, reason: str = "completed",
          node_id: str = "n1") -> Envelope:
    return event(JobExited(job_id=job, node_id=node_id, replica=replica, attempt=attempt, exit_code=0,
                           reason=reason), at=T0 + at)  # type: ignore[arg-type]


def placed_share(job: str, gpu_milli: int, attempt: int = 1) -> Envelope:
    return event(JobPlaced(job_id=job, attempt=attempt, allocations=(ReplicaAllocation(
        replica=0, node_id="n1", gpu_indices=(0,), cpu_milli=0, memory_mib=0, gpu_milli=gpu_milli),)))


def costs(h: Harness) -> dict[str, Decimal]:  # type: ignore[type-arg]
    return {c.key: c.cost for c in h.state.charges}


# ---------------------------------------------------------------- metering


def test_an_interval_costs_its_gpus_cores_and_memory_times_its_hours() -> None:
    h = harness().given(node("n1"), submitted(make_job().gpus(2).queue("research"), "j1"),
                        placed("j1", ("n1", [0, 1]), cpu_milli=4000, memory_mib=8 * 1024))
    h.when(start("j1", timedelta(0)))
    h.when(exit_("j1", 2 * H))
    [c] = h.state.charges
    by = {line.resource: line for line in c.lines}
    assert by["gpu/H100"].cost == Decimal("14.4")  # 2 GPUs x 2 h x 3.60
    assert by["cpu"].cost == Decimal("0.288")  # 4 cores x 2 h x 0.036
    assert by["memory"].cost == Decimal("0.0576")  # 8 GiB x 2 h x 0.0036
    assert c.cost == Decimal("14.7456") and c.gpu_seconds == 4 * 3600
    assert (c.key, c.queue, c.end, c.currency) == ("j1:0:1", "research", "exited:completed", "EUR")
    assert h.state.spent[("tenant", "acme")] == h.state.spent[("queue", "research")] == c.cost


@pytest.mark.parametrize(("gpu_milli", "expected"), [(1000, "3.6"), (500, "1.8"), (250, "0.9"), (1, "0.0036")])
def test_a_gpu_share_costs_its_fraction(gpu_milli: int, expected: str) -> None:
    h = harness().given(node("n1"), placed_share("j1", gpu_milli))
    h.when(start("j1", timedelta(0)))
    h.when(exit_("j1", H))
    assert costs(h) == {"j1:0:1": Decimal(expected)}


def test_a_mig_instance_costs_its_slices_of_its_gpu() -> None:
    h = harness()
    h.given(mig_node("m1"))
    uuids = [u for u, (model, profile) in h.state.mig_devices.items() if profile == "3g.40gb"][:1]
    h.given(event(JobPlaced(job_id="j1", allocations=(ReplicaAllocation(
        replica=0, node_id="m1", mig_devices=tuple(uuids), cpu_milli=0, memory_mib=0),))))
    h.when(start("j1", timedelta(0), node_id="m1"))
    h.when(exit_("j1", 7 * H, node_id="m1"))
    assert mig_share("3g.40gb") * 7 == 3
    assert costs(h) == {"j1:0:1": Decimal("3.6") * 3}  # 3/7 of a GPU for 7 h


def test_duplicated_and_replayed_events_are_counted_once() -> None:
    h = harness().given(node("n1"))
    p = placed_share("j1", 1000)
    s, e = start("j1", timedelta(0)), exit_("j1", H)
    for env in (p, p, s, s, e, s, e, p, s):  # duplicates, and late copies after the end
        h.when(env)
    assert costs(h) == {"j1:0:1": Decimal("3.6")}
    assert not h.state.open and h.state.intervals == 1


def test_preemption_then_resume_is_two_intervals() -> None:
    h = harness().given(node("n1"), placed_share("j1", 1000))
    h.when(start("j1", timedelta(0)))
    h.when(exit_("j1", H, reason="preempted"))
    h.when(event(JobResumeRequested(job_id="j1", reason=Reason(code="preempted", message="x")), at=T0 + H))
    h.when(placed_share("j1", 1000, attempt=2))
    h.when(start("j1", 3 * H, attempt=2))
    h.when(exit_("j1", 5 * H, attempt=2))
    assert costs(h) == {"j1:0:1": Decimal("3.6"), "j1:0:2": Decimal("7.2")}
    assert [c.end for c in h.state.charges] == ["exited:preempted", "exited:completed"]


def test_an_interval_without_an_exit_ends_with_the_job_the_resume_or_the_node() -> None:
    h = harness().given(node("n1"), node("n2"), placed_share("a", 1000), placed_share("b", 1000),
                        event(JobPlaced(job_id="c", allocations=(ReplicaAllocation(
                            replica=0, node_id="n2", gpu_indices=(1,), cpu_milli=0, memory_mib=0),))),
                        placed_share("never", 1000))
    for job in ("a", "b"):
        h.when(start(job, timedelta(0)))
    h.when(start("c", timedelta(0), node_id="n2"))
    h.when(event(JobResumeRequested(job_id="a", reason=Reason(code="node_lost", message="x")), at=T0 + H))
    h.when(cancelled("b"))  # at T0 + a few ms
    h.when(event(NodeLost(node_id="n2"), at=T0 + 2 * H))
    h.when(cancelled("never"))  # placed, never started: nothing allocated was used
    ends = {c.key: c.end for c in h.state.charges}
    assert ends == {"a:0:1": "resumed", "b:0:1": "cancelled", "c:0:1": "node_lost"}
    assert costs(h)["c:0:1"] == Decimal("7.2") and not h.state.open and not h.state.placements


def test_idle_cost_counts_from_when_the_gpus_went_idle_to_when_they_were_busy_or_released() -> None:
    h = harness().given(node("n1"), placed_share("j1", 1000))
    h.when(start("j1", timedelta(0)))
    h.when(event(JobIdleDetected(job_id="j1", gpu_util_pct=1.0, idle_s=1800.0), at=T0 + H))  # idle since 0:30
    h.when(event(JobIdleDetected(job_id="j1", gpu_util_pct=1.0, idle_s=3600.0), at=T0 + H + H / 2))  # said again
    h.when(event(JobIdleEnded(job_id="j1", gpu_util_pct=80.0), at=T0 + 2 * H))
    h.when(event(JobIdleDetected(job_id="j1", gpu_util_pct=2.0, idle_s=0.0), at=T0 + 3 * H))
    h.when(exit_("j1", 4 * H))
    [c] = h.state.charges
    assert c.idle_gpu_seconds == Decimal(5400 + 3600)
    assert c.idle_cost == Decimal("9.0") and c.cost == Decimal("14.4")


# ---------------------------------------------------------------- budgets


def budget_events(out: list[Envelope]) -> list[tuple[str, int]]:
    return [(e.type, e.payload.threshold_pct) for e in out if e.type.startswith("budget.")]  # type: ignore[union-attr]


def test_each_threshold_is_said_once_as_spending_grows() -> None:
    cfg = config(budgets={"tenants": {"acme": {"amount": "10", "thresholds": [50, 80], "policy": "hold"}}})
    h = harness(cfg).given(node("n1"), placed_share("j1", 1000))
    h.when(start("j1", timedelta(0)))
    assert budget_events(h.tick(T0 + H)) == []  # 3.60 of 10
    out = h.tick(T0 + 2 * H)  # 7.20: 50 % crossed
    assert budget_events(out) == [("budget.threshold_reached", 50)]
    assert out[0].subject() == "fleet.evt.sys.budget.tenant.acme.threshold_reached"
    assert budget_events(h.tick(T0 + 2 * H + H / 6)) == []  # 7.80: said already
    out = h.when(exit_("j1", 3 * H))  # 10.80: 80 and 100 at once (no tick in between)
    assert budget_events(out) == [("budget.threshold_reached", 80), ("budget.exceeded", 100)]
    exceeded = out[1]
    assert exceeded.payload.spent == Decimal("10.8") and exceeded.payload.policy == "hold"  # type: ignore[union-attr]
    assert budget_events(h.tick(T0 + 5 * H)) == [] and budget_events(h.start(T0 + 5 * H)) == []
    # another instance folding the same log (without these events yet) decides the same ids, so
    # the server keeps one of each
    h2 = harness(cfg).given(node("n1"), placed_share("j1", 1000), start("j1", timedelta(0)), exit_("j1", 3 * H))
    assert [e.event_id for e in h2.start(T0 + 4 * H)][-2:] == [o.event_id for o in out]


def test_ids_are_deterministic_and_a_raised_budget_has_thresholds_of_its_own() -> None:
    def run(amount: str) -> list[Envelope]:
        cfg = config(budgets={"queues": {"default": {"amount": amount}}})
        h = harness(cfg).given(node("n1"), placed_share("j1", 1000), start("j1", timedelta(0)))
        return h.when(exit_("j1", 10 * H))  # 36.00

    first, second = run("20"), run("20")
    assert [e.event_id for e in first] == [e.event_id for e in second]
    assert budget_events(first) == [("budget.threshold_reached", 50), ("budget.threshold_reached", 80),
                                    ("budget.exceeded", 100)]
    raised = run("50")  # 72 %
    assert budget_events(raised) == [("budget.threshold_reached", 50)]
    assert not {e.event_id for e in raised} & {e.event_id for e in first}


def exceeded_event(scope: str, name: str, amount: str) -> Envelope:
    cfg = config(budgets={f"{scope}s": {name: {"amount": amount, "policy": "hold"}}})
    h = harness(cfg).given(node("n1"), submitted(make_job().queue("q1"), "x"), placed_share("x", 1000),
                           start("x", timedelta(0)))
    return [e for e in h.when(exit_("x", 100 * H)) if e.type == "budget.exceeded"][0]


@pytest.mark.parametrize(("scope", "name", "field"), [("tenant", "acme", "tenant"), ("queue", "q1", "queue")])
def test_admission_rejects_new_submits_while_a_hold_budget_is_exceeded(scope: str, name: str, field: str) -> None:
    fact = exceeded_event(scope, name, "100")
    job = make_job().queue("q1")
    hold = config(budgets={f"{scope}s": {name: {"amount": "100", "policy": "hold"}}})
    h = Harness(AdmissionCore(hold)).given(fact)
    [rejected] = h.when(submit(job, "j1"))
    assert rejected.type == "job.rejected"
    [reason] = rejected.payload.reasons  # type: ignore[union-attr]
    assert (reason.code, reason.field) == ("budget_exceeded", field) and name in reason.message
    # warn only, or a raised budget: admitted
    for cfg in (config(budgets={f"{scope}s": {name: {"amount": "100", "policy": "warn"}}}),
                config(budgets={f"{scope}s": {name: {"amount": "150", "policy": "hold"}}})):
        out = Harness(AdmissionCore(cfg)).given(fact).when(submit(job, "j2"))
        assert [e.type for e in out] == ["job.submitted", "job.admitted"]
    # another tenant and another queue are not held
    other = Harness(AdmissionCore(hold)).given(fact).when(submit(make_job(tenant="zeta").queue("q2"), "j3"))
    assert [e.type for e in other] == ["job.submitted", "job.admitted"]


# ---------------------------------------------------------------- config, estimate, report


@pytest.mark.parametrize(("data", "field"), [
    ({"prices": {"gpuHour": {"H100": -1}}}, "prices.gpuHour.H100"),
    ({"prices": {"cpuCoreHour": "cheap"}}, "prices.cpuCoreHour"),
    ({"prices": {"memoryGiBHour": True}}, "prices.memoryGiBHour"),
    ({"prices": {"currency": "€"}}, "prices.currency"),
    ({"budgets": {"tenants": {"acme": {"amount": "NaN"}}}}, "budgets.tenants.acme.amount"),
    ({"budgets": {"queues": {"q": {"amount": 1, "thresholds": [0]}}}}, "budgets.queues.q.thresholds"),
    ({"budgets": {"queues": {"q": {"amount": 1, "policy": "block"}}}}, "budgets.queues.q.policy"),
    ({"budgets": {"teams": {}}}, "budgets.teams"),
])
def test_bad_prices_and_budgets_name_the_field(data: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_config(data)
    assert err.value.field == field, str(err.value)


def test_prices_are_decimals_never_floats() -> None:
    cfg = parse_config({"prices": {"gpuHour": {"H100": 4.1}, "cpuCoreHour": 0.1}})
    assert cfg.prices.gpu("H100") == Decimal("4.1") and cfg.prices.cpu_core_hour == Decimal("0.1")
    assert cfg.prices.gpu("B200") == 0  # neither listed nor "*"


def test_an_estimate_is_resources_times_duration_times_prices() -> None:
    spec = make_job().gpus(2).model("A100").replicas(3).cpu(4).memory("10Gi").max_runtime("2h").spec()
    doc = report.estimate(spec, config())
    # per replica per hour: 2 x 1.80 + 4 x 0.036 + 10 x 0.0036 = 3.78; x 3 replicas x 2 h
    assert (doc["cost"], doc["gpu_model"], doc["gpu_hours"]) == ("22.68", "A100", "12.000000")
    assert report.estimate(spec, config(), duration_s=1800)["cost"] == "5.67"
    # no model named: the dearest the cluster has, and the cheapest
    open_ = make_job().gpus(1).cpu(0).memory(0).max_runtime("1h").spec()
    doc = report.estimate(open_, config(), cluster_models={"A100", "H100"})
    assert (doc["cost"], doc["cost_min"], doc["gpu_model"]) == ("3.60", "1.80", "H100")


def test_the_bill_groups_and_cuts_at_the_window() -> None:
    core = BillingCore(config(), keep_charges=True)
    h = Harness(core).given(node("n1"), node("n2", model="A100"), submitted(make_job().queue("q1"), "j1"),
                            placed_share("j1", 1000),
                            event(JobPlaced(job_id="j2", allocations=(ReplicaAllocation(
                                replica=0, node_id="n2", gpu_indices=(0,), cpu_milli=1000, memory_mib=0),)),
                                tenant="zeta"))
    h.when(start("j1", timedelta(0)))
    h.when(exit_("j1", 2 * H))
    h.when(event(JobStarted(job_id="j2", node_id="n2"), at=T0 + H, tenant="zeta"))
    items = report.charges(core, h.state, T0 + 3 * H)  # j2 still runs: charged to now
    rows = {r.key: r for r in report.bill(items, "gpu-model")}
    assert rows["H100"].cost == Decimal("7.2") and rows["A100"].cost == Decimal("3.6")
    assert rows["-"].cost == Decimal("0.072") and rows["A100"].running == 1
    by_tenant = {r.key: r.cost for r in report.bill(report.charges(core, h.state, T0 + 3 * H, tenant="acme"))}
    assert by_tenant == {"acme": Decimal("7.2")}
    window = report.charges(core, h.state, T0 + 3 * H, since=T0 + H, until=T0 + 2 * H)
    doc = report.bill_json(report.bill(window, "job"), "job", "EUR")
    assert {r["key"]: r["cost"] for r in doc["rows"]} == {"j1": "3.60", "j2": "1.836"}
    assert doc["total"]["cost"] == "5.436" and report.bill_csv(doc).startswith("key,intervals")
