"""The job spec: quantities, durations, and errors that name the field. Table-driven."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from gpufleet.shared.contract.errors import SpecError
from gpufleet.shared.contract.spec import (
    JobSpec,
    load_spec_yaml,
    parse_cpu_milli,
    parse_duration_s,
    parse_memory_mib,
    parse_spec,
    spec_to_user,
    spec_to_wire,
)

from .builders import JobBuilder, make_job

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# ---------------------------------------------------------------- quantities


@pytest.mark.parametrize(("value", "milli"), [
    ("500m", 500), ("1m", 1), (2, 2000), ("2", 2000), (1.5, 1500), ("1.5", 1500), ("0.25", 250),
    ("1.001", 1001), (0.001, 1), ("64", 64_000), (" 250m ", 250), (0, 0),
])
def test_cpu_quantity(value: Any, milli: int) -> None:
    assert parse_cpu_milli(value) == milli


@pytest.mark.parametrize(("value", "mib"), [
    ("128Gi", 128 * 1024), ("512Mi", 512), ("1Ti", 1024 * 1024), ("1.5Gi", 1536), ("64Ki", 1),
    (1024 * 1024, 1), (1024**3, 1024), (1000, 1),  # bare numbers are bytes, rounded up to a MiB
    ("1G", 954), ("1M", 1),  # decimal units, rounded up: never under-reserve
])
def test_memory_quantity(value: Any, mib: int) -> None:
    assert parse_memory_mib(value) == mib


@pytest.mark.parametrize(("value", "seconds"), [
    ("90s", 90.0), ("30m", 1800.0), ("2h", 7200.0), ("1d", 86400.0), ("500ms", 0.5), ("0.5s", 0.5),
    (45, 45.0), (2.5, 2.5), ("120", 120.0),
])
def test_duration(value: Any, seconds: float) -> None:
    assert parse_duration_s(value) == seconds


@pytest.mark.parametrize(("parse", "value", "says"), [
    (parse_cpu_milli, "0.0001", "finer than 1m"),
    (parse_cpu_milli, "1.5m", "finer than 1m"),
    (parse_cpu_milli, "2 cores", "CPU quantity"),
    (parse_cpu_milli, True, "not a boolean"),
    (parse_cpu_milli, [2], "got list"),
    (parse_cpu_milli, -1, "CPU quantity"),
    (parse_memory_mib, "12GB", "memory quantity"),
    (parse_memory_mib, False, "not a boolean"),
    (parse_memory_mib, "-1Gi", "memory quantity"),
    (parse_duration_s, "2 hours", "duration"),
    (parse_duration_s, "-5s", "duration"),
    (parse_duration_s, -5, "not be negative"),
    (parse_duration_s, math.inf, "finite"),
    (parse_duration_s, None, "got NoneType"),
])
def test_bad_quantity(parse: Any, value: Any, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse(value)


# ---------------------------------------------------------------- whole specs: valid


VALID: list[tuple[str, JobBuilder, dict[str, Any]]] = [
    ("defaults", make_job(),
     {"queue": "default", "type": "batch", "replicas": 1, "priority": 0, "max_runtime_s": 86400.0}),
    ("milli cpu", make_job().cpu("500m"), {"cpu_milli": 500}),
    ("whole cpu", make_job().cpu(2), {"cpu_milli": 2000}),
    ("fractional cpu", make_job().cpu(1.5), {"cpu_milli": 1500}),
    ("Gi memory", make_job().memory("128Gi"), {"memory_mib": 131072}),
    ("Mi memory", make_job().memory("512Mi"), {"memory_mib": 512}),
    ("bytes memory", make_job().memory(2 * 1024**3), {"memory_mib": 2048}),
    ("gpus", make_job().gpus(8), {"gpu": 8, "gpus_total": 8}),
    ("whole float gpus", make_job().gpus(2.0), {"gpu": 2}),
    ("one model", make_job().gpus(8).model("H100"), {"gpu_models": ("H100",)}),
    ("model list", make_job().gpus(1).res("gpuModels", ["H100", "A100"]), {"gpu_models": ("H100", "A100")}),
    ("gpu memory", make_job().gpus(1).res("gpuMemory", "80Gi"), {"gpu_memory_mib": 81920}),
    ("gang", make_job().gpus(8).replicas(2), {"replicas": 2, "gpus_total": 16}),
    ("queue and type", make_job().queue("a").type("training"), {"queue": "a", "type": "training"}),
    ("priority", make_job().priority(-5), {"priority": -5}),
    ("90s runtime", make_job().max_runtime("90s"), {"max_runtime_s": 90.0}),
    ("30m runtime", make_job().max_runtime("30m"), {"max_runtime_s": 1800.0}),
    ("2h runtime", make_job().max_runtime("2h"), {"max_runtime_s": 7200.0}),
    ("sim", make_job().runs("0.5s", 3), {"sim_duration_s": 0.5, "sim_exit_code": 3}),
    ("checkpoint", make_job().set("checkpoint", {"path": "/ckpt/x", "interval": "10m"}),
     {"checkpoint_interval_s": 600.0}),
    ("ids with - and _", make_job("res-net_50", "team-a_1").queue("q_1"), {"name": "res-net_50", "tenant": "team-a_1"}),
    ("image and command", make_job().set("image", "pytorch:2").set("command", ["python", "train.py"]),
     {"command": ("python", "train.py")}),
]


def _facts(spec: JobSpec) -> dict[str, Any]:
    r = spec.resources
    return {
        "name": spec.name, "tenant": spec.tenant, "queue": spec.queue, "type": spec.type, "priority": spec.priority,
        "replicas": spec.replicas, "max_runtime_s": spec.runtime_limit_s, "cpu_milli": r.cpu_milli,
        "memory_mib": r.memory_mib, "gpu": r.gpu, "gpu_models": r.gpu_models, "gpu_memory_mib": r.gpu_memory_mib,
        "gpus_total": spec.gpus_total, "sim_duration_s": spec.sim.duration_s, "sim_exit_code": spec.sim.exit_code,
        "checkpoint_interval_s": spec.checkpoint.interval_s if spec.checkpoint else None, "command": spec.command,
    }


@pytest.mark.parametrize(("job", "expected"), [(j, e) for _, j, e in VALID], ids=[n for n, _, _ in VALID])
def test_valid_spec(job: JobBuilder, expected: dict[str, Any]) -> None:
    facts = _facts(parse_spec(job.dict()))
    assert {k: facts[k] for k in expected} == expected


@pytest.mark.parametrize("job", [j for _, j, _ in VALID], ids=[n for n, _, _ in VALID])
def test_wire_round_trip(job: JobBuilder) -> None:
    spec = parse_spec(job.dict())
    wire = spec_to_wire(spec)
    assert parse_spec(wire, user=False) == spec
    assert spec_to_wire(parse_spec(wire, user=False)) == wire  # the canonical form is a fixed point
    assert parse_spec(spec_to_user(spec)) == spec  # and the form a client writes


def test_a_client_writes_one_spelling_per_field() -> None:
    """`cmd.submit` takes the user-facing names only (docs/schemas/jobspec.schema.json); the
    normalised ones the events carry are refused, each naming the spelling to write."""
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "x", "tenant": "acme", "resources": {"cpu_milli": 500, "gpu": 1},
                    "sim": {"duration_s": 5}, "max_runtime_s": 60})
    fields = dict(err.value.errors)
    assert set(fields) == {"resources.cpu_milli", "sim.duration_s", "max_runtime_s"}, fields
    assert "write `cpu`" in fields["resources.cpu_milli"] and "write `duration`" in fields["sim.duration_s"]
    assert "write `maxRuntime`" in fields["max_runtime_s"]
    assert parse_spec({"name": "x", "tenant": "acme", "resources": {"cpu": "500m"}, "sim": {"duration": 5},
                       "maxRuntime": 60}).resources.cpu_milli == 500


def test_wire_form_is_canonical_units() -> None:
    wire = spec_to_wire(make_job().cpu("500m").memory("2Gi").gpus(1).max_runtime("2h").spec())
    assert wire["resources"]["cpu_milli"] == 500
    assert wire["resources"]["memory_mib"] == 2048
    assert wire["max_runtime_s"] == 7200.0


def test_example_yaml_loads() -> None:
    spec = load_spec_yaml((EXAMPLES / "train-resnet.yaml").read_text())
    assert (spec.tenant, spec.type, spec.resources.gpu, spec.resources.gpu_models) == ("acme", "training", 8, ("H100",))
    assert spec.resources.memory_mib == 256 * 1024 and spec.max_runtime_s == 7200.0


# ---------------------------------------------------------------- whole specs: invalid


INVALID: list[tuple[str, JobBuilder | Any, str, str]] = [
    # (case, spec, the field the error must name, words the reason must contain)
    ("negative gpus", make_job().gpus(-1), "resources.gpu", "greater than or equal to 0"),
    ("fractional gpus", make_job().gpus(0.5), "resources.gpu", "whole number of GPUs"),
    ("gpus as string", make_job().gpus("8"), "resources.gpu", "not a string"),
    ("gpus as bool", make_job().gpus(True), "resources.gpu", "whole number"),
    ("too many gpus", make_job().gpus(5000), "resources.gpu", "less than or equal to 1024"),
    ("gang size 0", make_job().replicas(0), "replicas", "greater than or equal to 1"),
    ("gang size 1.5", make_job().replicas(1.5), "replicas", "whole number"),
    ("gang size as string", make_job().replicas("2"), "replicas", "whole number"),
    ("unknown field", make_job().set("gpus", 8), "gpus", "unknown field"),
    ("unknown resource field", make_job().res("tpu", 1), "resources.tpu", "unknown field"),
    ("unknown sim field", make_job().set("sim", {"duration": "1s", "exit": 0}), "sim.exit", "unknown field"),
    ("cpu as list", make_job().cpu([1]), "resources.cpu", "CPU quantity"),
    ("cpu finer than 1m", make_job().cpu("0.0001"), "resources.cpu", "finer than 1m"),
    ("negative cpu", make_job().cpu(-2), "resources.cpu", "CPU quantity"),
    ("memory without a unit we know", make_job().memory("12GB"), "resources.memory", "memory quantity"),
    ("memory as bool", make_job().memory(True), "resources.memory", "not a boolean"),
    ("resources not a mapping", make_job().set("resources", "big"), "resources", "valid dictionary"),
    ("priority as bool", make_job().priority(True), "priority", "whole number"),
    ("priority too high", make_job().priority(10**9), "priority", "less than or equal"),
    ("unknown job type", make_job().type("mining"), "type", "'training'"),
    ("env value not a string", make_job().set("env", {"A": 1}), "env.A", "valid string"),
    ("command as one string", make_job().set("command", "python train.py"), "command", "valid tuple"),
    ("zero runtime", make_job().max_runtime(0), "maxRuntime", "greater than 0"),
    ("negative runtime", make_job().max_runtime("-5s"), "maxRuntime", "duration"),
    ("runtime in words", make_job().max_runtime("two hours"), "maxRuntime", "duration"),
    ("infinite runtime", make_job().max_runtime(math.inf), "maxRuntime", "finite"),
    ("exit code over 255", make_job().runs("1s", 300), "sim.exitCode", "less than or equal to 255"),
    ("checkpoint keep 0", make_job().set("checkpoint", {"keep": 0}), "checkpoint.keep", "greater than or equal to 1"),
    ("name with '.'", make_job("a.b"), "name", "used in NATS subjects"),
    ("name with '*'", make_job("a*"), "name", "used in NATS subjects"),
    ("name with '>'", make_job("a>"), "name", "used in NATS subjects"),
    ("name with a space", make_job("a b"), "name", "used in NATS subjects"),
    ("name with leading '$'", make_job("$SYS"), "name", "used in NATS subjects"),
    ("empty name", make_job(""), "name", "1-64 characters"),
    ("name too long", make_job("x" * 65), "name", "1-64 characters"),
    ("name not a string", make_job().name(7), "name", "got 7"),
    ("tenant with '.'", make_job(tenant="acme.evil"), "tenant", "used in NATS subjects"),
    ("tenant with '>'", make_job(tenant=">"), "tenant", "used in NATS subjects"),
    ("tenant sys", make_job(tenant="sys"), "tenant", "reserved"),
    ("queue with '*'", make_job().queue("*"), "queue", "used in NATS subjects"),
    ("no tenant", make_job().without("tenant"), "tenant", "required"),
    ("no name", make_job().without("name"), "name", "required"),
    ("gpuModel with gpu 0", make_job().gpus(0).model("H100"), "resources.gpuModels", "gpu is 0"),
    ("gpuModel without gpu", make_job().model("H100"), "resources.gpuModels", "gpu is 0"),
    ("gpuMemory with gpu 0", make_job().res("gpuMemory", "80Gi"), "resources.gpuMemory", "gpu is 0"),
    ("gpuModel and gpuModels", make_job().gpus(1).model("H100").res("gpuModels", ["A100"]), "resources",
     "not both"),
    ("not a mapping", ["name", "x"], "spec", "must be a mapping"),
]


@pytest.mark.parametrize(("job", "field", "says"), [(j, f, s) for _, j, f, s in INVALID],
                         ids=[n for n, _, _, _ in INVALID])
def test_invalid_spec_names_the_field(job: JobBuilder | Any, field: str, says: str) -> None:
    data = job.dict() if isinstance(job, JobBuilder) else job
    with pytest.raises(SpecError) as caught:
        parse_spec(data)
    assert caught.value.field == field
    assert says in caught.value.reason
    assert caught.value.reason.startswith(f"{field}: ") or field == "spec"


def test_every_error_is_reported_first_one_named() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(make_job().gpus(-1).replicas(0).dict())
    assert caught.value.field == "replicas"  # declared before resources
    assert "resources.gpu:" in caught.value.reason and "replicas:" in caught.value.reason


@pytest.mark.parametrize(("text", "says"), [
    ("name: [unclosed", "not valid YAML"),
    ("- a\n- b\n", "must be a mapping"),
    ("", "must be a mapping"),
])
def test_bad_yaml(text: str, says: str) -> None:
    with pytest.raises(SpecError, match=says) as caught:
        load_spec_yaml(text)
    assert caught.value.field == "spec"


def test_a_spec_as_a_person_writes_it_round_trips_and_takes_set_paths() -> None:
    """`submit --from JOB --set PATH=VALUE`: the past spec as written (`spec_to_user`), changed
    in its own spelling, parses back to the same spec but for the change."""
    from gpufleet.shared.contract.spec import parse_spec, set_path, spec_to_user

    spec = parse_spec({"name": "t", "tenant": "acme", "resources": {"gpu": 2, "cpu": "1500m", "memory": "3Gi"},
                       "sim": {"duration": "90s", "gpuMemoryUsed": "10Gi"}})
    doc = spec_to_user(spec)
    assert parse_spec(doc) == spec  # (gpuMemoryUsed too: a bare number would be bytes)
    set_path(doc, "resources.gpu=4")
    set_path(doc, "sim.duration=2h")
    set_path(doc, "env.MODE=fast")  # a level that was not there
    again = parse_spec(doc)
    assert (again.resources.gpu, again.sim.duration_s, again.env) == (4, 7200.0, {"MODE": "fast"})
    assert again.resources.cpu_milli == 1500 and again.sim.gpu_mem_used_mib == 10240
    classed = parse_spec({"name": "t", "tenant": "acme", "priorityClass": "high"}).model_copy(update={"priority": 100})
    assert "priority" not in spec_to_user(classed)  # (as admission stored it: the class's number filled in)
    for wrong, field in (("resources.gpu", "--set"), ("=4", "--set"), ("name.first=x", "name")):
        with pytest.raises(SpecError) as err:
            set_path(doc, wrong)
        assert err.value.field == field


# ---------------------------------------------------------------- known shapes (specs read from events)


def _submitted_json(spec: dict[str, Any], job_id: str = "j1") -> bytes:
    """A job.submitted event as admission writes it, with the spec's JSON as given (not re-validated)."""
    import json

    from .builders import submitted

    doc = json.loads(submitted(make_job("x").spec()).to_json())
    doc["payload"]["spec"] = spec
    doc["payload"]["job_id"] = doc["correlation_id"] = job_id
    return json.dumps(doc).encode()


