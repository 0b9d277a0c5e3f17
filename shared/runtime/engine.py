"""The delivery rules of a core, written once: a pure, synchronous engine.

Every place that plays a core over the log uses this: the service runtime (shared/runtime/loop.py),
the simulator (gpufleet/tools/sim.py), the test harness (tests/builders.py) and every tool that folds
a core's state (`queues`, `pools`, `estimate`, `bill`, the dashboard's cores, the SDK). The
rules:

- **Fold.** A fact of the log at sequence `seq` that the core has not decided on is evolved
  into its state, unless it is one of the core's own outputs, evolved already when it was
  decided (`own`), or the fold has covered it already (`seq <= self.seq`).
- **Deliver.** A delivered event is folded (by the rule above), then decided on; the outputs
  that belong to the core's own subjects are evolved at once (so the next decision sees them)
  and remembered in `own` until they come back.
- **Tick / start.** Time-driven decisions and the decisions on start, outputs applied the same way.
- **Refusal.** A message whose envelope claims another subject than the one it was published
  on, a client's command that breaks the command rules (ULID `event_id` = `Nats-Msg-Id`), or a
  fact whose author does not own its type is never folded (`refusal`): the live decision and
  every fold apply the same rules, so a fold equals the live state.
- **Committed point.** `point()` is the state as a snapshot (shared/runtime/snapshots.py: the state, the
  sequence it covers, the last compare-and-set sequence, own outputs not seen back), and
  `restore()` goes back to one: a restart, a lost compare-and-set and a failed publish each
  restore a point and fold only the tail.

`fold_log` is the one asynchronous helper: a core's state at the head of the stream (or at
`until_seq`), from its newest stored snapshot when one covers no more than that, folding only
the tail after it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from gpufleet.shared.contract.events import Envelope, parse_envelope
from gpufleet.shared.contract.ids import is_ulid
from gpufleet.shared.contract.subjects import SubjectFilter
from gpufleet.shared.runtime.pull import stream_seq
from gpufleet.shared.runtime.snapshots import Snapshot, take
from gpufleet.shared.trust.authz import foreign_author

# The log's recent events as parsed, for every reader in this process: a grouped process's cores
# share one delivery, but its billing ledger (and a fold beside them) reads the same events again,
# and a job.submitted costs 50-100 us to parse. Keyed by the stream sequence; a hit must carry the
# same bytes (a stream created again reuses sequences). Envelopes are frozen, so sharing is safe.
PARSED_RECENT = 2048
_parsed: dict[int, tuple[bytes, Envelope]] = {}


def parse_logged(seq: int, data: bytes) -> Envelope:
    """The event at `seq` of the log, parsed once for the whole process while it is recent."""
    hit = _parsed.get(seq)
    if hit is not None and (hit[0] is data or hit[0] == data):
        return hit[1]
    env = parse_envelope(data)
    _parsed[seq] = (data, env)
    if len(_parsed) > PARSED_RECENT:
        del _parsed[next(iter(_parsed))]
    return env


if TYPE_CHECKING:
    from gpufleet.shared.runtime.bus import Bus
    from gpufleet.shared.runtime.loop import Core, Ctx

log = logging.getLogger(__name__)

S = TypeVar("S")


class Engine(Generic[S]):
    """One core's state and where it stands in the log, with the delivery rules."""

    def __init__(self, core: Core[S], state: S | None = None) -> None:
        self.core = core
        self.interest = SubjectFilter(core.subjects)
        self.takes = SubjectFilter([core.cas_subject] if core.cas_subject else [])  # moves the guard
        guarded = getattr(core, "cas_outputs", ()) or ([core.cas_subject] if core.cas_subject else [])
        self.guarded = SubjectFilter(list(guarded) if core.cas_subject else [])  # outputs that carry it
        self.state: S = core.initial_state() if state is None else state
        self.seq = 0  # every event of the core's subjects up to here is folded
        self.last_cas_seq = 0  # the last sequence seen on its compare-and-set subject
        self.own: set[str] = set()  # ids of its outputs evolved already, not yet seen back

    def wants(self, subject: str) -> bool:
        return self.interest(subject)

    def passed(self, seq: int) -> None:
        """The log moved past `seq` with nothing for this core (another subject, a refused message)."""
        if seq > self.seq:
            self.seq = seq

    def fold(self, env: Envelope, seq: int | None = None) -> bool:
        """A fact of the log at `seq` (None: a test's given, always new). True if it was evolved."""
        evolved = False
        if env.event_id in self.own:
            self.own.discard(env.event_id)  # evolved when it was decided
        elif seq is None or seq > self.seq:
            self.state = self.core.evolve(self.state, env)
            evolved = True
            if seq is not None and seq > self.last_cas_seq and self.takes(env.subject()):
                self.last_cas_seq = seq
        if seq is not None and seq > self.seq:
            self.seq = seq
        return evolved

    def decide(self, env: Envelope, ctx: Ctx) -> list[Envelope]:
        """The pure decision on the current state; nothing evolved."""
        return self.core.decide(self.state, env, ctx)

    def apply(self, outputs: Iterable[Envelope]) -> None:
        """Evolve the core's outputs that belong to its own subjects, once: their coming back is skipped."""
        for out in outputs:
            if self.interest(out.subject()):
                self.state = self.core.evolve(self.state, out)
                self.own.add(out.event_id)

    def deliver(self, env: Envelope, seq: int | None, ctx: Ctx) -> list[Envelope]:
        """A delivered event: fold it, decide on it, apply the outputs."""
        self.fold(env, seq)
        outs = self.decide(env, ctx)
        self.apply(outs)
        return outs

    def tick(self, ctx: Ctx) -> list[Envelope]:
        outs = self.core.tick(self.state, ctx)
        self.apply(outs)
        return outs

    def start(self, ctx: Ctx) -> list[Envelope]:
        outs = self.core.on_start(self.state, ctx)
        self.apply(outs)
        return outs

    def takes_capacity(self, outputs: Iterable[Envelope]) -> bool:
        """Whether these outputs must be published under the compare-and-set guard."""
        return any(self.guarded(o.subject()) for o in outputs)

    # ---------------------------------------------------------------- committed points

    def point(self, stream_created: str) -> Snapshot:
        """The state as a committed point (uncompressed: compressed when stored)."""
        return take(self.core, self.state, self.seq, self.last_cas_seq, self.own, stream_created, compress=False)

    def restore(self, snap: Snapshot | None) -> None:
        """Back to a committed point (None: to the start of the log)."""
        if snap is None:
            self.state, self.seq, self.last_cas_seq, self.own = self.core.initial_state(), 0, 0, set()
        else:
            self.state, self.seq, self.last_cas_seq, self.own = snap.state(), snap.seq, snap.last_cas_seq, set(snap.own)

    def fold_message(self, subject: str, data: bytes, headers: Mapping[str, str] | None, seq: int) -> bool:
        """A raw message of the log: parsed, refused by the contract's rules, else folded."""
        if seq <= self.seq:
            return False
        if not self.interest(subject):
            self.passed(seq)
            return False
        try:
            env = parse_logged(seq, data)
        except Exception:  # noqa: BLE001 - dead-lettered by the service that consumes it
            self.passed(seq)
            return False
        return self.fold_checked(env, subject, headers, seq)

    def fold_checked(self, env: Envelope, subject: str, headers: Mapping[str, str] | None, seq: int) -> bool:
        """A parsed message of the log: folded unless the contract's rules refuse it."""
        if seq <= self.seq:
            return False
        if refusal(env, subject, headers) is not None:
            self.passed(seq)
            return False
        return self.fold(env, seq)


