"""What `gpufleet explain` says of a waiting job, each statement pointing at its event's sequence."""

from __future__ import annotations

from typing import Any

from gpufleet.sdk import Fleet
from gpufleet.shared.contract.events import JobPreemptionRequested, JobQueued, JobUnschedulable, Reason
from gpufleet.shared.read.view import pending_reasons
from gpufleet.shared.runtime.bus import Bus

from .helpers import default_cores, nodes_registered, running, wait_until
from .test_node_cores import T0, ev, placed, submitted


def test_pending_statements_point_at_their_events() -> None:
    hist = list(enumerate([
        submitted("j"), placed("j"),
        ev(JobPreemptionRequested(job_id="j", reason=Reason(code="priority", message="for p"), by_job_id="p")),
        ev(JobQueued(job_id="j", queue="q", reason=Reason(code="queue_limit", message="queue q is full")), at=T0 + 1),
    ], start=1))
    out = pending_reasons(hist)
    assert [(p["seq"], p["kind"], p["code"]) for p in out] == [(4, "quota", "queue_limit"), (3, "preempted", "priority")]
    assert out[1]["by_job_id"] == "p" and "(seq 3)" in out[1]["text"]
    unplaced = list(enumerate([submitted("k"), ev(JobUnschedulable(
        job_id="k", reasons=(Reason(code="no_fit", message="no node has 16 GPUs"),), filtered={"gpus": 4},
        nodes_total=4))], start=10))
    (p,) = pending_reasons(unplaced)
    assert (p["seq"], p["kind"], p["filtered"]) == (11, "placement", {"gpus": 4})


async def test_the_sdk_explains_a_job_from_the_log(bus: Bus, nats_url: str) -> None:
    """`Fleet.explain`: what `gpufleet explain --json` prints, for a program."""
    async with running(nats_url, default_cores(sim_nodes=1)):
        await wait_until(lambda: nodes_registered(bus, 1))
        async with await Fleet.connect(nats_url=nats_url) as fleet:
            ok = await fleet.submit({"name": "fits", "tenant": "acme", "resources": {"gpu": 8}, "sim": {"duration": "30s"}})
            waits = await fleet.submit({"name": "waits", "tenant": "acme", "resources": {"gpu": 8},
                                        "sim": {"duration": "1s"}})

            async def told() -> Any:
                doc = await fleet.explain(waits)
                return doc if doc is not None and doc.pending and doc.pending[0]["kind"] == "placement" else None

            doc = await wait_until(told)
            assert doc.job_id == waits and [e.type for _, e in doc.history][:2] == ["cmd.submit", "job.submitted"]
            # the one node's 8 GPUs are taken by the first job; the node is held for this one from
            # when the first reaches its max runtime
            assert [p["kind"] for p in doc.pending] == ["placement", "backfill"]
            why = doc.pending[0]
            assert why["seq"] in [s for s, _ in doc.history] and "job.unschedulable" in [e.type for _, e in doc.history]
            js = doc.to_json()
            assert js["job_id"] == waits and js["events"][0]["seq"] == doc.history[0][0] and js["pending"] == doc.pending
            await fleet.cancel(ok, "acme")
            assert await fleet.explain("no-such-job") is None


async def test_explain_reads_the_commands_of_the_jobs_window_not_the_whole_log(bus: Bus, nats_url: str) -> None:
    """300 commands of other jobs came before (200 of another tenant): explain reads its job's
    events and its tenant's commands of the job's life, and still finds the submit and a cancel."""
    from .helpers import submit_cmd

    await bus.publish_batch([submit_cmd({"name": "x", "tenant": "globex" if i % 3 else "acme"}, f"old{i}")
                             for i in range(300)])
    async with running(nats_url, default_cores(sim_nodes=1)):
        await wait_until(lambda: nodes_registered(bus, 1))
        async with await Fleet.connect(nats_url=nats_url) as fleet:
            job = await fleet.submit({"name": "mine", "tenant": "acme", "resources": {"gpu": 1},
                                      "sim": {"duration": "10m"}})
            await fleet.cancel(job)  # the admin's (fleet.cmd.sys.cancel)

            async def told() -> Any:
                doc = await fleet.explain(job)
                return doc if doc and "job.cancelled" in [e.type for _, e in doc.history] else None

            doc = await wait_until(told)
            types = [e.type for _, e in doc.history]
            assert types[0] == "cmd.submit" and "cmd.cancel" in types
            assert fleet.commands_read < 120, fleet.commands_read  # acme's 100 old ones at most, not 300
