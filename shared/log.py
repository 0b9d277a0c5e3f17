"""Reading the log: every event of FLEET (or a filtered part) in sequence order, fast.

Used by a service's fold, `gpufleet replay`, `watch --from-start` and tests. An ephemeral,
unacknowledged consumer is fetched in large batches until it has nothing pending.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

import nats
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from .bus import Bus
from .events import STREAM

READ_BATCH = 2048


async def read_stream(bus: Bus, subjects: Sequence[str] = ("fleet.>",), from_seq: int = 1,
                      until_seq: int | None = None, stream: str = STREAM) -> AsyncIterator[list[Msg]]:
    """Yield batches of messages on `subjects` from `from_seq` to the head (or `until_seq`)."""
    js = bus.js
    name = f"read-{time.time_ns()}"
    cfg = ConsumerConfig(
        name=name, filter_subjects=list(subjects), ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE if from_seq > 1 else DeliverPolicy.ALL,
        opt_start_seq=from_seq if from_seq > 1 else None, inactive_threshold=120.0, mem_storage=True,
    )
    info = await js.add_consumer(stream, cfg)
    try:
        if not info.num_pending:
            return
        psub = await js.pull_subscribe_bind(name, stream=stream)
        try:
            while True:
                try:
                    msgs = await psub.fetch(READ_BATCH, timeout=2.0)
                except (nats.errors.TimeoutError, TimeoutError):
                    return
                if until_seq is not None:
                    kept = [m for m in msgs if m.metadata.sequence.stream <= until_seq]
                    if kept:
                        yield kept
                    if len(kept) < len(msgs) or (kept and kept[-1].metadata.sequence.stream >= until_seq):
                        return
                else:
                    yield msgs
                if msgs[-1].metadata.num_pending == 0:
                    return
        finally:
            await psub.unsubscribe()
    finally:
        try:
            await js.delete_consumer(stream, name)
        except Exception:  # noqa: BLE001 - it expires by itself
            pass
