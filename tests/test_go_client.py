"""Any client: a Go client (the standard library, nats.go and nkeys, nothing of gpufleet), written
only from docs/clients.md, docs/schemas/, README.md and docs/security.md (clients/go/), submits a
good job, bad specs and broken envelopes, and follows each to its end against a live mesh
(issue 17: an outside client in a second language beside clients/node/).

Needs `go` and the sources of nats.go and nkeys in a GOPATH (Debian's golang-go and
golang-github-nats-io-go-nats-dev, which `.ci/run` installs: /usr/share/gocode); the client is
built offline in GOPATH mode. Skips, saying why, without them.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.trust.authz import Realm

from .helpers import default_cores, nodes_registered, running, wait_until

CLIENT = Path(__file__).resolve().parent.parent / "clients" / "go"
SOURCE = CLIENT / "submit_and_follow.go"
SCHEMAS = Path(__file__).resolve().parent.parent / "docs" / "schemas"
NATS_PACKAGES = ("github.com/nats-io/nats.go", "github.com/nats-io/nkeys")
CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def go_path() -> str | None:
    """A GOPATH that holds the sources of nats.go and nkeys: $GOPATH's, else Debian's."""
    candidates = [p for p in os.environ.get("GOPATH", "").split(os.pathsep) if p] + ["/usr/share/gocode"]
    for root in candidates:
        if all((Path(root) / "src" / pkg).is_dir() for pkg in NATS_PACKAGES):
            return root
    return None


def go_env(gopath: str, cache: Path) -> dict[str, str]:
    """GOPATH mode (no module proxy needed: the packages' sources are on disk), offline."""
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": gopath, "GOFLAGS": "", "GOPROXY": "off"}
    if "GOCACHE" not in env and not (env.get("HOME") or env.get("XDG_CACHE_HOME")):
        env["GOCACHE"] = str(cache)
    return env


pytestmark = [
    pytest.mark.skipif(shutil.which("go") is None,
                       reason="no `go` on this machine (Debian: apt-get install golang-go)"),
    pytest.mark.skipif(go_path() is None,
                       reason="no nats.go / nkeys sources in $GOPATH or /usr/share/gocode "
                              "(Debian: apt-get install golang-github-nats-io-go-nats-dev)"),
]


@pytest.fixture(scope="session")
def go_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gopath = go_path()
    assert gopath is not None
    out = tmp_path_factory.mktemp("go-client")
    env = go_env(gopath, out / "cache")
    proc = subprocess.run(["go", "build", "-o", str(out / "submit_and_follow"), SOURCE.name], cwd=CLIENT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"go build failed:\n{proc.stderr[-3000:]}"
    return out / "submit_and_follow"


def schema(kind: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((SCHEMAS / f"{kind}.schema.json").read_text())
    return doc


async def run_client(client: Path, url: str, spec: dict[str, Any], *extra: str,
                     timeout_s: float = 60) -> tuple[int, list[dict[str, Any]], str]:
    """Runs as the tenant acme, with the credentials `gpufleet tenant creds acme` hands out."""
    creds = Realm(Path(os.environ["GPUFLEET_TEST_REALM"])).creds_path("tenant-acme")
    env = {k: v for k, v in os.environ.items() if k != "GPUFLEET_CREDS"}
    proc = await asyncio.create_subprocess_exec(
        str(client), url, json.dumps(spec), "--creds", str(creds), "--timeout-s", str(timeout_s), *extra,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s + 30)
    lines = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
    assert proc.returncode is not None
    if proc.returncode == 2 or not lines:
        raise AssertionError(f"exit {proc.returncode}: {err.decode()[-2000:]}")
    return proc.returncode, lines, err.decode()


def events(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [ln for ln in lines if "event" in ln]


def check_events_against_schemas(lines: list[dict[str, Any]]) -> None:
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


def ulid_ms(ulid: str) -> int:
    """The milliseconds of a ULID: its first 10 characters, Crockford base32."""
    n = 0
    for ch in ulid[:10]:
        n = n * 32 + CROCKFORD.index(ch)
    return n


def test_the_go_client_imports_only_the_standard_library_nats_and_nkeys(go_client: Path) -> None:
    gopath = go_path()
    assert gopath is not None
    proc = subprocess.run(["go", "list", "-f", "{{join .Imports \"\\n\"}}", SOURCE.name], cwd=CLIENT,
                          env=go_env(gopath, go_client.parent / "cache"), capture_output=True, text=True,
                          timeout=120, check=True)
    imports = [i for i in proc.stdout.split() if i]
    foreign = {i for i in imports if "." in i.split("/")[0] and i not in NATS_PACKAGES}
    assert imports and not foreign, foreign
    assert [p.name for p in CLIENT.glob("*.go")] == [SOURCE.name]  # one file, package main


async def test_a_go_client_submits_and_follows_its_job_to_the_end(bus: Bus, nats_url: str, go_client: Path) -> None:
    spec = {"name": "from-go", "tenant": "acme", "type": "batch",
            "resources": {"gpu": 1, "cpu": "500m", "memory": "1Gi"}, "sim": {"duration": "1s"}}
    async with running(nats_url, default_cores(sim_nodes=1)):
        await wait_until(lambda: nodes_registered(bus, 1))
        code, lines, err = await run_client(go_client, nats_url, spec, "--verdict")
    job_id = lines[0]["submitted"]
    types = [ln["type"] for ln in events(lines)]
    assert code == 0, (lines, err)
    assert lines[-1] == {"done": "job.succeeded", "job_id": job_id, "reasons": []}
    assert types[0] == "job.submitted" and types[-1] == "job.succeeded", types
    for t in ("job.admitted", "job.quota_reserved", "job.placed", "job.started", "job.exited"):
        assert t in types, (t, types)
    check_events_against_schemas(lines)
    # the request/reply verdict (section 2): accepted, with the job.admitted envelope of the log
    verdict = next(ln["verdict"] for ln in lines if "verdict" in ln)
    admitted = next(ln["event"] for ln in events(lines) if ln["type"] == "job.admitted")
    assert verdict == {"accepted": True, "events": [admitted]}
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


BAD_SPECS = [
    # a value the schema refuses: the field is named
    ({"name": "bad-spec", "tenant": "acme", "resources": {"gpu": 2, "cpu": "lots"}}, "invalid_spec", "resources.cpu"),
    # the normalised names of the events are not a spelling of the spec (docs/clients.md, section 2)
    ({"name": "normalised", "tenant": "acme", "resources": {"gpu": 1, "cpu_milli": 500}}, "invalid_spec",
     "resources.cpu_milli"),
    # valid by the schema, but beyond the cluster: no node has 64 GPUs
    ({"name": "too-big", "tenant": "acme", "resources": {"gpu": 64}}, "exceeds_node", "resources.gpu"),
]


async def test_a_go_client_is_told_which_field_of_a_bad_spec_is_wrong(bus: Bus, nats_url: str,
                                                                      go_client: Path) -> None:
    runs = []
    async with running(nats_url, default_cores(sim_nodes=1)):
        await wait_until(lambda: nodes_registered(bus, 1))
        for spec, _, _ in BAD_SPECS:
            runs.append(await run_client(go_client, nats_url, spec, "--verdict"))
    for (_, code, field), (exit_code, lines, err) in zip(BAD_SPECS, runs, strict=True):
        assert exit_code == 1, (field, lines, err)
        end = lines[-1]
        assert end["done"] == "job.rejected" and end["job_id"] == lines[0]["submitted"], lines
        assert [ln["type"] for ln in events(lines)] == ["job.rejected"], lines  # alone: no job.submitted
        assert (code, field) in {(r["code"], r["field"]) for r in end["reasons"]}, end["reasons"]
        assert all(r["message"] for r in end["reasons"])
        assert end["reasons"] == events(lines)[0]["event"]["payload"]["reasons"]
        check_events_against_schemas(lines)
        verdict = next(ln["verdict"] for ln in lines if "verdict" in ln)
        assert verdict == {"accepted": False, "events": [events(lines)[-1]["event"]]}
        # the client's envelope was valid by the published schema; only a spec that breaks the schema breaks it
        doc, _ = await published(bus, lines[0]["seq"])
        if code == "invalid_spec":
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(doc, schema("cmd.submit"))
        else:
            jsonschema.validate(doc, schema("cmd.submit"))
        jsonschema.validate({**doc, "payload": {**doc["payload"], "spec": {"name": "x", "tenant": "acme"}}},
                            schema("cmd.submit"))


async def dead_letters(bus: Bus) -> list[dict[str, Any]]:
    from gpufleet.shared.runtime.log import read_stream

    out: list[dict[str, Any]] = []
    async for batch in read_stream(bus, ("fleet.evt.sys.deadletter.>",)):
        out += [json.loads(m.data) for m in batch]
    return out


# each broken envelope of docs/clients.md section 5, and the field its reason names
BROKEN = [("no-actor", "actor"), ("tenant-mismatch", "tenant"), ("no-msg-id", "Nats-Msg-Id"),
          ("msg-id-mismatch", "Nats-Msg-Id"), ("event-id-not-ulid", "event_id"), ("extra-field", "colour")]


async def test_a_go_client_is_answered_on_its_job_when_its_envelope_is_broken(bus: Bus, nats_url: str,
                                                                             go_client: Path) -> None:
    spec = {"name": "bad-envelope", "tenant": "acme", "resources": {"gpu": 1}, "sim": {"duration": "1s"}}
    runs = {}
    async with running(nats_url, default_cores(sim_nodes=1)):
        await wait_until(lambda: nodes_registered(bus, 1))
        for bad, _ in BROKEN:
            runs[bad] = await run_client(go_client, nats_url, spec, "--verdict", "--bad-envelope", bad)
        letters = await dead_letters(bus)
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
        verdict = next(ln["verdict"] for ln in lines if "verdict" in ln)
        assert verdict == {"accepted": False, "events": [rejected]}, bad
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


async def test_a_go_client_without_a_readable_job_id_gets_only_a_dead_letter(bus: Bus, nats_url: str,
                                                                            go_client: Path) -> None:
    spec = {"name": "bad-json", "tenant": "acme", "resources": {"gpu": 1}}
    async with running(nats_url, default_cores(sim_nodes=1)):
        await wait_until(lambda: nodes_registered(bus, 1))
        code, lines, _ = await run_client(go_client, nats_url, spec, "--bad-envelope", "bad-json", timeout_s=3)
        assert code == 3 and lines[-1] == {"done": None, "job_id": lines[0]["submitted"], "timeout": True}, lines
        assert not events(lines)
        # asked for, the verdict says refused, with no events
        code, lines, _ = await run_client(go_client, nats_url, spec, "--verdict", "--bad-envelope", "bad-json",
                                          timeout_s=10)
        letters = await dead_letters(bus)
    assert code == 1 and not events(lines), lines
    assert [ln["verdict"] for ln in lines if "verdict" in ln] == [{"accepted": False, "events": []}]
    assert lines[-1] == {"done": None, "job_id": lines[0]["submitted"], "refused": True, "reasons": []}
    letter = next(d["payload"] for d in letters if d["payload"]["stream_seq"] == lines[0]["seq"])
    assert letter["tenant"] == "acme" and letter.get("about_job") is None, letter
