"""The service cores as pure functions: given events -> when event -> then events. No NATS.

`Harness` plays a core the way ServiceRuntime does: the input is evolved before the decision,
and the core's outputs on its own subjects are evolved right after it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.executor.core import EXIT_KILLED, EXIT_TIMEOUT, ExecutorCore
from gpufleet.services.guardian.core import GuardianCore
from gpufleet.services.placer.core import PlacerCore, PlacerState
from gpufleet.services.quota.core import QuotaCore
from gpufleet.shared.contract.clusterconfig import parse_config
from gpufleet.shared.contract.events import Envelope, JobPlaced
from gpufleet.shared.runtime.loop import Core

from .builders import (
    T0,
    Harness,
    JobBuilder,
    admitted,
    cancel,
    cancel_requested,
    cancelled,
    cordoned,
    ctx,
    derived,
    exited,
    inventory,
    make_job,
    node,
    placed,
    quota_reserved,
    reserved,
    started,
    submit,
    submitted,
    types,
)

# ================================================================ admission


def test_valid_submit_is_recorded_and_admitted() -> None:
    job = make_job("train").gpus(8).queue("a")
    cmd = submit(job, "j1")

    out = Harness(AdmissionCore()).when(cmd)

    assert types(out) == ["job.submitted", "job.admitted"]
    assert out[0].payload.spec == job.spec()  # type: ignore[union-attr]
    for e in out:
        assert (e.job_id, e.tenant, e.causation_id, e.correlation_id) == ("j1", "acme", cmd.event_id, "j1")
    assert [e.event_id for e in out] == [derived(cmd, 0), derived(cmd, 1)]


@pytest.mark.parametrize(("job", "field"), [
    (make_job().gpus(-1), "resources.gpu"),
    (make_job().replicas(0), "replicas"),
    (make_job().set("gpus", 8), "gpus"),
    (make_job().max_runtime("soon"), "maxRuntime"),
    (make_job("bad.name"), "name"),
])
def test_invalid_submit_is_rejected_naming_the_field(job: JobBuilder, field: str) -> None:
    out = Harness(AdmissionCore()).when(submit(job, "j1"))

    assert types(out) == ["job.rejected"]
    (reason,) = out[0].payload.reasons  # type: ignore[union-attr]
    assert (reason.code, reason.field) == ("invalid_spec", field)
    assert field in reason.message


def test_submit_for_another_tenant_is_rejected() -> None:
    out = Harness(AdmissionCore()).when(submit(make_job(tenant="acme"), "j1", tenant="globex"))

    assert types(out) == ["job.rejected"]
    assert out[0].tenant == "globex"
    (reason,) = out[0].payload.reasons  # type: ignore[union-attr]
    assert (reason.code, reason.field) == ("tenant_mismatch", "tenant")
    assert "'acme'" in reason.message and "'globex'" in reason.message


@pytest.mark.parametrize("first", [make_job(), make_job().gpus(-1)], ids=["admitted", "rejected"])
def test_duplicate_submit_is_refused_and_changes_nothing(first: JobBuilder) -> None:
    h = Harness(AdmissionCore())
    cmd = submit(first, "j1")
    h.when(cmd)

    assert h.when(cmd) == []  # the same command redelivered: decided already
    out = h.when(submit(make_job().gpus(2), "j1", seq=99))  # another command, same job id
    assert types(out) == ["job.request_refused"]
    (reason,) = out[0].payload.reasons  # type: ignore[union-attr]
    assert (reason.code, reason.field) == ("duplicate_job_id", "job_id")


def test_an_admin_cancel_on_the_admins_subject_cancels_any_tenants_job_as_the_admins() -> None:
    """`fleet.cmd.sys.cancel` (only the admin may publish there): the job's own tenant carries
    the request, and the log says the admin asked."""
    h = Harness(AdmissionCore()).given(submitted(make_job(), "j1"))
    cmd = cancel("j1", tenant="sys", actor="admin/cli")
    assert cmd.subject() == "fleet.cmd.sys.cancel"

    out = h.when(cmd)

    assert types(out) == ["job.cancel_requested"]
    assert out[0].tenant == "acme" and out[0].subject().startswith("fleet.evt.acme.job.j1.")
    assert out[0].payload.requested_by == "admin/cli"  # type: ignore[union-attr]
    # an unknown job is refused to the admin, on the admin's own subjects
    refused = h.when(cancel("nope", tenant="sys", actor="admin/cli"))
    assert types(refused) == ["job.request_refused"] and refused[0].tenant == "sys"


def test_a_cluster_that_configures_queues_refuses_another_queue_naming_the_known_ones() -> None:
    cfg = parse_config({"queues": {"train": {"cohort": "c"}, "infer": {"cohort": "c"}}})
    out = Harness(AdmissionCore(cfg)).when(submit(make_job().queue("scratch"), "j1"))
    assert types(out) == ["job.rejected"]
    (reason,) = out[0].payload.reasons  # type: ignore[union-attr]
    assert (reason.code, reason.field) == ("unknown_queue", "queue")
    assert "known: infer, train" in reason.message
    # a tenant outside a closed config hears which tenants there are
    closed = parse_config({"tenants": {"acme": {}}})
    out = Harness(AdmissionCore(closed)).when(submit(make_job(tenant="globex"), "j2"))
    assert "known: acme" in out[-1].payload.reasons[0].message  # type: ignore[union-attr]


def test_every_broken_field_of_a_spec_is_its_own_reason() -> None:
    out = Harness(AdmissionCore()).when(submit(make_job().gpus("eight").set("priority", "high").set("colour", "red"),
                                               "j1"))
    assert types(out) == ["job.rejected"]
    reasons = out[0].payload.reasons  # type: ignore[union-attr]
    assert sorted(r.field for r in reasons) == ["colour", "priority", "resources.gpu"]
    assert all(r.code == "invalid_spec" and r.message.startswith(f"{r.field}: ") and ";" not in r.message
               for r in reasons)


def test_submit_written_in_part_is_finished_with_the_same_id() -> None:
    # job.submitted made it to the log, job.admitted did not (a publish cut short)
    cmd = submit(make_job(), "j1")
    first = Harness(AdmissionCore()).when(cmd)
    h = Harness(AdmissionCore()).given(first[0])

    out = h.when(cmd)

    assert types(out) == ["job.admitted"]
    assert out[0].event_id == first[1].event_id  # a copy, should the first one have landed after all
    assert h.when(cmd) == []


@pytest.mark.parametrize(("history", "cmd", "then"), [
    ("pending", cancel("j1"), ["job.cancel_requested"]),  # admission only asks: it may lag
    ("placed", cancel("j1"), ["job.cancel_requested"]),
    ("pending", cancel("j1", tenant="globex"), ["job.request_refused"]),
    ("placed", cancel("j1", tenant="globex"), ["job.request_refused"]),
    ("unknown", cancel("j1"), ["job.request_refused"]),
    ("ended", cancel("j1"), ["job.request_refused"]),
], ids=["pending", "placed", "pending-other-tenant", "placed-other-tenant", "unknown", "ended"])
def test_cancel(history: str, cmd: Envelope, then: list[str]) -> None:
    given: list[Envelope] = []
    if history != "unknown":
        given.append(submitted(make_job(), "j1"))
    if history == "placed":
        given.append(placed("j1", ("n1", [0])))
    if history == "ended":
        given.append(cancelled("j1"))
    h = Harness(AdmissionCore()).given(*given)

    out = h.when(cmd)

    assert types(out) == then
    if then == ["job.cancel_requested"]:
        assert out[0].payload.requested_by == cmd.actor  # type: ignore[union-attr]
    if then == ["job.cancel_requested"]:
        assert h.when(cancel("j1")) == []  # a second cancel after the first: nothing more
    if then == ["job.request_refused"]:
        assert out[0].tenant == cmd.tenant  # told to the one who asked, under its own subject
        assert out[0].payload.reasons[0].code in ("unknown_job", "already_ended")  # type: ignore[union-attr]


# ================================================================ quota


def test_admitted_job_gets_quota_for_all_replicas() -> None:
    job = make_job().gpus(8).cpu("1500m").memory("64Gi").replicas(3).queue("a")
    h = Harness(QuotaCore()).given(submitted(job, "j1"))

    out = h.when(admitted("j1"))

    assert types(out) == ["job.quota_reserved"]
    p = out[0].payload
    assert (p.queue, p.gpus, p.cpu_milli, p.memory_mib) == ("a", 24, 4500, 3 * 64 * 1024)  # type: ignore[union-attr]
    assert h.state.usage == {"a": {"cpu": 4500, "memory": 3 * 64 * 1024, "gpu": 24}}


def test_quota_is_reserved_once_and_given_back_at_the_end() -> None:
    h = Harness(QuotaCore()).given(submitted(make_job().gpus(4), "j1"))
    h.when(admitted("j1"))

    assert h.when(admitted("j1")) == []  # redelivered
    h.when(cancelled("j1"))
    assert h.state.usage == {"default": {"cpu": 0, "memory": 0, "gpu": 0}}
    assert h.when(admitted("j1")) == []  # late, after the end


# ================================================================ placer


def _gpus_by_node(out: list[Envelope]) -> dict[str, list[int]]:
    held: dict[str, list[int]] = {}
    for e in out:
        assert isinstance(e.payload, JobPlaced)
        for a in e.payload.allocations:
            held.setdefault(a.node_id, []).extend(a.gpu_indices)
    return held


def placer_types(out: list[Envelope]) -> list[str]:
    """The placer's outputs but its backfill reservations (tested on their own)."""
    return [t for t in types(out) if t != "job.backfill_reserved"]


