"""Retention with an archive: what leaves FLEET is archived first, and read back as one log.

FLEET keeps everything by default. With a retention configured (`gpufleet up --retention 30d`,
i.e. `GPUFLEET_LOG_RETENTION`, seconds or a duration), the stream is created without
`deny_purge`, and the mesh's `archive` process (an identity of its own: it may read the stream
and purge it, nothing else) does, every minute:

1. read the oldest events still in the stream, a segment of up to `SEGMENT` events whose every
   event was stored more than the retention ago;
2. write them to `<data-dir>/archive/FLEET-<first>-<last>.jsonl.gz` (one JSON line per message:
   sequence, subject, stored time, headers, data), fsync it, and add it to `manifest.json`
   (atomically) with its SHA-256 chained to the previous segment's;
3. only then purge the stream below the segment's end (`{"seq": last + 1}`), and never below the
   first event one of the mesh's own readers (a service's durable, a ledger, a fold under way)
   has not received yet: a consumer gets only what the stream still holds, so an event purged
   ahead of a lagging service would be lost to it (`reader_floor`). What is held is purged by a
   later round; tenants' own consumers never hold it.

Nothing is dropped that is not archived: the server's own limits never drop events (discard
NEW: at a cap writes are refused, loudly). A reader (`read_stream` (shared/runtime/log.py), and so every
fold, `replay`, `explain`, `audit`) asked for sequences below the stream's first reads them from
the archive when it is on the same machine (`GPUFLEET_ARCHIVE_DIR`, set by the supervisor for its
children), in the same order with the same metadata. `gpufleet audit` checks the archive (each
segment's digest, the chain, no sequence missing) and that it reaches the stream's head
(`head`); `gpufleet status` shows the archive beside the stream's extent.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RETENTION_ENV = "GPUFLEET_LOG_RETENTION"
ARCHIVE_DIR_ENV = "GPUFLEET_ARCHIVE_DIR"
SEGMENT = int(os.environ.get("GPUFLEET_ARCHIVE_SEGMENT", "10000"))
MANIFEST = "manifest.json"


def retention_s(value: str | None = None) -> float | None:
    """The configured retention in seconds (None: keep everything)."""
    raw = os.environ.get(RETENTION_ENV) if value is None else value
    if raw is None or str(raw).strip() in ("", "0", "forever", "none"):
        return None
    from gpufleet.shared.contract.spec import parse_duration_s

    return float(parse_duration_s(raw))


def archive_dir() -> Path | None:
    d = os.environ.get(ARCHIVE_DIR_ENV)
    return Path(d) if d else None


@dataclass(frozen=True)
class Segment:
    file: str
    first: int
    last: int
    count: int
    sha256: str  # of the file's bytes
    chain: str  # sha256(previous chain + this sha256): a segment removed or replaced breaks it
    stored_to: str = ""  # the stored time of its last event


@dataclass
class _Meta:
    stream: int
    timestamp: datetime | None
    num_pending: int = 0
    num_delivered: int = 1

    @property
    def sequence(self) -> Any:
        return self


@dataclass
class ArchivedMsg:
    """An archived message, read back with the attributes of a JetStream message."""

    subject: str
    data: bytes
    headers: dict[str, str] | None
    metadata: _Meta = field(repr=False)


class Archive:
    def __init__(self, root: Path) -> None:
        self.root = root

    def segments(self) -> list[Segment]:
        try:
            doc = json.loads((self.root / MANIFEST).read_text())
        except FileNotFoundError:
            return []
        return [Segment(**s) for s in doc.get("segments", [])]

    @property
    def archived_to(self) -> int:
        segs = self.segments()
        return segs[-1].last if segs else 0

    def write(self, msgs: Sequence[Any]) -> Segment:
        """Archive `msgs` (consecutive sequences, right after the last segment), durably."""
        from gpufleet.shared.contract.config import write_private

        self.root.mkdir(parents=True, exist_ok=True)
        segs = self.segments()
        first, last = msgs[0].metadata.sequence.stream, msgs[-1].metadata.sequence.stream
        expect = (segs[-1].last if segs else first - 1) + 1
        if first != expect or last - first + 1 != len(msgs):
            raise ValueError(f"archive: segment {first}..{last} of {len(msgs)} messages does not follow {expect - 1}")
        lines = []
        for m in msgs:
            ts = m.metadata.timestamp
            lines.append(json.dumps({"seq": m.metadata.sequence.stream, "subject": m.subject,
                                     "time": ts.isoformat() if ts else None, "headers": dict(m.headers or {}),
                                     "data": m.data.decode("utf-8", "surrogateescape")}, separators=(",", ":")))
        blob = gzip.compress(("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"), 6, mtime=0)
        name = f"FLEET-{first:012d}-{last:012d}.jsonl.gz"
        tmp = self.root / (name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / name)
        digest = hashlib.sha256(blob).hexdigest()
        prev = segs[-1].chain if segs else ""
        ts = msgs[-1].metadata.timestamp
        seg = Segment(name, first, last, len(msgs), digest, hashlib.sha256((prev + digest).encode()).hexdigest(),
                      ts.isoformat() if ts else "")
        write_private(self.root / MANIFEST, json.dumps({"stream": "FLEET", "segments": [asdict(s) for s in [*segs, seg]]},
                                                       indent=1) + "\n")
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename and the manifest are durable before the stream is purged
        finally:
            os.close(fd)
        return seg

    def verify(self) -> list[str]:
        """What is wrong with the archive: a segment whose bytes are not its digest, a broken
        chain, sequences missing between segments. [] when whole."""
        problems: list[str] = []
        prev_chain, prev_last = "", 0
        for s in self.segments():
            if s.first != prev_last + 1:
                problems.append(f"seqs {prev_last + 1}..{s.first - 1} are in no archive segment")
            try:
                digest = hashlib.sha256((self.root / s.file).read_bytes()).hexdigest()
            except FileNotFoundError:
                problems.append(f"segment {s.file} is missing")
                digest = ""
            if digest and digest != s.sha256:
                problems.append(f"segment {s.file} does not match its digest (altered)")
            if hashlib.sha256((prev_chain + s.sha256).encode()).hexdigest() != s.chain:
                problems.append(f"segment {s.file}: the manifest's chain is broken (a segment replaced or removed)")
            prev_chain, prev_last = s.chain, s.last
        return problems

    def read(self, subjects: Sequence[str], from_seq: int = 1, until_seq: int | None = None,
             batch: int = 2048) -> Iterator[list[ArchivedMsg]]:
        """Archived messages on `subjects` from `from_seq` (to `until_seq`), in order, in batches."""
        from gpufleet.shared.runtime.bus import subject_matches

        out: list[ArchivedMsg] = []
        for s in self.segments():
            if s.last < from_seq or (until_seq is not None and s.first > until_seq):
                continue
            with gzip.open(self.root / s.file, "rt", encoding="utf-8", errors="surrogateescape") as f:
                for line in f:
                    doc = json.loads(line)
                    seq = int(doc["seq"])
                    if seq < from_seq:
                        continue
                    if until_seq is not None and seq > until_seq:
                        break
                    if not any(subject_matches(p, doc["subject"]) for p in subjects):
                        continue
                    ts = datetime.fromisoformat(doc["time"]) if doc.get("time") else None
                    out.append(ArchivedMsg(doc["subject"], doc["data"].encode("utf-8", "surrogateescape"),
                                           doc.get("headers") or None, _Meta(seq, ts)))
                    if len(out) >= batch:
                        yield out
                        out = []
        if out:
            yield out


async def archive_round(bus: Any, archive: Archive, retention: float, segment: int = SEGMENT,
                        now: float | None = None) -> int:
    """Archive, then purge, every full segment of events stored more than `retention` seconds
    ago (and a last partial one when all of it is that old). Returns the events archived."""
    from gpufleet.shared.contract.events import STREAM
    from gpufleet.shared.runtime.log import read_stream

    cutoff = (time.time() if now is None else now) - retention
    done = 0
    while True:
        info = await bus.js.stream_info(STREAM)
        first, last = int(info.state.first_seq), int(info.state.last_seq)
        if archive.archived_to >= first:  # archived but kept while a reader needed it: purge what is read now
            if not await _purge_below(bus, archive.archived_to + 1, last):
                return done
            continue
        start = max(archive.archived_to + 1, first)
        if start > last:
            return done
        if start != archive.archived_to + 1:
            raise RuntimeError(f"archive: the stream starts at {first} but the archive ends at {archive.archived_to}: "
                               "events were dropped without being archived")
        msgs: list[Any] = []
        async for batch in read_stream(bus, ("fleet.>",), from_seq=start, until_seq=min(last, start + segment - 1)):
            msgs.extend(batch)
        old = []
        for m in msgs:
            ts = m.metadata.timestamp
            if ts is None or ts.timestamp() > cutoff:
                break
            old.append(m)
        if not old or (len(old) < segment and len(old) < len(msgs)):
            return done  # the next segment is not all past the retention yet
        seg = archive.write(old)
        done += seg.count
        if not await _purge_below(bus, seg.last + 1, last):
            log.info("archive: seqs %d..%d archived (%s); kept in the stream while a reader needs them",
                     seg.first, seg.last, seg.file)
            return done
        log.info("archive: seqs %d..%d archived (%s) and purged from the stream", seg.first, seg.last, seg.file)


def _tenant_scoped(filters: Sequence[str]) -> bool:
    """A consumer whose every filter is inside one tenant's subjects (`fleet.evt.<tenant>.…`): a
    tenant's own reader. Its pace never holds the log (a tenant that never reads must not keep
    every tenant's history in the stream); the server makes a tenant's consumers filtered so."""
    from gpufleet.shared.contract.events import SYS_TENANT

    def one(f: str) -> bool:
        t = f.split(".")
        return len(t) >= 3 and t[0] == "fleet" and t[1] in ("evt", "cmd") and t[2] not in ("*", ">", SYS_TENANT)
    return bool(filters) and all(one(f) for f in filters)


async def reader_floor(bus: Any, last: int) -> tuple[int, str]:
    """The first sequence some reader of the mesh still has to receive (`last + 1` when every one
    has it all), and that reader's name. A purge below it loses nothing: a consumer receives only
    what the stream still holds, so an event purged before a lagging service (a durable behind a
    restart, a ledger, a fold under way) got it would be lost to it for good, which a fold's read
    of the archive does not mend for a live consumer. Tenants' own consumers do not count."""
    from gpufleet.shared.contract.events import STREAM

    floor, who = last + 1, ""
    offset = 0
    while True:
        infos = await bus.js.consumers_info(STREAM, offset=offset or None)
        for ci in infos:
            cfg = ci.config
            filters = list(cfg.filter_subjects or ([cfg.filter_subject] if cfg.filter_subject else []))
            if _tenant_scoped(filters):
                continue
            if not ci.num_pending and not ci.num_ack_pending:
                continue  # it has everything the stream holds
            if str(getattr(cfg.ack_policy, "value", cfg.ack_policy)) == "none":
                got = int(ci.delivered.stream_seq or 0) if ci.delivered else 0
            else:
                got = int(ci.ack_floor.stream_seq or 0) if ci.ack_floor else 0
            if got + 1 < floor:
                floor, who = got + 1, ci.name
        if len(infos) < 256:
            return floor, who
        offset += len(infos)


