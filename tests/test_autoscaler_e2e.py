"""The autoscaler through the mesh (real nats-server, the default cores + autoscaler, the sim
executor as the node pools' provider): an inference service under a load ramp, a node pool that
grows for an unschedulable 8-GPU job and shrinks again, and load that oscillates without flapping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import timedelta
from typing import Any

import pytest

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.autoscaler.core import AutoscalerCore
from gpufleet.services.executor.agent import ExecutorAgent
from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.guardian.core import GuardianCore
from gpufleet.services.placer.core import PlacerCore
from gpufleet.services.quota.core import QuotaCore
from gpufleet.services.telemetry.agent import TelemetryAgent
from gpufleet.services.telemetry.core import Rules, TelemetryCore
from gpufleet.shared.contract.clusterconfig import parse_config
from gpufleet.shared.contract.events import Envelope, JobScaled, ReportLoadCmd, utc
from gpufleet.shared.node.cluster import sim_fleet
from gpufleet.shared.runtime.bus import Bus

from .helpers import (
    agent_running,
    cancel_cmd,
    fold_log,
    job_status,
    new_id,
    read_log,
    running,
    submit_cmd,
    wait_until,
)

SERVICE = {
    "name": "web", "tenant": "acme", "type": "inference", "resources": {"gpu": 1, "cpu": 2, "memory": "8Gi"},
    "sim": {"duration": "1h"},
    "autoscale": {"minReplicas": 1, "maxReplicas": 4, "targetRpsPerReplica": 10,
                  "scaleUpCooldown": "1s", "scaleDownCooldown": "3s"},
}


@asynccontextmanager
async def mesh(url: str, config: dict[str, Any] | None = None, sim_nodes: int = 4, mix: str = "",
               telemetry: bool = False, sim_pools: bool = True) -> AsyncIterator[None]:
    cfg = parse_config(config or {})
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(running(url, [
            AdmissionCore(cfg), QuotaCore(cfg), PlacerCore(cfg), GuardianCore(cfg), AutoscalerCore(cfg)]))
        await stack.enter_async_context(agent_running(url, "executor", lambda bus: ExecutorAgent(
            ExecutorCore(sim_fleet(sim_nodes, mix=mix), sim_pools=sim_pools), bus, heartbeat_s=0.3)))
        if telemetry:
            await stack.enter_async_context(agent_running(url, "telemetry", lambda bus: TelemetryAgent(
                TelemetryCore(Rules(lease_s=3.0)), bus, sample_s=0.2, lease_check_s=0.2)))
        yield


async def report(bus: Bus, service_id: str, rps: float, p99_ms: float | None = None) -> None:
    payload = ReportLoadCmd(job_id=service_id, rps=rps, p99_ms=p99_ms, window_s=1.0)
    await bus.publish(Envelope(event_id=new_id(), type=payload.type, occurred_at=utc(time.time()), tenant="acme",
                               actor="loadbalancer", correlation_id=service_id, payload=payload))


async def of_type(bus: Bus, type_: str) -> list[Envelope]:
    return [e for _, e in await read_log(bus) if e.type == type_]


async def scale_events(bus: Bus, service_id: str) -> list[JobScaled]:
    return [e.payload for e in await of_type(bus, "job.scaled")
            if isinstance(e.payload, JobScaled) and e.job_id == service_id]


async def replicas_running(bus: Bus, service_id: str) -> set[str]:
    """Replica jobs started and not ended."""
    started: set[str] = set()
    for _, e in await read_log(bus):
        jid = e.job_id or ""
        if not jid.startswith(service_id + "-r"):
            continue
        if e.type == "job.started":
            started.add(jid)
        elif e.type in ("job.cancelled", "job.failed", "job.succeeded", "job.exited"):
            started.discard(jid)
    return started


@pytest.mark.slow
async def test_an_inference_service_scales_up_under_a_load_ramp_and_back_down(nats_url: str, bus: Bus) -> None:
    async with mesh(nats_url):
        svc = new_id()
        await bus.publish(submit_cmd(SERVICE, svc))
        await wait_until(lambda: replicas_running(bus, svc), timeout_s=20)  # minReplicas: one replica runs
        assert await job_status(bus, svc) == "serving"  # the service itself holds nothing
        for rps in (10, 20, 35, 35):  # the ramp: 35 req/s at 10 per replica -> 4
            await report(bus, svc, rps)
            await asyncio.sleep(1.1)

        async def four() -> bool:
            await report(bus, svc, 35)
            return len(await replicas_running(bus, svc)) == 4
        await wait_until(four, timeout_s=30, every_s=0.5)
        row = (await fold_log(bus)).jobs[svc]
        assert (row.status, row.replicas) == ("serving", 4)
        ups = await scale_events(bus, svc)
        assert ups[0].reason.code == "initial" and ups[-1].to_replicas == 4
        assert all(e.reason.code in ("initial", "load") for e in ups)
        assert "req/s" in ups[-1].reason.message

        async def one() -> bool:
            await report(bus, svc, 4)
            return len(await replicas_running(bus, svc)) == 1
        await wait_until(one, timeout_s=30, every_s=0.5)
        down = (await scale_events(bus, svc))[-1]
        assert (down.to_replicas, down.reason.code) == (1, "load") and down.removed
        for rid in down.removed:
            assert await job_status(bus, rid) == "cancelled"  # replicas end as ordinary jobs do

        await bus.publish(cancel_cmd(svc))  # the service ends: so do its replicas
        await wait_until(lambda: _status_is(bus, svc, "cancelled"), timeout_s=20)
        await wait_until(lambda: _none_running(bus, svc), timeout_s=20)


async def _status_is(bus: Bus, job_id: str, status: str) -> bool:
    return await job_status(bus, job_id) == status


async def _none_running(bus: Bus, svc: str) -> bool:
    return not await replicas_running(bus, svc)


POOL = {"nodePools": {"h100": {
    "provider": "sim", "shape": {"gpuModel": "H100", "gpus": 8, "cpu": 96, "memory": "1Ti"},
    "min": 0, "max": 2, "provisionDelay": "1s", "scaleUpAfter": "1s", "scaleDownAfter": "2s",
}}}


def gpu_job(name: str, duration: str) -> dict[str, Any]:
    return {"name": name, "tenant": "acme", "type": "batch", "resources": {"gpu": 8, "gpuModel": "H100"},
            "sim": {"duration": duration}}


@pytest.mark.slow
async def test_an_unschedulable_8_gpu_job_grows_a_pool_runs_and_the_idle_node_is_removed(
        nats_url: str, bus: Bus) -> None:
    async with mesh(nats_url, POOL, sim_nodes=1, mix="h100x8", telemetry=True):
        blocker, big = new_id(), new_id()
        await bus.publish(submit_cmd(gpu_job("blocker", "1h"), blocker))
        await wait_until(lambda: _status_is(bus, blocker, "running"), timeout_s=20)
        await bus.publish(submit_cmd(gpu_job("big", "2s"), big))

        provision = await wait_until(lambda: of_type(bus, "node.provision_requested"), timeout_s=20)
        assert len(provision) == 1
        p = provision[0].payload
        assert p.node_id == "h100-0000" and p.reason.code == "unschedulable"  # type: ignore[union-attr]
        assert big in p.for_jobs  # type: ignore[union-attr]
        assert (await of_type(bus, "job.unschedulable"))[0].job_id == big

        await wait_until(lambda: _status_is(bus, big, "succeeded"), timeout_s=30)
        placed = [e for e in await of_type(bus, "job.placed") if e.job_id == big]
        assert placed[0].payload.allocations[0].node_id == "h100-0000"  # type: ignore[union-attr]

        # nothing on it for scaleDownAfter: cordoned, drained, removed, and not lost afterwards
        gone = await wait_until(lambda: of_type(bus, "node.deregistered"), timeout_s=30)
        assert [e.node_id for e in gone] == ["h100-0000"]
        cordon = [e for e in await of_type(bus, "node.cordoned") if e.node_id == "h100-0000"]
        assert cordon and "autoscaler" in cordon[0].payload.reason  # type: ignore[union-attr]
        removal = await of_type(bus, "node.removal_requested")
        assert [e.payload.reason.code for e in removal] == ["idle"]  # type: ignore[union-attr]
        await asyncio.sleep(3.5)  # past the telemetry lease (3s)
        assert [e for e in await of_type(bus, "node.lost") if e.node_id == "h100-0000"] == []
        assert len(await of_type(bus, "node.provision_requested")) == 1  # no flapping back up
        assert await job_status(bus, blocker) == "running"  # the static node is not the pool's


@pytest.mark.slow
async def test_oscillating_load_does_not_flap(nats_url: str, bus: Bus) -> None:
    async with mesh(nats_url):
        svc = new_id()
        await bus.publish(submit_cmd(SERVICE, svc))
        await wait_until(lambda: replicas_running(bus, svc), timeout_s=20)
        t_end = time.monotonic() + 8.0
        high = True
        while time.monotonic() < t_end:  # 35 and 5 req/s in turn, every 0.25s, for 8s
            await report(bus, svc, 35 if high else 5)
            high = not high
            await asyncio.sleep(0.25)
        await asyncio.sleep(1.0)
        events = await scale_events(bus, svc)
        # initial, then up to 4 once; the stabilisation window (3s) keeps it there: a naive
        # autoscaler would have scaled about 30 times
        assert [e.to_replicas for e in events] == [1, 4]


@pytest.mark.slow
async def test_a_job_only_a_pool_shape_can_hold_is_admitted_grows_the_pool_and_runs(nats_url: str, bus: Bus) -> None:
    """Pool h100 (min 0) and no H100 node at all: the 8-GPU H100 job is neither refused by admission
    (gpu_model_unknown) nor failed by the placer (never_fits); it waits, the pool grows, it runs, and
    the node, idle again, is removed and leaves the view."""
    async with mesh(nats_url, POOL, sim_nodes=1, mix="a100x8"):
        await wait_until(lambda: of_type(bus, "node.registered"), timeout_s=20)
        big = new_id()
        await bus.publish(submit_cmd(gpu_job("big", "2s"), big))
        provision = await wait_until(lambda: of_type(bus, "node.provision_requested"), timeout_s=20)
        p = provision[0].payload
        assert p.node_id == "h100-0000" and big in p.for_jobs  # type: ignore[union-attr]
        await wait_until(lambda: _status_is(bus, big, "succeeded"), timeout_s=30)
        placed = [e for e in await of_type(bus, "job.placed") if e.job_id == big]
        assert [a.node_id for a in placed[0].payload.allocations] == ["h100-0000"]  # type: ignore[union-attr]
        assert await of_type(bus, "job.rejected") == [] and await of_type(bus, "job.failed") == []

        await wait_until(lambda: of_type(bus, "node.deregistered"), timeout_s=30)  # idle 2s: removed
        assert sorted((await fold_log(bus)).nodes) == ["sim-00000"]  # gone from the view too

        too_big = new_id()  # 16 GPUs on one node: no node and no pool shape has that many
        await bus.publish(submit_cmd({**gpu_job("too-big", "2s"), "resources": {"gpu": 16, "gpuModel": "H100"}},
                                     too_big))
        rejected = await wait_until(lambda: of_type(bus, "job.rejected"), timeout_s=20)
        assert [r.code for r in rejected[0].payload.reasons] == ["exceeds_node"]  # type: ignore[union-attr]


@pytest.mark.slow
async def test_a_node_that_never_registers_is_given_up_and_another_is_asked_for(nats_url: str, bus: Bus) -> None:
    """No sim provider plays the pool (an executor without sim pools): the node asked for never comes;
    after provisionTimeout the autoscaler gives up on it, with the reason, and asks for another."""
    pool = {"nodePools": {"h100": {**POOL["nodePools"]["h100"], "provisionTimeout": "2s"}}}
    async with mesh(nats_url, pool, sim_nodes=1, mix="a100x8", sim_pools=False):
        await wait_until(lambda: of_type(bus, "node.registered"), timeout_s=20)
        big = new_id()
        await bus.publish(submit_cmd(gpu_job("big", "2s"), big))

        async def second() -> list[Envelope]:
            return [e for e in await of_type(bus, "node.provision_requested") if e.node_id == "h100-0001"]
        await wait_until(second, timeout_s=30)
        log = [e for _, e in await read_log(bus) if e.type.startswith("node.") and e.node_id != "sim-00000"]
        assert [(e.type, e.node_id) for e in log][:3] == [
            ("node.provision_requested", "h100-0000"), ("node.removal_requested", "h100-0000"),
            ("node.provision_requested", "h100-0001")]
        gave_up = log[1].payload.reason  # type: ignore[union-attr]
        assert gave_up.code == "provision_timeout" and "never registered" in gave_up.message
        assert log[1].occurred_at - log[0].occurred_at >= timedelta(seconds=2)
        assert await job_status(bus, big) == "reserved"  # still waiting, and told why (unschedulable)
