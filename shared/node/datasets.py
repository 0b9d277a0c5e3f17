"""Where a job's dataset or model is read from: the sources the executor stages into its node's cache.

A job's `dataset` (and `model`) names either a source URI (`file:///data/c4-en`, `s3://bucket/c4`)
or a bare name (`c4-en`): a dataset the node may already hold, staged only when the cluster config
maps the name to a URI (`datasetCache.sources`, docs/config.md). `file://` (a local or mounted
filesystem: a directory or one file) is built in; an object store registers its own source with
`register_source`, as checkpoint stores do (shared/node/checkpoints.py).

A source is called from a worker thread: `fetch` copies into a directory of the caller's, calls
`progress` with the bytes copied so far, and stops with `StagingCancelled` as soon as
`cancelled()` says so (checked between chunks).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

from gpufleet.shared.contract.clusterconfig import source_refusal  # noqa: F401  (where sources are read)
from gpufleet.shared.contract.errors import PermanentError, RetryableError

CHUNK_BYTES = 1 << 20  # a copy looks at `cancelled` and reports progress once per chunk
MAX_FILES = 1_000_000  # a bound on what one source may list


class SourceMissing(PermanentError):
    """The source is not there (or not readable): the job cannot start with it."""


class StagingCancelled(RetryableError):
    """The copy was stopped (its job was cancelled, or the executor is stopping)."""


def is_uri(name: str) -> bool:
    """`name` names a source (`scheme://...`), not a bare dataset name."""
    return "://" in name


class DataSource(Protocol):
    """What the executor needs of the storage a dataset or model lives in."""

    def size(self, uri: str) -> int:
        """The bytes a copy of `uri` takes (SourceMissing if it is not there)."""
        ...

    def fetch(self, uri: str, dest: Path, progress: Callable[[int], None], cancelled: Callable[[], bool]) -> int:
        """Copy `uri` into the directory `dest` (made by the caller, empty); return the bytes copied."""
        ...


class LocalSource:
    """A local or mounted filesystem (NFS, a persistent volume): `file:///path`, a directory or a file.
    Regular files and directories are copied; symlinks and special files are left out."""

    def size(self, uri: str) -> int:
        return sum(size for _, size in self._files(_local_path(uri)))

    def fetch(self, uri: str, dest: Path, progress: Callable[[int], None], cancelled: Callable[[], bool]) -> int:
        root = _local_path(uri)
        done = 0
        for rel, _ in self._files(root):
            src = root / rel if rel != Path(".") else root
            out = dest / (rel if rel != Path(".") else root.name)
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(src, "rb") as fin, open(out, "wb") as fout:
                    while chunk := fin.read(CHUNK_BYTES):
                        if cancelled():
                            raise StagingCancelled(f"copy of {uri} stopped")
                        fout.write(chunk)
                        done += len(chunk)
                        progress(done)
            except OSError as exc:
                raise SourceMissing(f"{src}: {exc.strerror or exc}") from None
            shutil.copystat(src, out, follow_symlinks=False)
        return done

    @staticmethod
    def _files(root: Path) -> list[tuple[Path, int]]:
        """(path relative to `root`, size) of every regular file; `.` for `root` itself being a file."""
        try:
            st = root.stat()
        except OSError as exc:
            raise SourceMissing(f"{root}: {exc.strerror or exc}") from None
        if not os.access(root, os.R_OK):
            raise SourceMissing(f"{root}: not readable")
        if root.is_file():
            return [(Path("."), st.st_size)]
        if not root.is_dir():
            raise SourceMissing(f"{root}: neither a file nor a directory")
        out: list[tuple[Path, int]] = []
        for d, dirs, files in os.walk(root, onerror=_raise):
            dirs.sort()
            for name in sorted(files):
                p = Path(d) / name
                if p.is_symlink() or not p.is_file():
                    continue
                out.append((p.relative_to(root), p.stat().st_size))
                if len(out) > MAX_FILES:
                    raise SourceMissing(f"{root}: more than {MAX_FILES} files")
        return out


def _raise(exc: OSError) -> None:
    raise SourceMissing(f"{exc.filename}: {exc.strerror or exc}")


def _local_path(uri: str) -> Path:
    if not uri.startswith("file://"):
        return Path(uri)
    parsed = urlparse(uri)
    if parsed.netloc not in ("", "localhost"):
        raise SourceMissing(f"{uri}: a file:// URI names a path on this node (file:///path), not host {parsed.netloc}")
    return Path(unquote(parsed.path))


_SOURCES: dict[str, Callable[[], DataSource]] = {"file": LocalSource}


def register_source(scheme: str, factory: Callable[[], DataSource]) -> None:
    _SOURCES[scheme] = factory


def source_for(uri: str) -> DataSource:
    """The source that reads `uri` (SourceMissing, naming the schemes known, when there is none)."""
    scheme = uri.split("://", 1)[0] if is_uri(uri) else "file"
    factory = _SOURCES.get(scheme)
    if factory is None:
        raise SourceMissing(f"no dataset source for {scheme}:// (known: {', '.join(sorted(_SOURCES))}); "
                            "register one with gpufleet.shared.node.datasets.register_source")
    return factory()
