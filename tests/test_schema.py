"""The published contract (docs/schemas) matches the models and validates real messages."""

from __future__ import annotations

import functools
import json
import re
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator
from pydantic import ValidationError

from gpufleet.shared.contract import schema
from gpufleet.shared.contract.events import (
    PAYLOAD_TYPES,
    BudgetExceeded,
    BudgetThresholdReached,
    CancelRequestedCmd,
    CapacityCommitted,
    DeadLetter,
    Envelope,
    GpuDevice,
    JobAdmitted,
    JobBackfillReserved,
    JobCancelled,
    JobCancelRequested,
    JobCheckpointInvalid,
    JobCheckpointOverdue,
    JobCheckpointSaved,
    JobCheckpointVerified,
    JobDataStaged,
    JobDataStaging,
    JobExited,
    JobFailed,
    JobGpuStarved,
    JobHeartbeat,
    JobIdleDetected,
    JobIdleEnded,
    JobPlaced,
    JobPreempted,
    JobPreemptionRequested,
    JobQueued,
    JobQuotaReserved,
    JobRejected,
    JobRequestRefused,
    JobResized,
    JobResumeRequested,
    JobScaled,
    JobStarted,
    JobSubmitted,
    JobSucceeded,
    JobUnschedulable,
    NodeCordoned,
    NodeDatasetsCached,
    NodeDeregistered,
    NodeGpuCleared,
    NodeGpuUnhealthy,
    NodeGpuZombieDetected,
    NodeHeartbeat,
    NodeInventory,
    NodeLost,
    NodeProvisionRequested,
    NodeRegistered,
    NodeRemovalRequested,
    NodeUncordoned,
    Reason,
    ReplicaAllocation,
    ReportLoadCmd,
    SubmitRequested,
    parse_envelope,
)
from gpufleet.shared.contract.ids import ULID_PATTERN, derive_id, is_ulid, ulid
from gpufleet.shared.contract.spec import parse_spec

DOCS = Path(__file__).resolve().parent.parent / "docs" / "schemas"
JOB = "job-0001"
NODE = "node-a"
SPEC = {
    "name": "resnet50", "tenant": "acme", "type": "training", "priority": 100, "replicas": 2,
    "resources": {"cpu": 8, "memory": "64Gi", "gpu": 8, "gpuModel": "H100", "gpuMemory": "80Gi"},
    "maxRuntime": "2h", "checkpoint": {"path": "/ckpt/resnet50", "interval": "30m"},
    "sim": {"duration": "20s", "exitCode": 0}, "env": {"NCCL_DEBUG": "INFO"}, "command": ["python", "train.py"],
}
OOM = Reason(code="oom", message="replica 0 ran out of memory")

