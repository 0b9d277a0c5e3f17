"""Billing, pure: given events -> the charges, the budget events, the admission hold, the estimate."""

from __future__ import annotations

import copy
from datetime import timedelta
from decimal import Decimal

import pytest

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.billing import report
from gpufleet.services.billing.core import BillingCore
from gpufleet.services.billing.pricing import mig_share
from gpufleet.shared.contract.clusterconfig import ClusterConfig, parse_config
from gpufleet.shared.contract.errors import SpecError
from gpufleet.shared.contract.events import (
    Envelope,
    JobExited,
    JobIdleDetected,
    JobIdleEnded,
    JobPlaced,
    JobResumeRequested,
    JobStarted,
    JobSucceeded,
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


def test_an_interval_without_an_exit_ends_with_the_job_the_next_placement_or_the_node() -> None:
    h = harness().given(node("n1"), node("n2"), placed_share("a", 1000), placed_share("b", 1000),
                        event(JobPlaced(job_id="c", allocations=(ReplicaAllocation(
                            replica=0, node_id="n2", gpu_indices=(1,), cpu_milli=0, memory_mib=0),))),
                        placed_share("never", 1000))
    for job in ("a", "b"):
        h.when(start(job, timedelta(0)))
    h.when(start("c", timedelta(0), node_id="n2"))
    h.when(event(JobResumeRequested(job_id="a", reason=Reason(code="crashed", message="x")), at=T0 + H))
    assert "a:0:1" in h.state.open  # a resume ends nothing: the placer holds its GPUs until its exit
    # a later attempt is placed only once the placer freed the earlier one: an exit the log lacks ends there
    h.when(event(JobPlaced(job_id="a", attempt=2, allocations=(ReplicaAllocation(
        replica=0, node_id="n1", gpu_indices=(0,), cpu_milli=0, memory_mib=0),)), at=T0 + H + H / 2))
    h.when(cancelled("b"))  # at T0 + a few ms
    h.when(event(NodeLost(node_id="n2"), at=T0 + 2 * H))
    h.when(cancelled("never"))  # placed, never started: nothing allocated was used
    h.when(cancelled("a"))
    ends = {c.key: c.end for c in h.state.charges}
    assert ends == {"a:0:1": "replaced", "b:0:1": "cancelled", "c:0:1": "node_lost"}
    assert costs(h)["a:0:1"] == Decimal("5.4")  # 1.5 h
    assert costs(h)["c:0:1"] == Decimal("7.2") and not h.state.open and h.state.size()["placements"] == 0


def test_a_duplicated_resume_ends_nothing_and_the_running_attempt_is_billed_in_full() -> None:
    # review8 b1: a copy of job.resume_requested (replayed, or re-published after the 120 s
    # duplicate window) closed the running attempt 2 as `resumed` at 0 cost
    h = harness().given(node("n1"), submitted(make_job().queue("q1"), "j1"), placed_share("j1", 1000))
    resume = event(JobResumeRequested(job_id="j1", reason=Reason(code="preempted", message="x")), at=T0 + H)
    for env in (start("j1", timedelta(0)), exit_("j1", H, reason="preempted"), resume,
                placed_share("j1", 1000, attempt=2), start("j1", 2 * H, attempt=2)):
        h.when(env)
    before = (set(h.state.open), copy.deepcopy(h.state.jobs["j1"]))  # its attempt, closed keys, placements
    h.when(resume)  # the same event again while attempt 2 runs
    h.when(event(JobResumeRequested(job_id="j1", reason=Reason(code="preempted", message="x")), at=T0 + 3 * H))
    assert (set(h.state.open), h.state.jobs["j1"]) == before
    h.when(exit_("j1", 5 * H, attempt=2))
    assert costs(h) == {"j1:0:1": Decimal("3.6"), "j1:0:2": Decimal("10.8")}  # 3 h x 3.60
    assert [c.end for c in h.state.charges] == ["exited:preempted", "exited:completed"]
    assert h.state.spent[("queue", "q1")] == Decimal("14.4")


def test_an_old_attempt_is_billed_to_its_own_exit_not_to_the_resume() -> None:
    # review8 b4: a gang loses one node; its other replica holds its GPU (the placer's books)
    # until it is stopped, after the resume: billed to that exit, as the placer holds it
    h = harness(config(prices={"gpuHour": {"*": "1"}, "cpuCoreHour": "0", "memoryGiBHour": "0"}))
    h.given(node("n1"), node("n2"), node("n3"), submitted(make_job().gpus(1).replicas(2), "g"),
            placed("g", ("n1", [0]), ("n2", [0]), cpu_milli=0, memory_mib=0))
    for env in (
        start("g", timedelta(0), 0, node_id="n1"), start("g", H / 10, 1, node_id="n2"),
        event(NodeLost(node_id="n2"), at=T0 + H),
        event(JobResumeRequested(job_id="g", reason=Reason(code="node_lost", message="x")), at=T0 + H),
        event(JobExited(job_id="g", node_id="n1", replica=0, attempt=1, exit_code=137, reason="killed"),
              at=T0 + H + H / 10),
        placed("g", ("n1", [0]), ("n3", [0]), cpu_milli=0, memory_mib=0, attempt=2),
        start("g", 2 * H, 0, attempt=2, node_id="n1"), start("g", 2 * H, 1, attempt=2, node_id="n3"),
        start("g", 2 * H + H / 2, 0, attempt=1, node_id="n1"),  # a late copy of attempt 1's start
        event(JobSucceeded(job_id="g"), at=T0 + 3 * H),
    ):
        h.when(env)
    assert {c.key: (c.cost, c.end) for c in h.state.charges} == {
        "g:1:1": (Decimal("0.9"), "node_lost"), "g:0:1": (Decimal("1.1"), "exited:killed"),
        "g:0:2": (Decimal("1"), "succeeded"), "g:1:2": (Decimal("1"), "succeeded")}
    assert not h.state.open


def test_idle_cost_counts_from_when_the_gpus_went_idle_to_when_they_were_busy_or_released() -> None:
    h = harness().given(node("n1"), placed_share("j1", 1000))
    h.when(start("j1", timedelta(0)))
    h.when(event(JobIdleDetected(job_id="j1", gpu_util_pct=1.0, idle_s=1800.0), at=T0 + H))  # idle since 0:30
    h.when(event(JobIdleDetected(job_id="j1", gpu_util_pct=1.0, idle_s=3600.0), at=T0 + H + H / 2))  # said again
    h.when(event(JobIdleEnded(job_id="j1", gpu_util_pct=80.0), at=T0 + 2 * H))
    h.when(event(JobIdleDetected(job_id="j1", gpu_util_pct=2.0, idle_s=0.0), at=T0 + 3 * H))
    from gpufleet.services.billing import metrics
    from gpufleet.shared.runtime import otel

    otel.METRICS = True  # (the gauges' store, read back below; no exporter)
    try:
        metrics.export(h.core, h.state, now=T0 + 3 * H + H / 2)  # while it runs: idle since 3:00
        assert otel._tenants[("acme", "EUR")] == (float(Decimal("3.6") * Decimal("3.5")), 3.6 * 2, 1.0)
        h.when(exit_("j1", 4 * H))
        metrics.export(h.core, h.state, now=T0 + 5 * H)
        assert otel._tenants[("acme", "EUR")] == (14.4, 9.0, 0.0) and not otel._allocated
    finally:
        otel.shutdown()
    [c] = h.state.charges
    assert c.idle_gpu_seconds == Decimal(5400 + 3600)
    assert c.idle_cost == Decimal("9.0") and c.cost == Decimal("14.4")
    assert h.state.idle_spent[("tenant", "acme")] == h.state.idle_spent[("queue", "default")] == Decimal("9.0")


def test_a_copy_of_an_idle_detected_after_the_idle_ended_counts_nothing() -> None:
    h = harness().given(node("n1"), placed_share("j1", 1000))
    idle = event(JobIdleDetected(job_id="j1", gpu_util_pct=1.0, idle_s=1800.0), at=T0 + H)  # idle since 0:30
    for env in (start("j1", timedelta(0)), idle, event(JobIdleEnded(job_id="j1", gpu_util_pct=80.0), at=T0 + 2 * H),
                idle, exit_("j1", 4 * H)):  # the copy: without its id known, idle again from 0:30 to 4:00
        h.when(env)
    [c] = h.state.charges
    assert c.idle_gpu_seconds == Decimal(5400) and c.idle_cost == Decimal("5.4") and c.cost == Decimal("14.4")


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


def test_the_bill_by_gpu_model_counts_each_interval_once_in_the_total() -> None:
    # review8 b3: an interval has lines in its GPU model's row and in `-` (CPU, memory)
    core = BillingCore(config(), keep_charges=True)
    h = Harness(core).given(node("n1"), node("n2", model="A100"), placed("j1", ("n1", [0])),
                            placed("j2", ("n2", [0])), start("j1", timedelta(0)))
    h.when(exit_("j1", H))
    h.when(start("j2", timedelta(0), node_id="n2"))  # still running
    items = report.charges(core, h.state, T0 + 2 * H)
    for by in report.BY:
        doc = report.bill_json(report.bill(items, by), by, "EUR")
        assert (doc["total"]["intervals"], doc["total"]["running"]) == (2, 1), by
    rows = {r.key: (r.intervals, r.running) for r in report.bill(items, "gpu-model")}
    assert rows == {"-": (2, 1), "H100": (1, 0), "A100": (1, 1)}


# ---------------------------------------------------------------- memory: what an ended job leaves


def test_an_ended_job_leaves_only_its_id_and_its_late_copies_count_nothing() -> None:
    from gpufleet.services.billing.core import ENDED_KEPT_S
    from gpufleet.shared.contract.events import JobSucceeded

    h = harness().given(node("n1"), submitted(make_job().queue("q1"), "j1"))
    p1, s1, e1 = placed_share("j1", 1000), start("j1", timedelta(0)), exit_("j1", H, reason="preempted")
    resume = event(JobResumeRequested(job_id="j1", reason=Reason(code="preempted", message="x")), at=T0 + H)
    p2, s2, e2 = placed_share("j1", 1000, attempt=2), start("j1", 2 * H, attempt=2), exit_("j1", 3 * H, attempt=2)
    for env in (p1, s1, e1, resume, p2, s2):
        h.when(env)
    h.when(s1)  # a late copy of attempt 1's start while attempt 2 runs: its interval is closed
    assert set(h.state.open) == {"j1:0:2"} and h.state.jobs["j1"].intervals["j1:0:1"] is None  # closed
    h.when(e2)
    done = event(JobSucceeded(job_id="j1"), at=T0 + 3 * H)
    h.when(done)
    assert costs(h) == {"j1:0:1": Decimal("3.6"), "j1:0:2": Decimal("3.6")}
    pruned = {k: v for k, v in h.state.size().items() if k not in ("ended", "spent", "charges")}
    assert set(pruned.values()) == {0}, pruned  # no record, placement or key of j1 is left
    assert list(h.state.ended) == ["j1"]
    # every event of the job again, duplicated and late, in any order: nothing counted, nothing kept
    for env in (p1, s1, e1, resume, p2, s2, e2, done, submitted(make_job().queue("q1"), "j1"), p2, s2,
                event(JobIdleDetected(job_id="j1", gpu_util_pct=1.0, idle_s=60.0), at=T0 + 3 * H)):
        h.when(env)
    assert costs(h) == {"j1:0:1": Decimal("3.6"), "j1:0:2": Decimal("3.6")} and h.state.intervals == 2
    assert h.state.spent[("queue", "q1")] == Decimal("7.2")
    assert {k: v for k, v in h.state.size().items() if k in pruned} == pruned
    # the id itself is forgotten ENDED_KEPT_S of log time after the end
    later = T0 + 3 * H + timedelta(seconds=ENDED_KEPT_S)
    h.when(event(JobPlaced(job_id="j2", allocations=(ReplicaAllocation(
        replica=0, node_id="n1", gpu_indices=(1,), cpu_milli=0, memory_mib=0),)), at=later))
    assert "j1" in h.state.ended
    h.when(start("j2", later - T0 + timedelta(seconds=1)))
    assert "j1" not in h.state.ended and h.state.size()["ended"] == 0


def test_a_replica_that_starts_after_its_job_ended_is_charged_for_its_run() -> None:
    # Seen in the 10,000-job bench chaos: a gang's replica 0 was preempted and the job ended while
    # the agent of replica 1 lagged; it started replica 1 after the end and stopped it at once.
    # That run happened (a real driver launched it): it is charged, from its start to its exit.
    from gpufleet.shared.contract.events import JobPreempted

    h = harness().given(node("n1"), node("n2"), submitted(make_job().gpus(1).replicas(2), "g"),
                        placed("g", ("n1", [0]), ("n2", [0])))
    h.when(start("g", timedelta(0), replica=0, node_id="n1"))
    h.when(exit_("g", H, replica=0, reason="preempted", node_id="n1"))
    h.when(event(JobPreempted(job_id="g", reason=Reason(code="preempted", message="x")), at=T0 + H))
    assert set(h.state.late) == {"g"} and not h.state.jobs
    h.when(start("g", H + timedelta(seconds=1), replica=1, node_id="n2"))
    h.when(start("g", H + timedelta(seconds=1), replica=1, node_id="n2"))  # a copy
    h.when(exit_("g", H + timedelta(seconds=31), replica=1, reason="preempted", node_id="n2"))
    assert sorted((c.key, c.ended_at - c.started_at) for c in h.state.charges) == [
        ("g:0:1", H), ("g:1:1", timedelta(seconds=30))]
    assert not h.state.late and not h.state.open  # nothing more of it can start: nothing kept
    h.when(start("g", H + timedelta(seconds=40), replica=1, node_id="n2"))  # a late copy: nothing
    assert len(h.state.charges) == 2 and not h.state.open


def test_many_jobs_leave_nothing_once_ended_and_forgotten() -> None:
    from gpufleet.shared.contract.events import JobRejected, JobSucceeded

    h = harness().given(node("n1"))
    for i in range(200):
        at = timedelta(minutes=i)
        h.given(submitted(make_job().queue(f"q{i % 3}"), f"j{i}"), placed_share(f"j{i}", 500),
                start(f"j{i}", at), exit_(f"j{i}", at + timedelta(seconds=30)),
                event(JobSucceeded(job_id=f"j{i}"), at=T0 + at + timedelta(seconds=31)),
                # a rejected submit leaves nothing either
                submitted(make_job(), f"r{i}"),
                event(JobRejected(job_id=f"r{i}", reasons=(Reason(code="x", message="x"),)), at=T0 + at))
    size = h.state.size()
    assert h.state.intervals == 200 and len(h.state.charges) == 200
    assert (size["jobs"], size["placements"], size["closed"], size["open"]) == (0, 0, 0, 0)
    assert size["ended"] == 2 * 61  # the last hour's ends (and their rejections), by log time


# ---------------------------------------------------------------- monthly budgets


def test_a_monthly_budget_starts_again_each_month_and_says_each_threshold_once_per_month() -> None:
    from datetime import UTC, datetime

    budget = {"amount": "10", "thresholds": [50], "policy": "hold", "period": "month"}
    cfg = config(budgets={"tenants": {"acme": budget}})
    assert config(budgets={"tenants": {"acme": {"amount": "1"}}}).budgets.tenants["acme"].period == "all"
    jan = datetime(2026, 1, 31, 20, 0, tzinfo=UTC)  # 3.60 an hour from 20:00 on January 31
    feb = datetime(2026, 2, 1, tzinfo=UTC)
    h = harness(cfg).given(node("n1"), placed_share("j1", 1000), event(JobStarted(job_id="j1", node_id="n1"), at=jan))
    said = h.tick(jan + 2 * H)  # 7.20 in January: 50 %
    assert budget_events(said) == [("budget.threshold_reached", 50)]
    said += h.tick(jan + 3 * H)  # 10.80: exceeded
    assert budget_events(said) == [("budget.threshold_reached", 50), ("budget.exceeded", 100)]
    assert budget_events(h.tick(jan + 3 * H + H / 2)) == []  # said once
    assert budget_events(h.tick(feb + H / 2)) == []  # February: 1.80 so far, spending started again
    feb_50 = h.tick(feb + 2 * H)  # 7.20 in February
    assert budget_events(feb_50) == [("budget.threshold_reached", 50)]
    feb_100 = h.when(event(JobExited(job_id="j1", node_id="n1", exit_code=0, reason="completed"), at=feb + 3 * H),
                     now=feb + 3 * H)  # 10.80 in February
    assert budget_events(feb_100) == [("budget.exceeded", 100)] and budget_events(h.tick(feb + 4 * H)) == []
    assert [e.payload.period for e in said + feb_50 + feb_100] == ["2026-01"] * 2 + ["2026-02"] * 2  # type: ignore[union-attr]
    assert feb_50[0].event_id != said[0].event_id and feb_50[0].payload.spent == Decimal("7.2")  # type: ignore[union-attr]
    # the interval (7 h) is split at the month's edge: 4 h in January, 3 h in February
    acme = ("tenant", "acme")
    assert h.state.spent_month == {(acme, "2026-01"): Decimal("14.4"), (acme, "2026-02"): Decimal("10.8")}
    assert h.state.spent[acme] == Decimal("25.2") and costs(h) == {"j1:0:1": Decimal("25.2")}
    # the hold lasts the month it was exceeded in: a submit on January 31 is rejected, one on February 1 is not
    [jan_exceeded] = [e for e in said if e.type == "budget.exceeded"]
    adm = Harness(AdmissionCore(cfg)).given(jan_exceeded)
    [rejected] = adm.when(submit(make_job(), "j2"), now=jan + 4 * H - timedelta(seconds=1))
    assert rejected.type == "job.rejected" and "in 2026-01" in rejected.payload.reasons[0].message  # type: ignore[union-attr]
    assert types_of(adm.when(submit(make_job(), "j3"), now=feb)) == ["job.submitted", "job.admitted"]
    # a second instance folding the same log says the same ids (the server keeps one of each)
    again = harness(cfg).given(node("n1"), placed_share("j1", 1000), event(JobStarted(job_id="j1", node_id="n1"), at=jan))
    assert [e.event_id for e in again.tick(jan + 3 * H)] == [e.event_id for e in said]


def types_of(out: list[Envelope]) -> list[str]:
    return [e.type for e in out]


def test_the_example_cluster_config_has_prices_and_budgets() -> None:
    from pathlib import Path

    from gpufleet.shared.contract.clusterconfig import load_config

    cfg = load_config(Path(__file__).resolve().parent.parent / "examples" / "cluster.yaml")
    assert cfg.prices.gpu("H100") == Decimal("4.10") and cfg.prices.gpu("B200") == Decimal("1.50")
    assert cfg.budgets.tenants["acme"].period == "month" and cfg.budgets.tenants["acme"].policy == "hold"
    assert cfg.budgets.queues["research"].period == "all"


def test_bench_billing_folds_the_same_log_and_the_state_does_not_grow_with_it() -> None:
    import json
    import subprocess
    import sys

    from gpufleet.bench.billing import run

    small, big = run(3000, 1), run(12000, 1)
    for doc in (small, big):
        assert set(doc["folds"]) == {"billing", "billing+charges", "cluster view (baseline)"}
        assert all(r["events_per_s_median"] > 0 and r["peak_kib"] > 0 for r in doc["folds"].values())
    s, b = small["folds"]["billing"]["entries"], big["folds"]["billing"]["entries"]
    assert big["jobs"] > 3 * small["jobs"] // 2 and big["folds"]["billing"]["intervals"] > 3 * small["folds"]["billing"]["intervals"] // 2
    # the running jobs (about 300) and an hour of ended ids (about 1,800), however long the log
    assert max(s["jobs"], b["jobs"], s["placements"], b["placements"]) < 400 and b["ended"] < 2000
    assert b["closed"] < 50 and b["charges"] == 0 and big["folds"]["billing+charges"]["entries"]["charges"] > 0
    assert big["folds"]["cluster view (baseline)"]["entries"]["jobs"] > 4 * b["jobs"]
    out = subprocess.run([sys.executable, "-m", "gpufleet.cli", "bench", "billing", "--events", "500", "--repeat", "1",
                          "--json"], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout)["events"] == 500


def test_a_config_without_prices_gets_public_list_prices_and_a_whole_node_costs_its_instance() -> None:
    """`make run` must not show 0.00: no `prices:` block means the documented list prices
    (shared/contract/clusterconfig.py LIST_PRICES), and a GPU-hour is the instance's price less its
    CPUs and memory, so that a p5.48xlarge's worth (8 H100, 192 cores, 2048 GiB) costs its 55.04.
    A `prices:` block replaces the whole table."""
    from gpufleet.shared.contract.clusterconfig import ClusterConfig, parse_config

    p = ClusterConfig().prices
    whole = 8 * p.gpu("H100") + 192 * p.cpu_core_hour + 2048 * p.memory_gib_hour
    assert abs(whole - Decimal("55.04")) < Decimal("0.01") and p.currency == "USD"
    assert all(p.gpu(m) > 0 for m in ("H100", "H200", "A100", "A10", "L4", "B200"))
    assert parse_config({"tenants": {"acme": {}}}).prices == p  # a config about something else keeps them
    own = parse_config({"prices": {"currency": "EUR", "gpuHour": {"H100": "3"}}}).prices
    assert own.gpu("H100") == Decimal(3) and own.gpu("A100") == 0 and own.cpu_core_hour == 0
