"""Request/reply submit (header `Gpufleet-Reply`): admission answers a command's verdict on the
sender's own inbox once it is in the log — accepted, or rejected with one reason per field,
including for a broken envelope — and never on another tenant's inbox."""

from __future__ import annotations

import json
from typing import Any

import nats.errors
import pytest

from gpufleet.sdk import Fleet
from gpufleet.services.admission.core import AdmissionCore
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.loop import REPLY_HEADER

from .helpers import new_id, running


async def _tenant(nats_url: str, realm: Any, name: str) -> Fleet:
    return Fleet(await Bus.connect(nats_url, name=name, creds=realm.creds_path(f"tenant-{name}")))


async def test_a_submit_gets_its_verdict_on_its_own_inbox(bus: Bus, nats_url: str, realm: Any) -> None:
    acme = await _tenant(nats_url, realm, "acme")
    try:
        async with running(nats_url, [AdmissionCore()]):
            good = await acme.submit_for_verdict({"name": "a", "resources": {"gpu": 1}})
            assert good["accepted"] and [e["type"] for e in good["events"]] == ["job.admitted"]
            bad = await acme.submit_for_verdict({"name": "b", "resources": {"gpu": -1, "cpu": "lots"}})
            assert not bad["accepted"] and bad["events"][0]["type"] == "job.rejected"
            fields = {r["field"] for r in bad["events"][0]["payload"]["reasons"]}
            assert {"resources.gpu", "resources.cpu"} <= fields  # one reason per field
    finally:
        await acme.close()


async def test_a_broken_envelope_is_answered_and_another_tenants_inbox_never(
        bus: Bus, nats_url: str, realm: Any) -> None:
    acme = await _tenant(nats_url, realm, "acme")
    beta = await _tenant(nats_url, realm, "beta")
    try:
        async with running(nats_url, [AdmissionCore()]):
            mine = acme.bus.nc.new_inbox()
            theirs = beta.bus.nc.new_inbox()
            got_mine = await acme.bus.nc.subscribe(mine, max_msgs=1)
            got_theirs = await beta.bus.nc.subscribe(theirs, max_msgs=1)
            eid = new_id()
            # a submit without its actor (not the contract), naming acme's inbox
            doc = {"event_id": eid, "type": "cmd.submit", "schema_version": 1, "occurred_at": "2026-01-01T00:00:00Z",
                   "tenant": "acme", "correlation_id": "jb", "payload": {"job_id": "jb", "type": "cmd.submit",
                                                                        "spec": {"name": "b", "tenant": "acme"}}}
            await acme.bus.js.publish("fleet.cmd.acme.submit", json.dumps(doc).encode(),
                                      headers={"Nats-Msg-Id": eid, REPLY_HEADER: mine})
            reply = json.loads((await got_mine.next_msg(timeout=15)).data)
            assert not reply["accepted"]
            reasons = reply["events"][0]["payload"]["reasons"]
            assert any(r["code"] == "invalid_envelope" and r["field"] == "actor" for r in reasons)
            # acme names beta's inbox: admission does not answer there
            eid2 = new_id()
            doc2 = {**doc, "event_id": eid2, "actor": "acme/cli", "correlation_id": "jc",
                    "payload": {"job_id": "jc", "type": "cmd.submit", "spec": {"name": "c", "tenant": "acme"}}}
            await acme.bus.js.publish("fleet.cmd.acme.submit", json.dumps(doc2).encode(),
                                      headers={"Nats-Msg-Id": eid2, REPLY_HEADER: theirs})
            ok = await acme.submit_for_verdict({"name": "d"})  # (decided after jc: jc's verdict was due by now)
            assert ok["accepted"]
            with pytest.raises(nats.errors.TimeoutError):  # nothing came to beta's inbox
                await got_theirs.next_msg(timeout=1)
    finally:
        await acme.close()
        await beta.close()
