"""The runtime loop against a real nats-server: bad input, crashes, kills, racing replicas, CAS.

Every test starts its own nats-server (the `bus` / `nats_url` fixtures) and checks the log
itself, the single source of truth, after the fact.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from nats.aio.msg import Msg

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.placer.core import PlacerCore
from gpufleet.shared.contract.errors import CasConflict, RetryableError
from gpufleet.shared.contract.events import (
    STREAM,
    TERMINAL_JOB_TYPES,
    CapacityCommitted,
    Envelope,
    JobAdmitted,
    JobRejected,
    Reason,
    SubmitRequested,
)
from gpufleet.shared.node.cluster import sim_fleet
from gpufleet.shared.runtime.bus import Bus, Cas
from gpufleet.shared.runtime.loop import BaseCore, Core, Ctx, ServiceRuntime

from .builders import event, make_job, node, placed, quota_reserved, submit, submitted
from .helpers import default_cores, read_log, running, submit_cmd, wait_until

PLACED = "fleet.evt.*.job.*.placed"
MARK = "fleet.evt.sys.capacity.placer"  # the placer's guard: each of its commits ends with a marker there


def capacity_committed(chunk: Sequence[Envelope]) -> Envelope:
    """The marker a placer's commit ends with (BaseCore.cas_marker)."""
    return event(CapacityCommitted(service="placer", events=len(chunk)))


class Service:
    """One core's runtime on its own connection, as a task that can be stopped, or killed."""

    def __init__(self, url: str, core: Core[Any], instance: str = "0", ack_wait_s: float = 30.0,
                 runtime: type[ServiceRuntime[Any]] = ServiceRuntime) -> None:
        self.url, self.core, self.instance, self.ack_wait_s, self.runtime = url, core, instance, ack_wait_s, runtime
        self.rt: ServiceRuntime[Any]
        self.task: asyncio.Task[None] | None = None

    async def start(self, run: bool = True) -> Service:
        bus = await Bus.connect(self.url, name=f"{self.core.name}-{self.instance}")
        self.rt = self.runtime(self.core, bus, instance=self.instance, fetch_timeout_s=0.05,
                               ack_wait_s=self.ack_wait_s)
        await self.rt.start()
        if run:
            self.task = asyncio.create_task(self.rt.run())
        return self

    async def stop(self) -> None:
        self.rt.stop()
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)
        await self.rt.bus.close()

    async def kill(self) -> None:
        """Cancel the loop wherever it is (mid-publish, before the ack) and drop the connection."""
        assert self.task is not None
        # Python 3.11's asyncio.wait_for (under nats-py's fetch) can swallow a cancel that lands as
        # its inner future completes, and the loop runs on: cancel until it is really gone.
        for _ in range(50):
            self.task.cancel()
            await asyncio.wait([self.task], timeout=0.2)
            if self.task.done():
                break
        assert self.task.done(), "the service would not die"
        await self.rt.bus.nc.close()


async def consumer_idle(bus: Bus, durable: str) -> bool:
    info = await bus.js.consumer_info(STREAM, durable)
    return info.num_pending == 0 and info.num_ack_pending == 0


async def log_of(bus: Bus) -> list[Envelope]:
    return [env for _, env in await read_log(bus)]


def no_duplicate_ids(events: Sequence[Envelope]) -> None:
    dups = [i for i, n in Counter(e.event_id for e in events).items() if n > 1]
    assert not dups, f"event ids written twice: {dups}"


# ================================================================ (a) bad messages


