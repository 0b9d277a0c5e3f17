"""The log at a moment: `replay --until TIME` folds what was stored by then, and `watch --since
TIME` starts from what was stored since then (the server's clock for both)."""

from __future__ import annotations

import asyncio
import time

from gpufleet.sdk import Fleet
from gpufleet.shared.bus import Bus
from gpufleet.shared.events import NodeRegistered

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
