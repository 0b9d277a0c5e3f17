"""The real GPUs of this node, through NVML (pynvml, from the `nvidia-ml-py` package).

`NvmlBackend` implements `GpuBackend` (shared/node/gpu.py). NVML is asked only in the backend's
methods; what it answers is turned into our types by the small pure functions below
(`short_model`, `mig_profile`, `islands_from_links`, `switches_from_ancestors`,
`devices_from_raw`, ...), which are tested without a GPU.

Every query that a GPU may not support (NUMA node, NVLink, ECC, utilisation in MIG mode, power,
XID events in a VM) is guarded: NotSupported (or any other NVML error) gives None or 0, never an
exception out of `sample()` or `devices()`.

`open_backend()` gives None, with the reason logged, where NVML cannot start (no driver, no
libnvidia-ml, no GPU); `nvml_status()` gives that reason.
"""

from __future__ import annotations

import ctypes
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml  # type: ignore[import-untyped]

from gpufleet.shared.contract.events import GpuDevice, MigDevice
from gpufleet.shared.node.gpu import GpuProcess, GpuSample

log = logging.getLogger(__name__)

MIB = 1 << 20
UNKNOWN_MIG_PROFILE = "unknown"
# the XIDs drained from the event set per sample(), at most: a storm must not stall a sample
MAX_EVENTS_PER_SAMPLE = 256

Handle = Any  # an NVML device handle (a ctypes pointer)


# ---------------------------------------------------------------- pure conversions


_VENDOR_WORDS = frozenset({"NVIDIA", "TESLA", "GEFORCE", "QUADRO"})
_TWO_WORD_FAMILIES = frozenset({"RTX", "GTX", "TITAN"})


def short_model(name: str) -> str:
    """NVML's product name -> the short model the placer matches on: "NVIDIA H200" -> "H200",
    "NVIDIA A100-SXM4-80GB" -> "A100", "NVIDIA H100 80GB HBM3" -> "H100", "Tesla V100-SXM2-32GB"
    -> "V100", "NVIDIA RTX A6000" -> "RTX-A6000" (a token: no spaces). MIG suffixes are dropped."""
    words = [w for w in name.replace("_", " ").split() if w.upper() not in _VENDOR_WORDS]
    if "MIG" in words:  # a MIG device's name: "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
        words = words[:words.index("MIG")]
    if not words:
        return name.strip().replace(" ", "-") or "unknown"
    first = words[0].split("-")[0]
    if first.upper() in _TWO_WORD_FAMILIES and len(words) > 1:
        return f"{first}-{words[1].split('-')[0]}"
    return first


_MIG_PROFILE = re.compile(r"(?<![\w.])(?:\d+c\.)?\d+g\.\d+gb(?:\+[a-z0-9]+)*(?![\w.])")


def mig_profile(name: str) -> str | None:
    """The MIG profile in a MIG device's name: "NVIDIA H100 80GB HBM3 MIG 1g.10gb" -> "1g.10gb",
    "NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb" -> "1c.3g.20gb", "... MIG 1g.10gb+me" -> "1g.10gb+me";
    None where the name carries none."""
    m = _MIG_PROFILE.search(name.lower())
    return m.group(0) if m else None


def pci_address(bus_id: str) -> str:
    """NVML's bus id ("00000000:1B:00.0", 8 hex digits of domain) -> the sysfs form
    ("0000:1b:00.0"): lower case, a 4-digit domain."""
    bus_id = bus_id.strip().lower()
    domain, sep, rest = bus_id.partition(":")
    if not sep:
        return bus_id
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return bus_id


def numa_from_sysfs(bus_id: str, sys_root: Path = Path("/sys")) -> int | None:
    """The NUMA node the kernel gives the PCI device, None where it cannot be read."""
    try:
        text = (sys_root / "bus/pci/devices" / pci_address(bus_id) / "numa_node").read_text()
        return int(text.strip())
    except (OSError, ValueError):
        return None


