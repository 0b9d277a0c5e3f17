"""Autoscaling through the CLI, as an operator runs it against the embedded stack (`gpufleet up`
with a node pool in the cluster config): an inference service driven with `gpufleet report-load`,
its replicas and status in `gpufleet jobs`, and `gpufleet pools` while a pool grows for a job of a
GPU model no registered node has. Real processes, nats-server and PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .test_mesh_cli import EXAMPLES, cli, jobs

pytestmark = pytest.mark.slow

CONFIG = """\
nodePools:
  h200:
    provider: sim
    shape: {gpuModel: H200, gpus: 8, cpu: 64, memory: 512Gi}
    min: 0
    max: 1
    provisionDelay: 1s
    scaleUpAfter: 2s
    scaleDownAfter: 10m
"""


@pytest.fixture
def pooled(tmp_path: Path) -> Iterator[Path]:
    config = tmp_path / "cluster.yaml"
    config.write_text(CONFIG)
    data_dir = tmp_path / "mesh"
    cli(data_dir, "up", "--detach", "--sim-nodes", "2", "--config", str(config))  # an H100 and an A100 node
    try:
        yield data_dir
    finally:
        subprocess.run([sys.executable, "-m", "gpufleet.cli", "down", "--data-dir", str(data_dir)],
                       capture_output=True, timeout=120)


def until(what: str, check: Callable[[], Any], timeout_s: float = 60, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)


def rows(data_dir: Path) -> dict[str, dict[str, Any]]:
    return {r["job_id"]: r for r in jobs(data_dir)}


def test_report_load_scales_a_service_and_pools_shows_a_pool_growing(pooled: Path, tmp_path: Path) -> None:
    assert json.loads(cli(pooled, "pools", "--json").stdout) == [{
        "pool": "h200", "configured": True, "provider": "sim",
        "shape": {"gpuModel": "H200", "gpus": 8, "gpuMemory": 80 * 1024, "cpu": 64_000, "memory": 512 * 1024,
                  "nvlinkIslands": 1, "labels": {}, "taints": []},
        "min": 0, "max": 1, "ready": 0, "provisioning": 0, "draining": 0, "removing": 0, "given_up": 0,
        "cordoned": 0, "lost": 0, "nodes": [], "last_decision": None}]

    svc = json.loads(cli(pooled, "submit", str(EXAMPLES / "inference-service.yaml"), "--yes", "--json").stdout)["job_id"]

    def serving(n: int) -> bool:
        r = rows(pooled)
        replicas = [j for j in r.values() if j["job_id"].startswith(f"{svc}-r") and j["status"] == "running"]
        return r.get(svc, {}).get("status") == "serving" and r[svc]["replicas"] == n and len(replicas) == n
    until("the service's first replica", lambda: serving(1))

    def load() -> bool:  # as a load balancer does: every few seconds (the first step waits out scaleUpCooldown)
        out = cli(pooled, "report-load", svc, "--rps", "120", "--p99-ms", "180", "--window", "30s", "--json")
        doc = json.loads(out.stdout)
        assert (doc["tenant"], doc["rps"], doc["p99_ms"], doc["window_s"]) == ("acme", 120.0, 180.0, 30.0)
        return serving(3)
    until("3 replicas for 120 req/s at 40 per replica", load, timeout_s=60, every_s=2)
    assert "serving" in cli(pooled, "jobs").stdout
    text = cli(pooled, "report-load", svc, "--rps", "120").stdout
    assert text.startswith(f"load reported for {svc} (acme): 120 req/s")

    bad = cli(pooled, "report-load", svc, "--rps", "-1", check=False)
    assert bad.returncode == 2 and "rps" in bad.stderr
    assert cli(pooled, "report-load", svc, "--rps", "1", "--window", "soon", check=False).returncode == 2
    unknown = cli(pooled, "report-load", "no-such-job", "--rps", "1", check=False)
    assert unknown.returncode == 1 and "no job no-such-job" in unknown.stderr
    replica = f"{svc}-r0"
    not_a_service = cli(pooled, "report-load", replica, "--rps", "1", check=False)
    assert not_a_service.returncode == 1 and "not an inference service" in not_a_service.stderr

    # a job only the pool's shape can hold: admitted, waits, the pool grows, it runs there
    spec = tmp_path / "h200.yaml"
    spec.write_text("name: big\ntenant: acme\nresources: {gpu: 8, gpuModel: H200, cpu: 8, memory: 64Gi}\n"
                    "sim: {duration: 1h}\n")
    big = json.loads(cli(pooled, "submit", str(spec), "--yes", "--json").stdout)["job_id"]
    row = until("the H200 job to run", lambda: (r := rows(pooled).get(big)) and r["status"] == "running" and r)
    assert row["node_ids"] == ["h200-0000"]
    [pool] = json.loads(cli(pooled, "pools", "--json").stdout)
    assert (pool["ready"], pool["provisioning"], pool["draining"]) == (1, 0, 0)
    assert pool["nodes"] == [{"node_id": "h200-0000", "state": "ready"}]
    last = pool["last_decision"]
    assert last["type"] == "node.provision_requested" and last["node_id"] == "h200-0000"
    assert big in last["reason"] and "0 -> 1" in last["reason"]
    table = cli(pooled, "pools").stdout.splitlines()
    assert table[0].split()[:7] == ["POOL", "SHAPE", "READY", "PROV", "DRAIN", "MIN", "MAX"]
    assert table[1].split()[:7] == ["h200", "H200x8", "1", "0", "0", "0", "1"] and "provision_requested" in table[1]
