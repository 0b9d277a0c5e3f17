"""Where things are: the data dir, the running mesh's endpoints (mesh.json), environment."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gpufleet.shared.contract.errors import MeshNotRunning

DEFAULT_DATA_DIR = Path.home() / ".gpufleet"
MESH_FILE = "mesh.json"


def data_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """--data-dir, else GPUFLEET_DATA_DIR, else ~/.gpufleet."""
    if explicit:
        return Path(explicit).expanduser().resolve()
    env = os.environ.get("GPUFLEET_DATA_DIR")
    return Path(env).expanduser().resolve() if env else DEFAULT_DATA_DIR


def read_mesh(explicit: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    path = data_dir(explicit) / MESH_FILE
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise MeshNotRunning(f"no mesh running in {path.parent} (start one with `gpufleet up`)") from None


def resolve_nats_url(explicit_data_dir: str | None = None) -> str:
    env = os.environ.get("GPUFLEET_NATS_URL")
    if env and not explicit_data_dir:
        return env
    return str(read_mesh(explicit_data_dir)["nats_url"])


def resolve_pg_dsn(explicit_data_dir: str | None = None) -> str:
    env = os.environ.get("GPUFLEET_PG_DSN")
    if env and not explicit_data_dir:
        return env
    return str(read_mesh(explicit_data_dir)["pg_dsn"])


def write_private(path: Path, data: str | bytes, private_dir: bool = False, mode: int = 0o600) -> None:
    """Replace `path` at once (a reader never sees half of it) with `data`, readable by its owner
    only unless `mode` says otherwise, never more open even briefly; with `private_dir`, its
    folder is made the owner's only too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if private_dir:
        os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.chmod(tmp, mode)
    tmp.replace(path)
