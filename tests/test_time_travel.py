"""The log at a moment: `replay --until TIME` folds what was stored by then, and `watch --since
TIME` starts from what was stored since then (the server's clock for both)."""

from __future__ import annotations

import asyncio
import time

from gpufleet.sdk import Fleet
from gpufleet.shared.contract.events import NodeRegistered
from gpufleet.shared.runtime.bus import Bus

from .test_node_cores import INV, T0, ev  # noqa: F401


async def test_fold_until_a_time_and_watch_since_a_time(bus: Bus, nats_url: str) -> None:
    early = [ev(NodeRegistered(node_id=f"n{i}", inventory=INV), at=T0 + i) for i in range(3)]
    late = [ev(NodeRegistered(node_id=f"m{i}", inventory=INV), at=T0 + 100 + i) for i in range(2)]
    for e in early:
        await bus.publish(e)
    await asyncio.sleep(1.1)
    cut = time.time()
    await asyncio.sleep(0.1)
    for e in late:
        await bus.publish(e)
    async with await Fleet.connect(nats_url=nats_url) as fleet:
        then = await fleet.fold(until_time=cut)
        assert sorted(then.nodes) == ["n0", "n1", "n2"] and then.seq == 3
        assert sorted((await fleet.fold()).nodes) == ["m0", "m1", "n0", "n1", "n2"]
        assert (await fleet.fold(until_time=cut - 3600)).nodes == {}
        seen = []

        async def tail() -> None:
            async for _seq, env in fleet.watch("fleet.evt.sys.node.>", since=cut):
                seen.append(env.node_id)
                if len(seen) == 2:
                    return
        await asyncio.wait_for(tail(), timeout=10)
    assert seen == ["m0", "m1"]


async def test_replay_gives_each_gpu_and_each_queue_at_a_sequence(bus: Bus, nats_url: str) -> None:
    """`replay --json` (Fleet.state_at): beside jobs and nodes, which job holds which GPU, and each
    queue's usage, at the head or at any earlier sequence."""
    from gpufleet.shared.contract.events import JobQuotaReserved

    from .test_node_cores import NODE, placed, submitted

    reserved = ev(JobQuotaReserved(job_id="j1", queue="default", cpu_milli=1000, memory_mib=1024, gpus=2))
    for e in (ev(NodeRegistered(node_id=NODE, inventory=INV)), submitted("j1"), reserved, placed("j1", gpus=(1,))):
        await bus.publish(e)
    async with await Fleet.connect(nats_url=nats_url) as fleet:
        head = await fleet.state_at()
        before = await fleet.state_at(until_seq=3)
    held = {c["gpu"]: (c["state"], c["job"]) for c in head["gpus"][NODE]}
    assert held == {0: ("free", None), 1: ("allocated", "j1")}
    assert [(q["queue"], q["gpus_used"], q["running_or_placed"]) for q in head["queues"]] == [("default", 2, 1)]
    assert head["seq"] == 4 and [j["status"] for j in head["jobs"]] == ["placed"]
    assert all(c["state"] == "free" for c in before["gpus"][NODE]) and before["seq"] == 3
    assert [(q["queue"], q["gpus_used"]) for q in before["queues"]] == [("default", 2)]  # reserved, not placed