def _fragmented_cluster() -> Harness[PlacerState]:
    """n-empty: 8 free; n-two: 2 free; n-four: 4 free (all H100)."""
    return Harness(PlacerCore()).given(
        node("n-empty"), node("n-two"), node("n-four"),
        submitted(make_job().gpus(6), "busy6"), placed("busy6", ("n-two", range(6))),
        submitted(make_job().gpus(4), "busy4"), placed("busy4", ("n-four", range(4))),
    )


@pytest.mark.parametrize(("gpus", "node_id"), [(1, "n-two"), (2, "n-two"), (3, "n-four"), (4, "n-four"),
                                               (5, "n-empty"), (8, "n-empty")])
def test_best_fit_takes_the_fullest_node_that_fits(gpus: int, node_id: str) -> None:
    h = _fragmented_cluster().given(submitted(make_job().gpus(gpus), "j1"))
    cause = quota_reserved(make_job().gpus(gpus), "j1")

    out = h.when(cause)

    assert types(out) == ["job.placed"]
    (alloc,) = out[0].payload.allocations  # type: ignore[union-attr]
    assert alloc.node_id == node_id and len(alloc.gpu_indices) == gpus
    assert out[0].event_id == derived(cause, "placed:j1")


def test_gang_spans_two_nodes() -> None:
    job = make_job().gpus(8).replicas(2)
    h = Harness(PlacerCore()).given(node("n1"), node("n2"), node("n3"), submitted(job, "g"))

    out = h.when(quota_reserved(job, "g"))

    assert types(out) == ["job.placed"]
    allocs = out[0].payload.allocations  # type: ignore[union-attr]
    assert [a.replica for a in allocs] == [0, 1]
    assert len({a.node_id for a in allocs}) == 2
    assert all(sorted(a.gpu_indices) == list(range(8)) for a in allocs)