async def _purge_below(bus: Any, seq: int, last: int) -> bool:
    """Purge FLEET below `seq`, or below the first sequence a reader still needs when that is
    lower. True when all of it was purged."""
    from gpufleet.shared.contract.events import STREAM

    first = int((await bus.js.stream_info(STREAM)).state.first_seq)
    floor, who = await reader_floor(bus, last)  # right before the purge: a reader made since is seen
    upto = min(seq, floor)
    if upto > first:
        await bus.js.purge_stream(STREAM, seq=upto)
    if upto < seq:
        log.warning("archive: %s has not received seq %d yet; the stream keeps it (archived up to %d)",
                    who, floor, seq - 1)
        return False
    return True


async def keep(bus: Any, archive: Archive, retention: float, stop: Any, every_s: float = 60.0,
               segment: int = SEGMENT) -> None:
    """The archive process: a round every `every_s` until `stop` (a failed round is logged; the next tries again)."""
    from gpufleet.shared.runtime.loop import every

    async def archive_once() -> None:
        await archive_round(bus, archive, retention, segment)

    await every(stop, every_s, archive_once, "archive")


def main(argv: list[str] | None = None) -> None:
    import argparse
    import asyncio

    from gpufleet.shared.runtime.bus import Looping, run_until_signal

    ap = argparse.ArgumentParser(prog="gpufleet.shared.runtime.archive", description="archive, then purge, FLEET's oldest events")
    ap.add_argument("--nats-url", default=os.environ.get("GPUFLEET_NATS_URL", "nats://127.0.0.1:4222"))
    ap.add_argument("--dir", default=os.environ.get(ARCHIVE_DIR_ENV))
    ap.add_argument("--segment", type=int, default=SEGMENT)
    ap.add_argument("--retention", default=os.environ.get(RETENTION_ENV))
    ap.add_argument("--every", type=float, default=float(os.environ.get("GPUFLEET_ARCHIVE_EVERY_S", "60")))
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s archive %(levelname)s %(message)s")
    keep_s = retention_s(args.retention)
    if keep_s is None or not args.dir:
        raise SystemExit("archive: --retention and --dir (or their environment) are required")

    archive = Archive(Path(args.dir))
    asyncio.run(run_until_signal(args.nats_url, "gpufleet-archive", lambda bus: Looping(
        bus, lambda stop: keep(bus, archive, keep_s, stop, args.every, args.segment))))

if __name__ == "__main__":
    main()
