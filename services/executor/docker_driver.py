"""The `docker` driver: a job's replica is one container on the node's Docker engine (aiodocker).

The engine is the source of truth: every container this driver creates carries labels

    gpufleet.job / .tenant / .replica / .attempt   which workload it is
    gpufleet.node                                  the node (executor) that owns it
    gpufleet.allocation                            the job.placed event it runs for
    gpufleet.started_at                            when we created it (unix seconds)

and is named `gpufleet-<key with '.' as '-'>`, so a restarted executor (a new `DockerDriver` on
the same node) finds its containers again by label and re-adopts them. What the engine does not
keep is in the data dir:

    docker/<key>.stopped   we asked it to stop (so its exit was ours, not the job's)
    logs/<key>.log         stdout and stderr, saved by `cleanup` before the container is removed

The container request is a pure function of the launch (`container_config`): non-root user,
CPU / memory / pids limits, no network by default, tini as pid 1 (signals reach the job, zombies
are reaped), the checkpoint dir bind-mounted at the same path, and exactly the allocated GPUs as
an NVIDIA device request.

A container never sees a credential (issue 14): its environment is the job's (`Launch.job_env`:
the spec's env and the GPUFLEET_* variables), nothing of the executor's, and its only mounts are
the job's checkpoint dir and, read-only, its staged dataset / model, each refused where it would
show the container anything of the mesh's (`mount_conflict`: the data dir or a directory above
it, anything in creds/ or in the driver's own state and logs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import aiodocker
from aiodocker.containers import DockerContainer
from aiodocker.exceptions import DockerError

from .drivers import GRACE_S, DriverError, Launch, Workload, workload_key
from .logs import LogText, read_tenant, write_tenant
from .process_driver import default_layout_data_dir, inside

log = logging.getLogger(__name__)

PullPolicy = Literal["never", "if-not-present", "always"]
PULL_POLICIES: tuple[PullPolicy, ...] = ("never", "if-not-present", "always")

LABEL = "gpufleet"
L_JOB, L_TENANT, L_REPLICA, L_ATTEMPT = f"{LABEL}.job", f"{LABEL}.tenant", f"{LABEL}.replica", f"{LABEL}.attempt"
L_NODE, L_ALLOCATION, L_STARTED_AT = f"{LABEL}.node", f"{LABEL}.allocation", f"{LABEL}.started_at"
L_GPUS = f"{LABEL}.gpus"  # the allocated GPU indices, comma-separated (for the cleanliness check)

DEFAULT_USER = "65534:65534"  # nobody:nogroup
DEFAULT_PIDS_LIMIT = 4096
MIB = 1024 * 1024
_LOG_FLUSH_BYTES = 1 << 20


def container_name(key: str) -> str:
    """The container of workload `key` (`<job>.<replica>.<attempt>`): job ids are [A-Za-z0-9_-]."""
    return "gpufleet-" + key.replace(".", "-")


def is_root_user(user: str) -> bool:
    """`user` (docker's `uid[:gid]` or `name[:group]`) runs as root."""
    name = user.split(":", 1)[0].strip()
    return name in ("", "0", "root")


def mount_conflict(path: str, protected: Sequence[str] = (), private: Sequence[str] = ()) -> str | None:
    """What of the mesh's a bind mount of host `path` would show a container, or None.

    `protected`: directories a mount must not be, nor be above (the data dir: one inside it, such
    as a job's dir under the checkpoint root, is fine); `private`: directories a mount must not
    overlap at all (creds/, the driver's state and logs). Symlinks are resolved (the one I/O).
    """
    for p in (*protected, *private):
        if inside(p, path):
            return p
    for p in private:
        if inside(path, p):
            return p
    return None


def container_config(
    launch: Launch,
    user: str = DEFAULT_USER,
    *,
    started_at: float = 0.0,
    pids_limit: int = DEFAULT_PIDS_LIMIT,
    network_mode: str = "none",
    init: bool = True,
    stop_timeout_s: float = GRACE_S,
    protected: Sequence[str] = (),
    private: Sequence[str] = (),
) -> dict[str, Any]:
    """The Docker Engine `containers/create` body for `launch` (pure: no I/O, only data, but for
    resolving the checkpoint dir against `protected` / `private`).

    An empty command runs the image's own entrypoint / command. Raises DriverError naming the
    field when the launch cannot become a container (a checkpoint dir that would show it
    something `protected` or `private`, see `mount_conflict`, among them).
    """
    if not launch.image:
        raise DriverError("image_required", f"job {launch.job_id}: the docker driver needs an image (spec image is empty)")
    if is_root_user(user):
        raise DriverError("root_user", f"job {launch.job_id}: containers run as a non-root user, got user={user!r}")
    if launch.cpu_milli <= 0:
        raise DriverError("bad_resources", f"job {launch.job_id}: cpu_milli must be > 0, got {launch.cpu_milli}")
    if launch.memory_mib <= 0:
        raise DriverError("bad_resources", f"job {launch.job_id}: memory_mib must be > 0, got {launch.memory_mib}")
    if pids_limit <= 0:
        raise DriverError("bad_resources", f"job {launch.job_id}: pids_limit must be > 0, got {pids_limit}")
    memory = launch.memory_mib * MIB
    host: dict[str, Any] = {
        "NanoCpus": launch.cpu_milli * 1_000_000,
        "Memory": memory,
        "MemorySwap": memory,  # no swap on top of the limit
        "PidsLimit": pids_limit,
        "NetworkMode": network_mode,
        "Init": init,
        "RestartPolicy": {"Name": "no"},
        "AutoRemove": False,  # the exit code is read after the exit; `cleanup` removes it
        "SecurityOpt": ["no-new-privileges"],
        "CapDrop": ["ALL"],
    }
    if launch.checkpoint_dir:
        ckpt = launch.checkpoint_dir
        if not os.path.isabs(ckpt) or ":" in ckpt:
            raise DriverError(
                "bad_checkpoint_dir",
                f"job {launch.job_id}: checkpoint_dir must be an absolute path without ':', got {ckpt!r}")
        conflict = mount_conflict(ckpt, protected, private)
        if conflict is not None:
            raise DriverError(
                "checkpoint_dir_not_allowed",
                f"job {launch.job_id}: checkpoint_dir {ckpt!r} is not mounted: it would show the container "
                f"{conflict}, which is the mesh's")
        host["Binds"] = [f"{ckpt}:{ckpt}:rw"]
    for what, path in launch.data_dirs:  # its staged dataset / model, read-only at the same path
        if not os.path.isabs(path) or ":" in path:
            raise DriverError("bad_data_dir", f"job {launch.job_id}: the {what} dir must be an absolute path "
                              f"without ':', got {path!r}")
        conflict = mount_conflict(path, protected, private)
        if conflict is not None:
            raise DriverError("data_dir_not_allowed", f"job {launch.job_id}: the {what} dir {path!r} is not "
                              f"mounted: it would show the container {conflict}, which is the mesh's")
        host.setdefault("Binds", []).append(f"{path}:{path}:ro")
    if launch.gpu_uuids:
        host["DeviceRequests"] = [
            {"Driver": "nvidia", "DeviceIDs": list(launch.gpu_uuids), "Capabilities": [["gpu"]]}]
    config: dict[str, Any] = {
        "Image": launch.image,
        "Env": [f"{k}={v}" for k, v in sorted(launch.job_env().items())],
        "Labels": {
            L_JOB: launch.job_id,
            L_TENANT: launch.tenant,
            L_REPLICA: str(launch.replica),
            L_ATTEMPT: str(launch.attempt),
            L_NODE: launch.node_id,
            L_ALLOCATION: launch.placed_event_id,
            L_STARTED_AT: f"{started_at:.6f}",
            L_GPUS: ",".join(str(i) for i in launch.gpu_indices),
        },
        "User": user,
        "Tty": False,
        "OpenStdin": False,
        "AttachStdin": False,
        "AttachStdout": False,
        "AttachStderr": False,
        "StopSignal": "SIGTERM",
        "StopTimeout": max(0, math.ceil(stop_timeout_s)),
        "HostConfig": host,
    }
    if launch.command:
        config["Cmd"] = list(launch.command)
    if launch.checkpoint_dir:
        config["WorkingDir"] = launch.checkpoint_dir
    return config


def _workload_of(info: dict[str, Any], stopped_by_us: bool) -> Workload | None:
    """A Workload from a `containers/{id}/json` inspect result (None if its labels are not ours)."""
    labels: dict[str, str] = (info.get("Config") or {}).get("Labels") or {}
    state: dict[str, Any] = info.get("State") or {}
    try:
        job_id, replica, attempt = labels[L_JOB], int(labels[L_REPLICA]), int(labels[L_ATTEMPT])
        node_id = labels[L_NODE]
    except (KeyError, ValueError):
        return None
    try:
        started_at = float(labels.get(L_STARTED_AT, "0"))
    except ValueError:
        started_at = 0.0
    running = bool(state.get("Running"))
    exit_code: int | None = None
    if not running and state.get("Status") in ("exited", "dead"):
        exit_code = int(state.get("ExitCode", 0))
    pid = int(state.get("Pid") or 0) or None
    return Workload(
        job_id=job_id, replica=replica, attempt=attempt, node_id=node_id, handle=str(info["Id"]),
        running=running, exit_code=exit_code, started_at=started_at, pid=pid if running else None,
        container_id=str(info["Id"]), stopped_by_us=stopped_by_us,
        gpu_indices=tuple(int(g) for g in labels.get(L_GPUS, "").split(",") if g.strip().isdigit()),
    )


class DockerDriver:
    """Runs workloads as containers on one node's Docker engine (see the module docstring).

    `stop` returns once the stop is under way (the engine sends SIGTERM, waits, then SIGKILL);
    the exit shows in `list`, as with the process driver.
    """

    name = "docker"

    def __init__(
        self,
        node_id: str,
        data_dir: Path,
        docker_url: str | None = None,
        user: str = DEFAULT_USER,
        pull: PullPolicy = "if-not-present",
        allowed_images: Callable[[str, str], bool] | None = None,
        *,
        pids_limit: int = DEFAULT_PIDS_LIMIT,
        network_mode: str = "none",
        init: bool = True,
        mesh_data_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if is_root_user(user):
            raise ValueError(f"DockerDriver: user must not be root, got user={user!r}")
        if pull not in PULL_POLICIES:
            raise ValueError(f"DockerDriver: pull must be one of {PULL_POLICIES}, got pull={pull!r}")
        self.node_id = node_id
        self.data_dir = Path(data_dir)
        self.docker_url = docker_url
        self.user = user
        self.pull = pull
        self.allowed_images = allowed_images
        self.pids_limit = pids_limit
        self.network_mode = network_mode
        self.init = init
        self.state_dir = self.data_dir / "docker"
        self.logs_dir = self.data_dir / "logs"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        # what no container may see through its checkpoint mount: the mesh's data dir (given, from
        # $GPUFLEET_DATA_DIR, or above the agent's default work dir), the driver's own and the
        # executor's creds file ($GPUFLEET_CREDS), whole; creds/ dirs and the driver's state and
        # logs, nothing of them either
        meshes = {str(p) for p in (mesh_data_dir, os.environ.get("GPUFLEET_DATA_DIR"),
                                   default_layout_data_dir(self.data_dir)) if p}
        protected = [*meshes, str(self.data_dir)]
        private = [os.path.join(m, "creds") for m in meshes] + [str(self.state_dir), str(self.logs_dir)]
        creds = os.environ.get("GPUFLEET_CREDS")
        if creds:
            protected.append(creds)
            if Path(creds).parent.name == "creds":
                private.append(str(Path(creds).parent))
        self.protected = tuple(sorted({os.path.realpath(p) for p in protected}))
        self.private = tuple(sorted({os.path.realpath(p) for p in private}))
        self._docker: aiodocker.Docker | None = None
        self._stopping: dict[str, asyncio.Task[None]] = {}

    # ------------------------------------------------------------ Driver

    async def start(self, launch: Launch) -> Workload:
        if launch.node_id != self.node_id:
            raise DriverError(
                "wrong_node", f"job {launch.job_id}: launch is for node {launch.node_id!r}, this driver runs {self.node_id!r}")
        key = launch.key
        name = container_name(key)
        existing = await self._inspect(key)
        if existing is not None:
            if (existing.get("State") or {}).get("Status") == "created":  # created, then we died: start it
                await self._start_or_remove(launch, DockerContainer(await self._client(), id=existing["Id"]))
                existing = await self._inspect(key) or existing
            return self._to_workload(key, existing)
        image = launch.image or ""
        if self.allowed_images is not None and image and not self.allowed_images(launch.tenant, image):
            raise DriverError(
                "image_not_allowed", f"job {launch.job_id}: image {image!r} is not allowed for tenant {launch.tenant!r}")
        config = self.config_for(launch, started_at=time.time())
        await self._ensure_image(launch.job_id, image)
        await asyncio.to_thread(write_tenant, self.logs_dir, key, launch.tenant)  # whose log it is (`gpufleet logs`)
        if launch.checkpoint_dir:
            await asyncio.to_thread(self._prepare_checkpoint_dir, Path(launch.checkpoint_dir))
        docker = await self._client()
        try:
            container = await docker.containers.create(config, name=name)
        except DockerError as e:
            if e.status == 409:  # created meanwhile (a concurrent start): that one it is
                info = await self._inspect(key)
                if info is not None:
                    return self._to_workload(key, info)
            raise self._error("create_failed", f"job {launch.job_id}: creating container {name}", e) from e
        await self._start_or_remove(launch, container)
        info = await self._inspect(key)
        if info is None:
            raise DriverError("start_failed", f"job {launch.job_id}: container {name} vanished right after it started")
        w = self._to_workload(key, info)
        log.info("started %s as container %s (%s): %s", key, name, w.container_id and w.container_id[:12],
                 " ".join(launch.command))
        return w

    async def list(self) -> list[Workload]:
        docker = await self._client()
        try:
            found = await docker.containers.list(
                all=True, filters=json.dumps({"label": [f"{L_NODE}={self.node_id}"]}))
        except DockerError as e:
            raise self._error("list_failed", f"listing the containers of node {self.node_id}", e) from e
        infos = await asyncio.gather(*(self._inspect_id(c.id) for c in found))
        out: list[Workload] = []
        for info in infos:
            if info is None:
                continue  # removed between the list and the inspect
            labels = (info.get("Config") or {}).get("Labels") or {}
            if labels.get(L_NODE) != self.node_id:
                continue
            try:
                key = workload_key(labels[L_JOB], int(labels[L_REPLICA]), int(labels[L_ATTEMPT]))
            except (KeyError, ValueError):
                log.warning("container %s has gpufleet.node=%s but no valid job labels: %s",
                            info.get("Name"), self.node_id, labels)
                continue
            if (info.get("State") or {}).get("Status") == "created":
                continue  # created, never started (the executor died in between): `start` starts it
            w = self._to_workload(key, info)
            out.append(w)
        return sorted(out, key=lambda w: w.key)

    async def stop(self, key: str, grace_s: float = GRACE_S) -> None:
        if key in self._stopping and not self._stopping[key].done():
            return
        info = await self._inspect(key)
        if info is None or not (info.get("State") or {}).get("Running"):
            return
        await asyncio.to_thread(self._stop_marker(key).write_text, f"{time.time():.6f} grace={grace_s}\n")
        container = DockerContainer(await self._client(), id=info["Id"])
        task = asyncio.create_task(self._docker_stop(key, container, grace_s), name=f"docker-stop-{key}")
        self._stopping[key] = task
        await asyncio.sleep(0)  # let the request go out before returning

    async def pids(self, key: str) -> set[int]:
        info = await self._inspect(key)
        if info is None or not (info.get("State") or {}).get("Running"):
            return set()
        container = DockerContainer(await self._client(), id=info["Id"])
        try:
            top = await container.top(ps_args="-eo pid")
        except DockerError as e:
            if e.status in (404, 409) or "is not running" in e.message:
                return set()
            raise self._error("pids_failed", f"listing the processes of {container_name(key)}", e) from e
        titles: list[str] = top.get("Titles") or []
        col = titles.index("PID") if "PID" in titles else 0
        out: set[int] = set()
        for row in top.get("Processes") or []:
            with contextlib.suppress(ValueError, IndexError):
                out.add(int(row[col]))
        return out

    async def log_text(self, key: str) -> LogText | None:
        tenant = read_tenant(self.logs_dir, key)
        if tenant is None:
            return None
        info = await self._inspect(key)
        if info is None:  # cleaned up: the copy saved then
            return LogText(tenant, path=self.logs_dir / f"{key}.log")
        container = DockerContainer(await self._client(), id=info["Id"])
        try:
            chunks = await container.log(stdout=True, stderr=True)
        except DockerError as e:
            if e.status in (404, 409):  # removed, or being removed, meanwhile: the copy clean-up saved first
                return LogText(tenant, path=self.logs_dir / f"{key}.log")
            raise self._error("logs_failed", f"logs of container {container_name(key)}", e) from e
        return LogText(tenant, data="".join(chunks).encode("utf-8", "replace"),
                       running=bool((info.get("State") or {}).get("Running")))

    async def cleanup(self, key: str) -> None:
        task = self._stopping.pop(key, None)
        info = await self._inspect(key)
        if info is not None:
            container = DockerContainer(await self._client(), id=info["Id"])
            if (info.get("State") or {}).get("Running"):
                log.warning("cleanup of %s while it still runs: killing it", key)
                with contextlib.suppress(DockerError):
                    await container.kill(signal="SIGKILL")
                with contextlib.suppress(DockerError):
                    await container.wait()
            await self._save_logs(key, container)
            try:
                await container.delete(force=True)
            except DockerError as e:
                if e.status != 404:
                    raise self._error("cleanup_failed", f"removing container {container_name(key)}", e) from e
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(FileNotFoundError):
            self._stop_marker(key).unlink()

    async def close(self) -> None:
        pending = [t for t in self._stopping.values() if not t.done()]
        if pending:  # each ends once the engine has stopped its container (bounded by its grace)
            await asyncio.gather(*pending, return_exceptions=True)
        self._stopping.clear()
        if self._docker is not None:
            await self._docker.close()
            self._docker = None

    def config_for(self, launch: Launch, started_at: float = 0.0) -> dict[str, Any]:
        """The `containers/create` body `start` sends for `launch` (see `container_config`)."""
        return container_config(
            launch, self.user, started_at=started_at, pids_limit=self.pids_limit,
            network_mode=self.network_mode, init=self.init, protected=self.protected, private=self.private)

    # ------------------------------------------------------------ inside

    async def _client(self) -> aiodocker.Docker:
        if self._docker is None:  # made lazily: aiohttp wants a running loop
            self._docker = aiodocker.Docker(url=self.docker_url)
        return self._docker

    def _stop_marker(self, key: str) -> Path:
        return self.state_dir / f"{key}.stopped"

    def _to_workload(self, key: str, info: dict[str, Any]) -> Workload:
        w = _workload_of(info, stopped_by_us=self._stop_marker(key).exists())
        if w is None:
            raise DriverError("not_ours", f"container {info.get('Name')} has no valid gpufleet labels")
        return w

    def _error(self, code: str, what: str, e: DockerError) -> DriverError:
        if e.status == 900:  # aiodocker: the engine could not be reached
            code = "engine_unreachable"
        return DriverError(code, f"{what}: docker engine said ({e.status}) {e.message}")

    async def _inspect_id(self, container_id: str) -> dict[str, Any] | None:
        docker = await self._client()
        try:
            return await docker.containers.container(container_id).show()
        except DockerError as e:
            if e.status == 404:
                return None
            raise self._error("inspect_failed", f"inspecting container {container_id}", e) from e

    async def _inspect(self, key: str) -> dict[str, Any] | None:
        """The container of `key` on this node, or None; a same-named container of another node is an error."""
        info = await self._inspect_id(container_name(key))
        if info is None:
            return None
        labels = (info.get("Config") or {}).get("Labels") or {}
        try:
            theirs = workload_key(labels[L_JOB], int(labels[L_REPLICA]), int(labels[L_ATTEMPT]))
        except (KeyError, ValueError):
            theirs = None
        if theirs != key or labels.get(L_NODE) != self.node_id:
            raise DriverError(
                "name_conflict",
                f"container {container_name(key)} exists but is not workload {key} of node {self.node_id} "
                f"(its labels: job={labels.get(L_JOB)!r} replica={labels.get(L_REPLICA)!r} "
                f"attempt={labels.get(L_ATTEMPT)!r} node={labels.get(L_NODE)!r})")
        return info

    async def _ensure_image(self, job_id: str, image: str) -> None:
        docker = await self._client()
        if self.pull != "always":
            try:
                await docker.images.inspect(image)
                return
            except DockerError as e:
                if e.status != 404:
                    raise self._error("image_inspect_failed", f"job {job_id}: looking up image {image!r}", e) from e
            if self.pull == "never":
                raise DriverError(
                    "image_missing", f"job {job_id}: image {image!r} is not on node {self.node_id} and pull=never")
        log.info("pulling %s for job %s", image, job_id)
        try:
            await docker.images.pull(image)
        except DockerError as e:
            raise self._error("image_pull_failed", f"job {job_id}: pulling image {image!r}", e) from e

    async def _start_or_remove(self, launch: Launch, container: DockerContainer) -> None:
        """Start it; if the engine refuses (no GPU runtime, bad mount ...), remove it and say why."""
        try:
            await container.start()
        except DockerError as e:
            with contextlib.suppress(DockerError):
                await container.delete(force=True)
            raise self._error(
                "start_failed", f"job {launch.job_id}: starting container {container_name(launch.key)}", e) from e

    async def _docker_stop(self, key: str, container: DockerContainer, grace_s: float) -> None:
        try:
            await container.stop(t=max(0, math.ceil(grace_s)))  # the engine: SIGTERM, wait t s, SIGKILL
        except DockerError as e:
            if e.status not in (304, 404):
                log.warning("stopping %s: docker engine said (%s) %s", key, e.status, e.message)

    async def _save_logs(self, key: str, container: DockerContainer) -> None:
        """stdout + stderr of the (stopped) container into logs/<key>.log, replacing an older copy."""
        path = self.logs_dir / f"{key}.log"
        tmp = path.with_suffix(".log.tmp")
        f = await asyncio.to_thread(open, tmp, "w", encoding="utf-8")
        try:
            buf: list[str] = []
            size = 0
            try:
                async for chunk in container.log(stdout=True, stderr=True, follow=True):
                    buf.append(chunk)
                    size += len(chunk)
                    if size >= _LOG_FLUSH_BYTES:
                        await asyncio.to_thread(f.write, "".join(buf))
                        buf, size = [], 0
            except DockerError as e:
                log.warning("logs of %s: docker engine said (%s) %s", key, e.status, e.message)
                buf.append(f"\n[gpufleet: logs incomplete: docker engine said ({e.status}) {e.message}]\n")
            await asyncio.to_thread(f.write, "".join(buf))
        finally:
            await asyncio.to_thread(f.close)
        await asyncio.to_thread(tmp.replace, path)

    def _prepare_checkpoint_dir(self, path: Path) -> None:
        """Create it; when we made it and run as root, hand it to the container's numeric user."""
        if path.is_dir():
            return
        path.mkdir(parents=True, exist_ok=True)
        uid, _, gid = self.user.partition(":")
        if os.geteuid() == 0 and uid.isdigit():
            os.chown(path, int(uid), int(gid) if gid.isdigit() else -1)
