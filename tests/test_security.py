"""The attack suite (issue 14): against a real nats-server running the authorization `gpufleet up`
generates, every attack of the threat model is refused, each with the error it gets, and every
identity can still do its own work. Grows with every new subject (docs/security.md).

A refused publish or subscribe is seen positively: the server reports a permissions violation
to the offender's connection (nats-py's error callback), and a refused JetStream request gets
no answer (its timeout)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gpufleet.shared.contract.events import (
    STREAM,
    GpuDevice,
    JobPlaced,
    JobSucceeded,
    NodeInventory,
    NodeRegistered,
    ReplicaAllocation,
    parse_envelope,
)
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.log import scoped, tenant_subscribe
from gpufleet.shared.trust.authz import ADMIN, OWNERS, SERVICES, Realm, load_creds, subject_pattern
from gpufleet.tools.audit import LogFacts, audit

from .builders import event, make_job
from .helpers import read_log, running, submit_cmd, wait_until

REFUSED_S = 2.0  # how long a refused JetStream request waits for the answer that never comes


class Conn:
    """One identity's connection, recording the permission violations the server reports to it."""

    def __init__(self, bus: Bus, errors: list[str]) -> None:
        self.bus, self.errors = bus, errors

    @property
    def nc(self) -> Any:
        return self.bus.nc

    async def violation(self, needle: str) -> str:
        """Wait for the server's report of a refused operation on a subject containing `needle`."""
        try:
            return str(await wait_until(lambda: next(
                (e for e in self.errors if "violation" in e.lower() and needle.lower() in e.lower()), None), timeout_s=10))
        except TimeoutError:
            raise AssertionError(f"no permissions violation on {needle!r}; got {self.errors}") from None


@pytest.fixture
async def connect(nats_url: str, realm: Realm) -> AsyncIterator[Any]:
    opened: list[Bus] = []

    async def open_as(identity: str) -> Conn:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        bus = await Bus.connect(nats_url, name=identity, creds=load_creds(realm.creds_path(identity)),
                                error_cb=on_error)
        opened.append(bus)
        return Conn(bus, errors)

    yield open_as
    for b in opened:
        await b.close()


def _giant_node() -> NodeRegistered:
    gpus = tuple(GpuDevice(index=i, uuid=f"GPU-forged-{i}", model="H100", memory_mib=81559) for i in range(1000))
    return NodeRegistered(node_id="forged-node", inventory=NodeInventory(
        cpu_milli=1_000_000, memory_mib=10_000_000, gpus=gpus))


# ---------------------------------------------------------------- connection


async def test_no_connection_without_credentials(nats_url: str) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)


async def test_no_connection_with_a_key_the_server_does_not_know(nats_url: str, tmp_path: Path) -> None:
    stranger = Realm(tmp_path / "elsewhere")
    stranger.add("tenant", "acme")  # same name, another key: not the server's
    creds = load_creds(stranger.creds_path("tenant-acme"))
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                           **creds.connect_options())


# ---------------------------------------------------------------- reading another tenant