def _full(data: bytes) -> Any:
    """The envelope validated in full (no known shape)."""
    from gpufleet.shared.contract import spec as spec_module
    from gpufleet.shared.contract.events import parse_envelope

    saved = dict(spec_module._SHAPES)
    spec_module._SHAPES.clear()
    try:
        return parse_envelope(data)
    finally:
        spec_module._SHAPES.clear()
        spec_module._SHAPES.update(saved)


def test_a_spec_of_a_known_shape_read_from_an_event_equals_one_validated_in_full() -> None:
    from gpufleet.shared.contract import spec as spec_module
    from gpufleet.shared.contract.events import parse_envelope

    wire = spec_to_wire(parse_spec({"name": "a", "tenant": "acme", "resources": {"gpu": 2, "cpu": 4, "memory": "8Gi"},
                                    "env": {"K": "v"}, "nodeSelector": {"rack": "r1"}, "sim": {"duration": "5m"}}))
    first = parse_envelope(_submitted_json({**wire, "name": "a"})).payload.spec
    assert json_key(wire) in spec_module._SHAPES
    for name in ("b", "c-2"):
        again = parse_envelope(_submitted_json({**wire, "name": name})).payload.spec
        full = _full(_submitted_json({**wire, "name": name})).payload.spec
        assert again.name == name and first.name == "a"  # its own name; the first keeps its own
        assert again == full and again.model_fields_set == full.model_fields_set
        assert again.model_dump_json(by_alias=True) == full.model_dump_json(by_alias=True)
        assert again.resources is first.resources and again.env is first.env  # the shape's parts, shared
    assert parse_envelope(_submitted_json({**wire, "name": "b"})).payload.spec != first  # (the names differ)


