"""Billing through the mesh (real nats-server, real PostgreSQL, sim executor): the bill across a
preemption and a resume, the estimate against the bill, the ledger against the fold (PostgreSQL
stopped mid-run, a replay, duplicated deliveries, PostgreSQL back without its rows, an event the
fold fails on), and the budget hold."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from decimal import Decimal
from typing import Any

import asyncpg
import pytest

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.billing import report
from gpufleet.services.billing.core import BillingCore
from gpufleet.services.billing.ledger import Ledger
from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.guardian.core import GuardianCore
from gpufleet.services.placer.core import PlacerCore
from gpufleet.services.quota.core import QuotaCore
from gpufleet.shared.contract.clusterconfig import ClusterConfig, parse_config
from gpufleet.shared.contract.events import STREAM, Envelope, JobExited, JobStarted, JobSucceeded
from gpufleet.shared.contract.spec import parse_spec
from gpufleet.shared.embedded.pg import EmbeddedPostgres
from gpufleet.shared.node.cluster import sim_fleet
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.loop import ServiceRuntime

from .builders import T0, event, make_job, node, placed, started, submitted
from .helpers import job_status, read_log, running, service_creds, submit_cmd, wait_until

PRICES = {"currency": "USD", "gpuHour": {"H100": "36", "*": "18"}, "cpuCoreHour": "0.36", "memoryGiBHour": "0.036"}
TICK_SLACK_S = Decimal("0.6")  # the sim executor ends jobs on a 0.2 s tick, and a batch takes its time


def cores(config: ClusterConfig) -> list[Any]:
    return [AdmissionCore(config), QuotaCore(config), PlacerCore(config), ExecutorCore(sim_fleet(4)),
            GuardianCore(config), BillingCore(config)]


async def fold_charges(bus: Bus, config: ClusterConfig) -> list[Any]:
    core = BillingCore(config, keep_charges=True)
    [state] = await report.fold(bus, [core])
    assert not state.open
    return list(state.charges)


async def ledger_lines(dsn: str) -> set[tuple[str, str, Decimal, Decimal]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT interval_key, resource, seconds, cost FROM billing_charges")
    finally:
        await conn.close()
    return {(r["interval_key"], r["resource"], r["seconds"], r["cost"]) for r in rows}


def fold_lines(charges: list[Any]) -> set[tuple[str, str, Decimal, Decimal]]:
    return {(c.key, line.resource, line.seconds, line.cost) for c in charges for line in c.lines}


async def run_ledger(bus: Bus, dsn: str, config: ClusterConfig) -> tuple[Ledger, asyncio.Task[None]]:
    ledger = Ledger(bus, dsn, config, fetch_timeout_s=0.1, max_backoff_s=0.5)
    await ledger.start()
    return ledger, asyncio.create_task(ledger.run())


async def caught_up(ledger: Ledger, bus: Bus) -> bool:
    return ledger.stored is not None and ledger.stored >= await bus.last_seq() and not ledger.pending


@pytest.mark.slow
async def test_bill_across_preemption_and_resume_and_the_ledger_through_an_outage(
        bus: Bus, nats_url: str, pg: EmbeddedPostgres) -> None:
    config = parse_config({"queues": {"research": {"nominal": {"gpu": 1}}}, "prices": PRICES})
    low = submit_cmd({"name": "low", "tenant": "acme", "type": "training", "queue": "research", "priority": 0,
                      "resources": {"gpu": 1, "gpuModel": "H100", "cpu": 2, "memory": "4Gi"},
                      "sim": {"duration": "2s"}})
    high_spec = {"name": "high", "tenant": "acme", "type": "batch", "queue": "research", "priority": 10,
                 "resources": {"gpu": 1, "gpuModel": "H100", "cpu": 1, "memory": "2Gi"},
                 "maxRuntime": "2s", "sim": {"duration": "2s"}}
    high = submit_cmd(high_spec)
    ledger, ledger_task = await run_ledger(bus, pg.dsn, config)
    try:
        async with running(nats_url, cores(config)):
            await bus.publish(low)
            await wait_until(lambda: job_status(bus, low.job_id or ""), timeout_s=20)

            async def low_runs() -> bool:
                return any(e.type == "job.started" and e.job_id == low.job_id for _, e in await read_log(bus))
            await wait_until(low_runs, timeout_s=20)
            pg.stop()  # PostgreSQL goes away mid-run: the ledger holds what closes meanwhile
            await bus.publish(high)

            async def both_done() -> bool:
                return (await job_status(bus, high.job_id or "") == "succeeded"
                        and await job_status(bus, low.job_id or "") == "succeeded")
            await wait_until(both_done, timeout_s=40)
            assert ledger.pending and ledger.stats.pg_failures > 0
            pg.start()
            await wait_until(lambda: caught_up(ledger, bus), timeout_s=20)
        log = await read_log(bus)
    finally:
        ledger.stop()
        await ledger_task

    # 1. the bill: each interval is its allocation time x price, from the log's own timestamps
    starts = {(e.job_id, e.payload.attempt): e.occurred_at for _, e in log if isinstance(e.payload, JobStarted)}
    ends = {(e.job_id, e.payload.attempt): e.occurred_at for _, e in log if isinstance(e.payload, JobExited)}
    exits = [e.payload.reason for _, e in log if isinstance(e.payload, JobExited) and e.job_id == low.job_id]
    assert exits == ["preempted", "completed"]  # it ran twice
    charges = await fold_charges(bus, config)
    low_charges = sorted((c for c in charges if c.job_id == low.job_id), key=lambda c: c.attempt)
    assert [c.key.rsplit(":", 1)[1] for c in low_charges] == ["1", "2"]
    rates = {"gpu/H100": Decimal("36"), "cpu": 2 * Decimal("0.36"), "memory": 4 * Decimal("0.036")}  # per hour
    for c in low_charges:
        seconds = Decimal(str((ends[(low.job_id, c.attempt)] - starts[(low.job_id, c.attempt)]).total_seconds()))
        # each line is rounded once, to the micro-dollar
        assert {line.resource: line.cost for line in c.lines} == {
            r: (rate * seconds / 3600).quantize(Decimal("0.000001")) for r, rate in rates.items()}
    doc = report.bill_json(report.bill(charges, "job"), "job", "USD")
    billed = {r["key"]: Decimal(r["cost"]) for r in doc["rows"]}
    assert billed[low.job_id] == sum(c.cost for c in low_charges)

    # 2. the estimate of the job that ran its max runtime is its bill (up to the sim's tick)
    est = Decimal(report.estimate(parse_spec(high_spec), config)["cost"])
    high_per_hour = Decimal("36") + Decimal("0.36") + 2 * Decimal("0.036")
    assert est == Decimal("0.02") + Decimal("0.0002") + Decimal("0.00004")  # 2 s of each line
    assert abs(billed[high.job_id] - est) <= high_per_hour * TICK_SLACK_S / 3600

    # 3. the ledger, written through the outage, is the fold: every line once
    assert await ledger_lines(pg.dsn) == fold_lines(charges)
    assert ledger.stats.written == len(fold_lines(charges))

    # 4. a replay (a new ledger folds the whole log again) and duplicated deliveries change nothing
    for _, env in log:
        if env.type in ("job.started", "job.exited", "job.placed"):
            # the same envelope stored again under another message id: a true duplicate in the log
            await bus.js.publish(env.subject(), env.to_json(), headers={"Nats-Msg-Id": f"dup-{env.event_id}"})
    assert len(await fold_charges(bus, config)) == len(charges)
    again, task = await run_ledger(bus, pg.dsn, config)
    try:
        await wait_until(lambda: caught_up(again, bus), timeout_s=20)
    finally:
        again.stop()
        await task
    assert again.stats.charges == len(charges) and again.stats.written == 0
    assert await ledger_lines(pg.dsn) == fold_lines(charges)


async def test_a_hold_budget_rejects_submits_once_exceeded(bus: Bus, nats_url: str) -> None:
    config = parse_config({"prices": PRICES,
                           "budgets": {"tenants": {"acme": {"amount": "0.01", "policy": "hold"}}}})
    spec = {"name": "spend", "tenant": "acme", "resources": {"gpu": 1, "gpuModel": "H100"}, "sim": {"duration": "1s"}}
    first, second = submit_cmd(spec), submit_cmd(spec)
    other = submit_cmd({**spec, "tenant": "zeta"})
    async with running(nats_url, cores(config)):
        await bus.publish(first)
        await wait_until(lambda: job_status(bus, first.job_id or ""), timeout_s=10)  # 36/h for ~1 s: 0.01

        async def exceeded() -> bool:
            return any(e.type == "budget.exceeded" for _, e in await read_log(bus))
        await wait_until(exceeded, timeout_s=30)
        await bus.publish(second)
        await bus.publish(other)
        await wait_until(lambda: job_status(bus, second.job_id or ""), timeout_s=10)
        await wait_until(lambda: job_status(bus, other.job_id or ""), timeout_s=10)
    log = await read_log(bus)
    [rejected] = [e for _, e in log if e.type == "job.rejected" and e.job_id == second.job_id]
    assert [(r.code, r.field) for r in rejected.payload.reasons] == [("budget_exceeded", "tenant")]  # type: ignore[union-attr]
    assert await job_status(bus, other.job_id or "") != "rejected"
    [fact] = [e for _, e in log if e.type == "budget.exceeded"]
    assert fact.subject() == "fleet.evt.sys.budget.tenant.acme.exceeded" and fact.payload.spent >= Decimal("0.01")  # type: ignore[union-attr]


# ---------------------------------------------------------------- the ledger when PostgreSQL loses its rows


def job_events(job_id: str, gpu: int, at: timedelta) -> list[Envelope]:
    """A job that runs one hour on GPU `gpu` of n1 and succeeds (a log the audit accepts)."""
    return [submitted(make_job(), job_id), placed(job_id, ("n1", [gpu]), at=T0 + at),
            started(job_id, "n1", at=T0 + at),
            event(JobExited(job_id=job_id, node_id="n1", exit_code=0), at=T0 + at + timedelta(hours=1)),
            event(JobSucceeded(job_id=job_id), at=T0 + at + timedelta(hours=1))]


async def publish(bus: Bus, envs: list[Envelope]) -> int:
    seq = 0
    for env in envs:
        seq = await bus.publish(env)
    return seq


async def ledger_is_the_fold(ledger: Ledger, bus: Bus, dsn: str, config: ClusterConfig) -> bool:
    return await caught_up(ledger, bus) and await ledger_lines(dsn) == fold_lines(await fold_charges(bus, config))


async def test_the_ledger_writes_again_what_postgresql_lost_while_it_runs(bus: Bus, pg: EmbeddedPostgres) -> None:
    # review8 b2: PostgreSQL back without the ledger's rows (tables dropped, an older backup, a new
    # data dir): the ledger wrote only what closed after and stored its offset as current
    config = parse_config({"prices": PRICES})
    ledger = Ledger(bus, pg.dsn, config, fetch_timeout_s=0.1, min_backoff_s=0.05, max_backoff_s=0.2, check_s=0.2)
    await ledger.start()
    task = asyncio.create_task(ledger.run())
    conn = await asyncpg.connect(pg.dsn)
    try:
        await publish(bus, [node("n1"), *job_events("a", 0, timedelta(0))])
        await wait_until(lambda: ledger_is_the_fold(ledger, bus, pg.dsn, config), timeout_s=20)
        assert {k for k, *_ in await ledger_lines(pg.dsn)} == {"a:0:1"}

        # 1. the tables dropped while it runs, idle: it sees it, folds again, writes a's rows again
        await conn.execute("DROP TABLE billing_charges, billing_offsets")
        await wait_until(lambda: ledger.stats.refolds == 1, timeout_s=20)
        await wait_until(lambda: ledger_is_the_fold(ledger, bus, pg.dsn, config), timeout_s=20)
        await publish(bus, job_events("b", 1, timedelta(hours=1)))
        await wait_until(lambda: ledger_is_the_fold(ledger, bus, pg.dsn, config), timeout_s=20)
        assert {k for k, *_ in await ledger_lines(pg.dsn)} == {"a:0:1", "b:0:1"}

        # 2. emptied (a new data dir) and more jobs at once: the next write sees the offset behind it
        c_at = await publish(bus, job_events("c", 2, timedelta(hours=2)))
        await wait_until(lambda: caught_up(ledger, bus), timeout_s=20)
        await conn.execute("TRUNCATE billing_charges, billing_offsets")
        await publish(bus, job_events("d", 3, timedelta(hours=3)))
        await wait_until(lambda: ledger_is_the_fold(ledger, bus, pg.dsn, config), timeout_s=20)
        assert ledger.stats.refolds == 2

        # 3. an older backup: the rows and the offset as they were after c
        await conn.execute("DELETE FROM billing_charges WHERE seq > $1", c_at)
        await conn.execute("UPDATE billing_offsets SET seq = $1", c_at)
        await wait_until(lambda: ledger.stats.refolds == 3, timeout_s=20)
        await wait_until(lambda: ledger_is_the_fold(ledger, bus, pg.dsn, config), timeout_s=20)
        assert {k for k, *_ in await ledger_lines(pg.dsn)} == {"a:0:1", "b:0:1", "c:0:1", "d:0:1"}
        assert ledger.stats.skipped == 0
    finally:
        await conn.close()
        ledger.stop()
        await task


async def test_the_ledger_beside_billing_folds_its_delivery_once_caught_up(
        bus: Bus, nats_url: str, pg: EmbeddedPostgres) -> None:
    """Beside the billing runtime the ledger reads on its own only until it reaches what the runtime
    is delivered, then folds that delivery (each event received once in the process): the rows stay
    the fold of the log through the switch, a refold (PostgreSQL back without its rows) and back."""
    config = parse_config({"prices": PRICES})
    await publish(bus, [node("n1"), *job_events("a", 0, timedelta(0))])  # before it starts: read on its own
    core_bus = await Bus.connect(nats_url, name="billing", creds=service_creds("billing"))
    rt: ServiceRuntime[Any] = ServiceRuntime(BillingCore(config), core_bus, fetch_timeout_s=0.05)
    ledger = Ledger(core_bus, pg.dsn, config, fetch_timeout_s=0.1, min_backoff_s=0.05, max_backoff_s=0.2,
                    check_s=0.2)
    rt.taps.append(ledger.attach(rt.filter_subject))
    with pytest.raises(ValueError, match="misses"):
        ledger.attach("fleet.cmd.>")  # a tap that does not deliver what the ledger folds
    await rt.start()
    await ledger.start()
    tasks = [asyncio.create_task(rt.run()), asyncio.create_task(ledger.run())]
    conn = await asyncpg.connect(pg.dsn)

    async def is_fold() -> bool:
        return await ledger_is_the_fold(ledger, bus, pg.dsn, config)

    async def own_consumer() -> bool:
        return any(c.name.startswith(ledger.name) for c in await bus.js.consumers_info(STREAM))

    try:
        await wait_until(is_fold, timeout_s=20)
        await publish(bus, job_events("b", 1, timedelta(hours=1)))
        await wait_until(lambda: ledger.tapping, timeout_s=20)
        assert ledger.stats.switches == 1
        await wait_until(is_fold, timeout_s=20)
        assert not await own_consumer()  # its reader is gone: one delivery for the runtime and the ledger
        tapped = ledger.stats.tapped
        await publish(bus, job_events("c", 2, timedelta(hours=2)))
        await wait_until(is_fold, timeout_s=20)
        assert ledger.stats.tapped >= tapped + 5  # c's five events came through the tap

        # PostgreSQL back without its rows: it folds from the start on its own, then takes the tap again
        await conn.execute("DROP TABLE billing_charges, billing_offsets")
        await wait_until(lambda: ledger.stats.refolds == 1, timeout_s=20)
        await publish(bus, job_events("d", 3, timedelta(hours=3)))
        await wait_until(is_fold, timeout_s=20)
        await wait_until(lambda: ledger.tapping and ledger.stats.switches == 2, timeout_s=20)
        assert {k for k, *_ in await ledger_lines(pg.dsn)} == {"a:0:1", "b:0:1", "c:0:1", "d:0:1"}
        assert ledger.stats.skipped == 0
    finally:
        await conn.close()
        rt.stop()
        ledger.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        await core_bus.close()


async def test_a_tapped_ledger_reads_on_its_own_again_when_postgresql_holds_too_much_back(
        bus: Bus, nats_url: str, pg: EmbeddedPostgres) -> None:
    """PostgreSQL down while the ledger folds the runtime's delivery: past `max_pending` held charges
    it stops folding the tap (the runtime goes on deciding), and once PostgreSQL is back it reads on
    its own from where it stopped and takes the tap again: every charge once."""
    config = parse_config({"prices": PRICES})
    core_bus = await Bus.connect(nats_url, name="billing", creds=service_creds("billing"))
    rt: ServiceRuntime[Any] = ServiceRuntime(BillingCore(config), core_bus, fetch_timeout_s=0.05)
    ledger = Ledger(core_bus, pg.dsn, config, fetch_timeout_s=0.1, min_backoff_s=0.05, max_backoff_s=0.2,
                    check_s=0.2, max_pending=2)
    rt.taps.append(ledger.attach(rt.filter_subject))
    await rt.start()
    await ledger.start()
    tasks = [asyncio.create_task(rt.run()), asyncio.create_task(ledger.run())]

    async def is_fold() -> bool:
        return await ledger_is_the_fold(ledger, bus, pg.dsn, config)

    try:
        await publish(bus, [node("n1"), *job_events("a", 0, timedelta(0))])
        await wait_until(lambda: ledger.tapping, timeout_s=20)
        await wait_until(is_fold, timeout_s=20)
        pg.stop()
        last = 0
        for i, job in enumerate(("b", "c", "d", "e")):
            last = await publish(bus, job_events(job, i + 1, timedelta(hours=i + 1)))
        await wait_until(lambda: rt.applied_seq >= last, timeout_s=20)  # the runtime went on
        await wait_until(lambda: not ledger.tapping, timeout_s=20)
        assert len(ledger.pending) >= 2
        pg.start()
        await wait_until(is_fold, timeout_s=30)
        assert {k for k, *_ in await ledger_lines(pg.dsn)} == {f"{j}:0:1" for j in "abcde"}
        await publish(bus, job_events("f", 5, timedelta(hours=5)))
        await wait_until(lambda: ledger.tapping and ledger.stats.switches == 2, timeout_s=20)
        await wait_until(is_fold, timeout_s=20)
        assert ledger.stats.written == 6 * 3 and ledger.stats.skipped == 0  # three lines a job, each once
    finally:
        rt.stop()
        ledger.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        await core_bus.close()


class FailsOn(BillingCore):
    """The billing core, failing on one job's start (a bug in the fold, as the ledger and the bill meet it)."""

    def __init__(self, config: ClusterConfig, job_id: str) -> None:
        super().__init__(config, keep_charges=True)
        self.job_id = job_id

    def evolve(self, state: Any, env: Envelope) -> Any:
        if env.job_id == self.job_id and env.type == "job.started":
            raise RuntimeError(f"cannot fold {env.type} of {self.job_id}")
        return super().evolve(state, env)