async def test_bad_messages_are_dead_lettered_once_and_the_service_goes_on(bus: Bus, nats_url: str) -> None:
    globex_on_acme = submit(make_job(tenant="globex"), "sneaky", tenant="globex")
    bad = {
        "not json": ("fleet.cmd.acme.submit", b"not json {", "Invalid JSON"),
        "breaks the schema": ("fleet.cmd.acme.submit", b'{"event_id": "x", "type": "cmd.submit"}', "event_id"),
        "subject of another tenant": ("fleet.cmd.acme.submit", globex_on_acme.to_json(), "belongs on fleet.cmd.globex"),
    }
    async with running(nats_url, default_cores(2)) as rts:
        seqs = {}
        for case, (subject, data, _) in bad.items():
            seqs[case] = (await bus.js.publish(subject, data)).seq
        garbage_evt = (await bus.js.publish("fleet.evt.acme.job.x.exited", b"\xff\xfe")).seq
        good = submit_cmd(make_job("after").runs("0.2s").dict())
        await bus.publish(good)

        async def succeeded() -> bool:
            return any(e.type == "job.succeeded" and e.job_id == good.job_id for e in await log_of(bus))

        await wait_until(succeeded, timeout_s=15)
        await asyncio.sleep(0.5)  # room for redeliveries, were there any
        for rt in rts:
            assert await consumer_idle(bus, rt.durable), f"{rt.durable} still has messages in flight"

    dead = [e.payload for e in await log_of(bus) if e.type == "sys.dead_letter"]
    by_seq = Counter((d.stream_seq, d.service) for d in dead)  # type: ignore[union-attr]
    assert all(n == 1 for n in by_seq.values()), f"dead-lettered more than once: {by_seq}"
    for case, (subject, data, says) in bad.items():
        (d,) = [d for d in dead if d.stream_seq == seqs[case]]  # type: ignore[union-attr]
        assert (d.service, d.subject) == ("admission", subject), case  # type: ignore[union-attr]
        assert says in d.reason and d.reason.startswith("invalid message"), (case, d.reason)  # type: ignore[union-attr]
        assert d.data_excerpt == data[:512].decode("utf-8", "replace")  # type: ignore[union-attr]
    # an event subject many services consume: each of them says so, once
    assert {d.service for d in dead if d.stream_seq == garbage_evt} == {  # type: ignore[union-attr]
        "placer", "executor", "guardian"}
    # the message claiming another tenant did nothing for that tenant: its sender (the subject's
    # tenant, acme) is told, on its own subjects, and that is all
    about = [e for e in await log_of(bus) if e.job_id == "sneaky" and e.type != "cmd.submit"]
    assert [(e.type, e.tenant) for e in about] == [("job.rejected", "acme")]
    assert about[0].payload.reasons[0].field == "tenant"  # type: ignore[union-attr]


# ================================================================ (b) crash between publish and ack


class CrashBeforeAck(ServiceRuntime[Any]):
    """Publishes its decisions and dies before it acks them."""

    async def _commit(self, outputs: list[Envelope], handled: Sequence[Msg], cas_seq: int | None = None) -> None:
        await super()._commit(outputs, (), cas_seq)
        if outputs:
            self.stop()


class Echo(BaseCore[None]):
    """Decides two facts per submit and folds nothing: only the server's dedupe stops a copy.
    It stands in for admission (whose facts these are: shared/trust/authz.py)."""

    name = "admission"
    subjects = ("fleet.cmd.*.submit",)

    def initial_state(self) -> None:
        return None

    def evolve(self, state: None, env: Envelope) -> None:
        return None

    def decide(self, state: None, env: Envelope, ctx: Ctx) -> list[Envelope]:
        assert isinstance(env.payload, SubmitRequested)
        job_id = env.payload.job_id
        return [ctx.emit(JobAdmitted(job_id=job_id)),
                ctx.emit(JobRejected(job_id=job_id, reasons=(Reason(code="echo", message="echo"),)))]


@pytest.mark.parametrize("make_core", [AdmissionCore, Echo], ids=["folded-state", "server-dedupe"])
async def test_crash_between_publish_and_ack_writes_nothing_twice(bus: Bus, nats_url: str, make_core: Any) -> None:
    cmds = [submit(make_job(f"j{i}"), f"j{i}") for i in range(3)]
    await bus.publish_batch(cmds)
    crashed = await Service(nats_url, make_core(), ack_wait_s=1.0, runtime=CrashBeforeAck).start()
    await wait_until(lambda: crashed.rt._stop.is_set(), timeout_s=10)
    await crashed.stop()
    before = await log_of(bus)
    decided = [e for e in before if not e.type.startswith("cmd.")]
    assert len(decided) == 2 * len(cmds)  # published ...
    assert not await consumer_idle(bus, crashed.rt.durable)  # ... and never acked

    fresh = await Service(nats_url, make_core(), ack_wait_s=1.0).start()
    try:
        await wait_until(lambda: consumer_idle(bus, fresh.rt.durable), timeout_s=10)  # redelivered, handled, acked
        assert fresh.rt.stats.consumed >= len(cmds)
    finally:
        await fresh.stop()

    after = await log_of(bus)
    assert [e.event_id for e in after] == [e.event_id for e in before]  # nothing new, nothing twice
    no_duplicate_ids(after)


