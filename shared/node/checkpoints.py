"""Checkpoints on disk: where a job's live, what a complete one is, and which is the latest good.

Layout of a job's checkpoint location (a directory; `file://` URIs):

    <location>/step-000000042/            one checkpoint, published by an atomic rename
        manifest.json                     {"step", "created_at", "job_id", "files": {name: {size, sha256}}}
        <the job's files>
    <location>/.tmp-step-000000042-<pid>/ being written (never read)

A checkpoint is *good* when its manifest parses and every file it lists has that size and
sha256. `scan` lists them newest first with why a bad one is bad, `latest_good` takes the first
good one, so a partial or corrupt latest checkpoint is skipped for the previous good one.

Locations: a training / finetune job gets `<root>/<tenant>/<job>` under the configured
checkpoint root, unless its spec names a persistent `checkpoint.path` of its own. A path on
ephemeral storage (a temp dir, shared memory, or a relative path inside the container's own
filesystem) vanishes with the container: `ephemeral_reason` says why, and the tenant's policy
rejects the job or corrects the path (docs/config.md). A path is also judged by the filesystem
it is on, where the guardian can see it (`filesystem_of`, /proc/self/mountinfo): tmpfs, ramfs,
a container's own overlay keep nothing past a reboot or the container, wherever they are
mounted. A job's own `checkpoint.path` on one fails at the start of its run
(`checkpoint_location_ephemeral`); the checkpoint root on one is reported when the guardian
starts; every run's `job.checkpoint_verified` names the filesystem.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
EPHEMERAL_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/proc", "/sys")
# filesystems that keep nothing past a reboot or their container, wherever they are mounted
EPHEMERAL_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "overlay", "aufs", "zram"})
CHECKPOINTED_TYPES = ("training", "finetune")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    size_bytes: int
    sha256: str  # of the manifest: names the whole checkpoint
    created_at: float = 0.0
    world_size: int | None = None  # the replicas of the run that saved it (None: not recorded)

    @property
    def uri(self) -> str:
        return self.path.resolve().as_uri()


@dataclass(frozen=True)
class Scanned:
    step: int
    path: Path
    checkpoint: Checkpoint | None  # None: bad
    reason: str = ""  # why it is bad


def ephemeral_reason(path: str) -> str | None:
    """Why a checkpoint path would not outlive the job's container, or None if it would."""
    if "://" in path and not path.startswith("file://"):
        scheme = path.split("://", 1)[0]
        return None if scheme in _STORES else f"no checkpoint store for {scheme}:// locations"
    path = path.removeprefix("file://")
    if not path.startswith("/"):
        return f"{path!r} is relative: it lands in the container's own filesystem"
    norm = os.path.normpath(path)
    for prefix in EPHEMERAL_PREFIXES:
        if norm == prefix or norm.startswith(prefix + "/"):
            return f"{path!r} is under {prefix}, which does not outlive the container"
    return None


