"""The runtime's own fetch (shared/runtime/pull.py) gives what nats-py's fetch gives, on a real nats-server:
every message once and in order across batches, a timeout when nothing comes, late deliveries of a
lingering request at the next fetch, and the sequences read from the ack subject."""

from __future__ import annotations

import asyncio
import time

import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gpufleet.shared.runtime import pull

pytestmark = pytest.mark.no_audit  # (not the contract's events: raw messages on a stream of its own)

STREAM = "PULLTEST"


async def _consumer(bus, name: str = "c"):  # type: ignore[no-untyped-def]
    js = bus.js
    await js.add_stream(name=STREAM, subjects=["pulltest.>"])
    await js.add_consumer(STREAM, ConsumerConfig(durable_name=name, ack_policy=AckPolicy.ALL,
                                                 deliver_policy=DeliverPolicy.ALL))
    return await js.pull_subscribe_bind(name, stream=STREAM)


async def _publish(bus, first: int, n: int) -> None:  # type: ignore[no-untyped-def]
    for i in range(first, first + n):
        await bus.js.publish(f"pulltest.{i % 3}", str(i).encode())


async def test_every_message_once_in_order_across_batches(bus) -> None:  # type: ignore[no-untyped-def]
    psub = await _consumer(bus)
    await _publish(bus, 0, 700)
    got: list[int] = []
    sizes = []
    while len(got) < 700:
        msgs = await pull.fetch(psub, 256, 2.0)
        sizes.append(len(msgs))
        got += [int(m.data) for m in msgs]
        for m in msgs:
            sseq, cseq, delivered = pull.seqs(m)
            assert (sseq, cseq, delivered) == (m.metadata.sequence.stream, m.metadata.sequence.consumer,
                                               m.metadata.num_delivered)
            assert pull.stream_seq(m) == sseq
            assert pull.stored_ms(m) == int(m.metadata.timestamp.timestamp() * 1000)
        await msgs[-1].ack()
    assert got == list(range(700))
    assert max(sizes) == 256  # a full batch when the server has it


async def test_nothing_there_times_out_within_the_time(bus) -> None:  # type: ignore[no-untyped-def]
    psub = await _consumer(bus)
    t0 = time.monotonic()
    with pytest.raises(nats.errors.TimeoutError):
        await pull.fetch(psub, 64, 0.5)
    assert 0.4 <= time.monotonic() - t0 < 2.0


async def test_a_message_published_while_waiting_comes_at_once(bus) -> None:  # type: ignore[no-untyped-def]
    psub = await _consumer(bus)
    fetching = asyncio.ensure_future(pull.fetch(psub, 64, 5.0))
    await asyncio.sleep(0.2)  # (the fetch is waiting on its lingering request)
    t0 = time.monotonic()
    await _publish(bus, 0, 1)
    msgs = await fetching
    assert [int(m.data) for m in msgs] == [0] and time.monotonic() - t0 < 1.0
    # the lingering request stays open for 63 more: what comes next is delivered to the inbox and
    # taken by the next fetch, in order, none twice
    await _publish(bus, 1, 5)
    got: list[int] = []
    while len(got) < 5:
        got += [int(m.data) for m in await pull.fetch(psub, 64, 2.0)]
    assert got == [1, 2, 3, 4, 5]


async def test_the_same_as_nats_py_fetch(bus) -> None:  # type: ignore[no-untyped-def]
    """Two consumers on the same stream, one read with each fetch: the same messages in the same batches."""
    psub = await _consumer(bus, "ours")
    await bus.js.add_consumer(STREAM, ConsumerConfig(durable_name="theirs", ack_policy=AckPolicy.ALL,
                                                     deliver_policy=DeliverPolicy.ALL))
    theirs = await bus.js.pull_subscribe_bind("theirs", stream=STREAM)
    await _publish(bus, 0, 300)
    for want in (100, 100, 100):
        a = await pull.fetch(psub, want, 2.0)
        b = await theirs.fetch(want, timeout=2.0)
        assert [m.data for m in a] == [m.data for m in b] and len(a) == want
