"""The runtime loop every service runs: fold, then consume in batches, decide, publish, ack.

    durable pull consumer ──fetch(batch)──► evolve ─► decide ─► outputs (evolved at once, so
    the next decision in the batch sees them) ─► one atomic batch publish (CAS if it takes
    capacity) ─► ack the inputs

- On start the state is rebuilt by folding the stream (the service's filter subjects) to its
  head before the first decision. A delivered event the fold already covered is decided but
  not evolved twice; a service's own outputs coming back are recognised by event id.
- Output ids derive from the input event id, so re-deciding after a crash re-publishes the
  same ids and the server drops them; decisions are also idempotent on the folded state.
- A lost compare-and-set (another writer took the resource) re-folds and decides again.
- A message that is not valid JSON / not the contract, or that a core cannot handle, is
  acknowledged and recorded as a `sys.dead_letter` event with the reason; a message delivered
  more than MAX_DELIVER times likewise.
- One ack per batch (AckAll). After any failure in a batch the service re-folds and recreates
  its consumer at the ack floor, so what was not decided is delivered again, in order.
- With shared/runtime/otel.py set up: a span per decision that published something (or failed),
  parented to the decided message's `traceparent` (else in the job's own trace), whose context
  its outputs carry; counters of what was consumed and published, by type.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, Protocol, TypeVar

import nats
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gpufleet.shared.contract.errors import CasConflict, RetryableError
from gpufleet.shared.contract.events import (
    STREAM,
    SYS_TENANT,
    CapacityCommitted,
    DeadLetter,
    Envelope,
    Payload,
    subject_for,
    utc,
)
from gpufleet.shared.contract.ids import derive_id, is_token
from gpufleet.shared.contract.subjects import consumer_filter
from gpufleet.shared.runtime import otel, pull
from gpufleet.shared.runtime.bus import Bus, Cas, while_unanswered
from gpufleet.shared.runtime.engine import Engine, FoldStats, fold_engines, fold_tail, parse_logged, refusal
from gpufleet.shared.runtime.pull import seqs, stream_seq
from gpufleet.shared.runtime.snapshots import FORK_FROM_S, ForkedPoint, Snapshot, SnapshotStore, point_fork

log = logging.getLogger(__name__)

S = TypeVar("S")
MAX_DELIVER = 20
REDECIDE_MAX = 8
NAK_DELAY_S = 1.0
FOLD_BATCH = 2048
SNAPSHOT_EVENTS = int(os.environ.get("GPUFLEET_SNAPSHOT_EVENTS", "2000"))  # the in-memory rollback point
SNAPSHOT_STORE_EVENTS = int(os.environ.get("GPUFLEET_SNAPSHOT_STORE_EVENTS", "20000"))  # and stored, for restarts
SNAPSHOT_STORE_S = float(os.environ.get("GPUFLEET_SNAPSHOT_STORE_S", "60"))
SNAPSHOT_MIN_S = float(os.environ.get("GPUFLEET_SNAPSHOT_MIN_S", "5"))
# a fetch after one that took a few messages waits this long first (shared/runtime/pull.py `Linger`)
LINGER_S = float(os.environ.get("GPUFLEET_LINGER_MS", "5")) / 1000
LINGER_BELOW = 32


def linger() -> pull.Linger:
    return pull.Linger(LINGER_S, LINGER_BELOW)
SNAPSHOT_CPU_SHARE = 0.02  # of the wall time, at most, spent taking rollback points
# A client that wants its command's verdict at once names an inbox of its own in this header; once
# the verdict is in the log, admission answers there too (docs/clients.md). Best effort: the log
# is the truth, and a redelivered command may be answered twice.
REPLY_HEADER = "Gpufleet-Reply"
_VERDICTS = ("job.admitted", "job.rejected", "job.request_refused", "job.cancel_requested")


@dataclass
class Ctx:
    """What a pure decision may know about the world: the time, who it is, and what caused it."""

    now: datetime
    actor: str
    cause: Envelope | None = None
    _n: int = 0

    def emit(self, payload: Payload, tenant: str | None = None, *, key: str | None = None,
             cause_id: str | None = None, correlation_id: str | None = None) -> Envelope:
        """An output event with an id derived from its cause (or from `cause_id` + `key`)."""
        parent = cause_id or (self.cause.event_id if self.cause else None)
        if key is None:
            key = str(self._n)
            self._n += 1
        if parent is None:
            event_id = derive_id(f"{self.actor}:{key}", 0, time_ms=int(self.now.timestamp() * 1000))
        else:
            event_id = derive_id(parent, key)
        if tenant is None:
            tenant = self.cause.tenant if self.cause else SYS_TENANT
        job_id = getattr(payload, "job_id", None)
        return Envelope(
            event_id=event_id,
            type=payload.type,
            occurred_at=self.now,
            tenant=tenant,
            causation_id=parent,
            correlation_id=correlation_id or job_id or (self.cause.correlation_id if self.cause else None),
            actor=self.actor,
            payload=payload,
        )


class Core(Protocol[S]):
    """A service's pure core. No I/O, no clock, no randomness: all of that comes in `ctx`."""

    # Read-only, so a core may set them as plain class attributes of a narrower type
    # (`subjects = ("a", "b")` is a tuple of two, `cas_subject = "x"` a str).
    @property
    def name(self) -> str: ...
    @property
    def subjects(self) -> tuple[str, ...]: ...  # what it folds and decides on
    @property
    def cas_subject(self) -> str | None: ...  # wildcard subject its capacity decisions are serialised on
    @property
    def cas_outputs(self) -> tuple[str, ...]: ...  # the outputs that carry the guard (() : those on cas_subject)
    @property
    def cas_marker(self) -> bool: ...  # each guarded commit ends with a sys.capacity_committed on cas_subject
    @property
    def tick_s(self) -> float | None: ...  # how often `tick` runs (None: never)

    def initial_state(self) -> S: ...
    def evolve(self, state: S, env: Envelope) -> S: ...
    def decide(self, state: S, env: Envelope, ctx: Ctx) -> list[Envelope]: ...
    def tick(self, state: S, ctx: Ctx) -> list[Envelope]: ...
    def on_start(self, state: S, ctx: Ctx) -> list[Envelope]: ...
    def on_invalid(self, state: S, bad: InvalidMessage, ctx: Ctx) -> list[Envelope]: ...