EXAMPLES: dict[str, Any] = {
    "cmd.submit": SubmitRequested(job_id=JOB, spec=SPEC),
    "cmd.cancel": CancelRequestedCmd(job_id=JOB),
    "job.submitted": JobSubmitted(job_id=JOB, spec=parse_spec(SPEC)),
    "job.admitted": JobAdmitted(job_id=JOB),
    "job.rejected": JobRejected(job_id=JOB, reasons=(Reason(code="spec", message="must be >= 0", field="resources.gpu"),)),
    "job.queued": JobQueued(job_id=JOB, queue="default", reason=Reason(code="quota", message="gpu quota 16 used")),
    "job.quota_reserved": JobQuotaReserved(job_id=JOB, queue="default", cpu_milli=16000, memory_mib=131072, gpus=16),
    "job.backfill_reserved": JobBackfillReserved(job_id=JOB, nodes=(NODE,),
                                                 estimated_start=datetime(2025, 10, 9, 14, 0, tzinfo=UTC)),
    "job.unschedulable": JobUnschedulable(
        job_id=JOB, reasons=(Reason(code="no_fit", message="no node has 8 free H100"),),
        filtered={"gpu_model": 3, "gpu_free": 1}, nodes_total=4,
    ),
    "job.placed": JobPlaced(job_id=JOB, allocations=(
        ReplicaAllocation(replica=0, node_id=NODE, gpu_indices=tuple(range(8)), cpu_milli=8000, memory_mib=65536),
        ReplicaAllocation(replica=1, node_id="node-b", gpu_indices=tuple(range(8)), cpu_milli=8000, memory_mib=65536),
    )),
    "job.data_staging": JobDataStaging(job_id=JOB, node_id=NODE, uri="file:///data/c4-en", done_bytes=1 << 30,
                                       total_bytes=4 << 30, elapsed_s=10.2),
    "job.data_staged": JobDataStaged(job_id=JOB, node_id=NODE, name="file:///data/c4-en", uri="file:///data/c4-en",
                                     path="/var/cache/gpufleet/3f2a/data", size_bytes=4 << 30, copied_bytes=4 << 30,
                                     staging_s=41.3),
    "job.started": JobStarted(job_id=JOB, node_id=NODE, replica=1, driver="docker", attempt=2),
    "job.heartbeat": JobHeartbeat(job_id=JOB, node_id=NODE, progress=0.42),
    "job.checkpoint_saved": JobCheckpointSaved(
        job_id=JOB, uri="file:///ckpt/resnet50/step-100", step=100, size_bytes=1 << 30, sha256="ab" * 32,
    ),
    "job.checkpoint_verified": JobCheckpointVerified(
        job_id=JOB, location="/ckpt/acme/j", latest_uri="file:///ckpt/acme/j/step-000000100", latest_step=100,
        skipped=(Reason(code="checkpoint_invalid", message="no manifest (partial)",
                        field="file:///ckpt/acme/j/step-000000120"),)),
    "job.checkpoint_invalid": JobCheckpointInvalid(job_id=JOB, uri="file:///ckpt/acme/j/step-000000120", step=120,
                                                   reason="state.pt does not match its sha256"),
    "job.checkpoint_overdue": JobCheckpointOverdue(job_id=JOB, age_s=4000.0, limit_s=3600.0),
    "job.preemption_requested": JobPreemptionRequested(
        job_id=JOB, reason=Reason(code="priority", message="a higher-priority job needs the GPUs"), by_job_id="job-0002",
    ),
    "job.preempted": JobPreempted(job_id=JOB, reason=Reason(code="priority", message="stopped for job-0002")),
    "job.cancel_requested": JobCancelRequested(job_id=JOB, reason="cancelled by user", requested_by="alice"),
    "job.request_refused": JobRequestRefused(
        job_id=JOB, command="cancel", command_id="01JD8Q3N5W6X7Y8Z9A0B1C2D3E",
        reasons=(Reason(code="unknown_job", message="no job 01JD8Q3N5W6X7Y8Z9A0B1C2D3E", field="job_id"),)),
    "job.exited": JobExited(job_id=JOB, node_id=NODE, exit_code=137, reason="killed", runtime_s=12.5),
    "job.succeeded": JobSucceeded(job_id=JOB),
    "job.failed": JobFailed(job_id=JOB, reason=OOM, exit_code=1),
    "job.cancelled": JobCancelled(job_id=JOB, reason="cancelled by user"),
    "job.resume_requested": JobResumeRequested(
        job_id=JOB, checkpoint_uri="file:///ckpt/resnet50/step-100", reason=OOM, lost_work_s=30.0,
    ),
    "job.resized": JobResized(job_id=JOB, from_replicas=4, to_replicas=2, attempt=1, for_job="01J0000000000000000000000B",
                              reason=Reason(code="shrink", message="4 -> 2 replicas: a job holding quota needs the room")),
    "job.idle_detected": JobIdleDetected(job_id=JOB, gpu_util_pct=1.5, idle_s=900.0),
    "job.idle_ended": JobIdleEnded(job_id=JOB, node_id=NODE, gpu_util_pct=64.0),
    "job.gpu_starved": JobGpuStarved(job_id=JOB, node_id=NODE, cause="cpu", gpu_util_pct=12.0,
                                     cpu_util_pct=98.0, window_s=60.0),
    "node.registered": NodeRegistered(node_id=NODE, inventory=NodeInventory(
        cpu_milli=128000, memory_mib=1048576, numa_nodes=2, labels={"zone": "a"},
        gpus=tuple(GpuDevice(index=i, uuid=f"GPU-{i}", model="H100", memory_mib=81920, nvlink_island=0,
                             numa_node=i // 4) for i in range(8)),
    )),
    "node.heartbeat": NodeHeartbeat(node_id=NODE, running_jobs=(JOB,)),
    "node.lost": NodeLost(node_id=NODE),
    "node.cordoned": NodeCordoned(node_id=NODE, reason="maintenance"),
    "node.datasets_cached": NodeDatasetsCached(node_id=NODE, datasets=("imagenet-1k", "c4")),
    "node.uncordoned": NodeUncordoned(node_id=NODE),
    "node.gpu_unhealthy": NodeGpuUnhealthy(node_id=NODE, gpu_index=3, reason="XID 79"),
    "node.gpu_zombie_detected": NodeGpuZombieDetected(node_id=NODE, gpu_index=3, pid=4242, used_mib=2048),
    "node.gpu_cleared": NodeGpuCleared(node_id=NODE, gpu_index=3),
    "cmd.report_load": ReportLoadCmd(job_id=JOB, rps=420.0, p99_ms=180.0, window_s=10.0),
    "job.scaled": JobScaled(job_id=JOB, from_replicas=2, to_replicas=5, rps=420.0, p99_ms=180.0,
                            reason=Reason(code="load", message="420 req/s (210.0 per replica, target 100): 2 -> 5"),
                            added=(f"{JOB}-r2", f"{JOB}-r3", f"{JOB}-r4")),
    "node.provision_requested": NodeProvisionRequested(
        node_id="h100-0003", pool="h100", provider="sim", ready_after_s=30.0, for_jobs=(JOB,),
        inventory=NodeInventory(cpu_milli=96000, memory_mib=1048576, labels={"pool": "h100"}),
        reason=Reason(code="unschedulable", message="1 job(s) unschedulable for up to 61s fit a h100 node")),
    "node.removal_requested": NodeRemovalRequested(
        node_id="h100-0003", pool="h100", provider="sim",
        reason=Reason(code="idle", message="drained: nothing on it since it was cordoned 3s ago")),
    "node.deregistered": NodeDeregistered(node_id="h100-0003"),
    "sys.dead_letter": DeadLetter(
        service="placer", subject="fleet.evt.acme.job.job-0001.submitted", stream_seq=17, reason="bad json",
        data_excerpt="{not json",
    ),
    "sys.capacity_committed": CapacityCommitted(service="placer", events=3),
    "budget.threshold_reached": BudgetThresholdReached(
        scope="tenant", budget="acme", amount=Decimal("5000"), currency="USD", spent=Decimal("4012.345678"),
        threshold_pct=80, policy="hold"),
    "budget.exceeded": BudgetExceeded(
        scope="queue", budget="research", amount=Decimal("800"), currency="USD", spent=Decimal("800.000412"),
        threshold_pct=100, policy="warn"),
}
TYPES: list[str] = sorted(PAYLOAD_TYPES)


def envelope(type_name: str) -> Envelope:
    payload = EXAMPLES[type_name]
    tenant = "acme" if type_name.split(".")[0] in ("cmd", "job") else "sys"
    return Envelope(
        event_id=ulid(1_760_000_000_000, bytes(range(10))), type=type_name,
        occurred_at=datetime(2025, 10, 9, 12, 0, 0, tzinfo=UTC), tenant=tenant, actor="test",
        causation_id=derive_id(JOB, "cause"), correlation_id=JOB if tenant == "acme" else None, payload=payload,
    )


def wire(type_name: str) -> dict[str, Any]:
    doc: dict[str, Any] = envelope(type_name).model_dump(mode="json")
    return doc


def load(name: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((DOCS / name).read_text())
    return result


@functools.cache
def validator(name: str) -> Draft202012Validator:
    from referencing import Registry, Resource

    s = load(name)
    Draft202012Validator.check_schema(s)
    # cmd.submit's spec is the file beside it (the job spec as a person writes it)
    registry: Registry = Registry().with_resource(schema.JOBSPEC_FILE, Resource.from_contents(load(schema.JOBSPEC_FILE)))
    return Draft202012Validator(s, format_checker=Draft202012Validator.FORMAT_CHECKER, registry=registry)


def test_examples_cover_every_type() -> None:
    assert set(EXAMPLES) == set(PAYLOAD_TYPES)


def test_docs_schemas_in_sync() -> None:
    assert schema.check_in_sync(DOCS) == [], "run: .venv/bin/python -m gpufleet.shared.contract.schema docs/schemas"


def test_every_type_has_a_standalone_documented_schema() -> None:
    for t, cls in PAYLOAD_TYPES.items():
        s = load(schema.schema_file(t))
        assert s["$schema"] == schema.DRAFT
        assert s["title"] == t
        assert s["description"] and "\n" not in s["description"]
        assert s["description"] == " ".join((cls.__doc__ or "").split())
        assert s["properties"]["type"]["const"] == t
        refs = set(re.findall(r'"\$ref": "([^"]+)"', json.dumps(s)))
        assert all(r.startswith("#/$defs/") and r.removeprefix("#/$defs/") in s["$defs"] for r in refs), refs


@pytest.mark.parametrize("t", TYPES)
def test_schema_validates_real_envelope(t: str) -> None:
    for doc in (wire(t), json.loads(envelope(t).to_json())):
        validator(schema.schema_file(t)).validate(doc)
        validator(schema.ENVELOPE_FILE).validate(doc)


@pytest.mark.parametrize("t", TYPES)
def test_payload_type_may_be_omitted(t: str) -> None:
    doc = wire(t)
    del doc["payload"]["type"]
    env = Envelope.model_validate(doc)
    assert env.payload.type == t
    assert parse_envelope(json.dumps(doc)) == env  # read from its bytes as the services read it
    bad = {**doc, "payload": {**doc["payload"], "not_a_field": 1}}  # and what is wrong besides is named as ever
    with pytest.raises(ValidationError, match="not_a_field"):
        parse_envelope(json.dumps(bad))
    validator(schema.schema_file(t)).validate(doc)
    validator(schema.ENVELOPE_FILE).validate(doc)


def _other(t: str) -> str:
    other: str = next(o for o in TYPES if o != t)
    return other


@pytest.mark.parametrize("t", TYPES)
def test_wrong_type_const_fails(t: str) -> None:
    doc = wire(t)
    doc["type"] = _other(t)
    assert not validator(schema.schema_file(t)).is_valid(doc)
    assert not validator(schema.ENVELOPE_FILE).is_valid(doc)
    with pytest.raises(ValidationError):
        Envelope.model_validate(doc)
    doc = wire(t)
    doc["payload"]["type"] = _other(t)
    assert not validator(schema.schema_file(t)).is_valid(doc)
    doc["type"] = "job.nonexistent"
    assert not validator(schema.ENVELOPE_FILE).is_valid(doc)


@pytest.mark.parametrize("t", TYPES)
def test_missing_required_payload_field_fails(t: str) -> None:
    required = [f for f, info in PAYLOAD_TYPES[t].model_fields.items() if info.is_required()]
    assert required
    for field in required:
        doc = wire(t)
        del doc["payload"][field]
        assert not validator(schema.schema_file(t)).is_valid(doc), field
        assert not validator(schema.ENVELOPE_FILE).is_valid(doc), field
        with pytest.raises(ValidationError):
            Envelope.model_validate(doc)


@pytest.mark.parametrize("t", TYPES)
def test_unknown_field_fails(t: str) -> None:
    for where in ("envelope", "payload"):
        doc = wire(t)
        (doc if where == "envelope" else doc["payload"])["surprise"] = 1
        assert not validator(schema.schema_file(t)).is_valid(doc), where
        with pytest.raises(ValidationError):
            Envelope.model_validate(doc)


def test_another_types_payload_fails() -> None:
    doc = wire("job.placed")
    doc["payload"] = wire("job.admitted")["payload"]
    assert not validator(schema.schema_file("job.placed")).is_valid(doc)
    assert not validator(schema.ENVELOPE_FILE).is_valid(doc)


@pytest.mark.parametrize("bad", ["a.b", "a*", ">", "", "with space", "x" * 65])
def test_subject_tokens_are_constrained_like_the_models(bad: str) -> None:
    cases = [("job.placed", ("payload", "job_id")), ("node.lost", ("payload", "node_id")), ("job.admitted", ("tenant",))]
    for t, path in cases:
        doc = wire(t)
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = bad
        assert not validator(schema.schema_file(t)).is_valid(doc), (t, path)
        with pytest.raises(ValidationError):
            Envelope.model_validate(doc)


# ids that are 26 characters but not a ULID: each letter Crockford's base32 leaves out, lower
# case, a first character over 7 (more than 48 bits of time)
NOT_ULIDS = ["01JH3Z6V7R8K9M0N1P2Q3R4S5I", "01JH3Z6V7R8K9M0N1P2Q3R4S5L", "O1JH3Z6V7R8K9M0N1P2Q3R4S5T",
             "01JH3Z6V7R8K9M0N1P2Q3R4S5U", "01jh3z6v7r8k9m0n1p2q3r4s5t", "81JH3Z6V7R8K9M0N1P2Q3R4S5T",
             "ZZZZZZZZZZZZZZZZZZZZZZZZZZ", "01JH3Z6V7R8K9M0N1P2Q3R4S5-", "x" * 26]


def test_the_ulid_pattern_takes_exactly_what_the_services_take() -> None:
    """`ULID_PATTERN` (event_id's `pattern` in every schema) and `is_ulid` (what the services
    check) agree on every character in every position that matters."""
    pattern = re.compile(ULID_PATTERN)
    base = "01JH3Z6V7R8K9M0N1P2Q3R4S5T"
    assert is_ulid(base) and pattern.search(base)
    for pos in (0, 1, 25):
        for c in map(chr, range(32, 127)):
            v = base[:pos] + c + base[pos + 1:]
            assert bool(pattern.search(v)) == is_ulid(v), (pos, c)
    for v in [*NOT_ULIDS, base[:-1], base + "0", "7ZZZZZZZZZZZZZZZZZZZZZZZZZ", ulid(2**48 - 1, bytes(10))]:
        assert bool(pattern.search(v)) == is_ulid(v), v
    env = load(schema.ENVELOPE_FILE)["properties"]["event_id"]
    assert env["pattern"] == ULID_PATTERN and "I L O U" in env["description"]
    headers = yaml.safe_load((DOCS / schema.ASYNCAPI_FILE).read_text())["components"]["schemas"]
    assert headers["FleetHeaders"]["properties"]["Nats-Msg-Id"]["pattern"] == ULID_PATTERN


@pytest.mark.parametrize("bad", NOT_ULIDS)
def test_an_event_id_that_is_not_a_ulid_is_refused_by_the_schema_and_by_the_services(bad: str) -> None:
    from gpufleet.shared.runtime.engine import refusal

    good = wire("cmd.submit")
    env = Envelope.model_validate(good)
    assert validator(schema.schema_file("cmd.submit")).is_valid(good)
    assert refusal(env, env.subject(), {"Nats-Msg-Id": env.event_id}) is None
    doc = {**good, "event_id": bad}
    for name in (schema.schema_file("cmd.submit"), schema.ENVELOPE_FILE):
        assert not validator(name).is_valid(doc), (name, bad)
    # the services: the envelope parses (26 characters), and the contract's rules refuse it, naming event_id
    env = Envelope.model_validate(doc)
    refused = refusal(env, env.subject(), {"Nats-Msg-Id": bad})
    assert refused is not None and [f for f, _ in refused[1]] == ["event_id"], refused
    # an event with one is refused by its schema as well (every event the services publish has a ULID)
    assert not validator(schema.schema_file("job.placed")).is_valid({**wire("job.placed"), "event_id": bad})


def test_newer_schema_version_fails() -> None:
    doc = wire("job.admitted")
    doc["schema_version"] += 1
    assert not validator(schema.schema_file("job.admitted")).is_valid(doc)
    with pytest.raises(ValidationError):
        Envelope.model_validate(doc)


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    """The object a local $ref points to, following references to references."""
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    if isinstance(node, dict) and set(node) == {"$ref"}:
        return _resolve(doc, node["$ref"])
    return node


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_asyncapi_document() -> None:
    doc = yaml.safe_load((DOCS / schema.ASYNCAPI_FILE).read_text())
    assert doc["asyncapi"] == "3.0.0"
    assert doc["servers"]["nats"]["protocol"] == "nats"
    addresses = {ch["address"] for ch in doc["channels"].values()}
    assert addresses == {
        "fleet.cmd.{tenant}.{verb}",
        "fleet.evt.{tenant}.job.{job_id}.{type}",
        "fleet.evt.sys.node.{node_id}.{type}",
        "fleet.evt.sys.deadletter.{service}",
        "fleet.evt.sys.capacity.{service}",
        "fleet.evt.sys.budget.{scope}.{budget}.{type}",
        "fleet.tel.node.{node_id}.{kind}",
        "fleet.logs.{tenant}.{node_id}", None,  # a run's logs: request/reply, in no stream (the reply: an inbox)
    }
    for ch in doc["channels"].values():
        assert set(re.findall(r"\{(\w+)\}", ch["address"] or "")) == set(ch.get("parameters", {}))
    assert "Nats-Msg-Id" in doc["info"]["description"] and "event_id" in doc["info"]["description"]

    # every internal reference resolves; every external one names a file that is there
    for ref in _refs(doc):
        if ref.startswith("#/"):
            _resolve(doc, ref)
        else:
            assert (DOCS / ref).is_file(), ref

    # every type is a message on exactly one channel, its payload the type's schema file
    seen: dict[str, str] = {}
    for key, ch in doc["channels"].items():
        if key in ("logs", "logsReply"):
            continue  # not envelopes: their own schemas (below)
        for ref in ch["messages"].values():
            msg = _resolve(doc, ref["$ref"])
            assert msg["name"] not in seen
            seen[msg["name"]] = key
            payload = _resolve(doc, msg["payload"]["$ref"])
            assert payload["schema"]["$ref"] == f"./{schema.schema_file(msg['name'])}"
    assert set(seen) == set(PAYLOAD_TYPES)

    # commands are sent, everything else received
    for op in doc["operations"].values():
        channel = op["channel"]["$ref"].removeprefix("#/channels/")
        assert op["action"] == ("send" if channel in ("commands", "logs") else "receive")
        assert all(m["$ref"].startswith(f"#/channels/{channel}/messages/") for m in op["messages"])
    sent = {_resolve(doc, m["$ref"])["name"] for op in doc["operations"].values() if op["action"] == "send"
            for m in op["messages"]}
    assert sent == {"cmd.submit", "cmd.cancel", "cmd.report_load", "logs.request"}
    # a log request is answered with a log reply, each with its schema file
    reply = doc["operations"]["requestLogs"]["reply"]
    assert _resolve(doc, reply["messages"][0]["$ref"])["name"] == "logs.reply"
    for name in (schema.LOGS_REQUEST_FILE, schema.LOGS_REPLY_FILE):
        assert json.loads((DOCS / name).read_text())["$id"] == name


@pytest.mark.parametrize("t", TYPES)
def test_subject_templates_match_real_subjects(t: str) -> None:
    env = envelope(t)
    template = schema.subject_template(t)
    values = {"tenant": env.tenant, "job_id": env.job_id, "node_id": env.node_id,
              "service": getattr(env.payload, "service", None), "scope": getattr(env.payload, "scope", None),
              "budget": getattr(env.payload, "budget", None)}
    assert re.sub(r"\{(\w+)\}", lambda m: str(values[m.group(1)]), template) == env.subject()


def test_readme_lists_every_type() -> None:
    text = (DOCS / schema.README_FILE).read_text()
    for t, cls in PAYLOAD_TYPES.items():
        line = next(line for line in text.splitlines() if line.startswith(f"| [`{t}`]"))
        assert schema.subject_template(t) in line
        assert " ".join((cls.__doc__ or "").split()) in line


def test_check_in_sync_reports_differences(tmp_path: Path) -> None:
    written = schema.export(tmp_path)
    assert {p.name for p in written} == set(schema.render())
    assert schema.check_in_sync(tmp_path) == []
    assert schema.export(tmp_path) == written and schema.check_in_sync(tmp_path) == []  # deterministic
    (tmp_path / "job.placed.schema.json").write_text("{}")
    (tmp_path / schema.README_FILE).unlink()
    (tmp_path / "job.gone.schema.json").write_text("{}")
    assert schema.check_in_sync(tmp_path) == [schema.README_FILE, "job.gone.schema.json", "job.placed.schema.json"]
    schema.export(tmp_path)
    assert schema.check_in_sync(tmp_path) == []
    assert not (tmp_path / "job.gone.schema.json").exists()
