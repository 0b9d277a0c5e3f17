"""The expected wait of `gpufleet estimate` (services/billing/wait.py), on folded states whose
answer is known: jobs ahead take quota and nodes first, running jobs end at their max runtime,
a queue without quota room waits for its own jobs to end."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from gpufleet.services.billing import report
from gpufleet.services.billing.wait import expected_wait
from gpufleet.services.placer.core import PlacerCore
from gpufleet.services.quota.core import QuotaCore
from gpufleet.shared.contract.clusterconfig import ClusterConfig, parse_config
from gpufleet.shared.contract.events import Envelope, JobPlaced, JobQuotaReserved, ReplicaAllocation
from gpufleet.shared.contract.spec import JobSpec
from gpufleet.shared.runtime.bus import subject_matches

from .builders import T0, JobBuilder, admitted, event, make_job, node, submitted

H = timedelta(hours=1)
NOW = T0 + timedelta(minutes=10)


def job(queue: str = "default", gpus: int = 8, replicas: int = 1, runtime: str = "1h",
        priority: int = 0) -> JobBuilder:
    return make_job().queue(queue).gpus(gpus).replicas(replicas).max_runtime(runtime).priority(priority)


def running(b: JobBuilder, job_id: str, *nodes: str) -> list[Envelope]:
    """Submitted, admitted, quota reserved and placed at T0 (8 GPUs of each node named)."""
    spec = b.spec()
    return [submitted(spec, job_id), admitted(job_id), *reserved(spec, job_id),
            event(JobPlaced(job_id=job_id, allocations=tuple(
                ReplicaAllocation(replica=i, node_id=n, gpu_indices=tuple(range(8)), cpu_milli=1000, memory_mib=1024)
                for i, n in enumerate(nodes))), at=T0)]


def reserved(spec: JobSpec, job_id: str) -> list[Envelope]:
    r = spec.resources
    return [event(JobQuotaReserved(job_id=job_id, queue=spec.queue, cpu_milli=r.cpu_milli * spec.replicas,
                                   memory_mib=r.memory_mib * spec.replicas, gpus=spec.gpus_total), at=T0)]


def waiting_for_quota(b: JobBuilder, job_id: str) -> list[Envelope]:
    return [submitted(b.spec(), job_id), admitted(job_id)]


def fold(config: ClusterConfig, *events: Envelope | list[Envelope]) -> tuple[Any, ...]:
    placer, quota = PlacerCore(config), QuotaCore(config)
    pstate, qstate = placer.initial_state(), quota.initial_state()
    for e in [x for item in events for x in (item if isinstance(item, list) else [item])]:
        if any(subject_matches(p, e.subject()) for p in placer.subjects):
            pstate = placer.evolve(pstate, e)
        if any(subject_matches(p, e.subject()) for p in quota.subjects):
            qstate = quota.evolve(qstate, e)
    return placer, pstate, quota, qstate


RESEARCH = {"queues": {"research": {"nominal": {"gpu": 8}}}}


def test_a_full_queue_waits_for_its_own_running_job_and_the_job_ahead_of_it() -> None:
    """research (8 GPUs of quota) runs r1 on n1 until T0+1h; p1 (8 GPUs) waits for research's
    quota ahead of us; n2 runs r2 (default queue) until T0+2h. p1 gets r1's quota and n1 at
    T0+1h for its hour; we (4 GPUs) get research's quota back only when p1 ends: T0+2h."""
    cfg = parse_config(RESEARCH)
    states = fold(cfg, node("n1"), node("n2"), running(job("research"), "r1", "n1"),
                  running(job(runtime="2h"), "r2", "n2"), waiting_for_quota(job("research"), "p1"))
    w = expected_wait(*states, job("research", gpus=4, runtime="30m").spec(), NOW.timestamp())
    assert w.wait_s == (2 * H - timedelta(minutes=10)).total_seconds() and w.start == T0 + 2 * H
    assert (w.ahead, w.ahead_first, w.running_ends) == (1, 1, 2)
    assert w.quota_queue == "research" and w.quota_until == T0 + 2 * H and w.quota_ends == 1
    assert w.quota_full == "queue research: gpu 8 used + 4 requested > nominal 8"
    assert w.note.startswith("1 job ahead (1 start first); waits for 2 running jobs to end; quota of queue "
                             "research full until 2026-01-01T14:00:00Z (1 running job of its cohort end)")
    doc = w.as_json()
    assert doc["quota"] == {"queue": "research", "full_now": True, "reason": w.quota_full,
                            "until": "2026-01-01T14:00:00Z", "running_ends": 1}
    assert (doc["ahead"], doc["ahead_first"], doc["running_ends"], doc["wait_s"]) == (1, 1, 2, 6600.0)
    # the same job in the unlimited default queue needs only a node: n1 once r1 ends, before p1?
    # no: p1 is ahead and takes n1 at T0+1h; n2 frees at T0+2h
    w = expected_wait(*states, job(gpus=4, runtime="30m").spec(), NOW.timestamp())
    assert (w.start, w.ahead, w.ahead_first, w.quota_queue, w.quota_full) == (T0 + 2 * H, 1, 1, None, None)
    # the estimate document carries the parts
    est = report.estimate(job("research", gpus=4).spec(), cfg, wait=expected_wait(
        *states, job("research", gpus=4).spec(), NOW.timestamp()))
    assert est["wait_s"] == 6600.0 and est["wait"]["quota"]["full_now"] and "1 job ahead" in est["wait_note"]
    assert "expected wait: 1 h 50 min, starting about 2026-01-01T14:00:00Z (1 job ahead" in report.estimate_text(est)


