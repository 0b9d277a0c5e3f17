"""The node-local dataset cache: its pure decisions (LRU, in-use protection, size accounting), the
`file://` source, and the on-disk stager (copies, scans, evictions) without a mesh."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gpufleet.services.executor.datacache import DataCache, DataNeed, data_needs, env_name, in_use
from gpufleet.services.executor.drivers import Launch
from gpufleet.services.executor.staging import DataStager
from gpufleet.shared.contract.clusterconfig import parse_config
from gpufleet.shared.contract.errors import SpecError
from gpufleet.shared.contract.spec import parse_spec
from gpufleet.shared.node.datasets import LocalSource, SourceMissing, StagingCancelled, source_for

from .helpers import wait_until

MiB = 1 << 20


def cache(capacity: int, *entries: tuple[str, int, float]) -> DataCache:
    c = DataCache(capacity)
    for name, size, used in entries:
        c.add(name, size, used)
    return c


# ---------------------------------------------------------------- the pure cache


@pytest.mark.parametrize(("entries", "incoming", "used", "evicted"), [
    # room enough: nothing goes
    ([("a", 30, 1), ("b", 30, 2)], 40, (), []),
    # least recently used first, only as many as it takes
    ([("a", 30, 3), ("b", 30, 1), ("c", 30, 2)], 20, (), ["b"]),
    ([("a", 30, 3), ("b", 30, 1), ("c", 30, 2)], 50, (), ["b", "c"]),
    # an entry in use is never evicted: the next least recent goes instead
    ([("a", 30, 3), ("b", 30, 1), ("c", 30, 2)], 20, ("b",), ["c"]),
    # all in use: none goes (the cache runs over its size until they are released)
    ([("a", 50, 1), ("b", 50, 2)], 50, ("a", "b"), []),
    # bigger than the whole cache: everything not in use goes
    ([("a", 30, 1), ("b", 30, 2)], 500, ("b",), ["a"]),
    # ties in time: by name, so the plan is the same on every node
    ([("y", 60, 5), ("x", 60, 5)], 10, (), ["x"]),
])
def test_evictions_are_lru_and_spare_what_is_in_use(entries: list[tuple[str, int, float]], incoming: int,
                                                    used: tuple[str, ...], evicted: list[str]) -> None:
    assert cache(100, *entries).evictions(incoming, used) == evicted


def test_size_accounting_touch_and_trim() -> None:
    c = cache(100, ("a", 40, 1), ("b", 40, 2))
    assert c.used_bytes == 80 and c.listing() == ("a", "b")
    c.touch("a", 5)  # a job used it: now b is the least recently used
    c.add("c", 40, 6)  # staged over the size while a and b were in use
    assert c.used_bytes == 120
    assert c.evictions(0, ("a", "b", "c")) == []  # still all in use
    assert c.evictions(0, ("a", "c")) == ["b"]  # b released: trimmed back within the size
    c.remove("b")
    assert c.used_bytes == 80 and c.listing() == ("a", "c")
    c.touch("gone", 9)  # not held: nothing happens
    c.touch("a", 1)  # never moves back in time
    assert c.entries["a"].used_at_s == 5


def test_what_a_spec_needs_and_where_from() -> None:
    spec = parse_spec({"name": "j", "tenant": "t", "dataset": "file:///data/c4", "model": "llama-8b"})
    assert data_needs(spec) == (DataNeed("dataset", "file:///data/c4", "file:///data/c4"),
                                DataNeed("model", "llama-8b", None))  # a bare name, no source configured
    assert data_needs(spec, {"llama-8b": "file:///models/llama"})[1].uri == "file:///models/llama"
    assert data_needs(parse_spec({"name": "j", "tenant": "t"})) == () and data_needs(None) == ()
    assert in_use([spec, None]) == {"file:///data/c4", "llama-8b"}
    assert env_name("dataset") == "GPUFLEET_DATASET_DIR" and env_name("model") == "GPUFLEET_MODEL_DIR"
    env = Launch("j", "t", 0, 1, "n", ("true",), data_dirs=(("dataset", "/c/x/data"), ("model", "/c/y/data"))).job_env()
    assert env["GPUFLEET_DATASET_DIR"] == "/c/x/data" and env["GPUFLEET_MODEL_DIR"] == "/c/y/data"


def test_config_names_the_cache_size_and_sources() -> None:
    cfg = parse_config({"datasetCache": {"size": "2Gi", "dir": "/var/cache/gpufleet",
                                         "sources": {"c4-en": "file:///mnt/c4-en"}}})
    assert cfg.dataset_cache.size_mib == 2048 and cfg.dataset_cache.sources == {"c4-en": "file:///mnt/c4-en"}
    assert parse_config({}).dataset_cache.size_mib == 100 * 1024
    with pytest.raises(SpecError) as err:
        parse_config({"datasetCache": {"sources": {"c4-en": "/mnt/c4-en"}}})
    assert "datasetCache.sources" in str(err.value)


# ---------------------------------------------------------------- the file:// source


def tree(root: Path, files: dict[str, int]) -> Path:
    for rel, size in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * size)
    return root


def test_local_source_copies_a_tree_or_a_file(tmp_path: Path) -> None:
    src = tree(tmp_path / "src", {"a.bin": 3 * MiB + 5, "sub/b.txt": 10})
    (src / "link").symlink_to("/etc/passwd")  # left out
    s = source_for(src.as_uri())
    assert isinstance(s, LocalSource) and s.size(src.as_uri()) == 3 * MiB + 15
    seen: list[int] = []
    dest = tmp_path / "dest"
    dest.mkdir()
    assert s.fetch(src.as_uri(), dest, seen.append, lambda: False) == 3 * MiB + 15
    assert (dest / "sub" / "b.txt").read_bytes() == b"x" * 10 and not (dest / "link").exists()
    assert seen[-1] == 3 * MiB + 15 and len(seen) >= 4  # progress per chunk
    one = tmp_path / "one"
    one.mkdir()
    assert s.fetch((src / "a.bin").as_uri(), one, seen.append, lambda: False) == 3 * MiB + 5
    assert (one / "a.bin").stat().st_size == 3 * MiB + 5


def test_local_source_says_what_is_missing_and_stops_when_cancelled(tmp_path: Path) -> None:
    s = LocalSource()
    with pytest.raises(SourceMissing, match="nope"):
        s.size((tmp_path / "nope").as_uri())
    with pytest.raises(SourceMissing, match="no dataset source for s3://"):
        source_for("s3://bucket/c4")
    src = tree(tmp_path / "src", {"big": 4 * MiB})
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(StagingCancelled):
        s.fetch(src.as_uri(), dest, lambda n: None, lambda: True)


# ---------------------------------------------------------------- the stager, on disk


async def staged(stager: DataStager, name: str, key: str) -> None:
    stager.begin(DataNeed("dataset", name, name), key)
    await wait_until(lambda: stager.has(name) or (key, name) in stager.failed, timeout_s=10, every_s=0.01)


async def test_stager_copies_once_keeps_its_size_and_rescans_what_is_there(tmp_path: Path) -> None:
    a, b, c = (tree(tmp_path / n, {"f": 2 * MiB}).as_uri() for n in ("a", "b", "c"))
    clock = [100.0]
    st = DataStager(tmp_path / "cache", capacity_bytes=5 * MiB, clock=lambda: clock[0])
    st.scan()
    await staged(st, a, "j1.0.1")
    assert st.staged[("j1.0.1", a)].copied_bytes == 2 * MiB
    assert (st.path_of(a) / "f").stat().st_size == 2 * MiB
    clock[0] = 101
    await staged(st, b, "j2.0.1")
    clock[0] = 102
    st.use(a)  # a job used a after b was staged: b is now the least recently used
    st.in_use = set()
    clock[0] = 103
    await staged(st, c, "j3.0.1")  # 6 MiB > 5: one goes, the least recently used
    assert st.listing() == tuple(sorted((a, c)))
    assert not st.path_of(b).exists()
    again = DataStager(tmp_path / "cache", capacity_bytes=5 * MiB)
    (tmp_path / "cache" / ".tmp-half-copied").mkdir()
    again.scan()  # a restart: what is really there, with the LRU order it had
    assert again.listing() == st.listing() and again.cache.used_bytes == 4 * MiB
    assert again.cache.entries[a].used_at_s == 102
    assert not (tmp_path / "cache" / ".tmp-half-copied").exists()


async def test_stager_spares_data_in_use_and_trims_after(tmp_path: Path) -> None:
    a, b = (tree(tmp_path / n, {"f": 3 * MiB}).as_uri() for n in ("a", "b"))
    st = DataStager(tmp_path / "cache", capacity_bytes=4 * MiB)
    st.scan()
    await staged(st, a, "j1.0.1")
    st.in_use = {a}  # a running job uses a
    await staged(st, b, "j2.0.1")
    assert st.listing() == tuple(sorted((a, b))) and st.cache.used_bytes == 6 * MiB  # over, for now
    st.in_use = {b}  # j1 ended
    assert await st.trim() == [a]
    assert st.listing() == (b,)


async def test_stager_reports_a_missing_source_and_stops_an_unwanted_copy(tmp_path: Path) -> None:
    st = DataStager(tmp_path / "cache", capacity_bytes=64 * MiB)
    st.scan()
    missing = (tmp_path / "nope").as_uri()
    await staged(st, missing, "j1.0.1")
    assert "nope" in st.failed[("j1.0.1", missing)] and missing not in st.listing()
    big = tree(tmp_path / "big", {f"f{i}": 8 * MiB for i in range(6)}).as_uri()
    c = st.begin(DataNeed("dataset", big, big), "j2.0.1")
    st.want_only(set())  # j2 was cancelled while its data was copied
    assert c.task is not None
    await asyncio.wait_for(c.task, 10)
    assert big not in st.listing() and not st.copies
    assert not [p for p in (tmp_path / "cache").iterdir()]  # nothing half-copied left behind


# ---------------------------------------------------------------- which sources a job may name


def test_a_job_names_only_the_sources_its_tenant_is_allowed() -> None:
    from gpufleet.shared.contract.clusterconfig import parse_config, source_refusal

    config = parse_config({"datasetCache": {"allowedSources": ["file:///data/public/*"]},
                           "tenants": {"acme": {}, "beta": {"allowedDataSources": ["s3://beta-data/*"]}}})
    allowed = config.data_sources_for("acme")
    assert source_refusal("file:///data/public/c4-en", allowed) is None
    assert "matches none" in (source_refusal("file:///etc/shadow", allowed) or "")
    assert "'..'" in (source_refusal("file:///data/public/../../etc/shadow", allowed) or "")
    assert "'..'" in (source_refusal("file:///data/public/%2e%2e/secret", allowed) or "")  # (escaped, too)
    # a symlink under an allowed directory that points elsewhere: refused on the node
    assert "resolves to" in (source_refusal("file:///data/public/link", allowed, real="file:///home/beta/x") or "")
    assert config.data_sources_for("beta") == ("s3://beta-data/*",)  # its own list replaces the cluster's
    assert source_refusal("file:///data/public/c4-en", config.data_sources_for("beta")) is not None
    assert "allowedSources" in (source_refusal("file:///x", parse_config({}).data_sources_for("anyone")) or "")


def test_admission_refuses_a_dataset_the_tenant_may_not_read_naming_the_field() -> None:
    from gpufleet.services.admission.core import AdmissionCore
    from gpufleet.shared.contract.clusterconfig import parse_config
    from gpufleet.shared.contract.events import JobRejected

    from .builders import Harness
    from .helpers import submit_cmd

    core = AdmissionCore(parse_config({"datasetCache": {"allowedSources": ["file:///data/public/*"]}}))
    h = Harness(core)
    spec = {"name": "p", "tenant": "acme", "type": "batch", "resources": {"gpu": 0}}
    bad = h.when(submit_cmd({**spec, "dataset": "file:///etc/shadow", "model": "file:///data/public/m"}))
    (rej,) = [e.payload for e in bad if isinstance(e.payload, JobRejected)]
    assert [(r.code, r.field) for r in rej.reasons] == [("data_source_not_allowed", "dataset")]
    assert "file:///etc/shadow" in rej.reasons[0].message
    ok = h.when(submit_cmd({**spec, "dataset": "file:///data/public/c4-en", "model": "c4-bare-name"}))
    assert not any(isinstance(e.payload, JobRejected) for e in ok)
