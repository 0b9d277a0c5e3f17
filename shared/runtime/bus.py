"""The bus: NATS JetStream connection, the two streams, and the publish paths.

- `publish_batch` writes a list of events as one *atomic batch* (NATS 2.12+): all of them or
  none, optionally guarded by a compare-and-set on a wildcard subject
  (`Nats-Expected-Last-Subject-Sequence` + `-Subject`). This makes a gang placement, or a whole
  batch of decisions, a single conditional write.
- Every message carries `Nats-Msg-Id` = event id, so the server drops re-published copies.
- nats-py 2.16's `publish_async` never resolves a future whose publish the server rejected
  (PROBE.md), so every wait here is bounded by a timeout.
- With tracing set up (shared/runtime/otel.py) every event also carries W3C `traceparent` (and
  `tracestate`): the context of the span that decided it, else the caller's current span.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NatsClient
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.client import JetStreamContext

from gpufleet.shared.contract.errors import CasConflict, GpufleetError, PermanentError, RetryableError
from gpufleet.shared.contract.events import STREAM, TELEMETRY_STREAM, Envelope
from gpufleet.shared.runtime import headers, otel
from gpufleet.shared.trust.authz import Creds, find_creds

log = logging.getLogger(__name__)
headers.install()  # nats-py's header parse, by the header (shared/runtime/headers.py)

ATOMIC_BATCH_MAX = 500  # the server accepts up to 1000 messages in one atomic batch
ERR_WRONG_LAST_SEQ = 10071
ERR_BATCH_DUP_ID = 10201
ERR_DUP_IN_PROCESS = 10158  # a copy of this Nats-Msg-Id is still being stored: ask again for its ack
DUPLICATE_WINDOW_S = 120.0
TELEMETRY_MAX_AGE_S = 6 * 3600.0
PUBLISH_TIMEOUT_S = 10.0
# A server that went silent without closing the connection (its host cut off the network: a
# partition, tests/test_partition.py) is given up after this many unanswered pings, one every
# PING_INTERVAL_S, and the client reconnects to another server of the cluster. nats-py's default
# (2 pings 120 s apart) left a service on a partitioned node stuck for ~6 minutes.
PING_INTERVAL_S = int(os.environ.get("GPUFLEET_NATS_PING_S", "5"))
MAX_OUTSTANDING_PINGS = 3
# Unconditional publishes of this many events or more go as atomic batches (0: never). The
# crossover is for a server that fsyncs every write (`sync_interval: always`, the embedded
# default); a server that syncs lazily writes pipelined messages cheaper than batches.
ATOMIC_FROM = int(os.environ.get("GPUFLEET_ATOMIC_FROM",
                                 "12" if os.environ.get("GPUFLEET_NATS_SYNC", "always") == "always" else "0"))
STREAM_WAIT_S = 300.0
# A server that answers pings but not JetStream (it is on the minority side of a partition: its
# routes to the quorum are cut, tests/test_partition.py) holds its clients for as long as the cut
# lasts. With several servers known (listed, or told by the first one), the bus asks JetStream for its account info every
# JS_WATCH_S and moves to another server once it has gone unanswered for JS_FAILOVER_S.
JS_WATCH_S = float(os.environ.get("GPUFLEET_JS_WATCH_S", "1"))
JS_FAILOVER_S = float(os.environ.get("GPUFLEET_JS_FAILOVER_S", "3"))


def fleet_stream_config(replicas: int = 1) -> StreamConfig:
    from gpufleet.shared.runtime.archive import retention_s

    archived = retention_s() is not None  # with a retention the archive process purges what it archived
    return StreamConfig(
        name=STREAM,
        subjects=["fleet.cmd.>", "fleet.evt.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        duplicate_window=DUPLICATE_WINDOW_S,
        allow_atomic=True,
        allow_direct=True,
        max_msg_size=1024 * 1024,
        # the log cannot be erased through the API: no deletion of a message, and no purge but the
        # archive process's of what it has archived first (shared/runtime/archive.py), when a retention is set
        deny_delete=True,
        deny_purge=not archived,
        # at a limit (the server's max_file_store, a max_bytes) refuse new writes, loudly, instead
        # of dropping the oldest events: a fold from sequence 1 of a log without its head is wrong
        discard=DiscardPolicy.NEW,
    )


def telemetry_stream_config(replicas: int = 1) -> StreamConfig:
    return StreamConfig(
        name=TELEMETRY_STREAM,
        subjects=["fleet.tel.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=TELEMETRY_MAX_AGE_S,
        discard=DiscardPolicy.OLD,
        duplicate_window=10.0,
        allow_direct=True,
        allow_atomic=True,  # a sim world's round of samples goes as batches (publish_telemetry_many)
    )


def _covers(have: StreamConfig, want: StreamConfig) -> bool:
    """The stream as it is already has what `want` asks for (no update needed)."""
    keys = ("subjects", "retention", "storage", "num_replicas", "duplicate_window", "allow_atomic",
            "allow_direct", "max_msg_size", "deny_delete", "deny_purge", "max_age", "discard")
    return all(getattr(have, k, None) == getattr(want, k, None) or getattr(want, k, None) is None
               for k in keys)


T = TypeVar("T")
# what a connected client gets while JetStream does not answer (a cluster electing the stream's
# leader, a server restarting): worth trying again for a while
UNANSWERED: tuple[type[BaseException], ...] = (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError)


async def while_unanswered(fn: Callable[[], Awaitable[T]], within_s: float, *, pause_s: float = 0.5,
                           errors: tuple[type[BaseException], ...] = UNANSWERED,
                           on_retry: Callable[[BaseException], None] | None = None) -> T:
    """`await fn()`, again (after `pause_s`) while it fails with `errors`, for up to `within_s`;
    then the last error is raised. `on_retry` is told of each failure that is tried again."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await fn()
        except errors as exc:
            if time.monotonic() > deadline:
                raise
            if on_retry is not None:
                on_retry(exc)
            await asyncio.sleep(pause_s)

