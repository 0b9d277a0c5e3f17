"""Snapshots of a core's folded state, so that no cost of a service grows with the log.

A snapshot is the state after stream sequence `seq` (every event of the core's subjects up to
it folded), plus what the runtime needs to go on from there exactly as if it had folded: the
last sequence on its compare-and-set subject and the ids of its own outputs it has already
evolved but not yet seen come back (they are skipped when the tail brings them). A start, a lost
compare-and-set and a failed publish each restore the newest snapshot and fold only the tail.

- Kept twice: in memory (the last committed point, for a rollback) and in a JetStream object
  store bucket per core (`SNAP_<core>`, object `<core>`), for a restart; replicas of one core
  share it (the fold is deterministic).
- Stamped with the core, a format (the core's `state_format` and the fields of its state
  type: a changed state class never loads an old snapshot), the stream's creation time (a
  snapshot of another log is not this one's) and an HMAC-SHA256 of the blob with the core's
  snapshot key from its credentials (shared/trust/authz.py), so a tampered snapshot is refused
  before it is unpickled. Only the core's own identity may write its bucket.
- A snapshot that does not check out is skipped, loudly, for a full fold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import hmac
import json
import logging
import os
import pickle
import signal
import struct
import time
import zlib
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 1  # of the container (header + blob); a core's own format is its `state_format`
BUCKET_PREFIX = "SNAP_"


def bucket_for(core: str) -> str:
    return f"{BUCKET_PREFIX}{core}"


def state_fingerprint(core: Any, state: Any) -> str:
    """The core's state format: its `state_format` and the fields of its state type (a state class
    that gained or lost a field reads no snapshot of the old shape)."""
    kind = type(state)
    fields = [f"{f.name}:{f.type}" for f in dataclasses.fields(kind)] if dataclasses.is_dataclass(kind) else []
    text = f"{getattr(core, 'state_format', 1)}|{kind.__module__}.{kind.__qualname__}|{','.join(fields)}"
    if ident := snapshot_identity(core):  # (a core whose state depends on more than the log: the executor's nodes)
        text += f"|{ident}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def snapshot_identity(core: Any) -> str:
    """What besides the log decides a core's state (`Core.snapshot_identity`, '' for most): the
    executor's state holds only what its own nodes run, so the executors of different nodes
    (one per GPU node) must neither share nor read each other's snapshot."""
    return str(getattr(core, "snapshot_identity", "") or "")


def object_name(core: Any) -> str:
    """The core's newest snapshot's object: its name, and its identity's digest where it has one."""
    ident = snapshot_identity(core)
    return f"{core.name}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}" if ident else str(core.name)


@dataclass(frozen=True)
class Snapshot:
    """One committed point of a core: the pickled state and where it stands in the log."""

    core: str
    fingerprint: str
    seq: int  # every event of the core's subjects up to here is folded
    last_cas_seq: int
    own: tuple[str, ...]  # own outputs evolved already, published after `seq`
    stream_created: str  # the log it belongs to
    blob: bytes  # pickle(state), zlib-compressed when `compressed`
    taken_at: float = 0.0
    # An in-memory rollback point stays uncompressed (zlib was about half of taking one); a
    # point is compressed only when it is stored, and a stored one always is.
    compressed: bool = True

    def state(self) -> Any:
        raw = zlib.decompress(self.blob) if self.compressed else self.blob
        return pickle.loads(raw)  # noqa: S301 - checked by its HMAC first

    def packed(self) -> bytes:
        """The blob as stored: compressed."""
        return self.blob if self.compressed else zlib.compress(self.blob, 1)

    def encode(self, key: bytes | None) -> bytes:
        blob = self.packed()
        header = {"format": SNAPSHOT_FORMAT, "core": self.core, "fingerprint": self.fingerprint, "seq": self.seq,
                  "last_cas_seq": self.last_cas_seq, "own": list(self.own), "stream_created": self.stream_created,
                  "taken_at": self.taken_at, "size": len(blob), "mac": _mac(key, blob, self.seq)}
        h = json.dumps(header).encode()
        return struct.pack(">I", len(h)) + h + blob


