"""The job spec's JSON Schema (docs/schemas/jobspec.schema.json) and the service agree: every
example and every case of the admission catalogue is valid by the schema exactly when the
service's own parse takes it, and cmd.submit's schema points at it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.shared.contract.errors import SpecError
from gpufleet.shared.contract.schema import JOBSPEC_FILE, spec_schema, type_schema
from gpufleet.shared.contract.spec import parse_spec

from .builders import Harness, submit
from .test_admission_catalogue import CONFIG, SPECS, job

REPO = Path(__file__).resolve().parent.parent
VALIDATOR = jsonschema.Draft202012Validator(spec_schema())



def _service_takes(doc: dict[str, Any]) -> bool:
    """Admission's own verdict on the spec (its parse and its checks of the spec alone): anything
    but `invalid_spec` (a policy's or the cluster's refusal is about this cluster, not the spec)."""
    try:
        parse_spec(doc)
    except SpecError:
        return False
    cmd = submit(doc, "j1", tenant=str(doc.get("tenant") or "acme"))
    out = Harness(AdmissionCore(CONFIG)).when(cmd)
    rejected = [e for e in out if e.type in ("job.rejected", "job.request_refused")]
    return not any(r.code == "invalid_spec" for e in rejected for r in e.payload.reasons)  # type: ignore[union-attr]


def _cases() -> list[tuple[str, dict[str, Any]]]:
    out = [(f"example {p.name}", yaml.safe_load(p.read_text())) for p in sorted((REPO / "examples").glob("*.yaml"))]
    out = [(n, d) for n, d in out if isinstance(d, dict) and ("resources" in d or "name" in d)]
    out += [(f"catalogue: {name}", spec) for name, (spec, *_rest) in SPECS.items()]
    out += [("minimal", {"name": "a", "tenant": "acme"}), ("quantities", job(r_cpu="500m", r_memory="16Gi")),
            ("a share", job(r_gpuMilli=250, r_gpuSharing="shared")), ("mig", job(r_gpu=0, r_mig={"1g.10gb": 2})),
            ("no tenant", {"name": "a"}), ("cpu as a word", job(r_cpu="lots")),
            ("autoscale on batch", {**job(), "type": "batch", "autoscale": {"minReplicas": 1, "maxReplicas": 2}})]
    return out


@pytest.mark.parametrize(("name", "doc"), _cases(), ids=[n for n, _ in _cases()])
def test_the_schema_and_the_service_agree_on_every_spec(name: str, doc: dict[str, Any]) -> None:
    by_schema = VALIDATOR.is_valid(doc)
    by_service = _service_takes(doc)
    assert by_schema == by_service, (name, [e.message for e in VALIDATOR.iter_errors(doc)][:3])


def test_the_schema_file_is_exported_and_cmd_submit_points_at_it() -> None:
    on_disk = json.loads((REPO / "docs" / "schemas" / JOBSPEC_FILE).read_text())
    assert on_disk == spec_schema()
    submit = type_schema("cmd.submit")
    spec = next(d for d in submit["$defs"].values() if "spec" in d.get("properties", {}))["properties"]["spec"]
    assert spec["$ref"] == "#/$defs/UserJobSpec"  # the same schema, inlined: the file stands alone
    inlined = jsonschema.Draft202012Validator(submit)
    good = {"event_id": "01KDWQT620000000000000YGJ0", "type": "cmd.submit", "schema_version": 1,
            "occurred_at": "2026-01-01T00:00:00Z", "tenant": "acme", "actor": "acme/cli",
            "payload": {"job_id": "j1", "type": "cmd.submit", "spec": {"name": "a", "tenant": "acme",
                                                                      "resources": {"cpu": "500m"}}}}
    assert inlined.is_valid(good)
    assert not inlined.is_valid({**good, "payload": {**good["payload"], "spec": {"name": "a", "tenant": "acme",
                                                                                "resources": {"cpu_milli": 500}}}})
    assert set(on_disk["required"]) == {"name", "tenant"} and on_disk["additionalProperties"] is False
