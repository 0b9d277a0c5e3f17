"""A real Docker engine for the tests: `docker_engine`, one private dockerd per test session.

It runs the way /work/shared/PROBE.md found works on a bare machine (no iptables, no bridge,
vfs storage, everything under one temp dir; containers then use network mode "none"), and
gets one local image, `gpufleet-test/busybox:1`, imported from a rootfs made of Debian's
static busybox (no registry is needed). Where dockerd or /bin/busybox is missing, we are not
root, or the engine does not come up, the tests that use it are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

TEST_IMAGE = "gpufleet-test/busybox:1"
START_TIMEOUT_S = 20.0
BUSYBOX_PATHS = ("/bin/busybox", "/usr/bin/busybox")


@dataclass(frozen=True)
class DockerEngine:
    url: str  # unix:///.../docker.sock, for aiodocker.Docker(url=...) / DockerDriver(docker_url=...)
    image: str  # a local image with busybox: sh, sleep, echo, cat, kill, id ...
    root: Path  # the engine's temp dir (daemon log: root / "dockerd.log")

    @property
    def socket_path(self) -> str:
        return self.url.removeprefix("unix://")


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 10.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def engine_request(sock: str, method: str, path: str, body: bytes | None = None,
                   content_type: str = "application/json", timeout: float = 30.0) -> tuple[int, bytes]:
    """One HTTP request to the engine's API socket (no client library: the fixture is sync)."""
    conn = _UnixHTTPConnection(sock, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _find_busybox() -> str | None:
    for p in BUSYBOX_PATHS:
        if os.access(p, os.X_OK):
            return p
    return shutil.which("busybox")


def _find_dockerd() -> str | None:
    found = shutil.which("dockerd")
    if found:
        return found
    for p in ("/usr/sbin/dockerd", "/usr/bin/dockerd", "/usr/local/bin/dockerd"):
        if os.access(p, os.X_OK):
            return p
    return None


def busybox_rootfs_tar(busybox: str) -> bytes:
    """A tar of a minimal rootfs: /bin/busybox and a link per applet, /tmp, /etc, /proc ..."""
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, int(time.time())
            tar.addfile(info)

        for d in ("bin", "etc", "proc", "sys", "dev", "root", "home"):
            add_dir(d)
        add_dir("tmp", 0o1777)
        tar.add(busybox, arcname="bin/busybox")
        for name in sorted(set(applets) - {"busybox"}):
            link = tarfile.TarInfo(f"bin/{name}")
            link.type, link.linkname, link.mode = tarfile.SYMTYPE, "busybox", 0o777
            tar.addfile(link)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n"),
                           ("etc/group", "root:x:0:\nnogroup:x:65534:\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def import_image(sock: str, rootfs_tar: bytes, image: str) -> None:
    """`docker import` through the API: POST /images/create?fromSrc=- with the tar as body."""
    repo, _, tag = image.rpartition(":")
    query = urllib.parse.urlencode({"fromSrc": "-", "repo": repo, "tag": tag})
    status, body = engine_request(sock, "POST", f"/images/create?{query}", rootfs_tar, "application/x-tar")
    if status != 200:
        raise RuntimeError(f"importing {image}: engine said {status}: {body[:500]!r}")
    for line in body.splitlines():
        with contextlib.suppress(ValueError):
            msg = json.loads(line)
            if isinstance(msg, dict) and msg.get("error"):
                raise RuntimeError(f"importing {image}: {msg['error']}")


def _wait_up(sock: str, proc: subprocess.Popen[bytes], timeout_s: float) -> str | None:
    """None once the engine answers /_ping, else why not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"dockerd exited with code {proc.returncode}"
        if os.path.exists(sock):
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, body = engine_request(sock, "GET", "/_ping", timeout=2.0)
                if status == 200 and body.strip() == b"OK":
                    return None
        time.sleep(0.1)
    return f"dockerd did not answer on {sock} within {timeout_s:.0f}s"


def _stop(sock: str, proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(OSError, http.client.HTTPException, ValueError):  # leftovers would slow its exit
            status, body = engine_request(sock, "GET", "/containers/json?all=1", timeout=5.0)
            if status == 200:
                for c in json.loads(body):
                    engine_request(sock, "DELETE", f"/containers/{c['Id']}?force=1", timeout=15.0)
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _log_tail(path: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[DockerEngine]:
    """A private dockerd (session-wide) with `gpufleet-test/busybox:1`; skips where none can run."""
    dockerd = _find_dockerd()
    busybox = _find_busybox()
    if dockerd is None:
        pytest.skip("no Docker engine: `dockerd` is not installed (apt-get install docker.io)")
    if busybox is None:
        pytest.skip("no test image: /bin/busybox is missing (apt-get install busybox-static)")
    if os.geteuid() != 0:
        pytest.skip("no Docker engine: starting a private dockerd needs root")
    # a short path: the engine's and containerd's unix sockets live under it (108-byte limit)
    root = Path(tempfile.mkdtemp(prefix="gpfd-", dir="/tmp"))
    sock = str(root / "docker.sock")
    config = root / "daemon.json"
    config.write_text("{}\n")  # not the host's /etc/docker/daemon.json
    log_path = root / "dockerd.log"
    cmd = [
        dockerd, "--iptables=false", "--ip6tables=false", "--bridge=none", "--storage-driver=vfs",
        "--config-file", str(config), "--data-root", str(root / "data"), "--exec-root", str(root / "exec"),
        "--pidfile", str(root / "dockerd.pid"), "-H", f"unix://{sock}",
    ]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        why = _wait_up(sock, proc, START_TIMEOUT_S)
        if why is not None:
            _stop(sock, proc)
            pytest.skip(f"no Docker engine: {why}; its log ends:\n{_log_tail(log_path)}")
        try:
            import_image(sock, busybox_rootfs_tar(busybox), TEST_IMAGE)
        except (OSError, RuntimeError, subprocess.CalledProcessError, http.client.HTTPException) as e:
            _stop(sock, proc)
            pytest.skip(f"no test image: {e}")
        yield DockerEngine(url=f"unix://{sock}", image=TEST_IMAGE, root=root)
    finally:
        _stop(sock, proc)
        shutil.rmtree(root, ignore_errors=True)
