"""The dashboard: fed live from the event stream, over HTTP and server-sent events."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path
from typing import Any

import pytest

from gpufleet.shared.contract.events import (
    Envelope,
    JobPlaced,
    JobPreemptionRequested,
    JobSubmitted,
    NodeGpuUnhealthy,
    NodeRegistered,
    Reason,
    ReplicaAllocation,
)
from gpufleet.shared.contract.spec import parse_spec
from gpufleet.shared.embedded.procs import free_port
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.trust.authz import owner_actor
from gpufleet.tools.dashboard import ADMIN, Tokens, Viewer, serve

from .test_node_cores import INV, NODE, T0, ev, placed, submitted

TOKEN = "test-admin-token-0123456789"


async def publish(bus: Bus, *envs: Envelope) -> None:
    """Publish each event as by its type's owner (the audit of the test's log checks authors)."""
    for e in envs:
        await bus.publish(e.model_copy(update={"actor": owner_actor(e.type)}))


async def fetch(port: int, path: str, token: str | None = TOKEN, *headers: str) -> tuple[int, str, bytes]:
    """GET `path` (with `Authorization: Bearer token` unless token is None): status, head, body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lines = [f"GET {path} HTTP/1.1", "Host: x", *headers] + ([f"Authorization: Bearer {token}"] if token else [])
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode("latin-1"), body


async def get(port: int, path: str, token: str | None = TOKEN) -> tuple[int, bytes]:
    status, _, body = await fetch(port, path, token)
    return status, body


