"""Two instances of a service that decides on its own clock (shared/runtime/lease.py): the one holding
the lease decides through the service's shared durable consumer, the other waits; when the
holder dies the standby takes over within one TTL and goes on from the ack floor: every command
answered, none twice."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.shared.runtime import lease as lease_module
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.service import run_core

from .builders import make_job
from .helpers import read_log, submit_cmd, wait_until


@pytest.fixture
def short_lease(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(lease_module, "TTL_S", 2.0)  # (before the bus fixture makes the bucket)
    return 2.0


async def _holder(bus: Bus) -> str:
    kv = await bus.js.key_value(lease_module.BUCKET)
    return (await kv.get("admission")).value.decode()  # type: ignore[union-attr]


async def test_the_standby_takes_over_when_the_holder_dies_and_nothing_is_decided_twice(
        short_lease: float, bus: Bus, nats_url: str, realm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFLEET_CREDS", str(realm.creds_path("svc-admission")))  # the service's own identity
    tasks = {i: asyncio.create_task(run_core(AdmissionCore(), nats_url, instance=i, lease=True)) for i in ("0", "1")}
    try:
        async def submitted(job_ids: set[str]) -> bool:
            got = [e.job_id for _, e in await read_log(bus) if e.type == "job.submitted"]
            return set(got) >= job_ids

        await bus.publish(submit_cmd(make_job("a").dict(), "a"))
        await wait_until(lambda: submitted({"a"}), timeout_s=30)
        first = await _holder(bus)
        assert first in ("admission/0", "admission/1")
        dead = first.split("/")[1]
        tasks[dead].cancel()  # the holder dies without giving the lease back
        await asyncio.gather(tasks[dead], return_exceptions=True)
        for j in ("b", "c"):
            await bus.publish(submit_cmd(make_job(j).dict(), j))
        await wait_until(lambda: submitted({"a", "b", "c"}), timeout_s=30)
        assert await _holder(bus) != first  # the standby holds it now
        log = await read_log(bus)
        for kind in ("job.submitted", "job.admitted"):
            assert sorted(e.job_id or "" for _, e in log if e.type == kind) == ["a", "b", "c"], kind
        consumers = {c.name for c in await bus.js.consumers_info("FLEET")}
        assert "admission" in consumers and "admission-1" not in consumers  # one shared durable
    finally:
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)


async def test_a_lease_is_held_by_one_instance_and_only_by_its_own_service(
        short_lease: float, bus: Bus, nats_url: str, realm: Any) -> None:
    from gpufleet.shared.runtime.lease import Lease

    a = await Bus.connect(nats_url, name="a", creds=realm.creds_path("svc-guardian"))
    b = await Bus.connect(nats_url, name="b", creds=realm.creds_path("svc-guardian"))
    q = await Bus.connect(nats_url, name="q", creds=realm.creds_path("svc-quota"))
    try:
        la, lb = Lease(a, "guardian", "guardian/0"), Lease(b, "guardian", "guardian/1")
        assert await la.try_acquire() and la.valid()
        assert not await lb.try_acquire()
        assert await la.renew()
        # another service's identity may not take (or steal) the guardian's lease
        with pytest.raises(Exception):  # noqa: B017 - the server refuses the publish (a permissions violation)
            await asyncio.wait_for(Lease(q, "guardian", "quota/0").try_acquire(), 5)
        await la.release()
        assert await lb.try_acquire()
    finally:
        for x in (a, b, q):
            await x.close()


async def test_a_batch_the_old_holder_took_from_the_shared_durable_is_decided_by_the_new_one(
        bus: Bus, nats_url: str, realm: Any) -> None:
    """The lost-submit of `bench chaos`: an instance that lost its lease (or was paused between
    its lease check and its fetch) takes one more batch from the service's shared durable and
    drops it unacked. The new holder must not ack past it (AckAll would acknowledge what it
    never got): it sees the gap in the consumer's deliveries and takes them again, in order."""
    from gpufleet.shared.runtime.loop import ServiceRuntime

    new_bus = await Bus.connect(nats_url, name="admission-new", creds=realm.creds_path("svc-admission"))
    old_bus = await Bus.connect(nats_url, name="admission-old", creds=realm.creds_path("svc-admission"))
    try:
        holder: ServiceRuntime[Any] = ServiceRuntime(AdmissionCore(), new_bus, instance="1", shared_durable=True,
                                                     fetch_timeout_s=0.05, fence=lambda: True)
        await holder.start()
        assert holder.durable == "admission"
        await bus.publish(submit_cmd(make_job("taken").dict(), "taken"))
        stale = await old_bus.js.pull_subscribe_bind("admission", stream="FLEET")
        [taken] = await stale.fetch(1, timeout=5)  # the old holder's last batch, never acked
        assert b"taken" in taken.data
        await bus.publish(submit_cmd(make_job("after").dict(), "after"))

        running = asyncio.create_task(holder.run())
        try:
            await wait_until(lambda: _submitted(bus, "taken", "after"), timeout_s=20)  # (inside the 30 s ack wait)
            assert holder.stats.refolds >= 2  # its start, and the recovery from the gap
        finally:
            holder.stop()
            await running

        # an instance whose lease is gone fetches nothing more, and stops
        gone: ServiceRuntime[Any] = ServiceRuntime(AdmissionCore(), old_bus, shared_durable=True,
                                                   fetch_timeout_s=0.05, fence=lambda: False)
        gone._psub = stale
        await bus.publish(submit_cmd(make_job("later").dict(), "later"))
        assert await gone.step() == 0 and gone._stop.is_set()
        assert (await new_bus.js.consumer_info("FLEET", "admission")).num_pending >= 1
    finally:
        await new_bus.close()
        await old_bus.close()


async def _submitted(bus: Bus, *job_ids: str) -> bool:
    return set(job_ids) <= {e.job_id for _, e in await read_log(bus) if e.type == "job.submitted"}