# ---------------------------------------------------------------- the contract's refusals


def refusal(env: Envelope, subject: str, headers: Mapping[str, str] | None) -> tuple[str, list[tuple[str, str]]] | None:
    """Why a parsed message is not taken, with the fields to tell its sender (none: a fact by a
    foreign author, a service's, answered by nobody); None when it is taken. The live decision
    and every fold apply the same rules."""
    if env.subject() != subject:
        # the subject is what NATS permissions check: an envelope must not claim another
        # tenant, job or type than the subject it was allowed to publish on
        why = f"envelope belongs on {env.subject()}, not {subject}"
        return f"invalid message: {why}", [(_mismatch_field(env.subject(), subject), why)]
    broken = command_rules(env, headers) if subject.startswith("fleet.cmd.") else []
    if broken:
        # the rules the contract states for a client's command: without them its duplicate
        # protection is silently lost (docs/schemas, docs/log.md)
        return "invalid message: " + "; ".join(f"{f}: {m}" for f, m in broken), broken
    forged = foreign_author(env)
    if forged is not None:
        # the server's permissions should have refused it already (shared/trust/authz.py): a second
        # line of defence, so a misconfigured server cannot make a core act on it
        return f"foreign author: {forged}", []
    return None


def command_rules(env: Envelope, headers: Mapping[str, str] | None) -> list[tuple[str, str]]:
    """A command's `event_id` is a ULID (time-ordered, 26 Crockford base32 characters) and is
    also its `Nats-Msg-Id` header (the server's duplicate window drops a re-sent copy by it)."""
    out: list[tuple[str, str]] = []
    if not is_ulid(env.event_id):
        out.append(("event_id", f"must be a ULID (26 characters of 0-9 A-Z without I L O U), got {env.event_id!r}"))
    sent = (headers or {}).get("Nats-Msg-Id")
    if sent is None:
        out.append(("Nats-Msg-Id", "the header is required and must equal event_id"))
    elif sent != env.event_id:
        out.append(("Nats-Msg-Id", f"the header {sent!r} must equal event_id {env.event_id!r}"))
    return out


