"""`gpufleet bench chaos`, short: a few dozen jobs on the distributed shape (3 NATS nodes, every
service twice, PostgreSQL) while every fault kind is injected once; every check must hold."""

from __future__ import annotations

import pytest

from gpufleet.bench.chaos import FAULT_KINDS, PARTITION_KINDS, fault_kinds, run, schedule, workload

pytestmark = pytest.mark.slow


def test_the_seed_fixes_the_workload_and_the_faults() -> None:
    assert workload(3, 50) == workload(3, 50) and workload(3, 50) != workload(4, 50)
    faults = schedule(3, 60.0, 2)
    assert faults == schedule(3, 60.0, 2) and {k for _, k in faults} == set(FAULT_KINDS)
    assert len(faults) == len(FAULT_KINDS) + 2
    assert all(0 < at < 60 for at, _ in faults) and faults == sorted(faults)
    without = schedule(3, 60.0, 2, partitions=False)
    assert {k for _, k in without} == set(FAULT_KINDS) - set(PARTITION_KINDS) and len(without) == len(FAULT_KINDS) - len(PARTITION_KINDS) + 2


@pytest.mark.timeout(900)  # (a job that never ends is waited for 4 min: the report must still come back)
def test_a_short_campaign_loses_nothing_and_does_nothing_twice() -> None:
    doc = run(seed=2, jobs=60, sim_nodes=6, extra_faults=0)
    partitioned = doc["partitions"].startswith("injected")
    assert {f["kind"] for f in doc["faults"]} == set(fault_kinds(partitioned)), doc["partitions"]
    # a cut that was made and healed names its victim and the leader after it
    assert all(" cut " in f["hit"] for f in doc["faults"] if f["kind"] in PARTITION_KINDS), doc["faults"]
    assert all("nothing hit" not in f["hit"] for f in doc["faults"]), doc["faults"]
    assert doc["submitted"] + doc["not_acknowledged"] == 60 + len(doc["faults"])
    assert doc["not_ended_count"] == 0, doc["not_ended"]
    assert doc["ended_twice"] == [] and doc["audit_ok"], (doc["audit_violations"], doc.get("audit_error"))
    assert doc["replay_equals_read_model"], doc["replay_read_model_differ"]
    assert doc["runs_started"] > 0 and doc["runs_charged_twice"] == [] and doc["runs_not_charged"] == 0
    # a probe the client was told was not taken (the stream electing its leader) is no recovery to time
    assert all(f["recovery_s"] is not None for f in doc["faults"] if f["probe"] is not None), doc["faults"]
    # the node lost past its lease was declared lost, and no other fault cost a node
    assert doc["nodes_lost"] > 0 and doc["nodes_lost_elsewhere"] == [], doc["nodes_lost_elsewhere"]
    # the whole fleet silent at once (both node agents frozen past the lease): held, nobody lost
    [silence] = [f for f in doc["faults"] if f["kind"] == "silence_fleet"]
    assert "executor, executor@1" in silence["hit"] and doc["fleet_silent_holds"] >= 1, (silence, doc["fleet_silent_holds"])
    assert doc["ok"]