class CrashBeforePublish(ServiceRuntime[Any]):
    """Fetches and decides, then dies before it publishes or acks anything."""

    async def _commit(self, outputs: list[Envelope], handled: Sequence[Msg], cas_seq: int | None = None) -> None:
        self.stop()


async def test_crash_before_publish_then_newer_input_loses_nothing(bus: Bus, nats_url: str) -> None:
    # The fetched-but-unacked messages wait for redelivery *below* newer ones, which the fresh
    # runtime could get first: acking those must not ack the older ones undecided (the runtime
    # recreates its consumer at the ack floor, so they come first, in order).
    early = [submit(make_job(f"e{i}"), f"e{i}") for i in range(3)]
    await bus.publish_batch(early)
    crashed = await Service(nats_url, AdmissionCore(), ack_wait_s=1.0, runtime=CrashBeforePublish).start()
    await wait_until(lambda: crashed.rt._stop.is_set(), timeout_s=10)
    await crashed.stop()
    assert [e.type for e in await log_of(bus)] == ["cmd.submit"] * 3
    late = submit(make_job("late"), "late")
    await bus.publish(late)

    fresh = await Service(nats_url, AdmissionCore(), ack_wait_s=1.0).start()
    try:
        async def all_admitted() -> bool:
            return len([e for e in await log_of(bus) if e.type == "job.admitted"]) == 4

        await wait_until(all_admitted, timeout_s=10)
    finally:
        await fresh.stop()
    log = await log_of(bus)
    no_duplicate_ids(log)
    assert sorted(e.job_id for e in log if e.type == "job.admitted") == ["e0", "e1", "e2", "late"]  # type: ignore[type-var]


# ================================================================ (c) a service killed mid-flight


def _cores() -> dict[str, Core[Any]]:
    return {c.name: c for c in default_cores(4)}  # 4 x H100x8


@pytest.mark.parametrize("victim", ["admission", "quota", "placer", "executor", "guardian"])
async def test_service_killed_mid_flight_loses_no_job(bus: Bus, nats_url: str, victim: str) -> None:
    cores = _cores()
    services = {name: await Service(nats_url, core, ack_wait_s=1.0).start() for name, core in cores.items()}
    jobs = [submit_cmd(make_job(f"j{i}").gpus(4).runs("0.3s").dict()) for i in range(16)]  # 2 waves on 32 GPUs

    async def submit_all() -> None:
        for cmd in jobs:
            await bus.publish(cmd)
            await asyncio.sleep(0.02)

    submitting = asyncio.create_task(submit_all())
    try:
        await asyncio.sleep(0.15)  # jobs in every stage
        await services[victim].kill()

        async def work_waits() -> bool:  # (on a loaded machine the others take longer to give it some)
            missed = await bus.js.consumer_info(STREAM, services[victim].rt.durable)
            return bool(missed.num_pending + missed.num_ack_pending > 0)

        await wait_until(work_waits, timeout_s=15)  # killed mid-flight: work waits for it
        again = ExecutorCore(sim_fleet(4)) if victim == "executor" else type(cores[victim])()
        services[victim] = await Service(nats_url, again, ack_wait_s=1.0).start()
        await submitting

        async def all_ended() -> bool:
            log = await log_of(bus)
            return len({e.job_id for e in log if e.type in TERMINAL_JOB_TYPES}) == len(jobs)

        await wait_until(all_ended, timeout_s=30)
        await asyncio.sleep(1.5)  # past the ack wait: a late redelivery would show now
    finally:
        submitting.cancel()
        for s in services.values():
            await s.stop()

    log = await log_of(bus)
    no_duplicate_ids(log)
    for cmd in jobs:
        mine = [e.type for e in log if e.job_id == cmd.job_id]
        assert [t for t in mine if t in TERMINAL_JOB_TYPES] == ["job.succeeded"], (cmd.job_id, mine)
        for once in ("job.submitted", "job.admitted", "job.quota_reserved", "job.placed", "job.started", "job.exited"):
            assert mine.count(once) == 1, (cmd.job_id, once, mine)