def test_only_jobs_of_a_priority_at_least_ours_are_ahead_and_one_that_does_not_fit_does_not_block() -> None:
    cfg = parse_config(RESEARCH)
    base = [node("n1"), node("n2"), running(job("research"), "r1", "n1")]
    low = waiting_for_quota(job("research", priority=-5), "low")
    # n2 is free: an 8-GPU job of the default queue fits now, the waiting research job is no obstacle
    states = fold(cfg, *base, low)
    w = expected_wait(*states, job().spec(), NOW.timestamp())
    assert (w.wait_s, w.ahead, w.note) == (0.0, 0, "fits the free capacity and quota now")
    # a research job of priority 0: the low one (priority -5) is behind it; both wait for r1's quota
    w = expected_wait(*states, job("research").spec(), NOW.timestamp())
    assert (w.start, w.ahead, w.running_ends) == (T0 + H, 0, 1)
    # a high one (priority 10) admitted after the low one is ahead of ours all the same
    states = fold(cfg, *base, low, waiting_for_quota(job("research", priority=10), "high"))
    w = expected_wait(*states, job("research").spec(), NOW.timestamp())
    assert (w.start, w.ahead, w.ahead_first) == (T0 + 2 * H, 1, 1)
    # a gang ahead that cannot fit before everything ends does not hold back a job that fits now
    gang = job(gpus=8, replicas=2)
    states = fold(cfg, node("n1"), node("n2"), running(job(), "r2", "n1"),
                  submitted(gang.spec(), "g"), admitted("g"), reserved(gang.spec(), "g"))
    w = expected_wait(*states, job(runtime="30m").spec(), NOW.timestamp())
    assert (w.wait_s, w.ahead, w.ahead_first) == (0.0, 1, 0)
    assert w.note.startswith("1 job ahead (0 start first); fits now")


def test_what_cannot_be_known_says_why() -> None:
    cfg = parse_config(RESEARCH)
    assert expected_wait(*fold(cfg), job().spec(), NOW.timestamp()).note == "no nodes registered"
    states = fold(cfg, node("n1"))
    assert expected_wait(*states, job(gpus=8, replicas=2).spec(), NOW.timestamp()).wait_s is None
    states = fold(cfg, node("n1"), node("n2"))  # 12 GPUs fit the nodes, not research's 8 of quota
    w = expected_wait(*states, job("research", gpus=4, replicas=3).spec(), NOW.timestamp())
    assert w.wait_s is None and w.note.startswith("the quota of queue research could never hold it")
