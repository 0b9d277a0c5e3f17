"""MIG instances as a resource: the spec asks for them by profile, admission checks the cluster
has them, quota limits them per queue (`mig/<profile>`), the placer hands out instances — never a
GPU in MIG mode as a whole GPU — and a job asking for them runs through the real mesh."""

from __future__ import annotations

from typing import Any

import pytest

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.guardian.core import GuardianCore
from gpufleet.services.placer.core import PlacerCore
from gpufleet.services.quota.core import QuotaCore
from gpufleet.shared.contract.clusterconfig import parse_config
from gpufleet.shared.contract.errors import SpecError
from gpufleet.shared.contract.events import JobPlaced, JobQueued, JobQuotaReserved
from gpufleet.shared.contract.spec import parse_spec
from gpufleet.shared.node.cluster import MIG_LAYOUTS, shape_inventory, sim_fleet
from gpufleet.shared.runtime.bus import Bus

from .builders import Harness, admitted, exited, make_job, mig_node, node, reserved, submit, submitted, types
from .helpers import new_id, nodes_registered, read_log, running, submit_cmd, wait_until

# h100mig: GPUs 0-3 whole; 4 and 5 as 7 x 1g.10gb; 6 as 2 x 3g.40gb; 7 as 3 x 2g.20gb
LAYOUT = MIG_LAYOUTS["h100mig"]


def reserve(h: Harness[Any], job: Any, job_id: str) -> list[Any]:
    """Given the job's spec, when its quota is reserved: what the placer decides."""
    first, then = reserved(job, job_id)
    return h.given(first).when(then)


def unsched(out: list[Any]) -> list[Any]:
    """The job.unschedulable payloads (a backfill reservation may come with them)."""
    assert not any(isinstance(e.payload, JobPlaced) for e in out)
    return [e.payload for e in out if e.type == "job.unschedulable"]


def _placed(out: list[Any]) -> JobPlaced:
    (p,) = [e.payload for e in out if isinstance(e.payload, JobPlaced)]
    return p


# ---------------------------------------------------------------- spec


@pytest.mark.parametrize(("resources", "words"), [
    ({"gpu": 1, "mig": {"1g.10gb": 1}}, "not both"),
    ({"mig": {"half-a-gpu": 1}}, "not a MIG profile"),
    ({"mig": {"1g.10gb": 0}}, "from 1 to 64"),
    ({"mig": {"1g.10gb": 1.5}}, "valid integer"),
    ({"mig": {"1g.10gb": True}}, "valid integer"),
    ({"mig": ["1g.10gb"]}, "dictionary"),
], ids=["with-whole-gpus", "bad-profile", "zero", "fractional", "bool", "list"])
def test_a_bad_mig_request_names_the_field(resources: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "m", "tenant": "acme", "resources": resources})
    assert err.value.field.startswith("resources.mig")
    assert words in str(err.value)


def test_mig_instances_are_per_replica_and_may_name_the_gpu_model() -> None:
    spec = make_job().mig("1g.10gb", 2).mig("3g.40gb").model("H100").replicas(3).spec()
    assert spec.resources.gpu == 0 and spec.gpus_total == 0
    assert spec.mig_total == {"1g.10gb": 6, "3g.40gb": 3}
    assert spec.resources.gpu_models == ("H100",)


# ---------------------------------------------------------------- admission


@pytest.mark.parametrize(("job", "code"), [
    (make_job().mig("1g.10gb", 14), None),  # 2 GPUs x 7 on one node
    (make_job().mig("1g.10gb", 15), "exceeds_node"),
    (make_job().mig("1g.5gb"), "mig_profile_unknown"),
    (make_job().gpus(5), "exceeds_node"),  # the node has 4 whole GPUs: the others are in MIG mode
    (make_job().gpus(4), None),
], ids=["fits", "over-any-node", "unknown-profile", "mig-gpus-are-not-whole", "whole-gpus"])
def test_admission_checks_mig_instances_against_the_nodes(job: Any, code: str | None) -> None:
    h = Harness(AdmissionCore()).given(mig_node("m1"), node("n1", gpus=0))

    out = h.when(submit(job, "j1"))

    if code is None:
        assert types(out) == ["job.submitted", "job.admitted"]
    else:
        assert types(out) == ["job.rejected"]
        reason = out[0].payload.reasons[0]  # type: ignore[union-attr]
        assert reason.code == code
        assert reason.field == ("resources.gpu" if job.spec().resources.gpu else "resources.mig")


# ---------------------------------------------------------------- quota


def test_a_queue_limits_mig_instances_by_profile() -> None:
    h = Harness(QuotaCore(parse_config({"queues": {"a": {"nominal": {"mig/1g.10gb": 4, "gpu": 8}}}})))
    job = make_job().queue("a").mig("1g.10gb", 2)

    for i in (1, 2):
        h.given(submitted(job, f"j{i}"))
        out = h.when(admitted(f"j{i}"))
        (p,) = [e.payload for e in out if isinstance(e.payload, JobQuotaReserved)]
        assert p.mig == {"1g.10gb": 2} and p.gpus == 0
    h.given(submitted(job, "j3"))
    out = h.when(admitted("j3"))
    (q,) = [e.payload for e in out if isinstance(e.payload, JobQueued)]
    assert q.reason is not None and q.reason.code == "queue_limit"
    assert "mig/1g.10gb 4 used + 2 requested > nominal 4" in q.reason.message
    # another profile, and whole GPUs, are limited on their own
    h.given(submitted(make_job().queue("a").mig("3g.40gb", 2), "j4"))
    assert any(isinstance(e.payload, JobQuotaReserved) for e in h.when(admitted("j4")))
    assert h.state.usage["a"]["mig/1g.10gb"] == 4 and h.state.usage["a"]["mig/3g.40gb"] == 2
    h.when(exited("j1", "m1"))  # (an exit of one replica does not release quota: the job's end does)
    assert h.state.usage["a"]["mig/1g.10gb"] == 4


