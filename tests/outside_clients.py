"""What the tests of the outside clients (clients/go/, clients/python/, clients/node/) share: each is
written only from the published contract (docs/clients.md, docs/schemas/), so each is run, as the
tenant acme, with the same specs and broken envelopes, and its JSON lines are held to the same
checks here. A test file keeps only what is its own: how its client is built and run."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.trust.authz import Realm

from .helpers import default_cores, nodes_registered, running, wait_until

SCHEMAS = Path(__file__).resolve().parent.parent / "docs" / "schemas"
CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"

Line = dict[str, Any]
Result = tuple[int, list[Line], str]  # the client's exit status, its JSON lines, its stderr


def schema(kind: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((SCHEMAS / f"{kind}.schema.json").read_text())
    return doc


async def run_outside_client(command: Sequence[str], url: str, spec: dict[str, Any], *extra: str,
                             timeout_s: float = 60, drop_env: Collection[str] = (),
                             cwd: Path | None = None) -> Result:
    """Runs `command URL SPEC --creds FILE --timeout-s N EXTRA...` as the tenant acme, with the
    credentials `gpufleet tenant creds acme` hands out (not the test's own $GPUFLEET_CREDS, nor
    what else `drop_env` names), and parses the JSON lines it prints."""
    creds = Realm(Path(os.environ["GPUFLEET_TEST_REALM"])).creds_path("tenant-acme")
    env = {k: v for k, v in os.environ.items() if k != "GPUFLEET_CREDS" and k not in drop_env}
    proc = await asyncio.create_subprocess_exec(
        *command, url, json.dumps(spec), "--creds", str(creds), "--timeout-s", str(timeout_s), *extra,
        cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s + 30)
    lines = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
    assert proc.returncode is not None
    if proc.returncode == 2 or not lines:
        raise AssertionError(f"exit {proc.returncode}: {err.decode()[-2000:]}")
    return proc.returncode, lines, err.decode()


@asynccontextmanager
async def one_node_mesh(bus: Bus, nats_url: str) -> AsyncIterator[None]:
    """The services, with one simulated node, registered before the block starts."""
    async with running(nats_url, default_cores(sim_nodes=1)):
        await wait_until(lambda: nodes_registered(bus, 1))
        yield


def good_spec(name: str) -> dict[str, Any]:
    return {"name": name, "tenant": "acme", "type": "batch",
            "resources": {"gpu": 1, "cpu": "500m", "memory": "1Gi"}, "sim": {"duration": "1s"}}


BAD_SPECS = [
    # a value the schema refuses: the field is named
    ({"name": "bad-spec", "tenant": "acme", "resources": {"gpu": 2, "cpu": "lots"}}, "invalid_spec", "resources.cpu"),
    # the normalised names of the events are not a spelling of the spec (docs/clients.md, section 2)
    ({"name": "normalised", "tenant": "acme", "resources": {"gpu": 1, "cpu_milli": 500}}, "invalid_spec",
     "resources.cpu_milli"),
    # valid by the schema, but beyond the cluster: no node has 64 GPUs
    ({"name": "too-big", "tenant": "acme", "resources": {"gpu": 64}}, "exceeds_node", "resources.gpu"),
]

# each broken envelope of docs/clients.md section 5, and the field its reason names
BROKEN = [("no-actor", "actor"), ("tenant-mismatch", "tenant"), ("no-msg-id", "Nats-Msg-Id"),
          ("msg-id-mismatch", "Nats-Msg-Id"), ("event-id-not-ulid", "event_id"), ("extra-field", "colour")]
BROKEN_ENVELOPE_SPEC = {"name": "bad-envelope", "tenant": "acme", "resources": {"gpu": 1},
                        "sim": {"duration": "1s"}}
BAD_JSON_SPEC = {"name": "bad-json", "tenant": "acme", "resources": {"gpu": 1}}


def events(lines: list[Line]) -> list[Line]:
    return [ln for ln in lines if "event" in ln]


def verdict_of(lines: list[Line]) -> Any:
    return next(ln["verdict"] for ln in lines if "verdict" in ln)


def check_events_against_schemas(lines: list[Line]) -> None:
    """Every event the client was pushed is valid by its published schema, on its subject."""
    for ln in events(lines):
        env = ln["event"]
        jsonschema.validate(env, schema(env["type"]))
        assert ln["type"] == env["type"]
        job_id = env["payload"]["job_id"]
        assert ln["subject"] == f"fleet.evt.acme.job.{job_id}.{env['type'].split('.', 1)[1]}"
    seqs = [ln["seq"] for ln in events(lines)]
    assert all(isinstance(s, int) for s in seqs) and seqs == sorted(seqs)  # in log order, seq from the reply


async def published(bus: Bus, seq: int) -> tuple[dict[str, Any], dict[str, str]]:
    msg = await bus.js.get_msg("FLEET", seq)
    return json.loads(msg.data or b""), dict(msg.headers or {})


async def dead_letters(bus: Bus) -> list[dict[str, Any]]:
    from gpufleet.shared.runtime.log import read_stream

    out: list[dict[str, Any]] = []
    async for batch in read_stream(bus, ("fleet.evt.sys.deadletter.>",)):
        out += [json.loads(m.data) for m in batch]
    return out


def ulid_ms(ulid: str) -> int:
    """The milliseconds of a ULID: its first 10 characters, Crockford base32."""
    n = 0
    for ch in ulid[:10]:
        n = n * 32 + CROCKFORD.index(ch)
    return n


async def check_followed_to_the_end(bus: Bus, result: Result) -> str:
    """A good job (good_spec, run with --verdict) followed from its submit to job.succeeded; its job id."""
    code, lines, err = result
    job_id: str = lines[0]["submitted"]
    types = [ln["type"] for ln in events(lines)]
    assert code == 0, (lines, err)
    assert lines[-1]["done"] == "job.succeeded" and lines[-1]["job_id"] == job_id
    assert types[0] == "job.submitted" and types[-1] == "job.succeeded", types
    for t in ("job.admitted", "job.quota_reserved", "job.placed", "job.started", "job.exited"):
        assert t in types, (t, types)
    check_events_against_schemas(lines)
    # the request/reply verdict (section 2): accepted, with the job.admitted envelope of the log
    admitted = next(ln["event"] for ln in events(lines) if ln["type"] == "job.admitted")
    assert verdict_of(lines) == {"accepted": True, "events": [admitted]}
    # what it published is a valid envelope by the published schema, and the services parsed it
    doc, headers = await published(bus, lines[0]["seq"])
    jsonschema.validate(doc, schema("cmd.submit"))
    assert doc["payload"]["job_id"] == job_id and headers.get("Nats-Msg-Id") == doc["event_id"]
    assert doc["event_id"] == lines[0]["event_id"] and doc["correlation_id"] == job_id
    assert headers.get("Gpufleet-Reply", "").startswith("_INBOX.tenant.acme.")
    # its ULIDs (event id, job id) carry the time they were made: 48-bit milliseconds first
    for ulid in (doc["event_id"], job_id):
        assert abs(ulid_ms(ulid) - time.time() * 1000) < 120_000, ulid
    # every event of the job carries the job id as its correlation id (section 2's table)
    assert {ln["event"]["correlation_id"] for ln in events(lines)} == {job_id}
    # the seq it read from each pushed message's reply subject (section 3) is the event's in the log
    for ln in events(lines):
        assert (await published(bus, ln["seq"]))[0] == ln["event"], ln["seq"]
    return job_id


async def check_rejected_spec(bus: Bus, result: Result, code: str, field: str) -> None:
    """A spec of BAD_SPECS (run with --verdict): rejected alone, with `code` on `field`."""
    exit_code, lines, err = result
    assert exit_code == 1, (field, lines, err)
    end = lines[-1]
    assert end["done"] == "job.rejected" and end["job_id"] == lines[0]["submitted"], lines
    assert [ln["type"] for ln in events(lines)] == ["job.rejected"], lines  # alone: no job.submitted
    assert (code, field) in {(r["code"], r["field"]) for r in end["reasons"]}, end["reasons"]
    assert all(r["message"] for r in end["reasons"])
    assert end["reasons"] == events(lines)[0]["event"]["payload"]["reasons"]
    check_events_against_schemas(lines)
    assert verdict_of(lines) == {"accepted": False, "events": [events(lines)[-1]["event"]]}
    # the client's envelope was valid by the published schema; only a spec that breaks the schema breaks it
    doc, _ = await published(bus, lines[0]["seq"])
    if code == "invalid_spec":
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema("cmd.submit"))
    else:
        jsonschema.validate(doc, schema("cmd.submit"))
    jsonschema.validate({**doc, "payload": {**doc["payload"], "spec": {"name": "x", "tenant": "acme"}}},
                        schema("cmd.submit"))


async def check_broken_envelopes(bus: Bus, runs: dict[str, Result], letters: list[dict[str, Any]]) -> None:
    """Each broken envelope of BROKEN (BROKEN_ENVELOPE_SPEC, run with --verdict --bad-envelope): an
    answer on its job (job.rejected, invalid_envelope) and a dead letter, given the dead letters after."""
    for bad, field in BROKEN:
        code, lines, err = runs[bad]
        assert code == 1, (bad, lines, err)
        end, job_id = lines[-1], lines[0]["submitted"]
        assert end["done"] == "job.rejected", (bad, lines)
        assert [ln["type"] for ln in events(lines)] == ["job.rejected"], (bad, lines)  # never read: no job.submitted
        assert [(r["code"], r["field"]) for r in end["reasons"]] == [("invalid_envelope", field)], (bad, end)
        check_events_against_schemas(lines)
        rejected = events(lines)[0]["event"]
        assert rejected["correlation_id"] == job_id and rejected.get("causation_id") is None
        assert verdict_of(lines) == {"accepted": False, "events": [rejected]}, bad
        # and a dead letter for the operator, naming the tenant and the job
        letter = next(d["payload"] for d in letters if d["payload"]["stream_seq"] == lines[0]["seq"])
        assert (letter["service"], letter["tenant"], letter["about_job"]) == ("admission", "acme", job_id), letter
    # what the client published breaks the published schema (or the header rule), as intended
    for bad in ("no-actor", "tenant-mismatch", "extra-field", "event-id-not-ulid"):
        doc, _ = await published(bus, runs[bad][1][0]["seq"])
        if bad == "tenant-mismatch":
            assert doc["tenant"] != "acme" and doc["payload"]["spec"]["tenant"] == "acme"
            continue
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema("cmd.submit"))
    for bad, header in (("no-msg-id", None), ("msg-id-mismatch", "other")):
        doc, headers = await published(bus, runs[bad][1][0]["seq"])
        jsonschema.validate(doc, schema("cmd.submit"))  # the body is fine: only the header is wrong
        if header is None:
            assert "Nats-Msg-Id" not in headers
        else:
            assert headers["Nats-Msg-Id"] != doc["event_id"]


def check_unanswered(result: Result) -> None:
    """BAD_JSON_SPEC with --bad-envelope bad-json, no --verdict: no events, no end, a timeout."""
    code, lines, _ = result
    assert code == 3 and lines[-1] == {"done": None, "job_id": lines[0]["submitted"], "timeout": True}, lines
    assert not events(lines)


def check_refused_with_only_a_dead_letter(result: Result, letters: list[dict[str, Any]]) -> None:
    """The same with --verdict: the verdict says refused, with no events; a dead letter about no job."""
    code, lines, _ = result
    assert code == 1 and not events(lines), lines
    assert [ln["verdict"] for ln in lines if "verdict" in ln] == [{"accepted": False, "events": []}]
    assert lines[-1] == {"done": None, "job_id": lines[0]["submitted"], "refused": True, "reasons": []}
    letter = next(d["payload"] for d in letters if d["payload"]["stream_seq"] == lines[0]["seq"])
    assert letter["tenant"] == "acme" and letter.get("about_job") is None, letter
