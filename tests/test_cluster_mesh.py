"""The distributed shape on one machine: `gpufleet up --nats-cluster 3` runs a three-server
JetStream cluster on loopback with FLEET at R3, every service in its own process; jobs run, and
go on running when the stream's leader is killed (the supervisor restarts it and it rejoins)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from .test_mesh_cli import cli, wait_jobs

pytestmark = pytest.mark.slow


def _submit(d: Path, spec: Path, n: int) -> set[str]:
    return {json.loads(cli(d, "submit", str(spec), "--json", "--yes").stdout)["job_id"] for _ in range(n)}


async def _stream_leader(d: Path) -> tuple[str, int]:
    from gpufleet.sdk import Fleet
    from gpufleet.shared.contract.events import STREAM

    fleet = await Fleet.connect(data_dir=str(d))
    try:
        info = await fleet.bus.js.stream_info(STREAM)
        assert info.cluster is not None and info.cluster.leader
        return str(info.cluster.leader), int(info.config.num_replicas or 1)
    finally:
        await fleet.close()


def test_a_three_node_cluster_runs_jobs_through_the_loss_of_the_streams_leader(tmp_path: Path) -> None:
    d = tmp_path / "c"
    cli(d, "up", "--detach", "--nats-cluster", "3", "--layout", "separate", "--sim-nodes", "2", "--no-postgres",
        timeout=180)
    try:
        st = json.loads(cli(d, "status", "--json").stdout)
        assert {"nats", "nats-2", "nats-3"} <= set(st["parts"]) and all(p["alive"] for p in st["parts"].values())
        assert st["nats_url"].count(",") == 2
        spec = tmp_path / "j.yaml"
        spec.write_text("name: tiny\ntenant: acme\nresources: {gpu: 1}\nsim: {duration: 1s}\n")
        ids = _submit(d, spec, 3)
        wait_jobs(d, ids, "succeeded", timeout_s=90)

        leader, replicas = asyncio.run(_stream_leader(d))
        assert replicas == 3
        parts = json.loads((d / "mesh.json").read_text())["parts"]
        victim = next(name for name, p in parts.items()
                      if p.get("server_name", "nats-1" if name == "nats" else None) == leader)
        os.kill(int(parts[victim]["pid"]), signal.SIGKILL)  # the stream's leader, mid-run
        more = _submit(d, spec, 3)
        wait_jobs(d, ids | more, "succeeded", timeout_s=120)

        deadline = time.monotonic() + 60
        while True:  # the supervisor started it again, on its port and store: it rejoins
            st = json.loads(cli(d, "status", "--json").stdout)
            if st["parts"][victim]["alive"] and st["parts"][victim]["restarts"] >= 1:
                break
            assert time.monotonic() < deadline, st["parts"][victim]
            time.sleep(0.5)
        audit = json.loads(cli(d, "audit", "--json", "--full", check=False).stdout)
        assert audit["ok"], audit
    finally:
        cli(d, "down", check=False, timeout=120)


def test_two_instances_of_every_service_on_the_cluster_lose_nothing_when_one_of_each_kind_dies(tmp_path: Path) -> None:
    """`--instances 2`: a leased service's active instance and one placer killed mid-run; the
    standby takes over, the other placer goes on: every job ends once, the audit passes."""
    d = tmp_path / "c2"
    cli(d, "up", "--detach", "--nats-cluster", "3", "--layout", "separate", "--instances", "2", "--sim-nodes", "2",
        "--no-postgres", timeout=180)
    try:
        parts = json.loads((d / "mesh.json").read_text())["parts"]
        for svc in ("admission", "quota", "guardian", "billing", "autoscaler", "placer", "telemetry"):
            assert f"{svc}@1" in parts, sorted(parts)
        assert "executor@1" not in parts  # one agent per node
        spec = tmp_path / "j.yaml"
        spec.write_text("name: tiny\ntenant: acme\nresources: {gpu: 1}\nsim: {duration: 1s}\n")
        ids = _submit(d, spec, 3)
        wait_jobs(d, ids, "succeeded", timeout_s=90)
        holder = asyncio.run(_lease_holder(d, "admission"))
        victim = "admission" if holder.endswith("/0") else "admission@1"
        os.kill(int(parts[victim]["pid"]), signal.SIGKILL)
        os.kill(int(parts["placer"]["pid"]), signal.SIGKILL)
        more = _submit(d, spec, 4)
        rows = wait_jobs(d, ids | more, "succeeded", timeout_s=120)
        assert len(rows) == len(ids | more)
        audit = json.loads(cli(d, "audit", "--json", "--full", check=False).stdout)
        assert audit["ok"], audit
    finally:
        cli(d, "down", check=False, timeout=120)


async def _lease_holder(d: Path, svc: str) -> str:
    from gpufleet.sdk import Fleet
    from gpufleet.shared.runtime.lease import BUCKET

    fleet = await Fleet.connect(data_dir=str(d))
    try:
        kv = await fleet.bus.js.key_value(BUCKET)
        entry = await kv.get(svc)
        return (entry.value or b"").decode()
    finally:
        await fleet.close()