def test_a_bad_mig_quota_names_the_field() -> None:
    with pytest.raises(SpecError) as err:
        parse_config({"queues": {"a": {"nominal": {"mig/whole": 1}}}})
    assert err.value.field == "queues.a.nominal"
    assert "not a MIG profile" in str(err.value)


# ---------------------------------------------------------------- placer


def test_the_placer_hands_out_mig_instances_and_never_a_mig_gpu_whole() -> None:
    inv = shape_inventory("h100mig", "m1")
    h = Harness(PlacerCore()).given(mig_node("m1"))

    big = make_job().gpus(4)
    out = reserve(h, big, "whole")
    assert _placed(out).allocations[0].gpu_indices == (0, 1, 2, 3)  # the whole GPUs only
    out = reserve(h, make_job().gpus(1), "fifth")
    assert unsched(out)  # GPUs 4-7 are in MIG mode

    out = reserve(h, make_job().mig("1g.10gb", 3).mig("2g.20gb"), "small")
    alloc = _placed(out).allocations[0]
    uuids = {m.uuid: m.profile for g in inv.gpus for m in g.mig_devices}
    assert sorted(uuids[u] for u in alloc.mig_devices) == ["1g.10gb", "1g.10gb", "1g.10gb", "2g.20gb"]
    assert alloc.gpu_indices == ()

    # 14 - 3 = 11 instances of 1g.10gb are left: 11 fit, 12 do not
    out = reserve(h, make_job().mig("1g.10gb", 12), "too-many")
    (p,) = unsched(out)
    assert "12 MIG 1g.10gb" in p.reasons[0].message
    assert p.filtered == {"mig": 1}
    out = reserve(h, make_job().mig("1g.10gb", 11), "rest")
    assert len(_placed(out).allocations[0].mig_devices) == 11

    # the jobs end: their instances come back, and the job that waited gets them when 12 are free
    assert not any(isinstance(e.payload, JobPlaced) for e in h.when(exited("rest", "m1")))  # 11 free
    got = _placed(h.when(exited("small", "m1")))
    assert got.job_id == "too-many" and set(alloc.mig_devices) & set(got.allocations[0].mig_devices)


def test_a_mig_gang_spreads_over_nodes_and_never_shares_an_instance() -> None:
    h = Harness(PlacerCore()).given(mig_node("m1"), mig_node("m2"), node("n1"))

    out = reserve(h, make_job().mig("3g.40gb", 2).replicas(2), "gang")

    allocs = _placed(out).allocations
    assert {a.node_id for a in allocs} == {"m1", "m2"}  # 2 x 3g.40gb per node
    assert len({u for a in allocs for u in a.mig_devices}) == 4


def test_a_mig_job_no_node_could_ever_hold_fails_instead_of_holding_quota() -> None:
    h = Harness(PlacerCore()).given(mig_node("m1"))

    out = reserve(h, make_job().mig("3g.40gb", 3), "j1")

    assert types(out) == ["job.failed"]
    assert out[0].payload.reason.code == "never_fits"  # type: ignore[union-attr]


def test_re_registration_keeps_the_instances_that_are_held() -> None:
    h = Harness(PlacerCore()).given(mig_node("m1"))
    first = _placed(reserve(h, make_job().mig("3g.40gb", 2), "j1")).allocations[0].mig_devices

    h.given(mig_node("m1"))  # the executor restarted and registered the node again
    assert h.state.mig["m1"].free["3g.40gb"] == []
    assert unsched(reserve(h, make_job().mig("3g.40gb"), "j2"))
    out = h.when(exited("j1", "m1"))
    assert _placed(out).job_id == "j2" and _placed(out).allocations[0].mig_devices[0] in first


# ---------------------------------------------------------------- through the real mesh


async def test_mig_jobs_run_through_the_mesh_with_quota_per_profile(bus: Bus, nats_url: str) -> None:
    config = parse_config({"queues": {"small": {"nominal": {"mig/1g.10gb": 7}}}})
    fleet = sim_fleet(2, prefix="mig", mix="h100mig")
    cores = [AdmissionCore(), QuotaCore(config), PlacerCore(), ExecutorCore(fleet), GuardianCore()]
    spec = {"name": "m", "tenant": "acme", "queue": "small", "resources": {"mig": {"1g.10gb": 3}, "cpu": 1},
            "sim": {"duration": "0.3s"}}
    ids = [new_id() for _ in range(5)]
    async with running(nats_url, cores):
        await wait_until(lambda: nodes_registered(bus, 2), timeout_s=10)
        for job_id in ids:
            await bus.publish(submit_cmd(spec, job_id=job_id))

        async def done() -> bool:
            log = await read_log(bus)
            return sum(1 for _, e in log if e.type == "job.succeeded") == len(ids)

        await wait_until(done, timeout_s=30)
    log = [e for _, e in await read_log(bus)]
    placed = [e.payload for e in log if isinstance(e.payload, JobPlaced)]
    assert len(placed) == 5 and all(len(p.allocations[0].mig_devices) == 3 for p in placed)
    # 7 instances of quota, 3 a job: never more than 2 jobs at once, so some waited for quota
    assert any(e.type == "job.queued" for e in log)
    running_now = 0
    most = 0
    for e in log:
        if e.type == "job.quota_reserved":
            running_now += 1
            most = max(most, running_now)
        elif e.type == "job.succeeded":
            running_now -= 1
    assert most == 2
