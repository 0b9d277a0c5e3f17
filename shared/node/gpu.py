"""A node's GPUs as the executor and telemetry see them: one interface, two backends.

- `NvmlBackend` (shared/node/nvml.py): the real GPUs, through NVML (pynvml).
- `SimGpuBackend` (here): the same interface over simulated GPUs, so that every telemetry rule
  (zombie memory, ECC / XID, idle, starved) runs and is tested on machines without a GPU.
  Tests and the sim world change it through its methods (a process appears, an XID fires).

A backend is synchronous (NVML calls are short); shells call it from a thread when they must.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from gpufleet.shared.contract.events import GpuDevice


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_mib: int
    name: str = ""


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment."""

    index: int
    uuid: str
    util_pct: float | None  # None: the backend cannot say (NVML NotSupported)
    mem_used_mib: int
    mem_total_mib: int
    temp_c: float | None = None
    power_w: float | None = None
    ecc_uncorrected: int = 0  # volatile (since the driver loaded) uncorrected ECC errors
    ecc_corrected: int = 0
    xids: tuple[int, ...] = ()  # XID events since the last sample
    processes: tuple[GpuProcess, ...] = ()


def sample_doc(s: GpuSample) -> dict[str, object]:
    """A sample as JSON-ready data (what FLEET_TELEMETRY carries); built by hand: `asdict` is 10x slower."""
    return {"index": s.index, "uuid": s.uuid, "util_pct": s.util_pct, "mem_used_mib": s.mem_used_mib,
            "mem_total_mib": s.mem_total_mib, "temp_c": s.temp_c, "power_w": s.power_w,
            "ecc_uncorrected": s.ecc_uncorrected, "ecc_corrected": s.ecc_corrected, "xids": list(s.xids),
            "processes": [{"pid": p.pid, "used_mib": p.used_mib, "name": p.name} for p in s.processes]}


class GpuBackend(Protocol):
    def devices(self) -> tuple[GpuDevice, ...]:
        """The GPUs with their topology (NVLink island, PCIe switch, NUMA node, MIG instances)."""
        ...

    def sample(self) -> list[GpuSample]:
        ...

    def processes(self, index: int) -> list[GpuProcess]:
        """Processes holding memory on this GPU now."""
        ...

    def close(self) -> None:
        ...


# XIDs that mean the GPU needs attention (NVIDIA's XID catalogue): 48 double-bit ECC, 63/64 row
# remapping, 74 NVLink, 79 fallen off the bus, 92 high single-bit ECC rate, 94/95 contained /
# uncontained ECC, 119/120 GSP errors. Application faults (13, 31, 43, 45) are the job's, not the GPU's.
FATAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})


@dataclass
class _SimGpu:
    device: GpuDevice
    util_pct: float = 0.0
    temp_c: float = 35.0
    power_w: float = 70.0
    ecc_uncorrected: int = 0
    ecc_corrected: int = 0
    xids: list[int] = field(default_factory=list)
    processes: dict[int, GpuProcess] = field(default_factory=dict)
    util_of: dict[int, float] = field(default_factory=dict)  # pid -> the utilisation it drives


class SimGpuBackend:
    """Simulated GPUs of one node. Utilisation is the sum of what its processes drive (capped at
    100) unless `set_util` pinned it; memory used is the sum of its processes' memory."""

    def __init__(self, devices: tuple[GpuDevice, ...]) -> None:
        self._gpus = {d.index: _SimGpu(d) for d in devices}
        self._pinned: dict[int, float] = {}

    # -- the GpuBackend interface

    def devices(self) -> tuple[GpuDevice, ...]:
        return tuple(g.device for g in self._gpus.values())

    def sample(self) -> list[GpuSample]:
        out = []
        for i, g in self._gpus.items():
            util = self._pinned.get(i, min(100.0, sum(g.util_of.values())))
            used = sum(p.used_mib for p in g.processes.values())
            out.append(GpuSample(
                index=i, uuid=g.device.uuid, util_pct=util, mem_used_mib=used,
                mem_total_mib=g.device.memory_mib, temp_c=g.temp_c + util * 0.4,
                power_w=g.power_w + util * 5.0, ecc_uncorrected=g.ecc_uncorrected,
                ecc_corrected=g.ecc_corrected, xids=tuple(g.xids),
                processes=tuple(sorted(g.processes.values(), key=lambda p: p.pid)),
            ))
            g.xids.clear()
        return out

    def processes(self, index: int) -> list[GpuProcess]:
        g = self._gpus.get(index)
        return sorted(g.processes.values(), key=lambda p: p.pid) if g else []

    def close(self) -> None:
        pass

    # -- the simulated world

    def add_process(self, gpu: int, pid: int, used_mib: int, name: str = "python", util_pct: float = 0.0) -> None:
        g = self._gpus[gpu]
        g.processes[pid] = GpuProcess(pid, used_mib, name)
        g.util_of[pid] = util_pct

    def remove_process(self, pid: int, gpu: int | None = None) -> None:
        for i, g in self._gpus.items():
            if gpu is None or gpu == i:
                g.processes.pop(pid, None)
                g.util_of.pop(pid, None)

    def set_process_util(self, pid: int, util_pct: float) -> None:
        for g in self._gpus.values():
            if pid in g.processes:
                g.util_of[pid] = util_pct

    def set_util(self, gpu: int, util_pct: float | None) -> None:
        """Pin a GPU's utilisation (None: back to what its processes drive)."""
        if util_pct is None:
            self._pinned.pop(gpu, None)
        else:
            self._pinned[gpu] = util_pct

    def inject_xid(self, gpu: int, xid: int) -> None:
        self._gpus[gpu].xids.append(xid)

    def inject_ecc(self, gpu: int, uncorrected: int = 1, corrected: int = 0) -> None:
        g = self._gpus[gpu]
        g.ecc_uncorrected += uncorrected
        g.ecc_corrected += corrected

    def pids(self) -> set[int]:
        return {pid for g in self._gpus.values() for pid in g.processes}

    def with_devices(self, devices: tuple[GpuDevice, ...]) -> None:
        """The node re-registered with other GPUs: keep the state of those it still has."""
        self._gpus = {d.index: replace(self._gpus[d.index], device=d) if d.index in self._gpus else _SimGpu(d)
                      for d in devices}
