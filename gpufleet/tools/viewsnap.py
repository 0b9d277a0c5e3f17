"""View snapshots: the cluster view at points of the log, so `replay --seq N`, `replay --until`,
`jobs` / `nodes` without PostgreSQL and the dashboard start from the nearest one at or before
the point asked for and fold only the tail, whatever the length of the history.

The view is the dashboard's `Board` (the `ClusterView` rows, each GPU's cell, queue usage),
without what only a live page keeps (its feed, recent jobs, per-job histories). A process of the
mesh, `view` (its own identity, which may write only the bucket `SNAP_view`), folds the log
behind the services at a low CPU priority (nice 10: under load the services come first, it
catches up when they are idle) and stores a point every `GPUFLEET_VIEW_SNAPSHOT_EVENTS`
(10,000) events, or every as many events as the live board has rows when that is more (a point
costs in proportion to them: `spacing`), in two parts, so that no point's cost grows with the
history:

- `view-<seq>-<ms>` (the sequence it covers and the stored time of its last event, zero-padded
  so the names sort): the live board - nodes, GPU cells, queues, the rows of jobs that have not
  ended, the counts of all jobs by status, the ended jobs' ids for the retention window;
- `rows-<seq>`: the rows of the jobs that ended since the point before (written once: a job's
  end is final, shared/read/view.py), put away from the process's own board once stored.

`replay --seq N` restores the live board at the nearest point and folds at most 10,000 events
(or as many as the jobs live at that point);
the ended jobs' rows are read from the segments only when asked for (`replay --all`, `Fleet.fold`
for `jobs` without PostgreSQL). Both kinds of object live in the same container as the cores'
snapshots (shared/runtime/snapshots.py: state format, the log it belongs to, an HMAC with the
view key; the admin's creds hold the key to check them). Past `KEEP` points the older half is
thinned to every other one (a live board is small; the row segments are never thinned).

A snapshot that does not check out is skipped, loudly, for an older one or a fold from sequence 1:
a snapshot only ever saves time, the log holds everything.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from gpufleet.shared.contract.events import STREAM, parse_envelope
from gpufleet.shared.read.view import TERMINAL_STATUSES, ClusterView, JobRow
from gpufleet.shared.runtime import gcpolicy
from gpufleet.shared.runtime.engine import refusal
from gpufleet.shared.runtime.pull import stored_ms, stream_seq
from gpufleet.shared.runtime.snapshots import SnapshotStore, take
from gpufleet.tools.dashboard import Board

log = logging.getLogger(__name__)

VIEW = "view"
EVERY = int(os.environ.get("GPUFLEET_VIEW_SNAPSHOT_EVENTS", "10000"))
KEEP = 1000  # live points (10M events at the default spacing) before the oldest are thinned
ROWS = "rows"
NICE = 10


class _ViewKind:
    """What the snapshot container needs of a core: its name and its state's format."""

    name = VIEW
    state_format = 2  # 2: the board has its charts (a snapshot keeps none)


KIND = _ViewKind()


@dataclass(frozen=True)
class Point:
    seq: int
    stored_ms: int  # when the last event it covers was stored (the server's clock)
    name: str


def object_name(seq: int, stored_ms: int) -> str:
    return f"{VIEW}-{seq:012d}-{stored_ms:015d}"


def parse_name(name: str) -> Point | None:
    parts = name.split("-")
    if len(parts) != 3 or parts[0] != VIEW or not (parts[1].isdecimal() and parts[2].isdecimal()):
        return None
    return Point(int(parts[1]), int(parts[2]), name)


def stripped(board: Board) -> Board:
    """The board as a snapshot keeps it: the view and the cells, not what a live page shows."""
    return Board(view=board.view, gpus=board.gpus, held=board.held, placed=board.placed, attempt=board.attempt,
                 bad=board.bad, queues=board.queues, reserved=board.reserved, counts=board.counts,
                 ended=board.ended)


def live(board: Board) -> Board:
    """`stripped`, with only the rows of jobs that have not ended (a point's live part)."""
    v = board.view
    out = stripped(board)
    out.view = ClusterView(seq=v.seq, jobs={k: r for k, r in v.jobs.items() if r.status not in TERMINAL_STATUSES},
                           nodes=v.nodes, allocations=v.allocations)
    return out


def ended_rows(board: Board, after_seq: int = 0) -> dict[str, JobRow]:
    """The rows of jobs that ended after `after_seq` (a point's row segment)."""
    return {k: r for k, r in board.view.jobs.items() if r.status in TERMINAL_STATUSES and r.last_seq > after_seq}