class BaseCore(Generic[S]):
    """Defaults for the optional parts of a core."""

    name = "core"
    subjects: tuple[str, ...] = ()
    cas_subject: str | None = None
    # Outputs published only if nothing new was written on `cas_subject` since the core decided
    # them; () means the outputs on `cas_subject` itself (the placer: a placement, guarded by the
    # placements). The executor guards its starts and exits by the nodes' losses instead.
    cas_outputs: tuple[str, ...] = ()
    # Each guarded commit ends with a `sys.capacity_committed` on `cas_subject`, which must then be
    # `events.capacity_subject(name)` (literal), in the same atomic batch, and the guard is that subject's
    # last sequence (the placer). A guard on a wildcard subject costs the server a match over
    # every subject of the stream it covers, at each check (`fleet.evt.*.job.*.placed`: every job
    # the stream holds, 44.5 ms at 50,000 jobs); a literal one is one lookup (0.3 ms).
    cas_marker: bool = False
    tick_s: float | None = None

    def decide(self, state: S, env: Envelope, ctx: Ctx) -> list[Envelope]:
        return []

    def tick(self, state: S, ctx: Ctx) -> list[Envelope]:
        return []

    def on_start(self, state: S, ctx: Ctx) -> list[Envelope]:
        return []

    def on_invalid(self, state: S, bad: InvalidMessage, ctx: Ctx) -> list[Envelope]:
        """Answer a message that is not the contract (besides its dead letter): nothing by default."""
        return []


@dataclass(frozen=True)
class InvalidMessage:
    """A message that is not the contract, as far as it can be read: its subject, the tenant the
    subject names (a command's sender), the job id in its raw payload, and every error found."""

    subject: str
    stream_seq: int
    event_id: str  # a deterministic id for an answer to it
    tenant: str | None
    job_id: str | None
    errors: tuple[tuple[str, str], ...]  # (field, message)


def read_invalid(subject: str, data: bytes, seq: int, errors: list[tuple[str, str]], ts_ms: int) -> InvalidMessage:
    """What can be read of a bad message: the subject's tenant (`fleet.cmd.<tenant>.<verb>`,
    `fleet.evt.<tenant>.job.<id>.<type>`) and the raw payload's job id, each only if a valid token."""
    toks = subject.split(".")
    tenant = toks[2] if len(toks) > 3 and toks[1] in ("cmd", "evt") and is_token(toks[2]) else None
    job_id = None
    try:
        doc = json.loads(data)
        if isinstance(doc, dict) and isinstance(doc.get("payload"), dict):
            jid = doc["payload"].get("job_id")
            job_id = jid if isinstance(jid, str) and is_token(jid) else None
    except ValueError:
        pass
    return InvalidMessage(subject, seq, derive_id(f"invalid:{seq}", "answer", time_ms=ts_ms), tenant, job_id,
                          tuple(errors))


def validation_errors(exc: BaseException) -> list[tuple[str, str]]:
    """One (field, message) per error of a failed parse (pydantic's, or a plain exception's)."""
    errs = getattr(exc, "errors", None)
    if callable(errs):
        try:
            out = []
            for e in errs():
                loc = [str(x) for x in e.get("loc", ()) if not str(x).startswith(("cmd.", "job.", "node."))]
                out.append((".".join(loc) or "envelope", str(e.get("msg", ""))))
            if out:
                return out
        except Exception:  # noqa: BLE001 - fall back to the text
            pass
    return [("envelope", _short(exc))]


@dataclass
class RuntimeStats:
    consumed: int = 0
    published: int = 0
    dead_letters: int = 0
    cas_conflicts: int = 0
    refolds: int = 0
    batches: int = 0
    last_batch_s: float = 0.0