def take(core: Any, state: Any, seq: int, last_cas_seq: int, own: set[str], stream_created: str,
         compress: bool = True) -> Snapshot:
    blob = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    if compress:
        blob = zlib.compress(blob, 1)
    return _point(core, state, seq, last_cas_seq, own, stream_created, blob, compress)


def _point(core: Any, state: Any, seq: int, last_cas_seq: int, own: set[str], stream_created: str, blob: bytes,
           compressed: bool) -> Snapshot:
    return Snapshot(core.name, state_fingerprint(core, state), seq, last_cas_seq, tuple(sorted(own)),
                    stream_created, blob, time.time(), compressed=compressed)


# A large state pickles for 0.3-1 s (the placer's at 5,000 nodes and 20,000 jobs: 18 MB), and that
# long the process's loop stood still: in a group, every co-located service with it. Where the
# system can fork, a point of a state that took FORK_FROM_S or more is pickled by a forked child
# instead (the state as it was at the fork: the child's copy-on-write memory), its bytes read
# back through a pipe by a thread; the loop goes on meanwhile. GPUFLEET_POINT_FORK=0 turns it off.
FORK_FROM_S = 0.01


def point_fork() -> bool:
    """Whether a slow point is pickled by a forked child (read each time: tests turn it on and off)."""
    return os.environ.get("GPUFLEET_POINT_FORK", "1") != "0" and hasattr(os, "fork") and hasattr(os, "wait4")


