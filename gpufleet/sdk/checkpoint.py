"""Checkpoints for the job's own code: save complete ones, resume from the latest good one.

    from gpufleet.sdk import checkpoint

    start = checkpoint.resume()                      # the latest good checkpoint, or None
    state = json.loads((start.path / "state.json").read_text()) if start else fresh()
    for step in ...:
        ...
        if step % 100 == 0:
            checkpoint.save(step, {"state.json": json.dumps(state).encode()})

`save` writes the files into a temporary directory, records each file's size and sha256 in a
manifest written last, syncs, and publishes it with one atomic rename to `step-<n>`: a crash
leaves either the previous checkpoint or the new one, never half of one. The location is
`GPUFLEET_CHECKPOINT_DIR`, which gpufleet sets for training and finetune jobs (persistent
storage, never the container's own filesystem). The guardian watches it: every new good
checkpoint becomes a `job.checkpoint_saved` event, and a resume after a failure names it.
`keep` (default `GPUFLEET_CHECKPOINT_KEEP`, else 3) good checkpoints are kept.

An elastic job (`replicas: {min, max, step}`) is resized by a restart from its checkpoint at the
new world size: each checkpoint records the world size it was saved at (`Checkpoint.world_size`),
`world_size()` is the one this run has, so the code re-shards its state when they differ:

    start = checkpoint.resume()
    if start and start.world_size != checkpoint.world_size():
        ...  # e.g. the same global batch over world_size() replicas
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from gpufleet.shared.node.checkpoints import MANIFEST, Checkpoint, latest_good, prune, sha256_file, verify

__all__ = ["Checkpoint", "location", "rank", "resume", "save", "stop_requested", "world_size"]

_stop = False
_installed = False


def stop_requested() -> bool:
    """True once gpufleet asked the job to stop (a preemption, a cancel): save a checkpoint and
    exit. gpufleet sends SIGTERM and waits the grace period before SIGKILL; a job that saves and
    exits in time resumes from that checkpoint. The first call installs the SIGTERM handler."""
    global _installed
    if not _installed:
        import signal

        def on_term(signum: int, frame: object) -> None:
            global _stop
            _stop = True

        signal.signal(signal.SIGTERM, on_term)
        _installed = True
    return _stop


def world_size() -> int:
    """The replicas of this run (`GPUFLEET_WORLD_SIZE`; 1 outside gpufleet): an elastic job's
    size now, which a resize changes."""
    return int(os.environ.get("GPUFLEET_WORLD_SIZE", "1"))


def rank() -> int:
    """This replica's index in the run, 0 .. world_size() - 1 (`GPUFLEET_REPLICA`)."""
    return int(os.environ.get("GPUFLEET_REPLICA", "0"))


def location(explicit: str | os.PathLike[str] | None = None) -> Path:
    where = explicit or os.environ.get("GPUFLEET_CHECKPOINT_DIR")
    if not where:
        raise RuntimeError("no checkpoint location: GPUFLEET_CHECKPOINT_DIR is not set (is this a training job?)")
    return Path(str(where).removeprefix("file://"))


def save(step: int, files: Mapping[str, bytes] | Callable[[Path], None], where: str | os.PathLike[str] | None = None,
         keep: int | None = None) -> Checkpoint:
    """Write a complete checkpoint for `step`: `files` (name -> bytes), or a function that writes
    its files into the directory it is given. Returns the checkpoint, verified."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    root = location(where)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:09d}"
    if final.exists():
        ckpt, reason = verify(final)
        if ckpt is not None:
            return ckpt  # saved already (a retried save does not write twice)
        shutil.rmtree(final)  # a bad one in the way
    tmp = root / f".tmp-step-{step:09d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if callable(files):
        files(tmp)
    else:
        for name, data in files.items():
            if "/" in name or name in ("", ".", "..", MANIFEST):
                raise ValueError(f"file name {name!r}: a plain name, not {MANIFEST}")
            (tmp / name).write_bytes(data)
    listed: dict[str, dict[str, int | str]] = {}
    size = 0
    for f in sorted(tmp.iterdir()):
        if f.is_file() and f.name != MANIFEST:
            _fsync(f)
            listed[f.name] = {"size": f.stat().st_size, "sha256": sha256_file(f)}
            size += f.stat().st_size
    created = time.time()
    manifest = {"step": step, "created_at": created, "job_id": os.environ.get("GPUFLEET_JOB_ID"),
                "attempt": os.environ.get("GPUFLEET_ATTEMPT"), "world_size": world_size(), "files": listed}
    body = json.dumps(manifest, sort_keys=True).encode()
    (tmp / MANIFEST).write_bytes(body)
    _fsync(tmp / MANIFEST)
    try:
        os.rename(tmp, final)  # the publish: atomic on one filesystem
    except OSError:
        # another rank of the gang published this step first: keep theirs if it is good
        shutil.rmtree(tmp, ignore_errors=True)
        ckpt, reason = verify(final)
        if ckpt is None:
            raise RuntimeError(f"checkpoint {final} exists and is bad: {reason}") from None
        return ckpt
    _fsync_dir(root)
    keep = keep if keep is not None else int(os.environ.get("GPUFLEET_CHECKPOINT_KEEP", "3"))
    prune(root, keep)
    return Checkpoint(step, final, size, hashlib.sha256(body).hexdigest(), created, world_size())


def resume(where: str | os.PathLike[str] | None = None) -> Checkpoint | None:
    """The latest good checkpoint (a partial or corrupt newer one is skipped), or None."""
    try:
        return latest_good(location(where))
    except RuntimeError:
        return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync(path)
    except OSError:  # some filesystems do not sync directories
        pass
