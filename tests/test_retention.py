"""A state that forgets (shared/runtime/retention.py): jobs that ended more than the window of log time
ago are forgotten by every core, so what a core holds does not grow with the jobs ever run."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import pickle
import sys
from collections import Counter, deque
from datetime import timedelta
from typing import Any

import pytest

from gpufleet.bench.replay import synthetic_log
from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.registry import make_core
from gpufleet.shared.contract.events import Envelope, JobSucceeded, NodeRegistered
from gpufleet.shared.runtime.engine import Engine
from gpufleet.shared.runtime.retention import EndedJobs

from .builders import T0, Harness, event, make_job, submit


def _fold(name: str, log: list[Envelope]) -> Any:
    engine = Engine(make_core(name, argparse.Namespace(config=None, sim_nodes=0)))
    for seq, env in enumerate(log, 1):
        if engine.wants(env.subject()):
            engine.fold(env, seq)
    return engine.state


def _jobs_then_later(events: int) -> list[Envelope]:
    """Job lifecycles on a fixed set of nodes, then the end of another job a day and a half later."""
    log = [e for e in synthetic_log(events) if not isinstance(e.payload, NodeRegistered)]
    nodes = [e for e in synthetic_log(events) if isinstance(e.payload, NodeRegistered)][:2]
    # every job runs on the first two nodes (the synthetic log spreads them over more)
    log = [e for e in log if _on(e, {n.payload.node_id for n in nodes})]  # type: ignore[union-attr]
    # a day and a half later another job ends: the clock of the log is past the window for all
    late = event(JobSucceeded(job_id="late-job"), at=log[-1].occurred_at + timedelta(hours=36))
    return [*nodes, *log, late]


def _on(env: Envelope, nodes: set[str]) -> bool:
    allocs = getattr(env.payload, "allocations", None)
    node = getattr(env.payload, "node_id", None)
    return (allocs is None or all(a.node_id in nodes for a in allocs)) and (node is None or node in nodes)


@pytest.mark.parametrize("name", ["admission", "quota", "placer", "guardian", "executor", "telemetry", "autoscaler",
                                  "billing"])
def test_a_cores_state_after_many_ended_jobs_past_the_window_is_no_larger_than_after_few(name: str) -> None:
    few = _fold(name, _jobs_then_later(700))  # ~100 jobs
    many = _fold(name, _jobs_then_later(70_000))  # ~10,000 jobs
    if name == "placer":  # its window of the latest job shapes is bounded by design (SHAPES_KEPT)
        from gpufleet.services.placer.core import SHAPES_KEPT

        assert len(many.recent) <= SHAPES_KEPT
        few, many = (dataclasses.replace(s, recent=deque(), shapes=Counter()) for s in (few, many))
    small, big = len(pickle.dumps(few)), len(pickle.dumps(many))
    assert big <= small * 1.1 + 512, f"{name}: {small} bytes after ~100 jobs, {big} after ~10,000"
    if hasattr(many, "ended"):
        assert len(many.ended) <= len(few.ended) + 1


def test_telemetry_forgets_rejected_jobs_and_the_idle_spells_of_ended_ones() -> None:
    """A rejected job (never placed) and the idle and starvation spells of a job that ended are not
    kept: after 2,000 such jobs the telemetry state is no larger than after 20."""
    from gpufleet.shared.contract.events import (
        JobGpuStarved,
        JobIdleDetected,
        JobIdleEnded,
        JobRejected,
        Reason,
    )

    from .builders import node, placed, submitted

    def log(jobs: int) -> list[Envelope]:
        out = [node("n1")]
        for i in range(jobs):
            j = f"j{i}"
            if i % 2:
                out += [submitted(make_job(), j), event(JobRejected(job_id=j, reasons=(Reason(code="x", message="no"),)))]
                continue
            out += [submitted(make_job(), j), placed(j, ("n1", [0])),
                    event(JobIdleDetected(job_id=j, node_id="n1", gpu_util_pct=0.0, idle_s=600.0)),
                    event(JobIdleEnded(job_id=j)),
                    event(JobIdleDetected(job_id=j, node_id="n1", gpu_util_pct=0.0, idle_s=600.0)),
                    event(JobGpuStarved(job_id=j, node_id="n1", cause="cpu", gpu_util_pct=1.0, cpu_util_pct=100.0,
                                        window_s=60.0)),
                    event(JobSucceeded(job_id=j))]
        return out

    few, many = _fold("telemetry", log(20)), _fold("telemetry", log(2000))
    assert not many.jobs and not many.by_node  # (their sim behaviour and their spells went with their records)
    assert len(pickle.dumps(many)) <= len(pickle.dumps(few)) + 256


def test_ended_jobs_forget_in_log_time_and_only_past_the_window() -> None:
    e = EndedJobs(retention_s=3600)
    assert e.add("a", T0) == [] and "a" in e
    assert e.add("b", T0 + timedelta(minutes=59)) == []
    assert e.add("c", T0 + timedelta(hours=1, minutes=1)) == ["a"]
    assert "a" not in e and list(e) == ["b", "c"]


def test_a_forgotten_ulid_job_id_is_refused_by_its_time() -> None:
    from gpufleet.shared.contract.ids import ulid

    old = ulid(int((T0 - timedelta(days=3)).timestamp() * 1000), b"\x01" * 10)
    out = Harness(AdmissionCore()).when(submit(make_job(), old), now=T0)
    assert [e.type for e in out] == ["job.request_refused"]
    assert out[0].payload.reasons[0].code == "job_id_expired"  # type: ignore[union-attr]
    fresh = ulid(int(T0.timestamp() * 1000), b"\x02" * 10)
    assert [e.type for e in Harness(AdmissionCore()).when(submit(make_job(), fresh), now=T0)][0] != "job.request_refused"


@pytest.mark.parametrize("names", [("admission",), ("quota",), ("placer",), ("guardian",), ("executor",),
                                   ("telemetry",), ("autoscaler",), ("billing",),
                                   ("admission", "quota", "guardian", "telemetry", "billing", "autoscaler")])
def test_a_pending_job_costs_each_core_under_2_kb(names: tuple[str, ...]) -> None:
    """A backlog: 3,000 jobs admitted and waiting (each with its own name, of a few shapes), parsed
    from the wire as a service receives them; what the cores keep per job, one process together."""
    import gc
    import tracemalloc

    from gpufleet.shared.contract.events import parse_envelope

    from .builders import admitted, node, submitted

    jobs = 3000
    raw = [node(f"n{i}").to_json() for i in range(4)]
    for i in range(jobs):
        raw += [submitted(make_job(f"train-{i}").gpus(1 + i % 4).cpu(2 + i % 3), f"p{i:06d}").to_json(),
                admitted(f"p{i:06d}").to_json()]
    engines = [Engine(make_core(n, argparse.Namespace(config=None, sim_nodes=0))) for n in names]
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for seq, data in enumerate(raw, 1):
            env = parse_envelope(data)
            for e in engines:
                if e.wants(env.subject()):
                    e.fold(env, seq)
        del env
        gc.collect()
        per_job = (tracemalloc.get_traced_memory()[0] - before) / jobs
    finally:
        tracemalloc.stop()
    assert per_job <= 2048, f"{'+'.join(names)}: {per_job:.0f} bytes per pending job"


def test_compact_specs_share_equal_parts_and_serialise_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufleet.shared.contract import spec as spec_module
    from gpufleet.shared.contract.spec import parse_spec

    docs = [{"name": f"j{i}", "tenant": "acme", "resources": {"gpu": 2, "cpu": "4", "mig": {}},
             "sim": {"duration": "1m"}} for i in range(3)]
    docs.append({"name": "other", "tenant": "acme", "resources": {"cpu": "4", "mig": {"1g.10gb": 1}}})
    specs = [parse_spec(d) for d in docs]
    assert specs[0].resources is specs[1].resources is specs[2].resources  # one copy of the shape
    assert specs[0].sim is specs[2].sim
    assert specs[3].resources is not specs[0].resources and specs[3].resources.mig == {"1g.10gb": 1}
    with monkeypatch.context() as m:
        m.setattr(spec_module, "compact", lambda spec: None)  # as parsed before specs were compacted
        plain = [parse_spec(d) for d in docs]
    assert plain[0].resources is not plain[1].resources
    for p, s in zip(plain, specs, strict=True):
        assert s == p and s.model_fields_set == p.model_fields_set
        assert s.model_dump(exclude_unset=True) == p.model_dump(exclude_unset=True)
        assert s.model_dump_json(by_alias=True) == p.model_dump_json(by_alias=True)
    changed = specs[0].model_copy(update={"priority": 5})
    assert "priority" in changed.model_fields_set and "priority" not in specs[1].model_fields_set
    # repeated plain values and mappings are one copy, and a shared mapping refuses to change
    assert specs[0].tenant is specs[3].tenant and specs[0].env is specs[3].env
    with pytest.raises(TypeError, match="read-only"):
        specs[0].env["X"] = "1"  # type: ignore[index]
    assert specs[1].env == {} and copy.deepcopy(specs[0]) == specs[0] == pickle.loads(pickle.dumps(specs[0]))
    if spec_module._SPLIT_DICTS:  # the fields' dict shares its keys with every other spec's
        assert sys.getsizeof(specs[0].__dict__) < sys.getsizeof(dict(plain[0].__dict__)) / 2


def test_the_guardian_forgets_every_fact_of_a_job_when_it_ends() -> None:
    """One record per job: the checkpoint facts (verified, invalid, overdue, saved), its run, its
    retry and idle spells all go with it when it ends; only the id stays, in the ended window.
    (The parallel dicts this replaced left the invalid / overdue sets behind.)"""
    from gpufleet.services.guardian.core import GuardianCore
    from gpufleet.shared.contract.events import (
        JobCheckpointInvalid,
        JobCheckpointOverdue,
        JobCheckpointSaved,
        JobCheckpointVerified,
        JobStarted,
        JobSucceeded,
    )

    from .builders import Harness, event, make_job, node, placed, submitted

    job = make_job("train").type("training").gpus(1).runs("1h")
    h = Harness(GuardianCore())
    h.given(node("n1"), submitted(job, "j1"), placed("j1", ("n1", [0])),
            event(JobStarted(job_id="j1", node_id="n1", attempt=1, driver="process")),
            event(JobCheckpointVerified(job_id="j1", location="file:///c/j1", attempt=1)),
            event(JobCheckpointSaved(job_id="j1", uri="file:///c/j1/step-1", step=1, size_bytes=1, sha256="0" * 64)),
            event(JobCheckpointInvalid(job_id="j1", uri="file:///c/j1/step-2", step=2, reason="partial")),
            event(JobCheckpointOverdue(job_id="j1", age_s=9.0, limit_s=1.0)))
    rec = h.state.jobs["j1"]
    assert rec.said.verified == {1} and rec.said.invalid_said == {2} and rec.said.step == 1 and h.state.watched() == ["j1"]
    h.given(event(JobSucceeded(job_id="j1")))
    assert "j1" not in h.state.jobs and "j1" in h.state.ended
    assert not (h.state.running or h.state.idle or h.state.retrying) and h.state.watched() == []
    h.given(event(JobCheckpointSaved(job_id="j1", uri="file:///c/j1/step-3", step=3, size_bytes=1, sha256="0" * 64)))
    assert "j1" not in h.state.jobs, "a late fact about an ended job brought its record back"


def _autoscaler_story(rounds: int) -> Any:
    """A live inference service whose replicas fail and are replaced every round, and in each round
    a service that is admitted, scaled up, loses a replica (replaced), then is cancelled with its
    replicas; then a job ends a day and a half later (past the window for all of it). The rest of
    the mesh is played here: a replica submitted is submitted, admitted, placed and started; one
    cancelled ends."""
    from gpufleet.services.autoscaler.core import AutoscalerCore, replica_job_id
    from gpufleet.shared.contract.events import (
        CancelRequestedCmd,
        JobAdmitted,
        JobCancelled,
        JobFailed,
        Reason,
        ReportLoadCmd,
        SubmitRequested,
    )
    from gpufleet.shared.contract.spec import parse_spec

    from .builders import placed, started, submitted

    class Play(Harness[Any]):
        actor = "autoscaler/0"  # (it counts only its own submits)

    h = Play(AutoscalerCore())
    auto = {"minReplicas": 2, "maxReplicas": 4, "targetRpsPerReplica": 100, "scaleUpCooldown": "10s",
            "scaleDownCooldown": "60s"}
    spec = make_job("web").type("inference").gpus(1).runs("1h").set("autoscale", auto).spec()

    def at(s: float) -> Any:
        return T0 + timedelta(seconds=s)

    def world(out: list[Envelope], s: float) -> None:
        for e in out:
            p = e.payload
            if isinstance(p, SubmitRequested):
                h.given(submitted(parse_spec(p.spec), p.job_id), event(JobAdmitted(job_id=p.job_id), at=at(s)),
                        placed(p.job_id, ("n1", [0]), at=at(s)), started(p.job_id, "n1", at=at(s)))
            elif isinstance(p, CancelRequestedCmd):
                world(h.when(event(JobCancelled(job_id=p.job_id, reason="x"), at=at(s)), at(s)), s)

    def fail(job_id: str, s: float) -> None:
        world(h.when(event(JobFailed(job_id=job_id, reason=Reason(code="error", message="exit 1")), at=at(s)),
                     at(s)), s)

    h.given(submitted(spec, "live"))
    world(h.when(event(JobAdmitted(job_id="live"), at=at(0)), at(0)), 0)
    for i in range(rounds):
        s0, svc = 600.0 * (i + 1), f"svc{i}"
        h.given(submitted(spec, svc))
        world(h.when(event(JobAdmitted(job_id=svc), at=at(s0)), at(s0)), s0)
        world(h.when(event(ReportLoadCmd(job_id=svc, rps=400), at=at(s0 + 1)), at(s0 + 1)), s0 + 1)  # 2 -> 4
        fail(replica_job_id(svc, 1), s0 + 2)
        fail(min(h.state.services["live"].replicas), s0 + 2)
        world(h.tick(at(s0 + 5)), s0 + 5)  # both replaced after their backoff
        world(h.when(event(JobCancelled(job_id=svc, reason="user"), at=at(s0 + 10)), at(s0 + 10)), s0 + 10)
    h.given(event(JobSucceeded(job_id="late-job"), at=at(600.0 * (rounds + 1) + 36 * 3600)))
    return h.state


def test_the_autoscaler_forgets_ended_replicas_and_services_past_the_window() -> None:
    """Services whose replicas come and go: past the window the autoscaler keeps the live service and
    its live replicas, nothing of the replicas and services that ended (before: every replica ever
    made stayed in `replica_of`, every service that ended in `services`)."""
    few, many = _autoscaler_story(3), _autoscaler_story(60)
    live = many.services["live"]
    assert len(live.replicas) == 2 and live.next_index == 62  # (each round replaced one of them)
    assert set(many.services) == {"live"} and set(many.replica_of) == set(live.replicas)
    assert set(many.jobs) == {"live", *live.replicas} and list(many.ended) == ["late-job"]
    small, big = len(pickle.dumps(few)), len(pickle.dumps(many))
    assert big <= small * 1.1 + 256, f"autoscaler: {small} bytes after 3 rounds, {big} after 60"