class ForkedPoint:
    """A rollback point being pickled by a forked child: `result()` is the Snapshot and the
    CPU seconds the child spent (user + system), or raises if the child failed."""

    def __init__(self, core: Any, state: Any, seq: int, last_cas_seq: int, own: set[str], stream_created: str) -> None:
        self._point = _point(core, state, seq, last_cas_seq, own, stream_created, b"", compressed=False)
        self.seq = seq
        t0 = time.perf_counter()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: pickle, write, exit; nothing else of the parent runs here
            code = 1
            try:
                os.close(r)
                signal.set_wakeup_fd(-1)  # a signal to the child must not wake the parent's loop
                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_DFL)
                gc.disable()
                view = memoryview(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
                while view:
                    view = view[os.write(w, view):]
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        self.fork_s = time.perf_counter() - t0  # what the parent paid (its page tables copied)
        self._pid, self._fd = pid, r

    def _collect(self) -> tuple[bytes, float, int]:
        chunks = []
        try:
            while chunk := os.read(self._fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(self._fd)
        _, status, usage = os.wait4(self._pid, 0)
        return b"".join(chunks), usage.ru_utime + usage.ru_stime, os.waitstatus_to_exitcode(status)

    async def result(self) -> tuple[Snapshot, float]:
        blob, cpu_s, code = await asyncio.to_thread(self._collect)
        if code != 0 or not blob:
            raise RuntimeError(f"the child pickling {self._point.core}'s point exited with {code}")
        return dataclasses.replace(self._point, blob=blob), cpu_s + self.fork_s


class SnapshotRefused(ValueError):
    """Why a stored snapshot is not used (the runtime folds in full instead)."""


def decode(data: bytes, key: bytes | None, core: Any, state_template: Any, stream_created: str) -> Snapshot:
    """The stored snapshot, checked: container format, core, state format, log, size and MAC."""
    try:
        (n,) = struct.unpack(">I", data[:4])
        header = json.loads(data[4:4 + n])
        blob = data[4 + n:]
    except (struct.error, ValueError) as exc:
        raise SnapshotRefused(f"not a snapshot ({exc})") from None
    if header.get("format") != SNAPSHOT_FORMAT:
        raise SnapshotRefused(f"container format {header.get('format')}, this code reads {SNAPSHOT_FORMAT}")
    if header.get("core") != core.name:
        raise SnapshotRefused(f"a snapshot of {header.get('core')!r}, not {core.name!r}")
    want = state_fingerprint(core, state_template)
    if header.get("fingerprint") != want:
        raise SnapshotRefused(f"state format {header.get('fingerprint')}, this code's is {want}")
    if header.get("stream_created") != stream_created:
        raise SnapshotRefused("it belongs to another log (the stream was created at "
                              f"{header.get('stream_created')}, this one at {stream_created})")
    if header.get("size") != len(blob):
        raise SnapshotRefused(f"truncated: {len(blob)} of {header.get('size')} bytes")
    seq = int(header["seq"])
    if not hmac.compare_digest(str(header.get("mac", "")), _mac(key, blob, seq)):
        raise SnapshotRefused("its MAC does not match: corrupt, or not written by this core's identity")
    return Snapshot(core.name, want, seq, int(header["last_cas_seq"]), tuple(header.get("own", ())),
                    stream_created, blob, float(header.get("taken_at", 0.0)))


def _mac(key: bytes | None, blob: bytes, seq: int) -> str:
    msg = seq.to_bytes(8, "big") + blob
    if key is None:  # a server without identities: integrity only
        return "sha256:" + hashlib.sha256(msg).hexdigest()
    return "hmac:" + hmac.new(key, msg, hashlib.sha256).hexdigest()


async def open_bucket(bus: Any, bucket: str, create: bool, description: str) -> Any:
    """A snapshot bucket (JetStream object store, file storage); None when it is not there and
    `create` is false."""
    import nats.js.errors

    try:
        return await bus.js.object_store(bucket)
    except (nats.js.errors.NotFoundError, nats.js.errors.BucketNotFoundError):
        if not create:
            return None
        from nats.js.api import ObjectStoreConfig, StorageType

        return await bus.js.create_object_store(bucket, ObjectStoreConfig(
            description=description, storage=StorageType.FILE, replicas=bus.replicas))


class SnapshotStore:
    """A core's snapshots in its JetStream object store bucket (`SNAP_<name>`), one object per
    point: `<name>` for a core's newest, others by name (the view's points, shared by its readers)."""

    def __init__(self, bus: Any, core: Any, key: bytes | None) -> None:
        self.bus, self.core, self.key = bus, core, key
        self._obs: Any = None

    async def _store(self, create: bool) -> Any:
        if self._obs is None:
            self._obs = await open_bucket(self.bus, bucket_for(self.core.name), create,
                                          f"snapshots of the {self.core.name} core's state (shared/runtime/snapshots.py)")
        return self._obs

    async def save(self, snap: Snapshot, name: str | None = None) -> None:
        obs = await self._store(create=True)
        # zlib lets go of the GIL while it compresses: a large point's 50-100 ms off the loop
        data = await asyncio.to_thread(snap.encode, self.key) if not snap.compressed else snap.encode(self.key)
        await obs.put(name or object_name(self.core), data)

    async def load(self, state_template: Any, stream_created: str, name: str | None = None) -> Snapshot | None:
        """The stored snapshot (the newest, or object `name`) if it checks out; None (with the
        reason logged) if not."""
        import nats.js.errors

        try:
            obs = await self._store(create=False)
            if obs is None:
                return None
            res = await obs.get(name or object_name(self.core))
        except (nats.js.errors.NotFoundError, nats.js.errors.ObjectNotFoundError, nats.js.errors.BucketNotFoundError):
            return None
        except Exception as exc:  # noqa: BLE001 - a snapshot is an optimisation: fold in full
            log.warning("%s: cannot read its snapshot (%s: %s); folding the whole log", self.core.name,
                        type(exc).__name__, exc)
            return None
        try:
            return decode(res.data or b"", self.key, self.core, state_template, stream_created)
        except SnapshotRefused as exc:
            log.warning("%s: snapshot refused: %s; folding the whole log", self.core.name, exc)
            return None