def _mismatch_field(own: str, published: str) -> str:
    """The envelope field that puts it on another subject than the one it was published on."""
    a, b = own.split("."), published.split(".")
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    if i == 2:
        return "tenant"
    if a[1:2] == ["evt"] and a[3:4] == ["job"] and i == 4:
        return "payload.job_id"
    return "type"


# ---------------------------------------------------------------- folding from the stream


@dataclass
class FoldStats:
    """The last (re)fold: where it started (0: sequence 1, else a snapshot's), events folded."""

    from_seq: int = 0
    events: int = 0
    to_seq: int = 0
    seconds: float = 0.0


async def fold_tail(bus: Bus, engine: Engine[Any], until_seq: int | None = None, subject: str | None = None) -> int:
    """Fold what the stream holds after `engine.seq` (up to `until_seq`): the number evolved."""
    counts = await fold_engines(bus, [engine], until_seq, subject=subject)
    return counts[0]


OnError = Callable[[Engine[Any], int, Envelope, Exception], None]


async def fold_engines(bus: Bus, engines: Sequence[Engine[Any]], until_seq: int | None = None, *,
                       subject: str | None = None, on_error: OnError | None = None) -> list[int]:
    """Bring each engine to the head of the stream (or `until_seq`), reading the log once, from
    the lowest point any of them stands at; each message parsed once. An event a core fails on
    is skipped for that core alone (`on_error`, else logged). The number each evolved."""
    from gpufleet.shared.contract.subjects import consumer_filter
    from gpufleet.shared.runtime.log import read_stream

    server = subject or consumer_filter([p for e in engines for p in e.core.subjects])
    counts = [0] * len(engines)
    start = min((e.seq for e in engines), default=0) + 1
    async for msgs in read_stream(bus, (server,), from_seq=start, until_seq=until_seq):
        if len(engines) == 1:  # a service's refold: no bookkeeping of several
            one = engines[0]
            for msg in msgs:
                seq = stream_seq(msg)
                try:
                    counts[0] += one.fold_message(msg.subject, msg.data, msg.headers, seq)
                except Exception as exc:  # noqa: BLE001 - one bad event must not stop the fold
                    one.passed(seq)
                    _failed(one, seq, parse_envelope(msg.data), exc, on_error)  # (it parsed: the evolve failed)
            continue
        for msg in msgs:
            seq = stream_seq(msg)
            wanted = [i for i, e in enumerate(engines) if seq > e.seq]
            for i in [i for i in wanted if not engines[i].wants(msg.subject)]:
                engines[i].passed(seq)
            wanted = [i for i in wanted if engines[i].wants(msg.subject)]
            if not wanted:
                continue
            try:
                env = parse_logged(seq, msg.data)
            except Exception:  # noqa: BLE001 - dead-lettered by the service that consumes it
                for i in wanted:
                    engines[i].passed(seq)
                continue
            for i in wanted:
                engine = engines[i]
                try:
                    counts[i] += engine.fold_checked(env, msg.subject, msg.headers, seq)
                except Exception as exc:  # noqa: BLE001 - one bad event must not stop the fold
                    engine.passed(seq)
                    _failed(engine, seq, env, exc, on_error)
    return counts