# ================================================================ (d) two placers racing


def _check_no_gpu_taken_twice(log: Sequence[Envelope], gpus_per_node: int) -> dict[str, int]:
    """No job placed twice and no (node, GPU) held by two jobs (nothing exits in these tests)."""
    placements = Counter(e.job_id for e in log if e.type == "job.placed")
    assert all(n == 1 for n in placements.values()), f"placed twice: {placements}"
    held: dict[tuple[str, int], str] = {}
    per_node: Counter[str] = Counter()
    for e in log:
        if e.type != "job.placed":
            continue
        for a in e.payload.allocations:  # type: ignore[union-attr]
            for g in a.gpu_indices:
                assert (a.node_id, g) not in held, f"{a.node_id} GPU {g}: {held[(a.node_id, g)]} and {e.job_id}"
                held[(a.node_id, g)] = e.job_id  # type: ignore[assignment]
            per_node[a.node_id] += len(a.gpu_indices)
    assert all(n <= gpus_per_node for n in per_node.values())
    # and the placer's own fold of the log agrees: nothing over-committed
    core = PlacerCore()
    state = core.initial_state()
    for e in log:
        state = core.evolve(state, e)
    assert all(0 <= len(n.free_gpus) <= n.gpus_total for n in state.nodes.values())
    return dict(per_node)


def _small_cluster_and_jobs(n_jobs: int) -> tuple[list[Envelope], list[Envelope]]:
    nodes = [node("n1"), node("n2")]
    job = make_job().gpus(4)
    jobs = [e for i in range(n_jobs) for e in (submitted(job, f"j{i}"), quota_reserved(job, f"j{i}"))]
    return nodes, jobs


async def _race(bus: Bus, nats_url: str, nodes: list[Envelope], jobs: list[Envelope]) -> tuple[Any, Any]:
    """Two placers see the same burst of jobs at once; run until both have settled."""
    await bus.publish_batch(nodes)
    a = await Service(nats_url, PlacerCore(), instance="a").start()
    b = await Service(nats_url, PlacerCore(), instance="b").start()
    try:
        await bus.publish_batch(jobs)
        last = await bus.last_seq()

        async def settled() -> bool:
            return (a.rt.applied_seq >= last and b.rt.applied_seq >= last
                    and await consumer_idle(bus, a.rt.durable) and await consumer_idle(bus, b.rt.durable))

        await wait_until(settled, timeout_s=10)
        await asyncio.sleep(0.3)
        await wait_until(settled, timeout_s=10)
    finally:
        await a.stop()
        await b.stop()
    return a, b


async def test_two_placers_never_allocate_a_gpu_twice(bus: Bus, nats_url: str) -> None:
    nodes, jobs = _small_cluster_and_jobs(10)  # 40 GPUs asked of 16
    a, b = await _race(bus, nats_url, nodes, jobs)

    log = await log_of(bus)
    per_node = _check_no_gpu_taken_twice(log, gpus_per_node=8)
    assert per_node == {"n1": 8, "n2": 8}  # together they still fill the cluster
    assert sum(1 for e in log if e.type == "job.placed") == 4
    conflicts = a.rt.stats.cas_conflicts + b.rt.stats.cas_conflicts
    assert conflicts >= 1, "the race never happened"
    loser = a if a.rt.stats.cas_conflicts else b
    assert loser.rt.stats.refolds >= 1 + loser.rt.stats.cas_conflicts  # start, then once per lost CAS
    # a lost CAS rolls back to the last committed point and folds only what came since
    assert loser.rt.last_fold.from_seq > 0
    assert loser.rt.last_fold.events < loser.rt.last_fold.to_seq
    # ... and what it rolled forward to is exactly the state a fresh fold of the whole log gives
    from gpufleet.shared.runtime.engine import fold_log

    fresh, _ = await fold_log(bus, PlacerCore(), snapshots=False)
    assert loser.rt.applied_seq == fresh.seq and loser.rt.state == fresh.state


