"""Faults injected by hand on a real nats-server that the test stops and starts again (same port,
same store, the generated authorization): what the services do when NATS goes away and comes
back (issue: the distributed mode under faults)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.guardian.core import GuardianCore
from gpufleet.services.placer.core import PlacerCore
from gpufleet.services.quota.core import QuotaCore
from gpufleet.shared.embedded.procs import free_port, start_nats, stop_process
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.trust.authz import ADMIN, Realm, nats_config, write_nats_config

from .builders import node as node_event
from .helpers import read_log, running, submit_cmd, wait_until
from .test_telemetry import RULES, executor, node, spec, telemetry, wait_for_type


class Server:
    """A nats-server that can go away and come back on the same port with the same store."""

    def __init__(self, d: Path, realm: Realm) -> None:
        self.port = free_port()
        self.d = d
        self.conf = write_nats_config(d / "nats.conf", nats_config(d / "nats", self.port, realm))
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: Any = None
        self.start()

    def start(self) -> None:
        self.proc = start_nats(self.d / "nats", self.port, config=self.conf, log_file=self.d / "nats.log")

    def stop(self) -> None:
        stop_process(self.proc)


async def _jetstream_ready(bus: Bus) -> bool:
    try:
        await asyncio.wait_for(bus.js.stream_info("FLEET"), 2)
        return True
    except Exception:  # noqa: BLE001 - not yet
        return False


@pytest.fixture
def server(tmp_path: Path, realm: Realm, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    monkeypatch.setenv("GPUFLEET_CREDS", str(realm.creds_path(ADMIN)))
    monkeypatch.setenv("GPUFLEET_TEST_REALM", str(realm.dir))
    s = Server(tmp_path, realm)
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.slow
async def test_a_nats_outage_longer_than_the_lease_loses_no_node(server: Server) -> None:
    """Telemetry cut off from NATS hears no heartbeat from anyone; that is not every node lost.
    After the outage (3 leases long) each node gets a full lease again, and the running job runs on."""
    admin = await Bus.connect(server.url, name="test")
    await admin.ensure_streams()
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(running(server.url, [AdmissionCore(), QuotaCore(), PlacerCore(),
                                                             GuardianCore()]))
        await stack.enter_async_context(executor(server.url, {"a": node("a"), "b": node("b")}, "0"))
        tel = await stack.enter_async_context(telemetry(server.url))
        job = submit_cmd(spec(gpu=1, duration="10m"))
        await admin.publish(job)
        await wait_for_type(admin, "job.started", job.job_id)

        server.stop()
        down_at = time.monotonic()
        await wait_until(lambda: tel._blind, timeout_s=10)  # it knows it is cut off
        await wait_until(lambda: time.monotonic() - down_at > 3 * RULES.lease_s, timeout_s=10)
        server.start()
        # heard again: every node's heartbeat reaches it after the reconnect
        up_at = time.time()
        await wait_until(lambda: not tel._blind and all(tel.last_seen.get(n, 0) > up_at for n in ("a", "b")),
                         timeout_s=30)
        # it had every chance to decide: checks for two more leases after hearing them
        checks = tel.lease_checks
        await wait_until(lambda: tel.lease_checks >= checks + int(2 * RULES.lease_s / 0.1), timeout_s=20)
        log = [e for _, e in await read_log(admin)]
        assert not [e for e in log if e.type == "node.lost"]
        assert not [e for e in log if e.type == "job.exited"], "the healthy job was stopped"
    await admin.close()


@pytest.mark.slow
async def test_the_ledger_reads_on_after_nats_restarts(server: Server, pg: Any) -> None:
    """Its reader is a memory-stored consumer, which a server restart deletes; the fetch then
    fails with 'service unavailable'. It must make a new one and bill what came after."""
    from gpufleet.shared.contract.clusterconfig import parse_config

    from .test_billing_mesh import caught_up, job_events, ledger_lines, publish, run_ledger

    config = parse_config({"prices": {"currency": "USD", "gpuHour": {"H100": "2"}}})
    admin = await Bus.connect(server.url, name="test")
    await admin.ensure_streams()
    await publish(admin, [node_event("n1")])
    await publish(admin, job_events("j1", 0, timedelta(0)))
    ledger, task = await run_ledger(admin, pg.dsn, config)
    try:
        await wait_until(lambda: caught_up(ledger, admin), timeout_s=30)
        assert len(await ledger_lines(pg.dsn)) > 0
        before = len(await ledger_lines(pg.dsn))
        server.stop()
        server.start()
        await wait_until(lambda: _jetstream_ready(admin), timeout_s=30)
        await publish(admin, job_events("j2", 1, timedelta(hours=2)))
        await wait_until(lambda: caught_up(ledger, admin), timeout_s=30)
        assert len(await ledger_lines(pg.dsn)) > before  # j2 billed: it read on
    finally:
        ledger.stop()
        await task
        await admin.close()


async def test_a_client_whose_server_does_not_answer_says_so_within_seconds(tmp_path: Path) -> None:
    """A port that accepts and never speaks (a stopped nats-server) and a closed one: the SDK (and
    so every client command) fails within its deadline, naming the server, without a traceback."""
    from gpufleet.sdk import CONNECT_DEADLINE_S, Fleet
    from gpufleet.shared.contract.errors import MeshNotRunning

    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    for url in (f"nats://127.0.0.1:{port}", f"nats://127.0.0.1:{free_port()}"):
        t0 = time.monotonic()
        with pytest.raises(MeshNotRunning, match="does not answer"):
            await Fleet.connect(nats_url=url, data_dir=str(tmp_path))
        assert time.monotonic() - t0 < CONNECT_DEADLINE_S + 2
    silent.close()


async def test_a_service_started_before_the_streams_waits_for_them(server: Server, realm: Realm,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A service may not create streams (only the admin may): started first, it waits and says
    so, and starts once the admin has created them."""
    import logging

    from gpufleet.shared.runtime.loop import ServiceRuntime

    bus = await Bus.connect(server.url, name="admission", creds=realm.creds_path("svc-admission"))
    rt: ServiceRuntime[Any] = ServiceRuntime(AdmissionCore(), bus)
    caplog.set_level(logging.WARNING, logger="gpufleet.shared.runtime.bus")
    task = asyncio.create_task(rt.start())
    await wait_until(lambda: any("waiting for stream FLEET" in r.getMessage() for r in caplog.records), timeout_s=20)
    assert not task.done()
    admin = await Bus.connect(server.url, name="test", creds=realm.creds_path(ADMIN))
    await admin.ensure_streams()
    await asyncio.wait_for(task, 20)
    assert rt.applied_seq == 0 and bus.nc.is_connected
    await bus.close()
    await admin.close()