def test_gang_is_all_or_nothing() -> None:
    job = make_job().gpus(8).replicas(2)
    h = Harness(PlacerCore()).given(
        node("n1"), node("n2"), submitted(make_job().gpus(4), "half"), placed("half", ("n2", range(4))),
        submitted(job, "g"),
    )
    free_before = {n: list(s.free_gpus) for n, s in h.state.nodes.items()}

    out = h.when(quota_reserved(job, "g"))

    assert placer_types(out) == ["job.unschedulable"]
    assert {n: s.free_gpus for n, s in h.state.nodes.items()} == free_before  # nothing half-taken
    assert "g" in h.state.pending and h.state.jobs["g"].allocations is None


def test_no_fit_says_why_per_filter() -> None:
    job = make_job().gpus(8).model("H100")
    h = Harness(PlacerCore()).given(
        node("h100-half"), submitted(make_job().gpus(4), "x"), placed("x", ("h100-half", range(4))),
        node("a100", model="A100"), node("a10", gpus=4, model="A10"),
        node("h100-cordoned"), cordoned("h100-cordoned"),
        node("h100-small-cpu", cpu_milli=500),
        submitted(job, "j1"),
    )

    out = h.when(quota_reserved(job, "j1"))

    assert placer_types(out) == ["job.unschedulable"]
    (p,) = [e.payload for e in out if e.type == "job.unschedulable"]
    assert p.filtered == {"gpu_count": 1, "gpu_model": 2, "unhealthy": 1, "cpu": 1}  # type: ignore[union-attr]
    assert p.nodes_total == 5  # type: ignore[union-attr]
    (reason,) = p.reasons  # type: ignore[union-attr]
    assert reason.code == "no_fit" and "1 x 8 GPU" in reason.message and "2 gpu_model" in reason.message
    assert h.when(quota_reserved(job, "j1")) == []  # redelivered: said once (reservation too)