def _failed(engine: Engine[Any], seq: int, env: Envelope, exc: Exception, on_error: OnError | None) -> None:
    if on_error is not None:
        on_error(engine, seq, env, exc)
    else:
        log.exception("%s: evolve failed on seq %d during fold", engine.core.name, seq)


async def restored(bus: Bus, core: Core[S], until_seq: int | None = None, *, key: bytes | None = None) -> tuple[Engine[S], int]:
    """An engine at the core's newest stored snapshot, when one checks out with `key` (by default
    the connection's creds: a service's hold its cores' keys, the admin's every core's) and
    covers no more than `until_seq`; else at the start of the log. With the snapshot's sequence (0: none)."""
    from gpufleet.shared.contract.events import STREAM
    from gpufleet.shared.runtime.snapshots import SnapshotStore

    engine: Engine[S] = Engine(core)
    creds = getattr(bus, "creds", None)
    if key is None and creds is not None:
        key = creds.snapshot_key(core.name)
    if key is None:
        return engine, 0
    try:
        info = await bus.js.stream_info(STREAM)
        created = str(info.created or "")
    except Exception:  # noqa: BLE001 - no snapshot without knowing which log it is
        return engine, 0
    snap = await SnapshotStore(bus, core, key).load(core.initial_state(), created) if created else None
    if snap is None or (until_seq is not None and snap.seq > until_seq):
        return engine, 0  # none, or past the point asked for
    engine.restore(snap)
    return engine, snap.seq


async def fold_log(bus: Bus, core: Core[S], until_seq: int | None = None, *, key: bytes | None = None,
                   snapshots: bool = True) -> tuple[Engine[S], FoldStats]:
    """A core's state at the head of the log (or at `until_seq`): from its newest stored snapshot
    (`restored`), then the tail; with `snapshots=False`, or none that checks out, from sequence 1."""
    t0 = time.perf_counter()
    engine, from_seq = await restored(bus, core, until_seq, key=key) if snapshots else (Engine(core), 0)
    (n,) = await fold_engines(bus, [engine], until_seq)
    return engine, FoldStats(from_seq=from_seq, events=n, to_seq=engine.seq, seconds=time.perf_counter() - t0)


async def fold_cores(bus: Bus, cores: Sequence[Core[Any]], until_seq: int | None = None, *,
                     snapshots: bool = True, on_error: OnError | None = None) -> list[Engine[Any]]:
    """Several cores' engines at the head of the log (or `until_seq`), each from its snapshot, the
    log read once from the oldest of them."""
    engines = [(await restored(bus, c, until_seq))[0] if snapshots else Engine(c) for c in cores]
    await fold_engines(bus, engines, until_seq, on_error=on_error)
    return engines
