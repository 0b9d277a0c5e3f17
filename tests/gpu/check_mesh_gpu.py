"""On a machine with a real NVIDIA GPU: the whole path, through the mesh.

    .venv/bin/python tests/gpu/check_mesh_gpu.py        (writes $OUT/mesh-gpu-check.json if OUT is set)

1. `gpufleet up --driver process`: the executor registers this machine from real NVML;
2. a 1-GPU job (a CUDA load holding 1 GiB) runs through the `process` driver, pinned by
   CUDA_VISIBLE_DEVICES to the GPU it was allocated;
3. telemetry's samples (FLEET_TELEMETRY) show the job's process on that GPU with its memory;
4. a cancel kills the process group; the exit reports the GPU clean and the samples show it free.
Exit code 0 when every check passed. Not collected by pytest (no GPU on CI machines).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_real_gpu import LOAD, MIN_USED_MIB, Check, python_with_torch  # noqa: E402

from gpufleet.shared.contract.config import read_mesh  # noqa: E402
from gpufleet.shared.contract.events import Envelope, parse_envelope  # noqa: E402
from gpufleet.shared.runtime.bus import Bus  # noqa: E402

GPUFLEET = str(Path(sys.executable).parent / "gpufleet")


def cli(*args: str) -> str:
    return subprocess.run([GPUFLEET, *args], check=True, capture_output=True, text=True, timeout=120).stdout


async def log_events(bus: Bus) -> list[Envelope]:
    out = []
    for seq in range(1, await bus.last_seq() + 1):
        try:
            out.append(parse_envelope((await bus.js.get_msg("FLEET", seq)).data or b""))
        except Exception:  # noqa: BLE001
            continue
    return out


async def until(pred: Any, timeout_s: float, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await pred()
        if got:
            return got
        await asyncio.sleep(every_s)
    return None


async def check(data: Path, c: Check) -> None:
    bus = await Bus.connect(read_mesh(str(data))["nats_url"], name="gpu-check")
    samples: list[dict[str, Any]] = []

    async def on_sample(msg: Any) -> None:
        samples.append(json.loads(msg.data))
    await bus.nc.subscribe("fleet.tel.node.*.gpu", cb=on_sample)

    async def registered() -> Any:
        return next((e for e in await log_events(bus) if e.type == "node.registered"), None)
    reg = await until(registered, 60)
    gpus = reg.payload.inventory.gpus if reg else ()
    if not c("node registered from NVML", bool(gpus), [g.model_dump() for g in gpus]):
        return
    node_id = reg.payload.node_id
    py, has_torch = python_with_torch()
    job_yaml = data / "job.yaml"
    script = data / "load.py"
    script.write_text(LOAD)
    job_yaml.write_text(json.dumps({
        "name": "gpu-check", "tenant": "acme", "type": "batch", "resources": {"gpu": 1, "cpu": 1, "memory": "4Gi"},
        "command": ["sh", "-c", f'echo "visible=$CUDA_VISIBLE_DEVICES"; exec {py} {script} '
                                f'{"torch" if has_torch else "cuda"}'],
    }))
    out = cli("submit", str(job_yaml), "--data-dir", str(data), "--json")
    job_id = json.loads(out)["job_id"]

    async def started() -> Any:
        evs = await log_events(bus)
        st = next((e for e in evs if e.job_id == job_id and e.type == "job.started"), None)
        pl = next((e for e in evs if e.job_id == job_id and e.type == "job.placed"), None)
        return (st, pl) if st and pl else None
    got = await until(started, 60)
    if not c("job started through the process driver", got is not None, job_id):
        return
    st, pl = got
    index = pl.payload.allocations[0].gpu_indices[0]
    uuid = next(g.uuid for g in gpus if g.index == index)
    pgid = st.payload.pid

    async def seen() -> Any:
        for doc in reversed(samples):
            if doc["node_id"] != node_id:
                continue
            g = next((g for g in doc["gpus"] if g["index"] == index), None)
            if g and any(p["used_mib"] >= MIN_USED_MIB for p in g["processes"]):
                return g
        return None
    g = await until(seen, 90)
    c("telemetry sees the job's process and memory on its GPU", g is not None, g)
    if g is not None:
        c("that process belongs to the job's process group",
          any(_pgid(p["pid"]) == pgid for p in g["processes"] if p["used_mib"] >= MIN_USED_MIB),
          {"pgid": pgid, "processes": g["processes"]})
    text = _job_log(data, job_id)
    c("pinned to exactly the allocated GPU", f"visible={uuid}" in text, text[:300])
    cli("cancel", job_id, "--data-dir", str(data))

    async def exited() -> Any:
        return next((e for e in await log_events(bus) if e.job_id == job_id and e.type == "job.exited"), None)
    ex = await until(exited, 60)
    c("cancel kills the process group", ex is not None and ex.payload.reason == "cancelled",
      ex.payload.model_dump() if ex else None)
    c("the GPU is reported clean after the kill", ex is not None and ex.payload.unclean_gpus == (),
      ex.payload.unclean_gpus if ex else None)
    n = len(samples)

    async def freed() -> Any:
        for doc in samples[n:]:
            gg = next((x for x in doc["gpus"] if x["index"] == index and doc["node_id"] == node_id), None)
            if gg is not None and not any(p["pid"] >= 0 and p["used_mib"] >= MIN_USED_MIB for p in gg["processes"]):
                return gg
        return None
    c("telemetry sees the GPU free again", await until(freed, 60) is not None)
    zombies = [e for e in await log_events(bus) if e.type == "node.gpu_zombie_detected"]
    c("no zombie raised for a job's own process", not zombies, [z.payload.model_dump() for z in zombies])
    # a process outside any job takes GPU memory: the zombie fact, then the clear once it is gone
    orphan = await asyncio.create_subprocess_exec(py, str(script), "torch" if has_torch else "cuda",
                                                  env={**os.environ, "CUDA_VISIBLE_DEVICES": uuid},
                                                  stdout=subprocess.DEVNULL)
    try:
        async def zombie() -> Any:
            return next((e for e in await log_events(bus) if e.type == "node.gpu_zombie_detected"), None)
        z = await until(zombie, 90)
        c("memory held outside any job raises node.gpu_zombie_detected", z is not None and z.payload.gpu_index == index,
          z.payload.model_dump() if z else None)
    finally:
        orphan.kill()
        await orphan.wait()

    async def cleared() -> Any:
        return next((e for e in await log_events(bus) if e.type == "node.gpu_cleared"), None)
    cl = await until(cleared, 90)
    c("the GPU is cleared once the orphan is gone", cl is not None, cl.payload.model_dump() if cl else None)
    await bus.close()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _job_log(data: Path, job_id: str) -> str:
    logs = list(data.glob(f"executor/*/logs/{job_id}.0.1.log"))
    return logs[0].read_text() if logs else ""


def main() -> int:
    c = Check()
    data = Path(tempfile.mkdtemp(prefix="gpufleet-gpu-"))
    os.environ["GPUFLEET_SAMPLE_S"] = "1"
    try:
        cli("up", "--detach", "--driver", "process", "--no-postgres", "--data-dir", str(data))
        asyncio.run(check(data, c))
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        c("ran to the end", False, repr(exc))
    finally:
        subprocess.run([GPUFLEET, "down", "--data-dir", str(data)], capture_output=True, timeout=120)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "mesh-gpu-check.json").write_text(json.dumps(c.report, indent=1, default=str))
    return c.finish()


if __name__ == "__main__":
    sys.exit(main())
