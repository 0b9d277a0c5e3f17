"""Snapshots (shared/runtime/snapshots.py): a start, a lost compare-and-set and a failed publish restore
the last committed point and fold only the tail, with exactly the state a full fold gives."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.shared.contract.events import Envelope
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.loop import Ctx, ServiceRuntime
from gpufleet.shared.runtime.snapshots import SnapshotRefused, bucket_for, decode, take
from gpufleet.tools.sim import run_file

from .builders import make_job
from .helpers import submit_cmd, wait_until

_LOGS: dict[int, Any] = {}


def _sim(seed: int) -> Any:
    """A stress scenario's whole log (gangs, preemption, resumes, lost nodes; chaos on odd seeds)."""
    if seed not in _LOGS:
        _LOGS[seed] = run_file("examples/sim/stress.yaml", seed=seed)
    return _LOGS[seed]


def _fold(core: Any, state: Any, log: list[Envelope]) -> Any:
    for env in log:
        if core_wants(core, env):
            state = core.evolve(state, env)
    return state


def core_wants(core: Any, env: Envelope) -> bool:
    from gpufleet.shared.contract.subjects import SubjectFilter

    return SubjectFilter(core.subjects)(env.subject())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.sampled_from([5, 1, 7]), cut=st.floats(0.05, 0.95))
def test_snapshot_at_any_point_plus_the_tail_is_the_full_fold_for_every_core(seed: int, cut: float) -> None:
    """For each core: fold to a random point, snapshot (pickle, compress, MAC), restore into a new
    core instance, fold the rest: the state equals the full fold's, and every decision on the
    tail is the same (a cache on the instance would show here)."""
    sim = _sim(seed)
    log = sim.log
    k = int(len(log) * cut)
    key = b"k" * 32
    for member in sim.members:
        make = type(member.core)
        full_core = _fresh(member.core)
        full = _fold(full_core, full_core.initial_state(), log)

        first = _fresh(member.core)
        part = _fold(first, first.initial_state(), log[:k])
        snap = take(first, part, seq=k, last_cas_seq=0, own=set(), stream_created="t")
        data = snap.encode(key)
        restored_core = _fresh(member.core)
        back = decode(data, key, restored_core, restored_core.initial_state(), "t")
        state = restored_core.initial_state()
        state = back.state()
        cont = _fresh(member.core)
        cont_state = _fold(cont, cont.initial_state(), log[:k])
        for env in log[k:]:
            if not core_wants(restored_core, env):
                continue
            state = restored_core.evolve(state, env)
            cont_state = cont.evolve(cont_state, env)
            ctx = Ctx(now=env.occurred_at, actor=f"{member.core.name}/0", cause=env)
            ctx2 = Ctx(now=env.occurred_at, actor=f"{member.core.name}/0", cause=env)
            assert [e.model_dump() for e in restored_core.decide(state, env, ctx)] == \
                   [e.model_dump() for e in cont.decide(cont_state, env, ctx2)], (make.__name__, env.type)
        assert state == full, f"{make.__name__}: snapshot at {k} of {len(log)} + tail != full fold"


def _fresh(core: Any) -> Any:
    """A new instance of the same core, configured alike (its config and constructor arguments)."""
    return pickle.loads(pickle.dumps(core))


def test_a_snapshot_that_does_not_check_out_is_refused() -> None:
    core = AdmissionCore()
    state = core.initial_state()
    snap = take(core, state, 10, 0, set(), "created-1")
    good = snap.encode(b"k" * 32)
    assert decode(good, b"k" * 32, core, state, "created-1").seq == 10
    tampered = good[:-3] + bytes([good[-3] ^ 1]) + good[-2:]
    with pytest.raises(SnapshotRefused, match="MAC"):
        decode(tampered, b"k" * 32, core, state, "created-1")
    with pytest.raises(SnapshotRefused, match="MAC"):
        decode(good, b"another key".ljust(32), core, state, "created-1")
    with pytest.raises(SnapshotRefused, match="another log"):
        decode(good, b"k" * 32, core, state, "created-2")
    with pytest.raises(SnapshotRefused, match="truncated"):
        decode(good[:-5], b"k" * 32, core, state, "created-1")
    with pytest.raises(SnapshotRefused, match="not a snapshot"):
        decode(b"\x00\x00\x00\x05junk", b"k" * 32, core, state, "created-1")
    bumped = AdmissionCore()
    bumped.state_format = AdmissionCore.state_format + 1
    with pytest.raises(SnapshotRefused, match="state format"):
        decode(good, b"k" * 32, bumped, state, "created-1")