def test_no_nodes_is_its_own_reason() -> None:
    h = Harness(PlacerCore()).given(submitted(make_job().gpus(1), "j1"))

    out = h.when(quota_reserved(make_job().gpus(1), "j1"))

    assert [r.code for r in out[0].payload.reasons] == ["no_nodes"]  # type: ignore[union-attr]


def test_gpu_model_is_respected() -> None:
    job = make_job().gpus(2).model("A100")
    h = Harness(PlacerCore()).given(node("h"), node("a", model="A100"), submitted(job, "j1"))

    out = h.when(quota_reserved(job, "j1"))

    assert _gpus_by_node(out) == {"a": [0, 1]}


def test_capacity_freed_by_exit_places_the_pending_job() -> None:
    big = make_job().gpus(8)
    h = Harness(PlacerCore()).given(node("n1"), reserved(big, "a"), placed("a", ("n1", range(8))), submitted(big, "b"))
    assert placer_types(h.when(quota_reserved(big, "b"))) == ["job.unschedulable"]

    out = h.when(exited("a", "n1"))

    assert types(out) == ["job.placed"] and out[0].job_id == "b"
    assert _gpus_by_node(out) == {"n1": list(range(8))}
    assert "b" not in h.state.pending


def test_pending_jobs_placed_in_one_decision_never_share_a_gpu() -> None:
    quarter = make_job().gpus(4)
    h = Harness(PlacerCore()).given(
        node("n1"), reserved(make_job().gpus(8), "a"), placed("a", ("n1", range(8))),
        reserved(quarter, "b"), reserved(quarter, "c"), reserved(quarter, "d"),
    )

    out = h.when(exited("a", "n1"))

    assert [e.job_id for e in out] == ["b", "c"]  # d waits: nothing left
    gpus = _gpus_by_node(out)["n1"]
    assert sorted(gpus) == list(range(8))  # eight GPUs, each once
    assert h.state.nodes["n1"].free_gpus == [] and list(h.state.pending) == ["d"]


def test_late_placement_of_a_cancelled_job_is_ignored_on_refold() -> None:
    # the placer decided before it saw the cancel; on a re-fold the placement holds nothing
    h = Harness(PlacerCore()).given(
        node("n1"), reserved(make_job().gpus(8), "gone"), cancelled("gone"), placed("gone", ("n1", range(8))),
    )
    assert "gone" not in h.state.jobs and not h.state.placed and len(h.state.nodes["n1"].free_gpus) == 8

    out = h.given(submitted(make_job().gpus(8), "next")).when(quota_reserved(make_job().gpus(8), "next"))

    assert _gpus_by_node(out) == {"n1": list(range(8))}


def test_one_replica_exiting_frees_only_its_own_gpus() -> None:
    gang = make_job().gpus(8).replicas(2)
    h = Harness(PlacerCore()).given(
        node("n1"), node("n2"), reserved(gang, "g1"), placed("g1", ("n1", range(8)), ("n2", range(8))),
        reserved(gang, "g2"),
    )

    assert placer_types(h.when(exited("g1", "n1", replica=0))) == []  # replica 1 still holds n2
    assert h.state.nodes["n2"].free_gpus == []

    out = h.when(exited("g1", "n2", replica=1))

    assert types(out) == ["job.placed"] and out[0].job_id == "g2"


def test_cordoned_node_takes_no_new_work() -> None:
    h = Harness(PlacerCore()).given(node("n1"), cordoned("n1"), node("n2"), submitted(make_job().gpus(1), "j1"))

    out = h.when(quota_reserved(make_job().gpus(1), "j1"))

    assert _gpus_by_node(out) == {"n2": [0]}


def test_new_node_places_waiting_job() -> None:
    job = make_job().gpus(8)
    h = Harness(PlacerCore()).given(reserved(job, "j1"))

    out = h.when(node("n1"))

    assert _gpus_by_node(out) == {"n1": list(range(8))}


