"""The `process` driver: a job's replica is a local process group.

Layout under the data dir (what lets a restarted executor re-adopt its jobs):

    jobs/<key>/meta.json   job, replica, attempt, node, pid (= process group), its start time
    jobs/<key>/exit        the exit code, written by the wrapper shell when the command ends
    jobs/<key>/stopped     the signal we stopped it with (15, then 9), if we did
    jobs/<key>/work/       the workload's own directory: its HOME, and its working dir unless
                           it has a checkpoint dir (left in place if the job left files in it)
    logs/<key>.log         stdout and stderr, kept after clean-up

The command runs under `sh -c '"$@"; echo $? >&9'` in a new session, so the executor can
die and come back without killing it, the exit code survives the executor, and one killpg
reaches every process the job started (unless one left the group on purpose: those are found
by the GPUFLEET_JOB_ID in their environment, see `job_of_pid`). The executor opens the exit
file and the log and hands them over as file descriptors (the exit file as the wrapper's stdin,
which it moves to fd 9 and closes for the command), so the workload needs no way to them by path
and no right to write anything of the executor's.

A workload never sees a credential (issue 14):

- Its environment is built, not inherited: of the executor's own it gets only PATH, LANG /
  LC_*, TZ, LD_LIBRARY_PATH and the like (`INHERITED`), never a variable that names a
  credential (`is_credential_name`: GPUFLEET_CREDS, NATS_*, *_CREDS, *NKEY*, *TOKEN*,
  *PASSWORD*, GPUFLEET_PG_DSN ...); then HOME (its work dir), USER, and the job's own env with
  the GPUFLEET_* variables (`Launch.job_env`).
- When the executor runs as root, every workload runs as an unprivileged user without
  supplementary groups (`workload_user`: `gpufleet-job`, made with useradd if it does not
  exist, else `nobody`), so nothing the mesh keeps to itself (creds/ 0700 with 0600 files) is
  readable to it. The executor's own files stay its own: jobs/ and jobs/<key>/ are 0711
  (passable, neither listable nor writable), meta.json 0600, logs/ 0700 with 0600 logs. What the
  workload must write is handed to its user: its work dir, and its checkpoint dir when that is
  under the checkpoint root (`checkpoint_root`). A checkpoint dir of the job's own choosing
  (spec `checkpoint.path`, outside the root) is made by the workload's user, never by root: root
  making and handing over a path a tenant names would give the tenant a directory of its own
  anywhere (in site-packages, under /etc/systemd ...).

Limitations:

- Run as another user than root, the executor cannot switch users: workloads run as the
  executor's own user and can read whatever it can, its credentials included (a warning says
  so once). Run it as root, or keep credentials away from that user some other way.
- All workloads share the one user: this keeps the mesh's credentials from them, it does not
  isolate workloads (of different tenants) from each other.
- A path handed to the workload (HOME, GPUFLEET_CHECKPOINT_DIR) works only if every directory
  above it is searchable for its user (~/.gpufleet under a 0700 /root is not); the driver warns
  once per directory in the way. Its working dir works regardless (entered before the switch).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pwd
import signal
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gpufleet.shared.embedded.procs import proc_stat as _stat

from .drivers import GRACE_S, DriverError, Launch, Workload
from .logs import LogText, read_tenant, write_tenant

log = logging.getLogger(__name__)

# The shell outlives a SIGTERM to the group (a trap, reset to default in the command it runs), so
# a job that saves a checkpoint and exits in its grace period has its own exit code recorded. Its
# stdin is the exit file (opened by the executor): it keeps that as fd 9, out of the command's
# reach, and gives the command /dev/null as stdin.
WRAPPER = 'exec 9>&0 </dev/null; trap ":" TERM INT; "$@" 9>&-; echo $? >&9'

JOB_USER = "gpufleet-job"  # the unprivileged user workloads run as when the executor is root
FALLBACK_USER = "nobody"  # where that user cannot be made
NOBODY_ID = 65534

# What a workload gets of the executor's environment (everything else is built for it).
INHERITED = frozenset({
    "PATH", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "PYTHONPATH",
    "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "NVIDIA_DRIVER_CAPABILITIES",
})
INHERITED_PREFIXES = ("LC_",)
_CREDENTIAL_NAMES = frozenset({"GPUFLEET_CREDS", "GPUFLEET_PG_DSN", "GPUFLEET_NATS_URL", "DATABASE_URL"})
_CREDENTIAL_PREFIXES = ("NATS_", "PGPASS")
_CREDENTIAL_PARTS = ("CREDS", "CREDENTIAL", "NKEY", "TOKEN", "PASSWORD", "PASSWD", "SECRET", "_DSN",
                     "API_KEY", "PRIVATE_KEY", "ACCESS_KEY")


def is_credential_name(name: str) -> bool:
    """The environment variable `name` (may) hold a credential: never passed to a workload."""
    up = name.upper()
    return (up in _CREDENTIAL_NAMES or up.startswith(_CREDENTIAL_PREFIXES)
            or any(part in up for part in _CREDENTIAL_PARTS))


def inherited_env(environ: Any) -> dict[str, str]:
    """What a workload keeps of the executor's environment `environ`: `INHERITED`, no credential."""
    return {k: str(v) for k, v in environ.items()
            if (k in INHERITED or k.startswith(INHERITED_PREFIXES)) and not is_credential_name(k)}


