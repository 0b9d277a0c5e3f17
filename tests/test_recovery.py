"""Recovery end to end: a real training-like script (CPU) that checkpoints with the SDK helper,
run by the `process` driver on real processes, survives the loss of its node.

The mesh: a real nats-server, admission, quota, placer, guardian (+ its checkpoint watcher),
telemetry (heartbeat leases) and two process-driver executors sharing a checkpoint root.

Run as root (as here), the driver runs every workload as an unprivileged user: the script, what
it writes and the checkpoint root are in `job_dir` (tests/helpers.py), not under pytest's 0700
tmp_path, and it runs on `workload_python()`, not on a `sys.executable` that user may not reach.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.executor.agent import ExecutorAgent
from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.executor.process_driver import ProcessDriver, group_pids
from gpufleet.services.guardian.agent import GuardianAgent
from gpufleet.services.guardian.core import GuardianCore
from gpufleet.services.placer.core import PlacerCore
from gpufleet.services.quota.core import QuotaCore
from gpufleet.shared.runtime.bus import Bus

from .helpers import agent_running, job_status, read_log, running, submit_cmd, wait_until, workload_python
from .test_telemetry import node, of_type, telemetry, wait_for_type

STEPS = 40
TRAIN = '''
import json, os, sys, time
from gpufleet.sdk import checkpoint

steps, out = int(sys.argv[1]), sys.argv[2]
start = checkpoint.resume()
x, first = (json.loads((start.path / "state.json").read_text())["x"], start.step + 1) if start else (1, 0)
with open(out + ".runs", "a") as f:
    f.write(f"{os.environ['GPUFLEET_ATTEMPT']} {os.environ['GPUFLEET_NODE_ID']} {first}\\n")
for step in range(first, steps):
    x = (x * 31 + step) % 1000003          # the "training"
    time.sleep(0.1)
    checkpoint.save(step, {"state.json": json.dumps({"x": x}).encode()})
with open(out, "w") as f:
    f.write(str(x))
'''


def expected(steps: int) -> int:
    x = 1
    for step in range(steps):
        x = (x * 31 + step) % 1000003
    return x


def proc_executor(url: str, name: str, data: Path, root: Path) -> Any:
    inv = node(name).model_copy(update={"driver": "process"})
    return agent_running(url, f"executor-{name}", lambda bus: ExecutorAgent(
        ExecutorCore({name: inv}), bus, ProcessDriver(name, data / name, checkpoint_root=root), instance=name,
        heartbeat_s=0.3, reconcile_s=0.1, grace_s=0.5, checkpoint_root=str(root)))


@asynccontextmanager
async def control_plane(url: str, root: Path) -> AsyncIterator[None]:
    async with running(url, [AdmissionCore(), QuotaCore(), PlacerCore(), GuardianCore()]) as rts:
        watcher = GuardianAgent(rts[3], str(root), watch_s=0.2)
        task = asyncio.create_task(watcher.run())
        try:
            yield
        finally:
            watcher.stop()
            await task


def training(job_dir: Path, **extra: Any) -> tuple[Any, Path]:
    script = job_dir / "train.py"
    script.write_text(TRAIN)
    out = job_dir / "result"
    return submit_cmd({"name": "train", "tenant": "acme", "type": "training", "resources": {"gpu": 1},
                       "command": [*workload_python(), str(script), str(STEPS), str(out)], **extra}), out


async def test_node_lost_mid_run_resumes_elsewhere_from_the_last_checkpoint(
        bus: Bus, nats_url: str, tmp_path: Path, job_dir: Path) -> None:
    root = job_dir / "ckpt"
    job, out = training(job_dir)
    job_id = job.job_id or ""
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(control_plane(nats_url, root))
        await stack.enter_async_context(telemetry(nats_url))
        node_a = proc_executor(nats_url, "a", tmp_path, root)
        await node_a.__aenter__()
        await bus.publish(job)
        started = (await wait_for_type(bus, "job.started", job_id))[0].payload
        await wait_for_type(bus, "job.checkpoint_saved", job_id, n=10)
        await stack.enter_async_context(proc_executor(nats_url, "b", tmp_path, root))
        # node a dies: its executor and everything it ran
        await node_a.__aexit__(None, None, None)
        os.killpg(started.pid, signal.SIGKILL)  # type: ignore[union-attr]
        await wait_until(lambda: not group_pids(started.pid), timeout_s=5)  # type: ignore[union-attr]
        # the newest checkpoint on disk gets corrupted as the node goes down: it must be skipped
        newest = sorted(root.glob(f"acme/{job_id}/step-*"))[-1]
        (newest / "state.json").write_text('{"x": 0}')

        async def done() -> bool:
            return await job_status(bus, job_id) == "succeeded"
        await wait_until(done, timeout_s=40)
    assert out.read_text() == str(expected(STEPS))  # the same result as a run never interrupted
    runs = [line.split() for line in (job_dir / "result.runs").read_text().splitlines()]
    assert [(r[0], r[1]) for r in runs] == [("1", "a"), ("2", "b")]
    resumed_from = int(runs[1][2])
    assert 0 < resumed_from < STEPS and resumed_from == int(newest.name.split("-")[1])  # the one before the bad one
    lost = (await of_type(bus, "job.exited", job_id))[0].payload
    assert (lost.node_id, lost.reason, lost.attempt) == ("a", "node_lost", 1)  # type: ignore[union-attr]
    resume = (await of_type(bus, "job.resume_requested", job_id))[0].payload
    assert resume.checkpoint_uri and resume.checkpoint_uri.startswith("file://")  # type: ignore[union-attr]
    assert 0 < resume.lost_work_s < 5  # type: ignore[union-attr]  # work since the last checkpoint, not since the start
    verified = [e.payload for e in await of_type(bus, "job.checkpoint_verified", job_id)]
    assert [v.attempt for v in verified] == [1, 2]  # type: ignore[union-attr]
    assert all(v.filesystem and " at /" in v.filesystem for v in verified)  # type: ignore[union-attr]  # named
    assert verified[1].latest_step == resumed_from - 1  # type: ignore[union-attr]
    assert [r.field for r in verified[1].skipped] == [newest.resolve().as_uri()]  # type: ignore[union-attr]
    assert "the manifest says" in verified[1].skipped[0].message  # type: ignore[union-attr]
    # `gpufleet explain` names the interruption and what resumed from where
    from gpufleet.shared.read.view import interruptions

    (it,) = interruptions([(s, e) for s, e in await read_log(bus) if e.job_id == job_id])
    assert (it.attempt, it.node_id, it.reason, it.next_node) == (1, "a", "node_lost", "b")
    assert it.checkpoint_uri == resume.checkpoint_uri and it.lost_work_s == resume.lost_work_s  # type: ignore[union-attr]
    assert it.line().startswith("interrupted: run 1 on a ended node_lost") and "run 2 placed on b" in it.line()


async def test_retries_used_up_fail_the_job_with_the_reason(
        bus: Bus, nats_url: str, tmp_path: Path, job_dir: Path) -> None:
    root = job_dir / "ckpt"
    job, _ = training(job_dir, maxRetries=0)
    async with control_plane(nats_url, root), telemetry(nats_url):
        async with proc_executor(nats_url, "a", tmp_path, root):
            await bus.publish(job)
            started = (await wait_for_type(bus, "job.started", job.job_id))[0].payload
        os.killpg(started.pid, signal.SIGKILL)  # type: ignore[union-attr]
        failed = (await wait_for_type(bus, "job.failed", job.job_id))[0].payload
    assert failed.reason.code == "retries_exhausted"  # type: ignore[union-attr]
    assert "retries are used up" in failed.reason.message  # type: ignore[union-attr]


PREEMPTIBLE = '''
import json, os, sys, time
from gpufleet.sdk import checkpoint

steps, out = int(sys.argv[1]), sys.argv[2]
checkpoint.stop_requested()  # SIGTERM now means: save, then exit
start = checkpoint.resume()
x, first = (json.loads((start.path / "state.json").read_text())["x"], start.step + 1) if start else (1, 0)
with open(out + ".runs", "a") as f:
    f.write(f"{os.environ['GPUFLEET_ATTEMPT']} {first}\\n")
for step in range(first, steps):
    x = (x * 31 + step) % 1000003
    time.sleep(0.1)
    if step % 10 == 9 or checkpoint.stop_requested():
        checkpoint.save(step, {"state.json": json.dumps({"x": x}).encode()})
    if checkpoint.stop_requested():
        sys.exit(0)
with open(out, "w") as f:
    f.write(str(x))
'''


async def test_preempted_training_checkpoints_in_its_grace_and_resumes_later(
        bus: Bus, nats_url: str, tmp_path: Path, job_dir: Path) -> None:
    from gpufleet.shared.contract.clusterconfig import parse_config

    root = job_dir / "ckpt"
    config = parse_config({"queues": {"research": {"nominal": {"gpu": 1}}}})
    script = job_dir / "train.py"
    script.write_text(PREEMPTIBLE)
    out = job_dir / "result"
    low = submit_cmd({"name": "low", "tenant": "acme", "type": "training", "queue": "research", "priority": 0,
                      "resources": {"gpu": 1}, "command": [*workload_python(), str(script), str(STEPS), str(out)]})
    high = submit_cmd({"name": "high", "tenant": "acme", "type": "batch", "queue": "research", "priority": 10,
                       "resources": {"gpu": 1}, "command": ["sleep", "1"]})
    cores = [AdmissionCore(config), QuotaCore(config), PlacerCore(config), GuardianCore()]
    async with running(nats_url, cores) as rts, proc_executor(nats_url, "a", tmp_path, root):
        watcher = GuardianAgent(rts[3], str(root), watch_s=0.2)
        task = asyncio.create_task(watcher.run())
        await bus.publish(low)
        await wait_for_type(bus, "job.checkpoint_saved", low.job_id)  # step 9 saved
        await bus.publish(high)
        request = (await wait_for_type(bus, "job.preemption_requested", low.job_id))[0]

        async def both_done() -> bool:
            return (await job_status(bus, high.job_id or "") == "succeeded"
                    and await job_status(bus, low.job_id or "") == "succeeded")
        await wait_until(both_done, timeout_s=40)
        watcher.stop()
        await task
    assert out.read_text() == str(expected(STEPS))
    runs = [line.split() for line in (job_dir / "result.runs").read_text().splitlines()]
    assert [r[0] for r in runs] == ["1", "2"]
    resumed_from = int(runs[1][1])
    assert resumed_from % 10 != 0  # from the checkpoint saved in the grace, not the last periodic one
    exit1 = (await of_type(bus, "job.exited", low.job_id))[0].payload
    assert (exit1.reason, exit1.exit_code, exit1.attempt) == ("preempted", 0, 1)  # type: ignore[union-attr]
    assert exit1.runtime_s < 10  # type: ignore[union-attr]  # it stopped in its grace, once saved
    resume = (await of_type(bus, "job.resume_requested", low.job_id))[0]
    assert resume.payload.reason.code == "preempted"  # type: ignore[union-attr]
    # it names the checkpoint saved in the grace (the executor looked as the run ended)
    assert int(resume.payload.checkpoint_uri.rsplit("step-", 1)[1]) == resumed_from - 1  # type: ignore[union-attr]
    assert exit1.checkpoint_step == resumed_from - 1  # type: ignore[union-attr]
    assert not await of_type(bus, "job.preempted", low.job_id)  # it did not end: it ran again
    placed = [e.payload for e in await of_type(bus, "job.placed", low.job_id)]
    assert [p.attempt for p in placed] == [1, 2]  # type: ignore[union-attr]
    # the second run started only after the high-priority job gave its quota back
    high_end = (await of_type(bus, "job.succeeded", high.job_id))[0].occurred_at
    second = [e for e in await of_type(bus, "job.quota_reserved", low.job_id)][-1].occurred_at
    assert second >= high_end and request.occurred_at < high_end
    from gpufleet.tools.audit import audit

    report = audit(await read_log(bus), config, pending_grace_s=0)  # and the log holds every invariant
    assert report.ok, report.violations



@pytest.fixture
def tmpfs() -> Any:
    """A tmpfs mounted where admission's path rules see nothing wrong (not under /tmp; root only)."""
    try:
        Path("/mnt").mkdir(exist_ok=True)
        ram = Path(tempfile.mkdtemp(prefix="gpufleet-ram-", dir="/mnt"))
    except OSError as exc:
        pytest.skip(f"cannot make a mount point under /mnt: {exc}")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=1777", "tmpfs", str(ram)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        ram.rmdir()
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield ram
    finally:
        subprocess.run(["umount", "-l", str(ram)], capture_output=True)
        ram.rmdir()


async def test_a_checkpoint_path_on_a_tmpfs_mounted_anywhere_fails_the_run(
        bus: Bus, nats_url: str, tmp_path: Path, job_dir: Path, tmpfs: Path) -> None:
    """Judged by the filesystem, not the path: a tmpfs keeps nothing past a reboot, so the run
    fails at its start and says why."""
    job, _ = training(job_dir, checkpoint={"path": str(tmpfs / "ckpt")})
    job_id = job.job_id or ""
    async with control_plane(nats_url, job_dir / "ckpt"), proc_executor(nats_url, "a", tmp_path, job_dir / "ckpt"):
        await bus.publish(job)
        failed = (await wait_for_type(bus, "job.failed", job_id))[0].payload
    assert failed.reason.code == "checkpoint_location_ephemeral"  # type: ignore[union-attr]
    assert f"tmpfs (mounted at {tmpfs})" in failed.reason.message  # type: ignore[union-attr]
    assert await of_type(bus, "job.checkpoint_verified", job_id) == []
