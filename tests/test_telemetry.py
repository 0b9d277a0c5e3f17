"""Telemetry facts end to end through the mesh, with the simulated NVML backend.

A real nats-server, the real cores (admission, quota, placer, guardian), the executor agent
(sim nodes, heartbeats) and the telemetry agent sampling the sim world every 0.1 s.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.executor.agent import ExecutorAgent
from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.guardian.core import GuardianCore
from gpufleet.services.placer.core import PlacerCore
from gpufleet.services.quota.core import QuotaCore
from gpufleet.services.telemetry.agent import TelemetryAgent
from gpufleet.services.telemetry.core import Rules, TelemetryCore
from gpufleet.shared.contract.events import Envelope, GpuDevice, NodeInventory
from gpufleet.shared.runtime.bus import Bus

from .helpers import agent_running, job_status, read_log, running, submit_cmd, wait_until

RULES = Rules(lease_s=1.5, idle_pct=5.0, idle_after_s=0.5, starved_after_s=0.5)


def node(name: str, gpus: int = 2) -> NodeInventory:
    return NodeInventory(cpu_milli=32000, memory_mib=262144, labels={"name": name}, gpus=tuple(
        GpuDevice(index=i, uuid=f"GPU-{name}-{i}", model="H100", memory_mib=81920) for i in range(gpus)))


def executor(url: str, nodes: dict[str, NodeInventory], instance: str) -> Any:
    return agent_running(url, f"executor-{instance}", lambda bus: ExecutorAgent(
        ExecutorCore(nodes), bus, instance=instance, heartbeat_s=0.3))


def telemetry(url: str) -> Any:
    return agent_running(url, "telemetry", lambda bus: TelemetryAgent(
        TelemetryCore(RULES), bus, sample_s=0.1, lease_check_s=0.1))


@asynccontextmanager
async def mesh(url: str, nodes: dict[str, NodeInventory]) -> AsyncIterator[tuple[ExecutorAgent, TelemetryAgent]]:
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(running(url, [AdmissionCore(), QuotaCore(), PlacerCore(), GuardianCore()]))
        ex = await stack.enter_async_context(executor(url, nodes, "0"))
        tel = await stack.enter_async_context(telemetry(url))
        yield ex, tel


def spec(gpu: int = 1, duration: str = "60s", **sim: Any) -> dict[str, Any]:
    return {"name": "t", "tenant": "acme", "type": "batch", "resources": {"gpu": gpu},
            "sim": {"duration": duration, **sim}}


async def of_type(bus: Bus, type_: str, job_id: str | None = None) -> list[Envelope]:
    return [e for _, e in await read_log(bus) if e.type == type_ and (job_id is None or e.job_id == job_id)]


async def wait_for_type(bus: Bus, type_: str, job_id: str | None = None, n: int = 1, timeout_s: float = 20) -> list[Envelope]:
    async def check() -> list[Envelope] | None:
        found = await of_type(bus, type_, job_id)
        return found if len(found) >= n else None
    result: list[Envelope] = await wait_until(check, timeout_s=timeout_s)
    return result


async def gpus_of(bus: Bus, job_id: str) -> tuple[str, tuple[int, ...]]:
    placed = (await wait_for_type(bus, "job.placed", job_id))[-1].payload
    a = placed.allocations[0]  # type: ignore[union-attr]
    return a.node_id, a.gpu_indices


async def test_zombie_memory_quarantines_the_gpu_until_it_is_gone(bus: Bus, nats_url: str) -> None:
    async with mesh(nats_url, {"n0": node("n0")}) as (_, tel):
        leaky = submit_cmd(spec(duration="0.3s", leaveZombie=True, gpuMemoryUsed="4Gi"))
        await bus.publish(leaky)
        nid, (g,) = await gpus_of(bus, leaky.job_id or "")
        z = (await wait_for_type(bus, "node.gpu_zombie_detected"))[0].payload
        assert (z.node_id, z.gpu_index, z.used_mib, z.last_job_id) == (nid, g, 4096, leaky.job_id)  # type: ignore[union-attr]
        # the quarantined GPU takes no new job: a 2-GPU job waits, a 1-GPU job goes to the other GPU
        both = submit_cmd(spec(gpu=2, duration="0.2s"))
        one = submit_cmd(spec(gpu=1, duration="0.2s"))
        await bus.publish(both)
        await bus.publish(one)
        assert (await gpus_of(bus, one.job_id or ""))[1] == (1 - g,)
        await wait_for_type(bus, "job.unschedulable", both.job_id)
        assert not await of_type(bus, "job.placed", both.job_id)
        # the orphan goes away: the occupancy check passes, the GPU is cleared, the job runs
        tel.world.backends[nid].remove_process(z.pid)  # type: ignore[union-attr]
        await wait_for_type(bus, "node.gpu_cleared")
        assert (await gpus_of(bus, both.job_id or ""))[1] == (0, 1)
        await wait_until(lambda: job_status(bus, both.job_id or ""), timeout_s=10)
    zombies = await of_type(bus, "node.gpu_zombie_detected")
    assert len(zombies) == 1  # said once, not on every sample


async def test_ecc_or_xid_makes_the_gpu_unhealthy(bus: Bus, nats_url: str) -> None:
    async with mesh(nats_url, {"n0": node("n0")}) as (_, tel):
        await wait_until(lambda: "n0" in tel.world.backends, timeout_s=10)  # type: ignore[union-attr]
        tel.world.backends["n0"].inject_xid(1, 79)  # type: ignore[union-attr]
        tel.world.backends["n0"].inject_xid(0, 13)  # an application fault: the job's, not the GPU's  # type: ignore[union-attr]
        bad = (await wait_for_type(bus, "node.gpu_unhealthy"))[0].payload
        assert (bad.gpu_index, bad.xid, bad.reason) == (1, 79, "XID 79")  # type: ignore[union-attr]
        two = submit_cmd(spec(gpu=2))
        one = submit_cmd(spec(gpu=1, duration="0.2s"))
        await bus.publish(two)
        await bus.publish(one)
        assert (await gpus_of(bus, one.job_id or ""))[1] == (0,)
        await wait_for_type(bus, "job.unschedulable", two.job_id)
        await asyncio.sleep(0.3)
        assert len(await of_type(bus, "node.gpu_unhealthy")) == 1
        tel.world.backends["n0"].inject_ecc(0, uncorrected=2)  # type: ignore[union-attr]
        ecc = (await wait_for_type(bus, "node.gpu_unhealthy", n=2))[1].payload
        assert (ecc.gpu_index, ecc.ecc_uncorrected) == (0, 2)  # type: ignore[union-attr]


async def test_idle_and_starved_jobs_are_told(bus: Bus, nats_url: str) -> None:
    async with mesh(nats_url, {"n0": node("n0")}):
        idle = submit_cmd(spec(gpuUtil=1))
        starved = submit_cmd(spec(gpuUtil=20, cpuUtil=98))
        busy = submit_cmd(spec(gpuUtil=95, cpuUtil=60))
        for c in (idle, starved, busy):
            await bus.publish(c)
        i = (await wait_for_type(bus, "job.idle_detected", idle.job_id))[0].payload
        assert i.gpu_util_pct == 1.0 and i.idle_s >= 0.5  # type: ignore[union-attr]
        s = (await wait_for_type(bus, "job.gpu_starved", starved.job_id))[0].payload
        assert (s.cause, s.cpu_util_pct, s.gpu_util_pct) == ("cpu", 98.0, 20.0)  # type: ignore[union-attr]
        assert "input pipeline" in s.message  # type: ignore[union-attr]
        await asyncio.sleep(0.5)
        assert not await of_type(bus, "job.idle_detected", busy.job_id)
        assert not await of_type(bus, "job.gpu_starved", busy.job_id)
        assert len(await of_type(bus, "job.idle_detected", idle.job_id)) == 1


async def test_lost_node_releases_and_its_job_runs_again_elsewhere(bus: Bus, nats_url: str) -> None:
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(running(nats_url, [AdmissionCore(), QuotaCore(), PlacerCore(), GuardianCore()]))
        await stack.enter_async_context(telemetry(nats_url))
        node_a = executor(nats_url, {"a": node("a")}, "a")
        await node_a.__aenter__()
        job = submit_cmd(spec(gpu=2, duration="2s"))
        await bus.publish(job)
        await wait_for_type(bus, "job.started", job.job_id)
        await stack.enter_async_context(executor(nats_url, {"b": node("b")}, "b"))
        await node_a.__aexit__(None, None, None)  # a's executor dies with the node: no more heartbeats
        lost = (await wait_for_type(bus, "node.lost"))[0].payload
        assert lost.node_id == "a" and "no heartbeat" in lost.reason  # type: ignore[union-attr]
        ex = (await wait_for_type(bus, "job.exited", job.job_id))[0].payload
        assert (ex.node_id, ex.reason, ex.attempt) == ("a", "node_lost", 1)  # type: ignore[union-attr]
        resume = (await wait_for_type(bus, "job.resume_requested", job.job_id))[0].payload
        assert resume.reason.code == "node_lost" and resume.lost_work_s > 0  # type: ignore[union-attr]
        placed = (await wait_for_type(bus, "job.placed", job.job_id, n=2))[-1].payload
        assert placed.attempt == 2 and placed.allocations[0].node_id == "b"  # type: ignore[union-attr]

        async def done() -> bool:
            return await job_status(bus, job.job_id or "") == "succeeded"
        await wait_until(done, timeout_s=20)
        # a comes back: its executor registers it again, and it takes work again
        await stack.enter_async_context(executor(nats_url, {"a": node("a")}, "a2"))
        regs = await wait_for_type(bus, "node.registered", n=3)
        assert [e.payload.node_id for e in regs].count("a") == 2  # type: ignore[union-attr]
        again = submit_cmd(spec(gpu=2, duration="0.2s"))
        other = submit_cmd(spec(gpu=2, duration="0.2s"))
        await bus.publish(again)
        await bus.publish(other)
        nodes = {(await gpus_of(bus, again.job_id or ""))[0], (await gpus_of(bus, other.job_id or ""))[0]}
        assert nodes == {"a", "b"}
    assert len(await of_type(bus, "node.lost")) == 1


async def test_retry_budget_exhausted_fails_the_job(bus: Bus, nats_url: str) -> None:
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(running(nats_url, [AdmissionCore(), QuotaCore(), PlacerCore(), GuardianCore()]))
        await stack.enter_async_context(telemetry(nats_url))
        job = submit_cmd({**spec(gpu=1, duration="60s"), "maxRetries": 0})
        async with executor(nats_url, {"a": node("a")}, "a"):
            await bus.publish(job)
            await wait_for_type(bus, "job.started", job.job_id)
        failed = (await wait_for_type(bus, "job.failed", job.job_id))[0].payload
    assert failed.reason.code == "retries_exhausted"  # type: ignore[union-attr]
    assert not await of_type(bus, "job.resume_requested", job.job_id)


async def test_a_lost_process_node_that_comes_back_kills_what_was_run_again_elsewhere(
        bus: Bus, nats_url: str, tmp_path: Any, job_dir: Any) -> None:
    """A network split that heals: the node's job ran again elsewhere, so its own copy is stopped.
    Its marker is in `job_dir`: the workload may run as another user than the test (as root, it does)."""
    from gpufleet.services.executor.process_driver import ProcessDriver, alive

    def proc_node(name: str) -> NodeInventory:
        return node(name).model_copy(update={"driver": "process"})

    def proc_executor(name: str, instance: str) -> Any:
        return agent_running(nats_url, f"executor-{instance}", lambda b: ExecutorAgent(
            ExecutorCore({name: proc_node(name)}), b, ProcessDriver(name, tmp_path / name),
            instance=instance, heartbeat_s=0.3, reconcile_s=0.1, grace_s=0.5))

    marker = job_dir / "attempts"
    job = submit_cmd({"name": "p", "tenant": "acme", "type": "batch", "resources": {"gpu": 1},
                      "command": ["sh", "-c", f'echo "$GPUFLEET_ATTEMPT $GPUFLEET_NODE_ID" >> {marker}; '
                                              'if [ "$GPUFLEET_ATTEMPT" = 1 ]; then sleep 60; else sleep 1; fi']})
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(running(nats_url, [AdmissionCore(), QuotaCore(), PlacerCore(), GuardianCore()]))
        await stack.enter_async_context(telemetry(nats_url))
        node_a = proc_executor("pa", "pa")
        await node_a.__aenter__()
        await bus.publish(job)
        first = (await wait_for_type(bus, "job.started", job.job_id))[0].payload
        await stack.enter_async_context(proc_executor("pb", "pb"))
        await node_a.__aexit__(None, None, None)  # the agent is cut off; its process runs on
        assert first.node_id == "pa" and alive(first.pid)  # type: ignore[union-attr]
        placed = (await wait_for_type(bus, "job.placed", job.job_id, n=2))[-1].payload
        assert (placed.attempt, placed.allocations[0].node_id) == (2, "pb")  # type: ignore[union-attr]
        # the split heals: pa's agent is back, finds attempt 1 still running, and stops it
        await stack.enter_async_context(proc_executor("pa", "pa2"))
        await wait_until(lambda: not alive(first.pid), timeout_s=15)  # type: ignore[union-attr]

        async def done() -> bool:
            return await job_status(bus, job.job_id or "") == "succeeded"
        await wait_until(done, timeout_s=20)
    exits = [e.payload for e in await of_type(bus, "job.exited", job.job_id)]
    assert sorted((e.attempt, e.node_id, e.reason) for e in exits) == [  # type: ignore[union-attr]
        (1, "pa", "node_lost"), (2, "pb", "completed")]
    assert marker.read_text().split("\n")[:2] == ["1 pa", "2 pb"]


async def test_a_gpu_failing_under_a_job_runs_it_again_on_healthy_gpus(bus: Bus, nats_url: str) -> None:
    async with mesh(nats_url, {"n0": node("n0")}) as (_, tel):
        job = submit_cmd(spec(gpu=1, duration="1s"))
        await bus.publish(job)
        nid, (g,) = await gpus_of(bus, job.job_id or "")
        await wait_for_type(bus, "job.started", job.job_id)
        tel.world.backends[nid].inject_xid(g, 79)  # type: ignore[union-attr]
        resume = (await wait_for_type(bus, "job.resume_requested", job.job_id))[0].payload
        assert resume.reason.code == "gpu_unhealthy" and "XID 79" in resume.reason.message  # type: ignore[union-attr]
        placed = (await wait_for_type(bus, "job.placed", job.job_id, n=2))[-1].payload
        assert placed.attempt == 2 and placed.allocations[0].gpu_indices == (1 - g,)  # type: ignore[union-attr]

        async def done() -> bool:
            return await job_status(bus, job.job_id or "") == "succeeded"
        await wait_until(done, timeout_s=15)
    first = [e.payload for e in await of_type(bus, "job.exited", job.job_id)]
    assert [(e.attempt, e.reason) for e in first] == [(1, "killed"), (2, "completed")]  # type: ignore[union-attr]


async def test_on_failure_retries_with_backoff_then_fails(bus: Bus, nats_url: str) -> None:
    async with mesh(nats_url, {"n0": node("n0")}):
        job = submit_cmd({**spec(gpu=1, duration="0.1s", exitCode=3), "restartPolicy": "OnFailure",
                          "maxRetries": 2, "retryBackoff": "0.3s"})
        await bus.publish(job)
        failed = (await wait_for_type(bus, "job.failed", job.job_id))[0]
    assert failed.payload.reason.code == "retries_exhausted"  # type: ignore[union-attr]
    assert failed.payload.exit_code == 3  # type: ignore[union-attr]
    exits = await of_type(bus, "job.exited", job.job_id)
    resumes = await of_type(bus, "job.resume_requested", job.job_id)
    assert [e.payload.attempt for e in exits] == [1, 2, 3]  # type: ignore[union-attr]
    assert [r.payload.reason.code for r in resumes] == ["crashed", "crashed"]  # type: ignore[union-attr]
    # the backoff doubles: 0.3 s, then 0.6 s, between an exit and the next run
    waits = [(r.occurred_at - e.occurred_at).total_seconds() for e, r in zip(exits, resumes, strict=False)]
    assert 0.3 <= waits[0] < 1.5 and 0.6 <= waits[1] < 2.0


async def test_idle_jobs_are_warned_then_reclaimed_by_policy(bus: Bus, nats_url: str) -> None:
    from gpufleet.shared.contract.clusterconfig import parse_config

    config = parse_config({"tenants": {"acme": {"idleAction": "reclaim", "idleReclaimAfter": "0.5s"}, "globex": {}}})
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(running(nats_url, [AdmissionCore(config), QuotaCore(config), PlacerCore(config),
                                                            GuardianCore(config)]))
        await stack.enter_async_context(executor(nats_url, {"n0": node("n0")}, "0"))
        tel = await stack.enter_async_context(telemetry(nats_url))
        idle = submit_cmd(spec(gpuUtil=1))
        waking = submit_cmd(spec(gpuUtil=1))
        warned_only = submit_cmd({**spec(gpuUtil=1), "tenant": "globex"}, tenant="globex")
        for c in (idle, waking, warned_only):
            await bus.publish(c)
        # `waking` gets busy again right after its warning: it is not reclaimed
        await wait_for_type(bus, "job.idle_detected", waking.job_id)
        assert tel.world is not None
        tel.world.backends["n0"].set_process_util(tel.world.pid_of(waking.job_id or "") or 0, 80)
        await wait_for_type(bus, "job.idle_ended", waking.job_id)
        ended = (await wait_for_type(bus, "job.preempted", idle.job_id))[0].payload
        assert ended.reason.code == "idle_reclaimed"  # type: ignore[union-attr]
        ask = (await of_type(bus, "job.preemption_requested", idle.job_id))[0].payload
        assert ask.reason.code == "idle_reclaimed" and ask.grace_s == 30  # type: ignore[union-attr]
        await wait_for_type(bus, "job.idle_detected", warned_only.job_id)
        await asyncio.sleep(1.0)
        assert not await of_type(bus, "job.preemption_requested", waking.job_id)
        assert not await of_type(bus, "job.preemption_requested", warned_only.job_id)
        assert await job_status(bus, warned_only.job_id or "") == "running"
        assert await job_status(bus, waking.job_id or "") == "running"


async def test_a_gang_loses_one_node_and_runs_again_whole(bus: Bus, nats_url: str) -> None:
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(running(nats_url, [AdmissionCore(), QuotaCore(), PlacerCore(), GuardianCore()]))
        await stack.enter_async_context(telemetry(nats_url))
        node_a = executor(nats_url, {"a": node("a")}, "a")
        await node_a.__aenter__()
        await stack.enter_async_context(executor(nats_url, {"b": node("b")}, "b"))
        gang = submit_cmd({**spec(gpu=2, duration="3s"), "replicas": 2})
        await bus.publish(gang)
        await wait_for_type(bus, "job.started", gang.job_id, n=2)
        await stack.enter_async_context(executor(nats_url, {"c": node("c")}, "c"))
        await node_a.__aexit__(None, None, None)
        placed = (await wait_for_type(bus, "job.placed", gang.job_id, n=2))[-1].payload
        assert placed.attempt == 2  # type: ignore[union-attr]
        assert sorted(a.node_id for a in placed.allocations) == ["b", "c"]  # type: ignore[union-attr]

        async def done() -> bool:
            return await job_status(bus, gang.job_id or "") == "succeeded"
        await wait_until(done, timeout_s=20)
    exits = sorted((e.payload.attempt, e.payload.node_id, e.payload.reason)  # type: ignore[union-attr]
                   for e in await of_type(bus, "job.exited", gang.job_id))
    # run 1: a lost, b's replica stopped for the resume; run 2: both complete
    assert exits == [(1, "a", "node_lost"), (1, "b", "killed"), (2, "b", "completed"), (2, "c", "completed")]
    assert len(await of_type(bus, "job.resume_requested", gang.job_id)) == 1


async def test_the_whole_fleet_silent_at_once_is_held_and_a_straggler_gets_a_lease_after(bus: Bus, nats_url: str) -> None:
    """Every node agent silent past the lease while telemetry is connected: nobody is lost (a
    fault between them and NATS is likelier). When most are heard again, the one still silent
    gets a full lease from then, and is lost only once that runs out."""
    async with AsyncExitStack() as stack:
        ab = await stack.enter_async_context(executor(nats_url, {"a": node("a"), "b": node("b")}, "0"))
        c = await stack.enter_async_context(executor(nats_url, {"c": node("c")}, "1"))
        tel = await stack.enter_async_context(telemetry(nats_url))
        await wait_until(lambda: set(tel.state.nodes) == {"a", "b", "c"}, timeout_s=10)
        ab.beating = c.beating = False
        await wait_until(lambda: tel.lease_holds >= int(2 * RULES.lease_s / 0.1), timeout_s=20)  # two leases held
        assert tel.holding and not await of_type(bus, "node.lost")
        ab.beating = True  # a and b are heard again; c is still silent
        await wait_until(lambda: not tel.holding, timeout_s=10)
        ended = asyncio.get_running_loop().time()
        lost = await wait_for_type(bus, "node.lost", timeout_s=15)
        waited = asyncio.get_running_loop().time() - ended
    assert [e.node_id for e in lost] == ["c"]
    assert waited >= RULES.lease_s * 0.8, waited  # a lease from the end of the hold, not at once
