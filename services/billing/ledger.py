"""The billing ledger in PostgreSQL: one row per closed allocation interval and charge line.

    FLEET ──ephemeral consumer──► BillingCore.evolve (the same fold as the service and
    `gpufleet bill`) ──closed intervals──► INSERT ... ON CONFLICT DO NOTHING + offset, one transaction

- `billing_charges`: primary key (interval_key, resource); `seq` is the stream sequence of the
  event that closed the interval. A row is written once: a replayed or duplicated event closes
  nothing new in the fold, and a re-written batch hits the key.
- `billing_offsets(name, seq)`: the last stream sequence whose charges are stored, written in
  the same transaction as the rows.
- On start the ledger folds the log from its beginning (open intervals live only in the fold)
  and stores only what closed after the stored offset. While PostgreSQL is down it keeps folding
  and holds the charges in memory (up to `max_pending`, then it stops reading), retries with
  backoff, and writes them when it is back: nothing is lost, nothing is written twice.
- PostgreSQL back *behind* what this ledger wrote (its tables dropped or truncated, an older
  backup restored, a new data dir): seen on the reconnect, on a write (the offset row is below
  the one it wrote) or by a check every `check_s` while idle. The ledger then folds the log again
  from its beginning and writes every charge closed after the stored offset (0: all of them).
- An event the core fails on is logged, counted (`stats.skipped`) and skipped alone; the batch
  goes on.
- Beside a service (the billing core's runtime, or the group it is in), the ledger folds what that
  runtime is delivered (`attach`: a tap on its batches) instead of reading the log a second time:
  every event received and parsed once in the process. It reads on its own (its ephemeral
  consumer) until that reading reaches the first batch the tap holds for it, then drops its
  consumer; it goes back to reading on its own after a refold and while PostgreSQL holds back
  `max_pending` charges. The tap delivers every message of a filter that covers the ledger's, in
  order (a redelivered one changes nothing), so nothing is skipped at the switch.
- Its totals equal a fold of the log by construction; `tests/test_billing_mesh.py` checks it.

PostgreSQL is never the source of truth: drop the tables and the ledger is written again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

import asyncpg
import nats
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gpufleet.shared.contract.clusterconfig import ClusterConfig, load_config
from gpufleet.shared.contract.events import STREAM
from gpufleet.shared.contract.subjects import consumer_filter
from gpufleet.shared.runtime import gcpolicy
from gpufleet.shared.runtime.bus import Bus, run_until_signal
from gpufleet.shared.runtime.engine import Engine
from gpufleet.shared.runtime.pull import stream_seq

from .core import BillingCore, BillingState, Charge

log = logging.getLogger(__name__)

DEFAULT_NAME = "billing-ledger"
_SCHEMA_LOCK = 0x62696C6C_6C656467  # "bill" "ledg", an advisory lock key

SCHEMA: tuple[str, ...] = (
    "CREATE TABLE IF NOT EXISTS billing_charges ("
    " interval_key text NOT NULL, resource text NOT NULL, seq bigint NOT NULL,"
    " tenant text NOT NULL, queue text NOT NULL, job_id text NOT NULL, replica int NOT NULL, attempt int NOT NULL,"
    " node_id text NOT NULL, started_at timestamptz NOT NULL, ended_at timestamptz NOT NULL, ended_by text NOT NULL,"
    " quantity numeric NOT NULL, unit_price numeric NOT NULL, seconds numeric NOT NULL, cost numeric NOT NULL,"
    " idle_seconds numeric NOT NULL, idle_cost numeric NOT NULL, currency text NOT NULL,"
    " PRIMARY KEY (interval_key, resource))",
    "CREATE INDEX IF NOT EXISTS billing_charges_tenant_end ON billing_charges (tenant, ended_at)",
    "CREATE INDEX IF NOT EXISTS billing_charges_seq ON billing_charges (seq)",
    "CREATE TABLE IF NOT EXISTS billing_offsets (name text PRIMARY KEY, seq bigint NOT NULL)",
)
COLUMNS = ("interval_key", "resource", "seq", "tenant", "queue", "job_id", "replica", "attempt", "node_id",
           "started_at", "ended_at", "ended_by", "quantity", "unit_price", "seconds", "cost", "idle_seconds",
           "idle_cost", "currency")
_INSERT = (f"INSERT INTO billing_charges ({', '.join(COLUMNS)}) VALUES "
           f"({', '.join(f'${i}' for i in range(1, len(COLUMNS) + 1))}) ON CONFLICT DO NOTHING")

_PG_DOWN = (OSError, asyncio.TimeoutError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
            asyncpg.exceptions.CannotConnectNowError)


def rows_of(seq: int, c: Charge) -> list[tuple[Any, ...]]:
    return [(c.key, line.resource, seq, c.tenant, c.queue, c.job_id, c.replica, c.attempt, c.node_id,
             c.started_at, c.ended_at, c.end, line.quantity, line.unit_price, line.seconds, line.cost,
             line.idle_seconds, line.idle_cost, c.currency) for line in c.lines]


async def ensure_schema(conn: asyncpg.Connection | asyncpg.Pool) -> None:
    async with contextlib.AsyncExitStack() as stack:
        c = await stack.enter_async_context(conn.acquire()) if isinstance(conn, asyncpg.Pool) else conn
        async with c.transaction():
            await c.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
            for stmt in SCHEMA:
                await c.execute(stmt)


@dataclass
class LedgerStats:
    folded: int = 0  # events folded
    skipped: int = 0  # events the core failed on (logged, skipped alone)
    refolds: int = 0  # times PostgreSQL came back behind what this ledger wrote: folded again from 0
    charges: int = 0  # intervals closed (in the fold)
    written: int = 0  # rows inserted (not counting conflicts)
    commits: int = 0
    pg_failures: int = 0
    connects: int = 0
    offset: int = 0  # stored offset
    tapped: int = 0  # messages folded from the tap (the runtime's delivery), not read by the ledger itself
    switches: int = 0  # times it stopped reading on its own for the tap


class Ledger:
    """Keeps `billing_charges` equal to the fold of the log (see the module docstring)."""

    def __init__(self, bus: Bus, dsn: str, config: ClusterConfig | None = None, name: str = DEFAULT_NAME, *,
                 batch: int = 1024, fetch_timeout_s: float = 0.5, min_backoff_s: float = 0.1,
                 max_backoff_s: float = 2.0, max_pending: int = 200_000, check_s: float = 5.0) -> None:
        self.bus = bus
        self.dsn = dsn
        self.name = name
        # the fold, by the engine's rules (shared/runtime/engine.py)
        self.engine: Engine[BillingState] = Engine(BillingCore(config, keep_charges=True))
        self.batch, self.fetch_timeout_s = batch, fetch_timeout_s
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self.max_pending = max_pending
        self.check_s = check_s  # how often an idle ledger checks PostgreSQL still holds what it wrote
        self._next_check = 0.0
        self.stats = LedgerStats()
        self.stored: int | None = None  # the offset in PostgreSQL (None: not known yet)
        self.pending: list[tuple[int, Charge]] = []  # closed in the fold, not stored yet
        self._filter = consumer_filter(self.core.subjects)
        self._pool: asyncpg.Pool | None = None
        self._psub: Any = None
        self._consumer = ""
        self._backoff = min_backoff_s
        self._next_try = 0.0
        self._stop = asyncio.Event()
        self._tap_filter: str | None = None  # the tap's server-side filter (None: not attached)
        self.tapping = False  # folding the tap's delivery, its own consumer gone
        self._held: deque[Any] = deque()  # the tap's messages, held while it reads on its own
        self._wake = asyncio.Event()

    # ---------------------------------------------------------------- life cycle

    def attach(self, filter_subject: str) -> Callable[[Sequence[Any]], None]:
        """The tap for the runtime it sits beside, whose consumer's filter is `filter_subject`
        (it must cover the ledger's own: every message the ledger folds is in the tap's delivery).
        The runtime calls it with each batch it is delivered, in order, before deciding on it."""
        if not _covers(filter_subject, self._filter):
            raise ValueError(f"ledger {self.name}: a tap on {filter_subject} misses part of {self._filter}")
        self._tap_filter = filter_subject
        return self.tapped

    def tapped(self, msgs: Sequence[Any]) -> None:
        """A batch the runtime beside it was delivered: folded now (tapping), else held until its own
        reading reaches it (the oldest dropped past TAP_HELD: its own reading covers them)."""
        if not self.tapping:
            self._held.extend(msgs)
            while len(self._held) > TAP_HELD:
                self._held.popleft()
            return
        if len(self.pending) >= self.max_pending:  # PostgreSQL away too long: read on its own once it is back
            log.warning("ledger %s: %d charges wait for PostgreSQL; reading on its own from seq %d once stored",
                        self.name, len(self.pending), self.read_seq + 1)
            self.tapping = False
            self._held.extend(msgs)
            return
        for m in msgs:
            self.fold(stream_seq(m), m.data, m.subject, m.headers)
        self.stats.tapped += len(msgs)
        self._wake.set()

    async def _take_tap(self) -> None:
        """Its own reading reached the first message the tap holds: fold the rest from the tap."""
        first = stream_seq(self._held[0])
        if self.read_seq < first:
            return
        await self._drop_tail()
        self.tapping = True
        self.stats.switches += 1
        held, self._held = self._held, deque()
        for m in held:  # (those its own reading folded already change nothing)
            self.fold(stream_seq(m), m.data, m.subject, m.headers)
        log.info("ledger %s: folded to seq %d on its own; folding its runtime's delivery from here",
                 self.name, self.read_seq)

    async def start(self) -> None:
        await self.bus.ensure_streams()
        await self._open_tail()
        await self._connect()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        if self._psub is None:
            await self.start()
        try:
            while not self._stop.is_set():
                try:
                    await self.step()
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - the ledger must outlive any one failure
                    log.exception("ledger %s: step failed", self.name)
                    await self._sleep(0.5)
        finally:
            await self.close()

    async def close(self) -> None:
        self.tapping = False
        self._held.clear()
        await self._disconnect()
        await self._drop_tail()

    async def _drop_tail(self) -> None:
        """Stop reading the log: the pull subscription and its consumer go."""
        psub, self._psub = self._psub, None
        if psub is not None:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
            with contextlib.suppress(Exception):
                await self.bus.js.delete_consumer(STREAM, self._consumer)

    # ---------------------------------------------------------------- the fold

    async def _open_tail(self) -> None:
        """An ephemeral consumer from just after what the fold covers."""
        self._consumer = f"{self.name}-{time.time_ns()}"
        start = self.read_seq + 1
        cfg = ConsumerConfig(
            name=self._consumer, filter_subject=self._filter, ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start > 1 else DeliverPolicy.ALL,
            opt_start_seq=start if start > 1 else None, inactive_threshold=300.0, mem_storage=True,
        )
        await self.bus.js.add_consumer(STREAM, cfg)
        self._psub = await self.bus.js.pull_subscribe_bind(self._consumer, stream=STREAM)

    async def _fetch(self) -> list[Any]:
        if self._psub is None:  # a refold whose new consumer could not be made: try again
            await self._open_tail()
        try:
            return list(await self._psub.fetch(self.batch, timeout=self.fetch_timeout_s))
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        except (nats.js.errors.NotFoundError, nats.js.errors.ServiceUnavailableError) as exc:
            # the consumer is gone (a server restart deletes a memory-stored one; the fetch then
            # says "service unavailable", not "not found"): read on from read_seq with a new one
            log.warning("ledger %s: its reader is gone (%s); reading on from seq %d", self.name,
                        type(exc).__name__, self.read_seq + 1)
            self._psub = None  # (if the new one cannot be made yet, the next fetch tries again)
            await self._open_tail()
            return []

    @property
    def core(self) -> BillingCore:
        return self.engine.core  # type: ignore[return-value]

    @core.setter
    def core(self, core: BillingCore) -> None:  # (a fold from the start with another core)
        self.engine = Engine(core)

    @property
    def state(self) -> BillingState:
        return self.engine.state

    @property
    def read_seq(self) -> int:
        """The fold covers the log up to here."""
        return self.engine.seq

    def fold(self, seq: int, data: bytes, subject: str, headers: dict[str, str] | None = None) -> None:
        """Fold one message of the log (a redelivered one, a refused one or one of another subject
        changes nothing: the engine's rules); the intervals it closes become pending charges. A
        message the core fails on is logged, counted (`stats.skipped`) and skipped alone."""
        try:
            if self.engine.fold_message(subject, data, headers, seq):
                self.stats.folded += 1
        except Exception:  # noqa: BLE001 - one event the core fails on must not stop the ledger
            self.engine.passed(seq)
            self.stats.skipped += 1
            log.exception("ledger %s: the billing fold failed on seq %d (%s): skipped (%d so far)",
                          self.name, seq, subject, self.stats.skipped)
        finally:
            if self.state.charges:  # closed before it failed: charged all the same
                self.pending.extend((seq, c) for c in self.state.charges)
                self.stats.charges += len(self.state.charges)
                self.state.charges.clear()

    async def step(self) -> int:
        """Read a batch (unless too much waits for PostgreSQL), then store what is pending."""
        n = 0
        if self.tapping:  # the tap folds; store what it closed now and then
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.fetch_timeout_s)
        elif len(self.pending) < self.max_pending:
            msgs = await self._fetch()
            for m in msgs:
                self.fold(stream_seq(m), m.data, m.subject, m.headers)
            n = len(msgs)
            if self._held:
                await self._take_tap()
        else:
            await self._sleep(self.fetch_timeout_s)
        if self.stored is None or self.read_seq > self.stored or self.pending:
            await self.flush()
        elif time.monotonic() >= self._next_check:
            await self.check()
        return n

    async def check(self) -> None:
        """While nothing is to write: is PostgreSQL still where this ledger left it? (A restored
        backup, dropped tables, a new data dir: then fold again and write what is missing.)"""
        self._next_check = time.monotonic() + self.check_s
        if self._pool is None:
            if time.monotonic() >= self._next_try:
                await self._connect()  # behind what it wrote: folded again there
            return
        if self.stored is None:
            return
        try:
            stored = await self._pool.fetchval("SELECT seq FROM billing_offsets WHERE name = $1", self.name)
        except Exception as exc:  # noqa: BLE001 - tables gone, server away: reconnect (and see there)
            self._failed(exc)
            await self._disconnect()
            return
        if int(stored or 0) < self.stored:
            await self._refold(int(stored or 0))

    # ---------------------------------------------------------------- PostgreSQL

    async def flush(self) -> bool:
        """Store the pending charges and the offset in one transaction; False if PostgreSQL is away."""
        if time.monotonic() < self._next_try:
            return False
        if self._pool is None and not await self._connect():
            return False
        assert self._pool is not None and self.stored is not None
        base = self.stored
        behind: int | None = None
        # what is pending now: the tap may fold (and close more) while the transaction is away
        taken = self.pending[:]
        rows = [r for seq, c in taken if seq > base for r in rows_of(seq, c)]
        offset = max(base, self.read_seq)
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                stored = await conn.fetchval("SELECT seq FROM billing_offsets WHERE name = $1 FOR UPDATE", self.name)
                if int(stored or 0) < base:
                    behind = int(stored or 0)  # rows this ledger wrote may be gone: write nothing now
                    rows = []
                    offset = base = behind
                elif int(stored or 0) != base:
                    log.warning("ledger %s: offset moved under us (%s, expected %d)", self.name, stored, base)
                    base = int(stored or 0)
                    rows = [r for seq, c in taken if seq > base for r in rows_of(seq, c)]
                if rows:
                    await conn.executemany(_INSERT, rows)
                if offset > base:
                    await conn.execute(
                        "INSERT INTO billing_offsets (name, seq) VALUES ($1, $2)"
                        " ON CONFLICT (name) DO UPDATE SET seq = GREATEST(billing_offsets.seq, EXCLUDED.seq)",
                        self.name, offset)
        except Exception as exc:  # noqa: BLE001 - down or failing: keep everything, retry later
            self._failed(exc)
            await self._disconnect()
            return False
        if behind is not None:
            await self._refold(behind)
            return False
        self.stored = max(base, offset)
        self.stats.offset = self.stored
        self.stats.written += len(rows)
        self.stats.commits += 1
        del self.pending[:len(taken)]
        self._backoff = self.min_backoff_s
        return True

    async def _connect(self) -> bool:
        try:
            pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=2, timeout=5.0, command_timeout=30.0)
        except Exception as exc:  # noqa: BLE001 - down, starting up, refused: retried
            self._failed(exc)
            return False
        try:
            await ensure_schema(pool)
            stored = await pool.fetchval("SELECT seq FROM billing_offsets WHERE name = $1", self.name)
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)
            pool.terminate()
            return False
        was, self._pool, self.stored = self.stored, pool, int(stored or 0)
        self.stats.connects += 1
        self.stats.offset = self.stored
        self._next_check = time.monotonic() + self.check_s
        log.info("ledger %s: connected, stored to seq %d, folded to %d", self.name, self.stored, self.read_seq)
        if was is not None and self.stored < was:
            await self._refold(self.stored)
        elif was is not None and self.stored != was:
            log.warning("ledger %s: stored offset is %d, was %d", self.name, self.stored, was)
        return True

    async def _refold(self, stored: int) -> None:
        """PostgreSQL is behind what this ledger wrote (tables dropped, an older backup restored, a
        new data dir): the rows after `stored` may be gone. Fold the log again from its beginning
        (open intervals live only in the fold) and write every charge closed after `stored`, as
        on a start; a row still there hits its key."""
        log.warning("ledger %s: PostgreSQL is back at seq %d, behind the %s this ledger wrote: folding the log "
                    "again from its beginning to write what is missing", self.name, stored, self.stored)
        self.stats.refolds += 1
        self.stored = stored
        self.stats.offset = stored
        self.engine = Engine(self.core)
        self.pending.clear()
        self.tapping = False  # read on its own from the start; the tap's next batches are held
        self._held.clear()
        await self._drop_tail()
        await self._open_tail()

    async def _disconnect(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                await asyncio.wait_for(pool.close(), timeout=2.0)
            except Exception:  # noqa: BLE001 - a dead server: just drop the connections
                pool.terminate()

    def _failed(self, exc: BaseException) -> None:
        self.stats.pg_failures += 1
        kind = "down" if isinstance(exc, _PG_DOWN) else "failing"
        log.warning("ledger %s: PostgreSQL %s (%s: %s); %d charges held, retry in %.1fs",
                    self.name, kind, type(exc).__name__, exc, len(self.pending), self._backoff)
        self._next_try = time.monotonic() + self._backoff
        self._backoff = min(self.max_backoff_s, self._backoff * 2)

    async def _sleep(self, delay: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), timeout=delay)


TAP_HELD = 50_000  # the tap's messages held while the ledger reads on its own (the oldest go first)


def _covers(outer: str, inner: str) -> bool:
    """Whether every subject of the filter `inner` matches the filter `outer` (prefix filters of
    `consumer_filter`: literal tokens, a trailing '>')."""
    o, i = outer.split("."), inner.split(".")
    if o[-1] == ">":
        return len(i) >= len(o) and all(a == b for a, b in zip(o[:-1], i, strict=False)) and i[len(o) - 1:] != []
    return o == i


# -------------------------------------------------------------------- queries


async def ledger_rows(dsn: str, *, tenant: str | None = None, since: datetime | None = None,
                      until: datetime | None = None) -> list[dict[str, Any]]:
    """Stored charge lines (those whose interval ended in [since, until)), for `gpufleet bill --ledger`."""
    conn = await asyncpg.connect(dsn, timeout=5.0)
    try:
        await ensure_schema(conn)
        where, args = [], []
        for col, op, value in (("tenant", "=", tenant), ("ended_at", ">=", since), ("ended_at", "<", until)):
            if value is not None:
                args.append(value)
                where.append(f"{col} {op} ${len(args)}")
        sql = f"SELECT {', '.join(COLUMNS)} FROM billing_charges"
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = await conn.fetch(sql + " ORDER BY seq, interval_key, resource", *args)
        return [dict(r) for r in rows]
    finally:
        await conn.close()


async def ledger_totals(db: asyncpg.Pool | asyncpg.Connection) -> dict[str, Decimal]:
    """Cost and idle cost per tenant, straight from the table."""
    rows = await db.fetch("SELECT tenant, sum(cost) AS cost FROM billing_charges GROUP BY tenant ORDER BY tenant")
    return {r["tenant"]: r["cost"] for r in rows}


# -------------------------------------------------------------------- as a process


async def main(nats_url: str, dsn: str, config: ClusterConfig, name: str = DEFAULT_NAME) -> None:
    await run_until_signal(nats_url, f"gpufleet-{name}", lambda bus: Ledger(bus, dsn, config, name))


def _cli() -> None:
    ap = argparse.ArgumentParser(description="gpufleet billing ledger (FLEET -> PostgreSQL)")
    ap.add_argument("--nats", default=os.environ.get("GPUFLEET_NATS_URL", "nats://127.0.0.1:4222"))
    ap.add_argument("--dsn", default=os.environ.get("GPUFLEET_PG_DSN"), required="GPUFLEET_PG_DSN" not in os.environ)
    ap.add_argument("--config", default=os.environ.get("GPUFLEET_CONFIG"))
    ap.add_argument("--name", default=DEFAULT_NAME)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gcpolicy.install()
    asyncio.run(main(args.nats, args.dsn, load_config(args.config), args.name))


if __name__ == "__main__":
    _cli()


__all__ = ["COLUMNS", "Ledger", "LedgerStats", "ensure_schema", "ledger_rows", "ledger_totals", "main"]
