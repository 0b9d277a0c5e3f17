"""Where things are: the data dir, the running mesh's endpoints (mesh.json), environment."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import MeshNotRunning

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