# ================================================================ executor


def _executor(*own: str) -> Harness[Any]:
    return Harness(ExecutorCore({n: inventory() for n in own}))


def test_placement_on_own_node_starts_the_replica() -> None:
    job = make_job().gpus(8).replicas(2)
    h = _executor("n1").given(submitted(job, "j1"))
    cause = placed("j1", ("n1", range(8)), ("other", range(8)))

    out = h.when(cause)

    assert types(out) == ["job.started"]  # replica 1 is another executor's
    p = out[0].payload
    assert (p.node_id, p.replica, p.driver, out[0].causation_id) == ("n1", 0, "sim", cause.event_id)  # type: ignore[union-attr]
    assert h.when(cause) == []  # redelivered: already running


def test_redelivered_placement_after_exit_does_not_start_again() -> None:
    h = _executor("n1").given(submitted(make_job().runs("1s"), "j1"))
    cause = placed("j1", ("n1", []))
    h.when(cause)
    assert types(h.tick(T0 + timedelta(seconds=2))) == ["job.exited"]

    assert h.when(cause) == []  # the replica ran and ended: a redelivered placement is old news


@pytest.mark.parametrize(("job", "at_s", "then"), [
    (make_job().runs("10s", 0), 9.9, None),
    (make_job().runs("10s", 0), 10.0, (0, "completed")),
    (make_job().runs("10s", 3), 12.0, (3, "error")),
    (make_job().runs("60s", 0).max_runtime("5s"), 4.0, None),
    (make_job().runs("60s", 0).max_runtime("5s"), 5.0, (EXIT_TIMEOUT, "timeout")),
    (make_job().runs("5s", 0).max_runtime("5s"), 5.0, (0, "completed")),
], ids=["running", "done", "exit-code", "before-max", "timeout", "max-equals-duration"])
def test_tick_ends_replicas(job: JobBuilder, at_s: float, then: tuple[int, str] | None) -> None:
    h = _executor("n1").given(submitted(job, "j1"), started("j1", "n1", at=T0))

    out = h.tick(T0 + timedelta(seconds=at_s))

    if then is None:
        assert out == []
        return
    assert types(out) == ["job.exited"]
    p = out[0].payload
    assert (p.exit_code, p.reason, p.node_id, p.runtime_s) == (*then, "n1", at_s)  # type: ignore[union-attr]
    assert h.tick(T0 + timedelta(seconds=at_s + 1)) == []  # exited once


def test_cancel_requested_stops_running_replicas() -> None:
    h = _executor("n1", "n2").given(submitted(make_job().replicas(2), "j1"),
                                    started("j1", "n1", 0), started("j1", "n2", 1))

    out = h.when(cancel_requested("j1"))

    assert sorted((e.payload.replica, e.payload.exit_code, e.payload.reason) for e in out) == [  # type: ignore[union-attr]
        (0, EXIT_KILLED, "cancelled"), (1, EXIT_KILLED, "cancelled")]
    assert h.tick(T0 + timedelta(hours=1)) == []


def test_executor_registers_its_nodes_once() -> None:
    h = _executor("n1", "n2")

    out = h.start()

    assert types(out) == ["node.registered", "node.registered"]
    assert {e.node_id for e in out} == {"n1", "n2"} and {e.tenant for e in out} == {"sys"}
    assert h.start(T0 + timedelta(minutes=5)) == []  # a restart that folded its registrations
    bigger = ExecutorCore({"n1": inventory(gpus=4)})
    h2 = Harness(bigger).given(*out)
    assert [e.node_id for e in h2.start()] == ["n1"]  # the inventory changed: register again


# ================================================================ guardian


@pytest.mark.parametrize(("replicas", "exits", "then"), [
    (1, [(0, 0, "completed")], ["job.succeeded"]),
    (2, [(0, 0, "completed")], []),
    (2, [(0, 0, "completed"), (1, 0, "completed")], ["job.succeeded"]),
    (1, [(0, 3, "error")], ["job.failed"]),
    (2, [(0, 0, "completed"), (1, 1, "error")], ["job.failed"]),
    (2, [(0, 1, "error"), (1, 137, "killed")], ["job.failed"]),
    (1, [(0, EXIT_TIMEOUT, "timeout")], ["job.failed"]),
    (1, [(0, EXIT_KILLED, "cancelled")], ["job.cancelled"]),
    (2, [(0, EXIT_KILLED, "cancelled"), (1, EXIT_KILLED, "cancelled")], ["job.cancelled"]),
], ids=["one-ok", "gang-half", "gang-ok", "exit-code", "gang-one-bad", "gang-bad-then-killed", "timeout",
        "cancelled", "gang-cancelled"])
