"""What a driver is: the executor's hands on one node.

The executor core decides *what* should run on its nodes (folded from the log); a driver makes
it so and says what it sees. Drivers are shells: all I/O, no decisions. The executor's
reconcile loop (`services/executor/agent.py`) compares the two, like a kubelet:

    desired (log)  ──┐
                     ├─ reconcile() ─► start / stop / report exit / clean up
    observed (driver.list()) ─┘

A workload is named by `Launch.key` (`<job>.<replica>.<attempt>`), and a driver must be able
to find its workloads again after the executor restarted (pid files, container labels): that is
how running jobs are re-adopted instead of lost or started twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .logs import LogText

GRACE_S = 10.0  # SIGTERM, then this long, then SIGKILL


@dataclass(frozen=True)
class Launch:
    """Everything a driver needs to start one replica of a job on its node."""

    job_id: str
    tenant: str
    replica: int
    attempt: int
    node_id: str
    command: tuple[str, ...]
    image: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    gpu_indices: tuple[int, ...] = ()
    gpu_uuids: tuple[str, ...] = ()  # of gpu_indices, or the MIG instance UUIDs
    cpu_milli: int = 1000
    memory_mib: int = 1024
    max_runtime_s: float = 86400.0
    checkpoint_dir: str | None = None
    placed_event_id: str = ""  # ties the workload to its allocation (a label / pid-file field)
    world_size: int = 1  # the replicas of its attempt (GPUFLEET_WORLD_SIZE; an elastic job's size now)
    # the local copies of its dataset / model, as ("dataset" | "model", path on the node): the agent
    # fills them in once staged (services/executor/staging.py); read-only mounts for a container
    data_dirs: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> str:
        return workload_key(self.job_id, self.replica, self.attempt)

    def job_env(self) -> dict[str, str]:
        """The environment every driver gives the job (on top of `env` from the spec)."""
        visible = ",".join(self.gpu_uuids) if self.gpu_uuids else ",".join(str(i) for i in self.gpu_indices)
        out = {
            **self.env,
            "GPUFLEET_JOB_ID": self.job_id,
            "GPUFLEET_TENANT": self.tenant,
            "GPUFLEET_REPLICA": str(self.replica),
            "GPUFLEET_WORLD_SIZE": str(self.world_size),
            "GPUFLEET_ATTEMPT": str(self.attempt),
            "GPUFLEET_NODE_ID": self.node_id,
            # exactly the allocated GPUs; none at all for a CPU-only job
            "CUDA_VISIBLE_DEVICES": visible,
            "NVIDIA_VISIBLE_DEVICES": visible or "void",
        }
        if self.checkpoint_dir:
            out["GPUFLEET_CHECKPOINT_DIR"] = self.checkpoint_dir
        for what, path in self.data_dirs:
            out[f"GPUFLEET_{what.upper()}_DIR"] = path  # GPUFLEET_DATASET_DIR, GPUFLEET_MODEL_DIR
        return out


def workload_key(job_id: str, replica: int, attempt: int) -> str:
    return f"{job_id}.{replica}.{attempt}"


@dataclass(frozen=True)
class Workload:
    """One workload as the driver sees it on the node: running, or exited and not cleaned up."""

    job_id: str
    replica: int
    attempt: int
    node_id: str
    handle: str  # pid (process) or container id (docker)
    running: bool
    exit_code: int | None = None  # once it exited; None if the driver cannot know (adopted, then lost)
    started_at: float = 0.0
    pid: int | None = None
    container_id: str | None = None
    stopped_by_us: bool = False  # it ended because `stop` was called
    gpu_indices: tuple[int, ...] = ()  # the GPUs it was given (for the cleanliness check after it ends)

    @property
    def key(self) -> str:
        return workload_key(self.job_id, self.replica, self.attempt)


class DriverError(Exception):
    """A driver could not do what it was asked (the image is not allowed, the command is empty ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Driver(Protocol):
    """A node's way of running workloads. Every method is safe to call again (idempotent)."""

    name: str

    async def start(self, launch: Launch) -> Workload:
        """Start it (a workload with this key already there is returned as it is, not started twice)."""
        ...

    async def list(self) -> list[Workload]:
        """Every workload of this driver on this node, running or exited and not yet cleaned up."""
        ...

    async def stop(self, key: str, grace_s: float = GRACE_S) -> None:
        """SIGTERM (docker stop), wait up to `grace_s`, then SIGKILL; the exit shows in `list`."""
        ...

    async def pids(self, key: str) -> set[int]:
        """Host pids of the workload's processes still alive (for the GPU cleanliness check)."""
        ...

    async def cleanup(self, key: str) -> None:
        """After its exit was reported: remove the container / pid file; logs stay in the data dir."""
        ...

    async def log_text(self, key: str) -> LogText | None:
        """The workload's log as it is now (its tenant, bytes or file, whether it still runs), also
        after its clean-up; None when this node has no log of `key` (services/executor/logs.py)."""
        ...

    async def close(self) -> None:
        ...
