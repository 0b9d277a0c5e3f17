"""The node-local dataset and model cache, as decisions: what is held, what to evict, what a job needs.

Pure (no I/O, no clock): `services/executor/staging.py` copies and deletes, and calls this.

- An entry is named by the identifier the job spec carries (`dataset: file:///data/c4-en`, or a
  bare name like `c4-en`), the same string the placer's data-locality plugin compares with what a
  node reported in `node.datasets_cached`.
- The cache keeps its entries within `capacity_bytes`, least recently used out first. An entry a
  running (or starting) job uses is never evicted: when the entries in use hold more than the room
  a new copy needs, the cache goes over its size for as long as they do, and is trimmed back as
  soon as they are released (a job never waits for room, nor loses its data under it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from gpufleet.shared.contract.spec import JobSpec

DataField = Literal["dataset", "model"]
DATA_FIELDS: tuple[DataField, ...] = ("dataset", "model")


@dataclass(slots=True)
class CacheEntry:
    name: str  # the spec's identifier
    size_bytes: int
    used_at_s: float  # when a job last used it (the LRU order)


@dataclass(frozen=True, slots=True)
class DataNeed:
    """One piece of data a job asks for, and where it comes from."""

    field: DataField
    name: str  # as the spec says it
    uri: str | None  # what to copy it from; None: a bare name no source is configured for (used if cached)


@dataclass
class DataCache:
    capacity_bytes: int
    entries: dict[str, CacheEntry] = field(default_factory=dict)

    @property
    def used_bytes(self) -> int:
        return sum(e.size_bytes for e in self.entries.values())

    def listing(self) -> tuple[str, ...]:
        """What `node.datasets_cached` says: every name held, sorted."""
        return tuple(sorted(self.entries))

    def add(self, name: str, size_bytes: int, now_s: float) -> None:
        self.entries[name] = CacheEntry(name, size_bytes, now_s)

    def touch(self, name: str, now_s: float) -> None:
        e = self.entries.get(name)
        if e is not None:
            e.used_at_s = max(e.used_at_s, now_s)

    def remove(self, name: str) -> CacheEntry | None:
        return self.entries.pop(name, None)

    def evictions(self, incoming_bytes: int, in_use: Iterable[str] = ()) -> list[str]:
        """The entries to evict, least recently used first, so that `incoming_bytes` more fit within
        the capacity; never one in `in_use`. When those hold too much, as many as may go (the cache
        then runs over its size until they are released: `evictions(0, ...)` trims it back)."""
        keep = set(in_use)
        over = self.used_bytes + incoming_bytes - self.capacity_bytes
        out: list[str] = []
        for e in sorted(self.entries.values(), key=lambda e: (e.used_at_s, e.name)):
            if over <= 0:
                break
            if e.name in keep:
                continue
            out.append(e.name)
            over -= e.size_bytes
        return out


def data_needs(spec: JobSpec | None, sources: Mapping[str, str] | None = None) -> tuple[DataNeed, ...]:
    """What data a job's spec asks its node for: its `dataset` and `model`. A URI is copied from
    itself; a bare name from the source `sources` maps it to (the config's `datasetCache.sources`),
    else from nowhere (the job uses it if the node holds it, and starts without it if not)."""
    if spec is None:
        return ()
    out = []
    for f in DATA_FIELDS:
        name = getattr(spec, f)
        if name:
            uri = name if "://" in name else (sources or {}).get(name)
            out.append(DataNeed(f, name, uri))
    return tuple(out)


def in_use(specs: Iterable[JobSpec | None], sources: Mapping[str, str] | None = None) -> set[str]:
    """The cache entries the jobs of `specs` (running, or about to start) use: not to be evicted."""
    return {n.name for s in specs for n in data_needs(s, sources)}


def env_name(f: DataField) -> str:
    """The variable that gives the workload the local path of its `f`: GPUFLEET_DATASET_DIR, GPUFLEET_MODEL_DIR."""
    return f"GPUFLEET_{f.upper()}_DIR"
