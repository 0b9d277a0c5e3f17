"""`gpufleet audit`: a healthy log passes; each broken invariant is caught at its first event."""

from __future__ import annotations

from typing import Any

import pytest

from gpufleet.shared.contract.clusterconfig import parse_config
from gpufleet.shared.contract.events import (
    Envelope,
    JobAdmitted,
    JobExited,
    JobPlaced,
    JobPreempted,
    JobQueued,
    JobQuotaReserved,
    JobStarted,
    NodeLost,
    NodeRegistered,
    Reason,
    ReplicaAllocation,
)
from gpufleet.shared.runtime.bus import Bus
from gpufleet.tools.audit import audit

from .helpers import read_log, running, submit_cmd, wait_until
from .test_node_cores import INV, NODE, T0, ev, placed, submitted
from .test_telemetry import executor, node, telemetry, wait_for_type


def log(*envs: Envelope) -> list[tuple[int, Envelope]]:
    return list(enumerate(envs, start=1))


def reserved(job: str, queue: str = "a", gpus: int = 1, at: float = T0) -> Envelope:
    return ev(JobQuotaReserved(job_id=job, queue=queue, cpu_milli=1000, memory_mib=1024, gpus=gpus), at=at)


def firsts(report: Any) -> dict[str, tuple[int, str] | None]:
    return {k: (v.seq, v.message) if v else None for k, v in report.first().items()}


def test_a_gpu_given_twice_is_caught_at_the_second_placement() -> None:
    report = audit(log(ev(NodeRegistered(node_id=NODE, inventory=INV)), submitted("j1"), placed("j1", gpus=(0,)),
                       submitted("j2"), placed("j2", gpus=(0,)), placed("j3", gpus=(7,))))
    f = firsts(report)
    assert f["gpu_capacity"] == (5, "GPU 0 of n0 holds 2000 milli-GPU (more than 1000)")
    assert [v.seq for v in report.violations if v.invariant == "gpu_capacity"] == [5, 6]  # GPU 7 does not exist
    # once the first is gone, the GPU may be given again
    ok = audit(log(ev(NodeRegistered(node_id=NODE, inventory=INV)), placed("j1", gpus=(0,)),
                   ev(JobExited(job_id="j1", node_id=NODE, exit_code=0)), placed("j2", gpus=(0,))))
    assert ok.first()["gpu_capacity"] is None


def test_a_late_exit_of_an_earlier_run_frees_nothing() -> None:
    report = audit(log(ev(NodeRegistered(node_id=NODE, inventory=INV)), placed("j", gpus=(0,), attempt=2),
                       ev(JobExited(job_id="j", node_id=NODE, exit_code=0, attempt=1)), placed("k", gpus=(0,))))
    assert firsts(report)["gpu_capacity"] == (4, "GPU 0 of n0 holds 2000 milli-GPU (more than 1000)")


def test_work_on_a_lost_node_and_preemption_without_request() -> None:
    report = audit(log(ev(NodeRegistered(node_id=NODE, inventory=INV)), ev(NodeLost(node_id=NODE)),
                       placed("j"), ev(JobStarted(job_id="j", node_id=NODE)),
                       ev(JobPreempted(job_id="k", reason=Reason(code="x", message="y")))))
    f = firsts(report)
    assert f["lost_node"] == (3, "replica 0 placed on n0, which was lost at seq 2, before its placer decided")
    assert f["preemption_request"] == (5, "preempted without a preemption request")
    back = audit(log(ev(NodeRegistered(node_id=NODE, inventory=INV)), ev(NodeLost(node_id=NODE)),
                     ev(NodeRegistered(node_id=NODE, inventory=INV)), placed("j")))
    assert back.first()["lost_node"] is None