@dataclass
class RowSegment:
    """The rows of the jobs that ended between two points (`rows-<seq>`)."""

    rows: dict[str, JobRow] = field(default_factory=dict)


def rows_name(seq: int) -> str:
    return f"{ROWS}-{seq:012d}"


class RowsMissing(RuntimeError):
    """A row segment that does not check out: the ended rows come from a fold from sequence 1."""


class ViewSnapshots:
    """The bucket of view snapshots, read with `key` (the admin's or the view process's)."""

    def __init__(self, bus: Any, key: bytes | None) -> None:
        self.bus, self.key = bus, key
        self.store = SnapshotStore(bus, KIND, key)  # (signing, checking, reading and writing the objects)
        self._created: str | None = None

    async def _store(self, create: bool) -> Any:
        return await self.store._store(create)

    async def stream_created(self) -> str:
        if self._created is None:
            info = await self.bus.js.stream_info(STREAM)
            self._created = str(info.created or "")
        return self._created

    async def _names(self) -> list[str]:
        import nats.js.errors

        try:
            obs = await self._store(create=False)
            if obs is None:
                return []
            infos = await obs.list(ignore_deletes=True)
        except (nats.js.errors.NotFoundError, nats.js.errors.BucketNotFoundError, nats.js.errors.ObjectNotFoundError):
            return []
        return [i.name for i in infos]

    async def points(self) -> list[Point]:
        """The stored snapshots, oldest first ([] when there is no bucket)."""
        pts = [p for n in await self._names() if (p := parse_name(n)) is not None]
        return sorted(pts, key=lambda p: p.seq)

    async def save(self, board: Board, seq: int, stored_ms: int, after_seq: int = 0) -> Point:
        """Store the point at `seq`: first the rows of the jobs that ended after `after_seq` (the
        point before), then the live board (a point that exists has its segments)."""
        created = await self.stream_created()
        rows = ended_rows(board, after_seq)
        if rows:
            await self.store.save(take(KIND, RowSegment(rows), seq, 0, set(), created), rows_name(seq))
        point = Point(seq, stored_ms, object_name(seq, stored_ms))
        await self.store.save(take(KIND, live(board), seq, 0, set(), created), point.name)
        return point

    async def rows_until(self, seq: int) -> dict[str, JobRow]:
        """The rows of every job that ended by the point at `seq` (all its row segments)."""
        created = await self.stream_created()
        names = sorted(n for n in await self._names() if n.startswith(ROWS + "-") and n[len(ROWS) + 1:].isdecimal()
                       and int(n[len(ROWS) + 1:]) <= seq)
        out: dict[str, JobRow] = {}
        for name in names:
            snap = await self.store.load(RowSegment(), created, name)
            if snap is None:
                raise RowsMissing(f"view row segment {name} does not check out (logged)")
            out.update(snap.state().rows)
        return out

    async def load(self, point: Point) -> Board | None:
        """The board of a stored point, checked; None (the reason logged) if it does not check out."""
        snap = await self.store.load(Board(), await self.stream_created(), point.name)
        if snap is None:
            return None
        board: Board = snap.state()
        board.view.seq = max(board.view.seq, snap.seq)
        return board

    async def nearest(self, until_seq: int | None = None, until_ms: int | None = None) -> tuple[Board, int] | None:
        """The newest snapshot at or before `until_seq` (and `until_ms`) that checks out, with its
        sequence; older ones are tried when a newer does not; None when there is none."""
        if self.key is None:
            return None
        try:
            points = await self.points()
        except Exception as exc:  # noqa: BLE001 - an optimisation: the log holds everything
            log.warning("view snapshots unreadable (%s: %s); folding from sequence 1", type(exc).__name__, exc)
            return None
        for p in reversed(points):
            if (until_seq is not None and p.seq > until_seq) or (until_ms is not None and p.stored_ms > until_ms):
                continue
            board = await self.load(p)
            if board is not None:
                return board, p.seq
        return None

    async def thin(self) -> int:
        """Past KEEP snapshots, delete every other one of the older half: the points stay spread
        over the whole history (dense near the head). The number deleted."""
        pts = await self.points()
        if len(pts) <= KEEP:
            return 0
        old = pts[: len(pts) // 2]
        gone = old[1::2]
        obs = await self._store(create=False)
        for p in gone:
            await obs.delete(p.name)
        return len(gone)


def fold_message(board: Board, msg: Any) -> None:
    """One message of the log into the board, by the engine's rules (shared/runtime/engine.py)."""
    seq = stream_seq(msg)
    try:
        env = parse_envelope(msg.data)
    except Exception:  # noqa: BLE001 - dead-lettered by the services
        board.view.seq = max(board.view.seq, seq)
        return
    if refusal(env, msg.subject, msg.headers) is not None:
        board.view.seq = max(board.view.seq, seq)
        return
    board.fold(seq, env)


async def fold_board(bus: Any, board: Board, until_seq: int | None = None, until_ms: int | None = None) -> int:
    """Fold the log after `board.view.seq` into it (to `until_seq`, or up to the last event stored
    by `until_ms`); returns the stored time (ms) of the last event folded (0: none)."""
    from gpufleet.shared.runtime.log import read_stream

    last_ms = 0
    async for msgs in read_stream(bus, ("fleet.evt.>",), from_seq=board.view.seq + 1, until_seq=until_seq):
        for msg in msgs:
            ms = stored_ms(msg)
            if until_ms is not None and ms > until_ms:
                return last_ms
            fold_message(board, msg)
            last_ms = ms
    return last_ms


# ---------------------------------------------------------------- the mesh's view process


def spacing(board: Board, every: int) -> int:
    """Events from one point to the next: `every`, or the number of live rows the point will
    pickle when that is more. A point costs in proportion to the live board (every job not
    ended); spaced at least that many events apart, each event pays a bounded share of it
    however long the backlog (at 50,000 jobs in a burst, taking points was 17 % of the view
    process, twice its share at 5,000), and the tail a restore folds stays no longer than the
    board it restores."""
    return max(every, len(board.view.jobs))


async def catch_up(bus: Any, snaps: ViewSnapshots, board: Board, last: int, every: int,
                   stop: asyncio.Event | None = None) -> int:
    """Fold the log into `board` and store a snapshot each `spacing(board, every)` events past
    `last` up to the head (one at each, catching up too: the points stay spread). The new last."""
    head = await bus.last_seq()
    while head - last >= spacing(board, every) and not (stop is not None and stop.is_set()):
        target = last + spacing(board, every)
        ms = await fold_board(bus, board, until_seq=target)
        board.view.seq = max(board.view.seq, target)
        p = await snaps.save(board, target, ms, after_seq=last)
        for job_id in ended_rows(board):  # stored: put away (its end is final; `ended` remembers it)
            del board.view.jobs[job_id]
        last = target
        board.history.clear()  # (what only a live page shows)
        board.feed.clear()
        log.info("view: snapshot at seq %d stored (%s)", target, p.name)
        await snaps.thin()
    return last


async def keep(bus: Any, key: bytes | None, stop: asyncio.Event, every: int = EVERY, poll_s: float = 5.0) -> None:
    """Fold the log behind the services; store a snapshot each time `every` events have passed."""
    snaps = ViewSnapshots(bus, key)
    start = await snaps.nearest()
    board, last = start if start is not None else (Board(), 0)
    log.info("view: from %s", f"its snapshot at seq {last}" if last else "seq 1")
    from gpufleet.shared.runtime.loop import every as every_period

    async def snapshot_round() -> None:
        nonlocal last
        last = await catch_up(bus, snaps, board, last, every, stop)

    await every_period(stop, poll_s, snapshot_round, "view")


def main(argv: list[str] | None = None) -> None:
    from gpufleet.shared.runtime.bus import Bus, Looping, run_until_signal

    ap = argparse.ArgumentParser(prog="gpufleet.tools.viewsnap", description=__doc__.splitlines()[0])
    ap.add_argument("--nats-url", default=os.environ.get("GPUFLEET_NATS_URL", "nats://127.0.0.1:4222"))
    ap.add_argument("--every", type=int, default=EVERY)
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s view %(levelname)s %(message)s")
    try:
        os.nice(NICE)  # behind the services: it only saves later reads time
    except OSError:
        pass

    def worker(bus: Bus) -> Looping:
        key = bus.creds.snapshot_key(VIEW) if bus.creds is not None else None
        return Looping(bus, lambda stop: keep(bus, key, stop, every=args.every))

    t0 = time.monotonic()
    gcpolicy.install()
    asyncio.run(run_until_signal(args.nats_url, "gpufleet-view", worker))
    log.info("view: stopped after %.0f s", time.monotonic() - t0)


if __name__ == "__main__":
    main()