def test_guardian_ends_the_job(replicas: int, exits: list[tuple[int, int, str]], then: list[str]) -> None:
    h = Harness(GuardianCore()).given(submitted(make_job().replicas(replicas), "j1"))

    out: list[Envelope] = []
    for replica, code, reason in exits:
        out += h.when(exited("j1", f"n{replica}", replica, code, reason))

    assert types(out) == then  # exactly one terminal event, however many replicas
    assert all(e.job_id == "j1" for e in out)


@pytest.mark.parametrize(("code", "reason", "reason_code", "says"), [
    (3, "error", "exit_code", "exited with code 3"),
    (EXIT_TIMEOUT, "timeout", "timeout", "max runtime"),
])
def test_failure_says_why(code: int, reason: str, reason_code: str, says: str) -> None:
    h = Harness(GuardianCore()).given(submitted(make_job(), "j1"))

    (out,) = h.when(exited("j1", "n1", 0, code, reason))

    p = out.payload
    assert (p.exit_code, p.reason.code) == (code, reason_code)  # type: ignore[union-attr]
    assert says in p.reason.message  # type: ignore[union-attr]


def test_a_drain_moves_every_job_placed_on_the_node_without_spending_a_retry() -> None:
    from gpufleet.shared.contract.events import NodeCordoned

    from .builders import event

    h = Harness(GuardianCore()).given(
        submitted(make_job().gpus(1).set("maxRetries", 0), "j1"), placed("j1", ("n1", [0])), started("j1", "n1"),
        submitted(make_job().cpu(1).gpus(0), "cpu"), placed("cpu", ("n1", [])),  # CPUs only: found by its node
        submitted(make_job().gpus(1), "there"), placed("there", ("n2", [0])))
    out = h.when(event(NodeCordoned(node_id="n1", reason="kernel upgrade", drain=True), actor="admin/ops"))
    assert sorted((e.job_id, e.type) for e in out) == [("cpu", "job.resume_requested"), ("j1", "job.resume_requested")]
    resume = next(e.payload for e in out if e.job_id == "j1")
    # no retries left (maxRetries 0), and still resumed: a drain is nobody's failure
    assert resume.reason.code == "node_drained" and "drained by admin/ops (kernel upgrade)" in resume.reason.message  # type: ignore[union-attr]
    assert "retry" not in resume.reason.message and h.state.jobs["j1"].failures == 0  # type: ignore[union-attr]
    assert h.when(event(NodeCordoned(node_id="n2", reason="no new work"))) == []  # a cordon alone moves nothing


def test_exit_after_the_end_is_ignored() -> None:
    h = Harness(GuardianCore()).given(submitted(make_job(), "j1"), cancelled("j1"))

    assert h.when(exited("j1", "n1", 0, 0)) == []


# ================================================================ determinism


def _admission() -> tuple[Core[Any], list[Envelope], Envelope]:
    return AdmissionCore(), [], submit(make_job().gpus(1), "j1", seq=1)


def _quota() -> tuple[Core[Any], list[Envelope], Envelope]:
    return QuotaCore(), [submitted(make_job().gpus(2).replicas(2), "j1")], admitted("j1")


def _placer_retry() -> tuple[Core[Any], list[Envelope], Envelope]:
    q = make_job().gpus(4)
    given = [node("n1"), node("n2", gpus=4), *reserved(make_job().gpus(8), "a"), placed("a", ("n1", range(8))),
             *reserved(q, "b"), *reserved(q, "c"), *reserved(q, "d")]
    return PlacerCore(), given, exited("a", "n1")


def _placer_unschedulable() -> tuple[Core[Any], list[Envelope], Envelope]:
    job = make_job().gpus(16)
    return PlacerCore(), [node("n1"), submitted(job, "j1")], quota_reserved(job, "j1")


