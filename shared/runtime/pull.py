"""A pull consumer's fetch without nats-py's per-message wait, and a JetStream message's sequences
read cheaply.

nats-py 2.16's `PullSubscription.fetch(n)` takes each of the n messages through `next_msg`: a
`uuid4()` for a task name, a task and an `asyncio.wait_for` per message, 15-25 us each. Every
service fetches every event of the log (one broad filter, see subjects.py), so at ~7 events a job
and five consuming processes that was ~35 waits a job. `fetch` here sends the same pull requests
(the same two phases: a `no_wait` request, then a lingering one if nothing was there) to the same
inbox, and takes what the read loop has queued with `get_nowait`, waiting only when the queue is
empty (one timer for the whole fetch, not one a message).

`seqs(msg)` reads the stream and consumer sequences from the ack subject with one split: nats-py's
`Msg.metadata` builds two frozen dataclasses and a datetime (6-9 % of a consumer's samples).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

STATUS = "Status"
NO_MESSAGES, REQUEST_TIMEOUT, CONTROL = "404", "408", "100"
TEMPORARY = frozenset({"404", "408", "409"})  # (nats-py's _is_temporary_error: not an error to raise)


def _usable(psub: Any) -> bool:
    sub = getattr(psub, "_sub", None)
    return (sub is not None and hasattr(sub, "_pending_queue") and hasattr(psub, "_nms")
            and hasattr(psub, "_deliver") and hasattr(psub, "_nc"))


async def fetch(psub: Any, batch: int, timeout_s: float) -> list[Msg]:
    """Up to `batch` messages of the pull consumer bound by `psub`, as `psub.fetch(batch, timeout)`
    gives them: the first within `timeout_s` (else nats.errors.TimeoutError), then what the server
    has at once. Falls back on nats-py's own fetch for a subscription of another shape."""
    if not _usable(psub):
        return list(await psub.fetch(batch, timeout=timeout_s))
    sub, nc = psub._sub, psub._nc
    if nc.is_closed:
        raise nats.errors.ConnectionClosedError
    queue: asyncio.Queue[Msg] = sub._pending_queue
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    msgs: list[Msg] = []

    def got(msg: Msg) -> str | None:
        """One message off the queue: kept, or the status it is (None: kept or a heartbeat)."""
        sub._pending_size -= len(msg.data)
        queue.task_done()  # (a drained subscription joins its queue)
        headers = msg.headers
        status = headers.get(STATUS) if headers else None
        if not status:
            msgs.append(msg)
            return None
        if status in TEMPORARY:
            return status
        if status != CONTROL:
            raise nats.js.errors.APIError.from_msg(msg)
        return None

    def take() -> str | None:
        """What is queued, up to the batch; the status that ends this request, if one came."""
        while len(msgs) < batch:
            try:
                msg = queue.get_nowait()
            except asyncio.QueueEmpty:
                return None
            if (status := got(msg)) is not None:
                return status
        return None

    async def wait() -> str | None:
        """Until one message is queued (and taken: its status, if it is one) or the deadline passes
        (TimeoutError)."""
        left = deadline - loop.time()
        if left <= 0:
            raise TimeoutError
        getter = loop.create_task(queue.get())
        done, _ = await asyncio.wait((getter,), timeout=left)
        if not done:
            getter.cancel()  # (asyncio.Queue.get loses nothing when cancelled)
            raise TimeoutError
        return got(getter.result())

    # what came late for an earlier request (its statuses were for that request)
    while len(msgs) < batch:
        try:
            got(queue.get_nowait())
        except asyncio.QueueEmpty:
            break
    if len(msgs) >= batch:
        return msgs

    # first request: what the server has now, then a 404 (nats-py's first phase, the same request)
    req: dict[str, Any] = {"batch": batch - len(msgs), "no_wait": True}
    if not msgs:
        req["expires"] = max(1, int(timeout_s * 1e9) - 100_000)
    await nc.publish(psub._nms, json.dumps(req).encode(), psub._deliver)
    try:
        while len(msgs) < batch and take() is None and len(msgs) < batch:
            if await wait() is not None:
                break
    except TimeoutError:
        pass
    if msgs:
        take()
        return msgs

    # second request: lingering until a message comes or the time is up
    expires = int((deadline - loop.time()) * 1e9) - 100_000
    if expires <= 0:
        raise nats.errors.TimeoutError
    await nc.publish(psub._nms, json.dumps({"batch": batch, "expires": expires}).encode(), psub._deliver)
    try:
        while not msgs:
            take()
            if not msgs:
                await wait()  # a status here is the first request's late 404 or this one's end
    except TimeoutError:
        raise nats.errors.TimeoutError from None
    take()  # the rest of what is here already; more of this request comes to the next fetch
    return msgs


def _ack_tokens(msg: Any) -> list[str] | None:
    """The tokens of a JetStream message's ack subject in its usual form
    (`$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>`), split once; None for
    the other forms (v2, with domain and account hash; an archived message) and where nats-py has
    parsed its metadata already: those read `Msg.metadata`."""
    if getattr(msg, "_metadata", None) is not None:
        return None
    reply: str | None = getattr(msg, "reply", None)
    if reply and reply.startswith("$JS.ACK."):
        t = reply.split(".")
        if len(t) == 9:
            return t
    return None


def seqs(msg: Any) -> tuple[int, int, int]:
    """(stream sequence, consumer sequence, times delivered) of a JetStream message."""
    t = _ack_tokens(msg)
    if t is not None:
        return int(t[5]), int(t[6]), int(t[4])
    md = msg.metadata  # (raises NotJSMessageError as nats-py does for what is not JetStream's)
    return int(md.sequence.stream), getattr(md.sequence, "consumer", 0), md.num_delivered


def stream_seq(msg: Any) -> int:
    return seqs(msg)[0]


def stored_ms(msg: Any) -> int:
    """When the server stored the message, in ms since the epoch (0: not known)."""
    t = _ack_tokens(msg)
    if t is not None:
        return int(t[7]) // 1_000_000
    ts = msg.metadata.timestamp
    return int(ts.timestamp() * 1000) if ts is not None else 0


class Linger:
    """Let a trickle gather into batches: after a fetch that took only a few messages (more than
    none, fewer than `below`), the next fetch waits `s` first. A fetch that finds nothing waits on
    its lingering request and wakes at the first message, so an idle mesh answers at once; a
    burst fills its batches and never waits. Under a steady trickle (300 jobs/s is ~2,000 events a
    second) each round's fixed costs -- the pull request, the ack, a publish the server fsyncs --
    were paid for 1-3 messages; a few ms of waiting pays them for ten times as many."""

    def __init__(self, s: float, below: int) -> None:
        self.s, self.below = s, below
        self.small = False

    async def before(self) -> None:
        if self.small and self.s > 0:
            self.small = False
            await asyncio.sleep(self.s)

    def after(self, got: int) -> None:
        self.small = 0 < got < self.below