async def test_a_tenant_cannot_read_another_tenants_events(bus: Bus, connect: Any) -> None:
    await bus.publish(submit_cmd(make_job("secret", tenant="acme").dict(), "secret", tenant="acme"))
    beta = await connect("tenant-beta")

    # live: a core subscription on everything
    await beta.nc.subscribe("fleet.>")
    assert "fleet.>" in await beta.violation("fleet.>")

    # stored: a consumer on everything, on acme's subjects, and the old name-less create
    for filt in ("fleet.>", "fleet.evt.acme.>", "fleet.cmd.acme.>"):
        with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
            await beta.bus.js.add_consumer(STREAM, ConsumerConfig(
                name="peek", filter_subject=filt, deliver_subject=beta.nc.new_inbox(),
                ack_policy=AckPolicy.NONE), timeout=REFUSED_S)
        await beta.violation(f"CONSUMER.CREATE.{STREAM}.peek.{filt}")
    with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
        await beta.bus.js.add_consumer(STREAM, ConsumerConfig(
            filter_subject="fleet.>", deliver_subject=beta.nc.new_inbox(), ack_policy=AckPolicy.NONE),
            timeout=REFUSED_S)
    await beta.violation(f"$JS.API.CONSUMER.CREATE.{STREAM}\"")

    # by sequence (direct get, message get) and by pulling from a service's consumer
    for subject in (f"$JS.API.DIRECT.GET.{STREAM}", f"$JS.API.STREAM.MSG.GET.{STREAM}",
                    f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.placer", f"$JS.API.STREAM.INFO.{STREAM}"):
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await beta.nc.request(subject, json.dumps({"seq": 1}).encode(), timeout=REFUSED_S)
        await beta.violation(subject)
    # another identity's inbox
    await beta.nc.subscribe("_INBOX.>")
    await beta.violation("_INBOX.>")


async def test_a_tenant_cannot_widen_its_own_consumer_in_the_request_body(bus: Bus, connect: Any) -> None:
    """The create subject carries the tenant's filter; a body that asks for more (another
    filter, or several) is refused by the server itself, and nothing of acme's is delivered."""
    await bus.publish(submit_cmd(make_job("secret", tenant="acme").dict(), "secret", tenant="acme"))
    beta = await connect("tenant-beta")
    inbox = beta.nc.new_inbox()
    sub = await beta.nc.subscribe(inbox)
    for body in ({"filter_subject": "fleet.>"}, {"filter_subjects": ["fleet.>"]},
                 {"filter_subject": "fleet.evt.beta.>", "filter_subjects": ["fleet.>"]}):
        cfg = {"name": "peek", "deliver_subject": inbox, "ack_policy": "none", "deliver_policy": "all", **body}
        resp = await beta.nc.request(f"$JS.API.CONSUMER.CREATE.{STREAM}.peek.fleet.evt.beta.>",
                                     json.dumps({"stream_name": STREAM, "config": cfg}).encode(), timeout=5)
        err = json.loads(resp.data).get("error")
        assert err is not None and err["code"] == 400, (body, resp.data)
    with pytest.raises(nats.js.errors.NotFoundError):  # no consumer was made: nothing can be delivered
        await bus.js.consumer_info(STREAM, "peek")
    await sub.unsubscribe()


async def test_a_tenant_cannot_repoint_a_services_consumer(bus: Bus, connect: Any) -> None:
    """A create on an existing name updates it: a tenant could narrow the placer's filter to its
    own subjects and starve it. The service consumers' names are denied to tenants."""
    beta = await connect("tenant-beta")
    for name in ("placer", "group-admission-quota-guardian-telemetry-billing-autoscaler", "readmodel", "placer-1"):
        with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
            await beta.bus.js.add_consumer(STREAM, ConsumerConfig(
                name=name, filter_subject="fleet.evt.beta.>", deliver_subject=beta.nc.new_inbox(),
                ack_policy=AckPolicy.NONE), timeout=REFUSED_S)
        await beta.violation(f"CONSUMER.CREATE.{STREAM}.{name}.")


# ---------------------------------------------------------------- writing for others


async def test_a_tenant_cannot_command_for_another_tenant(bus: Bus, connect: Any) -> None:
    beta = await connect("tenant-beta")
    cmd = submit_cmd(make_job("x", tenant="acme").dict(), "x", tenant="acme")
    with pytest.raises(nats.errors.TimeoutError):
        await beta.bus.js.publish(cmd.subject(), cmd.to_json(), timeout=REFUSED_S)
    assert "fleet.cmd.acme.submit" in await beta.violation("fleet.cmd.acme.submit")
    # nor on the admin's subject
    admin_cancel = cmd.model_copy(update={"tenant": "sys"})
    with pytest.raises(nats.errors.TimeoutError):
        await beta.bus.js.publish("fleet.cmd.sys.cancel", admin_cancel.to_json(), timeout=REFUSED_S)
    await beta.violation("fleet.cmd.sys.cancel")
    assert not [e for _, e in await read_log(bus) if e.job_id == "x"]


async def test_every_owned_fact_is_refused_to_every_identity_that_does_not_own_it(bus: Bus, connect: Any) -> None:
    """For each event type of the contract: the tenants and each service that does not own it get
    a permissions violation on its subject; nothing of it reaches the log."""
    conns = {ident: await connect(ident) for ident in ("tenant-acme", *(f"svc-{s}" for s in SERVICES))}
    probes = 0
    for etype, owners in sorted(OWNERS.items()):
        if etype.startswith("cmd.") or etype == "sys.dead_letter":
            continue  # commands: the tenant's own subject (above); dead letters: below
        subject = subject_pattern(etype).replace("*", "forged")
        for ident, conn in conns.items():
            if ident.removeprefix("svc-") in owners:
                continue
            await conn.nc.publish(subject, b"{}")
            probes += 1
    for conn in conns.values():
        await conn.nc.flush()
    for etype, owners in sorted(OWNERS.items()):
        if etype.startswith("cmd.") or etype == "sys.dead_letter":
            continue
        subject = subject_pattern(etype).replace("*", "forged")
        for ident, conn in conns.items():
            if ident.removeprefix("svc-") not in owners:
                await conn.violation(f'"{subject}"')
    assert probes > 150
    # a service's dead letters go on its own subject only
    placer = conns["svc-placer"]
    await placer.nc.publish("fleet.evt.sys.deadletter.admission", b"{}")
    await placer.violation("fleet.evt.sys.deadletter.admission")
    assert not [s for s in (await _subjects(bus)) if "forged" in s or s.endswith("deadletter.admission")]


async def test_forged_facts_of_the_table_rows_are_refused(bus: Bus, connect: Any) -> None:
    """The rows of the issue: a tenant forging job.succeeded, job.placed, a 1,000-GPU node."""
    acme = await connect("tenant-acme")
    forged = [
        event(JobSucceeded(job_id="j1"), tenant="acme"),
        event(JobPlaced(job_id="j1", allocations=(ReplicaAllocation(replica=0, node_id="n0", gpu_indices=(0,)),)),
              tenant="acme"),
        event(_giant_node()),
    ]
    for env in forged:
        with pytest.raises(nats.errors.TimeoutError):
            await acme.bus.js.publish(env.subject(), env.to_json(), timeout=REFUSED_S)
        await acme.violation(env.subject())
    assert await _subjects(bus) == []


# ---------------------------------------------------------------- erasing history


@pytest.mark.parametrize("identity", ["tenant-acme", "svc-placer", ADMIN])
async def test_nobody_purges_or_deletes_the_log(bus: Bus, connect: Any, identity: str) -> None:
    await bus.publish(submit_cmd(make_job("keep").dict(), "keep"))
    conn = await connect(identity)
    for api in ("PURGE", "DELETE"):
        with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
            await conn.nc.request(f"$JS.API.STREAM.{api}.{STREAM}", b"", timeout=REFUSED_S)
        await conn.violation(f"$JS.API.STREAM.{api}.{STREAM}")
    with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
        await conn.nc.request(f"$JS.API.STREAM.MSG.DELETE.{STREAM}", b'{"seq": 1}', timeout=REFUSED_S)
    info = await bus.js.stream_info(STREAM)
    assert info.state.messages == 1 and info.state.first_seq == 1
    # and the stream itself refuses, whoever asks (a server config that let the API through)
    assert info.config.deny_purge and info.config.deny_delete


async def test_a_tenant_or_service_cannot_change_the_streams(bus: Bus, connect: Any) -> None:
    for identity in ("tenant-acme", "svc-placer"):
        conn = await connect(identity)
        for api in (f"UPDATE.{STREAM}", "CREATE.EVIL"):
            with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
                await conn.nc.request(f"$JS.API.STREAM.{api}", b"{}", timeout=REFUSED_S)
            await conn.violation(f"$JS.API.STREAM.{api}")


# ---------------------------------------------------------------- defence in depth


@pytest.mark.no_audit  # the admin writes a forged fact on purpose
async def test_a_core_dead_letters_a_fact_by_a_foreign_author(bus: Bus) -> None:
    """The admin may write any subject (the server lets it): a placement it claims for itself, or
    one claiming a tenant as author, is not folded by the executor; both are dead-lettered."""
    from gpufleet.services.executor.core import ExecutorCore
    from gpufleet.shared.node.cluster import sim_fleet

    executor = ExecutorCore(sim_fleet(1))
    async with running(_url(bus), [executor]) as rts:
        alloc = (ReplicaAllocation(replica=0, node_id="sim-00000", gpu_indices=(0,), cpu_milli=1000),)
        for actor in ("mallory/0", "acme"):
            env = event(JobPlaced(job_id=f"forged-{actor[:3]}", allocations=alloc), tenant="acme", actor=actor)
            await bus.publish(env)

        async def dead() -> list[Any]:
            return [e for _, e in await read_log(bus) if e.type == "sys.dead_letter"]

        letters = await wait_until(lambda: _ready(dead(), 2), timeout_s=15)
        assert all("foreign author" in e.payload.reason for e in letters)
        assert "only placer may author it" in letters[0].payload.reason
        assert not [e for _, e in await read_log(bus) if e.type == "job.started"]
        assert not [j for j, rec in rts[0].state.jobs.items() if rec.desired and j.startswith("forged")]


async def _ready(coro: Any, n: int) -> Any:
    got = await coro
    return got if len(got) >= n else None


def _url(bus: Bus) -> str:
    srv = bus.nc.connected_url
    return f"nats://{srv.hostname}:{srv.port}"


async def _subjects(bus: Bus) -> list[str]:
    info = await bus.js.stream_info(STREAM, subjects_filter=">")
    return sorted((info.state.subjects or {}).keys())


# ---------------------------------------------------------------- everyone can still work


async def test_a_tenant_submits_and_follows_its_own_jobs(bus: Bus, connect: Any, nats_url: str) -> None:
    from .helpers import default_cores

    acme = await connect("tenant-acme")
    async with running(nats_url, default_cores(2)):
        sub = await tenant_subscribe(acme.bus, scoped("fleet.evt.*.job.mine.>", "acme"), DeliverPolicy.ALL)
        cmd = submit_cmd(make_job("mine", tenant="acme").dict(), "mine", tenant="acme")
        await acme.bus.js.publish(cmd.subject(), cmd.to_json(), headers={"Nats-Msg-Id": cmd.event_id})
        seen: list[str] = []
        while "job.placed" not in seen:
            msg = await sub.next_msg(timeout=15)
            seen.append(parse_envelope(msg.data).type)
        assert seen[:2] == ["job.submitted", "job.admitted"]
    assert not [e for e in acme.errors if "violation" in e.lower()]


async def test_scoped_reads_name_the_subjects_a_tenant_may_read() -> None:
    assert scoped("fleet.>", "acme") == "fleet.evt.acme.>"
    assert scoped("fleet.evt.*.job.j1.*", "acme") == "fleet.evt.acme.job.j1.*"
    with pytest.raises(PermissionError, match="fleet.evt.acme"):
        scoped("fleet.evt.sys.node.*.lost", "acme")


# ---------------------------------------------------------------- the audit notices


def _hist(*envs: Any) -> list[tuple[int, Any]]:
    return list(enumerate(envs, start=1))


def test_audit_fails_on_a_forged_author() -> None:
    env = event(JobPlaced(job_id="j", allocations=()), actor="acme")
    report = audit(_hist(env))
    assert [v.invariant for v in report.violations] == ["author"]
    assert "only placer may author it" in report.violations[0].message
    ok = event(JobPlaced(job_id="j", allocations=()))
    assert audit(_hist(ok)).first()["author"] is None


def test_audit_fails_on_a_fact_on_a_subject_its_envelope_does_not_name() -> None:
    env = event(JobSucceeded(job_id="j"))
    facts = LogFacts(1, 1, {1: "fleet.evt.acme.job.other.succeeded"})
    report = audit(_hist(env), log=facts)
    assert report.first()["author"] is not None
    assert "fleet.evt.acme.job.other.succeeded" in report.violations[0].message


def test_audit_fails_on_a_gap_and_on_a_missing_head() -> None:
    envs = [event(JobSucceeded(job_id=f"j{i}")) for i in range(5)]
    hist = [(s, e) for s, e in _hist(*envs) if s != 3]
    report = audit(hist, log=LogFacts(1, 5, {s: e.subject() for s, e in hist}))
    assert [(v.invariant, v.seq) for v in report.violations] == [("gap", 3)]
    # a purged log: the stream starts past 1 (or is empty after its last sequence)
    tail = [(s, e) for s, e in _hist(*envs) if s >= 4]
    report = audit(tail, log=LogFacts(4, 5, {s: e.subject() for s, e in tail}))
    assert report.first()["head"] is not None and "1..3 are gone" in report.first()["head"].message  # type: ignore[union-attr]
    empty = audit([], log=LogFacts(6, 5))
    assert "purged" in empty.first()["head"].message  # type: ignore[union-attr]
    # an archive that holds the head makes it whole again
    assert audit(tail, log=LogFacts(4, 5, {s: e.subject() for s, e in tail}, archived_to=3)).ok
    assert not audit([], log=LogFacts(0, 0, exists=False)).ok


async def test_gpufleet_audit_reads_the_streams_own_facts(bus: Bus) -> None:
    from gpufleet.tools.audit import audit_log

    await bus.publish(submit_cmd(make_job("a").dict(), "a"))
    report, from_seq = await audit_log(bus, full=True)
    assert from_seq == 0 and report.events == 1 and report.head_seq == 1 and report.ok