@dataclass
class ServiceRuntime(Generic[S]):
    core: Core[S]
    bus: Bus
    instance: str = "0"
    batch: int = 256
    fetch_timeout_s: float = 0.25
    ack_wait_s: float = 30.0  # an unacked message (a crash before the ack) comes back after this
    clock: Callable[[], float] = time.time
    group: RuntimeGroup | None = None  # set when co-located: the group owns consumer and acks
    # one active instance (shared/runtime/lease.py): the consumer is the service's, shared by its instances,
    # and nothing is committed unless `fence()` says the lease is still held
    shared_durable: bool = False
    fence: Callable[[], bool] | None = None
    stats: RuntimeStats = field(default_factory=RuntimeStats)
    _linger: pull.Linger = field(default_factory=linger, repr=False)

    def __post_init__(self) -> None:
        # the state and where it stands in the log, with the delivery rules (shared/runtime/engine.py)
        self.engine: Engine[S] = Engine(self.core)
        # The last committed point (shared/runtime/snapshots.py): a refold restores it and folds the tail
        # only. Kept in memory every SNAPSHOT_EVENTS events, stored for restarts every
        # SNAPSHOT_STORE_EVENTS events or SNAPSHOT_STORE_S seconds.
        key = self.bus.creds.snapshot_key(self.core.name) if self.bus.creds is not None else None
        self.snapshots = SnapshotStore(self.bus, self.core, key)
        self._snap: Snapshot | None = None
        self._since_snap = 0
        self._snap_at = 0.0
        self._snap_cost_s = 0.0
        self._stored_seq = 0
        self._stored_at = time.monotonic()
        self._save_task: asyncio.Task[None] | None = None
        self._point_task: asyncio.Task[None] | None = None  # a point being pickled by a forked child
        self._stream_created = ""
        self.last_fold = FoldStats()
        self._decided_cas_seq: int | None = None  # what the batch's first capacity decision saw
        self._replies: list[tuple[str, list[Envelope]]] = []  # (inbox, verdicts) of the batch's commands
        self._stop = asyncio.Event()
        # One writer of the state at a time: the consume loop, ticks, refolds and a shell's local
        # outputs (an agent's reconcile or sampling round) take turns.
        self._lock = asyncio.Lock()
        self._dirty = False  # the state may hold outputs the log does not: refold before trusting it
        self._next_tick = 0.0
        self._psub: Any = None
        self.acked_seq = 0  # the newest sequence this process acknowledged on its durable
        self._delivered = 0  # the consumer's delivery count at the last message this process got
        self._watch = ConsumerWatch(self.bus, lambda: self.durable)
        self._batch_types: dict[str, int] | None = None  # the batch's decided events by type (metrics)
        # one broad server-side filter, the rest in the client (see shared/contract/subjects.py)
        self.filter_subject = consumer_filter(self.core.subjects)
        # readers beside it that fold what it is delivered instead of reading the log again (the
        # billing ledger): each called with every batch, in order, before the decisions
        self.taps: list[Callable[[Sequence[Msg]], None]] = []

    @property
    def actor(self) -> str:
        return f"{self.core.name}/{self.instance}"

    @property
    def durable(self) -> str:
        return f"{self.core.name}-{self.instance}" if self.instance != "0" and not self.shared_durable else self.core.name

    def ctx(self, cause: Envelope | None = None) -> Ctx:
        return Ctx(now=utc(self.clock()), actor=self.actor, cause=cause)

    @property
    def state(self) -> S:
        return self.engine.state

    @property
    def applied_seq(self) -> int:
        """Every event of the core's subjects up to here is folded into the state."""
        return self.engine.seq

    @property
    def last_cas_seq(self) -> int:
        return self.engine.last_cas_seq

    # ---------------------------------------------------------------- fold

    async def refold(self) -> int:
        """Rebuild the state from the stream (the core's subjects) up to its head."""
        async with self._lock:
            return await self._refold()

    async def _refold(self, full: bool = False) -> int:
        """The rebuild, in a new state swapped in at the end: a reader (an agent's loop) sees the
        old state or the new one, never one half folded. It starts from the last committed point
        (in memory, else the stored snapshot) and folds only what came after it; `full` (or no
        snapshot that checks out) folds from sequence 1."""
        engine, snap, t0 = await self._fold_from(full)
        # the tail, by the same rules as a delivered message: a fold equals the live state
        n = await fold_tail(self.bus, engine, subject=self.filter_subject)
        await self._guard_in_stream(engine)
        return self._folded(engine, snap, n, t0)

    async def _guard_in_stream(self, engine: Engine[S]) -> None:
        """The compare-and-set guard names the newest event of the core's CAS subject in the log,
        but the server compares it with the newest one the *stream* still holds. Once a retention
        purged that event (the archive, after a quiet spell longer than the retention), the stream
        holds none of the subject and the server expects 0: a guard left at the purged sequence
        would fail every commit, and every refold would set it back (a livelock). The fold read the
        stream to its head, so a guard below the stream's first sequence means no event of the
        subject is left in it. (A purge between this read and the commit fails that one CAS; the
        refold after it reads the stream again.)"""
        if not self.core.cas_subject or engine.last_cas_seq == 0:
            return
        first = int((await self.bus.js.stream_info(STREAM)).state.first_seq)
        if engine.last_cas_seq < first:
            log.info("%s: its compare-and-set guard (seq %d) was purged from the stream (which starts at %d): "
                     "the stream holds none of %s, so the guard is 0", self.actor, engine.last_cas_seq, first,
                     self.core.cas_subject)
            engine.last_cas_seq = 0

    async def _fold_from(self, full: bool = False) -> tuple[Engine[S], Snapshot | None, float]:
        """A new engine at the last committed point (none with `full`), to fold the tail into."""
        self.stats.refolds += 1
        otel.count_refold(self.core.name)
        self._dirty = True  # until this fold completes
        t0 = time.perf_counter()
        snap = None if full else await self._restore_point()
        engine: Engine[S] = Engine(self.core)  # (a new state also resets a core's caches of derived data)
        engine.restore(snap)
        return engine, snap, t0

    def _folded(self, engine: Engine[S], snap: Snapshot | None, n: int, t0: float) -> int:
        self.engine = engine
        self._dirty = False
        self.last_fold = FoldStats(from_seq=snap.seq if snap else 0, events=n, to_seq=engine.seq,
                                   seconds=time.perf_counter() - t0)
        log.info("%s folded %d events up to seq %d (%s)", self.actor, n, self.applied_seq,
                 f"from its snapshot at seq {snap.seq}" if snap else "from seq 1")
        self._take_snapshot()  # what it folded is all in the log: the next rollback point
        return n

    async def _restore_point(self) -> Snapshot | None:
        """The in-memory committed point, else the stored snapshot (checked), else None."""
        if self._snap is not None:
            return self._snap
        if not self._stream_created:
            try:
                info = await self.bus.js.stream_info(STREAM)
                self._stream_created = str(info.created or "")
            except Exception:  # noqa: BLE001 - no snapshot without knowing which log it is
                return None
        snap = await self.snapshots.load(self.core.initial_state(), self._stream_created)
        if snap is not None:
            self._stored_seq = snap.seq
            self._snap = snap
        return snap

    def _take_snapshot(self, store: bool = True, *, background: bool = False, store_always: bool = False) -> None:
        """Keep the state as the last committed point (after a successful commit: every output it
        holds is in the log); store it when enough has happened since the stored one (or, with
        `store_always`, whenever it is newer). With `background` a state that pickles slowly is
        pickled by a forked child while the loop goes on (shared/runtime/snapshots.py
        `ForkedPoint`); the point is kept, and stored, once the child is done."""
        if self._dirty or not self._stream_created:
            return
        if background and self._point_task is not None:
            return  # one child at a time: the next commit tries again (a point in the loop goes on: newer)
        if background and self._snap_cost_s >= FORK_FROM_S and point_fork():
            try:
                child = ForkedPoint(self.core, self.engine.state, self.engine.seq, self.engine.last_cas_seq,
                                    self.engine.own, self._stream_created)
            except OSError as exc:  # no fork now (memory, process limit): this once in the loop
                log.warning("%s: cannot fork to take its point (%s); taking it here", self.actor, exc)
            else:
                self._snap_at = time.monotonic()
                self._since_snap = 0
                self._point_task = asyncio.create_task(self._forked_point(child, store, store_always))
                return
        t0 = time.perf_counter()
        snap = self.engine.point(self._stream_created)
        self._snap_at = time.monotonic()
        self._since_snap = 0
        self._have_point(snap, time.perf_counter() - t0, store, store_always)

    async def _forked_point(self, child: ForkedPoint, store: bool, store_always: bool) -> None:
        try:
            snap, cost_s = await child.result()
        except Exception as exc:  # noqa: BLE001 - the older point stays; the next is taken in the loop
            log.warning("%s: its point at seq %d was not taken (%s)", self.actor, child.seq, exc)
            self._snap_cost_s = 0.0
            return
        finally:
            self._point_task = None
        if snap.stream_created != self._stream_created or (self._snap is not None and self._snap.seq > snap.seq):
            return  # another log by now, or a newer point was taken meanwhile
        self._have_point(snap, cost_s, store, store_always)

    def _have_point(self, snap: Snapshot, cost_s: float, store: bool, store_always: bool) -> None:
        self._snap = snap
        self._snap_cost_s = cost_s
        if store_always:
            if snap.seq > self._stored_seq:
                self._store_snapshot(snap)
            return
        due = (snap.seq - self._stored_seq >= SNAPSHOT_STORE_EVENTS
               or (snap.seq > self._stored_seq and time.monotonic() - self._stored_at >= SNAPSHOT_STORE_S))
        if store and due:
            self._store_snapshot(snap)

    def _store_snapshot(self, snap: Snapshot) -> None:
        if self._save_task is not None and not self._save_task.done():
            return  # one write at a time; the next committed point goes next
        self._stored_seq, self._stored_at = snap.seq, time.monotonic()

        async def save() -> None:
            try:
                await self.snapshots.save(snap)
                log.info("%s: snapshot at seq %d stored (%d bytes pickled)", self.actor, snap.seq, len(snap.blob))
            except Exception as exc:  # noqa: BLE001 - an optimisation: the log holds everything
                log.warning("%s: storing its snapshot failed (%s: %s)", self.actor, type(exc).__name__, exc)
                self._stored_seq = 0

        self._save_task = asyncio.create_task(save())

    def _committed(self, n: int) -> None:
        """After a successful commit: a new rollback point every SNAPSHOT_EVENTS events, but never
        more than SNAPSHOT_CPU_SHARE of the time on taking them (a placer's state at 5,000 nodes
        pickles in ~0.25 s: then every ~12 s; a small core's in 1 ms: every SNAPSHOT_MIN_S)."""
        self._since_snap += n
        if self._since_snap >= SNAPSHOT_EVENTS and self._point_affordable():
            self._take_snapshot(background=True)

    def _point_affordable(self) -> bool:
        """A new rollback point now spends at most SNAPSHOT_CPU_SHARE of the time on them, a
        share the members of a group divide (one process, one budget: six cores each taking
        their own 2 % spent 14 % of the group's time on points)."""
        share = SNAPSHOT_CPU_SHARE / (len(self.group.runtimes) if self.group is not None else 1)
        return time.monotonic() - self._snap_at >= max(SNAPSHOT_MIN_S, self._snap_cost_s / share)

    def idle(self) -> None:
        """Nothing came in: a state that moved past its stored snapshot is stored now (events
        that came to nothing for this core advance its point too), so a restart after a quiet spell
        folds almost nothing, however few of the events were this core's."""
        if (not self._dirty and self.applied_seq > self._stored_seq
                and time.monotonic() - self._stored_at >= SNAPSHOT_MIN_S and self._point_affordable()):
            self._take_snapshot(background=True, store_always=True)

    async def flush_snapshot(self) -> None:
        """Store the current committed point now and wait for it (a clean stop, tests)."""
        if self._save_task is not None:
            await asyncio.gather(self._save_task, return_exceptions=True)
        self._take_snapshot(store=False)  # stored here, once, and awaited
        if self._snap is not None and self._snap.seq > 0:
            await self.snapshots.save(self._snap)
            self._stored_seq = self._snap.seq

    # ---------------------------------------------------------------- consume

    async def _first_fold(self, within_s: float = 60.0) -> int:
        """The fold on start, again while JetStream does not answer (a cluster still electing the
        stream's leader, a server restarting), saying so."""
        return await while_unanswered(self._refold, within_s, on_retry=lambda exc: log.warning(
            "%s: JetStream does not answer yet (%s); folding again", self.actor, type(exc).__name__))

    async def start(self) -> None:
        await self.bus.ensure_streams()
        async with self._lock:
            await self._first_fold()
            await self._open_consumer()
            await self._publish_and_apply(self.engine.start(self.ctx()), evolved=True)

    async def _open_consumer(self) -> None:
        if self.group is not None:
            await self.group.reopen()
            return
        self._psub = await open_durable(self.bus, self.durable, self.filter_subject, self.ack_wait_s, self._psub,
                                        known_floor=self.acked_seq)
        self._delivered = 0  # (a new consumer counts its deliveries from 1)

    async def _recover(self, reason: str) -> None:
        async with self._lock:
            await self._recover_locked(reason)

    async def _recover_locked(self, reason: str) -> None:
        """After a failed batch: rebuild the state from the log, redeliver from the ack floor."""
        log.warning("%s: %s; re-folding and redelivering from the ack floor", self.actor, reason)
        await self._refold()
        await self._open_consumer()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Run until `stop()`; call `start()` first."""
        await run_steps(self._stop, self.step, lambda: self._recover("a step failed"), self.actor)

    async def step(self) -> int:
        """Fetch and handle one batch, then tick if due. Returns the number of messages handled."""
        if self.fence is not None and not self.fence():
            self.stop()  # its lease is gone: it takes nothing more from the service's shared durable
            return 0
        await self._linger.before()
        msgs = await fetch_batch(self._psub, self.batch, self.fetch_timeout_s)
        self._linger.after(len(msgs))
        if msgs:
            self._delivered = check_deliveries(msgs, self._delivered, self.durable)
            _tap(self.taps, msgs)
            await self.handle_batch(msgs)
        await self.tick_if_due()
        if not msgs:
            self.idle()
        await self._watch.after(len(msgs))
        return len(msgs)

    async def tick_if_due(self) -> None:
        if self.core.tick_s is not None and self.clock() >= self._next_tick:
            self._next_tick = self.clock() + self.core.tick_s
            async with self._lock:
                await self._publish_and_apply(self.engine.tick(self.ctx()), evolved=True)

    def _says_bad(self, subject: str) -> bool:
        """Who records a message that is not the contract: for a client's command, admission alone
        (it answers commands; the autoscaler also reads them, and two dead letters per bad
        command said the same thing twice); for anything else, every service that reads it."""
        return self.core.name == "admission" or not subject.startswith("fleet.cmd.")

    def _invalid(self, msg: Msg, reason: str, errors: list[tuple[str, str]]) -> list[Envelope]:
        """The dead letter of a message that is not the contract (naming its tenant and job when
        they can be read), and the core's answer to its sender, if any (admission: `job.rejected`
        / `job.request_refused` on the job's own subject)."""
        md = msg.metadata
        ts_ms = int(md.timestamp.timestamp() * 1000) if md.timestamp else 0
        bad = read_invalid(msg.subject, msg.data, md.sequence.stream, errors, ts_ms)
        out = [self._dead_letter(msg, reason, bad)]
        try:
            out += self.core.on_invalid(self.state, bad, self.ctx())
        except Exception:  # noqa: BLE001 - the dead letter is said either way
            log.exception("%s: answering the invalid message at seq %d failed", self.actor, bad.stream_seq)
        return out

    def _dead_letter(self, msg: Msg, reason: str, bad: InvalidMessage | None = None) -> Envelope:
        md = msg.metadata
        seq = md.sequence.stream
        ts_ms = int(md.timestamp.timestamp() * 1000) if md.timestamp else 0
        self.stats.dead_letters += 1
        otel.count_dead_letter(self.core.name)
        log.warning("%s: dead letter seq %d on %s: %s", self.actor, seq, msg.subject, reason)
        payload = DeadLetter(
            service=self.core.name, subject=msg.subject, stream_seq=seq, reason=reason[:2000],
            data_excerpt=msg.data[:512].decode("utf-8", "replace"),
            tenant=bad.tenant if bad else None, about_job=bad.job_id if bad else None,
        )
        return Envelope(
            event_id=derive_id(f"{self.durable}:{seq}", "dead", time_ms=ts_ms), type=payload.type,
            occurred_at=utc(self.clock()), tenant=SYS_TENANT, actor=self.actor, payload=payload,
        )

    def _reply_to(self, msg: Msg) -> str | None:
        """The inbox a command asks its verdict on, when admission answers it and the inbox is the
        sender's own (a tenant's `_INBOX.tenant.<t>.`, the admin's `_INBOX.admin.`): never another's."""
        reply = (msg.headers or {}).get(REPLY_HEADER)
        if not reply or self.core.name != "admission" or not msg.subject.startswith("fleet.cmd."):
            return None
        if self.bus.creds is None:
            return reply  # a server without identities: nobody to tell apart
        tenant = msg.subject.split(".")[2]
        own = "_INBOX.admin." if tenant == SYS_TENANT else f"_INBOX.tenant.{tenant}."
        return reply if reply.startswith(own) and ">" not in reply and "*" not in reply else None

    async def _send_replies(self) -> None:
        for reply, answers in self._replies:
            doc = {"accepted": bool(answers) and all(a.type != "job.rejected" and a.type != "job.request_refused"
                                                     for a in answers),
                   "events": [json.loads(a.to_json()) for a in answers]}
            try:
                await self.bus.nc.publish(reply, json.dumps(doc).encode())
            except Exception as exc:  # noqa: BLE001 - best effort: the verdict is in the log
                log.debug("%s: reply to %s failed (%s)", self.actor, reply, exc)
        self._replies = []

    def _decide_batch(self, msgs: Sequence[Msg]) -> tuple[list[Envelope], list[Msg], list[Msg]]:
        self._decided_cas_seq = None
        self._replies = []
        outputs: list[Envelope] = []
        good: list[Msg] = []
        bad: list[Msg] = []
        spans = otel.decisions(self.core.name)  # None unless tracing is set up
        types: dict[str, int] | None = {} if otel.METRICS else None
        self._batch_types = types
        for msg in msgs:
            if not self.engine.wants(msg.subject):
                good.append(msg)  # not this service's business; acked with the batch
                continue
            seq, _, delivered = seqs(msg)
            try:
                env = parse_logged(seq, msg.data)  # (once per process: a group's members share it)
            except Exception as exc:  # noqa: BLE001 - any parse failure is a bad message
                if self._says_bad(msg.subject):
                    said = self._invalid(msg, f"invalid message: {_short(exc)}", validation_errors(exc))
                    outputs.extend(said)
                    if (reply := self._reply_to(msg)) is not None:
                        self._replies.append((reply, [e for e in said if e.type in _VERDICTS]))
                bad.append(msg)
                if types is not None:
                    types["invalid"] = types.get("invalid", 0) + 1
                continue
            if types is not None:
                types[env.type] = types.get(env.type, 0) + 1
            refused = refusal(env, msg.subject, msg.headers)
            if refused is not None:
                reason, fields = refused
                if not fields:  # a foreign author: a service's fact, nobody to answer
                    outputs.append(self._dead_letter(msg, reason))
                elif self._says_bad(msg.subject):
                    said = self._invalid(msg, reason, fields)
                    outputs.extend(said)
                    if (reply := self._reply_to(msg)) is not None:
                        self._replies.append((reply, [e for e in said if e.type in _VERDICTS]))
                bad.append(msg)
                continue
            if delivered > MAX_DELIVER:
                outputs.append(self._dead_letter(msg, f"delivered {delivered} times"))
                bad.append(msg)
                continue
            t0 = time.time_ns() if spans is not None else 0
            try:
                outs = self.engine.deliver(env, seq, self.ctx(env))
                if (reply := self._reply_to(msg)) is not None:
                    self._replies.append((reply, [o for o in outs if o.type in _VERDICTS]))
                if self._decided_cas_seq is None and self.engine.takes_capacity(outs):
                    # The guard is what this decision saw: a rival's write consumed later in the
                    # same batch must fail the CAS, not move the guard past itself.
                    self._decided_cas_seq = self.last_cas_seq
            except Exception as exc:  # noqa: BLE001 - a core bug must not stop the service
                log.exception("%s: core failed on seq %d", self.actor, seq)
                outputs.append(self._dead_letter(msg, f"{type(exc).__name__}: {_short(exc)}"))
                bad.append(msg)
                if spans is not None:
                    spans.decided(env, msg.headers, seq, outputs[-1:], t0, exc)
                raise _CoreFailed(outputs, good, bad) from exc
            if spans is not None and outs:
                spans.decided(env, msg.headers, seq, outs, t0)
            outputs.extend(outs)
            good.append(msg)
        return outputs, good, bad

    async def handle_batch(self, msgs: Sequence[Msg]) -> None:
        async with self._lock:
            await self._handle_batch(msgs)

    async def _handle_batch(self, msgs: Sequence[Msg]) -> None:
        t0 = time.perf_counter()
        for _attempt in range(REDECIDE_MAX):
            try:
                outputs, good, bad = self._decide_batch(msgs)
            except _CoreFailed as failed:
                # Publish what was decided before the failure plus the dead letter, ack up to
                # there; the rest comes again after a re-fold, since the state may be torn.
                await self._commit(failed.outputs, [*failed.good, *failed.bad], self._decided_cas_seq)
                await self._recover_locked("a core failed")
                return
            try:
                await self._commit(outputs, [*good, *bad], self._decided_cas_seq)
            except CasConflict:
                self.stats.cas_conflicts += 1
                otel.count_cas_conflict(self.core.name)
                await self._refold()  # the batch is not acked: decide it again on the new state
                continue
            except Exception as exc:  # noqa: BLE001 - retryable or not: the state holds unpublished outputs
                await asyncio.sleep(NAK_DELAY_S)
                await self._recover_locked(f"publish failed ({type(exc).__name__}: {exc})")
                return
            if self._replies:
                await self._send_replies()  # (the verdicts are in the log now)
            self.stats.batches += 1
            self.stats.consumed += len(msgs)
            self._committed(len(msgs))
            self.stats.last_batch_s = time.perf_counter() - t0
            if otel.METRICS:
                otel.count_consumed(self.core.name, self._batch_types or {})
                otel.observe_batch(self.core.name, self.stats.last_batch_s)
            return
        await asyncio.sleep(NAK_DELAY_S)
        await self._recover_locked(f"{REDECIDE_MAX} compare-and-set conflicts in a row")

    async def _commit(self, outputs: list[Envelope], handled: Sequence[Msg], cas_seq: int | None = None) -> None:
        """Publish the outputs, then ack the handled messages (one AckAll for all of them)."""
        if self.fence is not None and not self.fence():
            self.stop()
            raise LeaseLost(f"{self.actor}: its lease is not held: nothing more is committed")
        dups: list[tuple[int, Envelope]] = []  # outputs the server held already (another's version?)
        if outputs:
            spans = otel.decisions(self.core.name)  # None unless tracing is set up
            if spans is not None:
                spans.emitted(outputs)  # a span for each output of a job no decision span carries
            cas = None
            if self.core.cas_subject and self.engine.takes_capacity(outputs):
                cas = Cas(self.core.cas_subject, self.last_cas_seq if cas_seq is None else cas_seq)
            main = [o for o in outputs if not o.subject().startswith("fleet.tel.")]
            marks: list[tuple[int, Envelope]] = []  # (seq, marker) of each atomic batch's marker
            mark = self._capacity_marker if cas is not None and self.core.cas_marker else None
            seqs = await (self.bus.publish_batch(main, cas=cas, dups=dups, mark=mark, marks=marks) if cas
                          else self.bus.publish_many(main, dups=dups))
            self.stats.published += len(main) + len(marks)
            if cas is not None:
                for o, seq in [*zip(main, seqs, strict=True), *((m, s) for s, m in marks)]:
                    if self.engine.takes(o.subject()) and seq > self.engine.last_cas_seq:
                        self.engine.last_cas_seq = seq
            for o in outputs:
                if o.subject().startswith("fleet.tel."):
                    await self.bus.publish_telemetry(o.subject(), o.to_json())
            if spans is not None:
                otel.release(outputs)  # (after a failed publish the same ids are bound again)
            otel.count_published(self.core.name, outputs)
        if handled and self.group is None:
            last = max(handled, key=stream_seq)
            await last.ack()
            self.acked_seq = max(self.acked_seq, stream_seq(last))
        if dups and await self._others_version(dups):
            # the decision is in the log (the cause is decided), but in another version than the
            # one this state evolved: the state is rebuilt from the log, the log's version wins
            await self._refold()

    def _capacity_marker(self, chunk: Sequence[Envelope]) -> Envelope:
        """The last event of an atomic batch of guarded outputs (`cas_marker`): its id derived
        from the batch's last output, so a commit sent again is the same batch."""
        return self.ctx().emit(CapacityCommitted(service=self.core.name, events=len(chunk)), SYS_TENANT,
                               cause_id=chunk[-1].event_id, key="capacity_committed")

    async def _others_version(self, dups: list[tuple[int, Envelope]]) -> bool:
        """Whether the stream holds, for any of these outputs the server had already, another
        payload than this instance decided: the other instance of the service (or this one's
        earlier try, before a failure) decided the same cause under the same derived id on a
        state that differed (two placers: another node for the same job). Its version is what
        happened; this state evolved its own, so it must not go on from it (it would place the
        next job on GPUs the log says are taken, and its compare-and-set guard, moved to the
        copy's sequence, would let it)."""
        for seq, mine in dups:
            try:
                stored = await self.bus.js.get_msg(STREAM, seq)
                theirs = parse_logged(seq, stored.data or b"")
            except Exception as exc:  # noqa: BLE001 - unreadable: assume the worst
                log.warning("%s: reading the copy at seq %d failed (%s): re-folding", self.actor, seq, exc)
                return True
            if theirs.event_id != mine.event_id or theirs.payload != mine.payload:
                self.stats.cas_conflicts += 1
                log.info("%s: %s at seq %d was decided first by %s, differently: re-folding", self.actor,
                         mine.type, seq, theirs.actor)
                return True
        return False

    async def publish_local(self, outputs: list[Envelope]) -> None:
        """Publish outputs a shell decided from what it observed (a driver, NVML, heartbeats), not
        from a consumed message: they are evolved into the state like any decision's outputs.
        If the publish fails the state is rebuilt from the log and the error raised, so the shell
        does not act (remove a container, forget an exit) on something the log does not hold."""
        async with self._lock:
            if self._dirty:
                await self._refold()
            await self._publish_and_apply(outputs, evolved=False, raise_errors=True)

    async def ensure_fresh(self) -> None:
        """Before a shell reads the state to act on it: rebuild it if a failure left it doubtful."""
        if self._dirty:
            async with self._lock:
                if self._dirty:
                    await self._refold()

    async def _publish_and_apply(self, outputs: list[Envelope], evolved: bool, raise_errors: bool = False) -> None:
        """Outputs not caused by a consumed message (start-up, ticks)."""
        if not outputs:
            return
        if not evolved:
            self.engine.apply(outputs)
        try:
            await self._commit(outputs, ())
        except Exception as exc:
            self._dirty = True  # what was evolved above may not be in the log
            if not raise_errors and not isinstance(exc, CasConflict | RetryableError):
                raise
            log.warning("%s: publish of %d outputs failed (%s); re-folding", self.actor, len(outputs), exc)
            await self._refold()
            if raise_errors:
                raise