async def feed(port: int, token: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The live feed, open (its response head read)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET /events HTTP/1.1\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
    await writer.drain()
    assert b"text/event-stream" in await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    return reader, writer


async def until(pred: Any, timeout_s: float = 10) -> Any:
    for _ in range(int(timeout_s * 20)):
        got = await pred()
        if got:
            return got
        await asyncio.sleep(0.05)
    raise TimeoutError


async def test_state_job_page_and_live_events(bus: Bus, nats_url: str) -> None:
    await publish(bus, ev(NodeRegistered(node_id=NODE, inventory=INV)), submitted("j1"), placed("j1", gpus=(1,)))
    port = free_port()
    _, server, follow = await serve(bus, "127.0.0.1", port, tokens=Tokens(admin=TOKEN))
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
        reader, writer = await feed(port, TOKEN)
        await publish(bus, ev(NodeGpuUnhealthy(node_id=NODE, gpu_index=0, reason="XID 79"), at=T0 + 5))
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
    from gpufleet.shared.contract.events import (
        JobExited,
        JobPlaced,
        JobQuotaReserved,
        JobResumeRequested,
        Reason,
        ReplicaAllocation,
    )
    from gpufleet.tools.dashboard import Board

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
    from gpufleet.tools.dashboard import CLIENT_EVENTS, Client

    c = Client(ADMIN)
    for i in range(CLIENT_EVENTS + 50):
        c.events.append(f"event {i}\n".encode())
    c.state, c.state = b"state 1\n", b"state 2\n"  # a newer state replaces one not sent yet
    out = c.take().decode().splitlines()
    assert len(out) == CLIENT_EVENTS + 1 and out[0] == "event 50" and out[-1] == "state 2"
    assert c.take() == b"" and not c.wake.is_set()


# ------------------------------------------------------------------ tokens


def job_of(tenant: str, job: str, gpu: int | None, at: float) -> list[Envelope]:
    """A job of `tenant` submitted and placed on one GPU of NODE (None: waiting); ids apart by `at`."""
    spec = parse_spec({"name": f"{job}-name", "tenant": tenant, "command": ["sleep", "9"]})
    if gpu is None:
        return [ev(JobSubmitted(job_id=job, spec=spec), at=at, tenant=tenant)]
    return [ev(JobSubmitted(job_id=job, spec=spec), at=at, tenant=tenant),
            ev(JobPlaced(job_id=job, allocations=(ReplicaAllocation(replica=0, node_id=NODE, gpu_indices=(gpu,),
                                                                      cpu_milli=1000),)), at=at + 0.5, tenant=tenant)]


async def test_every_request_needs_a_token(bus: Bus, nats_url: str) -> None:
    await publish(bus, ev(NodeRegistered(node_id=NODE, inventory=INV)), submitted("j1"), placed("j1"))
    port = free_port()
    _, server, follow = await serve(bus, "127.0.0.1", port, tokens=Tokens(admin=TOKEN))
    try:
        await until(lambda: _has_job(port, TOKEN, "j1"))
        for path in ("/", "/state", "/events", "/job/j1", "/nope", "/?x=1"):
            status, head, body = await fetch(port, path, None)  # no token
            assert status == 401 and "WWW-Authenticate: Bearer" in head, path
            assert b"needs a token" in body and b"Authorization: Bearer TOKEN" in body and b"?token=" in body
            assert b"j1" not in body and NODE.encode() not in body  # nothing of the cluster
            for wrong in ((path, "not-the-token"), (path + ("&" if "?" in path else "?") + "token=nope", None)):
                status, _, body = await fetch(port, wrong[0], wrong[1])
                assert status == 401 and b"not valid" in body and b"j1" not in body, wrong
            status, _, body = await fetch(port, path, None, f"Cookie: gpufleet_dashboard_{port}=nope")
            assert status == 401, path
        status, _, body = await fetch(port, "/state", None, f"Authorization: Basic {TOKEN}")
        assert status == 401  # only a bearer token
        assert (await get(port, "/state"))[0] == 200 and (await get(port, "/nope"))[0] == 404
    finally:
        server.close()
        follow.cancel()


async def _has_job(port: int, token: str, job: str) -> bool:
    status, body = await get(port, "/state", token)
    return status == 200 and any(j["job_id"] == job for j in json.loads(body)["recent"])


async def test_the_token_in_the_url_sets_a_strict_http_only_cookie(bus: Bus, nats_url: str) -> None:
    port = free_port()
    _, server, follow = await serve(bus, "127.0.0.1", port, tokens=Tokens(admin=TOKEN))
    try:
        status, head, page = await fetch(port, f"/?token={TOKEN}", None)
        assert status == 200 and b"EventSource" in page
        cookie = next(h for h in head.split("\r\n") if h.lower().startswith("set-cookie:"))
        assert f"gpufleet_dashboard_{port}={TOKEN}" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        # the page's own requests carry the cookie: the state, a job page, the live feed
        cookie_header = f"Cookie: other=1; gpufleet_dashboard_{port}={TOKEN}"
        assert (await fetch(port, "/state", None, cookie_header))[0] == 200
        assert (await fetch(port, "/job/nope", None, cookie_header))[0] == 404
        status, head, _ = await fetch(port, "/state", TOKEN)
        assert status == 200 and "set-cookie" not in head.lower()  # only a token in the URL sets it
    finally:
        server.close()
        follow.cancel()


async def test_admin_sees_every_tenant_and_a_tenant_only_its_own(bus: Bus, nats_url: str, tmp_path: Path) -> None:
    from gpufleet.tools.dashboard import ensure_admin_token, tenant_token, tokens_path

    admin = ensure_admin_token(tmp_path)
    acme, globex = tenant_token(tmp_path, "acme"), tenant_token(tmp_path, "globex")
    assert len({admin, acme, globex}) == 3 and ensure_admin_token(tmp_path) == admin
    assert tenant_token(tmp_path, "acme") == acme  # made once, then the same
    assert stat.S_IMODE(tokens_path(tmp_path).stat().st_mode) == 0o600
    assert json.loads(tokens_path(tmp_path).read_text())[acme] == {"role": "tenant", "tenant": "acme"}
    await publish(bus, ev(NodeRegistered(node_id=NODE, inventory=INV)), *job_of("acme", "a1", 0, T0 + 1),
                  *job_of("globex", "g1", 1, T0 + 2))
    port = free_port()
    _, server, follow = await serve(bus, "127.0.0.1", port, tokens=Tokens.of(tmp_path))
    try:
        await until(lambda: _has_job(port, admin, "g1"))
        _, body = await get(port, "/state", admin)
        everything = json.loads(body)
        assert {(j["job_id"], j["tenant"]) for j in everything["recent"]} == {("a1", "acme"), ("g1", "globex")}
        assert [c["job"] for c in everything["nodes"][0]["gpus"]] == ["a1", "g1"]
        assert (await get(port, "/job/g1", admin))[0] == 200 and (await get(port, "/job/a1", admin))[0] == 200

        status, body = await get(port, "/state", acme)
        mine = json.loads(body)
        assert status == 200 and mine["tenant"] == "acme"
        assert [(j["job_id"], j["tenant"]) for j in mine["recent"]] == [("a1", "acme")]
        assert mine["jobs"] == {"placed": 1}
        # the map shows the GPU held, but not by whom
        assert [(c["state"], c["job"]) for c in mine["nodes"][0]["gpus"]] == [("allocated", "a1"), ("allocated", "other")]
        assert mine["nodes"][0]["jobs"] == ["a1", "other"]
        assert b"g1" not in body and b"globex" not in body
        assert (await get(port, "/job/a1", acme))[0] == 200
        status, body = await get(port, "/job/g1", acme)
        assert status == 404 and b"g1-name" not in body and b"globex" not in body  # as for a job that is not there
        status, body = await get(port, "/state", globex)
        assert [j["job_id"] for j in json.loads(body)["recent"]] == ["g1"] and b"a1" not in body

        # the live feed: acme's page gets its own jobs' events and node events, never globex's
        reader, writer = await feed(port, acme)
        await publish(bus, ev(NodeGpuUnhealthy(node_id=NODE, gpu_index=1, reason="XID 79"), at=T0 + 5),
                      *job_of("globex", "g2", None, T0 + 6), *job_of("acme", "a2", None, T0 + 7))
        seen = b""
        while b'"a2"' not in seen or b"node.gpu_unhealthy" not in seen:
            seen += await asyncio.wait_for(reader.readuntil(b"\n\n"), 10)
        writer.close()
        events = [json.loads(b.split(b"data: ", 1)[1]) for b in seen.split(b"\n\n") if b.startswith(b"event: event")]
        assert {e["job_id"] for e in events} == {"a1", "a2", None}
        assert b"g1" not in seen and b"g2" not in seen and b"globex" not in seen
    finally:
        server.close()
        follow.cancel()


def test_a_tenant_page_names_no_other_tenants_job() -> None:
    """Another tenant's job id is OTHER wherever it would show: a GPU, a node, a message of the
    tenant's own job ("preempted for job g1"), a field of its event."""
    from gpufleet.tools.dashboard import Board

    b = Board()
    envs = [ev(NodeRegistered(node_id=NODE, inventory=INV)), *job_of("acme", "a1", 0, T0 + 1),
            *job_of("globex", "g1", 1, T0 + 2),
            ev(JobPreemptionRequested(job_id="a1", by_job_id="g1", reason=Reason(
                code="priority", message="preempted for job g1 (priority 5 > 0) in queue default")),
               at=T0 + 3, tenant="acme")]
    for seq, e in enumerate(envs, 1):
        b.fold(seq, e)
    page = b.job("a1", "acme")
    assert page is not None and "g1" not in json.dumps(page)
    assert any("by other" in line for line in page["pending"])
    last = page["timeline"][-1]
    assert last["payload"]["by_job_id"] == "other" and "for job other" in last["payload"]["reason"]["message"]
    assert b.job("g1", "acme") is None and b.job("nope", "acme") is None and b.job("g1") is not None
    assert b.event_for(b.feed[-1], "globex") is None  # acme's job's event
    assert b.event_for(b.feed[-1], None) == b.feed[-1]  # the admin's page: as it is
    assert b.event_for(b.feed[0], "globex") == b.feed[0]  # a node event
    assert "g1" not in json.dumps(b.state("acme")) and "a1" not in json.dumps(b.state("globex"))


def test_tokens_file_and_command_line_token(tmp_path: Path) -> None:
    from gpufleet.tools.dashboard import ensure_admin_token, tenant_token, tokens_path

    admin, acme = ensure_admin_token(tmp_path), tenant_token(tmp_path, "acme")
    tokens = Tokens.of(tmp_path)
    assert tokens.viewer(admin) == ADMIN and tokens.viewer(acme) == Viewer("acme")
    assert tokens.viewer(None) is None and tokens.viewer("") is None and tokens.viewer(admin[:-1]) is None
    later = tenant_token(tmp_path, "globex")  # made while it runs: taken at once
    assert tokens.viewer(later) == Viewer("globex")
    # --token replaces the file's admin token; the tenants' still work
    given = Tokens.of(tmp_path, admin=TOKEN)
    assert given.viewer(TOKEN) == ADMIN and given.viewer(admin) is None and given.viewer(acme) == Viewer("acme")
    tokens_path(tmp_path).chmod(0o644)
    assert ensure_admin_token(tmp_path) == admin
    assert stat.S_IMODE(tokens_path(tmp_path).stat().st_mode) == 0o600  # made private again
    for bad in ("sys", "a.b", ""):
        with pytest.raises(ValueError):
            tenant_token(tmp_path, bad)


def test_command_prints_a_tenant_url_and_warns_off_loopback(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gpufleet.cli import app
    from gpufleet.tools.dashboard import exposure_warning, page_url, tenant_token

    out = CliRunner().invoke(app, ["dashboard", "--data-dir", str(tmp_path), "--tenant", "acme", "--port", "9000"])
    assert out.exit_code == 0, out.output
    assert f"http://127.0.0.1:9000/?token={tenant_token(tmp_path, 'acme')}" in out.output
    bad = CliRunner().invoke(app, ["dashboard", "--data-dir", str(tmp_path), "--token", "short"])
    assert bad.exit_code == 2 and "16 or more" in bad.output
    for host in ("127.0.0.1", "::1", "localhost"):
        assert exposure_warning(host, 8080) is None
    warning = exposure_warning("0.0.0.0", 8080)
    assert warning is not None and "0.0.0.0:8080" in warning and "reachable from other machines" in warning
    assert page_url("0.0.0.0", 8080, "t") == "http://127.0.0.1:8080/?token=t"
    assert page_url("::1", 8080, "t") == "http://[::1]:8080/?token=t"


def test_the_charts_fold_a_point_per_step_of_log_time() -> None:
    """The page's charts (gpufleet/tools/charts.py), folded from the log by the board: GPUs
    allocated per model, the wait from submitted to placed per queue, waiting jobs, each tenant's
    cost at the prices, the utilisation and idle cost from the nodes' samples, preemptions and
    failures; a tenant's page sees its own cost and queues only, and no cluster-wide counts."""
    from decimal import Decimal

    from gpufleet.shared.contract.clusterconfig import PriceTable
    from gpufleet.shared.contract.events import JobFailed, JobPreempted
    from gpufleet.tools.dashboard import Board

    b = Board()
    b.charts.enabled, b.charts.step_s = True, 10.0
    b.charts.prices = PriceTable(gpu_hour={"H100": Decimal("3.60")})
    b.fold(1, ev(NodeRegistered(node_id=NODE, inventory=INV), at=T0))  # 2 H100s
    b.fold(2, submitted("a"))  # at T0
    b.fold(3, ev(JobSubmitted(job_id="w", spec=submitted("w").payload.spec), at=T0 + 1))  # type: ignore[union-attr]
    b.fold(4, placed("a", (0, 1)).model_copy(update={"occurred_at": submitted("a").occurred_at.replace(
        second=submitted("a").occurred_at.second + 4)}))
    assert list(b.charts.points) == []  # the first step (T0 .. T0+10) is still open
    b.fold(5, ev(JobPreempted(job_id="x", reason=Reason(code="preempted", message="m")), at=T0 + 12))
    [first] = b.charts.points
    assert first["alloc"] == {"H100": 2.0} and first["total"] == {"H100": 2}
    assert first["wait_p50"] == {"default": 4.0} and first["wait_p95"] == {"default": 4.0}
    assert first["pending"] == {"default": 1}  # `w` waits
    assert first["cost"] == {"acme": 0.02}  # 2 GPUs x 3.60/h x 10 s
    assert first["util"] == {} and first["idle_cost"] == {}  # no sample: nothing said of how busy
    b.charts.sample({"node_id": NODE, "gpus": [{"index": 0, "util_pct": 1.0}, {"index": 1, "util_pct": 99.0}]},
                    T0 + 15)
    b.fold(6, ev(JobFailed(job_id="y", reason=Reason(code="exit_code", message="m")), at=T0 + 25))
    second = b.charts.points[-1]
    assert second["preempted"] == 1 and second["failed"] == 0 and second["wait_p50"] == {}
    assert second["util"] == {"H100": 50.0} and second["idle_cost"] == {"acme": 0.01}  # GPU 0 idle
    assert [p["failed"] for p in b.charts.points] == [0, 0]  # (the failure is the third step's)
    theirs = b.series("globex")
    assert theirs[0]["cost"] == {} and theirs[0]["pending"] == {} and theirs[0]["preempted"] is None
    assert b.series("acme")[0]["cost"] == {"acme": 0.02} and b.series("acme")[0]["pending"] == {"default": 1}
    # a board that is not the dashboard's (a view snapshot's, a replay's) draws nothing
    quiet = Board()
    quiet.fold(1, ev(NodeRegistered(node_id=NODE, inventory=INV), at=T0))
    quiet.fold(2, submitted("a").model_copy(update={"occurred_at": submitted("a").occurred_at.replace(year=2031)}))
    assert not quiet.charts.points
