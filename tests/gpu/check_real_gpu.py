"""A check of the NVML backend on a machine with a real NVIDIA GPU (not a pytest test: pytest
collects only test_*.py). Run it from the repository root:

    .venv/bin/python tests/gpu/check_real_gpu.py

1. NvmlBackend's inventory, printed as JSON: at least one GPU, a UUID, a short model, memory.
2. A small CUDA load on one whole GPU (CUDA_VISIBLE_DEVICES=<its UUID>): torch where a Python
   with torch is found (1 GiB held, matmuls), else the CUDA driver API through ctypes (1 GiB).
3. sample() until the load's process shows with >= 512 MiB; its utilisation and memory printed
   (torch: utilisation above 0 must be seen).
4. The load killed; sample() until its process is gone and its memory is given back.

Exits non-zero when a check fails; writes the report to $OUT/gpu-check.json when OUT is set.
Finishes in under 2 minutes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpufleet.shared.contract.events import GpuDevice
from gpufleet.shared.node.gpu import FATAL_XIDS, GpuProcess, GpuSample
from gpufleet.shared.node.hostinfo import host_inventory, local_node_inventory
from gpufleet.shared.node.nvml import NvmlBackend, nvml_status, open_backend

MIN_USED_MIB = 512
APPEAR_S = 60.0  # torch's import and CUDA start can take a while on a cold machine
UTIL_S = 6.0
GONE_S = 20.0

LOAD = r'''
import sys, time
end = time.time() + 90  # never outlives the check, even if nobody kills it

def cuda_driver():
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")
    def ck(r, what):
        if r != 0:
            raise SystemExit(f"{what}: CUresult {r}")
    ck(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    ptr = ctypes.c_uint64()
    ck(cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 30)), "cuMemAlloc_v2")
    cu.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
    ck(cu.cuMemsetD8_v2(ptr.value, 1, 1 << 30), "cuMemsetD8_v2")
    ck(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    print("READY cuda", flush=True)
    while time.time() < end:
        time.sleep(0.2)

def torch_load():
    import torch
    if not torch.cuda.is_available():
        print("torch without CUDA: the driver API instead", file=sys.stderr, flush=True)
        return cuda_driver()
    held = torch.ones(256 * 1024 * 1024, device="cuda")  # 1 GiB of float32
    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    print("READY torch", flush=True)
    while time.time() < end:
        for _ in range(20):
            c = a @ b
        torch.cuda.synchronize()

torch_load() if sys.argv[1] == "torch" else cuda_driver()
'''


class Check:
    def __init__(self) -> None:
        self.report: dict[str, Any] = {"checks": {}, "samples": []}
        self.failed: list[str] = []

    def __call__(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.report["checks"][name] = {"ok": ok, "detail": detail}
        print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)
        if not ok:
            self.failed.append(name)
        return ok

    def finish(self) -> int:
        self.report["ok"] = not self.failed
        self.report["failed"] = self.failed
        out = os.environ.get("OUT")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "gpu-check.json").write_text(json.dumps(self.report, indent=1, default=str))
        print("PASSED" if not self.failed else f"FAILED: {', '.join(self.failed)}", flush=True)
        return 0 if not self.failed else 1


def python_with_torch() -> tuple[str, bool]:
    """This Python if it has torch, else a python3 on PATH that has it, else this one without."""
    if importlib.util.find_spec("torch") is not None:
        return sys.executable, True
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"
    for name in ("python3", "python"):
        exe = shutil.which(name)
        if exe and os.path.realpath(exe) != os.path.realpath(sys.executable):
            try:
                if subprocess.run([exe, "-c", probe], timeout=20, capture_output=True).returncode == 0:
                    return exe, True
            except (OSError, subprocess.TimeoutExpired):
                pass
    return sys.executable, False


def _one(backend: NvmlBackend, index: int) -> GpuSample:
    return next(s for s in backend.sample() if s.index == index)


def _show(s: GpuSample, check: Check, note: str) -> None:
    row = {"t": round(time.monotonic(), 2), "note": note, "util_pct": s.util_pct, "mem_used_mib": s.mem_used_mib,
           "temp_c": s.temp_c, "power_w": s.power_w, "xids": s.xids,
           "processes": [(p.pid, p.used_mib, p.name) for p in s.processes]}
    check.report["samples"].append(row)
    print(f"  {note}: util={s.util_pct}% mem={s.mem_used_mib}/{s.mem_total_mib} MiB temp={s.temp_c} "
          f"power={s.power_w} W procs={row['processes']}", flush=True)


def _find(s: GpuSample, pid: int, before: set[int]) -> tuple[GpuProcess | None, str]:
    """The load's process: by pid, or (NVML reporting pids of another pid namespace, as in a
    container) the one new process holding enough memory."""
    for p in s.processes:
        if p.pid == pid:
            return p, "pid"
    new = [p for p in s.processes if p.pid not in before and p.used_mib >= MIN_USED_MIB]
    return (new[0], "new process (pid namespace differs)") if len(new) == 1 else (None, "")


def run_load(backend: NvmlBackend, gpu: GpuDevice, check: Check) -> None:
    before = {p.pid for p in backend.processes(gpu.index)}
    mem_before = _one(backend, gpu.index).mem_used_mib
    exe, has_torch = python_with_torch()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu.uuid}
    child = subprocess.Popen([exe, "-c", LOAD, "torch" if has_torch else "cuda"], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    lines: list[str] = []
    errors: list[str] = []
    for stream, sink in ((child.stdout, lines), (child.stderr, errors)):
        threading.Thread(target=lambda st=stream, sk=sink: sk.extend(st or ()), daemon=True).start()
    check.report["load"] = {"python": exe, "torch": has_torch, "pid": child.pid, "gpu": gpu.uuid}
    print(f"load: pid {child.pid} ({'torch' if has_torch else 'CUDA driver API'}) on {gpu.uuid}", flush=True)
    try:
        # 3. it shows up with its memory
        seen: GpuProcess | None = None
        peak_mem = 0
        how = ""
        deadline = time.monotonic() + APPEAR_S
        while time.monotonic() < deadline and child.poll() is None:
            s = _one(backend, gpu.index)
            p, how = _find(s, child.pid, before)
            if p is not None and p.used_mib >= MIN_USED_MIB:
                seen = p
                _show(s, check, "load seen")
                break
            time.sleep(0.5)
        if not check("load process seen with >= 512 MiB", seen is not None,
                     {"process": seen, "matched_by": how} if seen else
                     {"exit_code": child.poll(), "stderr": "".join(errors)[-2000:]}):
            return
        assert seen is not None
        check.report["load"]["name"] = seen.name  # "" where NVML's pid is of another pid namespace
        mode = next((ln.split()[1] for ln in lines if ln.startswith("READY")), "")
        peak = 0.0
        end = time.monotonic() + UTIL_S
        while time.monotonic() < end:
            time.sleep(0.5)
            s = _one(backend, gpu.index)
            _show(s, check, "loaded")
            peak = max(peak, s.util_pct or 0.0)
            peak_mem = max(peak_mem, s.mem_used_mib)
            mode = mode or next((ln.split()[1] for ln in lines if ln.startswith("READY")), "")
            if mode == "torch" and peak > 0 and time.monotonic() > end - UTIL_S / 2:
                break
        check.report["load"]["mode"] = mode
        if mode == "torch":
            check("utilisation seen under matmuls", peak > 0, f"peak {peak}%")
        check("memory used grew", peak_mem >= mem_before + MIN_USED_MIB, f"{mem_before} -> {peak_mem} MiB")
    finally:
        # 4. killed: its process and memory go
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait(timeout=15)
    assert seen is not None
    gone = False
    s = _one(backend, gpu.index)
    deadline = time.monotonic() + GONE_S
    while time.monotonic() < deadline:
        s = _one(backend, gpu.index)
        if all(p.pid not in (child.pid, seen.pid) for p in s.processes):
            gone = True
            break
        time.sleep(0.5)
    _show(s, check, "after kill")
    check("load process gone after kill", gone, [(p.pid, p.used_mib) for p in s.processes])
    check("its memory given back", s.mem_used_mib < peak_mem - MIN_USED_MIB // 2, f"{peak_mem} -> {s.mem_used_mib} MiB")


def main() -> int:
    check = Check()
    started = time.monotonic()
    backend = open_backend()
    if not check("NVML opens", backend is not None, nvml_status() or "ok"):
        return check.finish()
    assert backend is not None
    try:
        devices = backend.devices()
        inv = host_inventory(devices)
        check.report["driver"] = backend.driver_version
        check.report["inventory"] = inv.model_dump(mode="json")
        print(json.dumps(check.report["inventory"], indent=1), flush=True)
        check("at least one GPU", len(devices) >= 1, f"{len(devices)} GPU(s), driver {backend.driver_version}")
        for d in devices:
            check(f"GPU {d.index} described", d.uuid.startswith("GPU-") and bool(d.model) and " " not in d.model
                  and d.memory_mib > 1024, {"uuid": d.uuid, "model": d.model, "memory_mib": d.memory_mib,
                                            "island": d.nvlink_island, "switch": d.pcie_switch, "numa": d.numa_node})
        first = backend.sample()
        check("sample() answers for every GPU", [s.index for s in first] == [d.index for d in devices]
              and all(s.mem_total_mib > 0 for s in first), [(s.index, s.util_pct, s.mem_used_mib) for s in first])
        fatal = [(s.index, x) for s in first for x in s.xids if x in FATAL_XIDS]
        check.report["xids"] = [(s.index, s.xids) for s in first]
        check.report["ecc_uncorrected"] = [(s.index, s.ecc_uncorrected) for s in first]
        if fatal:
            print(f"note: fatal XIDs pending on this machine: {fatal}", flush=True)
        gpu = next((d for d in devices if not d.mig_enabled), None)
        if check("a whole (non-MIG) GPU to load", gpu is not None):
            assert gpu is not None
            run_load(backend, gpu, check)
    finally:
        backend.close()
    # the same GPUs through the node inventory, with NVML opened (and closed) again
    again = local_node_inventory()
    check("local_node_inventory sees the same GPUs", [g.uuid for g in again.gpus] == [d.uuid for d in devices],
          [g.uuid for g in again.gpus])
    check.report["elapsed_s"] = round(time.monotonic() - started, 1)
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
