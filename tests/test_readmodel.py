"""The PostgreSQL read model against a real nats-server and a real PostgreSQL.

The reference is always `ClusterView` folded directly from the same events: the rows in
PostgreSQL must be exactly its `as_json()`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import nats
import pytest

from gpufleet.shared.contract.events import (
    STREAM,
    Envelope,
    GpuDevice,
    JobAdmitted,
    JobPlaced,
    JobRejected,
    JobScaled,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    NodeCordoned,
    NodeDeregistered,
    NodeInventory,
    NodeRegistered,
    Reason,
    ReplicaAllocation,
)
from gpufleet.shared.contract.ids import ulid
from gpufleet.shared.contract.spec import parse_spec
from gpufleet.shared.embedded.pg import EmbeddedPostgres, PostgresError
from gpufleet.shared.read.readmodel import JOB_COLUMNS, NODE_COLUMNS, Projector, ReadModel
from gpufleet.shared.read.view import ClusterView, JobRow, NodeRow, apply
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.trust.authz import owner_actor

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


class Events:
    """Envelopes with distinct ids and microsecond timestamps (the ISO strings must survive)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, payload: object, tenant: str = "acme") -> Envelope:
        self.n += 1
        at = T0 + timedelta(seconds=self.n, microseconds=123_457 * self.n % 1_000_000)
        return Envelope(
            event_id=ulid(int(at.timestamp() * 1000), self.n.to_bytes(10, "big")),
            type=payload.type,  # type: ignore[attr-defined]
            occurred_at=at, tenant=tenant, actor=owner_actor(payload.type), payload=payload,  # type: ignore[arg-type]
        )

    def node(self, node_id: str, gpus: int = 8, model: str = "H100") -> Envelope:
        inv = NodeInventory(
            cpu_milli=64_000, memory_mib=512 * 1024,
            gpus=tuple(GpuDevice(index=i, uuid=f"GPU-{node_id}-{i}", model=model, memory_mib=81_559)
                       for i in range(gpus)),
        )
        return self(NodeRegistered(node_id=node_id, inventory=inv), tenant="sys")

    def submit(self, job_id: str, gpu: int = 2, replicas: int = 2, priority: int = 10) -> Envelope:
        spec = parse_spec({"name": f"train-{job_id}", "tenant": "acme", "queue": "research", "type": "training",
                           "priority": priority, "replicas": replicas, "resources": {"gpu": gpu, "cpu": 4}})
        return self(JobSubmitted(job_id=job_id, spec=spec))

    def place(self, job_id: str, node_id: str, first_gpu: int, replicas: int = 2, gpu: int = 2) -> Envelope:
        allocs = tuple(
            ReplicaAllocation(replica=r, node_id=node_id,
                              gpu_indices=tuple(range(first_gpu + r * gpu, first_gpu + (r + 1) * gpu)),
                              cpu_milli=4000, memory_mib=1024)
            for r in range(replicas)
        )
        return self(JobPlaced(job_id=job_id, allocations=allocs))


def scenario_part1(ev: Events) -> list[Envelope]:
    """Two nodes, a job that will finish, a job that stays placed, a rejected job."""
    return [
        ev.node("node-a"),
        ev.node("node-b", gpus=4, model="A100"),
        ev.submit("job-1"),
        ev.submit("job-2", priority=50),
        ev(JobAdmitted(job_id="job-1")),
        ev(JobAdmitted(job_id="job-2")),
        ev.place("job-1", "node-a", 0),
        ev.place("job-2", "node-a", 4),
        ev(JobStarted(job_id="job-1", node_id="node-a")),
        ev.submit("job-3"),
        ev(JobRejected(job_id="job-3", reasons=(Reason(code="quota", message="over the GPU limit",
                                                       field="resources.gpu"),))),
    ]


def scenario_part2(ev: Events) -> list[Envelope]:
    """job-1 ends (its GPUs are released), a new job lands on node-b, node-a is cordoned."""
    return [
        ev(JobSucceeded(job_id="job-1")),
        ev.submit("job-4", gpu=1, replicas=2),
        ev(JobAdmitted(job_id="job-4")),
        ev.place("job-4", "node-b", 0, gpu=1),
        ev(NodeCordoned(node_id="node-a", reason="maintenance"), tenant="sys"),
    ]


def fold(items: list[tuple[int, Envelope]]) -> ClusterView:
    view = ClusterView()
    for seq, env in items:
        apply(view, env, seq)
    return view


async def publish(bus: Bus, envs: list[Envelope]) -> list[tuple[int, Envelope]]:
    return [(await bus.publish(env), env) for env in envs]


