"""The docker driver through the mesh: the executor agent runs jobs as real containers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpufleet.services.executor.agent import ExecutorAgent
from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.executor.docker_driver import DockerDriver
from gpufleet.shared.contract.events import NodeInventory
from gpufleet.shared.runtime.bus import Bus

from .dockerd import DockerEngine
from .helpers import agent_running, cancel_cmd, job_status, read_log, running, submit_cmd, wait_until
from .test_executor_process import control_cores

pytestmark = pytest.mark.docker
NODE = "dock-0"


def agent(url: str, engine: DockerEngine, data: Path, instance: str = "0") -> Any:
    inv = NodeInventory(cpu_milli=2000, memory_mib=4096, driver="docker")
    return agent_running(url, f"executor-{instance}", lambda bus: ExecutorAgent(
        ExecutorCore({NODE: inv}), bus,
        DockerDriver(NODE, data, docker_url=engine.url, allowed_images=lambda tenant, image: tenant == "acme"),
        instance=instance, reconcile_s=0.1, grace_s=1.0))


def spec(engine: DockerEngine, command: list[str], tenant: str = "acme") -> dict[str, Any]:
    return {"name": "d", "tenant": tenant, "type": "batch", "image": engine.image, "command": command,
            "resources": {"cpu": 1, "memory": "256Mi"}}


async def status_is(bus: Bus, job_id: str, status: str) -> None:
    async def check() -> bool:
        return await job_status(bus, job_id) == status
    await wait_until(check, timeout_s=30)


async def test_containers_run_end_and_are_readopted(docker_engine: DockerEngine, bus: Bus, nats_url: str,
                                                    tmp_path: Path) -> None:
    ok = submit_cmd(spec(docker_engine, ["sh", "-c", "echo inside $GPUFLEET_JOB_ID"]))
    bad = submit_cmd(spec(docker_engine, ["sh", "-c", "exit 4"]))
    slow = submit_cmd(spec(docker_engine, ["sleep", "2"]))
    long = submit_cmd(spec(docker_engine, ["sleep", "60"]))
    async with running(nats_url, control_cores()):
        async with agent(nats_url, docker_engine, tmp_path):
            for c in (ok, bad, slow, long):
                await bus.publish(c)
            await status_is(bus, ok.job_id or "", "succeeded")
            await status_is(bus, bad.job_id or "", "failed")
            await status_is(bus, slow.job_id or "", "running")
        # the executor restarts while `slow` and `long` run: they are re-adopted, not started again
        async with agent(nats_url, docker_engine, tmp_path, instance="1"):
            await status_is(bus, slow.job_id or "", "succeeded")
            await bus.publish(cancel_cmd(long.job_id or ""))
            await status_is(bus, long.job_id or "", "cancelled")
    log = [env for _, env in await read_log(bus)]
    for job in (ok, bad, slow, long):
        assert len([e for e in log if e.job_id == job.job_id and e.type == "job.started"]) == 1
    started = next(e.payload for e in log if e.job_id == ok.job_id and e.type == "job.started")
    assert started.driver == "docker" and started.container_id  # type: ignore[union-attr]
    exits = {e.job_id: e.payload for e in log if e.type == "job.exited"}
    assert (exits[bad.job_id].exit_code, exits[bad.job_id].reason) == (4, "error")  # type: ignore[union-attr,index]
    assert exits[long.job_id].reason == "cancelled"  # type: ignore[union-attr,index]
    assert (tmp_path / "logs" / f"{ok.job_id}.0.1.log").read_text().strip() == f"inside {ok.job_id}"


async def test_image_refused_for_the_tenant_fails_the_job(docker_engine: DockerEngine, bus: Bus, nats_url: str,
                                                          tmp_path: Path) -> None:
    job = submit_cmd(spec(docker_engine, ["true"], tenant="globex"))
    async with running(nats_url, control_cores()), agent(nats_url, docker_engine, tmp_path):
        await bus.publish(job)
        await status_is(bus, job.job_id or "", "failed")
    ex = next(env.payload for _, env in await read_log(bus) if env.job_id == job.job_id and env.type == "job.exited")
    assert ex.exit_code == 126  # type: ignore[union-attr]