async def every(stop: asyncio.Event, period_s: float, fn: Callable[[], Awaitable[Any]], who: str) -> None:
    """Run `fn` every `period_s` until `stop` is set (a shell's loop beside the runtime: heartbeats,
    a driver's reconcile, GPU sampling); a failed round is logged and the next one tries again."""
    while not stop.is_set():
        try:
            await fn()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the loop must outlive any one failure
            log.exception("%s: %s failed; again in %.1fs", who, getattr(fn, "__name__", fn), period_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)


async def fetch_batch(psub: Any, batch: int, timeout_s: float) -> list[Msg]:
    """Up to `batch` messages, [] when none came in time or the connection is away."""
    try:
        return await pull.fetch(psub, batch, timeout_s)
    except (TimeoutError, nats.errors.TimeoutError):  # nats-py also raises a bare asyncio one
        return []
    except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
        await asyncio.sleep(0.2)
        return []


class DeliveryGap(RuntimeError):
    """Deliveries of this durable consumer went elsewhere: the step fails, and recovery
    recreates the consumer at its ack floor, so what went elsewhere comes here again in order."""


def check_deliveries(msgs: Sequence[Msg], delivered: int, durable: str) -> int:
    """The consumer's delivery count after `msgs`, which must follow `delivered` without a gap.

    A consumer numbers every delivery it makes (redeliveries included), so a batch that does not
    go on from this process's last one means deliveries went elsewhere: to another process on
    the same durable (an instance that lost its service's lease and took one more batch before
    it noticed, or was paused between its lease check and its fetch), or to a connection that
    broke on the way (a node agent cut off: a whole batch). Acking past that gap (AckAll) would
    acknowledge what was never decided; it is never redelivered. So the batch is not handled,
    and recovery recreates the consumer at the ack floor.
    """
    for msg in msgs:
        got = seqs(msg)[1]
        if got != delivered + 1:
            raise DeliveryGap(f"durable {durable} delivered #{got} after #{delivered} here: "
                              f"{got - delivered - 1} deliveries went elsewhere (another process, or a broken connection)")
        delivered = got
    return delivered


