"""gpufleet.ext, the FastStream kit: typed subscribers on the fleet's event types. The example
(examples/ext/failed_to_csv.py) in FastStream's in-memory TestNatsBroker, and a subscriber of
the kit against a real nats-server with the mesh's authorization and real services."""

from __future__ import annotations

import csv
import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("faststream")

from faststream.nats import TestNatsBroker  # noqa: E402

from gpufleet.ext import FleetRouter, event_subject, fleet_broker  # noqa: E402
from gpufleet.shared.contract.events import Envelope, JobFailed, Reason, utc  # noqa: E402
from gpufleet.shared.contract.ids import derive_id  # noqa: E402
from gpufleet.shared.runtime.bus import Bus  # noqa: E402

from .helpers import default_cores, running, submit_cmd, wait_until  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def failed_env(job_id: str, tenant: str = "acme") -> Envelope:
    return Envelope(event_id=derive_id(job_id, "failed", 1_800_000_000_000), type="job.failed",
                    occurred_at=utc(1_800_000_000), tenant=tenant, actor="guardian/0",
                    payload=JobFailed(job_id=job_id, reason=Reason(code="exit_code", message="exited with code 3"),
                                      exit_code=3))


def test_event_types_map_to_their_subjects_and_a_misspelt_one_is_refused() -> None:
    assert event_subject("job.failed") == "fleet.evt.*.job.*.failed"
    assert event_subject("job.failed", tenant="acme", job_id="j1") == "fleet.evt.acme.job.j1.failed"
    assert event_subject("node.lost") == "fleet.evt.sys.node.*.lost"
    with pytest.raises(ValueError, match="'job.failled' is not an event of the contract"):
        event_subject("job.failled")
    with pytest.raises(ValueError, match="tenant"):
        event_subject("job.failed", tenant="a.b")
    with pytest.raises(ValueError, match="durable: 'placer' is a consumer of the mesh's own services"):
        FleetRouter().subscriber("job.failed", durable="placer")


async def test_the_example_appends_each_failed_job_to_its_csv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "failed.csv"
    monkeypatch.setenv("FAILED_CSV", str(out))
    monkeypatch.syspath_prepend(str(REPO))
    sys.modules.pop("examples.ext.failed_to_csv", None)
    example = importlib.import_module("examples.ext.failed_to_csv")
    async with TestNatsBroker(example.broker) as br:
        await br.publish(failed_env("j1").to_json(), "fleet.evt.acme.job.j1.failed")
        example.failed.mock.assert_called_once()
    rows = list(csv.reader(out.open()))
    assert [r[1:4] for r in rows] == [["acme", "j1", "exit_code"]]
    # the app's AsyncAPI document names the fleet channel it subscribes to
    from faststream.specification import AsyncAPI

    doc = AsyncAPI(example.broker).to_specification().to_jsonable()
    assert any(ch.get("address") == "fleet.evt.*.job.*.failed" for ch in doc["channels"].values()), doc["channels"]


async def test_subscribers_get_real_failures_through_a_real_server(bus: Bus, nats_url: str, realm: Any) -> None:
    """The admin's durable subscriber (a pull consumer) gets every failure; a tenant's router, on
    its own credentials, gets its own only (the server's permissions), parsed to the Envelope."""
    admin_got: list[Envelope] = []
    acme_got: list[Envelope] = []
    ops, acme = FleetRouter(), FleetRouter(tenant="acme")

    @ops.subscriber("job.failed", durable="ops-failures")
    async def every(env: Envelope) -> None:
        admin_got.append(env)

    @acme.subscriber("job.failed")
    async def own(env: Envelope) -> None:
        acme_got.append(env)

    with pytest.raises(ValueError, match="durable: a durable consumer is the admin's"):
        FleetRouter(tenant="acme").subscriber("job.failed", durable="mine")
    admin_broker = fleet_broker(nats_url=nats_url)  # $GPUFLEET_CREDS: the test's admin
    admin_broker.include_router(ops)
    acme_broker = fleet_broker(nats_url=nats_url, creds=str(realm.creds_path("tenant-acme")))
    acme_broker.include_router(acme)
    mine = submit_cmd({"name": "f", "tenant": "acme", "resources": {"gpu": 1}, "sim": {"duration": "1s", "exitCode": 3}})
    theirs = submit_cmd({"name": "f", "tenant": "beta", "resources": {"gpu": 1},
                         "sim": {"duration": "1s", "exitCode": 3}})
    async with running(nats_url, default_cores()):
        await admin_broker.start()
        await acme_broker.start()
        try:
            await bus.publish(mine)
            await bus.publish(theirs)
            await wait_until(lambda: len(admin_got) == 2, timeout_s=30)
            await wait_until(lambda: acme_got, timeout_s=10)
        finally:
            await admin_broker.stop()
            await acme_broker.stop()
    assert sorted(e.job_id or "" for e in admin_got) == sorted([mine.job_id or "", theirs.job_id or ""])
    # acme's router narrows to acme's subjects, the only ones its credentials may subscribe to
    assert [(e.job_id, e.tenant, e.payload.reason.code) for e in acme_got] == [(mine.job_id, "acme", "exit_code")]  # type: ignore[union-attr]
