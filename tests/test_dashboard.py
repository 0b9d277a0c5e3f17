"""The dashboard: fed live from the event stream, over HTTP and server-sent events."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gpufleet.dashboard import serve
from gpufleet.shared.bus import Bus
from gpufleet.shared.events import NodeGpuUnhealthy, NodeRegistered
from gpufleet.shared.procs import free_port

from .test_node_cores import INV, NODE, T0, ev, placed, submitted


async def get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def until(pred: Any, timeout_s: float = 10) -> Any:
    for _ in range(int(timeout_s * 20)):
        got = await pred()
        if got:
            return got
        await asyncio.sleep(0.05)
    raise TimeoutError


async def test_state_job_page_and_live_events(bus: Bus, nats_url: str) -> None:
    for e in (ev(NodeRegistered(node_id=NODE, inventory=INV)), submitted("j1"), placed("j1", gpus=(1,))):
        await bus.publish(e)
    port = free_port()
    _, server, follow = await serve(bus, "127.0.0.1", port)
    try:
        async def gpus() -> Any:
            _, body = await get(port, "/state")
            nodes = json.loads(body)["nodes"]
            return nodes[0]["gpus"] if nodes and any(g["state"] == "allocated" for g in nodes[0]["gpus"]) else None
        cells = await until(gpus)
        assert [(c["gpu"], c["state"], c["job"]) for c in cells] == [(0, "free", None), (1, "allocated", "j1")]
        status, page = await get(port, "/")
        assert status == 200 and b"EventSource" in page
        status, body = await get(port, "/job/j1")
        doc = json.loads(body)
        assert status == 200 and [e["type"] for e in doc["timeline"]] == ["job.submitted", "job.placed"]
        assert (await get(port, "/job/nope"))[0] == 404
        # a live page: the stream sends the state, then each new event as it lands
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /events HTTP/1.1\r\n\r\n")
        await writer.drain()
        assert b"text/event-stream" in await reader.readuntil(b"\r\n\r\n")
        await bus.publish(ev(NodeGpuUnhealthy(node_id=NODE, gpu_index=0, reason="XID 79"), at=T0 + 5))
        seen = b""
        while b"node.gpu_unhealthy" not in seen:
            seen += await asyncio.wait_for(reader.readuntil(b"\n\n"), 10)
        last_state = None
        while last_state is None or last_state["nodes"][0]["gpus"][0]["state"] != "unhealthy":
            block = await asyncio.wait_for(reader.readuntil(b"\n\n"), 10)
            if block.startswith(b"event: state"):
                last_state = json.loads(block.split(b"data: ", 1)[1])
        writer.close()
    finally:
        server.close()
        follow.cancel()


def test_board_keeps_gpu_shares_and_quota_straight() -> None:
    from gpufleet.dashboard import Board
    from gpufleet.shared.events import (
        JobExited,
        JobPlaced,
        JobQuotaReserved,
        JobResumeRequested,
        Reason,
        ReplicaAllocation,
    )

    def share(job: str) -> Any:
        return ev(JobPlaced(job_id=job, allocations=(ReplicaAllocation(replica=0, node_id=NODE, gpu_indices=(0,),
                                                                         gpu_milli=500),)))
    b = Board()
    for seq, e in enumerate([ev(NodeRegistered(node_id=NODE, inventory=INV)), share("a"), share("b"),
                             ev(JobExited(job_id="a", node_id=NODE, exit_code=0)),
                             ev(JobQuotaReserved(job_id="t", queue="q", cpu_milli=1, memory_mib=1, gpus=2)),
                             ev(JobResumeRequested(job_id="t", reason=Reason(code="preempted", message="x")))], 1):
        b.fold(seq, e)
    cell = b.state()["nodes"][0]["gpus"][0]
    assert (cell["state"], cell["job"], cell["milli"]) == ("shared", "b", 500)  # a left; b still holds half
    assert b.state()["queues"][0]["gpus_used"] == 0  # the preempted job gave its quota back


def test_a_slow_page_holds_only_the_latest_state_and_its_newest_events() -> None:
    from gpufleet.dashboard import CLIENT_EVENTS, Client

    c = Client()
    for i in range(CLIENT_EVENTS + 50):
        c.events.append(f"event {i}\n".encode())
    c.state, c.state = b"state 1\n", b"state 2\n"  # a newer state replaces one not sent yet
    out = c.take().decode().splitlines()
    assert len(out) == CLIENT_EVENTS + 1 and out[0] == "event 50" and out[-1] == "state 2"
    assert c.take() == b"" and not c.wake.is_set()