async def test_two_placers_racing_on_gangs_place_each_whole_or_not_at_all(bus: Bus, nats_url: str) -> None:
    nodes = [node(f"n{i}") for i in range(4)]  # 32 GPUs
    gang = make_job().gpus(8).replicas(2)
    jobs = [e for i in range(5) for e in (submitted(gang, f"g{i}"), quota_reserved(gang, f"g{i}"))]  # 80 asked
    a, b = await _race(bus, nats_url, nodes, jobs)

    log = await log_of(bus)
    per_node = _check_no_gpu_taken_twice(log, gpus_per_node=8)
    gangs = [e for e in log if e.type == "job.placed"]
    assert len(gangs) == 2 and all(len(e.payload.allocations) == 2 for e in gangs)  # type: ignore[union-attr]
    assert sorted(per_node.values()) == [8, 8, 8, 8]
    assert a.rt.stats.cas_conflicts + b.rt.stats.cas_conflicts >= 1, "the race never happened"


async def test_rival_placement_later_in_the_same_batch_fails_the_cas(bus: Bus, nats_url: str) -> None:
    # The placer fetches, in ONE batch, reservations and then a rival's placements of the same
    # jobs. It decides on the reservations before it reaches the rival's writes, so its
    # guard must be what it saw then; otherwise the CAS passes and every job is placed twice.
    nodes, jobs = _small_cluster_and_jobs(4)
    me = await Service(nats_url, PlacerCore(), instance="me").start(run=False)
    try:
        await bus.publish_batch(nodes + jobs)
        rival = [placed(f"j{i}", (f"n{1 + i // 2}", range(4 * (i % 2), 4 * (i % 2) + 4))) for i in range(4)]
        await bus.publish_batch(rival, cas=Cas(MARK, 0), mark=capacity_committed)  # as a placer commits
        assert await me.rt.step() == len(nodes + jobs + rival) + 1  # and the rival's marker
    finally:
        await me.stop()

    log = await log_of(bus)
    _check_no_gpu_taken_twice(log, gpus_per_node=8)
    assert [e.event_id for e in log if e.type == "job.placed"] == [e.event_id for e in rival]
    assert me.rt.stats.cas_conflicts == 1


@pytest.mark.slow  # (three nats-servers)
async def test_a_rival_placement_under_the_same_id_but_elsewhere_is_the_one_the_placer_goes_on_from(
        nats_cluster_url: str) -> None:
    # Two placers decide the same reservation: same cause, same derived id. When the rival's
    # version is in the log first, the server keeps it and answers this placer's copy as a
    # duplicate, with the rival's sequence. Its state holds its own version (other GPUs): going
    # on from it, the next job would go where the log says the first one runs (seen in bench
    # chaos: GPU 0 of a node at 2000 milli-GPU), and the guard, moved to the copy's sequence,
    # would let it through. The log's version must win.
    from gpufleet.shared.contract.ids import derive_id

    bus = await Bus.connect(nats_cluster_url, name="test")
    await bus.ensure_streams()
    me = await Service(nats_cluster_url, PlacerCore(), instance="me").start(run=False)
    try:
        job = make_job().gpus(4)
        reservation = quota_reserved(job, "x")
        rival = placed("x", ("n1", range(4, 8)))
        rival = rival.model_copy(update={"event_id": derive_id(reservation.event_id, "placed:x"),
                                         "causation_id": reservation.event_id})
        await bus.publish_batch([node("n1"), submitted(job, "x"), reservation])
        await bus.publish(rival)  # the rival decided first, on GPUs 4-7
        while me.rt.applied_seq < await bus.last_seq():
            await me.rt.step()
        await bus.publish_batch([submitted(job, "y"), quota_reserved(job, "y")])
        while me.rt.applied_seq < await bus.last_seq():
            await me.rt.step()
        log = await log_of(bus)
    finally:
        await me.stop()
        await bus.close()
    _check_no_gpu_taken_twice(log, gpus_per_node=8)
    [x] = [e.payload for e in log if e.type == "job.placed" and e.job_id == "x"]
    [y] = [e.payload for e in log if e.type == "job.placed" and e.job_id == "y"]
    assert x.allocations[0].gpu_indices == (4, 5, 6, 7) and y.allocations[0].gpu_indices == (0, 1, 2, 3)


