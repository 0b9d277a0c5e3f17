"""This machine as a node: CPUs, memory and NUMA nodes from the OS, GPUs from NVML."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from gpufleet.shared.contract.events import GpuDevice, NodeInventory


def cpu_count() -> int:
    """The CPUs this process may run on (its affinity mask: a container's cpuset, taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def memory_mib(proc_root: Path = Path("/proc")) -> int:
    """MemTotal of /proc/meminfo, in MiB; 0 where it cannot be read."""
    try:
        with open(proc_root / "meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "MemTotal":  # "MemTotal:       24683336 kB" (the kernel's kB are KiB)
                    return int(rest.split()[0]) // 1024
    except (OSError, ValueError):
        pass
    return 0


def numa_nodes(sys_root: Path = Path("/sys")) -> int:
    """The NUMA nodes the kernel knows (node0, node1, ...), at least 1."""
    try:
        nodes = [p for p in (sys_root / "devices/system/node").iterdir()
                 if p.name.startswith("node") and p.name[4:].isdigit()]
    except OSError:
        return 1
    return max(1, len(nodes))


def host_inventory(gpus: tuple[GpuDevice, ...], labels: dict[str, str] | None = None, driver: str = "process",
                   proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys")) -> NodeInventory:
    """This machine's inventory with these GPUs; `labels` are added to (and win over) the
    hostname label."""
    return NodeInventory(
        cpu_milli=cpu_count() * 1000, memory_mib=memory_mib(proc_root), gpus=gpus,
        numa_nodes=numa_nodes(sys_root), labels={"hostname": socket.gethostname(), **(labels or {})},
        driver=driver,
    )


def local_node_inventory(driver: str = "process", labels: dict[str, str] | None = None) -> NodeInventory:
    """This machine as a node: its GPUs where NVML is there (see nvml.open_backend), else none."""
    from gpufleet.shared.node.nvml import open_backend  # here: pynvml is loaded only by who asks for GPUs

    backend = open_backend()
    gpus: tuple[GpuDevice, ...] = ()
    if backend is not None:
        try:
            gpus = backend.devices()
        finally:
            backend.close()
    return host_inventory(gpus, labels=labels, driver=driver)
