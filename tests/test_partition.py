"""A real network partition of the 3-node cluster: `gpufleet up --nats-cluster 3 --nats-netns`
runs each nats-server in a network namespace of its own (shared/embedded/netns.py), and a cut is a
pair of blackhole routes between two of them, while the clients on the host still reach every
server. The stream's leader cut from the other two is the case that hurts: the others elect a new
leader, and the clients connected to the old one keep a connection that answers pings and nothing
else. The bus moves them (shared/runtime/bus.py watch_server): jobs go on being submitted, placed
and run while the cut lasts, the old leader catches up once it is healed, the audit passes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import pytest

from gpufleet.shared.embedded import netns

from .test_cluster_mesh import _stream_leader, _submit
from .test_mesh_cli import cli
from .test_mesh_cli import wait_jobs as _wait_jobs

WHY_NOT = netns.available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}")]


async def _replicas_current(d: Path) -> dict[str, bool]:
    """Each follower of FLEET, as its leader sees it: caught up (current, no lag) or not."""
    from gpufleet.sdk import Fleet
    from gpufleet.shared.contract.events import STREAM

    fleet = await Fleet.connect(data_dir=str(d))
    try:
        info = await asyncio.wait_for(fleet.bus.js.stream_info(STREAM), 15)
        assert info.cluster is not None
        return {str(r.name): bool(r.current) and not r.lag for r in info.cluster.replicas or []}
    finally:
        await asyncio.wait_for(fleet.close(), 15)


async def _submit_through(d: Path, first: str, urls: str) -> tuple[str, int]:
    """Submit with a client whose first server is `first` (the pool in the given order): the job id
    and how often its bus moved to another server."""
    from gpufleet.sdk import Fleet
    from gpufleet.shared.runtime.bus import Bus

    order = ",".join([first, *(u for u in urls.split(",") if u != first)])
    bus = await Bus.connect(order, creds=d / "creds" / "admin.creds", dont_randomize=True)
    try:
        assert bus.nc.connected_url is not None and bus.nc.connected_url.netloc in first
        job_id = await Fleet(bus).submit({"name": "pinned", "tenant": "acme", "resources": {"gpu": 1},
                                          "sim": {"duration": "1s"}})
        return job_id, bus.failovers
    finally:
        await bus.close()


def wait_jobs(d: Path, ids: set[str], status: str, timeout_s: float) -> None:
    """`wait_jobs`, asking again while a `jobs` of the log is told "JetStream does not answer"
    (its client on the cut server, the stream electing): the jobs must still all reach `status`
    within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _wait_jobs(d, ids, status, timeout_s=max(1.0, deadline - time.monotonic()))
            return
        except AssertionError as exc:
            if "JetStream does not answer" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_the_streams_leader_cut_off_from_the_cluster_stops_nothing(tmp_path: Path) -> None:
    d = tmp_path / "p"
    cli(d, "up", "--detach", "--nats-cluster", "3", "--nats-netns", "--layout", "separate", "--sim-nodes", "2",
        "--no-postgres", timeout=180)
    doc = json.loads((d / "mesh.json").read_text())
    lab = netns.NetLab.attach(doc["netns"])
    try:
        assert all(a.startswith("nats://198.1") for a in doc["nats_url"].split(",")), doc["nats_url"]
        spec = tmp_path / "j.yaml"
        spec.write_text("name: tiny\ntenant: acme\nresources: {gpu: 1}\nsim: {duration: 1s}\n")
        ids = _submit(d, spec, 2)
        wait_jobs(d, ids, "succeeded", timeout_s=90)

        leader, _ = asyncio.run(_stream_leader(d))
        k = int(leader.split("-")[1])
        lab.isolate(k)
        cut_at = time.monotonic()
        # every submit is acknowledged, each within seconds, whichever server its client lands on
        during: set[str] = set()
        for _ in range(5):
            t = time.monotonic()
            during |= _submit(d, spec, 1)
            assert time.monotonic() - t < 25
        wait_jobs(d, ids | during, "succeeded", timeout_s=90)
        deadline = time.monotonic() + 30
        while True:  # a client on the cut server hears "no leader", or itself, from it until it moves: ask again
            try:
                new_leader = asyncio.run(_stream_leader(d))[0]
            except AssertionError:
                new_leader = None
            if new_leader not in (None, leader):
                break
            assert time.monotonic() < deadline, f"no new leader after the cut (still {new_leader})"
            time.sleep(0.5)
        # the jobs ran while the cut lasted (nothing here has healed it yet)
        assert lab.cuts and time.monotonic() - cut_at > 0
        # a client that lands on the cut server (listed first, never shuffled) moves and is acknowledged
        pinned_id, failovers = asyncio.run(_submit_through(d, doc["nats_url"].split(",")[k - 1], doc["nats_url"]))
        during.add(pinned_id)
        assert failovers >= 1
        wait_jobs(d, ids | during, "succeeded", timeout_s=90)

        lab.heal()
        deadline = time.monotonic() + 60
        while True:  # the old leader rejoins as a follower and catches up from the new one
            try:
                followers = asyncio.run(_replicas_current(d))
                if len(followers) == 2 and all(followers.values()):
                    break
            except Exception:  # noqa: BLE001 - the cluster may still be settling
                followers = {}
            assert time.monotonic() < deadline, f"the healed node did not catch up: {followers}"
            time.sleep(0.5)
        more = _submit(d, spec, 2)
        wait_jobs(d, ids | during | more, "succeeded", timeout_s=90)
        deadline = time.monotonic() + 30
        while True:  # the audit says so and exits 1 while JetStream does not answer (still settling): again
            run = cli(d, "audit", "--json", "--full", check=False)
            if run.stdout.strip():
                break
            assert "JetStream does not answer" in run.stderr and time.monotonic() < deadline, run.stderr
            time.sleep(0.5)
        audit = json.loads(run.stdout)
        assert audit["ok"], audit
        ended = json.loads(cli(d, "jobs", "--json", "--limit", "0").stdout)
        assert sorted(j["job_id"] for j in ended) == sorted(ids | during | more)
    finally:
        lab.heal()
        cli(d, "down", check=False, timeout=120)
    # down removed the namespaces and the bridge
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert lab.ns(1) not in left and lab.ns(2) not in left


def test_a_lab_cuts_and_heals_between_two_namespaces_only() -> None:
    """The cut drops what goes between the two nodes, either way, and nothing else."""
    import sys

    lab = netns.NetLab(3).create()
    srv = None
    try:
        srv = subprocess.Popen(lab.argv(2, [sys.executable, "-c", (
            "import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
            f"s.bind(('{lab.addr(2)}',8099));s.listen(16)\n"
            "while True: s.accept()[0].close()")]))

        def reach(i: int | None) -> bool:
            code = f"import socket;socket.create_connection(('{lab.addr(2)}',8099),timeout=1)"
            argv = [sys.executable, "-c", code]
            return subprocess.run(lab.argv(i, argv) if i else argv, capture_output=True).returncode == 0

        deadline = time.monotonic() + 10
        while not reach(None):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert reach(1) and reach(3)
        lab.cut(1, 2)
        assert not reach(1) and reach(3) and reach(None)
        netns.NetLab.attach({"owner": lab.owner, "n": 3, "net": str(lab.net)}).heal()  # from another handle
        assert reach(1)
    finally:
        if srv is not None:
            srv.kill()
            srv.wait()
        lab.destroy()
    assert lab.ns(1) not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
