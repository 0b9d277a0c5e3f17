"""Preemption: a higher-priority job takes quota from lower-priority ones in its queue; a queue
reclaims its nominal quota from borrowers in its cohort. Victims are the fewest, lowest priority,
most recently admitted; every preemption is an event with its reason; it cannot loop."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from gpufleet.services.quota.core import QuotaCore
from gpufleet.shared.contract.clusterconfig import parse_config
from gpufleet.shared.contract.events import Envelope, JobPreempted, Reason

from .builders import T0, Harness, admitted, event, make_job, submitted, types


def quota(queues: dict[str, Any]) -> Harness[Any]:
    return Harness(QuotaCore(parse_config({"queues": queues, "starvationAfter": "1h"})))


def run(h: Harness[Any], job_id: str, gpus: int, queue: str = "a", priority: int = 0) -> list[Envelope]:
    h.given(submitted(make_job(job_id).gpus(gpus).queue(queue).priority(priority), job_id))
    return h.when(admitted(job_id))


def preempted(job_id: str) -> Envelope:
    return event(JobPreempted(job_id=job_id, reason=Reason(code="preempted", message="stopped")))


def test_higher_priority_preempts_the_fewest_lowest_priority_most_recent() -> None:
    h = quota({"a": {"nominal": {"gpu": 16}}})
    assert types(run(h, "low-old", 4, priority=1)) == ["job.quota_reserved"]
    assert types(run(h, "low-new", 4, priority=1)) == ["job.quota_reserved"]
    assert types(run(h, "mid", 8, priority=5)) == ["job.quota_reserved"]
    out = run(h, "urgent", 8, priority=10)
    victims = [e for e in out if e.type == "job.preemption_requested"]
    # 8 GPUs are needed: both priority-1 jobs (4 + 4) rather than the one priority-5 job
    assert sorted(v.job_id for v in victims) == ["low-new", "low-old"]  # type: ignore[type-var]
    assert all(v.payload.by_job_id == "urgent" and v.payload.reason.code == "priority" for v in victims)  # type: ignore[union-attr]
    assert [e.type for e in out if e.job_id == "urgent"] == ["job.queued"]
    assert h.tick(T0 + timedelta(seconds=5)) == []  # no second round while the victims end
    h.when(preempted("low-old"))
    out = h.when(preempted("low-new"))
    assert [(e.type, e.job_id) for e in out] == [("job.quota_reserved", "urgent")]


def test_victims_are_minimal_one_big_job_not_many_small() -> None:
    h = quota({"a": {"nominal": {"gpu": 16}}})
    run(h, "small1", 2)
    run(h, "small2", 2)
    run(h, "big", 12)
    out = run(h, "urgent", 10, priority=9)
    # the most recent (big) alone frees enough; small1 and small2 are spared
    assert [e.job_id for e in out if e.type == "job.preemption_requested"] == ["big"]


def test_equal_or_lower_priority_never_preempts() -> None:
    h = quota({"a": {"nominal": {"gpu": 8}}})
    run(h, "first", 8, priority=5)
    assert types(run(h, "same", 8, priority=5)) == ["job.queued"]
    assert types(run(h, "lower", 8, priority=1)) == ["job.queued"]


def test_a_queue_reclaims_its_nominal_from_a_borrower_in_its_cohort() -> None:
    h = quota({"a": {"cohort": "lab", "nominal": {"gpu": 8}}, "b": {"cohort": "lab", "nominal": {"gpu": 8}}})
    assert types(run(h, "b1", 8, queue="b")) == ["job.quota_reserved"]
    assert types(run(h, "b2", 8, queue="b")) == ["job.quota_reserved"]  # borrowed a's unused 8
    out = run(h, "a1", 8, queue="a", priority=0)  # a is owed its nominal, whatever the priorities
    victims = [e for e in out if e.type == "job.preemption_requested"]
    assert [v.job_id for v in victims] == ["b2"]  # the borrower's most recent job
    assert victims[0].payload.reason.code == "reclaim"  # type: ignore[union-attr]
    out = h.when(preempted("b2"))
    assert [(e.type, e.job_id) for e in out] == [("job.quota_reserved", "a1")]


def test_what_a_victim_gives_back_waits_for_the_job_that_preempted_it() -> None:
    # a reclaims 8 from b, which borrows with two 4-GPU jobs; the first victim's 4 must not go to
    # b's next job (it would borrow them, to be reclaimed in turn: a loop), but wait for a1
    h = quota({"a": {"cohort": "lab", "nominal": {"gpu": 8}}, "b": {"cohort": "lab", "nominal": {"gpu": 8}}})
    for j in ("b1", "b2", "b3", "b4"):
        run(h, j, 4, queue="b")
    run(h, "b5", 4, queue="b")  # waits: the cohort is full
    out = run(h, "a1", 8, queue="a")
    assert sorted(e.job_id for e in out if e.type == "job.preemption_requested") == ["b3", "b4"]  # type: ignore[type-var]
    out = h.when(preempted("b4"))
    assert "job.quota_reserved" not in types(out)  # b5 is held back, a1 still lacks 4
    assert [e.payload.reason.code for e in out if e.job_id == "b5"] == ["behind_preemptor"]  # type: ignore[union-attr]
    out = h.when(preempted("b3"))
    assert [(e.type, e.job_id) for e in out if e.type == "job.quota_reserved"] == [("job.quota_reserved", "a1")]


def test_no_reclaim_beyond_the_nominal_and_no_preemption_loop() -> None:
    h = quota({"a": {"cohort": "lab", "nominal": {"gpu": 8}}, "b": {"cohort": "lab", "nominal": {"gpu": 8}}})
    run(h, "b1", 8, queue="b")
    run(h, "b2", 8, queue="b")
    run(h, "a1", 8, queue="a")
    h.when(preempted("b2"))
    # a is at its nominal now: a second job of a may not reclaim (it would borrow itself)
    assert types(run(h, "a2", 8, queue="a")) == ["job.queued"]
    # and b, at its nominal, cannot take back from a, which does not borrow: nothing moves
    assert types(run(h, "b3", 8, queue="b")) == ["job.queued"]
    for n in range(10):
        assert h.tick(T0 + timedelta(seconds=5 * (n + 1))) == []


def test_with_a_backlog_a_cycle_runs_every_few_admissions_and_at_each_tick() -> None:
    from gpufleet.services.quota.core import CYCLE_ON_EVENT_MAX

    h = quota({"a": {"nominal": {"gpu": 8}}})
    run(h, "holder", 8)
    for i in range(CYCLE_ON_EVENT_MAX):  # up to the threshold: a cycle for each, each told why once
        assert [e.job_id for e in run(h, f"w{i}", 8) if e.type == "job.queued"] == [f"w{i}"]
    # past it (65-128 waiting): a cycle every second admission, which tells what came since the last
    outs = [run(h, f"late{i}", 8) for i in range(8)]
    cycled = [i for i, o in enumerate(outs) if o]
    assert len(cycled) == 4 and all(b - a == 2 for a, b in zip(cycled, cycled[1:], strict=False))
    told = [e.job_id for o in outs for e in o if e.type == "job.queued"]
    untold = [f"late{i}" for i in range(cycled[-1] + 1, 8)]
    assert told == [f"late{i}" for i in range(cycled[-1] + 1)]
    out = h.tick(T0 + timedelta(seconds=1))  # the tick tells the rest
    assert [e.job_id for e in out if e.type == "job.queued"] == untold
    out = h.when(preempted("holder"))  # a release with a backlog: left to the tick
    assert out == []
    assert [e.job_id for e in h.tick(T0 + timedelta(seconds=2)) if e.type == "job.quota_reserved"] == ["w0"]