def test_executors_of_different_nodes_neither_share_nor_read_each_others_snapshot() -> None:
    """One executor per GPU node: each state holds only what its own nodes run. A snapshot
    written by the executor of node A must not be where node B's looks, nor be read by it."""
    from gpufleet.services.executor.core import ExecutorCore
    from gpufleet.shared.node.cluster import sim_fleet
    from gpufleet.shared.runtime.snapshots import object_name

    a, b = ExecutorCore(sim_fleet(2, "a")), ExecutorCore(sim_fleet(2, "b"))
    same = ExecutorCore(sim_fleet(2, "a"))  # a second instance of A's executor
    assert object_name(a) != object_name(b) and object_name(a) == object_name(same)
    assert object_name(AdmissionCore()) == "admission"  # a core of the log alone keeps its name
    good = take(a, a.initial_state(), 10, 0, set(), "created-1").encode(b"k" * 32)
    assert decode(good, b"k" * 32, same, same.initial_state(), "created-1").seq == 10
    with pytest.raises(SnapshotRefused, match="state format"):
        decode(good, b"k" * 32, b, b.initial_state(), "created-1")


async def _runtime(nats_url: str, realm_creds: Any = None) -> ServiceRuntime[Any]:
    bus = await Bus.connect(nats_url, name="admission", creds=realm_creds)
    rt: ServiceRuntime[Any] = ServiceRuntime(AdmissionCore(), bus, fetch_timeout_s=0.05)
    await rt.start()
    return rt


async def _full_fold(nats_url: str) -> Any:
    """The state a fold of the whole log from sequence 1 gives."""
    full = await _runtime(nats_url, None)
    try:
        await full._refold(full=True)
        return full.state
    finally:
        await full.bus.close()


async def _drain(rt: ServiceRuntime[Any], bus: Bus) -> None:
    async def caught_up() -> bool:
        await rt.step()
        return rt.applied_seq >= await bus.last_seq()
    await wait_until(caught_up, timeout_s=30)


async def test_a_restart_starts_from_the_stored_snapshot_and_folds_only_the_tail(
        bus: Bus, nats_url: str, realm: Any) -> None:
    creds = realm.creds_path("svc-admission")
    await bus.publish_batch([submit_cmd(make_job(f"a{i}").dict(), f"a{i}") for i in range(40)])
    rt = await _runtime(nats_url, creds)
    assert rt.last_fold.from_seq == 0  # nothing stored yet: from sequence 1
    await _drain(rt, bus)
    await rt.flush_snapshot()  # as a clean stop does
    stored_at = rt.applied_seq
    before = rt.state
    await rt.bus.close()

    await bus.publish_batch([submit_cmd(make_job(f"b{i}").dict(), f"b{i}") for i in range(3)])
    again = await _runtime(nats_url, creds)
    try:
        assert again.last_fold.from_seq == stored_at > 100
        assert again.last_fold.events == 3  # the three commands since
        await _drain(again, bus)
        assert set(before.jobs) < set(again.state.jobs) and len(again.state.jobs) == 43
        assert await _full_fold(nats_url) == again.state  # the same state a fold from sequence 1 gives
    finally:
        await again.bus.close()


async def test_a_corrupt_or_foreign_snapshot_is_skipped_for_a_full_fold(bus: Bus, nats_url: str, realm: Any) -> None:
    creds = realm.creds_path("svc-admission")
    await bus.publish_batch([submit_cmd(make_job(f"a{i}").dict(), f"a{i}") for i in range(5)])
    rt = await _runtime(nats_url, creds)
    await _drain(rt, bus)
    await rt.flush_snapshot()
    await rt.bus.close()
    # someone with the admin's rights overwrites it (a service's identity may write only its own)
    obs = await bus.js.object_store(bucket_for("admission"))
    res = await obs.get("admission")
    data = bytearray(res.data or b"")
    data[-1] ^= 0xFF
    await obs.put("admission", bytes(data))
    again = await _runtime(nats_url, creds)
    try:
        assert again.last_fold.from_seq == 0 and again.last_fold.events >= 15
        assert len(again.state.jobs) == 5
    finally:
        await again.bus.close()