RECOVER_MAX_S = 5.0
CONSUMER_INFO_TIMEOUT_S = 2.0
IDLE_PROBE_S = 2.0  # an idle consumer is asked for its info this often


class ConsumerStuck(RuntimeError):
    """The durable consumer does not answer (no leader): the step fails, recovery re-opens it."""


class ConsumerWatch:
    """Tells an idle consumer from a stuck one. A fetch from a replicated consumer that lost its
    leader times out like one with nothing to deliver; after IDLE_PROBE_S of empty fetches the
    consumer is asked for its info, and one that does not answer fails the step."""

    def __init__(self, bus: Bus, durable: Callable[[], str]) -> None:
        self.bus, self.durable = bus, durable
        self.idle_since: float | None = None

    async def after(self, got: int) -> None:
        now = time.monotonic()
        if got or self.idle_since is None:
            self.idle_since = None if got else now
            return
        if now - self.idle_since < IDLE_PROBE_S:
            return
        self.idle_since = now
        try:
            await self.bus.js.consumer_info(STREAM, self.durable(), timeout=CONSUMER_INFO_TIMEOUT_S)
        except (TimeoutError, nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError,
                nats.js.errors.NotFoundError) as exc:
            raise ConsumerStuck(f"durable {self.durable()} does not answer ({type(exc).__name__})") from None
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
            pass  # (the connection is away: the fetches say so)