# ================================================================ (e) publish_batch with a stale CAS


@pytest.mark.parametrize("n", [1, 3])
async def test_stale_cas_raises_and_writes_nothing(bus: Bus, n: int) -> None:
    first = placed("j0", ("n1", [0]))
    (seq0,) = await bus.publish_batch([first], cas=Cas(PLACED, 0))
    late = [placed(f"j{i}", ("n1", [i])) for i in range(1, n + 1)]
    before = await bus.last_seq()

    with pytest.raises(CasConflict):
        await bus.publish_batch(late, cas=Cas(PLACED, 0))  # stale: j0 was placed since

    assert await bus.last_seq() == before
    # the rejected ids were not remembered as written: with the right guard they go in
    seqs = await bus.publish_batch(late, cas=Cas(PLACED, seq0))
    assert seqs == list(range(before + 1, before + n + 1))
    assert [e.event_id for e in await log_of(bus)] == [first.event_id] + [e.event_id for e in late]


async def test_cas_guards_only_its_subject(bus: Bus) -> None:
    (seq0,) = await bus.publish_batch([placed("j0", ("n1", [0]))], cas=Cas(PLACED, 0))
    await bus.publish(event(JobAdmitted(job_id="other")))  # not a placement: the guard still holds

    seqs = await bus.publish_batch([placed("j1", ("n1", [1])), event(JobAdmitted(job_id="x"))], cas=Cas(PLACED, seq0))

    assert len(seqs) == 2 and seqs[1] == seqs[0] + 1


async def test_republished_batch_is_dropped_as_duplicates(bus: Bus) -> None:
    batch = [placed(f"j{i}", ("n1", [i])) for i in range(3)]
    seqs = await bus.publish_batch(batch)
    t0 = time.monotonic()

    again = await bus.publish_batch(batch)

    assert again == seqs and time.monotonic() - t0 < 5
    assert len(await log_of(bus)) == 3


async def test_a_batch_with_a_copy_held_before_keeps_a_guard_on_another_subject(bus: Bus) -> None:
    # The executor's shape: outputs (starts, exits) under a guard on another subject (the nodes'
    # losses). A batch holding one event written before goes one by one; the guard must go with
    # every event, or a start is written after its node was lost.
    admitted = "fleet.evt.*.job.*.admitted"
    (seq0,) = await bus.publish_batch([event(JobAdmitted(job_id="a"))], cas=Cas(admitted, 0))
    old = placed("j0", ("n1", [0]))
    await bus.publish(old)
    await bus.publish(event(JobAdmitted(job_id="b")))  # what the decision below never saw
    new = placed("j1", ("n1", [1]))

    with pytest.raises(CasConflict):
        await bus.publish_batch([old, new], cas=Cas(admitted, seq0))

    assert new.event_id not in [e.event_id for e in await log_of(bus)]


