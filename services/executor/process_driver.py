"""The `process` driver: a job's replica is a local process group.

Layout under the data dir (what lets a restarted executor re-adopt its jobs):

    jobs/<key>/meta.json   job, replica, attempt, node, pid (= process group), its start time
    jobs/<key>/exit        the exit code, written by the wrapper shell when the command ends
    jobs/<key>/stopped     the signal we stopped it with (15, then 9), if we did
    logs/<key>.log         stdout and stderr, kept after clean-up

The command runs under `sh -c '"$@"; echo $? > exit'` in a new session, so the executor can
die and come back without killing it, the exit code survives the executor, and one killpg
reaches every process the job started (unless one left the group on purpose: those are found
by the GPUFLEET_JOB_ID in their environment, see `job_of_pid`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from .drivers import GRACE_S, DriverError, Launch, Workload

log = logging.getLogger(__name__)

# The shell outlives a SIGTERM to the group (a trap, reset to default in the command it runs), so
# a job that saves a checkpoint and exits in its grace period has its own exit code recorded.
WRAPPER = 'trap ":" TERM INT; "$@"; echo $? > "$GPUFLEET_EXIT_FILE"'


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name (state is [0]), or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw[raw.rfind(")") + 2:].split()


def proc_start_time(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[19]) if fields else None  # field 22 of stat: start time in clock ticks


def alive(pid: int, start_time: int | None = None) -> bool:
    """The process exists, is not a zombie, and (if given) is the one started at `start_time`."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return start_time is None or int(fields[19]) == start_time


def group_pids(pgid: int) -> set[int]:
    """Live processes whose process group is `pgid`."""
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
                out.add(int(entry.name))
    return out


