"""`replay --what-if` on a log recorded by a real mesh (nats-server, PostgreSQL, the services, the
sim driver): the recorded workload run again through the cores under the recorded config and
under another one, beside the figures read off the log itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_mesh_cli import cli, wait_jobs

pytestmark = pytest.mark.slow


def test_what_if_on_a_log_recorded_by_a_real_mesh(tmp_path: Path) -> None:
    data = tmp_path / "mesh"
    cli(data, "up", "--detach", "--sim-nodes", "2", "--sim-mix", "h100x8")
    try:
        # six whole-node jobs on two nodes: they queue, three deep
        spec = tmp_path / "whole-node.yaml"
        spec.write_text(yaml.safe_dump({"name": "whole-node", "tenant": "acme", "queue": "default", "type": "batch",
                                        "resources": {"gpu": 8, "cpu": 8, "memory": "32Gi"},
                                        "maxRuntime": "10m", "sim": {"duration": "3s"}}))
        procs = [subprocess.Popen([sys.executable, "-m", "gpufleet.cli", "submit", str(spec), "--json", "--yes",
                                   "--data-dir", str(data)], stdout=subprocess.PIPE, text=True) for _ in range(6)]
        ids = {json.loads(p.communicate(timeout=60)[0])["job_id"] for p in procs}  # all six at once
        assert len(ids) == 6
        wait_jobs(data, ids, "succeeded", timeout_s=90)

        other = yaml.safe_load((data / "cluster.yaml").read_text()) or {}
        other["nodes"] = [{"shape": "h100x8", "count": 1, "prefix": "one"}]  # half the cluster
        what_if = tmp_path / "one-node.yaml"
        what_if.write_text(yaml.safe_dump(other))
        doc = json.loads(cli(data, "replay", "--what-if", str(what_if), "--json", timeout=300).stdout)
        text = cli(data, "replay", "--what-if", str(what_if), timeout=300).stdout
    finally:
        subprocess.run([sys.executable, "-m", "gpufleet.cli", "down", "--data-dir", str(data)],
                       capture_output=True, timeout=120)

    logged, recorded, half = doc["logged"], doc["recorded"], doc["what_if"]
    assert logged["jobs"] == {"succeeded": 6} and recorded["jobs"] == {"succeeded": 6}
    assert half["jobs"] == {"succeeded": 6} and doc["jobs_compared"] == 6
    for figures in (logged, recorded, half):
        assert figures["never_ran"] == 0 and figures["preemptions"] == 0
        assert len(figures["gpu_allocation_curve"]) == 20
        assert all(0 <= v <= 100 for v in figures["gpu_allocation_curve"])
    # the queue was real: two started at once, the others waited about one and two runs of 3 s
    assert logged["wait_p95_s"] > 4 and 1.5 < logged["wait_mean_s"] < 6, logged
    # the recorded config, replayed on the simulated clock, waits as the mesh did (the cores'
    # 1 s grain and the real mesh's latency apart)
    assert abs(recorded["wait_mean_s"] - logged["wait_mean_s"]) < 2.5, (recorded, logged)
    assert recorded["gpu_allocation_pct"] > 0 and logged["gpu_allocation_pct"] > 0
    # half the GPUs: each job waits behind more of the others
    assert half["wait_mean_s"] > recorded["wait_mean_s"] + 2 and doc["delta"]["wait_mean_s"] > 2
    assert doc["finished_later"] >= 3
    assert "as logged" in text and "wait mean (s)" in text and "never ran" in text
