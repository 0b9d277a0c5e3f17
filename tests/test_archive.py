"""Retention with an archive (shared/runtime/archive.py): what leaves FLEET is archived first, only the
archive process may purge, and replay, audit and every fold read archive + stream as one log."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from gpufleet.bench.replay import synthetic_log
from gpufleet.sdk import Fleet
from gpufleet.shared.contract.events import STREAM
from gpufleet.shared.runtime.archive import ARCHIVE_DIR_ENV, MANIFEST, RETENTION_ENV, Archive, archive_round
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.log import read_stream
from gpufleet.tools.audit import audit_log

from .helpers import wait_until


@pytest.fixture
def archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Archive:
    monkeypatch.setenv(RETENTION_ENV, "1s")
    monkeypatch.setenv(ARCHIVE_DIR_ENV, str(tmp_path / "archive"))
    return Archive(tmp_path / "archive")


async def test_archived_events_leave_the_stream_and_are_read_back_as_one_log(
        archive: Archive, bus: Bus, nats_url: str, realm: Any) -> None:
    # (`archive` first: the stream is made with a retention, so the archive process may purge it)
    assert (await bus.js.stream_info(STREAM)).config.deny_purge is False
    log = synthetic_log(3100)
    await bus.publish_batch(log[:1500])
    await bus.publish_batch(log[1500:3000])
    fleet = await Fleet.connect(nats_url=nats_url)
    try:
        before = await fleet.state_at(until_seq=3000)
        arch_bus = await Bus.connect(nats_url, name="archive", creds=realm.creds_path("svc-archive"))
        try:
            n = await archive_round(arch_bus, archive, retention=1.0, segment=1000, now=time.time() + 60)
        finally:
            await arch_bus.close()
        assert n == 3000 and [(s.first, s.last) for s in archive.segments()] == [(1, 1000), (1001, 2000), (2001, 3000)]
        info = await bus.js.stream_info(STREAM)
        assert info.state.first_seq == 3001 and info.state.messages == 0  # gone from the stream, kept in the archive
        await bus.publish_batch(log[3000:])

        seqs = [m.metadata.sequence.stream async for batch in read_stream(bus) for m in batch]
        assert seqs == list(range(1, 3101))  # one log, in order
        again = await fleet.state_at(until_seq=3000)
        assert {k: v for k, v in again.items() if k != "from_snapshot"} == \
               {k: v for k, v in before.items() if k != "from_snapshot"}
        report, _ = await audit_log(bus, full=True)
        assert report.ok, report.violations
        assert report.events == 3100 and report.head_seq == 3100
    finally:
        await fleet.close()

    # a segment altered after the fact (its digest in the manifest no longer matches): the audit says so
    doc = json.loads((archive.root / MANIFEST).read_text())
    good = doc["segments"][1]["sha256"]
    doc["segments"][1]["sha256"] = "0" * 64
    (archive.root / MANIFEST).write_text(json.dumps(doc))
    report, _ = await audit_log(bus, full=True)
    assert [v.invariant for v in report.violations][:1] == ["head"]
    assert any("does not match its digest" in v.message for v in report.violations)
    doc["segments"][1]["sha256"] = good
    (archive.root / MANIFEST).write_text(json.dumps(doc))


async def test_a_lagging_service_reader_holds_the_purge_and_a_tenants_reader_does_not(
        archive: Archive, bus: Bus, nats_url: str, realm: Any) -> None:
    """A consumer receives only what the stream still holds: a purge ahead of a service's durable
    (behind a restart, a slow machine) would lose those events to it for good. The archive writes
    them, keeps them in the stream until that reader has them, and purges them in a later round;
    a tenant's own reader that never reads holds nothing."""
    from nats.js.api import AckPolicy, ConsumerConfig

    await bus.publish_batch(synthetic_log(3000))
    await bus.js.add_consumer(STREAM, ConsumerConfig(durable_name="placer", filter_subject="fleet.>",
                                                     ack_policy=AckPolicy.ALL))
    await bus.js.add_consumer(STREAM, ConsumerConfig(durable_name="t0-watch", filter_subject="fleet.evt.t0.>",
                                                     ack_policy=AckPolicy.EXPLICIT))
    arch_bus = await Bus.connect(nats_url, name="archive", creds=realm.creds_path("svc-archive"))
    try:
        later = time.time() + 60
        assert await archive_round(arch_bus, archive, retention=1.0, segment=1000, now=later) == 1000
        assert (await bus.js.stream_info(STREAM)).state.first_seq == 1  # the placer has none of it yet
        psub = await bus.js.pull_subscribe_bind("placer", stream=STREAM)
        seq = 0
        while seq < 1500:
            got = await psub.fetch(min(500, 1500 - seq), timeout=5)
            await got[-1].ack_sync()  # AckPolicy.ALL: everything up to it is done
            seq = got[-1].metadata.sequence.stream
        assert await archive_round(arch_bus, archive, retention=1.0, segment=1000, now=later) == 1000
        info = await bus.js.stream_info(STREAM)
        assert info.state.first_seq == 1501  # purged up to what the placer has, archived to 2000
        assert archive.archived_to == 2000
        seqs = [m.metadata.sequence.stream async for batch in read_stream(bus) for m in batch]
        assert seqs == list(range(1, 3001))  # still one log
        await bus.js.delete_consumer(STREAM, "placer")
        assert await archive_round(arch_bus, archive, retention=1.0, segment=1000, now=later) == 1000
        assert (await bus.js.stream_info(STREAM)).state.first_seq == 3001  # the tenant's reader held nothing
    finally:
        await arch_bus.close()