def test_a_placement_decided_before_the_loss_it_crossed_is_a_race_not_a_violation() -> None:
    """The placer decided on an event from before the loss and its placement was written just
    after it: nothing could have told it (kube-scheduler binding to a node going NotReady). It is
    allowed as long as it never starts; a placement caused by an event after the loss is not."""
    before = reserved("j")
    after = reserved("k")
    raced = placed("j").model_copy(update={"causation_id": before.event_id})
    knew = placed("k").model_copy(update={"causation_id": after.event_id, "event_id": "01KPLACEDAFTERTHELOSS00000"})
    report = audit(log(ev(NodeRegistered(node_id=NODE, inventory=INV)), before, ev(NodeLost(node_id=NODE)),
                       raced, after, knew))
    lost = [(v.seq, v.job_id) for v in report.violations if v.invariant == "lost_node"]
    assert lost == [(6, "k")]
    assert "before its placer decided" in report.first()["lost_node"].message  # type: ignore[union-attr]
    # a placement caused by the loss itself was decided knowing it
    loss = ev(NodeLost(node_id=NODE))
    on_loss = placed("j").model_copy(update={"causation_id": loss.event_id})
    assert [v.seq for v in audit(log(ev(NodeRegistered(node_id=NODE, inventory=INV)), loss, on_loss)).violations
            if v.invariant == "lost_node"] == [3]
    # two losses: a cause between them is before the second one's
    other = "n1"
    x = reserved("x")
    raced_b = placed("x").model_copy(update={"causation_id": x.event_id, "payload": JobPlaced(
        job_id="x", attempt=1, allocations=(ReplicaAllocation(replica=0, node_id=other, gpu_indices=(0,)),))})
    two = audit(log(ev(NodeRegistered(node_id=NODE, inventory=INV)),
                    ev(NodeRegistered(node_id=other, inventory=INV)).model_copy(update={"event_id": "01KREGISTEREDN1000000000000"[:26]}),
                    ev(NodeLost(node_id=NODE)), x,
                    ev(NodeLost(node_id=other)).model_copy(update={"event_id": "01KLOSTN100000000000000000"}), raced_b))
    assert [v for v in two.violations if v.invariant == "lost_node"] == []
    started = audit(log(ev(NodeRegistered(node_id=NODE, inventory=INV)), before, ev(NodeLost(node_id=NODE)),
                        raced, ev(JobStarted(job_id="j", node_id=NODE))))
    assert firsts(started)["lost_node"] == (5, "started on n0, which was lost")


def test_quota_over_a_queue_or_cohort_limit() -> None:
    config = parse_config({"cohorts": {"c": {}},  # the cohort holds what its queues bring: 2 + 2
                           "queues": {"a": {"cohort": "c", "nominal": {"gpu": 2}, "borrowingLimit": {"gpu": 1}},
                                      "b": {"cohort": "c", "nominal": {"gpu": 2}}}})
    fine = audit(log(reserved("j1", gpus=3)), config)
    assert fine.first()["quota_limit"] is None  # 2 + borrowing 1
    report = audit(log(reserved("j1", gpus=3), reserved("j2", gpus=1)), config)
    assert firsts(report)["quota_limit"] == (2, "queue a uses 4 gpu, over its quota + borrowing limit (3)")
    root = audit(log(reserved("j1", gpus=3), reserved("j2", "b", gpus=2)), config)
    assert firsts(root)["quota_limit"] == (2, "cohort c uses 5 gpu, over the 4 it holds")


def test_a_reservation_written_after_its_job_ended_holds_nothing() -> None:
    """Quota decided on a state from before a job's cancel and wrote its reservation after it (seen
    in `bench chaos`: a steady 'cohort uses 186 gpu, over the 184'): the quota service drops such a
    late fact, so the audit must not count it as held for ever, nor the job as waiting untold."""
    from gpufleet.shared.contract.events import JobCancelled

    config = parse_config({"queues": {"a": {"nominal": {"gpu": 2}}}})
    late = audit(log(submitted("j1"), ev(JobCancelled(job_id="j1", reason="cancelled by user")),
                     reserved("j1", gpus=2), reserved("j2", gpus=2)), config)
    assert late.ok, late.violations
    live = audit(log(submitted("j1"), reserved("j1", gpus=2), reserved("j2", gpus=2)), config)
    assert firsts(live)["quota_limit"] == (3, "queue a uses 4 gpu, over the 2 it holds")


def test_a_waiting_job_must_have_been_told_why() -> None:
    waiting = log(submitted("j"), ev(JobAdmitted(job_id="j")), ev(JobAdmitted(job_id="x"), at=T0 + 60))
    report = audit(waiting)
    assert firsts(report)["pending_reason"] == (2, "waiting since job.admitted (seq 2) and never told why")
    told = audit(log(*[e for _, e in waiting], ev(JobQueued(job_id="j", queue="a", reason=Reason(
        code="queue_limit", message="full")), at=T0 + 1)))
    assert told.first()["pending_reason"] is None
    # admitted 2 s before the head of the log: its answer may still be in flight
    recent = audit(log(submitted("j"), ev(JobAdmitted(job_id="j"), at=T0 + 58), ev(JobAdmitted(job_id="x"), at=T0 + 60)))
    assert recent.first()["pending_reason"] is None


async def test_a_real_mesh_log_passes(bus: Bus, nats_url: str) -> None:
    from gpufleet.services.admission.core import AdmissionCore
    from gpufleet.services.guardian.core import GuardianCore
    from gpufleet.services.placer.core import PlacerCore
    from gpufleet.services.quota.core import QuotaCore

    config = parse_config({"queues": {"research": {"nominal": {"gpu": 2}}}})
    async with running(nats_url, [AdmissionCore(config), QuotaCore(config), PlacerCore(config), GuardianCore(config)]):
        async with telemetry(nats_url):
            node_a = executor(nats_url, {"a": node("a")}, "a")
            await node_a.__aenter__()
            async with executor(nats_url, {"b": node("b")}, "b"):
                jobs = [submit_cmd({"name": f"j{i}", "tenant": "acme", "queue": "research", "priority": i,
                                    "type": "training", "resources": {"gpu": 1}, "sim": {"duration": "1s"}})
                        for i in range(4)]
                for j in jobs:
                    await bus.publish(j)
                await wait_for_type(bus, "job.started", n=2)
                await node_a.__aexit__(None, None, None)  # a node lost mid-run
                await wait_for_type(bus, "node.lost")

                async def settled() -> bool:
                    ends = [e for _, e in await read_log(bus) if e.type in ("job.succeeded", "job.failed")]
                    return len(ends) == 4
                await wait_until(settled, timeout_s=30)
    report = audit(await read_log(bus), config, pending_grace_s=0)
    assert report.ok, report.violations
    assert report.events > 40


