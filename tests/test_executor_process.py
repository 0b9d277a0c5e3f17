"""The `process` driver with real processes (CPU only), alone and through the mesh.

Through the mesh: a real nats-server, the real cores (admission, quota, placer, guardian) and
the executor agent with its reconcile loop, on one node whose driver is `process`.

Run as root (as here), the driver runs every workload as an unprivileged user, which cannot
reach pytest's tmp_path (under a 0700 dir): what a job writes by path goes to `job_dir`, and a
Python script runs as `[*workload_python(), script, ...]` (both in tests/helpers.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.executor.agent import ExecutorAgent
from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.executor.drivers import Launch
from gpufleet.services.executor.process_driver import ProcessDriver, alive, group_pids
from gpufleet.services.guardian.core import GuardianCore
from gpufleet.services.placer.core import PlacerCore
from gpufleet.services.quota.core import QuotaCore
from gpufleet.shared.contract.events import GpuDevice, JobExited, JobStarted, NodeInventory
from gpufleet.shared.node.gpu import SimGpuBackend
from gpufleet.shared.runtime.bus import Bus

from .helpers import (  # noqa: F401 - job_dir (a fixture), workload_python: tests/test_workload_isolation.py imports them from here
    agent_running,
    cancel_cmd,
    job_dir,
    job_status,
    read_log,
    running,
    submit_cmd,
    wait_until,
    workload_python,
)

NODE = "proc-0"


def launch(key: str, *command: str, **kw: Any) -> Launch:
    return Launch(job_id=key, tenant="acme", replica=0, attempt=1, node_id=NODE, command=command, **kw)


async def wait_exit(driver: ProcessDriver, key: str, timeout_s: float = 10.0) -> int | None:
    async def done() -> Any:
        ws = [w for w in await driver.list() if w.key == key and not w.running]
        return ws[0] if ws else None
    w = await wait_until(done, timeout_s=timeout_s, every_s=0.05)
    return w.exit_code  # type: ignore[no-any-return]


# ---------------------------------------------------------------- the driver alone


async def test_exit_codes_env_and_logs(tmp_path: Path) -> None:
    d = ProcessDriver(NODE, tmp_path)
    await d.start(launch("ok", "sh", "-c", 'echo "gpus=$CUDA_VISIBLE_DEVICES job=$GPUFLEET_JOB_ID"',
                         gpu_indices=(2, 4), gpu_uuids=("GPU-a", "GPU-b")))
    await d.start(launch("bad", "sh", "-c", "exit 3"))
    assert await wait_exit(d, "ok.0.1") == 0
    assert await wait_exit(d, "bad.0.1") == 3
    assert (tmp_path / "logs" / "ok.0.1.log").read_text().strip() == "gpus=GPU-a,GPU-b job=ok"
    await d.cleanup("ok.0.1")
    assert [w.key for w in await d.list()] == ["bad.0.1"]
    assert (tmp_path / "logs" / "ok.0.1.log").exists()  # logs outlive the clean-up


async def test_start_is_idempotent(tmp_path: Path) -> None:
    d = ProcessDriver(NODE, tmp_path)
    first = await d.start(launch("j", "sleep", "30"))
    again = await d.start(launch("j", "sleep", "30"))
    assert again.pid == first.pid and again.running
    await wait_until(lambda: len(group_pids(first.pid or 0)) == 2, timeout_s=5, every_s=0.02)  # sleep runs
    await d.stop("j.0.1", grace_s=1)
    assert await wait_exit(d, "j.0.1") == 128 + signal.SIGTERM


async def test_stop_kills_the_whole_group_and_escalates(tmp_path: Path) -> None:
    d = ProcessDriver(NODE, tmp_path)
    # a child in the background, and a parent that ignores SIGTERM: only SIGKILL ends them
    w = await d.start(launch("stubborn", "sh", "-c", "trap '' TERM; sleep 60 & wait; sleep 60"))
    assert w.pid is not None
    # the wrapper, the shell and its sleep: by then the shell ignores SIGTERM
    await wait_until(lambda: len(group_pids(w.pid or 0)) >= 3, timeout_s=5, every_s=0.02)
    t0 = time.monotonic()
    await d.stop(w.key, grace_s=0.5)
    code = await wait_exit(d, w.key)
    assert code == 128 + signal.SIGKILL
    assert time.monotonic() - t0 >= 0.5  # the grace period was given
    await wait_until(lambda: not group_pids(w.pid or 0), timeout_s=5, every_s=0.05)


async def test_command_required(tmp_path: Path) -> None:
    from gpufleet.services.executor.drivers import DriverError

    with pytest.raises(DriverError) as err:
        await ProcessDriver(NODE, tmp_path).start(launch("empty"))
    assert err.value.code == "command_missing"


async def test_a_new_driver_finds_what_the_old_one_started(tmp_path: Path) -> None:
    old = ProcessDriver(NODE, tmp_path)
    w = await old.start(launch("long", "sleep", "30"))
    await wait_until(lambda: len(group_pids(w.pid or 0)) == 2, timeout_s=15, every_s=0.02)
    new = ProcessDriver(NODE, tmp_path)  # an executor restart
    seen = await new.list()
    assert [(x.key, x.pid, x.running) for x in seen] == [("long.0.1", w.pid, True)]
    await new.stop("long.0.1", grace_s=1)
    assert await wait_exit(new, "long.0.1") == 128 + signal.SIGTERM
    # the wrapper writes the code, then exits: gone within moments
    await wait_until(lambda: not alive(w.pid or 0), timeout_s=5, every_s=0.02)


# ---------------------------------------------------------------- through the mesh


def process_node(gpus: int = 2) -> NodeInventory:
    return NodeInventory(cpu_milli=8000, memory_mib=16384, driver="process", gpus=tuple(
        GpuDevice(index=i, uuid=f"GPU-{NODE}-{i}", model="H100", memory_mib=81920) for i in range(gpus)))


def agent(url: str, data: Path, gpu: SimGpuBackend | None = None, instance: str = "0",
          grace_s: float = 1.0, checkpoint_root: str | None = None) -> Any:
    return agent_running(url, f"executor-{instance}", lambda bus: ExecutorAgent(
        ExecutorCore({NODE: process_node()}), bus, ProcessDriver(NODE, data, checkpoint_root=checkpoint_root),
        gpu=gpu, instance=instance, reconcile_s=0.1, grace_s=grace_s, heartbeat_s=1.0,
        checkpoint_root=checkpoint_root))


def control_cores() -> list[Any]:
    return [AdmissionCore(), QuotaCore(), PlacerCore(), GuardianCore()]


def spec(command: list[str], gpu: int = 1, **extra: Any) -> dict[str, Any]:
    return {"name": "p", "tenant": "acme", "type": "batch", "command": command, "resources": {"gpu": gpu}, **extra}


async def events_of(bus: Bus, job_id: str, type_: str) -> list[Any]:
    return [env for _, env in await read_log(bus) if env.job_id == job_id and env.type == type_]


async def until_status(bus: Bus, job_id: str, status: str, timeout_s: float = 20) -> None:
    async def check() -> bool:
        return await job_status(bus, job_id) == status
    await wait_until(check, timeout_s=timeout_s)


async def test_jobs_run_for_real(bus: Bus, nats_url: str, tmp_path: Path) -> None:
    ok = submit_cmd(spec(["sh", "-c", 'echo "on $CUDA_VISIBLE_DEVICES"'], gpu=1))
    bad = submit_cmd(spec(["sh", "-c", "exit 7"], gpu=1))
    async with running(nats_url, control_cores()), agent(nats_url, tmp_path):
        await bus.publish(ok)
        await bus.publish(bad)
        await until_status(bus, ok.job_id or "", "succeeded")
        await until_status(bus, bad.job_id or "", "failed")
    started = (await events_of(bus, ok.job_id or "", "job.started"))[0].payload
    assert isinstance(started, JobStarted) and started.driver == "process" and started.pid
    exited = (await events_of(bus, bad.job_id or "", "job.exited"))[0].payload
    assert isinstance(exited, JobExited) and (exited.exit_code, exited.reason) == (7, "error")
    placed = (await events_of(bus, ok.job_id or "", "job.placed"))[0].payload
    uuid = f"GPU-{NODE}-{placed.allocations[0].gpu_indices[0]}"
    log = (tmp_path / "logs" / f"{ok.job_id}.0.1.log").read_text()
    assert log.strip() == f"on {uuid}"  # exactly the allocated GPU
    assert not list((tmp_path / "jobs").iterdir())  # cleaned up once reported


async def test_cancel_and_timeout_kill_the_process_group(bus: Bus, nats_url: str, tmp_path: Path) -> None:
    long = submit_cmd(spec(["sh", "-c", "sleep 60 & sleep 60"], gpu=0))
    timed = submit_cmd(spec(["sleep", "60"], gpu=0, maxRuntime="1s"))
    async with running(nats_url, control_cores()), agent(nats_url, tmp_path, grace_s=0.5):
        await bus.publish(long)
        await bus.publish(timed)

        async def started() -> bool:
            return bool(await events_of(bus, long.job_id or "", "job.started"))
        await wait_until(started)
        pgid = (await events_of(bus, long.job_id or "", "job.started"))[0].payload.pid
        await wait_until(lambda: len(group_pids(pgid)) >= 2, timeout_s=5)
        await bus.publish(cancel_cmd(long.job_id or ""))
        await until_status(bus, long.job_id or "", "cancelled")
        await until_status(bus, timed.job_id or "", "failed")
    assert not group_pids(pgid)
    ex = (await events_of(bus, long.job_id or "", "job.exited"))[0].payload
    assert ex.reason == "cancelled" and ex.exit_code == 128 + signal.SIGTERM
    tex = (await events_of(bus, timed.job_id or "", "job.exited"))[0].payload
    assert tex.reason == "timeout" and tex.exit_code == 124 and tex.runtime_s >= 1.0


async def test_restarted_executor_readopts_running_jobs(bus: Bus, nats_url: str, tmp_path: Path,
                                                        job_dir: Path) -> None:  # noqa: F811
    marker = job_dir / "runs"
    job = submit_cmd(spec(["sh", "-c", f'echo run >> {marker}; sleep 2'], gpu=1))
    async with running(nats_url, control_cores()):
        async with agent(nats_url, tmp_path) as first:
            await bus.publish(job)

            async def started() -> bool:
                return bool(await events_of(bus, job.job_id or "", "job.started"))
            await wait_until(started)
            assert first.state.run(job.job_id or "", 0) is not None
            pid = (await events_of(bus, job.job_id or "", "job.started"))[0].payload.pid
        # the executor is gone; its job is not
        assert alive(pid)
        async with agent(nats_url, tmp_path, instance="1"):
            await until_status(bus, job.job_id or "", "succeeded")
    assert marker.read_text().count("run") == 1  # never started twice
    assert len(await events_of(bus, job.job_id or "", "job.started")) == 1
    assert len(await events_of(bus, job.job_id or "", "job.exited")) == 1


async def test_job_ended_while_executor_was_down_is_reported(bus: Bus, nats_url: str, tmp_path: Path) -> None:
    job = submit_cmd(spec(["sh", "-c", "sleep 1; exit 5"], gpu=1))
    async with running(nats_url, control_cores()):
        async with agent(nats_url, tmp_path):
            await bus.publish(job)

            async def started() -> bool:
                return bool(await events_of(bus, job.job_id or "", "job.started"))
            await wait_until(started)
        await asyncio.sleep(1.5)  # it ends while no executor watches
        async with agent(nats_url, tmp_path, instance="1"):
            await until_status(bus, job.job_id or "", "failed")
    ex = (await events_of(bus, job.job_id or "", "job.exited"))[0].payload
    assert (ex.exit_code, ex.reason) == (5, "error")


async def test_gpu_memory_left_behind_marks_the_gpu_unclean(bus: Bus, nats_url: str, tmp_path: Path,
                                                           job_dir: Path) -> None:  # noqa: F811
    pidfile = job_dir / "leftover.pid"
    # the job starts a process that leaves its group (setsid) and outlives it, holding GPU memory
    cmd = ["sh", "-c", f"setsid sleep 30 & echo $! > {pidfile}; sleep 1"]
    gpu = SimGpuBackend(process_node().gpus)
    job = submit_cmd(spec(cmd, gpu=1))
    async with running(nats_url, control_cores()), agent(nats_url, tmp_path, gpu=gpu):
        await bus.publish(job)
        await wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout_s=10)
        leftover = int(pidfile.read_text())
        placed = (await events_of(bus, job.job_id or "", "job.placed"))[0].payload
        index = placed.allocations[0].gpu_indices[0]
        gpu.add_process(index, leftover, used_mib=4096)
        gpu.add_process(1 - index, os.getpid(), used_mib=100)  # not the job's: does not count
        await until_status(bus, job.job_id or "", "succeeded")
    os.kill(leftover, signal.SIGKILL)
    ex = (await events_of(bus, job.job_id or "", "job.exited"))[0].payload
    assert ex.unclean_gpus == (index,)


async def test_training_jobs_get_a_persistent_checkpoint_dir(bus: Bus, nats_url: str, job_dir: Path) -> None:  # noqa: F811
    train = submit_cmd({**spec(["sh", "-c", 'echo step-1 > "$GPUFLEET_CHECKPOINT_DIR/ckpt"'], gpu=0), "type": "training"})
    batch = submit_cmd(spec(["sh", "-c", 'test -z "$GPUFLEET_CHECKPOINT_DIR"'], gpu=0))
    root = job_dir / "ckpt"
    async with running(nats_url, control_cores()), agent(nats_url, job_dir / "data", checkpoint_root=str(root)):
        await bus.publish(train)
        await bus.publish(batch)
        await until_status(bus, train.job_id or "", "succeeded")
        await until_status(bus, batch.job_id or "", "succeeded")  # a batch job gets none
    assert (root / "acme" / (train.job_id or "") / "ckpt").read_text().strip() == "step-1"


async def test_a_workload_stuck_terminating_is_force_ended_and_its_gpu_kept_out(
        bus: Bus, nats_url: str, tmp_path: Path) -> None:
    class Unkillable(ProcessDriver):
        async def stop(self, key: str, grace_s: float = 1.0) -> None:
            return None  # as if SIGKILL did not end it (a process stuck in the kernel)

    gpu = SimGpuBackend(process_node().gpus)
    job = submit_cmd(spec(["sleep", "30"], gpu=1))
    b = await Bus.connect(nats_url, name="executor")
    a = ExecutorAgent(ExecutorCore({NODE: process_node()}), b, Unkillable(NODE, tmp_path), gpu=gpu,
                      reconcile_s=0.1, grace_s=0.2, force_after_s=0.5)
    a.runtime.fetch_timeout_s = 0.05
    await a.start()
    task = asyncio.create_task(a.run())
    try:
        async with running(nats_url, control_cores()):
            await bus.publish(job)

            async def started() -> Any:
                found = await events_of(bus, job.job_id or "", "job.started")
                return found[0].payload if found else None
            st = await wait_until(started)
            index = (await events_of(bus, job.job_id or "", "job.placed"))[0].payload.allocations[0].gpu_indices[0]
            for pid in group_pids(st.pid):
                gpu.add_process(index, pid, used_mib=1024)
            await bus.publish(cancel_cmd(job.job_id or ""))
            await until_status(bus, job.job_id or "", "cancelled")
            assert alive(st.pid)  # still there: the end was reported without it
    finally:
        a.stop()
        await task
        await b.close()
        os.killpg(st.pid, signal.SIGKILL)
    ex = (await events_of(bus, job.job_id or "", "job.exited"))[0].payload
    assert (ex.reason, ex.exit_code, ex.unclean_gpus) == ("cancelled", 137, (index,))