async def wait_until(pred: Callable[[], Awaitable[bool]], timeout_s: float = 10.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


async def stop_projector(projector: Projector, task: asyncio.Task[None]) -> None:
    projector.stop()
    await asyncio.wait_for(task, timeout=10)


# -------------------------------------------------------------------- the server


def test_embedded_postgres_lifecycle(pg_dir: Path) -> None:
    from gpufleet.shared.embedded.procs import free_port

    server = EmbeddedPostgres(pg_dir / "data", free_port(), fsync=False)
    assert not server.is_running()
    server.init()
    server.init()  # idempotent
    assert (pg_dir / "data" / "PG_VERSION").exists()
    server.start()
    try:
        pid = server.running_pid()
        assert pid is not None and server.is_running()
        server.start()  # already running: no-op, same server
        assert server.running_pid() == pid
        assert server.dsn == f"postgresql://gpufleet@127.0.0.1:{server.port}/gpufleet"

        async def write_then_read() -> list[str]:
            conn = await asyncpg.connect(server.dsn)
            try:
                await conn.execute("CREATE TABLE IF NOT EXISTS t (x text)")
                await conn.execute("INSERT INTO t VALUES ('kept')")
                return [r["x"] for r in await conn.fetch("SELECT x FROM t")]
            finally:
                await conn.close()

        assert asyncio.run(write_then_read()) == ["kept"]
        server.stop()
        assert not server.is_running()
        server.stop()  # stopped: no-op
        server.start()
        assert server.is_running() and server.running_pid() != pid

        async def read() -> list[str]:
            conn = await asyncpg.connect(server.dsn)
            try:
                return [r["x"] for r in await conn.fetch("SELECT x FROM t")]
            finally:
                await conn.close()

        # the same data dir, the same database: the row outlived the restart (and no duplicate insert)
        assert asyncio.run(read()) == ["kept"]
    finally:
        server.stop()
    assert not server.is_running()

    junk = pg_dir / "junk"
    junk.mkdir()
    (junk / "file").write_text("x")
    with pytest.raises(PostgresError):
        EmbeddedPostgres(junk, free_port()).init()


# -------------------------------------------------------------------- the read model


async def test_schema_columns_are_the_row_fields(pg_pool: asyncpg.Pool) -> None:
    rm = ReadModel(pg_pool)
    await rm.ensure_schema()
    await rm.ensure_schema()  # idempotent
    for table, cls in (("jobs", JobRow), ("nodes", NodeRow)):
        rows = await pg_pool.fetch(
            "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = $1"
            " ORDER BY ordinal_position", table)
        assert [r["column_name"] for r in rows] == [f.name for f in dataclasses.fields(cls)]
        types = {r["column_name"]: r["data_type"] for r in rows}
        for f in dataclasses.fields(cls):
            want = {"str": "text", "int": "bigint", "list[str]": "ARRAY"}[str(f.type)]
            assert types[f.name] == want, (table, f.name)
    assert JOB_COLUMNS == tuple(f.name for f in dataclasses.fields(JobRow))
    assert NODE_COLUMNS == tuple(f.name for f in dataclasses.fields(NodeRow))
    assert await rm.offset() == 0
    assert await rm.jobs() == [] and await rm.nodes() == []


async def test_apply_batch_is_idempotent_and_reload_continues_the_fold(pg_pool: asyncpg.Pool) -> None:
    ev = Events()
    part1 = [(i + 1, e) for i, e in enumerate(scenario_part1(ev))]
    part2 = [(len(part1) + i + 1, e) for i, e in enumerate(scenario_part2(ev))]

    rm = ReadModel(pg_pool)
    await rm.ensure_schema()
    await rm.load()
    assert await rm.apply_batch(part1) == len(part1)
    want1 = fold(part1).as_json()
    got1 = await rm.as_json()
    assert got1 == want1
    assert await rm.offset() == len(part1)
    # a non-trivial state: job-1 and job-2 each hold 4 GPUs on node-a
    node_a = next(n for n in got1["nodes"] if n["node_id"] == "node-a")
    assert node_a["gpus_allocated"] == 8 and node_a["running_jobs"] == ["job-1", "job-2"]
    assert {j["job_id"]: j["status"] for j in got1["jobs"]} == {"job-1": "running", "job-2": "placed",
                                                                "job-3": "rejected"}
    assert next(j for j in got1["jobs"] if j["job_id"] == "job-1")["submitted_at"] == part1[2][1].occurred_at.isoformat()

    # the same batch again, through the same model and through a freshly loaded one: nothing changes
    assert await rm.apply_batch(part1) == 0
    assert await rm.as_json() == want1
    rm2 = ReadModel(pg_pool)
    loaded = await rm2.load()
    assert loaded == fold(part1)  # rows, offset and the GPU allocations: the fold continues exactly
    assert await rm2.apply_batch(part1[3:]) == 0
    assert await rm2.as_json() == want1

    # continue from the loaded view, with an overlapping batch: only the new events count
    assert await rm2.apply_batch(part1[-3:] + part2) == len(part2)
    want2 = fold(part1 + part2).as_json()
    got2 = await rm2.as_json()
    assert got2 == want2
    node_a = next(n for n in got2["nodes"] if n["node_id"] == "node-a")
    assert node_a["gpus_allocated"] == 4 and node_a["running_jobs"] == ["job-2"] and node_a["status"] == "cordoned"

    # rm's view is stale now (rm2 moved the offset): it notices, reloads, and applies only what is new
    part3 = [(len(part1) + len(part2) + 1, ev(JobSucceeded(job_id="job-2")))]
    assert await rm.apply_batch(part2 + part3) == 1
    assert await rm.as_json() == fold(part1 + part2 + part3).as_json()
    assert (await rm.job("job-2") or {})["status"] == "succeeded"
    assert next(n for n in await rm.nodes() if n["node_id"] == "node-a")["gpus_allocated"] == 0


async def test_a_removed_node_leaves_the_tables_and_a_service_shows_serving(pg_pool: asyncpg.Pool) -> None:
    ev = Events()
    svc = parse_spec({"name": "chat", "tenant": "acme", "type": "inference", "resources": {"gpu": 1},
                      "autoscale": {"maxReplicas": 4, "targetRpsPerReplica": 40}})
    items = list(enumerate([
        ev.node("pool-0000"), ev.node("node-b", gpus=4, model="A100"),
        ev(JobSubmitted(job_id="svc", spec=svc)), ev(JobAdmitted(job_id="svc")),
        ev(JobScaled(job_id="svc", from_replicas=0, to_replicas=2, reason=Reason(code="initial", message="min 2"))),
        ev(NodeCordoned(node_id="pool-0000", reason="autoscaler: idle"), tenant="sys"),
        ev(NodeDeregistered(node_id="pool-0000"), tenant="sys"),
    ], start=1))
    rm = ReadModel(pg_pool)
    await rm.ensure_schema()
    await rm.load()
    await rm.apply_batch(items[:5])
    assert {n["node_id"] for n in await rm.nodes()} == {"pool-0000", "node-b"}
    await rm.apply_batch(items[5:])
    got = await rm.as_json()
    assert got == fold(items).as_json()
    assert [n["node_id"] for n in got["nodes"]] == ["node-b"]  # the row went with the node
    row = await rm.job("svc") or {}
    assert (row["status"], row["replicas"]) == ("serving", 2)
    assert await ReadModel(pg_pool).load() == fold(items)  # and a reload continues the fold exactly


# -------------------------------------------------------------------- the projector


async def test_projector_matches_the_fold(bus: Bus, pg: EmbeddedPostgres) -> None:
    ev = Events()
    published = await publish(bus, scenario_part1(ev))
    junk = await bus.js.publish("fleet.evt.acme.job.job-x.submitted", b"{not an envelope")
    published += await publish(bus, scenario_part2(ev))
    head = published[-1][0]
    assert junk.seq < head

    projector = Projector(bus, pg.dsn, batch=4, fetch_timeout_s=0.2)  # small batches: several commits
    task = asyncio.create_task(projector.run())
    pool = await asyncpg.create_pool(pg.dsn, min_size=1, max_size=2)
    try:
        rm = ReadModel(pool)

        async def caught_up() -> bool:
            return projector.stats.offset >= head and await rm.offset() == head

        await wait_until(caught_up, what="the projection to reach the stream head")
        want = fold(published).as_json()
        assert await rm.jobs() == want["jobs"]
        assert await rm.nodes() == want["nodes"]
        assert {j["status"] for j in want["jobs"]} >= {"succeeded", "placed", "rejected"}
        assert projector.stats.unparsable == 1
        assert projector.stats.applied == len(published)
        assert projector.stats.batches >= 4
        info = await bus.js.consumer_info(STREAM, "readmodel")
        assert info.num_pending == 0 and info.num_ack_pending == 0  # everything acked, junk included

        # a restart on the existing durable consumer picks up where it was
        await stop_projector(projector, task)
        one_more = await publish(bus, [ev(JobSucceeded(job_id="job-4"))])
        published += one_more
        head = one_more[-1][0]
        want = fold(published).as_json()
        projector = Projector(bus, pg.dsn, fetch_timeout_s=0.2)
        task = asyncio.create_task(projector.run())
        await wait_until(caught_up, what="the restarted projector to apply the new event")
        assert projector.stats.applied == 1 and projector.stats.stale == 0
        assert await rm.jobs() == want["jobs"] and await rm.nodes() == want["nodes"]
        assert (await rm.job("job-4") or {})["status"] == "succeeded"

        # a new consumer redelivers the whole stream: acked, no effect
        await stop_projector(projector, task)
        await bus.js.delete_consumer(STREAM, "readmodel")
        again = Projector(bus, pg.dsn, fetch_timeout_s=0.2)
        task = asyncio.create_task(again.run())
        projector = again

        async def all_redelivered() -> bool:
            try:
                i = await bus.js.consumer_info(STREAM, "readmodel")
            except nats.js.errors.NotFoundError:  # not made yet
                return False
            return i.num_pending == 0 and i.num_ack_pending == 0 and i.delivered.stream_seq >= head

        await wait_until(all_redelivered, what="the redelivered stream to be acked")
        assert again.stats.applied == 0 and again.stats.stale == head
        assert await rm.as_json() == {**want, "seq": head}
    finally:
        await stop_projector(projector, task)
        pool.terminate()


async def test_projector_catches_up_after_postgres_restart(bus: Bus, pg: EmbeddedPostgres) -> None:
    ev = Events()
    published = await publish(bus, scenario_part1(ev))
    head1 = published[-1][0]
    projector = Projector(bus, pg.dsn, fetch_timeout_s=0.2, min_backoff_s=0.05, max_backoff_s=0.3)
    task = asyncio.create_task(projector.run())
    try:
        def at(seq: int) -> Callable[[], Awaitable[bool]]:
            async def pred() -> bool:
                return projector.stats.offset >= seq
            return pred

        await wait_until(at(head1), what="the first part")

        await asyncio.to_thread(pg.stop)
        more = await publish(bus, scenario_part2(ev))
        head2 = more[-1][0]

        async def failing() -> bool:
            return projector.stats.pg_failures >= 2

        await wait_until(failing, what="the projector to notice PostgreSQL is down")
        assert projector.stats.offset == head1
        info = await bus.js.consumer_info(STREAM, "readmodel")
        assert info.num_ack_pending + info.num_pending == len(more)  # nothing acked while down
        assert not projector.connected

        await asyncio.to_thread(pg.start)
        await wait_until(at(head2), what="catch-up after the restart")
        pool = await asyncpg.create_pool(pg.dsn, min_size=1, max_size=2)
        try:
            rm = ReadModel(pool)
            assert await rm.offset() == head2
            assert await rm.as_json() == fold(published + more).as_json()
        finally:
            pool.terminate()
        info = await bus.js.consumer_info(STREAM, "readmodel")
        assert info.num_pending == 0 and info.num_ack_pending == 0
        assert projector.stats.connects >= 2
    finally:
        await stop_projector(projector, task)


async def test_projector_replaces_an_incompatible_consumer(bus: Bus) -> None:
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    await bus.js.add_consumer(STREAM, ConsumerConfig(
        durable_name="readmodel", filter_subject="fleet.evt.>", ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.NEW))
    projector = Projector(bus, "postgresql://gpufleet@127.0.0.1:1/gpufleet")  # PostgreSQL down: still starts
    try:
        await projector.start()
        assert not projector.connected and projector.stats.pg_failures == 1
        info = await bus.js.consumer_info(STREAM, "readmodel")
        assert info.config.deliver_policy == DeliverPolicy.ALL
        assert info.config.filter_subject == "fleet.evt.>"
    finally:
        await projector.close()


async def test_jobs_come_a_page_at_a_time_by_job_id(pg_pool: asyncpg.Pool) -> None:
    """`jobs --limit N --after J`: the read model pages by job id in SQL, filters included."""
    ev = Events()
    part1 = [(i + 1, e) for i, e in enumerate(scenario_part1(ev))]
    rm = ReadModel(pg_pool)
    await rm.ensure_schema()
    await rm.load()
    await rm.apply_batch(part1)
    every = [r["job_id"] for r in await rm.jobs()]
    assert every == ["job-1", "job-2", "job-3"]
    first = await rm.jobs(limit=2)
    assert [r["job_id"] for r in first] == ["job-1", "job-2"]
    assert [r["job_id"] for r in await rm.jobs(after=first[-1]["job_id"], limit=2)] == ["job-3"]
    assert await rm.jobs(after="job-3") == []
    assert [r["job_id"] for r in await rm.jobs(status="rejected", after="job-1")] == ["job-3"]