def resolve_numa(nvml_node: int | None, bus_id: str, sys_root: Path = Path("/sys")) -> int:
    """NVML's NUMA node where it knows it, else sysfs', else 0; -1 (no affinity) is 0."""
    node = nvml_node if nvml_node is not None else numa_from_sysfs(bus_id, sys_root)
    return node if node is not None and node >= 0 else 0


def _components(n: int, edges: Iterable[tuple[Any, Any]]) -> list[int]:
    """Union-find over positions 0..n-1 (and any other hashable endpoints the edges name);
    -> the component of each position, numbered 0, 1, ... in the order of their lowest position."""
    parent: dict[Any, Any] = {i: i for i in range(n)}

    def find(x: Any) -> Any:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra
    ids: dict[Any, int] = {}
    out = []
    for i in range(n):
        out.append(ids.setdefault(find(i), len(ids)))
    return out


def islands_from_links(n: int, links: Iterable[tuple[int, int | str]]) -> list[int]:
    """NVLink islands of n GPUs from their active links: (gpu position, peer), the peer a GPU
    position (a direct GPU-GPU link) or a string naming another endpoint (an NVSwitch's bus id),
    through which every GPU linked to it is connected. A GPU with no active link is an island
    of its own. -> the island of each GPU, numbered from 0 in order of the GPUs."""
    return _components(n, ((a, b if isinstance(b, int) else f"ep:{b}") for a, b in links))


# NVML topology levels: INTERNAL (one board), SINGLE (one PCIe switch), MULTIPLE (several
# switches, below the host bridge) mean the two GPUs sit under a common PCIe switch.
SHARED_SWITCH_LEVELS = frozenset({pynvml.NVML_TOPOLOGY_INTERNAL, pynvml.NVML_TOPOLOGY_SINGLE,
                                  pynvml.NVML_TOPOLOGY_MULTIPLE})


def switches_from_ancestors(n: int, levels: Mapping[tuple[int, int], int]) -> list[int]:
    """PCIe switch groups of n GPUs from their pairwise common-ancestor levels ((i, j) -> NVML
    topology level; a missing pair shares nothing): GPUs whose common ancestor is a switch
    (INTERNAL, SINGLE, MULTIPLE) are in one group, transitively. -> the group of each GPU."""
    return _components(n, (pair for pair, level in levels.items() if level in SHARED_SWITCH_LEVELS))


def bytes_to_mib(used: int | None) -> int:
    """A process's GPU memory in bytes (None: NVML cannot say) -> MiB, rounded up, so that any
    memory held shows as at least 1 MiB."""
    if used is None or used <= 0:
        return 0
    return (used + MIB - 1) // MIB


def merge_processes(entries: Iterable[tuple[int, int | None]], name_of: Callable[[int], str]) -> list[GpuProcess]:
    """(pid, used bytes) from the compute and graphics lists (a pid may be in both, or several
    times through MIG instances) -> one GpuProcess per pid with the most memory seen, by pid."""
    used: dict[int, int] = {}
    for pid, used_bytes in entries:
        used[pid] = max(used.get(pid, 0), bytes_to_mib(used_bytes))
    return [GpuProcess(pid, mib, name_of(pid)) for pid, mib in sorted(used.items())]