def _executor_place() -> tuple[Core[Any], list[Envelope], Envelope]:
    core = ExecutorCore({"n1": inventory(), "n2": inventory()})
    return core, [submitted(make_job().replicas(2), "j1")], placed("j1", ("n1", [0]), ("n2", [0]))


def _guardian() -> tuple[Core[Any], list[Envelope], Envelope]:
    return GuardianCore(), [submitted(make_job(), "j1")], exited("j1", "n1", 0, 3, "error")


@pytest.mark.parametrize("case", [_admission, _quota, _placer_retry, _placer_unschedulable, _executor_place, _guardian],
                         ids=["admission", "quota", "placer-retry", "placer-unschedulable", "executor", "guardian"])
def test_decide_is_deterministic(case: Callable[[], tuple[Core[Any], list[Envelope], Envelope]]) -> None:
    core, given, when = case()
    h = Harness(core).given(*given)
    h.state = core.evolve(h.state, when)  # as the runtime does before deciding
    before = copy.deepcopy(h.state)

    first = h.decide(when)
    second = h.decide(when, now=T0 + timedelta(seconds=30))  # re-decided later, after a crash

    assert first, "the case must decide something"
    assert [e.event_id for e in first] == [e.event_id for e in second]
    assert [e.payload for e in first] == [e.payload for e in second]
    assert len({e.event_id for e in first}) == len(first)  # distinct outputs, distinct ids
    assert h.state == before  # deciding does not change the state
    # and a fresh core folding the same history decides the same
    fresh = Harness(case()[0]).given(*given, when)
    assert [e.event_id for e in fresh.decide(when)] == [e.event_id for e in first]


def test_executor_tick_ids_derive_from_the_start() -> None:
    h = _executor("n1").given(submitted(make_job().runs("1s"), "j1"), started("j1", "n1", seq=7))
    late = T0 + timedelta(seconds=5)

    # (copies: the executor's tick pops its deadline heap as it goes)
    a = ExecutorCore({"n1": inventory()}).tick(copy.deepcopy(h.state), ctx(None, late))
    b = ExecutorCore({"n1": inventory()}).tick(copy.deepcopy(h.state), ctx(None, late + timedelta(seconds=9)))

    assert [e.event_id for e in a] == [e.event_id for e in b] and len(a) == 1


# ---------------------------------------------------------------- cancellation races


def test_placer_cancels_a_job_it_has_not_placed_and_then_never_places_it() -> None:
    job = make_job().gpus(1)
    h = Harness(PlacerCore()).given(node("n1"), submitted(job, "j1"))
    out = h.when(cancel_requested("j1"))
    assert types(out) == ["job.cancelled"]
    assert h.when(quota_reserved(job, "j1")) == []  # its reservation arrives late: nothing placed


def test_placer_leaves_a_placed_job_to_the_executor() -> None:
    job = make_job().gpus(1)
    h = Harness(PlacerCore()).given(node("n1"), submitted(job, "j1"), placed("j1", ("n1", [0])))
    assert h.when(cancel_requested("j1")) == []


def test_executor_never_starts_a_placement_its_cancel_overtook() -> None:
    nodes = {"n1": inventory()}
    h = Harness(ExecutorCore(nodes)).given(submitted(make_job().gpus(1), "j1"), cancel_requested("j1"))
    out = h.when(placed("j1", ("n1", [0])))
    assert types(out) == ["job.exited"]
    assert out[0].payload.reason == "cancelled"  # type: ignore[union-attr]


def test_a_gang_no_cluster_could_hold_fails_and_gives_its_quota_back() -> None:
    # 3 nodes of 8 GPUs: a 4 x 8 gang can never fit, even on the empty cluster
    gang = make_job().gpus(8).replicas(4)
    h = Harness(PlacerCore()).given(node("n1"), node("n2"), node("n3"), submitted(gang, "g"))
    out = h.when(quota_reserved(gang, "g"))
    assert types(out) == ["job.failed"]
    assert out[0].payload.reason.code == "never_fits"  # type: ignore[union-attr]
    # while a gang that fits an empty cluster but not the busy one just waits
    small = make_job().gpus(8).replicas(3)
    h2 = Harness(PlacerCore()).given(node("n1"), node("n2"), node("n3"), submitted(make_job().gpus(1), "x"),
                                     placed("x", ("n1", [0])), submitted(small, "s"))
    assert placer_types(h2.when(quota_reserved(small, "s"))) == ["job.unschedulable"]