async def test_a_marked_batch_holding_a_copy_held_before_is_refused_whole(bus: Bus) -> None:
    # The placer's shape: its placements do not move its guard, the marker at the end of the
    # batch does. One by one (what a batch holding a duplicate fell back to), the placements
    # would be written under a guard nothing moves until the marker: a rival placer committing
    # between them, on a view without them, books the same GPUs (seen in the chaos test's audit,
    # gpu_capacity). Such a batch must be refused whole, so the placer reads the log again.
    held = placed("j0", ("n1", [0]))
    await bus.publish(held)  # (a rival's copy of the same decision, or this writer's own unacked one)
    new = placed("j1", ("n1", [1]))
    rival = [placed("r", ("n1", [1]))]
    real_publish = bus.publish

    async def rival_between(env: Envelope, *args: object, **kwargs: object) -> int:
        seq = await real_publish(env, *args, **kwargs)  # type: ignore[arg-type]
        if env.event_id == new.event_id:  # a rival commits between this writer's events
            await Bus.publish_batch(bus, rival, cas=Cas(MARK, 0), mark=capacity_committed)
        return seq

    bus.publish = rival_between  # type: ignore[method-assign]
    try:
        with pytest.raises(CasConflict):
            await bus.publish_batch([new, held], cas=Cas(MARK, 0), mark=capacity_committed)
    finally:
        bus.publish = real_publish  # type: ignore[method-assign]

    log = await log_of(bus)
    _check_no_gpu_taken_twice(log, gpus_per_node=8)
    assert [e.event_id for e in log] == [held.event_id]  # nothing of this commit went out


@pytest.mark.slow  # (three nats-servers)
async def test_a_copy_held_past_the_guard_stops_the_rest_of_the_decision(nats_cluster_url: str) -> None:
    # Seen in the 10,000-job bench chaos (GPU 1 of a node at 2000 milli-GPU): two placers decide
    # the same causes under the same derived ids. The loser's batch holds a copy of the rival's
    # latest placement, so it goes one by one; a cluster answers that copy as a duplicate before
    # it checks the guard, with the rival's sequence. A guard moved there lets the loser's next
    # placement through, decided without the rival's placements before it: that one must not be
    # written.
    bus = await Bus.connect(nats_cluster_url, name="test")
    await bus.ensure_streams()
    try:
        (seen,) = await bus.publish_batch([placed("j0", ("n1", [0]))], cas=Cas(PLACED, 0))
        unseen = placed("j1", ("n1", [1]))  # the rival's: this decision never folded it
        held = placed("j2", ("n1", [2]))    # the rival's too, and this decision's copy of it
        await bus.publish_batch([unseen, held], cas=Cas(PLACED, seen))
        mine = placed("j3", ("n1", [1]))    # where the rival put j1

        with pytest.raises(CasConflict):
            await bus.publish_batch([held, mine], cas=Cas(PLACED, seen))

        log = await log_of(bus)
    finally:
        await bus.close()
    assert mine.event_id not in [e.event_id for e in log]
    _check_no_gpu_taken_twice(log, gpus_per_node=8)


# ================================================================ a publish that wrote only part of a decision


async def test_decision_written_only_in_part_is_completed_on_redelivery(bus: Bus, nats_url: str) -> None:
    # Non-atomic publishing (or a connection lost mid-batch) can write the first outputs of a
    # decision and not the rest; the redelivered input must complete it, not be taken as done.
    svc = Service(nats_url, AdmissionCore(), ack_wait_s=1.0)
    await svc.start(run=False)
    real_many, real_batch = svc.rt.bus.publish_many, svc.rt.bus.publish_batch
    failures = []

    async def first_only(envs: Sequence[Envelope], *args: Any, **kw: Any) -> list[int]:
        if not failures and len(envs) > 1:
            failures.append(envs)
            await real_batch(envs[:1])
            raise RetryableError("connection lost mid-batch")
        return await (real_batch(envs, *args, **kw) if args or kw else real_many(envs))

    svc.rt.bus.publish_many = first_only  # type: ignore[method-assign]
    svc.rt.bus.publish_batch = first_only  # type: ignore[method-assign]
    svc.task = asyncio.create_task(svc.rt.run())
    cmd = submit(make_job(), "j1")
    try:
        await bus.publish(cmd)

        async def admitted_once() -> bool:
            return [e.type for e in await log_of(bus) if e.job_id == "j1"] == [
                "cmd.submit", "job.submitted", "job.admitted"]

        await wait_until(admitted_once, timeout_s=10)
    finally:
        await svc.stop()
    assert failures, "the partial write never happened"