def process_name(pid: int, proc_root: Path = Path("/proc")) -> str:
    """The process's command name (/proc/<pid>/comm); "" where it is gone or in another pid namespace."""
    try:
        return (proc_root / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class RawGpu:
    """What NVML said about one GPU, before conversion: the input of `devices_from_raw`."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    pci_bus_id: str = ""
    numa_node: int = 0  # already resolved (see resolve_numa)
    mig_enabled: bool = False
    mig: tuple[tuple[str, str], ...] = ()  # (uuid, name) of each MIG device
    nvlink_peers: tuple[str, ...] = ()  # the remote PCI bus id of each active NVLink
    ancestors: Mapping[int, int] = field(default_factory=dict)  # other GPU's index -> topology level


def devices_from_raw(raws: Sequence[RawGpu]) -> tuple[GpuDevice, ...]:
    """NVML's answers about a node's GPUs -> GpuDevice with topology: an NVLink peer whose bus id
    is another GPU's is that GPU, any other (an NVSwitch) an endpoint that joins all linked to it."""
    pos_of_bus = {pci_address(r.pci_bus_id): p for p, r in enumerate(raws) if r.pci_bus_id}
    pos_of_index = {r.index: p for p, r in enumerate(raws)}
    links: list[tuple[int, int | str]] = []
    for p, r in enumerate(raws):
        for peer in r.nvlink_peers:
            addr = pci_address(peer)
            links.append((p, pos_of_bus.get(addr, addr)))
    levels: dict[tuple[int, int], int] = {}
    for p, r in enumerate(raws):
        for other, level in r.ancestors.items():
            q = pos_of_index.get(other)
            if q is not None and q != p:
                levels[(min(p, q), max(p, q))] = level
    islands = islands_from_links(len(raws), links)
    switches = switches_from_ancestors(len(raws), levels)
    out = []
    for p, r in enumerate(raws):
        migs = tuple(MigDevice(profile=mig_profile(name) or UNKNOWN_MIG_PROFILE, uuid=uuid) for uuid, name in r.mig)
        out.append(GpuDevice(
            index=r.index, uuid=r.uuid, model=short_model(r.name), memory_mib=r.memory_total_bytes // MIB,
            nvlink_island=islands[p], pcie_switch=switches[p], numa_node=r.numa_node,
            mig_enabled=r.mig_enabled, mig_devices=migs if r.mig_enabled else (),
        ))
    return tuple(out)


# ---------------------------------------------------------------- NVML


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """One NVML query: its answer, or None where NVML says NotSupported (or fails otherwise)."""
    try:
        return fn(*args)
    except pynvml.NVMLError_NotSupported:
        return None
    except pynvml.NVMLError as e:
        log.debug("NVML %s: %s", getattr(fn, "__name__", fn), e)
        return None


def _int(value: Any) -> int | None:
    return int(value) if value is not None else None


def _attr(value: Any, name: str) -> Any:
    """An attribute of an NVML answer, None where the query failed (None)."""
    return getattr(value, name, None) if value is not None else None


def nvml_status() -> str | None:
    """None where NVML starts (and there is a GPU); else why not, in words."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return f"NVML cannot start: {e} ({type(e).__name__})"
    except OSError as e:
        return f"NVML cannot start: {e}"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError as e:
        return f"NVML cannot count the GPUs: {e} ({type(e).__name__})"
    finally:
        _call(pynvml.nvmlShutdown)
    return None if count > 0 else "NVML started but sees no GPU"


def nvml_available() -> bool:
    return nvml_status() is None


class NvmlBackend:
    """The node's GPUs through NVML. Construction starts NVML (raises pynvml.NVMLError where it
    cannot: use open_backend() for None instead); close() stops it."""

    def __init__(self, sys_root: Path = Path("/sys"), proc_root: Path = Path("/proc")) -> None:
        self._sys_root = sys_root
        self._proc_root = proc_root
        pynvml.nvmlInit()
        self._open = True
        try:
            self._handles: dict[int, Handle] = {}
            self._uuids: dict[int, str] = {}
            self._totals: dict[int, int] = {}
            for i in range(int(pynvml.nvmlDeviceGetCount())):
                try:
                    h = pynvml.nvmlDeviceGetHandleByIndex(i)
                    self._uuids[i] = _text(pynvml.nvmlDeviceGetUUID(h))
                except pynvml.NVMLError as e:  # a GPU fallen off the bus: the others still work
                    log.warning("NVML: GPU %d left out: %s", i, e)
                    continue
                self._handles[i] = h
                self._totals[i] = (_int(_attr(_call(pynvml.nvmlDeviceGetMemoryInfo, h), "total")) or 0) // MIB
            self._driver = _text(_call(pynvml.nvmlSystemGetDriverVersion) or "")
            self._events: Any = None
            self._event_index: dict[int, int] = {}  # handle address -> GPU index
            self._setup_events()
        except BaseException:
            self.close()
            raise

    @property
    def driver_version(self) -> str:
        return self._driver

    @property
    def gpu_count(self) -> int:
        return len(self._handles)

    # -- topology

    def _raw(self, i: int, h: Handle) -> RawGpu:
        nv = pynvml
        name = _text(_call(nv.nvmlDeviceGetName, h) or "")
        total = _int(_attr(_call(nv.nvmlDeviceGetMemoryInfo, h), "total"))
        bus_id = _text(_attr(_call(nv.nvmlDeviceGetPciInfo, h), "busId") or "")
        nvml_numa = _int(_call(nv.nvmlDeviceGetNumaNodeId, h))
        mig_enabled = self._mig_enabled(h)
        ancestors: dict[int, int] = {}
        for j, other in self._handles.items():
            level = _int(_call(nv.nvmlDeviceGetTopologyCommonAncestor, h, other)) if j != i else None
            if level is not None:
                ancestors[j] = level
        return RawGpu(
            index=i, uuid=self._uuids[i], name=name, memory_total_bytes=total if total is not None else self._totals.get(i, 0) * MIB, pci_bus_id=bus_id,
            numa_node=resolve_numa(nvml_numa, bus_id, self._sys_root), mig_enabled=mig_enabled,
            mig=self._mig_devices(h) if mig_enabled else (), nvlink_peers=self._nvlink_peers(h),
            ancestors=ancestors,
        )

    @staticmethod
    def _mig_enabled(h: Handle) -> bool:
        mode = _call(pynvml.nvmlDeviceGetMigMode, h)
        return mode is not None and int(mode[0]) == pynvml.NVML_DEVICE_MIG_ENABLE

    @staticmethod
    def _mig_handles(h: Handle) -> list[Handle]:
        """The GPU's MIG devices (a slot without an instance answers NotFound, and is skipped)."""
        count = _int(_call(pynvml.nvmlDeviceGetMaxMigDeviceCount, h)) or 0
        return [m for k in range(count) if (m := _call(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, h, k)) is not None]

    def _mig_devices(self, h: Handle) -> tuple[tuple[str, str], ...]:
        out = []
        for m in self._mig_handles(h):
            uuid = _text(_call(pynvml.nvmlDeviceGetUUID, m) or "")
            if uuid:
                out.append((uuid, _text(_call(pynvml.nvmlDeviceGetName, m) or "")))
        return tuple(out)

    def _nvlink_peers(self, h: Handle) -> tuple[str, ...]:
        nv = pynvml
        peers = []
        for link in range(int(nv.NVML_NVLINK_MAX_LINKS)):
            try:
                active = int(nv.nvmlDeviceGetNvLinkState(h, link)) == nv.NVML_FEATURE_ENABLED
            except nv.NVMLError_NotSupported:
                if link == 0:
                    break  # no NVLink on this GPU (or in this VM)
                continue
            except nv.NVMLError:  # past the GPU's last link (InvalidArgument), or a link down
                continue
            if active:
                bus = _text(_attr(_call(nv.nvmlDeviceGetNvLinkRemotePciInfo, h, link), "busId") or "")
                if bus:
                    peers.append(bus)
        return tuple(peers)

    def devices(self) -> tuple[GpuDevice, ...]:
        return devices_from_raw([self._raw(i, h) for i, h in self._handles.items()])

    # -- samples

    def _setup_events(self) -> None:
        nv = pynvml
        try:
            self._events = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            log.info("NVML: no event set, XIDs will not be seen: %s", e)
            return
        for i, h in self._handles.items():
            supported = _int(_call(nv.nvmlDeviceGetSupportedEventTypes, h))
            if supported is not None and not supported & nv.nvmlEventTypeXidCriticalError:
                log.info("NVML: GPU %d reports no XID events", i)
                continue
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._events)
                self._event_index[_address(h)] = i
            except nv.NVMLError as e:
                log.info("NVML: GPU %d: XID events not registered: %s", i, e)

    def _drain_xids(self) -> dict[int, list[int]]:
        """The XID events since the last call, by GPU index (never waits)."""
        nv = pynvml
        out: dict[int, list[int]] = {}
        if self._events is None or not self._event_index:
            return out
        for _ in range(MAX_EVENTS_PER_SAMPLE):
            try:
                data = nv.nvmlEventSetWait(self._events, 0)
            except nv.NVMLError_Timeout:
                break
            except nv.NVMLError as e:
                log.debug("NVML event wait: %s", e)
                break
            if not int(data.eventType) & nv.nvmlEventTypeXidCriticalError:
                continue
            i = self._event_index.get(_address(data.device))
            if i is None:  # another handle for the same GPU (or a MIG instance): by UUID
                uuid = _text(_call(nv.nvmlDeviceGetUUID, data.device) or "")
                i = next((j for j, u in self._uuids.items() if u == uuid), None)
            if i is not None:
                out.setdefault(i, []).append(int(data.eventData))
        return out

    def _sample_one(self, i: int, h: Handle, xids: Sequence[int]) -> GpuSample:
        nv = pynvml
        util = _int(_attr(_call(nv.nvmlDeviceGetUtilizationRates, h), "gpu"))
        mem = _call(nv.nvmlDeviceGetMemoryInfo, h)
        temp = _int(_call(nv.nvmlDeviceGetTemperatureV, h, nv.NVML_TEMPERATURE_GPU))
        if temp is None:  # drivers older than nvmlDeviceGetTemperatureV
            temp = _int(_call(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU))
        power_mw = _int(_call(nv.nvmlDeviceGetPowerUsage, h))

        def ecc(kind: int) -> int:
            return _int(_call(nv.nvmlDeviceGetTotalEccErrors, h, kind, nv.NVML_VOLATILE_ECC)) or 0

        return GpuSample(
            index=i, uuid=self._uuids[i], util_pct=float(util) if util is not None else None,
            mem_used_mib=int(mem.used) // MIB if mem is not None else 0,
            mem_total_mib=int(mem.total) // MIB if mem is not None else self._totals.get(i, 0),
            temp_c=float(temp) if temp is not None else None, power_w=power_mw / 1000.0 if power_mw is not None else None,
            ecc_uncorrected=ecc(nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            ecc_corrected=ecc(nv.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            xids=tuple(xids), processes=tuple(self._processes(h)),
        )

    def sample(self) -> list[GpuSample]:
        xids = self._drain_xids()
        return [self._sample_one(i, h, xids.get(i, ())) for i, h in self._handles.items()]

    def _processes(self, h: Handle) -> list[GpuProcess]:
        nv = pynvml
        handles = [h, *self._mig_handles(h)] if self._mig_enabled(h) else [h]
        entries: list[tuple[int, int | None]] = []
        for d in handles:
            for query in (nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetGraphicsRunningProcesses):
                for p in _call(query, d) or ():
                    entries.append((int(p.pid), _int(getattr(p, "usedGpuMemory", None))))
        return merge_processes(entries, lambda pid: process_name(pid, self._proc_root))

    def processes(self, index: int) -> list[GpuProcess]:
        h = self._handles.get(index)
        return self._processes(h) if h is not None else []

    def close(self) -> None:
        if not getattr(self, "_open", False):
            return
        self._open = False
        if getattr(self, "_events", None) is not None:
            _call(pynvml.nvmlEventSetFree, self._events)
            self._events = None
        _call(pynvml.nvmlShutdown)


def _address(handle: Handle) -> int:
    """A device handle's pointer value: the same GPU's handles compare equal by it."""
    try:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


def open_backend(sys_root: Path = Path("/sys"), proc_root: Path = Path("/proc")) -> NvmlBackend | None:
    """The NVML backend, or None (and the reason logged) where NVML cannot start or sees no GPU."""
    try:
        backend = NvmlBackend(sys_root=sys_root, proc_root=proc_root)
    except pynvml.NVMLError as e:
        log.warning("NVML unavailable, no GPUs: %s (%s)", e, type(e).__name__)
        return None
    except OSError as e:
        log.warning("NVML unavailable, no GPUs: %s", e)
        return None
    if not backend.gpu_count:
        log.warning("NVML unavailable, no GPUs: NVML started but sees no GPU")
        backend.close()
        return None
    return backend
