"""Reading the log: every event of FLEET (or a filtered part) in sequence order, fast.

Used by a service's fold, `gpufleet replay`, `watch --from-start` and tests. An ephemeral,
unacknowledged consumer is fetched in large batches until it has nothing pending.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import nats
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gpufleet.shared.contract.events import STREAM
from gpufleet.shared.runtime import pull
from gpufleet.shared.runtime.archive import Archive, archive_dir
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.pull import stream_seq

READ_BATCH = 2048
# who wants to hear how far a long read got: (the last sequence read, messages still pending);
# the CLI shows a progress bar from it on a terminal (gpufleet/cli/common.py)
READ_PROGRESS: ContextVar[Callable[[int, int], None] | None] = ContextVar("read_progress", default=None)


@contextlib.contextmanager
def read_progress(report: Callable[[int, int], None]) -> Iterator[None]:
    """Every `read_stream` in this context reports each batch it read to `report(seq, pending)`."""
    token = READ_PROGRESS.set(report)
    try:
        yield
    finally:
        READ_PROGRESS.reset(token)


async def read_stream(bus: Bus, subjects: Sequence[str] = ("fleet.>",), from_seq: int = 1,
                      until_seq: int | None = None, stream: str = STREAM,
                      from_time: datetime | None = None) -> AsyncIterator[list[Msg]]:
    """Yield batches of messages on `subjects` from `from_seq` (or those stored since `from_time`)
    to the head (or `until_seq`). On a tenant's connection, only what it may read (its own
    subjects: read_tenant_stream)."""
    if bus.tenant_scope is not None:
        async for msgs in read_tenant_stream(bus, bus.tenant_scope, subjects, until_seq):
            yield msgs
        return
    js = bus.js
    name = f"read-{time.time_ns()}"
    archived_to = 0  # the stream's messages up to it were read from the archive: skipped below
    if stream == STREAM and from_time is None and (root := archive_dir()) is not None:
        # what the archive process moved out of the stream is read back from the archive first. The
        # consumer is made first and the stream's extent read after it: the archive process purges
        # nothing a reader of the mesh has not received (archive.reader_floor), so what is purged
        # while it is being made is below the first sequence read here, and so in the archive
        info = await js.add_consumer(stream, _read_config(name, subjects, from_seq, None))
        done = False
        try:
            first = int((await js.stream_info(stream)).state.first_seq)
            if from_seq < first:
                for archived in Archive(root).read(subjects, from_seq, min(until_seq or first - 1, first - 1)):
                    yield archived  # type: ignore[misc]  # (ArchivedMsg has the Msg attributes a reader uses)
                archived_to = first - 1
                done = until_seq is not None and until_seq < first
        except BaseException:
            done = True
            raise
        finally:
            if done:  # (a reader that stops early, or an error: the consumer goes, it holds the purge)
                await _delete_quietly(js, stream, name)
        if done:
            return
    else:
        info = await js.add_consumer(stream, _read_config(name, subjects, from_seq, from_time))
    async for msgs in _drain(js, stream, name, info, until_seq):
        if archived_to:
            msgs = [m for m in msgs if stream_seq(m) > archived_to]
            if not msgs:
                continue
        yield msgs


def _read_config(name: str, subjects: Sequence[str], from_seq: int, from_time: datetime | None) -> ConsumerConfig:
    policy = (DeliverPolicy.BY_START_TIME if from_time is not None else
              DeliverPolicy.BY_START_SEQUENCE if from_seq > 1 else DeliverPolicy.ALL)
    return ConsumerConfig(
        name=name, filter_subjects=list(subjects), ack_policy=AckPolicy.NONE, deliver_policy=policy,
        opt_start_seq=from_seq if from_seq > 1 and from_time is None else None, opt_start_time=from_time,
        inactive_threshold=120.0, mem_storage=True,
    )


EMPTY_FETCHES = 5  # fetches of 2 s in a row that deliver nothing while messages are pending


async def _delete_quietly(js: Any, stream: str, name: str) -> None:
    try:
        await js.delete_consumer(stream, name)
    except Exception:  # noqa: BLE001 - it expires by itself
        pass


async def _drain(js: Any, stream: str, name: str, info: Any, until_seq: int | None) -> AsyncIterator[list[Msg]]:
    """Fetch the consumer `name` until it has nothing pending (or is past `until_seq`); then delete it.
    A server that delivers nothing while messages are pending (a leader election, a slow
    server: a fetch that times out or comes back empty) is asked again; after EMPTY_FETCHES in a
    row it is an error (TimeoutError), never the end of the log: a reader must not take a part of
    the history for all of it."""
    try:
        pending = int(info.num_pending or 0)
        if not pending:
            return
        psub = await js.pull_subscribe_bind(name, stream=stream)
        try:
            empty = 0
            while True:
                try:
                    msgs = await pull.fetch(psub, READ_BATCH, 2.0)
                except (nats.errors.TimeoutError, TimeoutError):
                    msgs = []
                if not msgs:
                    empty += 1
                    if empty >= EMPTY_FETCHES:
                        raise TimeoutError(f"reading {stream}: {pending} message(s) pending, none delivered "
                                           f"in {EMPTY_FETCHES} fetches")
                    continue
                empty = 0
                pending = int(msgs[-1].metadata.num_pending or 0)
                if (report := READ_PROGRESS.get()) is not None:
                    report(int(msgs[-1].metadata.sequence.stream), pending)
                if until_seq is not None:
                    kept = [m for m in msgs if stream_seq(m) <= until_seq]
                    if kept:
                        yield kept
                    if len(kept) < len(msgs) or (kept and stream_seq(kept[-1]) >= until_seq):
                        return
                else:
                    yield msgs
                if pending == 0:
                    return
        finally:
            await psub.unsubscribe()
    finally:
        await _delete_quietly(js, stream, name)


def scoped(subject: str, tenant: str) -> str:
    """`subject` narrowed to what `tenant` may read: its own events (`fleet.evt.<tenant>.…`) and
    commands. A subject that cannot be narrowed to them raises PermissionError."""
    toks = subject.split(".")
    if toks == ["fleet", ">"] or toks == ["fleet", "evt", ">"]:
        return f"fleet.evt.{tenant}.>"
    if len(toks) >= 3 and toks[0] == "fleet" and toks[1] in ("evt", "cmd") and toks[2] in ("*", tenant):
        return ".".join(["fleet", toks[1], tenant, *toks[3:]]) if len(toks) > 3 else f"fleet.{toks[1]}.{tenant}.>"
    raise PermissionError(f"tenant {tenant} may read only fleet.evt.{tenant}.> and fleet.cmd.{tenant}.>, not {subject}")


async def tenant_subscribe(bus: Bus, subject: str, deliver_policy: DeliverPolicy = DeliverPolicy.ALL,
                           opt_start_seq: int | None = None, opt_start_time: Any = None) -> Any:
    """A push consumer on one of the tenant's own subjects, delivered to its private inbox.

    A tenant's permissions allow only this shape (shared/trust/authz.py): the consumer-create subject
    carries the filter, so the server checks it against the tenant's own subjects, and no pull
    (`MSG.NEXT`, which names any consumer) is needed. Returns a core subscription whose messages
    are the stream's, with JetStream metadata."""
    name = f"t{time.time_ns()}"
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox)
    cfg = ConsumerConfig(
        name=name, filter_subject=subject, deliver_subject=inbox, ack_policy=AckPolicy.NONE,
        deliver_policy=deliver_policy, opt_start_seq=opt_start_seq, opt_start_time=opt_start_time,
        inactive_threshold=60.0, mem_storage=True,
    )
    await bus.js.add_consumer(STREAM, cfg)
    return sub


async def read_tenant_stream(bus: Bus, tenant: str, subjects: Sequence[str], until_seq: int | None = None,
                             idle_s: float = 1.0) -> AsyncIterator[list[Msg]]:
    """read_stream for a tenant's connection: each subject narrowed to its own, read through a
    push consumer until nothing is pending (or nothing came for `idle_s`)."""

    for subject in subjects:
        sub = await tenant_subscribe(bus, scoped(subject, tenant))
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=idle_s)
                except (nats.errors.TimeoutError, TimeoutError):
                    break
                if until_seq is not None and msg.metadata.sequence.stream > until_seq:
                    break
                yield [msg]
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
