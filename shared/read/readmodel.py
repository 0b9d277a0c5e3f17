"""The PostgreSQL read model of jobs and nodes, and the projector that keeps it.

The rows are the `ClusterView` fold of shared/read/view.py, written to PostgreSQL: table `jobs` has
exactly the fields of `JobRow`, `nodes` exactly those of `NodeRow` (lists as text[], the
timestamps as the ISO strings the fold makes, so a row reads back equal). Two more tables:

- `projection_offsets(name, seq)`: the last stream sequence folded into the rows, written in
  the same transaction as the rows, so a batch is applied once or not at all.
- `job_replica_allocations(job_id, replica, node_id, gpus)`: `ClusterView.allocations` (how many GPUs a job's replica
  holds on each node). It is not part of any row, but the fold needs it to release GPUs
  later, so without it a view loaded back from PostgreSQL would not continue exactly.

PostgreSQL is never the source of truth: drop the tables and the projector rebuilds them from
the FLEET stream. The projector acks a message only after the transaction holding its effect
(or the offset past it) has committed; while PostgreSQL is down it holds its batch, retries with
backoff and reconnects, and catches up from where the committed offset says.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from gpufleet.shared.contract.events import STREAM, Envelope, parse_envelope
from gpufleet.shared.read.view import ClusterView, JobRow, NodeRow, apply
from gpufleet.shared.runtime import gcpolicy
from gpufleet.shared.runtime.bus import Bus, run_until_signal
from gpufleet.shared.runtime.engine import refusal
from gpufleet.shared.runtime.loop import fetch_batch, open_durable
from gpufleet.shared.runtime.pull import Linger, stream_seq

log = logging.getLogger(__name__)

DEFAULT_NAME = "readmodel"
EVENTS_FILTER = "fleet.evt.>"
_SCHEMA_LOCK = 0x67707566_6C656574 & 0x7FFFFFFFFFFFFFFF  # "gpufleet", an advisory lock key

_SQL_TYPES = {"str": "text NOT NULL DEFAULT ''", "int": "bigint NOT NULL DEFAULT 0",
              "list[str]": "text[] NOT NULL DEFAULT '{}'"}


def _columns(cls: type) -> list[tuple[str, str]]:
    """(column, SQL type) for every field of a row dataclass, in field order."""
    out = []
    for f in dataclasses.fields(cls):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if kind not in _SQL_TYPES:
            raise TypeError(f"{cls.__name__}.{f.name}: no SQL type for {kind!r}")
        out.append((f.name, _SQL_TYPES[kind]))
    return out


JOB_COLUMNS: tuple[str, ...] = tuple(c for c, _ in _columns(JobRow))
NODE_COLUMNS: tuple[str, ...] = tuple(c for c, _ in _columns(NodeRow))


def _create_table(table: str, cls: type, key: str) -> str:
    cols = ",\n  ".join(
        f"{name} text PRIMARY KEY" if name == key else f"{name} {sql}" for name, sql in _columns(cls)
    )
    return f"CREATE TABLE IF NOT EXISTS {table} (\n  {cols}\n)"


SCHEMA: tuple[str, ...] = (
    _create_table("jobs", JobRow, "job_id"),
    _create_table("nodes", NodeRow, "node_id"),
    "CREATE TABLE IF NOT EXISTS projection_offsets (name text PRIMARY KEY, seq bigint NOT NULL)",
    "CREATE TABLE IF NOT EXISTS job_replica_allocations ("
    " job_id text NOT NULL, replica int NOT NULL, node_id text NOT NULL, gpus bigint NOT NULL,"
    " PRIMARY KEY (job_id, replica))",
    "CREATE INDEX IF NOT EXISTS jobs_tenant_status ON jobs (tenant, status)",
)


def _upsert(table: str, columns: Sequence[str], key: str) -> str:
    names = ", ".join(columns)
    params = ", ".join(f"${i}" for i in range(1, len(columns) + 1))
    sets = ", ".join(f"{c} = EXCLUDED.{c}" for c in columns if c != key)
    return f"INSERT INTO {table} ({names}) VALUES ({params}) ON CONFLICT ({key}) DO UPDATE SET {sets}"


_UPSERT_JOB = _upsert("jobs", JOB_COLUMNS, "job_id")
_UPSERT_NODE = _upsert("nodes", NODE_COLUMNS, "node_id")
_SELECT_JOBS = f'SELECT {", ".join(JOB_COLUMNS)} FROM jobs'
_SELECT_NODES = f'SELECT {", ".join(NODE_COLUMNS)} FROM nodes'


async def ensure_schema(db: asyncpg.Pool | asyncpg.Connection) -> None:
    """Create the tables if missing; safe to run concurrently and repeatedly."""
    async with _acquire(db) as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
        for stmt in SCHEMA:
            await conn.execute(stmt)


@contextlib.asynccontextmanager
async def _acquire(db: asyncpg.Pool | asyncpg.Connection) -> Any:
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn:
            yield conn
    else:
        yield db


class StaleView(Exception):
    """The stored offset moved under us (another writer, or a rebuild); the view was reloaded."""


class ReadModel:
    """The jobs/nodes tables, and the in-memory `ClusterView` they were folded from.

    `apply_batch` folds events into the view and writes the rows they touched plus the new
    offset in one transaction. If that fails the in-memory view is dropped and reloaded from
    PostgreSQL before the next batch, so memory never runs ahead of what was committed.
    """

    def __init__(self, pool: asyncpg.Pool | asyncpg.Connection, name: str = DEFAULT_NAME) -> None:
        self.pool = pool
        self.name = name
        self._view: ClusterView | None = None
        self.fold_errors = 0

    @property
    def view(self) -> ClusterView:
        if self._view is None:
            raise RuntimeError("ReadModel.view: call load() first")
        return self._view

    async def ensure_schema(self) -> None:
        await ensure_schema(self.pool)

    async def load(self) -> ClusterView:
        """Read every row, the allocations and the offset back into a `ClusterView`."""
        async with _acquire(self.pool) as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            jobs = await conn.fetch(_SELECT_JOBS)
            nodes = await conn.fetch(_SELECT_NODES)
            allocs = await conn.fetch(
                "SELECT job_id, replica, node_id, gpus FROM job_replica_allocations ORDER BY job_id, replica")
            seq = await conn.fetchval("SELECT seq FROM projection_offsets WHERE name = $1", self.name)
        view = ClusterView(seq=int(seq or 0))
        for r in jobs:
            view.jobs[r["job_id"]] = JobRow(**dict(r))
        for r in nodes:
            view.nodes[r["node_id"]] = NodeRow(**dict(r))
        for r in allocs:
            view.allocations.setdefault(r["job_id"], {})[int(r["replica"])] = (r["node_id"], int(r["gpus"]))
        self._view = view
        return view

    async def apply_batch(self, items: Iterable[tuple[int, Envelope]], through_seq: int | None = None) -> int:
        """Fold the events with seq > the stored offset and commit them; returns how many were new.

        `through_seq` moves the offset past messages that were consumed but not folded (ones
        that failed to parse). Re-applying a batch already applied changes nothing.
        """
        batch = sorted(items, key=lambda it: it[0])
        for _ in range(5):
            if self._view is None:
                await self.load()
            try:
                return await self._apply_once(batch, through_seq)
            except StaleView:
                log.warning("read model %s: offset moved under us; reloading", self.name)
                self._view = None
        raise StaleView(f"read model {self.name}: offset keeps moving; is another projector writing?")

    async def _apply_once(self, batch: list[tuple[int, Envelope]], through_seq: int | None) -> int:
        view = self.view
        base = view.seq
        todo = [(seq, env) for seq, env in batch if seq > base]
        new_offset = max([base, through_seq or 0, *(seq for seq, _ in todo)])
        if new_offset == base:
            return 0
        jobs_touched: set[str] = set()
        nodes_touched: set[str] = set()
        try:
            for seq, env in todo:
                try:
                    j, n = apply(view, env, seq)
                except Exception:  # noqa: BLE001 - a fold bug must not stop the projection
                    self.fold_errors += 1
                    log.exception("read model %s: fold failed on seq %d (%s)", self.name, seq, env.type)
                    j = {env.job_id} if env.job_id else set()
                    n = {env.node_id} if env.node_id else set()
                    if env.job_id:
                        n |= {node for node, _ in view.allocations.get(env.job_id, {}).values()}
                jobs_touched |= j
                nodes_touched |= n
            view.seq = new_offset
            await self._write(base, new_offset, jobs_touched, nodes_touched)
        except BaseException:
            self._view = None  # torn: memory may be ahead of PostgreSQL
            raise
        return len(todo)

    async def _write(self, base: int, offset: int, jobs_touched: set[str], nodes_touched: set[str]) -> None:
        view = self.view
        job_rows = [_values(view.jobs[j], JOB_COLUMNS) for j in sorted(jobs_touched) if j in view.jobs]
        node_rows = [_values(view.nodes[n], NODE_COLUMNS) for n in sorted(nodes_touched) if n in view.nodes]
        gone_jobs = [j for j in jobs_touched if j not in view.jobs]
        gone_nodes = [n for n in nodes_touched if n not in view.nodes]
        alloc_jobs = sorted(jobs_touched)
        alloc_rows = [(j, r, node, gpus) for j in alloc_jobs for r, (node, gpus) in view.allocations.get(j, {}).items()]
        async with _acquire(self.pool) as conn, conn.transaction():
            stored = await conn.fetchval(
                "SELECT seq FROM projection_offsets WHERE name = $1 FOR UPDATE", self.name)
            if int(stored or 0) != base:
                raise StaleView(f"stored offset {stored}, expected {base}")
            if job_rows:
                await conn.executemany(_UPSERT_JOB, job_rows)
            if node_rows:
                await conn.executemany(_UPSERT_NODE, node_rows)
            if gone_jobs:
                await conn.execute("DELETE FROM jobs WHERE job_id = ANY($1::text[])", gone_jobs)
            if gone_nodes:
                await conn.execute("DELETE FROM nodes WHERE node_id = ANY($1::text[])", gone_nodes)
            if alloc_jobs:
                # Only an event about a job changes that job's allocation (see view.apply).
                await conn.execute("DELETE FROM job_replica_allocations WHERE job_id = ANY($1::text[])", alloc_jobs)
                if alloc_rows:
                    await conn.executemany(
                        "INSERT INTO job_replica_allocations (job_id, replica, node_id, gpus) VALUES ($1, $2, $3, $4)",
                        alloc_rows)
            await conn.execute(
                "INSERT INTO projection_offsets (name, seq) VALUES ($1, $2)"
                " ON CONFLICT (name) DO UPDATE SET seq = EXCLUDED.seq", self.name, offset)

    # ---------------------------------------------------------------- queries

    async def jobs(self, *, tenant: str | None = None, status: str | None = None, after: str | None = None,
                   limit: int | None = None) -> list[dict[str, Any]]:
        """Job rows as `ClusterView.as_json()["jobs"]` has them (same keys and types, by job id);
        a page of them with `after` (the last job id of the previous page) and `limit`."""
        where, args = _filters(tenant=tenant, status=status)
        if after is not None:
            args.append(after)
            where += (" AND " if where else " WHERE ") + f'job_id COLLATE "C" > ${len(args)}'
        page = ""
        if limit is not None:
            args.append(limit)
            page = f" LIMIT ${len(args)}"
        async with _acquire(self.pool) as conn:
            rows = await conn.fetch(f'{_SELECT_JOBS}{where} ORDER BY job_id COLLATE "C"{page}', *args)
        return [dict(r) for r in rows]

    async def job(self, job_id: str) -> dict[str, Any] | None:
        async with _acquire(self.pool) as conn:
            row = await conn.fetchrow(f"{_SELECT_JOBS} WHERE job_id = $1", job_id)
        return dict(row) if row is not None else None

    async def nodes(self) -> list[dict[str, Any]]:
        """Node rows as `ClusterView.as_json()["nodes"]` has them."""
        async with _acquire(self.pool) as conn:
            rows = await conn.fetch(f'{_SELECT_NODES} ORDER BY node_id COLLATE "C"')
        return [dict(r) for r in rows]

    async def offset(self) -> int:
        """The last stream sequence committed (0: nothing yet)."""
        async with _acquire(self.pool) as conn:
            seq = await conn.fetchval("SELECT seq FROM projection_offsets WHERE name = $1", self.name)
        return int(seq or 0)

    async def as_json(self) -> dict[str, Any]:
        """The committed rows in the shape of `ClusterView.as_json()`."""
        return {"seq": await self.offset(), "jobs": await self.jobs(), "nodes": await self.nodes()}


def _values(row: JobRow | NodeRow, columns: Sequence[str]) -> tuple[Any, ...]:
    return tuple(getattr(row, c) for c in columns)


def _filters(**kw: str | None) -> tuple[str, list[Any]]:
    parts: list[str] = []
    args: list[Any] = []
    for col, value in kw.items():
        if value is not None:
            args.append(value)
            parts.append(f"{col} = ${len(args)}")
    return (" WHERE " + " AND ".join(parts) if parts else ""), args


# -------------------------------------------------------------------- the projector service

_PG_DOWN = (OSError, asyncio.TimeoutError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
            asyncpg.exceptions.CannotConnectNowError, asyncpg.exceptions.AdminShutdownError,
            asyncpg.exceptions.CrashShutdownError, asyncpg.exceptions.ConnectionDoesNotExistError)


READ_LINGER_S = float(os.environ.get("GPUFLEET_READ_LINGER_MS", "25")) / 1000


@dataclass
class ProjectorStats:
    applied: int = 0  # events folded and committed
    stale: int = 0  # redelivered, already applied: acked without effect
    unparsable: int = 0  # acked and skipped (services dead-letter them)
    batches: int = 0
    pg_failures: int = 0
    connects: int = 0
    offset: int = 0


class Projector:
    """Keeps the read model: a durable pull consumer on `fleet.evt.>` -> `ReadModel.apply_batch`."""

    def __init__(self, bus: Bus, dsn: str, name: str = DEFAULT_NAME, *, batch: int = 512,
                 fetch_timeout_s: float = 0.5, ack_wait_s: float = 60.0,
                 min_backoff_s: float = 0.1, max_backoff_s: float = 2.0) -> None:
        self.bus = bus
        self.dsn = dsn
        self.name = name
        self.batch = batch
        self.fetch_timeout_s = fetch_timeout_s
        self.ack_wait_s = ack_wait_s
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.stats = ProjectorStats()
        self.model: ReadModel | None = None
        self._pool: asyncpg.Pool | None = None
        self._psub: Any = None
        self._held: list[Msg] = []  # fetched, not yet committed: never acked before PostgreSQL has them
        self._held_since = 0.0
        self._backoff = min_backoff_s
        # a read model a few tens of ms behind costs nobody anything, and each of its commits is a
        # PostgreSQL transaction: a trickle is gathered longer than in a service (shared/runtime/pull.py)
        self._linger = Linger(READ_LINGER_S, batch // 4)
        self._down_since: float | None = None
        self._stop = asyncio.Event()

    @property
    def connected(self) -> bool:
        return self.model is not None

    async def start(self) -> None:
        await self.bus.ensure_streams()
        # AckAll, reopened at its ack floor (shared/runtime/loop.py `open_durable`): batches are committed
        # in order and acked only after PostgreSQL has them, so one ack per batch is exact.
        self._psub = await open_durable(self.bus, self.name, EVENTS_FILTER, self.ack_wait_s)
        await self._connect()

    def stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        """Close the PostgreSQL pool and the pull subscription (the durable consumer stays)."""
        await self._disconnect()
        psub, self._psub = self._psub, None
        if psub is not None:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    async def run(self) -> None:
        """Run until `stop()` (calls `start()` first if needed)."""
        if self._psub is None:
            await self.start()
        try:
            while not self._stop.is_set():
                await self.step()
        finally:
            await self.close()

    async def step(self) -> int:
        """Connect if needed, fetch a batch (or retry the held one), commit, ack. Returns events applied."""
        if self.model is None and not await self._connect():
            await self._sleep_backoff()
            return 0
        if not self._held:
            self._held = await self._fetch()
            self._held_since = time.monotonic()
            if not self._held:
                return 0
        try:
            applied = await self._commit(self._held)
        except Exception as exc:  # noqa: BLE001 - PostgreSQL down or failing: keep the batch, retry
            self._on_pg_failure(exc)
            await self._disconnect()
            await self._keep_alive()
            await self._sleep_backoff()
            return 0
        with contextlib.suppress(Exception):  # a lost ack is redelivered and then acked as stale
            await max(self._held, key=stream_seq).ack()
        self._held = []
        self._backoff = self.min_backoff_s
        if self._down_since is not None:
            log.info("projector %s: PostgreSQL back after %.1fs; at seq %d",
                     self.name, time.monotonic() - self._down_since, self.stats.offset)
            self._down_since = None
        return applied

    async def _fetch(self) -> list[Msg]:
        await self._linger.before()
        msgs = await fetch_batch(self._psub, self.batch, self.fetch_timeout_s)
        self._linger.after(len(msgs))
        return msgs

    async def _commit(self, msgs: Sequence[Msg]) -> int:
        assert self.model is not None
        items: list[tuple[int, Envelope]] = []
        top = 0
        base = self.model.view.seq
        for msg in msgs:
            seq = stream_seq(msg)
            top = max(top, seq)
            if seq <= base:
                continue
            try:
                env = parse_envelope(msg.data)
            except Exception:  # noqa: BLE001 - services dead-letter it; the read model skips it
                log.warning("projector %s: skipping unparsable message seq %d on %s", self.name, seq, msg.subject)
                self.stats.unparsable += 1
                continue
            if refusal(env, msg.subject, msg.headers) is None:  # what no core folds, no row shows
                items.append((seq, env))
        applied = await self.model.apply_batch(items, through_seq=top)
        self.stats.stale += sum(1 for m in msgs if stream_seq(m) <= base)
        self.stats.applied += applied
        self.stats.batches += 1
        self.stats.offset = self.model.view.seq
        return applied

    async def _connect(self) -> bool:
        """Open a pool, make the schema and load the view; False (and logged) if PostgreSQL is down."""
        try:
            pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=2, timeout=5.0, command_timeout=30.0)
        except Exception as exc:  # noqa: BLE001 - down, starting up, refused: retried
            self._on_pg_failure(exc)
            return False
        try:
            model = ReadModel(pool, self.name)
            await model.ensure_schema()
            await model.load()
        except Exception as exc:  # noqa: BLE001
            self._on_pg_failure(exc)
            pool.terminate()
            return False
        self._pool, self.model = pool, model
        self.stats.connects += 1
        self.stats.offset = model.view.seq
        with contextlib.suppress(Exception):
            head = await self.bus.last_seq()
            if model.view.seq > head:
                log.error("projector %s: read model is at seq %d but stream %s ends at %d; "
                          "was the stream recreated? drop the read model to rebuild it",
                          self.name, model.view.seq, STREAM, head)
        log.info("projector %s: connected, read model at seq %d", self.name, model.view.seq)
        return True

    async def _disconnect(self) -> None:
        pool, self._pool, self.model = self._pool, None, None
        if pool is not None:
            try:
                await asyncio.wait_for(pool.close(), timeout=2.0)
            except Exception:  # noqa: BLE001 - a dead server: just drop the connections
                pool.terminate()

    def _on_pg_failure(self, exc: BaseException) -> None:
        self.stats.pg_failures += 1
        kind = "down" if isinstance(exc, _PG_DOWN) else "failing"
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("projector %s: PostgreSQL %s (%s: %s); holding %d messages, retrying",
                        self.name, kind, type(exc).__name__, exc, len(self._held))
        else:
            log.debug("projector %s: PostgreSQL still %s: %r", self.name, kind, exc)

    async def _keep_alive(self) -> None:
        """Tell the server the held messages are still being worked on, so they are not redelivered."""
        if self._held and time.monotonic() - self._held_since > self.ack_wait_s / 2:
            for m in self._held:
                with contextlib.suppress(Exception):
                    await m.in_progress()
            self._held_since = time.monotonic()

    async def _sleep_backoff(self) -> None:
        delay, self._backoff = self._backoff, min(self.max_backoff_s, self._backoff * 2)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), timeout=delay)


async def query_rows(dsn: str, kind: str, **page: Any) -> list[dict[str, Any]]:
    """`jobs` (filtered and paged by `page`: tenant, status, after, limit) or `nodes` rows of the
    live read model (for the CLI)."""
    conn = await asyncpg.connect(dsn)
    try:
        model = ReadModel(conn)
        return await (model.jobs(**page) if kind == "jobs" else model.nodes())
    finally:
        await conn.close()


async def main(nats_url: str, dsn: str, name: str = DEFAULT_NAME) -> None:
    """Run the projector until SIGINT/SIGTERM."""
    await run_until_signal(nats_url, f"gpufleet-{name}", lambda bus: Projector(bus, dsn, name))


def _cli() -> None:
    parser = argparse.ArgumentParser(description="gpufleet read-model projector (FLEET -> PostgreSQL)")
    parser.add_argument("--nats", default=os.environ.get("GPUFLEET_NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--dsn", default=os.environ.get("GPUFLEET_PG_DSN"), required="GPUFLEET_PG_DSN" not in os.environ)
    parser.add_argument("--name", default=DEFAULT_NAME)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gcpolicy.install()
    asyncio.run(main(args.nats, args.dsn, args.name))


if __name__ == "__main__":
    _cli()


__all__ = ["JOB_COLUMNS", "NODE_COLUMNS", "Projector", "ProjectorStats", "ReadModel", "StaleView",
           "ensure_schema", "main", "query_rows"]