@dataclass(frozen=True)
class Cas:
    """Publish only if the last message on `subject` (wildcards allowed) has sequence `last_seq`."""

    subject: str
    last_seq: int


def _headers(env: Envelope) -> dict[str, str]:
    """Nats-Msg-Id (the server drops a re-published copy), and the trace context if tracing."""
    headers = {"Nats-Msg-Id": env.event_id}
    if otel.TRACING:
        headers.update(otel.inject_headers(env))
    return headers


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match: '*' one token, '>' one or more trailing tokens."""
    p = pattern.split(".")
    s = subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


class Bus:
    def __init__(self, nc: NatsClient, replicas: int | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
        # 1 on one machine, 3 in a cluster (GPUFLEET_STREAM_REPLICAS=3 in docker-compose / k8s)
        self.replicas = int(os.environ.get("GPUFLEET_STREAM_REPLICAS", "1")) if replicas is None else replicas
        self._batch_counter = 0
        self._telemetry_atomic = True  # until the telemetry stream refuses a batch
        self.creds: Creds | None = None  # who this connection is (None: a server without auth)
        self._watch: asyncio.Task[None] | None = None
        self._closing = False
        self.failovers = 0  # moves to another server because this one did not answer JetStream

    @property
    def tenant_scope(self) -> str | None:
        """The tenant this connection may read for, when it is a tenant's (it reads its own
        subjects only, through push consumers: shared/runtime/log.py)."""
        return self.creds.tenant if self.creds is not None else None

    @classmethod
    async def connect(cls, url: str, name: str = "gpufleet", replicas: int | None = None,
                      creds: Creds | str | Path | None = None, **kw: Any) -> Bus:
        """`url` may list several servers, comma-separated (a cluster). `creds`: the identity
        (shared/trust/authz.py), by default $GPUFLEET_CREDS's; none for a server without auth."""
        servers = [u.strip() for u in url.split(",") if u.strip()]
        ident = creds if isinstance(creds, Creds) else find_creds(creds)
        opts: dict[str, Any] = {"name": name, "max_reconnect_attempts": -1, "reconnect_time_wait": 0.5,
                                "connect_timeout": 5, "ping_interval": PING_INTERVAL_S,
                                "max_outstanding_pings": MAX_OUTSTANDING_PINGS}
        if ident is not None:
            opts.update(ident.connect_options())
        opts.update(kw)
        nc = await nats.connect(servers, **opts)
        bus = cls(nc, replicas=replicas)
        bus.creds = ident
        if JS_WATCH_S > 0:  # it moves only where the pool holds another server (listed, or learnt from INFO)
            bus._watch = asyncio.create_task(bus.watch_server(), name=f"{name}-js-watch")
        return bus

    async def watch_server(self) -> None:
        """Move to another server of the cluster while this one does not answer JetStream.

        A partition leaves a server connected to its clients but cut from the quorum: every
        publish and fetch through it times out, and nats-py does not move (the server answers its
        pings). Every JS_WATCH_S this asks for the account info ($JS.API.INFO, which every identity
        may ask); unanswered for JS_FAILOVER_S on end, the connection is moved to the next server
        of the pool (`force_reconnect`: subscriptions are made again there, the JetStream consumers
        live in the cluster and are found again). A whole cluster without a leader moves the
        connection round the pool, which costs a reconnect each time and nothing else."""
        failing_since: float | None = None
        first = True
        while not self.nc.is_closed and not self._closing:
            if not first:  # the first look at once: a client that lands on a cut server finds out soonest
                await asyncio.sleep(JS_WATCH_S)
            first = False
            if not self.nc.is_connected:
                failing_since = None  # nats-py is reconnecting by itself
                continue
            try:
                reply = await self.nc.request("$JS.API.INFO", b"", timeout=max(0.5, JS_WATCH_S * 1.5))
                if b'"error"' not in reply.data:  # a minority server answers 503 "temporarily unavailable"
                    failing_since = None
                    continue
            except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
                pass
            except Exception:  # noqa: BLE001 - closing, draining, a reconnect under way: look again later
                continue
            now = time.monotonic()
            failing_since = failing_since or now
            if now - failing_since < JS_FAILOVER_S or len(self.nc.servers) < 2:
                continue
            why = f"has not answered JetStream for {now - failing_since:.1f} s (cut from the cluster's quorum?)"
            failing_since = None
            await self.move_server(why)

    async def move_server(self, why: str) -> bool:
        """Move to another server of the pool now (a client whose publishes go unanswered here,
        while this server may still answer the watch's probe: a server cut from the quorum can
        serve what it has locally). False when the pool has no other server."""
        if len(self.nc.servers) < 2 or not self.nc.is_connected or self._closing:
            return False
        url = self.nc.connected_url.netloc if self.nc.connected_url else "?"
        log.warning("NATS server %s %s: moving to another server", url, why)
        self.failovers += 1
        try:
            await self.nc.force_reconnect()
        except Exception:  # noqa: BLE001 - nats-py goes on reconnecting by itself
            log.exception("moving to another NATS server")
        return True

    async def close(self) -> None:
        if self._watch is not None:
            # a flag as well as the cancel: nats-py's request can turn a cancel into its own error,
            # which the watch takes for an unanswered probe (seen: close waited for ever)
            self._closing = True
            self._watch.cancel()
            await asyncio.wait({self._watch}, timeout=2 * JS_WATCH_S + 1)
            self._watch = None
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.flush(), 2.0)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            try:  # bounded: a command's close must not outlast the command (a reconnect may be under way)
                await asyncio.wait_for(self.nc.close(), 5.0)
            except TimeoutError:
                log.warning("closing the NATS connection took over 5 s; left to the process's end")

    async def ensure_streams(self) -> None:
        """Create or update FLEET and FLEET_TELEMETRY; safe to call from every service at start.
        A stream already as configured is left alone (only the admin may create or update one:
        a service with the mesh's permissions just checks)."""
        if self.creds is None or self.creds.is_admin:
            from gpufleet.shared.runtime.lease import ensure_bucket

            await ensure_bucket(self)  # one active instance of a leased service (shared/runtime/lease.py)
        for name, cfg in ((STREAM, fleet_stream_config(self.replicas)),
                          (TELEMETRY_STREAM, telemetry_stream_config(self.replicas))):
            try:
                info = await self.js.stream_info(name)
                if (info.config.num_replicas or 1) > (cfg.num_replicas or 1):
                    # never lower a cluster's replication from a service started with the default
                    cfg.num_replicas = info.config.num_replicas
                if _covers(info.config, cfg) or (self.creds is not None and not self.creds.is_admin):
                    continue  # (a service or tenant may not change it: the admin's config holds)
                if name == STREAM and info.config.deny_purge and not cfg.deny_purge:
                    raise GpufleetError(
                        "retention: this log was created to keep everything (the server forbids purging it for "
                        "good), so a retention cannot be added to it; keep it without --retention, or start a "
                        "new data dir with one")
                await self.js.update_stream(cfg)
            except nats.js.errors.NotFoundError:
                if self.creds is not None and not self.creds.is_admin:
                    await self._wait_for_stream(name)
                    continue
                try:
                    await self.js.add_stream(cfg)
                except nats.js.errors.BadRequestError as exc:
                    # a concurrent creator won the race
                    if "already in use" not in str(exc):
                        raise

    async def _wait_for_stream(self, name: str, timeout_s: float = STREAM_WAIT_S) -> None:
        """A service started before the admin created the streams (a fresh cluster, a cluster
        without quorum yet): wait for it, saying so, instead of failing on a create it may not do."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        said = 0.0
        while True:
            try:
                await self.js.stream_info(name)
                return
            except (nats.js.errors.NotFoundError, nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
                now = asyncio.get_running_loop().time()
                if now > deadline:
                    raise RetryableError(f"stream {name} does not exist after {timeout_s:.0f}s: the admin creates it "
                                         "(gpufleet up does; in a cluster, the streams job)") from None
                if now - said > 10:
                    log.warning("waiting for stream %s (the admin creates it; or JetStream has no quorum yet)", name)
                    said = now
                await asyncio.sleep(0.5)

    async def last_seq(self, stream: str = STREAM) -> int:
        info = await self.js.stream_info(stream)
        return int(info.state.last_seq)

    async def publish(self, env: Envelope, cas: Cas | None = None, headers_extra: dict[str, str] | None = None,
                      ack_within_s: float | None = None, dups: list[tuple[int, Envelope]] | None = None) -> int:
        """Publish one event and wait for its ack (up to `ack_within_s`, PUBLISH_TIMEOUT_S by default);
        returns the stream sequence. A copy the server already held (its Nats-Msg-Id within the
        duplicate window) is not written again: its sequence comes back, and with `dups` the
        pair (sequence, this event) is noted, since what the stream holds there may be another
        instance's version of the same decision."""
        headers = {**(headers_extra or {}), "Nats-Msg-Id": env.event_id}
        if otel.TRACING:
            headers.update(otel.inject_headers(env))
        if cas is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(cas.last_seq)
            headers["Nats-Expected-Last-Subject-Sequence-Subject"] = cas.subject
        try:
            ack = await self.js.publish(env.subject(), env.to_json(), headers=headers, timeout=ack_within_s)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code == ERR_WRONG_LAST_SEQ:
                raise CasConflict(str(exc)) from None
            raise PermanentError(str(exc)) from None
        except (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError,
                nats.js.errors.ServiceUnavailableError) as exc:
            raise RetryableError(f"publish {env.type}: {exc!r}") from None
        except nats.js.errors.APIError as exc:
            if exc.err_code == ERR_DUP_IN_PROCESS:  # a re-send overtook the first copy, still in the cluster
                raise RetryableError(f"publish {env.type}: {exc!r}") from None
            raise
        if ack.duplicate and dups is not None:
            dups.append((int(ack.seq), env))
        return int(ack.seq)

    async def publish_many(self, envs: Sequence[Envelope], dups: list[tuple[int, Envelope]] | None = None) -> list[int]:
        """Publish unconditionally: ATOMIC_FROM events or more as atomic batches, fewer pipelined
        (publish_async), every ack awaited with a timeout.

        Why both: with `sync_interval: always` (the embedded default) the server fsyncs every
        message it is given alone, and an atomic batch once (`gpufleet bench bus`: 256 events in
        67.2 ms pipelined, 9.7 ms as one batch; server CPU 117 vs 27 µs an event), while committing
        a batch costs the server a fixed ~3 ms: below ~10 events pipelining is quicker.
        Pipelined is not atomic: after a crash some may be written and others not; the derived
        ids and idempotent decisions make the re-decision write only the missing ones.
        """
        if not envs:
            return []
        if ATOMIC_FROM and len(envs) >= ATOMIC_FROM:
            return await self.publish_batch(envs, dups=dups)
        futs = [
            await self.js.publish_async(e.subject(), e.to_json(), headers=_headers(e))
            for e in envs
        ]
        try:
            acks = await asyncio.wait_for(asyncio.gather(*futs), PUBLISH_TIMEOUT_S)
        except (TimeoutError, nats.errors.TimeoutError, nats.js.errors.APIError) as exc:
            for f in futs:
                f.cancel()
            raise RetryableError(f"publish of {len(envs)} events: {exc!r}") from None
        if dups is not None:
            dups.extend((int(a.seq), e) for a, e in zip(acks, envs, strict=True) if a.duplicate)
        return [int(a.seq) for a in acks]

    async def publish_batch(self, envs: Sequence[Envelope], cas: Cas | None = None,
                            dups: list[tuple[int, Envelope]] | None = None,
                            mark: Callable[[Sequence[Envelope]], Envelope] | None = None,
                            marks: list[tuple[int, Envelope]] | None = None) -> list[int]:
        """Publish events as atomic batches of up to ATOMIC_BATCH_MAX; returns their sequences.

        With `cas`, the first batch is conditional on `cas.last_seq`, and each following batch on
        the last matching sequence the previous one wrote, so the whole list is one decision.
        Raises CasConflict when someone else wrote on the guarded subject first.
        With `mark`, each batch ends with `mark(batch)`, an event on the guarded subject (the
        runtime's `sys.capacity_committed`): a reader that has folded it has folded its whole
        batch. Its (sequence, event) goes to `marks`.
        """
        seqs: list[int] = []
        guard = cas
        size = ATOMIC_BATCH_MAX - (1 if mark is not None else 0)
        for start in range(0, len(envs), size):
            chunk = list(envs[start:start + size])
            if mark is not None:
                chunk.append(mark(chunk))
            chunk_seqs = await self._atomic(chunk, guard, dups, whole=mark is not None)
            if mark is not None and marks is not None:
                marks.append((chunk_seqs[-1], chunk[-1]))
            seqs.extend(chunk_seqs[:-1] if mark is not None else chunk_seqs)
            if guard is not None:
                last = guard.last_seq
                for env, seq in zip(chunk, chunk_seqs, strict=True):
                    if subject_matches(guard.subject, env.subject()):
                        last = max(last, seq)  # (a copy held from before may sit behind the guard)
                guard = Cas(guard.subject, last)
        return seqs

    async def _atomic(self, envs: Sequence[Envelope], cas: Cas | None,
                      dups: list[tuple[int, Envelope]] | None = None, whole: bool = False) -> list[int]:
        """One atomic batch. `whole`: it ends with a marker on the guarded subject, the only one
        of its events that moves the guard, so it cannot go one by one (see below)."""
        if not envs:
            return []
        if len(envs) == 1:
            # One event is all or nothing by itself, and an atomic batch costs an R1 file stream a
            # store of its own, made and removed for the batch (nats-server's newBatchStore: files,
            # metadata written with an fsync), ~3.7 ms of the server's CPU against ~0.1-0.3 ms for a
            # plain publish under the same guard (`_one_by_one`, which also reads a copy held from
            # before as the atomic path's fallback does).
            if cas is None:
                return [await self.publish(envs[0], dups=dups)]
            return await self._one_by_one(envs, cas, dups)
        self._batch_counter += 1
        batch_id = f"{envs[0].event_id}-{self._batch_counter}"
        n = len(envs)
        for i, env in enumerate(envs, 1):
            headers = {"Nats-Msg-Id": env.event_id, "Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(i)}
            if otel.TRACING:
                headers.update(otel.inject_headers(env))
            if i == 1 and cas is not None:
                headers["Nats-Expected-Last-Subject-Sequence"] = str(cas.last_seq)
                headers["Nats-Expected-Last-Subject-Sequence-Subject"] = cas.subject
            if i < n:
                await self.nc.publish(env.subject(), env.to_json(), headers=headers)
                continue
            headers["Nats-Batch-Commit"] = "1"
            try:
                reply = await self.nc.request(env.subject(), env.to_json(), headers=headers, timeout=PUBLISH_TIMEOUT_S)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
                raise RetryableError(f"atomic batch of {n}: {exc!r}") from None
            ack = json.loads(reply.data)
            err = ack.get("error")
            if err:
                code = err.get("err_code")
                if code == ERR_WRONG_LAST_SEQ:
                    raise CasConflict(err.get("description", "wrong last sequence"))
                if code == ERR_BATCH_DUP_ID:
                    if whole:
                        # One by one, the events before the marker would be written under a guard
                        # they do not move: a rival could commit between them, on a view without
                        # them (one GPU booked twice, seen in the chaos test's audit). A copy held
                        # from before is this writer's own commit whose ack was lost, or a rival's
                        # same decision: either way the log holds what this view lacks.
                        raise CasConflict(f"atomic batch of {n} holds events written before: "
                                          "the log holds a commit this decision did not see")
                    # Some of these were written before (a crash between publish and ack):
                    # fall back to one-by-one, where the server drops the duplicates.
                    return await self._one_by_one(envs, cas, dups)
                raise RetryableError(f"atomic batch rejected: {err}")
            last = int(ack["seq"])
            return list(range(last - n + 1, last + 1))
        raise AssertionError("unreachable")

    async def _one_by_one(self, envs: Sequence[Envelope], cas: Cas | None,
                          dups: list[tuple[int, Envelope]] | None = None) -> list[int]:
        """The events one at a time, each under the guard: it moves to this call's own writes on
        the guarded subject. A copy the server held already is answered with its sequence, and a
        JetStream cluster answers a duplicate before it checks the expected sequence: a copy
        beyond the guard is another writer's (the rival placer decided the same cause), so this
        decision was made without what came before it on the subject, and the rest of it must not
        go out (it would pass the guard moved to that copy: one GPU booked by two placers, seen in
        the 10,000-job `bench chaos`). CasConflict then, as the atomic batch would have."""
        seqs = []
        guard = cas
        for env in envs:
            held: list[tuple[int, Envelope]] = []
            seq = await self.publish(env, guard, dups=held)
            seqs.append(seq)
            if dups is not None:
                dups.extend(held)
            if guard is None or not subject_matches(guard.subject, env.subject()):
                continue  # (the guard on another subject than the outputs': it stays as it is)
            if not held:
                guard = Cas(guard.subject, seq)
            elif seq > guard.last_seq:
                raise CasConflict(f"{env.type} {env.event_id} was written before, at seq {seq}, by another "
                                  f"writer: past this decision's view of {guard.subject} (seq {guard.last_seq})")
        return seqs

    async def publish_telemetry(self, subject: str, data: bytes) -> None:
        """Samples: fire-and-forget into FLEET_TELEMETRY (the stream captures core publishes)."""
        await self.nc.publish(subject, data)

    async def publish_telemetry_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """A round of samples of many nodes (one process sampling a sim world of thousands): as
        atomic batches of ATOMIC_BATCH_MAX when there are ATOMIC_FROM or more, since a server
        that fsyncs each write would otherwise sync every node's document alone (5,000 sim
        nodes every 5 s: 1,000 fsyncs a second). A refused batch (a stream made before it allowed
        batches) is logged, and it and the rest of the round go one by one, as do later rounds."""
        if not (ATOMIC_FROM and self._telemetry_atomic and len(items) >= ATOMIC_FROM):
            for subject, data in items:
                await self.nc.publish(subject, data)
            return
        for start in range(0, len(items), ATOMIC_BATCH_MAX):
            chunk = items[start:start + ATOMIC_BATCH_MAX]
            self._batch_counter += 1
            batch_id = f"tel-{id(self):x}-{self._batch_counter}"
            for i, (subject, data) in enumerate(chunk, 1):
                headers = {"Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(i)}
                if i < len(chunk):
                    await self.nc.publish(subject, data, headers=headers)
                    continue
                headers["Nats-Batch-Commit"] = "1"
                try:
                    reply = await self.nc.request(subject, data, headers=headers, timeout=PUBLISH_TIMEOUT_S)
                    err = json.loads(reply.data).get("error")
                except (nats.errors.TimeoutError, nats.errors.NoRespondersError, ValueError) as exc:
                    err = repr(exc)
                if err:
                    log.warning("telemetry batch of %d refused (%s): samples go one by one", len(chunk), err)
                    self._telemetry_atomic = False
                    for subject2, data2 in items[start:]:
                        await self.nc.publish(subject2, data2)
                    return


async def wait_for(coro: Any, timeout_s: float) -> Any:
    return await asyncio.wait_for(coro, timeout_s)


async def run_until_signal(nats_url: str, name: str, make: Callable[[Bus], Any]) -> None:
    """Connect as `name`, build the worker (anything with `run()` and `stop()`: the read-model
    projector, billing's ledger) and run it until SIGINT / SIGTERM."""
    import signal

    bus = await Bus.connect(nats_url, name=name)
    worker = make(bus)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, worker.stop)
    try:
        await worker.run()
    finally:
        await bus.close()


class Looping:
    """A worker for `run_until_signal`: waits for FLEET (the admin creates it), then runs
    `body(stop)` until SIGINT / SIGTERM sets `stop` (the view and archive processes)."""

    def __init__(self, bus: Bus, body: Callable[[asyncio.Event], Awaitable[None]]) -> None:
        self.bus, self.body, self._stop = bus, body, asyncio.Event()

    async def run(self) -> None:
        await self.bus._wait_for_stream(STREAM)
        await self.body(self._stop)

    def stop(self) -> None:
        self._stop.set()