async def test_only_a_cores_own_identity_writes_its_snapshots(nats_url: str, realm: Any) -> None:
    import nats

    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    placer = await Bus.connect(nats_url, creds=realm.creds_path("svc-placer"), error_cb=on_error)
    try:
        await placer.nc.publish("$O.SNAP_admission.M.x", b"forged")
        await placer.nc.publish("$O.SNAP_placer.C.x", b"ok")
        await placer.nc.flush()
        await wait_until(lambda: any("$o.snap_admission" in e for e in errors), timeout_s=10)
        assert not any("$o.snap_placer" in e for e in errors)
        with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
            await placer.nc.request("$JS.API.STREAM.PURGE.OBJ_SNAP_admission", b"", timeout=2)
    finally:
        await placer.close()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.sampled_from([5, 1, 7]), cut=st.floats(0.05, 0.95))
def test_a_view_snapshot_at_any_point_plus_the_tail_is_the_full_fold(seed: int, cut: float) -> None:
    """The view (gpufleet/tools/viewsnap.py: the board's rows, GPU cells, queue usage and counts) stored
    at a random point of a stress log and folded on equals the view folded from sequence 1."""
    from gpufleet.tools.dashboard import Board
    from gpufleet.tools.viewsnap import KIND, ended_rows, live, stripped

    log = _sim(seed).log
    k = int(len(log) * cut)
    full, part = Board(), Board()
    for seq, env in enumerate(log, 1):
        full.fold(seq, env)
        if seq <= k:
            part.fold(seq, env)
    snap = take(KIND, stripped(part), seq=k, last_cas_seq=0, own=set(), stream_created="t")
    back: Board = decode(snap.encode(b"v" * 32), b"v" * 32, KIND, Board(), "t").state()
    for seq, env in enumerate(log[k:], k + 1):
        back.fold(seq, env)
    assert stripped(back) == stripped(full), f"view snapshot at {k} of {len(log)} + tail != full fold"
    assert back.state() == {**full.state(), "recent": back.state()["recent"]}  # (recent: what a live page saw)
    # a point as the view process stores it: the live board, the ended jobs' rows put away in a segment
    segment = ended_rows(part)
    lean: Board = decode(take(KIND, live(part), seq=k, last_cas_seq=0, own=set(), stream_created="t").encode(
        b"v" * 32), b"v" * 32, KIND, Board(), "t").state()
    assert not set(segment) & set(lean.view.jobs)
    for seq, env in enumerate(log[k:], k + 1):
        lean.fold(seq, env)
    assert live(lean) == live(full), f"live point at {k} of {len(log)} + tail != full fold"
    assert {**segment, **lean.view.jobs} == full.view.jobs, "the put-away rows + the tail's rows != every row"
    assert lean.counts == full.counts


