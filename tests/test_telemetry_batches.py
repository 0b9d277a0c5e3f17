"""A round of samples from many nodes goes to FLEET_TELEMETRY as atomic batches (one fsync a
batch on a server that syncs every write), every document stored once; a stream that does not
allow batches still gets every sample, one by one."""

from __future__ import annotations

import json

from gpufleet.shared.contract.events import TELEMETRY_STREAM
from gpufleet.shared.runtime import bus as bus_mod
from gpufleet.shared.runtime.bus import Bus

from .helpers import wait_until


def _round(n: int, tag: str) -> list[tuple[str, bytes]]:
    return [(f"fleet.tel.node.n{i:04d}.gpu", json.dumps({"node_id": f"n{i:04d}", "tag": tag}).encode())
            for i in range(n)]


async def _stored(bus: Bus) -> int:
    info = await bus.js.stream_info(TELEMETRY_STREAM)
    return int(info.state.messages)


async def test_a_round_of_samples_is_stored_whole_in_batches(bus: Bus) -> None:
    n = bus_mod.ATOMIC_BATCH_MAX + 37  # two batches
    assert bus_mod.ATOMIC_FROM and n >= bus_mod.ATOMIC_FROM
    await bus.publish_telemetry_many(_round(n, "a"))
    assert await _stored(bus) == n
    assert bus._telemetry_atomic
    last = await bus.js.get_last_msg(TELEMETRY_STREAM, "fleet.tel.node.n0536.gpu")
    assert json.loads(last.data or b"{}") == {"node_id": "n0536", "tag": "a"}


async def test_a_stream_without_batches_gets_every_sample_one_by_one(bus: Bus) -> None:
    info = await bus.js.stream_info(TELEMETRY_STREAM)
    cfg = info.config
    cfg.allow_atomic = False
    await bus.js.update_stream(cfg)
    await bus.publish_telemetry_many(_round(40, "b"))
    async def all_stored() -> bool:
        return await _stored(bus) == 40

    await wait_until(all_stored, timeout_s=10)
    assert not bus._telemetry_atomic  # later rounds go one by one at once
