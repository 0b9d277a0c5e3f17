"""The NVML backend and the host's inventory, on machines without a GPU: the pure conversions
from what NVML answers to our types, the backend over a fake pynvml (every query path, the
NotSupported guards, XID events), NVML's absence, the OS's numbers, and an inventory built from
what NVML really said on an H200 machine (tests/data/nvml-h200-probe.json)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import socket
import types
from pathlib import Path
from typing import Any

import pynvml  # type: ignore[import-untyped]
import pytest

from gpufleet.shared.contract.events import NodeInventory
from gpufleet.shared.node import nvml
from gpufleet.shared.node.gpu import GpuProcess
from gpufleet.shared.node.hostinfo import host_inventory, local_node_inventory, memory_mib, numa_nodes
from gpufleet.shared.node.nvml import (
    MIB,
    RawGpu,
    devices_from_raw,
    islands_from_links,
    merge_processes,
    mig_profile,
    pci_address,
    resolve_numa,
    short_model,
    switches_from_ancestors,
)

DATA = Path(__file__).parent / "data"
SINGLE: int = pynvml.NVML_TOPOLOGY_SINGLE
MULTIPLE: int = pynvml.NVML_TOPOLOGY_MULTIPLE
HOSTBRIDGE: int = pynvml.NVML_TOPOLOGY_HOSTBRIDGE
NODE: int = pynvml.NVML_TOPOLOGY_NODE
SYSTEM: int = pynvml.NVML_TOPOLOGY_SYSTEM


# ---------------------------------------------------------------- pure conversions


@pytest.mark.parametrize(("name", "model"), [
    ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-PCIE-40GB", "A100"),
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H100 PCIe", "H100"),
    ("NVIDIA H100 NVL", "H100"),
    ("Tesla V100-SXM2-32GB", "V100"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA GB200", "GB200"),
    ("NVIDIA RTX A6000", "RTX-A6000"),
    ("NVIDIA GeForce RTX 4090", "RTX-4090"),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "H100"),
])
def test_short_model_from_the_nvml_name(name: str, model: str) -> None:
    assert short_model(name) == model


@pytest.mark.parametrize(("name", "profile"), [
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "1g.10gb"),
    ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "3g.20gb"),
    ("NVIDIA A100-SXM4-80GB MIG 7g.80gb", "7g.80gb"),
    ("NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb", "1c.3g.40gb"),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me", "1g.10gb+me"),
    ("NVIDIA H200 MIG 2g.35gb", "2g.35gb"),
    ("NVIDIA A100-SXM4-40GB", None),  # the "40GB" of a whole GPU's name is no profile
    ("NVIDIA H100 80GB HBM3", None),
])
def test_mig_profile_from_the_mig_device_name(name: str, profile: str | None) -> None:
    assert mig_profile(name) == profile


@pytest.mark.parametrize(("bus_id", "sysfs"), [
    ("00000000:1B:00.0", "0000:1b:00.0"),
    ("00000001:C1:00.0", "0001:c1:00.0"),
    ("0000:00:06.0", "0000:00:06.0"),
])
def test_pci_address_is_the_sysfs_form(bus_id: str, sysfs: str) -> None:
    assert pci_address(bus_id) == sysfs


def _full_mesh(gpus: range) -> list[tuple[int, int | str]]:
    return [(a, b) for a in gpus for b in gpus if a != b]


def test_islands_of_an_8_gpu_node_with_two_nvlink_quads() -> None:
    assert islands_from_links(8, _full_mesh(range(0, 4)) + _full_mesh(range(4, 8))) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_islands_of_an_8_gpu_node_behind_nvswitches_are_one() -> None:
    # HGX: every GPU's 18 links go to the 4 NVSwitches, never to another GPU
    switches = [f"0000:{b:02x}:00.0" for b in (0xC1, 0xC2, 0xC3, 0xC4)]
    links: list[tuple[int, int | str]] = [(g, switches[link % 4]) for g in range(8) for link in range(18)]
    assert islands_from_links(8, links) == [0] * 8


def test_a_gpu_without_nvlink_is_an_island_of_its_own_numbered_in_gpu_order() -> None:
    assert islands_from_links(3, [(0, 1), (1, 0)]) == [0, 0, 1]
    assert islands_from_links(4, [(3, 2)]) == [0, 1, 2, 2]
    assert islands_from_links(2, []) == [0, 1]
    # GPU 0 and GPU 2 on one switch, GPU 1 on another: the switch names are what joins them
    assert islands_from_links(3, [(0, "sw-a"), (2, "sw-a"), (1, "sw-b")]) == [0, 1, 0]


def test_switches_from_common_ancestors() -> None:
    # DGX-like: pairs of GPUs under one PCIe switch, the pairs meet at host bridges / the CPU
    levels = {(a, b): SYSTEM if (a < 4) != (b < 4) else HOSTBRIDGE for a in range(8) for b in range(a + 1, 8)}
    for a in (0, 2, 4, 6):
        levels[(a, a + 1)] = SINGLE
    assert switches_from_ancestors(8, levels) == [0, 0, 1, 1, 2, 2, 3, 3]
    # two levels of switches: 0-1 and 2-3 meet at a common upper switch (MULTIPLE)
    levels[(0, 2)] = MULTIPLE
    assert switches_from_ancestors(8, levels) == [0, 0, 0, 0, 1, 1, 2, 2]
    # NODE / SYSTEM / HOSTBRIDGE join nothing; no answer at all joins nothing
    assert switches_from_ancestors(3, {(0, 1): NODE, (1, 2): HOSTBRIDGE, (0, 2): SYSTEM}) == [0, 1, 2]
    assert switches_from_ancestors(2, {}) == [0, 1]


def test_numa_from_nvml_then_sysfs_then_zero(tmp_path: Path) -> None:
    dev = tmp_path / "bus/pci/devices/0000:1b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    assert resolve_numa(3, "00000000:1B:00.0", tmp_path) == 3  # NVML knows: sysfs is not read
    assert resolve_numa(None, "00000000:1B:00.0", tmp_path) == 1  # NVML NotSupported: sysfs
    (dev / "numa_node").write_text("-1\n")  # no affinity
    assert resolve_numa(None, "00000000:1B:00.0", tmp_path) == 0
    assert resolve_numa(-1, "00000000:1B:00.0", tmp_path) == 0
    assert resolve_numa(None, "00000000:99:00.0", tmp_path) == 0  # not in sysfs


def test_processes_merge_by_pid_in_mib_rounded_up() -> None:
    entries = [(7, 3 * MIB), (5, None), (7, 1024 * MIB), (9, 1), (9, 0)]
    got = merge_processes(entries, lambda pid: f"p{pid}")
    assert got == [GpuProcess(5, 0, "p5"), GpuProcess(7, 1024, "p7"), GpuProcess(9, 1, "p9")]


def test_devices_from_raw_joins_topology_by_bus_id() -> None:
    # GPUs 0 and 1 linked directly (bus ids spelled as NVML spells them, in two forms), GPU 2 in
    # MIG mode without NVLink, all three under one PCIe switch pair-wise 0-1
    raws = [
        RawGpu(0, "GPU-a", "NVIDIA H100 80GB HBM3", 81559 * MIB, "00000000:1B:00.0", numa_node=0,
               nvlink_peers=("00000000:43:00.0",) * 4, ancestors={1: SINGLE, 2: SYSTEM}),
        RawGpu(1, "GPU-b", "NVIDIA H100 80GB HBM3", 81559 * MIB, "00000000:43:00.0", numa_node=0,
               nvlink_peers=("0000:1b:00.0",) * 4, ancestors={0: SINGLE, 2: SYSTEM}),
        RawGpu(2, "GPU-c", "NVIDIA H100 80GB HBM3", 81559 * MIB, "00000000:9A:00.0", numa_node=1, mig_enabled=True,
               mig=(("MIG-1", "NVIDIA H100 80GB HBM3 MIG 3g.40gb"), ("MIG-2", "NVIDIA H100 80GB HBM3 MIG 1g.10gb"),
                    ("MIG-3", "NVIDIA H100 80GB HBM3 MIG")),
               ancestors={0: SYSTEM, 1: SYSTEM}),
    ]
    devs = devices_from_raw(raws)
    assert [d.nvlink_island for d in devs] == [0, 0, 1]
    assert [d.pcie_switch for d in devs] == [0, 0, 1]
    assert [d.numa_node for d in devs] == [0, 0, 1]
    assert {d.model for d in devs} == {"H100"} and {d.memory_mib for d in devs} == {81559}
    assert not devs[0].mig_enabled and devs[0].mig_devices == ()
    assert devs[2].mig_enabled
    assert [(m.uuid, m.profile) for m in devs[2].mig_devices] == [
        ("MIG-1", "3g.40gb"), ("MIG-2", "1g.10gb"), ("MIG-3", nvml.UNKNOWN_MIG_PROFILE)]


# ---------------------------------------------------------------- the H200 probe


def _probe_raws(probe: dict[str, Any], sys_root: Path) -> list[RawGpu]:
    """What the probe recorded, as the backend gathers it: "ERR ..." is a query NVML refused."""
    def ok(v: Any) -> Any:
        return None if isinstance(v, str) and v.startswith("ERR") else v

    return [
        RawGpu(
            index=g["index"], uuid=g["uuid"], name=g["name"], memory_total_bytes=g["memory_total_mib"] * MIB,
            pci_bus_id=g["pci_bus_id"], numa_node=resolve_numa(ok(g["numa_node"]), g["pci_bus_id"], sys_root),
            mig_enabled=(ok(g["mig_mode"]) or [0])[0] == pynvml.NVML_DEVICE_MIG_ENABLE,
            nvlink_peers=(),  # "nvlink": NotSupported in that VM
        )
        for g in probe["gpus"]
    ]


def test_an_inventory_from_what_nvml_said_on_an_h200(tmp_path: Path) -> None:
    probe = json.loads((DATA / "nvml-h200-probe.json").read_text())
    assert probe["gpus"][0]["numa_node"].startswith("ERR") and probe["gpus"][0]["nvlink"].startswith("ERR")
    gpus = devices_from_raw(_probe_raws(probe, tmp_path))  # tmp_path: no sysfs entry for its bus id
    inv = host_inventory(gpus, labels={"rack": "r1"}, driver="process")
    assert isinstance(inv, NodeInventory)
    assert len(inv.gpus) == probe["count"] == 1
    g = inv.gpus[0]
    assert g.model == "H200"
    assert g.memory_mib == 143771
    assert g.uuid == "GPU-b92c24e2-f10f-0ceb-9335-6cf88fa62a98"
    assert (g.index, g.nvlink_island, g.pcie_switch, g.numa_node, g.mig_enabled, g.mig_devices) == (0, 0, 0, 0, False, ())
    assert inv.labels["rack"] == "r1" and inv.driver == "process"
    # the same GPU where sysfs knows its NUMA node (NVML did not): 00000000:00:06.0 -> 0000:00:06.0
    dev = tmp_path / "bus/pci/devices/0000:00:06.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    assert devices_from_raw(_probe_raws(probe, tmp_path))[0].numa_node == 1
    # and the inventory goes on the wire as a node.registered payload would carry it
    assert NodeInventory.model_validate_json(inv.model_dump_json()) == inv


# ---------------------------------------------------------------- the backend over a fake pynvml


class _Handle:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def _not_supported() -> Exception:
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # type: ignore[no-any-return]


class FakeNvml:
    """Four GPUs: 0-1 NVLinked directly and on one PCIe switch; 2-3 through an NVSwitch; 3 in
    MIG mode (2 instances); GPU 1 without a NUMA answer (sysfs says 1); GPU 3 without
    utilisation (MIG); ECC and power NotSupported on GPU 2; GPU 4 fell off the bus."""

    def __init__(self, my_pid: int) -> None:
        self.gpus = [_Handle(f"gpu{i}") for i in range(5)]
        self.migs = [_Handle("mig3.0"), _Handle("mig3.1")]
        self.bus = ["00000000:1B:00.0", "00000000:43:00.0", "00000000:9A:00.0", "00000000:C0:00.0", ""]
        self.inits = 0
        self.events: list[tuple[Any, int, int]] = []  # (device, type, data)
        self.freed = False
        self.my_pid = my_pid

    def module(self) -> types.ModuleType:
        m = types.ModuleType("pynvml")
        m.__dict__.update({k: v for k, v in vars(pynvml).items() if k.isupper() or k.startswith(("NVMLError", "nvmlEventType"))})
        for name in dir(self):
            if name.startswith("nvml"):
                setattr(m, name, getattr(self, name))
        return m

    def _i(self, h: Any) -> int:
        if h in self.gpus:
            return self.gpus.index(h)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.inits -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.159.04"

    def nvmlDeviceGetCount(self) -> int:
        return 5

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        if i == 4:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h: Any) -> str | bytes:
        if h in self.migs:
            return f"MIG-{self.migs.index(h)}"
        return f"GPU-{self._i(h)}".encode() if self._i(h) == 0 else f"GPU-{self._i(h)}"  # bytes, as old pynvml

    def nvmlDeviceGetName(self, h: Any) -> str:
        if h in self.migs:
            return ["NVIDIA H100 80GB HBM3 MIG 3g.40gb", "NVIDIA H100 80GB HBM3 MIG 1g.10gb"][self.migs.index(h)]
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        return types.SimpleNamespace(total=81559 * MIB, used=(1000 + self._i(h)) * MIB, free=0)

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        return types.SimpleNamespace(busId=self.bus[self._i(h)].encode())

    def nvmlDeviceGetNumaNodeId(self, h: Any) -> int:
        if self._i(h) == 1:
            raise _not_supported()
        return 0 if self._i(h) < 2 else 1

    def nvmlDeviceGetMigMode(self, h: Any) -> list[int]:
        if self._i(h) == 0:
            raise _not_supported()
        return [1, 1] if self._i(h) == 3 else [0, 0]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Any) -> int:
        return 7 if self._i(h) == 3 else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, k: int) -> Any:
        if self._i(h) != 3 or k >= len(self.migs):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return self.migs[k]

    def nvmlDeviceGetNvLinkState(self, h: Any, link: int) -> int:
        i = self._i(h)
        if link >= 18:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if i == 3 and link == 5:
            return 0  # a link down
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: Any, link: int) -> Any:
        i = self._i(h)
        peer = {0: self.bus[1], 1: self.bus[0]}.get(i, "00000000:E1:00.0")  # 2, 3: the NVSwitch
        return types.SimpleNamespace(busId=peer.encode())

    def nvmlDeviceGetTopologyCommonAncestor(self, a: Any, b: Any) -> int:
        pair = {self._i(a), self._i(b)}
        return SINGLE if pair == {0, 1} else SYSTEM

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        if self._i(h) == 3:
            raise _not_supported()
        return types.SimpleNamespace(gpu=10 * self._i(h), memory=0)

    def nvmlDeviceGetTemperatureV(self, h: Any, sensor: int) -> int:
        if self._i(h) == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # an old driver
        return 40

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        return 41

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        if self._i(h) == 2:
            raise _not_supported()
        return 124634

    def nvmlDeviceGetTotalEccErrors(self, h: Any, kind: int, counter: int) -> int:
        assert counter == pynvml.NVML_VOLATILE_ECC
        if self._i(h) == 2:
            raise _not_supported()
        return 2 if kind == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 5

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        if h is self.gpus[0]:
            return [types.SimpleNamespace(pid=self.my_pid, usedGpuMemory=1024 * MIB)]
        if h is self.gpus[1]:
            return [types.SimpleNamespace(pid=2**22 + 1, usedGpuMemory=None)]  # no such pid here
        if h is self.migs[1]:
            return [types.SimpleNamespace(pid=4242, usedGpuMemory=600 * MIB)]
        if h is self.gpus[2]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        return []

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: Any) -> list[Any]:
        if h is self.gpus[0]:
            return [types.SimpleNamespace(pid=self.my_pid, usedGpuMemory=512 * MIB)]
        return []

    def nvmlEventSetCreate(self) -> Any:
        return "evset"

    def nvmlDeviceGetSupportedEventTypes(self, h: Any) -> int:
        return 0 if self._i(h) == 2 else 0xFFFF  # GPU 2: none (a VM)

    def nvmlDeviceRegisterEvents(self, h: Any, types_: int, evset: Any) -> None:
        assert types_ == pynvml.nvmlEventTypeXidCriticalError and evset == "evset"
        if self._i(h) == 2:
            raise AssertionError("registered for events it does not support")

    def nvmlEventSetWait(self, evset: Any, timeout_ms: int) -> Any:
        assert timeout_ms == 0
        if not self.events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        device, kind, data = self.events.pop(0)
        return types.SimpleNamespace(device=device, eventType=kind, eventData=data)

    def nvmlEventSetFree(self, evset: Any) -> None:
        self.freed = True


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    f = FakeNvml(os.getpid())
    monkeypatch.setattr(nvml, "pynvml", f.module())
    return f


def test_backend_devices_over_nvml(fake: FakeNvml, tmp_path: Path) -> None:
    dev = tmp_path / "bus/pci/devices/0000:43:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    b = nvml.NvmlBackend(sys_root=tmp_path)
    try:
        assert b.gpu_count == 4 and b.driver_version == "580.159.04"  # GPU 4 left out, not fatal
        devs = b.devices()
        assert [d.index for d in devs] == [0, 1, 2, 3]
        assert [d.uuid for d in devs] == ["GPU-0", "GPU-1", "GPU-2", "GPU-3"]
        assert {d.model for d in devs} == {"H100"} and {d.memory_mib for d in devs} == {81559}
        assert [d.nvlink_island for d in devs] == [0, 0, 1, 1]
        assert [d.pcie_switch for d in devs] == [0, 0, 1, 2]
        assert [d.numa_node for d in devs] == [0, 1, 1, 1]  # GPU 1's from sysfs
        assert [d.mig_enabled for d in devs] == [False, False, False, True]
        assert [(m.uuid, m.profile) for m in devs[3].mig_devices] == [("MIG-0", "3g.40gb"), ("MIG-1", "1g.10gb")]
    finally:
        b.close()
    assert fake.inits == 0 and fake.freed
    b.close()  # twice: nothing more
    assert fake.inits == 0


def test_backend_samples_guard_every_query(fake: FakeNvml, tmp_path: Path) -> None:
    for pid, comm in ((os.getpid(), "trainer"), (4242, "mig-job")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "comm").write_text(f"{comm}\n")
    b = nvml.NvmlBackend(proc_root=tmp_path)
    try:
        fake.events += [(fake.gpus[1], pynvml.nvmlEventTypeXidCriticalError, 79),
                        (_Handle("another handle"), pynvml.nvmlEventTypeXidCriticalError, 48),  # by UUID: none
                        (fake.gpus[0], 0x1, 0),  # not an XID event
                        (fake.gpus[0], pynvml.nvmlEventTypeXidCriticalError, 13)]
        s = b.sample()
        assert [x.index for x in s] == [0, 1, 2, 3]
        assert [x.uuid for x in s] == ["GPU-0", "GPU-1", "GPU-2", "GPU-3"]
        assert [x.util_pct for x in s] == [0.0, 10.0, 20.0, None]  # MIG: NotSupported -> None
        assert [x.mem_used_mib for x in s] == [1000, 1001, 1002, 1003]
        assert {x.mem_total_mib for x in s} == {81559}
        assert [x.temp_c for x in s] == [40.0, 41.0, 40.0, 40.0]  # GPU 1 through the older call
        assert [x.power_w for x in s] == [124.634, 124.634, None, 124.634]
        assert [(x.ecc_uncorrected, x.ecc_corrected) for x in s] == [(2, 5), (2, 5), (0, 0), (2, 5)]
        assert [x.xids for x in s] == [(13,), (79,), (), ()]
        assert s[0].processes == (GpuProcess(os.getpid(), 1024, "trainer"),)  # compute and graphics: one
        assert s[1].processes == (GpuProcess(2**22 + 1, 0, ""),)  # memory unknown, pid not here
        assert s[2].processes == ()  # NoPermission: none seen, no crash
        assert s[3].processes == (GpuProcess(4242, 600, "mig-job"),)  # seen through its MIG instance
        assert [x.xids for x in b.sample()] == [(), (), (), ()]  # drained
        assert b.processes(0) == list(s[0].processes)
        assert b.processes(9) == []
    finally:
        b.close()


def test_open_backend_is_none_with_the_reason_when_nvml_cannot_start(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def no_driver() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    with caplog.at_level(logging.WARNING, logger="gpufleet.shared.node.nvml"):
        assert nvml.open_backend() is None
    assert "Driver Not Loaded" in caplog.text and "NVMLError_DriverNotLoaded" in caplog.text
    assert not nvml.nvml_available()
    assert "Driver Not Loaded" in (nvml.nvml_status() or "")
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        nvml.NvmlBackend()


def _libnvidia_ml_loads() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_libnvidia_ml_loads(), reason="this machine has libnvidia-ml (tests/gpu/check_real_gpu.py checks it)")
def test_open_backend_on_this_gpu_less_machine(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gpufleet.shared.node.nvml"):
        assert nvml.open_backend() is None
        inv = local_node_inventory(driver="process")
    assert "NVML Shared Library Not Found" in caplog.text
    assert nvml.nvml_status() == "NVML cannot start: NVML Shared Library Not Found (NVMLError_LibraryNotFound)"
    assert not nvml.nvml_available()
    assert inv.gpus == () and inv.driver == "process" and inv.cpu_milli > 0


# ---------------------------------------------------------------- the host


def test_host_inventory_is_what_the_os_says() -> None:
    inv = host_inventory((), labels={"rack": "r7", "hostname": "override"})
    assert inv.cpu_milli == len(os.sched_getaffinity(0)) * 1000
    assert 1000 <= inv.cpu_milli <= (os.cpu_count() or 1) * 1000
    meminfo = Path("/proc/meminfo").read_text()
    m = re.search(r"^MemTotal:\s+(\d+) kB$", meminfo, re.M)
    assert m is not None
    assert inv.memory_mib == int(m.group(1)) // 1024 > 0
    nodes = [p for p in Path("/sys/devices/system/node").glob("node*") if p.name[4:].isdigit()]
    assert inv.numa_nodes == max(1, len(nodes))
    assert inv.labels == {"rack": "r7", "hostname": "override"}  # the caller's labels win
    assert host_inventory(()).labels == {"hostname": socket.gethostname()}
    assert inv.driver == "process" and inv.gpus == ()


def test_host_numbers_from_given_roots(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal:        2097152 kB\nMemFree:   1 kB\n")
    assert memory_mib(tmp_path) == 2048
    assert memory_mib(tmp_path / "none") == 0
    node = tmp_path / "devices/system/node"
    assert numa_nodes(tmp_path) == 1  # no such folder
    for name in ("node0", "node1", "possible", "nodefoo"):
        (node / name).mkdir(parents=True)
    assert numa_nodes(tmp_path) == 2
    inv = host_inventory((), proc_root=tmp_path, sys_root=tmp_path, driver="docker")
    assert (inv.memory_mib, inv.numa_nodes, inv.driver) == (2048, 2, "docker")
