"""The cluster fold (shared/read/view.py): given events, then the jobs and nodes it shows. And the folds
beside the services see what the autoscaler does: a node its pool removed (`node.deregistered`)
leaves the cluster view, the dashboard's board and the audit's capacity books; an inference service
shows as `serving` with its replicas, not as a job waiting to be placed."""

from __future__ import annotations

from typing import Any

from gpufleet.shared.contract.events import (
    Envelope,
    JobAdmitted,
    JobCancelled,
    JobScaled,
    JobStarted,
    NodeDeregistered,
    NodeRegistered,
    Reason,
)
from gpufleet.shared.read.view import JOB_STATUSES, ClusterView, apply
from gpufleet.tools.audit import audit
from gpufleet.tools.dashboard import Board

from .builders import T0, admitted, event, exited, make_job, node, placed, started, submitted
from .builders import inventory as inv


def fold(*events: object) -> ClusterView:
    view = ClusterView()
    for seq, env in enumerate(events, 1):
        apply(view, env, seq)  # type: ignore[arg-type]
    return view


def test_gang_replica_exit_frees_only_that_replica() -> None:
    gang = make_job("g").gpus(8).replicas(2)
    view = fold(
        node("n1"), node("n2"), submitted(gang, "g"), admitted("g"),
        placed("g", ("n1", range(8)), ("n2", range(8))), started("g", "n1", 0), started("g", "n2", 1),
        exited("g", "n1", 0),
    )
    assert view.nodes["n1"].gpus_allocated == 0 and view.nodes["n1"].running_jobs == []
    assert view.nodes["n2"].gpus_allocated == 8 and view.nodes["n2"].running_jobs == ["g"]
    assert view.jobs["g"].status == "running"


def test_job_end_frees_every_replica_and_late_events_change_nothing() -> None:
    job = make_job("j").gpus(4)
    from .builders import cancelled

    view = fold(node("n1"), submitted(job, "j"), admitted("j"), cancelled("j"), placed("j", ("n1", range(4))))
    assert view.jobs["j"].status == "cancelled"
    assert view.nodes["n1"].gpus_allocated == 0  # a placement that raced the cancel holds nothing


# ---------------------------------------------------------------- removed nodes, serving services


def registered(node_id: str) -> Envelope:
    return event(NodeRegistered(node_id=node_id, inventory=inv()))


def gone(node_id: str) -> Envelope:
    return event(NodeDeregistered(node_id=node_id))


def scaled(job_id: str, to: int, code: str = "load", s: float = 0) -> Envelope:
    from datetime import timedelta

    return event(JobScaled(job_id=job_id, from_replicas=0, to_replicas=to,
                           reason=Reason(code=code, message=f"{to * 40} req/s")), at=T0 + timedelta(seconds=s))


def test_a_deregistered_node_leaves_the_view() -> None:
    view = fold(registered("p-0000"), registered("n1"), submitted(make_job().gpus(2), "j1"),
                placed("j1", ("p-0000", [0, 1])), exited("j1", "p-0000"), gone("p-0000"))
    assert sorted(view.nodes) == ["n1"]
    assert fold(registered("n1"), gone("nope")).nodes.keys() == {"n1"}  # an unknown node: nothing


def test_a_service_is_serving_with_its_replicas_and_a_late_scale_does_not_revive_it() -> None:
    svc = make_job("web").type("inference").gpus(1).set("autoscale", {"maxReplicas": 4, "targetRpsPerReplica": 40})
    view = fold(submitted(svc, "s"), event(JobAdmitted(job_id="s")), scaled("s", 1, "initial"))
    row = view.jobs["s"]
    assert (row.status, row.replicas) == ("serving", 1) and "initial" in row.reason
    assert "serving" in JOB_STATUSES
    apply(view, scaled("s", 3), 4)
    assert (view.jobs["s"].status, view.jobs["s"].replicas) == ("serving", 3)
    apply(view, event(JobCancelled(job_id="s", reason="by user")), 5)
    apply(view, scaled("s", 0), 6)  # raced the cancel
    assert view.jobs["s"].status == "cancelled"


def test_the_board_drops_a_removed_node() -> None:
    b = Board()
    for seq, e in enumerate([registered("p-0000"), registered("n1"), gone("p-0000")], 1):
        b.fold(seq, e)
    assert [n["node_id"] for n in b.state()["nodes"]] == ["n1"]
    assert "p-0000" not in b.gpus and "p-0000" not in b.held


def _log(*envs: Envelope) -> list[tuple[int, Envelope]]:
    return list(enumerate(envs, start=1))


def test_the_audit_books_a_removed_node_as_gone() -> None:
    job = make_job().gpus(1)
    report = audit(_log(registered("p-0000"), gone("p-0000"), submitted(job, "j1"), placed("j1", ("p-0000", [0])),
                        event(JobStarted(job_id="j1", node_id="p-0000"))))
    lost = [v for v in report.violations if v.invariant == "lost_node"]
    assert [v.message for v in lost] == ["replica 0 placed on p-0000, which was removed", "started on p-0000, which was removed"]
    again = audit(_log(registered("p-0000"), gone("p-0000"), registered("p-0000"), submitted(job, "j1"),
                       placed("j1", ("p-0000", [0]))))  # registered again: it is back
    assert again.ok, again.violations


def test_a_service_that_serves_is_not_a_job_left_untold() -> None:
    from datetime import timedelta

    svc = make_job("web").type("inference").gpus(1).set("autoscale", {"maxReplicas": 4, "targetRpsPerReplica": 40})
    late = event(NodeRegistered(node_id="n9", inventory=inv()), at=T0 + timedelta(hours=1))
    served: Any = audit(_log(submitted(svc, "s"), event(JobAdmitted(job_id="s")), scaled("s", 1, "initial"), late))
    assert served.ok, served.violations
    untold = audit(_log(submitted(svc, "s"), event(JobAdmitted(job_id="s")), late))  # never scaled: untold
    assert [v.invariant for v in untold.violations] == ["pending_reason"]