async def test_a_slow_point_is_pickled_by_a_forked_child_as_the_state_was_at_the_fork(
        bus: Bus, nats_url: str, realm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state that pickles slowly is pickled by a forked child while the loop goes on: the point
    is the state at the fork (not what the loop folded meanwhile), is used for a rollback exactly
    as one taken in the loop, and is stored when due; the child's CPU counts against the budget."""
    from gpufleet.shared.runtime import loop

    monkeypatch.setattr(loop, "FORK_FROM_S", 0.0)  # every point of this small state through a child
    monkeypatch.setenv("GPUFLEET_POINT_FORK", "1")
    creds = realm.creds_path("svc-admission")
    await bus.publish_batch([submit_cmd(make_job(f"f{i}").dict(), f"f{i}") for i in range(30)])
    rt = await _runtime(nats_url, creds)
    try:
        await _drain(rt, bus)
        at_fork_seq, at_fork_jobs = rt.applied_seq, set(rt.state.jobs)
        rt._snap_cost_s = 1.0  # as a large state's last point cost
        rt._take_snapshot(background=True, store_always=True)
        task = rt._point_task
        assert task is not None, "the point was taken in the loop, not by a child"
        # the loop goes on while the child pickles: more jobs folded
        await bus.publish_batch([submit_cmd(make_job(f"g{i}").dict(), f"g{i}") for i in range(5)])
        await _drain(rt, bus)
        await task
        assert rt._point_task is None
        snap = rt._snap
        assert snap is not None and snap.seq == at_fork_seq < rt.applied_seq
        assert set(snap.state().jobs) == at_fork_jobs  # the state at the fork, not the later one
        assert 0 < rt._snap_cost_s < 1.0  # the child's CPU (and the fork), not the stale figure
        await wait_until(lambda: rt._save_task is not None and rt._save_task.done(), timeout_s=10)
        assert rt._stored_seq == at_fork_seq  # stored: idle's point is stored whenever newer

        # a rollback restores it and folds the tail: the same state as a full fold
        before = rt.state
        await rt.refold()
        assert rt.last_fold.from_seq == at_fork_seq and rt.last_fold.events > 0
        assert rt.state == before
        assert await _full_fold(nats_url) == rt.state
    finally:
        await rt.bus.close()


async def test_a_failed_child_leaves_the_older_point_and_the_next_is_taken_in_the_loop(
        bus: Bus, nats_url: str, realm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufleet.shared.runtime import loop

    monkeypatch.setattr(loop, "FORK_FROM_S", 0.5)  # a point that cost 1 s goes to a child
    creds = realm.creds_path("svc-admission")
    await bus.publish_batch([submit_cmd(make_job(f"h{i}").dict(), f"h{i}") for i in range(5)])
    rt = await _runtime(nats_url, creds)
    try:
        await _drain(rt, bus)
        older = rt._snap
        assert older is not None
        rt.engine.state.jobs["poison"] = lambda: None  # type: ignore[assignment]  # a lambda does not pickle
        rt._snap_cost_s = 1.0
        rt._take_snapshot(background=True)
        assert rt._point_task is not None
        await rt._point_task
        assert rt._snap is older  # the child failed: the older point stays
        assert rt._snap_cost_s == 0.0  # so the next one is taken in the loop, where a failure shows
        del rt.engine.state.jobs["poison"]
        rt._take_snapshot(background=True)
        assert rt._point_task is None and rt._snap is not older and rt._snap.seq == rt.applied_seq
    finally:
        await rt.bus.close()


async def test_a_point_taken_in_the_loop_while_a_child_pickles_is_not_replaced_by_the_older_one(
        bus: Bus, nats_url: str, realm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from gpufleet.shared.runtime import loop, snapshots

    monkeypatch.setattr(loop, "FORK_FROM_S", 0.5)
    release = asyncio.Event()
    real_result = snapshots.ForkedPoint.result

    async def held_result(self: Any) -> Any:  # the child's point comes back only when the test says
        await release.wait()
        return await real_result(self)

    monkeypatch.setattr(snapshots.ForkedPoint, "result", held_result)
    creds = realm.creds_path("svc-admission")
    await bus.publish_batch([submit_cmd(make_job(f"k{i}").dict(), f"k{i}") for i in range(5)])
    rt = await _runtime(nats_url, creds)
    try:
        await _drain(rt, bus)
        rt._snap_cost_s = 1.0
        rt._take_snapshot(background=True)
        task = rt._point_task
        assert task is not None
        forked_at = rt.applied_seq
        await bus.publish_batch([submit_cmd(make_job(f"m{i}").dict(), f"m{i}") for i in range(3)])
        await _drain(rt, bus)
        rt._snap_cost_s = 1.0
        rt._take_snapshot(background=True)  # a second child waits for the first
        assert rt._point_task is task
        await rt.flush_snapshot()  # a clean stop: a point in the loop now, however slow
        assert rt._snap is not None and rt._snap.seq == rt.applied_seq > forked_at
        release.set()
        await task
        assert rt._snap.seq == rt.applied_seq  # the child's older point did not replace it
    finally:
        release.set()
        await rt.bus.close()
