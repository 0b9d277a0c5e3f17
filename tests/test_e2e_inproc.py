"""One job through admission, quota, placer, executor and guardian over a real nats-server."""

from __future__ import annotations

from pathlib import Path

import yaml

from gpufleet.shared.runtime.bus import Bus

from .helpers import default_cores, job_status, read_log, running, submit_cmd, wait_until

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train-resnet.yaml"


async def test_training_job_runs_to_success(bus: Bus, nats_url: str) -> None:
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["sim"]["duration"] = "0.5s"
    cmd = submit_cmd(spec)
    job_id = cmd.payload.job_id  # type: ignore[union-attr]
    async with running(nats_url, default_cores(4)):
        await bus.publish(cmd)

        async def done() -> bool:
            return await job_status(bus, job_id) == "succeeded"

        await wait_until(done, timeout_s=20)
    types = [env.type for _, env in await read_log(bus) if env.job_id == job_id]
    assert types == [
        "cmd.submit", "job.submitted", "job.admitted", "job.quota_reserved", "job.placed",
        "job.started", "job.exited", "job.succeeded",
    ]
    placed = next(env for _, env in await read_log(bus) if env.type == "job.placed")
    alloc = placed.payload.allocations  # type: ignore[union-attr]
    assert len(alloc) == 1 and len(alloc[0].gpu_indices) == 8
