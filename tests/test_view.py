"""The cluster fold (shared/view.py): given events, then the jobs and nodes it shows."""

from __future__ import annotations

from gpufleet.shared.view import ClusterView, apply

from .builders import admitted, exited, make_job, node, placed, started, submitted


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