def test_mig_instances_are_counted_too() -> None:
    from gpufleet.shared.contract.events import JobPlaced, ReplicaAllocation
    from gpufleet.shared.node.cluster import shape_inventory

    inv = shape_inventory("h100mig", "m0")
    uuid = next(m.uuid for g in inv.gpus for m in g.mig_devices)

    def mig(job: str, u: str) -> Envelope:
        return ev(JobPlaced(job_id=job, allocations=(ReplicaAllocation(replica=0, node_id="m0", mig_devices=(u,)),)))
    report = audit(log(ev(NodeRegistered(node_id="m0", inventory=inv)), mig("j1", uuid), mig("j2", uuid),
                       mig("j3", "MIG-nope")))
    assert [v.message for v in report.violations] == [
        f"MIG instance {uuid} of m0 is held by j1 already", "MIG instance MIG-nope is not on m0"]


async def _publish_double_booking(bus: Bus) -> None:
    j2 = [e.model_copy(update={"event_id": e.event_id[:-1] + ("A" if e.event_id[-1] != "A" else "B")})
          for e in (submitted("j2"), placed("j2", gpus=(0,)))]
    for e in (ev(NodeRegistered(node_id=NODE, inventory=INV)), submitted("j1"), placed("j1", gpus=(0,)), *j2):
        await bus.publish(e)  # (own event ids: the server drops a repeated one)


@pytest.mark.no_audit
async def test_every_test_log_is_audited_by_the_bus_fixture(bus: Bus, request: pytest.FixtureRequest) -> None:
    """The `bus` fixture audits each test's log after it; a double-booked GPU fails the test."""
    from .conftest import audit_test_log

    await _publish_double_booking(bus)
    with pytest.raises(AssertionError, match="gpu_capacity"):
        await audit_test_log(bus, request)


@pytest.mark.no_audit
async def test_the_test_log_audit_checks_quota_with_the_services_config(bus: Bus, request: pytest.FixtureRequest) -> None:
    """The config a test's quota service ran with (recorded by `running`) is the audit's."""
    from .conftest import audit_test_log
    from .helpers import AUDIT

    AUDIT["config"] = parse_config({"queues": {"a": {"nominal": {"gpu": 8}}}})
    for job in ("j1", "j2"):
        e = reserved(job, gpus=8)
        await bus.publish(e.model_copy(update={"event_id": e.event_id[:-2] + job[-1] + "Z"}))
    with pytest.raises(AssertionError, match="quota_limit"):
        await audit_test_log(bus, request)


@pytest.mark.no_audit  # it forges a fact on purpose
async def test_audit_goes_on_from_its_record_and_reports_what_a_full_audit_does(bus: Bus, realm: Any) -> None:
    """`gpufleet audit` stores its books at the sequence it checked and reads only the log after
    them next time; the report is the full audit's, a violation before the record included, and a
    tampered record makes a full audit."""
    from gpufleet.bench.replay import synthetic_log
    from gpufleet.shared.runtime.snapshots import bucket_for
    from gpufleet.tools.audit import AUDIT, audit_log

    first = synthetic_log(700)
    await bus.publish_batch(first[:400])
    # a foreign author: the admin (who may publish anything) says a placer's fact
    forged = first[400].model_copy(update={"actor": "admin/cli"})
    await bus.publish(forged)
    r1, from1 = await audit_log(bus, None, 0)
    assert from1 == 0 and [v.invariant for v in r1.violations] == ["author"]
    await bus.publish_batch(first[401:])
    r2, from2 = await audit_log(bus, None, 0)
    full, from_full = await audit_log(bus, None, 0, full=True)
    assert from2 == r1.head_seq and from_full == 0
    assert r2.as_json() == full.as_json() and r2.events == full.events == len(first)
    assert [v.invariant for v in r2.violations] == ["author"]  # the one found before the record, still said
    obs = await bus.js.object_store(bucket_for(AUDIT))
    data = bytearray((await obs.get(AUDIT)).data or b"")
    data[-1] ^= 0xFF
    await obs.put(AUDIT, bytes(data))
    r3, from3 = await audit_log(bus, None, 0)
    assert from3 == 0 and r3.as_json() == full.as_json()
