"""The node-local dataset and model cache, on disk: copies in, evictions out (the I/O of datacache.py).

Layout of the cache directory (`datasetCache.dir`, default `<data dir>/datasets/<node>`):

    <dir>/<digest of the name>/entry.json   {"name", "size_bytes", "used_at"}
    <dir>/<digest of the name>/data/        the copy: what the workload gets (read-only to it)
    <dir>/.tmp-<digest>-<n>/                a copy under way, or an eviction being deleted

An entry is published by renaming its finished copy into place, so what `scan` finds is what is
really there: a start drops the temporary dirs and every entry without its entry.json or data, and
measures the rest. Copies run in worker threads, one per source whatever the number of jobs
waiting for it; a copy no job waits for any more (they were cancelled) is stopped between two
chunks. Decisions (what to evict, what a job needs) are `datacache.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.shared.node.datasets import SourceMissing, StagingCancelled, source_for

from .datacache import DataCache, DataNeed

log = logging.getLogger(__name__)

ENTRY = "entry.json"
DATA = "data"
DEFAULT_CAPACITY_BYTES = 100 << 30
PROGRESS_EVERY_S = 10.0  # job.data_staging while a copy runs


@dataclass
class Copy:
    """One copy under way into the cache (shared by every job waiting for the same name)."""

    need: DataNeed
    started_at_s: float
    waiters: set[str] = field(default_factory=set)  # workload keys waiting for it
    done_bytes: int = 0
    total_bytes: int | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    task: asyncio.Task[None] | None = None


@dataclass(frozen=True)
class Staged:
    """What a copy did for the jobs that waited for it."""

    copied_bytes: int
    staging_s: float


class DataStager:
    """The cache of one executor's driver node(s). `sources`: bare names -> the URI to stage them from."""

    def refusal(self, tenant: str, uri: str) -> str | None:
        """Why the tenant's job may not read `uri` (its own URI, not an operator's bare name)."""
        if self.allowed is None:
            return None
        return self.allowed(tenant, uri)

    def __init__(self, cache_dir: str | os.PathLike[str], capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
                 sources: Mapping[str, str] | None = None, clock: Callable[[], float] = time.time,
                 allowed: Callable[[str, str], str | None] | None = None) -> None:
        self.dir = Path(cache_dir)
        # (tenant, URI) -> why the tenant's job may not name that source (None: it may); checked
        # on the node again, after admission, with file:// symlinks resolved. None: any source
        self.allowed = allowed
        self.cache = DataCache(capacity_bytes)
        self.sources = dict(sources or {})
        self.clock = clock
        self.copies: dict[str, Copy] = {}  # name -> the copy under way
        self.staged: dict[tuple[str, str], Staged] = {}  # (workload key, name) -> the copy it waited for
        self.failed: dict[tuple[str, str], str] = {}  # (workload key, name) -> why its copy failed
        self.in_use: set[str] = set()  # names running or starting jobs use (the agent says, each round)
        self._seq = 0

    # ------------------------------------------------------------ what is there

    def path_of(self, name: str) -> Path:
        return self.dir / _digest(name) / DATA

    def scan(self) -> None:
        """Rebuild the index from the directory (blocking: run it in a thread)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o755)  # the workloads' user passes through to their data
        self.cache.entries.clear()
        for d in sorted(self.dir.iterdir()):
            if d.name.startswith(".tmp-"):
                shutil.rmtree(d, ignore_errors=True)
                continue
            try:
                meta = json.loads((d / ENTRY).read_text())
                name, used_at = str(meta["name"]), float(meta.get("used_at", 0.0))
                ok = (d / DATA).is_dir() and d.name == _digest(name)
            except (OSError, ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                log.warning("dataset cache: %s is not a complete entry; removed", d)
                shutil.rmtree(d, ignore_errors=True)
                continue
            self.cache.add(name, _tree_bytes(d / DATA), used_at)
        log.info("dataset cache %s: %d entr(ies), %d of %d bytes", self.dir, len(self.cache.entries),
                 self.cache.used_bytes, self.cache.capacity_bytes)

    def listing(self) -> tuple[str, ...]:
        return self.cache.listing()

    # ------------------------------------------------------------ what a job needs

    def has(self, name: str) -> bool:
        return name in self.cache.entries and name not in self.copies

    def use(self, name: str) -> None:
        """A job starts with it: it moves to the front of the LRU (kept on disk, for restarts)."""
        now = self.clock()
        self.cache.touch(name, now)
        with contextlib.suppress(OSError):
            _write_entry(self.dir / _digest(name), name, self.cache.entries[name].size_bytes, now)

    def begin(self, need: DataNeed, key: str) -> Copy:
        """`key` waits for `need`: joins its copy, or starts one."""
        assert need.uri is not None
        c = self.copies.get(need.name)
        if c is None:
            c = self.copies[need.name] = Copy(need, self.clock())
            c.task = asyncio.create_task(self._copy(c))
        c.waiters.add(key)
        return c

    def want_only(self, keys: Iterable[str]) -> None:
        """Only `keys` still wait to start: a copy nobody waits for any more stops."""
        wanted = set(keys)
        for c in self.copies.values():
            c.waiters &= wanted
            if not c.waiters and not c.stop.is_set():
                log.info("dataset cache: nobody waits for %s any more: copy stopped", c.need.name)
                c.stop.set()
        for k in [k for k in self.failed if k[0] not in wanted]:
            del self.failed[k]
        for k in [k for k in self.staged if k[0] not in wanted]:
            del self.staged[k]

    async def trim(self) -> list[str]:
        """Evict what the cache holds past its size, now that nothing in use protects it."""
        return await self._evict(self.cache.evictions(0, self.in_use | set(self.copies)))

    async def close(self) -> None:
        for c in self.copies.values():
            c.stop.set()
        tasks = [c.task for c in self.copies.values() if c.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ inside

    async def _copy(self, c: Copy) -> None:
        need, name = c.need, c.need.name
        assert need.uri is not None
        self._seq += 1
        tmp = self.dir / f".tmp-{_digest(name)}-{os.getpid()}-{self._seq}"
        try:
            source = source_for(need.uri)
            c.total_bytes = await asyncio.to_thread(source.size, need.uri)
            await self._evict(self.cache.evictions(c.total_bytes + self._reserved(c), self.in_use | set(self.copies)))

            def progress(n: int) -> None:
                c.done_bytes = n

            def fetch() -> int:
                (tmp / DATA).mkdir(parents=True)
                copied = source.fetch(need.uri or "", tmp / DATA, progress, c.stop.is_set)
                _readable(tmp / DATA)
                _write_entry(tmp, name, copied, self.clock())
                final = self.dir / _digest(name)
                shutil.rmtree(final, ignore_errors=True)  # a stale copy, not indexed
                tmp.rename(final)
                return copied

            copied = await asyncio.to_thread(fetch)
            self.cache.add(name, copied, self.clock())
            took = round(self.clock() - c.started_at_s, 3)
            log.info("dataset cache: staged %s from %s: %d bytes in %.2f s", name, need.uri, copied, took)
            for key in c.waiters:
                self.staged[(key, name)] = Staged(copied, took)
        except StagingCancelled:
            pass
        except (SourceMissing, OSError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            log.warning("dataset cache: cannot stage %s from %s: %s", name, need.uri, why)
            for key in c.waiters:
                self.failed[(key, name)] = why
        finally:
            if tmp.exists():
                await asyncio.to_thread(shutil.rmtree, tmp, True)
            self.copies.pop(name, None)

    def _reserved(self, c: Copy) -> int:
        """Bytes the other copies under way will take."""
        return sum(o.total_bytes or 0 for o in self.copies.values() if o is not c)

    async def _evict(self, names: list[str]) -> list[str]:
        for name in names:
            e = self.cache.remove(name)
            self._seq += 1
            gone = self.dir / f".tmp-{_digest(name)}-{os.getpid()}-{self._seq}"
            with contextlib.suppress(FileNotFoundError):
                (self.dir / _digest(name)).rename(gone)  # out of the index on disk at once
            await asyncio.to_thread(shutil.rmtree, gone, True)
            log.info("dataset cache: evicted %s (%d bytes, least recently used)", name, e.size_bytes if e else 0)
        return names


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:24]


def _write_entry(d: Path, name: str, size_bytes: int, used_at: float) -> None:
    tmp = d / f".{ENTRY}.tmp"
    tmp.write_text(json.dumps({"name": name, "size_bytes": size_bytes, "used_at": used_at}))
    tmp.chmod(0o644)
    tmp.replace(d / ENTRY)


def _tree_bytes(root: Path) -> int:
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):
                total += (Path(d) / f).lstat().st_size
    return total


def _readable(root: Path) -> None:
    """Readable to every workload's user (the executor made it), writable to none of them."""
    for d, _, files in os.walk(root):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(Path(d) / f, 0o644)
    os.chmod(root.parent, 0o755)
