"""The job spec's JSON Schema (docs/schemas/jobspec.schema.json) and the service agree: every
example and every case of the admission catalogue is valid by the schema exactly when the
service's own parse takes it, the schema's own examples are taken by both, its defaults are
written as a person writes them and parse to the model's defaults, and cmd.submit's schema
points at it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.shared.contract.errors import SpecError
from gpufleet.shared.contract.schema import (
    JOBSPEC_FILE,
    SPEC_EXAMPLES,
    spec_schema,
    type_schema,
    user_quantity,
)
from gpufleet.shared.contract.spec import (
    AutoscaleSpec,
    CheckpointSpec,
    JobSpec,
    Resources,
    SimRun,
    SimSpec,
    parse_cpu_milli,
    parse_memory_mib,
    parse_spec,
)

from .builders import Harness, submit
from .test_admission_catalogue import CONFIG, SPECS, job

REPO = Path(__file__).resolve().parent.parent
SCHEMA = spec_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def _service_takes(doc: dict[str, Any]) -> bool:
    """Admission's own verdict on the spec (its parse and its checks of the spec alone): anything
    but `invalid_spec` (a policy's or the cluster's refusal is about this cluster, not the spec)."""
    try:
        parse_spec(doc, user=True)
    except SpecError:
        return False
    cmd = submit(doc, "j1", tenant=str(doc.get("tenant") or "acme"))
    out = Harness(AdmissionCore(CONFIG)).when(cmd)
    rejected = [e for e in out if e.type in ("job.rejected", "job.request_refused")]
    return not any(r.code == "invalid_spec" for e in rejected for r in e.payload.reasons)  # type: ignore[union-attr]


# the rules across the fields of `resources`: a share of a GPU, MIG instances, GPU memory
RESOURCE_CASES: dict[str, dict[str, Any]] = {
    "a quarter of a gpu": {"gpu": 0.25, "gpuSharing": "shared"},
    "a share without sharing": {"gpu": 0.25},
    "a share marked exclusive": {"gpu": 0.25, "gpuSharing": "exclusive"},
    "a shared 1.5": {"gpu": 1.5, "gpuSharing": "shared"},
    "a negative share": {"gpu": -0.5, "gpuSharing": "shared"},
    "a tiny share": {"gpu": 0.0001, "gpuSharing": "shared"},
    "a share of a model": {"gpu": 0.5, "gpuSharing": "shared", "gpuModel": "H100"},
    "a share and mig": {"gpu": 0.5, "gpuSharing": "shared", "mig": {"1g.10gb": 1}},
    "a share with gpu memory": {"gpu": 0.5, "gpuSharing": "shared", "gpuMemory": "10Gi"},
    "two shared gpus": {"gpu": 2, "gpuSharing": "shared"},
    "mig of a model": {"gpu": 0, "mig": {"1g.10gb": 1}, "gpuModel": "H100"},
    "mig of models": {"gpu": 0, "mig": {"1g.10gb": 1}, "gpuModels": ["H100", "A100"]},
    "mig count 0": {"gpu": 0, "mig": {"1g.10gb": 0}},
    "mig count 65": {"gpu": 0, "mig": {"1g.10gb": 65}},
    "a model without gpus": {"gpu": 0, "gpuModel": "H100"},
    "gpu memory without gpus": {"gpu": 0, "gpuMemory": "10Gi"},
    "no gpu memory without gpus": {"gpu": 0, "gpuMemory": "0Gi"},
    "gpuMilli without sharing": {"gpuMilli": 250},
    "gpuMilli of two gpus": {"gpu": 2, "gpuMilli": 250, "gpuSharing": "shared"},
    "gpuMilli of no gpu": {"gpu": 0, "gpuMilli": 250, "gpuSharing": "shared"},
}


def _cases() -> list[tuple[str, dict[str, Any]]]:
    out = [(f"example {p.name}", yaml.safe_load(p.read_text())) for p in sorted((REPO / "examples").glob("*.yaml"))]
    out = [(n, d) for n, d in out if isinstance(d, dict) and ("resources" in d or "name" in d)]
    out += [(f"catalogue: {name}", spec) for name, (spec, *_rest) in SPECS.items()]
    out += [("minimal", {"name": "a", "tenant": "acme"}), ("quantities", job(r_cpu="500m", r_memory="16Gi")),
            ("a share", job(r_gpuMilli=250, r_gpuSharing="shared")), ("mig", job(r_gpu=0, r_mig={"1g.10gb": 2})),
            ("no tenant", {"name": "a"}), ("cpu as a word", job(r_cpu="lots")),
            ("autoscale on batch", {**job(), "type": "batch", "autoscale": {"minReplicas": 1, "maxReplicas": 2}})]
    out += [(f"schema example {e['name']}", e) for e in SCHEMA["examples"]]
    out += [(f"resources {name}", job(**{f"r_{k}": v for k, v in res.items()}))
            for name, res in RESOURCE_CASES.items()]
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


def test_the_schema_has_examples_and_both_take_every_one() -> None:
    """docs/clients.md promises examples: a 1-GPU sim batch job, a training job with a checkpoint,
    a gang, in the user's spelling; the schema and the service's own parser take each."""
    examples = SCHEMA["examples"]
    assert examples == list(SPEC_EXAMPLES) and len(examples) >= 3
    for e in examples:
        assert VALIDATOR.is_valid(e), (e["name"], [x.message for x in VALIDATOR.iter_errors(e)][:3])
        spec = parse_spec(e, user=True)
        assert _service_takes(e), e["name"]
        assert not any(k in json.dumps(e) for k in ("cpu_milli", "memory_mib", "duration_s")), e["name"]
        assert spec.name == e["name"]
    specs = [parse_spec(e, user=True) for e in examples]
    assert any(s.type == "batch" and s.resources.gpu == 1 and s.replicas == 1 and "sim" in e
               for s, e in zip(specs, examples, strict=True))
    assert any(s.type == "training" and s.checkpoint is not None for s in specs)
    assert any(s.replicas > 1 for s in specs)  # a gang
    assert any(isinstance(e["resources"].get("cpu"), str) and e["resources"]["cpu"].endswith("m") for e in examples)
    assert any(isinstance(e.get("sim", {}).get("duration"), str) for e in examples)
    # the file holds them too
    on_disk = json.loads((REPO / "docs" / "schemas" / JOBSPEC_FILE).read_text())
    assert on_disk["examples"] == examples


# each model of the spec, the fields it needs to be valid at all, and its default as the model has it
_MODELS: list[tuple[str, type[Any], dict[str, Any]]] = [
    ("JobSpec", JobSpec, {"name": "a", "tenant": "acme"}),
    ("Resources", Resources, {}),
    ("SimSpec", SimSpec, {}),
    ("CheckpointSpec", CheckpointSpec, {}),
    ("AutoscaleSpec", AutoscaleSpec, {"targetRpsPerReplica": 40}),
    ("SimRun", SimRun, {"duration": "1s"}),
]


def _defaults(props: dict[str, Any]) -> dict[str, Any]:
    return {k: p["default"] for k, p in props.items() if "default" in p}


@pytest.mark.parametrize(("name", "model", "needs"), _MODELS, ids=[m[0] for m in _MODELS])
def test_every_default_is_in_the_users_spelling_and_parses_to_the_models(
        name: str, model: type[Any], needs: dict[str, Any]) -> None:
    props = (SCHEMA if name == "JobSpec" else SCHEMA["$defs"][name])["properties"]
    defaults = _defaults(props)
    assert defaults or name == "SimRun"
    # all the published defaults at once, written into a spec, are the model's defaults
    got = model.model_validate({**defaults, **needs}, by_alias=True, by_name=False)
    want = model.model_validate(needs, by_alias=True, by_name=False)
    assert got.model_dump() == want.model_dump(), name
    # and each alone, through the parser of its field
    for alias, value in defaults.items():
        if alias in needs:
            continue
        one = model.model_validate({**needs, alias: value}, by_alias=True, by_name=False)
        assert one.model_dump() == want.model_dump(), (name, alias, value)
        # a quantity's default is written with its unit, as its description says (a string)
        if "anyOf" in props[alias] and any(a.get("pattern") for a in props[alias]["anyOf"]):
            assert value is None or isinstance(value, str), (name, alias, value)


def test_the_defaults_the_client_found_in_normalised_units() -> None:
    res = _defaults(SCHEMA["$defs"]["Resources"]["properties"])
    sim = _defaults(SCHEMA["$defs"]["SimSpec"]["properties"])
    assert (res["cpu"], res["memory"], sim["gpuMemoryUsed"]) == ("1", "1Gi", "2Gi")
    assert parse_cpu_milli(res["cpu"]) == Resources().cpu_milli == 1000
    assert parse_memory_mib(res["memory"]) == Resources().memory_mib == 1024
    assert parse_memory_mib(sim["gpuMemoryUsed"]) == SimSpec().gpu_mem_used_mib == 2048
    # maxRuntime has no default on the wire (not given: the 24 h limit, and a learned estimate)
    assert SCHEMA["properties"]["maxRuntime"]["default"] is None is JobSpec.model_fields["max_runtime_s"].default
    assert JobSpec(name="x", tenant="t").runtime_limit_s == 86400.0
    assert "24 h" in SCHEMA["properties"]["maxRuntime"]["description"]
    # the defaults of whole objects too (`resources`, `sim`): as a person writes them, and valid by the schema
    for key, model in (("resources", Resources), ("sim", SimSpec)):
        whole = SCHEMA["properties"][key]["default"]
        assert whole == {**whole, **_defaults(SCHEMA["$defs"][model.__name__]["properties"])}, key
        doc = {"name": "a", "tenant": "acme", key: whole}
        assert VALIDATOR.is_valid(doc), (key, [x.message for x in VALIDATOR.iter_errors(doc)][:3])
        assert getattr(parse_spec(doc, user=True), key).model_dump() == model().model_dump(), key
        assert isinstance(whole.get("cpu", whole.get("duration")), str), key  # not a number in normalised units


@pytest.mark.parametrize(("func", "value", "text"), [
    ("parse_cpu_milli", 1000, "1"), ("parse_cpu_milli", 1500, "1500m"), ("parse_cpu_milli", 0, "0"),
    ("parse_memory_mib", 1024, "1Gi"), ("parse_memory_mib", 2048, "2Gi"), ("parse_memory_mib", 1536, "1536Mi"),
    ("parse_memory_mib", 1024 * 1024, "1Ti"), ("parse_memory_mib", 0, "0"),
    ("parse_duration_s", 86400.0, "1d"), ("parse_duration_s", 1800.0, "30m"), ("parse_duration_s", 10.0, "10s"),
    ("parse_duration_s", 0.5, "500ms"), ("parse_duration_s", 5400.0, "90m"),
])
def test_user_quantity_is_what_the_parser_reads_back(func: str, value: Any, text: str) -> None:
    import gpufleet.shared.contract.spec as spec_mod

    assert user_quantity(func, value) == text
    assert getattr(spec_mod, func)(text) == value
