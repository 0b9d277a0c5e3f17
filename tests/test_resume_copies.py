"""A copy of an old `job.resume_requested` (re-published after the duplicate window, or replayed
into a core that already folded it) changes nothing: the resume carries the attempt it starts,
and every core that counts attempts recognises a copy of one it has seen."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.guardian.core import GuardianCore
from gpufleet.services.placer.core import PlacerCore
from gpufleet.services.quota.core import QuotaCore
from gpufleet.shared.contract.clusterconfig import parse_config
from gpufleet.shared.contract.events import (
    JobExited,
    JobPlaced,
    JobResumeRequested,
    JobStarted,
    Reason,
    ReplicaAllocation,
)
from gpufleet.shared.contract.subjects import SubjectFilter

from .builders import T0, Harness, admitted, event, inventory, make_job, node, quota_reserved, submitted

JOB = make_job("train").type("training").gpus(2).runs("1h")


def story() -> tuple[list[Any], Any]:
    """Attempt 1 on n1, preempted and resumed; attempt 2 placed on n2 and running; then a copy."""
    def place(node_id: str, attempt: int, s: float) -> Any:
        return event(JobPlaced(job_id="j1", attempt=attempt, allocations=(ReplicaAllocation(
            replica=0, node_id=node_id, gpu_indices=(0, 1), cpu_milli=1000, memory_mib=1024),)),
            at=T0 + timedelta(seconds=s))

    resume = event(JobResumeRequested(job_id="j1", attempt=2, reason=Reason(code="preempted", message="for p")),
                   at=T0 + timedelta(seconds=100))
    log = [node("n1"), node("n2"), submitted(JOB, "j1"), admitted("j1"), quota_reserved(JOB, "j1"), place("n1", 1, 1),
           event(JobStarted(job_id="j1", node_id="n1", attempt=1), at=T0 + timedelta(seconds=2)), resume,
           event(JobExited(job_id="j1", node_id="n1", exit_code=143, reason="preempted", attempt=1),
                 at=T0 + timedelta(seconds=110)),
           quota_reserved(JOB, "j1"), place("n2", 2, 120),
           event(JobStarted(job_id="j1", node_id="n2", attempt=2), at=T0 + timedelta(seconds=121))]
    copy = resume.model_copy(update={"event_id": resume.event_id[:-1] + ("A" if resume.event_id[-1] != "A" else "B"),
                                     "occurred_at": T0 + timedelta(seconds=600)})
    return log, copy


def fold(core: Any, log: list[Any]) -> Harness[Any]:
    """The core's view of the log: what its subjects deliver (as the runtime does)."""
    wanted = SubjectFilter(core.subjects)
    return Harness(core).given(*(e for e in log if wanted(e.subject())))


def test_quota_keeps_the_reservation_of_the_running_attempt() -> None:
    log, copy = story()
    h = fold(QuotaCore(parse_config({})), log)
    before = (dict(h.state.usage), set(h.state.reserved), set(h.state.pending))
    assert "j1" in h.state.reserved
    h.when(copy, T0 + timedelta(seconds=600))
    assert (dict(h.state.usage), set(h.state.reserved), set(h.state.pending)) == before


def test_the_placer_does_not_count_another_attempt_nor_requeue_the_running_job() -> None:
    log, copy = story()
    h = fold(PlacerCore(), log)
    rec = h.state.jobs["j1"]
    assert rec.attempt == 2 and rec.allocations is not None
    out = h.when(copy, T0 + timedelta(seconds=600))
    assert out == [] and rec.attempt == 2 and "j1" not in h.state.pending and not rec.requota


def test_the_guardian_still_ends_the_job_when_the_running_attempt_exits() -> None:
    log, copy = story()
    h = fold(GuardianCore(), log)
    h.when(copy, T0 + timedelta(seconds=600))
    assert h.state.jobs["j1"].attempt == 2 and h.state.jobs["j1"].failures == 0
    out = h.when(event(JobExited(job_id="j1", node_id="n2", exit_code=0, reason="completed", attempt=2)),
                 T0 + timedelta(seconds=700))
    assert [e.type for e in out] == ["job.succeeded"]


def test_the_executor_does_not_stop_the_running_attempt() -> None:
    log, copy = story()
    h = fold(ExecutorCore({"n1": inventory(), "n2": inventory()}), log)
    assert h.state.jobs["j1"].attempt == 2
    out = h.when(copy, T0 + timedelta(seconds=600))
    assert not [e for e in out if e.type == "job.exited"] and h.state.jobs["j1"].attempt == 2


def test_a_resume_without_an_attempt_still_counts_one_more_run() -> None:
    # logs written before the field existed: each resume is a new run, as before
    from gpufleet.shared.contract.events import resumed_attempt

    old = JobResumeRequested(job_id="j1", reason=Reason(code="node_lost", message="x"))
    assert resumed_attempt(1, old) == 2 and resumed_attempt(2, old) == 3
    new = JobResumeRequested(job_id="j1", attempt=3, reason=Reason(code="node_lost", message="x"))
    assert resumed_attempt(2, new) == 3 and resumed_attempt(3, new) is None and resumed_attempt(4, new) is None