def job_of_pid(pid: int) -> tuple[str, int, int] | None:
    """(job, replica, attempt) of a process the executor started, from its environment."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    job = env.get(b"GPUFLEET_JOB_ID")
    if job is None:
        return None
    try:
        return job.decode(), int(env.get(b"GPUFLEET_REPLICA", b"0")), int(env.get(b"GPUFLEET_ATTEMPT", b"1"))
    except ValueError:
        return None


class ProcessDriver:
    name = "process"

    def __init__(self, node_id: str, data_dir: Path, base_env: dict[str, str] | None = None) -> None:
        self.node_id = node_id
        self.jobs = Path(data_dir) / "jobs"
        self.logs = Path(data_dir) / "logs"
        self.jobs.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self._children: dict[str, asyncio.subprocess.Process] = {}  # ours: reaped by the loop
        self._stopping: dict[str, asyncio.Task[None]] = {}

    # ------------------------------------------------------------ Driver

    async def start(self, launch: Launch) -> Workload:
        if not launch.command:
            raise DriverError("command_missing", f"job {launch.job_id}: the process driver needs a command")
        d = self.jobs / launch.key
        existing = self._read(d)
        if existing is not None:
            return existing
        d.mkdir(parents=True, exist_ok=True)
        exit_file = d / "exit"
        env = {**self.base_env, **launch.job_env(), "GPUFLEET_EXIT_FILE": str(exit_file)}
        with self._log_file(launch) as out:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", WRAPPER, "gpufleet-job", *launch.command,
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
                env=env, cwd=launch.checkpoint_dir or str(d), start_new_session=True,
            )
        self._children[launch.key] = proc
        meta = {
            "job_id": launch.job_id, "tenant": launch.tenant, "replica": launch.replica,
            "attempt": launch.attempt, "node_id": launch.node_id, "pid": proc.pid,
            "start_time": proc_start_time(proc.pid), "started_at": time.time(),
            "placed_event_id": launch.placed_event_id, "gpu_indices": list(launch.gpu_indices),
            "command": list(launch.command),
        }
        tmp = d / "meta.json.tmp"
        tmp.write_text(json.dumps(meta))
        tmp.replace(d / "meta.json")
        log.info("started %s as pid %d: %s", launch.key, proc.pid, " ".join(launch.command))
        w = self._read(d)
        assert w is not None
        return w

    async def list(self) -> list[Workload]:
        out = []
        for d in sorted(self.jobs.iterdir()):
            w = self._read(d)
            if w is not None and w.node_id == self.node_id:
                out.append(w)
        return out

    async def stop(self, key: str, grace_s: float = GRACE_S) -> None:
        meta = self._meta(self.jobs / key)
        if meta is None or key in self._stopping:
            return
        pgid = int(meta["pid"])
        if not alive(pgid, meta.get("start_time")) and not group_pids(pgid):
            return
        (self.jobs / key / "stopped").write_text(str(int(signal.SIGTERM)))
        self._signal(pgid, signal.SIGTERM)
        self._stopping[key] = asyncio.create_task(self._escalate(key, pgid, grace_s))

    async def pids(self, key: str) -> set[int]:
        return self._pids(key)

    def _pids(self, key: str) -> set[int]:
        meta = self._meta(self.jobs / key)
        if meta is None:
            return set()
        pids = group_pids(int(meta["pid"]))
        job = (meta["job_id"], int(meta["replica"]), int(meta["attempt"]))
        for entry in Path("/proc").iterdir():  # those that left the group still carry the job's env
            if entry.name.isdigit() and int(entry.name) not in pids and job_of_pid(int(entry.name)) == job:
                if alive(int(entry.name)):
                    pids.add(int(entry.name))
        return pids

    async def cleanup(self, key: str) -> None:
        d = self.jobs / key
        task = self._stopping.pop(key, None)
        if task is not None:
            task.cancel()
        meta = self._meta(d)
        if meta is not None and group_pids(int(str(meta["pid"]))):
            self._signal(int(str(meta["pid"])), signal.SIGKILL)  # what the command left in its group
        self._children.pop(key, None)
        for f in ("meta.json", "exit", "stopped", "meta.json.tmp"):
            with contextlib.suppress(FileNotFoundError):
                (d / f).unlink()
        with contextlib.suppress(OSError):
            d.rmdir()

    async def close(self) -> None:
        for task in self._stopping.values():
            task.cancel()

    # ------------------------------------------------------------ inside

    def _log_file(self, launch: Launch) -> Any:
        if launch.checkpoint_dir:
            Path(launch.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        return open(self.logs / f"{launch.key}.log", "ab")  # noqa: SIM115 - the caller closes it

    async def _escalate(self, key: str, pgid: int, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not group_pids(pgid):
                return
            await asyncio.sleep(0.05)
        if group_pids(pgid):
            log.warning("%s: still running %.1fs after SIGTERM; SIGKILL to its process group", key, grace_s)
            with contextlib.suppress(FileNotFoundError):
                (self.jobs / key / "stopped").write_text(str(int(signal.SIGKILL)))
            self._signal(pgid, signal.SIGKILL)

    @staticmethod
    def _signal(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    @staticmethod
    def _meta(d: Path) -> dict[str, Any] | None:
        try:
            meta: dict[str, Any] = json.loads((d / "meta.json").read_text())
        except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
            return None
        return meta

    def _read(self, d: Path) -> Workload | None:
        meta = self._meta(d)
        if meta is None:
            return None
        pid = int(str(meta["pid"]))
        start_time = meta.get("start_time")
        stopped_sig: int | None = None
        with contextlib.suppress(FileNotFoundError, ValueError):
            stopped_sig = int((d / "stopped").read_text())
        exit_code: int | None = None
        with contextlib.suppress(FileNotFoundError, ValueError):
            exit_code = int((d / "exit").read_text())  # the command ended by itself
        running = exit_code is None and (
            alive(pid, int(str(start_time)) if start_time is not None else None) or bool(group_pids(pid)))
        if not running and exit_code is None:
            if stopped_sig is not None:
                exit_code = 128 + stopped_sig
            else:
                child = self._children.get(d.name)
                if child is not None and child.returncode is not None:
                    rc = child.returncode  # the wrapper itself was signalled: -N
                    exit_code = 128 - rc if rc < 0 else rc
        return Workload(
            job_id=str(meta["job_id"]), replica=int(str(meta["replica"])), attempt=int(str(meta["attempt"])),
            node_id=str(meta["node_id"]), handle=str(pid), running=running, exit_code=exit_code,
            started_at=float(str(meta["started_at"])), pid=pid, stopped_by_us=stopped_sig is not None,
            gpu_indices=tuple(int(g) for g in meta.get("gpu_indices", ())),
        )
