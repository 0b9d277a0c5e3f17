"""What `gpufleet explain` says of a waiting job, each statement pointing at its event's sequence."""

from __future__ import annotations

from gpufleet.shared.events import JobPreemptionRequested, JobQueued, JobUnschedulable, Reason
from gpufleet.shared.view import pending_reasons

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