async def test_an_event_the_core_fails_on_is_skipped_alone_by_the_ledger_and_the_bill(
        bus: Bus, pg: EmbeddedPostgres, caplog: pytest.LogCaptureFixture) -> None:
    config = parse_config({"prices": PRICES})
    # all in one batch of the ledger: the jobs after the bad one are folded all the same
    await publish(bus, [node("n1"), *job_events("x", 0, timedelta(0)), *job_events("bad", 1, timedelta(0)),
                        *job_events("y", 2, timedelta(0))])
    ledger = Ledger(bus, pg.dsn, config, fetch_timeout_s=0.1)
    ledger.core = FailsOn(config, "bad")
    await ledger.start()
    task = asyncio.create_task(ledger.run())
    try:
        await wait_until(lambda: caught_up(ledger, bus), timeout_s=20)
    finally:
        ledger.stop()
        await task
    assert ledger.stats.skipped == 1
    assert {k for k, *_ in await ledger_lines(pg.dsn)} == {"x:0:1", "y:0:1"}

    skipped: list[report.Skipped] = []
    with caplog.at_level(logging.WARNING, logger=report.log.name):
        [state] = await report.fold(bus, [FailsOn(config, "bad")], skipped=skipped)
    assert [(s.core, s.event_type) for s in skipped] == [("billing", "job.started")]
    assert "skipped 1 event(s)" in caplog.text
    assert fold_lines(state.charges) == await ledger_lines(pg.dsn)
