"""View snapshots (gpufleet/tools/viewsnap.py): `replay --seq N` and the dashboard start from the
nearest snapshot at or before N and fold only the tail, and give exactly what a fold from
sequence 1 gives; one that does not check out is skipped for an older one."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

from gpufleet.bench.replay import synthetic_log
from gpufleet.sdk import Fleet
from gpufleet.shared.read.view import TERMINAL_STATUSES
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.snapshots import bucket_for
from gpufleet.tools.dashboard import Board, Dashboard, Tokens
from gpufleet.tools.viewsnap import VIEW, ViewSnapshots, keep

from .helpers import wait_until


async def _log(bus: Bus, events: int) -> int:
    for i in range(0, events, 500):
        await bus.publish_batch(synthetic_log(events)[i:i + 500])
    return await bus.last_seq()


def _view_doc(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != "from_snapshot"}


async def test_replay_at_any_point_from_a_view_snapshot_equals_the_fold_from_sequence_1(
        bus: Bus, nats_url: str, realm: Any) -> None:
    head = await _log(bus, 3000)
    view_bus = await Bus.connect(nats_url, name="view", creds=realm.creds_path("svc-view"))
    stop = asyncio.Event()
    keeper = asyncio.create_task(keep(view_bus, view_bus.creds.snapshot_key(VIEW) if view_bus.creds else None, stop,
                                      every=700, poll_s=0.05))
    snaps = ViewSnapshots(bus, bus.creds.snapshot_key(VIEW) if bus.creds else None)
    try:
        await wait_until(lambda: _count(snaps, 4), timeout_s=60)
    finally:
        stop.set()
        await keeper
        await view_bus.close()
    points = [p.seq for p in await snaps.points()]
    assert points == [700, 1400, 2100, 2800]
    fleet = await Fleet.connect(nats_url=nats_url)
    try:
        rng = random.Random(7)
        for seq in [*rng.sample(range(1, head + 1), 5), 700, 2799, head]:
            doc = await fleet.state_at(until_seq=seq, ended=True)
            state = await fleet.state_at(until_seq=seq)  # (the default: the jobs not ended, and the counts)
            assert doc["from_snapshot"] == state["from_snapshot"] == max((p for p in points if p <= seq), default=0)
            full = Board()
            from gpufleet.tools.viewsnap import fold_board

            await fold_board(bus, full, until_seq=seq)
            assert doc["seq"] == state["seq"] == seq
            assert doc["jobs"] == [j for j in full.view.as_json()["jobs"]]
            assert state["jobs"] == [j for j in doc["jobs"] if j["status"] not in TERMINAL_STATUSES]
            assert state["job_counts"] == dict(sorted(Counter(j["status"] for j in doc["jobs"]).items()))
            assert doc["nodes"] == state["nodes"] == full.view.as_json()["nodes"]
            assert doc["queues"] == state["queues"] == full.state()["queues"]
    finally:
        await fleet.close()


async def _count(snaps: ViewSnapshots, n: int) -> bool:
    return len(await snaps.points()) >= n


async def test_a_tampered_view_snapshot_is_skipped_for_an_older_one(bus: Bus, nats_url: str, realm: Any) -> None:
    await _log(bus, 1500)
    key = b"v" * 32
    snaps = ViewSnapshots(bus, key)
    from gpufleet.tools.viewsnap import fold_board

    board = Board()
    await fold_board(bus, board, until_seq=500)
    await snaps.save(board, 500, 0)
    await fold_board(bus, board, until_seq=1000)
    newer = await snaps.save(board, 1000, 0)
    obs = await bus.js.object_store(bucket_for(VIEW))
    data = bytearray((await obs.get(newer.name)).data or b"")
    data[-1] ^= 0xFF
    await obs.put(newer.name, bytes(data))
    got = await snaps.nearest(until_seq=1200)
    assert got is not None and got[1] == 500  # the tampered one refused, the older one used
    assert await ViewSnapshots(bus, b"another key".ljust(32)).nearest() is None  # nobody else's key checks out


async def test_the_dashboard_starts_from_the_newest_view_snapshot(bus: Bus, nats_url: str, realm: Any) -> None:
    head = await _log(bus, 1400)
    key = bus.creds.snapshot_key(VIEW) if bus.creds else None
    board = Board()
    from gpufleet.tools.viewsnap import fold_board

    await fold_board(bus, board, until_seq=1000)
    await ViewSnapshots(bus, key).save(board, 1000, 0)
    dash = Dashboard(bus, Tokens())
    task = asyncio.create_task(dash.follow())
    try:
        await wait_until(lambda: dash.board.view.seq >= head, timeout_s=30)
        full = Board()
        await fold_board(bus, full)
        # the live board: what had ended by the snapshot stays in its row segment (not loaded)
        live_rows = lambda r: r.status not in TERMINAL_STATUSES  # noqa: E731
        assert dash.board.view.as_json(live_rows) == full.view.as_json(live_rows)
        assert dash.board.counts == full.counts and dash.board.state()["queues"] == full.state()["queues"]
        # a job that ended before the snapshot: its page is read from the log by its subjects
        old = next(iter(full.view.jobs))
        assert old not in dash.board.history
        page = await dash.job_page(old, None)
        assert page is not None and page["timeline"] and page["status"] == full.view.jobs[old].status
    finally:
        task.cancel()


async def test_the_view_identity_writes_its_own_bucket_and_nothing_else(nats_url: str, realm: Any) -> None:
    """The view process may keep `SNAP_view` and nothing more: no fact of the log, no core's snapshots."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    view = await Bus.connect(nats_url, creds=realm.creds_path("svc-view"), error_cb=on_error)
    try:
        await view.nc.publish("$O.SNAP_placer.M.x", b"forged")
        await view.nc.publish("fleet.evt.acme.job.j1.placed", b"{}")
        await view.nc.publish("fleet.evt.sys.node.n1.registered", b"{}")
        await view.nc.publish("$O.SNAP_view.C.x", b"ok")
        await view.nc.flush()
        await wait_until(lambda: sum(("$o.snap_placer" in e) + ("fleet.evt" in e) for e in errors) >= 3, timeout_s=10)
        assert not any("$o.snap_view" in e for e in errors)
    finally:
        await view.close()


def test_the_boards_counts_follow_the_jobs_as_a_recount_does() -> None:
    """The page's counts (jobs by status, pending per queue) are kept as jobs move, not recounted
    over every job ever at each state push: they equal a recount at every point of a log."""
    board = Board()
    for seq, env in enumerate(synthetic_log(3000), 1):
        board.fold(seq, env)
        if seq % 250 == 0:
            recount: dict[tuple[str, str, str], int] = {}
            for j in board.view.jobs.values():
                recount[(j.tenant, j.queue, j.status)] = recount.get((j.tenant, j.queue, j.status), 0) + 1
            assert board.counts == recount
    assert sum(board.state()["jobs"].values()) == len(board.view.jobs)