def default_layout_data_dir(work_dir: Path) -> Path | None:
    """The mesh's data dir when `work_dir` is the agent's default `<data dir>/executor/<node>`."""
    work_dir = Path(os.path.realpath(work_dir))
    return work_dir.parent.parent if work_dir.parent.name == "executor" else None


def inside(path: str | os.PathLike[str], root: str | os.PathLike[str], *, strictly: bool = False) -> bool:
    """`path` is `root` or below it (strictly: below it), both with symlinks resolved."""
    p, r = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return (p != r or not strictly) and (p == r or r in p.parents)


# ---------------------------------------------------------------- who runs the workload


@dataclass(frozen=True)
class RunAs:
    """The user a workload runs as. `switch`: another user than the executor's (it is root)."""

    uid: int
    gid: int
    name: str
    switch: bool

    def popen_kwargs(self) -> dict[str, Any]:
        return {"user": self.uid, "group": self.gid, "extra_groups": []} if self.switch else {}


_default_user: RunAs | None = None
_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def _passwd(name: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except KeyError:
        return None


def _make_job_user() -> pwd.struct_passwd | None:
    """`useradd` the system user JOB_USER (no home, no login shell); None if that fails."""
    try:
        done = subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", JOB_USER],
            capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("cannot create user %s to run workloads as (%s)", JOB_USER, e)
        return _passwd(JOB_USER)
    made = _passwd(JOB_USER)  # made now, or meanwhile by another executor
    if made is None:
        log.warning("cannot create user %s to run workloads as: useradd said (%d) %s",
                    JOB_USER, done.returncode, done.stderr.strip())
    elif done.returncode == 0:
        log.info("created system user %s (uid %d) to run workloads as", JOB_USER, made.pw_uid)
    return made


def workload_user(name: str | None = None) -> RunAs:
    """Who workloads run as: as root, `name` (an existing non-root user) or by default
    JOB_USER (made if missing), else `nobody`; as any other user, that user itself."""
    global _default_user
    euid = os.geteuid()
    if euid != 0:
        if name is not None:
            pw = _passwd(name)
            if pw is None or pw.pw_uid != euid:
                raise ValueError(f"ProcessDriver: running workloads as user={name!r} needs root")
        me = _passwd(str(euid))
        return RunAs(euid, os.getegid(), me.pw_name if me else str(euid), switch=False)
    if name is not None:
        pw = _passwd(name)
        if pw is None:
            raise ValueError(f"ProcessDriver: no such user {name!r} to run workloads as")
        if pw.pw_uid == 0:
            raise ValueError(f"ProcessDriver: workloads never run as root, got user={name!r}")
        return RunAs(pw.pw_uid, pw.pw_gid, pw.pw_name, switch=True)
    if _default_user is None:
        pw = _passwd(JOB_USER) or _make_job_user() or _passwd(FALLBACK_USER)
        if pw is not None and pw.pw_uid == 0:
            pw = None
        _default_user = (RunAs(pw.pw_uid, pw.pw_gid, pw.pw_name, switch=True) if pw is not None
                         else RunAs(NOBODY_ID, NOBODY_ID, FALLBACK_USER, switch=True))
        if _default_user.name != JOB_USER:
            log.warning("workloads run as %s (uid %d): user %s is not there", _default_user.name,
                        _default_user.uid, JOB_USER)
    return _default_user


def unsearchable(path: Path, who: RunAs) -> Path | None:
    """The first directory from / down to `path` (itself included) that `who` may not search."""
    p = Path(os.path.abspath(path))
    for d in [*reversed(p.parents), p]:
        try:
            st = os.stat(d)
        except OSError:
            return d
        if st.st_uid == who.uid:
            bit = stat.S_IXUSR
        elif st.st_gid == who.gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return d
    return None


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
    """Runs workloads as local process groups (see the module docstring for who runs them).

    `base_env`: the executor environment workloads inherit from (default: `os.environ`, of
    which only `INHERITED` is kept); a credential is never passed on, whichever. `user`: who
    workloads run as when the executor is root (default JOB_USER, see `workload_user`).
    `checkpoint_root`: the root of the checkpoint dirs this driver makes and hands to the
    workload's user (default: $GPUFLEET_CHECKPOINT_ROOT, else `<data dir>/checkpoints` when the
    work dir is the agent's default `<data dir>/executor/<node>`); one elsewhere the workload's
    user must be able to make itself.
    """

    name = "process"

    def __init__(self, node_id: str, data_dir: Path, base_env: dict[str, str] | None = None, *,
                 user: str | None = None, checkpoint_root: str | os.PathLike[str] | None = None) -> None:
        self.node_id = node_id
        self.jobs = Path(data_dir) / "jobs"
        self.logs = Path(data_dir) / "logs"
        self.jobs.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.run_as = workload_user(user)
        if self.run_as.switch:
            os.chmod(self.jobs, 0o711)  # a workload may pass (to its work dir), not look around
            os.chmod(self.logs, 0o700)  # its log reaches it as a file descriptor
        else:
            _warn_once("same-user", "the executor does not run as root: workloads run as its own user %s "
                       "(uid %d) and can read what it can, its credentials included", self.run_as.name, self.run_as.uid)
        if base_env is None:
            self.base_env = inherited_env(os.environ)
        else:
            self.base_env = {k: v for k, v in base_env.items() if not is_credential_name(k)}
        if checkpoint_root is None:
            checkpoint_root = os.environ.get("GPUFLEET_CHECKPOINT_ROOT") or None
        if checkpoint_root is None:
            mesh = default_layout_data_dir(Path(data_dir))
            checkpoint_root = mesh / "checkpoints" if mesh is not None else None
        self.checkpoint_root = Path(os.path.realpath(checkpoint_root)) if checkpoint_root else None
        self._children: dict[str, subprocess.Popen[bytes]] = {}  # ours: reaped by `_read`
        self._stopping: dict[str, asyncio.Task[None]] = {}

    # ------------------------------------------------------------ Driver

    async def start(self, launch: Launch) -> Workload:
        if not launch.command:
            raise DriverError("command_missing", f"job {launch.job_id}: the process driver needs a command")
        d = self.jobs / launch.key
        existing = self._read(d)
        if existing is not None:
            return existing
        who = self.run_as
        work = self._work_dir(d)
        ckpt = await asyncio.to_thread(self._checkpoint_dir, launch)
        data = tuple(Path(p) for _, p in launch.data_dirs)
        for path in (work, ckpt, *data) if who.switch else ():
            blocked = unsearchable(path, who) if path is not None else None
            if blocked is None:
                continue
            _warn_once(f"reach:{blocked}", "%s: %s cannot reach %s (%s is not searchable for it): the "
                       "workload cannot use that path (HOME, GPUFLEET_CHECKPOINT_DIR, GPUFLEET_DATASET_DIR, "
                       "GPUFLEET_MODEL_DIR) by name", launch.key, who.name, path, blocked)
            if path == ckpt and blocked == ckpt:
                ckpt = None  # useless even as its working dir
        env = {**self.base_env, "HOME": str(work), "USER": who.name, "LOGNAME": who.name, **launch.job_env()}
        write_tenant(self.logs, launch.key, launch.tenant)  # whose log it is, kept with it (`gpufleet logs`)
        proc = self._spawn(launch, d, env, ckpt or work)
        self._children[launch.key] = proc
        meta = {
            "job_id": launch.job_id, "tenant": launch.tenant, "replica": launch.replica,
            "attempt": launch.attempt, "node_id": launch.node_id, "pid": proc.pid,
            "start_time": proc_start_time(proc.pid), "started_at": time.time(),
            "placed_event_id": launch.placed_event_id, "gpu_indices": list(launch.gpu_indices),
            "command": list(launch.command), "uid": who.uid,
        }
        self._write_meta(d, meta)
        log.info("started %s as pid %d (user %s): %s", launch.key, proc.pid, who.name, " ".join(launch.command))
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

    async def log_text(self, key: str) -> LogText | None:
        tenant = read_tenant(self.logs, key)
        if tenant is None:
            return None
        w = self._read(self.jobs / key)
        return LogText(tenant, path=self.logs / f"{key}.log", running=w is not None and w.running)

    async def cleanup(self, key: str) -> None:
        d = self.jobs / key
        task = self._stopping.pop(key, None)
        if task is not None:
            task.cancel()
        meta = self._meta(d)
        if meta is not None and group_pids(int(str(meta["pid"]))):
            self._signal(int(str(meta["pid"])), signal.SIGKILL)  # what the command left in its group
        child = self._children.pop(key, None)
        if child is not None:
            child.poll()  # reap the wrapper if it is done (else subprocess reaps it later)
        for f in ("meta.json", "exit", "stopped", "meta.json.tmp"):
            with contextlib.suppress(FileNotFoundError):
                (d / f).unlink()
        with contextlib.suppress(OSError):
            (d / "work").rmdir()  # unless the job left files there
        with contextlib.suppress(OSError):
            d.rmdir()

    async def close(self) -> None:
        for task in self._stopping.values():
            task.cancel()

    # ------------------------------------------------------------ inside

    def _work_dir(self, d: Path) -> Path:
        """jobs/<key>/ (the executor's: 0711 when the workload runs as another user) and in it
        work/, the workload's own."""
        d.mkdir(parents=True, exist_ok=True)
        work = d / "work"
        work.mkdir(exist_ok=True)
        who = self.run_as
        if who.switch:
            os.chmod(d, 0o711)
            os.chown(work, who.uid, who.gid, follow_symlinks=False)  # made just now in a dir only we write
            os.chmod(work, 0o700)
        return work

    def _spawn(self, launch: Launch, d: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
        """Start the wrapper (and so the command) as the workload's user, in a session of its own.

        subprocess.Popen, not asyncio's: uvloop's subprocess_exec has no user / group, and the
        exit lands in the exit file anyway (`_read` polls the child for a wrapper killed itself)."""
        exit_fd = os.open(d / "exit", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            with self._log_file(launch) as out:
                return subprocess.Popen(
                    ["/bin/sh", "-c", WRAPPER, "gpufleet-job", *launch.command],
                    stdin=exit_fd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                    start_new_session=True, close_fds=True, **self.run_as.popen_kwargs())
        finally:
            os.close(exit_fd)

    def _checkpoint_dir(self, launch: Launch) -> Path | None:
        """The job's checkpoint dir, made (and, as root, handed to the workload's user), or None
        if there is none or it could not be made."""
        if not launch.checkpoint_dir:
            return None
        path = Path(launch.checkpoint_dir)
        if not self.run_as.switch:
            path.mkdir(parents=True, exist_ok=True)  # the workload is the executor's user
            return path
        root = self.checkpoint_root
        if root is not None and inside(path, root, strictly=True) and self._hand_over(root, Path(os.path.realpath(path))):
            return path
        if path.is_dir():
            return path  # the job's own path: what it may do in it is for its permissions to say
        return path if self._mkdir_as_workload(launch, path) else None

    def _hand_over(self, root: Path, path: Path) -> bool:
        """Make `path` (under the checkpoint root) and give it to the workload's user. False
        where a directory on the way is not the executor's alone (writable for the workload's
        user, a symlink): then it is not ours to hand over."""
        who = self.run_as
        root.mkdir(parents=True, exist_ok=True)
        cur = root
        for part in path.relative_to(root).parts[:-1]:
            cur = cur / part
            with contextlib.suppress(FileExistsError):
                cur.mkdir()
            st = os.lstat(cur)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid == who.uid or st.st_mode & 0o022:
                return False
        with contextlib.suppress(FileExistsError):
            path.mkdir()
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            return False
        if st.st_uid != who.uid:  # made just now, or by an executor that ran jobs as root: all of it
            for _top, dirs, files, fd in os.fwalk(path, topdown=False):
                for name in (*dirs, *files):
                    with contextlib.suppress(FileNotFoundError):
                        if os.stat(name, dir_fd=fd, follow_symlinks=False).st_uid != who.uid:
                            os.chown(name, who.uid, who.gid, dir_fd=fd, follow_symlinks=False)
            os.chown(path, who.uid, who.gid, follow_symlinks=False)
        return True

    def _mkdir_as_workload(self, launch: Launch, path: Path) -> bool:
        """`mkdir -p path` as the workload's user (a path the job chose: never made by root)."""
        try:
            done = subprocess.run(
                ["mkdir", "-p", "--", str(path)], capture_output=True, text=True, timeout=60, check=False,
                cwd="/", env={"PATH": os.environ.get("PATH") or "/usr/bin:/bin"}, **self.run_as.popen_kwargs())
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("%s: cannot make checkpoint dir %s as %s: %s", launch.key, path, self.run_as.name, e)
            return False
        if done.returncode != 0:
            log.warning("%s: cannot make checkpoint dir %s as %s: %s", launch.key, path, self.run_as.name,
                        done.stderr.strip())
        return done.returncode == 0

    @staticmethod
    def _write_meta(d: Path, meta: dict[str, Any]) -> None:
        tmp = d / "meta.json.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "w") as f:
            f.write(json.dumps(meta))
        tmp.replace(d / "meta.json")

    def _log_file(self, launch: Launch) -> IO[bytes]:
        fd = os.open(self.logs / f"{launch.key}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return os.fdopen(fd, "ab")

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
            exit_code = int((d / "exit").read_text())  # the command ended by itself (empty until then)
        child = self._children.get(d.name)
        rc = child.poll() if child is not None else None  # reaps our wrapper once it is done
        running = exit_code is None and (
            alive(pid, int(str(start_time)) if start_time is not None else None) or bool(group_pids(pid)))
        if not running and exit_code is None:
            if stopped_sig is not None:
                exit_code = 128 + stopped_sig
            elif rc is not None:
                exit_code = 128 - rc if rc < 0 else rc  # the wrapper itself was signalled: -N
        return Workload(
            job_id=str(meta["job_id"]), replica=int(str(meta["replica"])), attempt=int(str(meta["attempt"])),
            node_id=str(meta["node_id"]), handle=str(pid), running=running, exit_code=exit_code,
            started_at=float(str(meta["started_at"])), pid=pid, stopped_by_us=stopped_sig is not None,
            gpu_indices=tuple(int(g) for g in meta.get("gpu_indices", ())),
        )
