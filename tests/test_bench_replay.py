"""`gpufleet bench replay`: the log's fold speed beside the raw read rate, measured on one log."""

from __future__ import annotations

import json
import subprocess
import sys

from gpufleet.bench.replay import synthetic_log
from gpufleet.shared.read.view import ClusterView, apply


def test_the_synthetic_log_is_a_consistent_history() -> None:
    envs = synthetic_log(3000)
    assert len(envs) == 3000 and len({e.event_id for e in envs}) == 3000
    view = ClusterView()
    for seq, e in enumerate(envs, 1):
        apply(view, e, seq)
    statuses = {j.status for j in view.jobs.values()}
    assert statuses <= {"succeeded", "submitted", "admitted", "reserved", "placed", "running"}
    assert sum(1 for j in view.jobs.values() if j.status == "succeeded") >= len(view.jobs) - 1
    assert all(n.gpus_allocated == 0 for n in view.nodes.values())  # every job ended: nothing held


def test_bench_replay_reads_parses_and_folds_every_event() -> None:
    proc = subprocess.run([sys.executable, "-m", "gpufleet.cli", "bench", "replay", "--events", "2000",
                           "--repeat", "1", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["built"]["events"] == 2000
    for m in ("raw_read", "parse", "fold"):
        assert doc[m]["events"] == 2000 and doc[m]["events_per_s"] > 0
    assert doc["raw_read"]["vs_raw_read"] == 1.0