async def test_only_the_archive_identity_purges_and_only_what_is_old_enough(
        archive: Archive, bus: Bus, nats_url: str, realm: Any) -> None:
    import nats

    await bus.publish_batch(synthetic_log(300))
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    placer = await Bus.connect(nats_url, name="p", creds=realm.creds_path("svc-placer"), error_cb=on_error)
    try:
        with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
            await placer.nc.request(f"$JS.API.STREAM.PURGE.{STREAM}", b"{}", timeout=2)
        await wait_until(lambda: any("purge" in e for e in errors), timeout_s=10)
    finally:
        await placer.close()
    with pytest.raises(Exception, match="(?i)permission|denied|violation|timeout"):
        await bus.js.purge_stream(STREAM)  # the admin may not purge either
    arch_bus = await Bus.connect(nats_url, name="archive", creds=realm.creds_path("svc-archive"))
    try:
        assert await archive_round(arch_bus, archive, retention=3600.0, segment=100) == 0  # nothing that old
        assert (await bus.js.stream_info(STREAM)).state.first_seq == 1
        # it cannot publish a fact either
        await arch_bus.nc.publish("fleet.evt.acme.job.j1.placed", b"{}")
        await arch_bus.nc.flush()
    finally:
        await arch_bus.close()


@pytest.mark.slow
def test_a_mesh_with_a_retention_archives_and_still_replays_and_audits_its_whole_history(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpufleet up --retention 1s`: the archive process moves old events out of the stream; the
    jobs still replay and audit from sequence 1 (archive + stream), and status shows both."""
    from .test_mesh_cli import cli, wait_jobs

    monkeypatch.setenv("GPUFLEET_ARCHIVE_EVERY_S", "0.5")
    monkeypatch.setenv("GPUFLEET_ARCHIVE_SEGMENT", "20")
    d = tmp_path / "m"
    cli(d, "up", "--detach", "--sim-nodes", "2", "--no-postgres", "--retention", "1s")
    try:
        spec = tmp_path / "j.yaml"
        spec.write_text("name: tiny\ntenant: acme\nresources: {gpu: 1}\nsim: {duration: 1s}\n")
        ids = {json.loads(cli(d, "submit", str(spec), "--json", "--yes").stdout)["job_id"] for _ in range(3)}
        wait_jobs(d, ids, "succeeded", timeout_s=60)

        def archived() -> bool:
            st = json.loads(cli(d, "status", "--json").stdout)["stream"]
            return bool(st["first_seq"] > 1 and st["archive"]["archived_to"] >= st["first_seq"] - 1)
        deadline = time.monotonic() + 60
        while not archived():
            assert time.monotonic() < deadline, "nothing archived"
            time.sleep(0.5)
        replay = json.loads(cli(d, "replay", "--json", "--all").stdout)
        assert {j["job_id"]: j["status"] for j in replay["jobs"] if j["job_id"] in ids} == {i: "succeeded" for i in ids}
        audit = json.loads(cli(d, "audit", "--json", "--full", check=False).stdout)
        assert audit["ok"], audit
        assert "archive: seqs 1.." in cli(d, "status").stdout
    finally:
        cli(d, "down", check=False)


async def test_a_long_read_reports_how_far_it_got(bus: Bus) -> None:
    """What the CLI's progress bar is fed: each batch's last sequence and what is still pending."""
    from gpufleet.shared.runtime.log import READ_BATCH, read_progress

    await bus.publish_batch(synthetic_log(READ_BATCH * 2 + 10))
    seen: list[tuple[int, int]] = []
    with read_progress(lambda seq, pending: seen.append((seq, pending))):
        n = 0
        async for batch in read_stream(bus):
            n += len(batch)
    assert n == READ_BATCH * 2 + 10 and len(seen) >= 3
    assert [s for s, _ in seen] == sorted(s for s, _ in seen) and seen[-1] == (n, 0)
    assert all(s + p == n for s, p in seen)  # the total is known from the first batch on
    told = len(seen)
    async for _ in read_stream(bus):  # outside the context: nobody told
        pass
    assert len(seen) == told


async def test_a_placement_after_the_last_one_was_purged_is_guarded_by_what_the_stream_still_holds(
        archive: Archive, bus: Bus, nats_url: str, realm: Any) -> None:
    """The placer's compare-and-set guard names its newest job.placed. After a quiet spell longer
    than the retention the archive purges that event, and the server then expects the subject's
    last sequence to be 0: a guard left at the purged sequence failed every placement, and each
    refold (archive + stream) set it back, for good (seen in CI: jobs left `reserved`)."""
    from gpufleet.services.placer.core import PlacerCore

    from .builders import make_job, node, quota_reserved, submitted
    from .test_runtime import Service, consumer_idle

    job = make_job().gpus(4)
    await bus.publish_batch([node("n1"), submitted(job, "j0"), quota_reserved(job, "j0")])
    placer = await Service(nats_url, PlacerCore(), instance="0").start()
    arch_bus = await Bus.connect(nats_url, name="archive", creds=realm.creds_path("svc-archive"))
    try:
        async def placed(job_id: str) -> list[Any]:
            got = [e for e in await fold_archived(bus) if e.type == "job.placed" and e.job_id == job_id]
            return got if got and await consumer_idle(bus, placer.rt.durable) else []

        await wait_until(lambda: placed("j0"), timeout_s=10)
        guard = placer.rt.last_cas_seq
        assert guard > 0
        await archive_round(arch_bus, archive, retention=1.0, segment=1000, now=time.time() + 60)
        info = await bus.js.stream_info(STREAM)
        assert info.state.messages == 0 and info.state.first_seq > guard  # the job.placed is archived only

        await bus.publish_batch([submitted(job, "j1"), quota_reserved(job, "j1")])
        (j1,) = await wait_until(lambda: placed("j1"), timeout_s=10)
        assert placer.rt.stats.cas_conflicts <= 1  # the one commit that still named the purged guard
        (j0,) = [e for e in await fold_archived(bus) if e.type == "job.placed" and e.job_id == "j0"]
        taken = {g for a in j0.payload.allocations for g in a.gpu_indices}
        assert taken and not taken & {g for a in j1.payload.allocations for g in a.gpu_indices}  # the archive was folded
    finally:
        await arch_bus.close()
        await placer.stop()


async def fold_archived(bus: Bus) -> list[Any]:
    """Every event of the log, archive and stream together."""
    from gpufleet.shared.runtime.engine import parse_logged

    return [parse_logged(m.metadata.sequence.stream, m.data) async for batch in read_stream(bus) for m in batch]