def filesystem_of(path: str | os.PathLike[str], mountinfo: str = "/proc/self/mountinfo") -> tuple[str, str] | None:
    """(type, mount point) of the filesystem `path` is on (its nearest existing ancestor, links
    resolved), or None where the mount table cannot be read (not Linux)."""
    p = Path(os.path.realpath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        table = Path(mountinfo).read_text()
    except OSError:
        return None
    at, best = str(p), None
    for line in table.splitlines():
        left, _, right = line.partition(" - ")
        fields, kind = left.split(), right.split()
        if len(fields) < 5 or not kind:
            continue
        mnt = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        inside = at == mnt or at.startswith(mnt.rstrip("/") + "/")
        if inside and (best is None or len(mnt) >= len(best[1])):  # (a later mount on the same point is on top)
            best = (kind[0], mnt)
    return best


def ephemeral_filesystem(fs: tuple[str, str] | None, path: str) -> str | None:
    """Why `path`, on filesystem `fs` (`filesystem_of`), would not outlive the machine or the
    container, or None."""
    if fs is None or fs[0] not in EPHEMERAL_FILESYSTEMS:
        return None
    return f"{path} is on {fs[0]} (mounted at {fs[1]}), which keeps nothing past a reboot or its container"


def location(root: str, tenant: str, job_id: str, own_path: str | None = None) -> str:
    """The job's checkpoint location: its own persistent path, else one under the root."""
    if own_path and ephemeral_reason(own_path) is None:
        return own_path.removeprefix("file://")
    return f"{root.rstrip('/')}/{tenant}/{job_id}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_VERIFIED: dict[Path, tuple[tuple[tuple[str, int, int], ...], Checkpoint | None, str]] = {}
_VERIFIED_MAX = 4096


def _signature(path: Path) -> tuple[tuple[str, int, int], ...]:
    """Names, sizes and modification times of a checkpoint's files: unchanged, no need to hash again."""
    out = []
    for f in sorted(path.iterdir()):
        st = f.stat()
        out.append((f.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def verify(path: Path) -> tuple[Checkpoint | None, str]:
    """(the checkpoint, "") if it is good, else (None, why). Never raises: a bad one is just bad.
    A result is remembered while the files keep their sizes and times (hashing GBs every few
    seconds would cost more than the job's own I/O)."""
    try:
        sig = _signature(path)
    except OSError as exc:
        return None, f"unreadable ({type(exc).__name__}: {exc})"[:300]
    hit = _VERIFIED.get(path)
    if hit is not None and hit[0] == sig:
        return hit[1], hit[2]
    try:
        ckpt, reason = _verify(path)
    except Exception as exc:  # noqa: BLE001 - any malformed manifest or unreadable file
        ckpt, reason = None, f"unreadable ({type(exc).__name__}: {exc})"[:300]
    if len(_VERIFIED) >= _VERIFIED_MAX:
        _VERIFIED.clear()
    _VERIFIED[path] = (sig, ckpt, reason)
    return ckpt, reason


def _verify(path: Path) -> tuple[Checkpoint | None, str]:
    m = STEP_DIR.match(path.name)
    if m is None:
        return None, "not a step-<n> directory"
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
        files = manifest["files"]
        step = int(manifest["step"])
    except FileNotFoundError:
        return None, "no manifest (partial)"
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"manifest unreadable ({type(exc).__name__})"
    if step != int(m.group(1)):
        return None, f"manifest says step {step}, the directory {path.name}"
    total = 0
    for name, meta in sorted(files.items()):
        f = path / name
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            return None, f"{name} is missing"
        if size != int(meta["size"]):
            return None, f"{name} has {size} bytes, the manifest says {meta['size']}"
        if sha256_file(f) != meta["sha256"]:
            return None, f"{name} does not match its sha256"
        total += size
    digest = hashlib.sha256((path / MANIFEST).read_bytes()).hexdigest()
    created = float(manifest.get("created_at", 0.0))
    if not 0.0 <= created < 4e9:  # not a time this code can turn into a date
        created = 0.0
    world = manifest.get("world_size")
    world = world if isinstance(world, int) and not isinstance(world, bool) and world >= 1 else None
    return Checkpoint(step, path, total, digest, created, world), ""


def scan(location_dir: str | Path) -> list[Scanned]:
    """Every step directory, newest first, each good or bad with the reason."""
    d = Path(location_dir)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            ckpt, reason = verify(p)
            out.append(Scanned(int(m.group(1)), p, ckpt, reason))
    return sorted(out, key=lambda s: -s.step)


def latest_good(location_dir: str | Path) -> Checkpoint | None:
    return next((s.checkpoint for s in scan(location_dir) if s.checkpoint is not None), None)


def prune(location_dir: str | Path, keep: int) -> list[Path]:
    """Keep the newest `keep` good checkpoints (and anything newer than the oldest kept); remove the rest."""
    kept = 0
    removed = []
    for s in scan(location_dir):
        if kept >= keep:
            shutil.rmtree(s.path, ignore_errors=True)
            removed.append(s.path)
        elif s.checkpoint is not None:
            kept += 1
    return removed


def check_writable(location_dir: str | Path) -> str | None:
    """None if a file can be created, synced and removed there; else why not."""
    d = Path(location_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".probe-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        return f"{d} is not writable: {exc.strerror or exc}"
    return None


# ---------------------------------------------------------------- stores: where locations live


class CheckpointStore(Protocol):
    """What the guardian needs of a checkpoint location's storage. `file://` (and plain paths) are
    built in; an object store (s3://, gs://) registers its own with `register_store`."""

    def check_writable(self, location: str) -> str | None: ...
    def scan(self, location: str) -> list[Scanned]: ...
    def prune(self, location: str, keep: int) -> list[str]: ...


class LocalStore:
    """A local or mounted filesystem (NFS, a persistent volume): the embedded default."""

    def check_writable(self, location: str) -> str | None:
        return check_writable(_path(location))

    def filesystem(self, location: str) -> tuple[str, str] | None:
        """(type, mount point) of the filesystem the location is on (an object store has none)."""
        return filesystem_of(_path(location))

    def scan(self, location: str) -> list[Scanned]:
        return scan(_path(location))

    def prune(self, location: str, keep: int) -> list[str]:
        return [str(p) for p in prune(_path(location), keep)]


_STORES: dict[str, Callable[[], CheckpointStore]] = {"file": LocalStore}


def register_store(scheme: str, factory: Callable[[], CheckpointStore]) -> None:
    _STORES[scheme] = factory


def store_for(location: str) -> CheckpointStore:
    scheme = location.split("://", 1)[0] if "://" in location else "file"
    factory = _STORES.get(scheme)
    if factory is None:
        raise ValueError(f"no checkpoint store for {scheme}:// locations (known: {', '.join(sorted(_STORES))}); "
                         "register one with gpufleet.shared.node.checkpoints.register_store")
    return factory()


def _path(location: str) -> Path:
    return Path(location.removeprefix("file://"))