async def run_steps(stop: asyncio.Event, step: Callable[[], Awaitable[int]],
                    recover: Callable[[], Awaitable[None]], who: str) -> None:
    """Step until `stop` is set; a failed step re-folds (`recover`) and the loop goes on."""
    while not stop.is_set():
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the loop must outlive any one failure
            log.exception("%s: step failed; re-folding", who)
            delay = 0.5
            while not stop.is_set():  # no step before a recovery went through: the consumer
                await asyncio.sleep(delay)  # may be gone, and stepping on it would only idle
                try:
                    await recover()
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - NATS may be away: again, backing off
                    log.warning("%s: recovery failed (%s: %s); again in %.1f s", who, type(exc).__name__, exc, delay)
                    delay = min(RECOVER_MAX_S, delay * 2)


async def open_durable(bus: Bus, durable: str, filter_subject: str, ack_wait_s: float, old_psub: Any = None,
                       known_floor: int = 0) -> Any:
    """(Re)create a durable consumer at its ack floor + 1 and bind a pull subscription to it.

    AckAll acknowledges everything up to the acked message, so the ack floor is exactly what
    has been decided. Recreating the consumer there (on start, and after any failure in a
    batch) redelivers the rest in stream order — never a newer message before an older one,
    so one ack per batch cannot acknowledge a message that was not decided.

    A replicated consumer can be left without a leader after its servers were killed in turn
    (seen in `bench chaos`: minutes, while the stream had one again): its info does not answer.
    Then a process that acknowledged up to `known_floor` itself deletes it and creates it again
    there (the messages after it are redelivered; none before it was left undecided by this
    process); one that acknowledged nothing yet cannot know the floor and raises (tried again).
    """
    js = bus.js
    floor = 0
    try:
        info = await js.consumer_info(STREAM, durable, timeout=CONSUMER_INFO_TIMEOUT_S)
        floor = int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0
        await js.delete_consumer(STREAM, durable)
    except nats.js.errors.NotFoundError:
        pass
    except (TimeoutError, nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
        if not known_floor:
            raise
        log.warning("durable %s does not answer; creating it again at this process's ack floor %d", durable, known_floor)
        floor = known_floor
        try:
            await js.delete_consumer(STREAM, durable)
        except nats.js.errors.NotFoundError:
            pass
    floor = max(floor, known_floor)
    cfg = ConsumerConfig(
        durable_name=durable, filter_subject=filter_subject,
        ack_policy=AckPolicy.ALL,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE if floor else DeliverPolicy.ALL,
        opt_start_seq=floor + 1 if floor else None,
        max_deliver=-1, ack_wait=ack_wait_s, max_ack_pending=20_000,
    )
    await js.add_consumer(STREAM, cfg)
    if old_psub is not None:
        try:
            await old_psub.unsubscribe()
        except Exception:  # noqa: BLE001 - the old subscription is gone either way
            pass
    return await js.pull_subscribe_bind(durable, stream=STREAM)


class RuntimeGroup:
    """Several cores co-located in one process, sharing one durable consumer.

    Each core keeps its own state, fold, decisions and compare-and-set; what they share is the
    delivery: every event is received and parsed once per process instead of once per service
    (on 2 cores the client-side cost of a delivery dominates). A failure in any core re-folds
    that core and redelivers the batch to all, whose decisions are idempotent on their state.
    """

    def __init__(self, cores: Sequence[Core[Any]], bus: Bus, instance: str = "0", batch: int = 256,
                 fetch_timeout_s: float = 0.25, ack_wait_s: float = 30.0) -> None:
        self.bus = bus
        self.runtimes: list[ServiceRuntime[Any]] = [
            ServiceRuntime(core, bus, instance=instance, batch=batch, fetch_timeout_s=fetch_timeout_s,
                           ack_wait_s=ack_wait_s, group=self)
            for core in cores
        ]
        names = "-".join(c.name for c in cores)
        self.durable = f"group-{names}" + (f"-{instance}" if instance != "0" else "")
        self.filter_subject = consumer_filter([p for c in cores for p in c.subjects])
        self.batch, self.fetch_timeout_s, self.ack_wait_s = batch, fetch_timeout_s, ack_wait_s
        self._linger = linger()
        self.acked_seq = 0
        self._delivered = 0
        self._watch = ConsumerWatch(bus, lambda: self.durable)
        self._psub: Any = None
        self._generation = 0
        self._stop = asyncio.Event()
        self.taps: list[Callable[[Sequence[Msg]], None]] = []  # as ServiceRuntime.taps, for the group's delivery

    async def start(self) -> None:
        await self.bus.ensure_streams()
        await self._first_fold()
        await self.reopen()
        for rt in self.runtimes:
            await rt._publish_and_apply(rt.engine.start(rt.ctx()), evolved=True)

    async def _first_fold(self, within_s: float = 60.0) -> None:
        """Every member from its own committed point, in one read of the log from the lowest of
        them (each message parsed once): a restart reads the tail once, not once per core.
        Again while JetStream does not answer, as a lone service's first fold."""
        async def fold_all() -> None:
            async with contextlib.AsyncExitStack() as locks:
                for rt in self.runtimes:
                    await locks.enter_async_context(rt._lock)
                started = [await rt._fold_from() for rt in self.runtimes]
                counts = await fold_engines(self.bus, [e for e, _, _ in started], subject=self.filter_subject)
                for rt, (engine, snap, t0), n in zip(self.runtimes, started, counts, strict=True):
                    await rt._guard_in_stream(engine)
                    rt._folded(engine, snap, n, t0)

        await while_unanswered(fold_all, within_s, on_retry=lambda exc: log.warning(
            "group %s: JetStream does not answer yet (%s); folding again", self.durable, type(exc).__name__))

    async def reopen(self) -> None:
        self._generation += 1
        self._psub = await open_durable(self.bus, self.durable, self.filter_subject, self.ack_wait_s, self._psub,
                                        known_floor=self.acked_seq)
        self._delivered = 0

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        await run_steps(self._stop, self.step, self._recover, f"group {self.durable}")

    async def _recover(self) -> None:
        for rt in self.runtimes:
            await rt.refold()
        await self.reopen()

    async def step(self) -> int:
        await self._linger.before()
        msgs = await fetch_batch(self._psub, self.batch, self.fetch_timeout_s)
        self._linger.after(len(msgs))
        if msgs:
            self._delivered = check_deliveries(msgs, self._delivered, self.durable)
            _tap(self.taps, msgs)
            generation = self._generation
            # Each member decides in turn (its decision runs without a pause up to its publish)
            # and the members' publishes are in flight together: their states are apart, and a
            # server that fsyncs each write then waits on one disk flush for all of them instead
            # of one after the other. Each message is parsed once for all (`parse_logged`).
            results = await asyncio.gather(*(rt.handle_batch(msgs) for rt in self.runtimes),
                                           return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            if generation == self._generation:  # no member recreated the consumer meanwhile
                last = max(msgs, key=stream_seq)
                await last.ack()
                self.acked_seq = max(self.acked_seq, stream_seq(last))
        for rt in self.runtimes:
            await rt.tick_if_due()
            if not msgs:
                rt.idle()
        await self._watch.after(len(msgs))
        return len(msgs)


def _tap(taps: Sequence[Callable[[Sequence[Msg]], None]], msgs: Sequence[Msg]) -> None:
    for tap in taps:
        try:
            tap(msgs)
        except Exception:  # noqa: BLE001 - a reader beside the runtime never stops its decisions
            log.exception("a tap on the delivery failed")


class LeaseLost(RuntimeError):
    """The instance no longer holds its service's lease (shared/runtime/lease.py): it stops."""


class _CoreFailed(Exception):
    def __init__(self, outputs: list[Envelope], good: list[Msg], bad: list[Msg]) -> None:
        super().__init__("core failed")
        self.outputs, self.good, self.bad = outputs, good, bad


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) < 1500 else text[:1500] + "..."


__all__ = ["BaseCore", "Core", "Ctx", "ServiceRuntime", "subject_for"]
