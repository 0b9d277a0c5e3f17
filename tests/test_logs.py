"""`gpufleet logs` (services/executor/logs.py): a run's log from the executor of its node, over a
real nats-server with the mesh's authorization, for the process and docker drivers and sim; a
tenant reads only its own jobs' logs."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gpufleet.sdk import Fleet
from gpufleet.services.executor.agent import ExecutorAgent
from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.executor.logs import BadLogRequest, LogRequest, LogText, cut, parse_request, sim_lines
from gpufleet.services.executor.process_driver import ProcessDriver
from gpufleet.shared.contract.errors import GpufleetError
from gpufleet.shared.contract.events import Envelope, JobExited, JobStarted, JobSubmitted
from gpufleet.shared.contract.ids import derive_id
from gpufleet.shared.contract.spec import parse_spec
from gpufleet.shared.runtime.bus import Bus

from .helpers import agent_running, running, submit_cmd, wait_until
from .test_executor_process import NODE, control_cores, process_node, spec, until_status

# ---------------------------------------------------------------- the pure parts


def test_cut_reads_from_an_offset_the_tail_and_at_most_the_limit(tmp_path: Path) -> None:
    body = b"".join(f"line {i}\n".encode() for i in range(1, 101))
    f = tmp_path / "x.log"
    f.write_bytes(body)
    for text in (LogText("acme", data=body), LogText("acme", path=f)):
        data, start, size = cut(text, LogRequest(job_id="j", tail=3))
        assert data == b"line 98\nline 99\nline 100\n" and start == size - len(data) and size == len(body)
        data, start, _ = cut(text, LogRequest(job_id="j", offset=7, limit=8))
        assert (data, start) == (b"line 2\nl", 7)
        data, start, _ = cut(text, LogRequest(job_id="j", offset=10_000))
        assert (data, start) == (b"", len(body))  # past the end: nothing, and where to ask again
        assert cut(text, LogRequest(job_id="j", tail=0))[0] == b""
    assert cut(LogText("acme", path=tmp_path / "none.log"), LogRequest(job_id="j")) == (b"", 0, 0)


def test_a_bad_request_names_the_field_and_the_reason() -> None:
    for raw, field in ((b'{"job_id": "j", "replica": -1}', "replica"), (b'{"job_id": "a.b"}', "job_id"),
                       (b'{"job_id": "j", "limit": 99999999}', "limit"), (b'{"job_id": "j", "what": 1}', "what"),
                       (b"{}", "job_id")):
        with pytest.raises(BadLogRequest, match=f"^{field}: "):
            parse_request(raw)
    with pytest.raises(BadLogRequest, match="not JSON"):
        parse_request(b"{")


def _env(t: datetime, payload: Any) -> Envelope:
    return Envelope(event_id=derive_id("t", payload.type, int(t.timestamp() * 1000)), type=payload.type, occurred_at=t, tenant="acme", actor="test", payload=payload)


def test_sim_lines_grow_with_the_clock_and_end_with_the_exit() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    job_spec = parse_spec({"name": "s", "tenant": "acme", "resources": {"gpu": 1}, "sim": {"duration": "100s"}})
    events = [_env(t0, JobSubmitted(job_id="j1", spec=job_spec)),
              _env(t0 + timedelta(seconds=1), JobStarted(job_id="j1", node_id="sim-0", attempt=1))]
    assert sim_lines(events, 0, 2, t0.timestamp() + 50) is None  # that run never started
    early, running_ = sim_lines(events, 0, 1, t0.timestamp() + 32)  # type: ignore[misc]
    assert running_ and "started on sim-0" in early and early.count("step") == 3
    later, _ = sim_lines(events, 0, 1, t0.timestamp() + 62)  # type: ignore[misc]
    assert later.startswith(early) and later.count("step") == 6  # the same bytes, and more
    events.append(_env(t0 + timedelta(seconds=101), JobExited(job_id="j1", node_id="sim-0", exit_code=0,
                                                              runtime_s=100)))
    done, running_ = sim_lines(events, 0, 1, t0.timestamp() + 500)  # type: ignore[misc]
    assert not running_ and done.startswith(later) and done.rstrip().endswith("exited with code 0 (completed)")


# ---------------------------------------------------------------- through a real nats-server


def executor_as_service(url: str, realm: Any, make: Callable[[Bus], ExecutorAgent]) -> Any:
    """The executor on the credentials a mesh gives it (its permissions decide what it may answer)."""
    return agent_running(url, "executor", make, creds=realm.creds_path("svc-executor"))


async def log_when(fleet: Fleet, job_id: str, node: str, ok: Callable[[dict[str, Any]], bool],
                   timeout_s: float) -> dict[str, Any]:
    """The run's log (replica 0, attempt 1, acme's) once it shows what `ok` waits for."""
    async def read() -> dict[str, Any] | None:
        doc = await fleet.logs(job_id, "acme", node)
        return doc if ok(doc) else None
    return await wait_until(read, timeout_s=timeout_s)  # type: ignore[no-any-return]


async def follow(fleet: Fleet, job_id: str, run: dict[str, Any], timeout_s: float = 30) -> tuple[str, list[dict[str, Any]]]:
    """What `gpufleet logs -f` does: read on from `next` until the run ended and nothing is left."""
    out, docs, offset = "", [], 0

    async def step() -> bool:
        nonlocal out, offset
        doc = await fleet.logs(job_id, run["tenant"], run["node_id"], run["replica"], run["attempt"], offset=offset)
        docs.append(doc)
        out += doc["data"]
        offset = doc["next"]
        return not doc["running"] and offset >= doc["size"]
    await wait_until(step, timeout_s=timeout_s, every_s=0.1)
    return out, docs


async def test_a_process_jobs_log_from_any_connection_and_only_for_its_tenant(
        bus: Bus, nats_url: str, realm: Any, tmp_path: Path) -> None:
    job = submit_cmd(spec(["sh", "-c", "echo one; echo two >&2; sleep 1.5; echo three"], gpu=0))
    acme = await Fleet.connect(nats_url=nats_url, creds=str(realm.creds_path("tenant-acme")))
    beta = await Fleet.connect(nats_url=nats_url, creds=str(realm.creds_path("tenant-beta")))
    try:
        async with running(nats_url, control_cores()), executor_as_service(nats_url, realm, lambda b: ExecutorAgent(
                ExecutorCore({NODE: process_node()}), b, ProcessDriver(NODE, tmp_path), reconcile_s=0.1,
                grace_s=1.0, heartbeat_s=1.0)):
            await bus.publish(job)
            job_id = job.job_id or ""

            runs = await wait_until(lambda: acme.runs_of(job_id), timeout_s=20)
            assert [(r["tenant"], r["node_id"], r["replica"], r["attempt"], r["driver"]) for r in runs] == \
                   [("acme", NODE, 0, 1, "process")]
            assert await beta.runs_of(job_id) == []  # another tenant does not even see that it ran

            doc = await log_when(acme, job_id, NODE, lambda d: "two" in d["data"], timeout_s=10)
            assert doc["running"] and doc["driver"] == "process" and doc["data"] == "one\ntwo\n"  # stderr too
            text, docs = await follow(acme, job_id, runs[0])
            assert text == "one\ntwo\nthree\n" and docs[0]["running"] and not docs[-1]["running"]
            await until_status(bus, job_id, "succeeded")

            # cleaned up, still readable; the tail is the last lines
            assert (await acme.logs(job_id, "acme", NODE, tail=1))["data"] == "three\n"
            # another tenant, on its own subjects: no such log (as if the job did not exist)
            with pytest.raises(GpufleetError, match="no logs of job"):
                await beta.logs(job_id, "beta", NODE)
            # on acme's subjects: its server refuses the request, no executor ever hears it
            with pytest.raises(GpufleetError, match="no executor answers"):
                await beta.logs(job_id, "acme", NODE, timeout_s=1)
            # a bad request reaches its sender, naming the field
            msg = await acme.bus.nc.request(f"fleet.logs.acme.{NODE}", json.dumps(
                {"job_id": job_id, "attempt": 0}).encode(), timeout=5)
            assert msg.headers and msg.headers["Nats-Service-Error-Code"] == "400"
            assert msg.headers["Nats-Service-Error"].startswith("attempt: ")
            # a node nobody hosts: said within the timeout
            with pytest.raises(GpufleetError, match="no executor answers for node nowhere"):
                await acme.logs(job_id, "acme", "nowhere", timeout_s=1)
    finally:
        await acme.close()
        await beta.close()


async def test_a_sim_jobs_log_is_rendered_from_its_events(bus: Bus, nats_url: str, realm: Any) -> None:
    from gpufleet.shared.node.cluster import sim_fleet

    job = submit_cmd({"name": "s", "tenant": "acme", "resources": {"gpu": 1}, "sim": {"duration": "1s"}})
    acme = await Fleet.connect(nats_url=nats_url, creds=str(realm.creds_path("tenant-acme")))
    try:
        async with running(nats_url, control_cores()), executor_as_service(
                nats_url, realm, lambda b: ExecutorAgent(ExecutorCore(sim_fleet(2, "sim")), b, heartbeat_s=1.0)):
            await bus.publish(job)
            job_id = job.job_id or ""
            await until_status(bus, job_id, "succeeded")
            runs = await acme.runs_of(job_id)
            text, docs = await follow(acme, job_id, runs[0])
    finally:
        await acme.close()
    assert docs[-1]["driver"] == "sim" and not docs[-1]["running"]
    lines = text.splitlines()
    assert f"job {job_id} replica 0 attempt 1 started on {runs[0]['node_id']}" in lines[0]
    assert lines[-1].endswith("exited with code 0 (completed)") and len(lines) == 11  # start, 9 steps, exit


@pytest.mark.docker
async def test_a_docker_jobs_log_while_it_runs_and_after_its_container_is_gone(
        docker_engine: Any, bus: Bus, nats_url: str, realm: Any, tmp_path: Path) -> None:
    from gpufleet.services.executor.docker_driver import DockerDriver
    from gpufleet.shared.contract.events import NodeInventory

    from .test_executor_docker import spec as docker_spec

    node = "dock-0"
    inv = NodeInventory(cpu_milli=2000, memory_mib=4096, driver="docker")
    job = submit_cmd(docker_spec(docker_engine, ["sh", "-c", "echo start; sleep 2; echo end"]))
    acme = await Fleet.connect(nats_url=nats_url, creds=str(realm.creds_path("tenant-acme")))
    try:
        async with running(nats_url, control_cores()), executor_as_service(nats_url, realm, lambda b: ExecutorAgent(
                ExecutorCore({node: inv}), b, DockerDriver(node, tmp_path, docker_url=docker_engine.url,
                                                           allowed_images=lambda t, i: t == "acme"),
                reconcile_s=0.1, grace_s=1.0)):
            await bus.publish(job)
            job_id = job.job_id or ""

            runs = await wait_until(lambda: acme.runs_of(job_id), timeout_s=30)

            doc = await log_when(acme, job_id, node, lambda d: bool(d["data"]), timeout_s=20)
            assert doc["running"] and doc["data"] == "start\n" and doc["driver"] == "docker"  # from the engine
            text, _ = await follow(acme, job_id, runs[0])
            assert text == "start\nend\n"
            await until_status(bus, job_id, "succeeded")
            assert (await acme.logs(job_id, "acme", node))["data"] == "start\nend\n"  # the copy saved at clean-up
    finally:
        await acme.close()