@pytest.mark.parametrize(("change", "field"), [
    ({"name": "not a token!"}, "name"),
    ({"name": 7}, "name"),
    ({"replicas": True}, "replicas"),  # equal to 1 in Python, not in JSON: another shape, refused
    ({"priority": 1.5}, "priority"),
    ({"tenant": "sys"}, "tenant"),
])
def test_a_known_shape_does_not_let_a_bad_spec_through(change: dict[str, Any], field: str) -> None:
    import pydantic

    from gpufleet.shared.contract.events import parse_envelope

    wire = spec_to_wire(parse_spec({"name": "a", "tenant": "acme", "replicas": 1, "priority": 1}))
    parse_envelope(_submitted_json(wire))  # the shape is known
    with pytest.raises(pydantic.ValidationError) as err:
        parse_envelope(_submitted_json({**wire, **change}))
    assert field in {str(p) for e in err.value.errors() for p in e["loc"]}


def test_a_users_spec_is_always_validated_in_full() -> None:
    """parse_spec (cmd.submit, YAML, the SDK) refuses the normalised names, whatever shapes the
    events carried before."""
    from gpufleet.shared.contract.events import parse_envelope

    wire = spec_to_wire(parse_spec({"name": "a", "tenant": "acme", "resources": {"cpu": 2}}))
    parse_envelope(_submitted_json(wire))
    with pytest.raises(SpecError, match="cpu_milli"):
        parse_spec({**wire, "name": "b"})


def json_key(wire: dict[str, Any]) -> str:
    import json

    return json.dumps({k: v for k, v in wire.items() if k != "name"}, separators=(",", ":"))
