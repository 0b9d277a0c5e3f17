"""Elastic training jobs (`replicas: {min, max, step}`): placed at the largest size that fits, shrunk
(instead of preempted whole) when a job holding quota needs the room of its replicas above min,
grown back into capacity nothing waits for; each resize a `job.resized` and a restart from the
job's checkpoint at the new world size.

The placer core alone, the whole mesh on the sim clock (every core, the audit), and a real
process-driver training script that checkpoints through the SDK, shrunk 4 -> 2 and grown back,
ending with the result of an uninterrupted run."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpufleet.services.guardian.core import GuardianCore
from gpufleet.services.placer.core import PlacerCore
from gpufleet.shared.contract.clusterconfig import parse_config
from gpufleet.shared.contract.errors import SpecError
from gpufleet.shared.contract.events import JobPlaced, JobResized, JobResumeRequested, Reason
from gpufleet.shared.contract.spec import JobSpec, spec_to_wire
from gpufleet.shared.read.view import interruptions
from gpufleet.tools.sim import Simulation, load_scenario

from .builders import T0, Harness, cancelled, event, exited, make_job, placed, quota_reserved, submitted
from .test_placer_core import dgx, place

ELASTIC = {"min": 2, "max": 4, "step": 2}


def elastic(name: str = "el", **sizes: Any) -> Any:
    return make_job(name).type("training").replicas(sizes or ELASTIC).gpus(4)


def of(out: list[Any], kind: type) -> list[Any]:
    return [e.payload for e in out if isinstance(e.payload, kind)]


# ---------------------------------------------------------------- the spec


def test_the_elastic_form_is_the_min_as_replicas_and_the_rest_as_elastic() -> None:
    spec = elastic(min=2, max=16, step="pow2").spec()
    assert (spec.replicas, spec.sizes) == (2, (2, 4, 8, 16))
    again = JobSpec.model_validate(spec_to_wire(spec))
    assert again == spec  # written back as replicas: 2, elastic: {max, step}, read the same
    assert elastic(min=1, max=7, step=3).spec().sizes == (1, 4, 7)


@pytest.mark.parametrize(("sizes", "job_type", "message"), [
    ({"min": 2, "max": 7, "step": 2}, "training", "max 7 is not a size of min 2 and step 2"),
    ({"min": 4, "max": 2}, "training", "max 2 is below min 4"),
    ({"min": 2}, "training", "gives min and max"),
    ({"min": 2, "max": 4, "every": 1}, "training", "unknown field(s) every"),
    ({"min": 2, "max": 4, "step": 0}, "training", "'pow2'"),
    ({"min": 2, "max": 4}, "batch", "only for type: training or finetune"),
])
def test_bad_elastic_sizes_are_refused_naming_the_reason(sizes: dict[str, Any], job_type: str, message: str) -> None:
    with pytest.raises(SpecError) as err:
        make_job().type(job_type).replicas(sizes).spec()
    assert message in str(err.value)


# ---------------------------------------------------------------- the placer


def test_an_elastic_job_starts_at_the_largest_size_that_fits_and_at_min_when_only_min_does() -> None:
    h = Harness(PlacerCore()).given(dgx("d1"), dgx("d2"))
    (p,) = of(place(h, elastic("big", min=1, max=8, step="pow2"), "big"), JobPlaced)
    assert len(p.allocations) == 4  # 4 x 4 GPUs: every GPU, the largest size of 1, 2, 4, 8 that fits
    h2 = Harness(PlacerCore()).given(dgx("d1"), dgx("d2"))
    place(h2, make_job().gpus(8), "other")
    (q,) = of(place(h2, elastic("e"), "e"), JobPlaced)
    assert len(q.allocations) == 2  # min: 8 GPUs left


def resized_run(h: Harness[Any], job_id: str, to: int, attempt: int, nodes: dict[int, str]) -> list[Any]:
    """The guardian's resume after a resize and the old run's replicas exiting: what the placer decides."""
    h.given(event(JobResumeRequested(job_id=job_id, attempt=attempt + 1, reason=Reason(code="resized", message="r"))))
    out: list[Any] = []
    for replica, node_id in sorted(nodes.items()):
        ex = exited(job_id, node_id, replica=replica, reason="killed", exit_code=143)
        ex = ex.model_copy(update={"payload": ex.payload.model_copy(update={"attempt": attempt})})
        out += h.when(ex)
    return out


def test_a_job_that_needs_room_shrinks_an_elastic_job_by_the_fewest_replicas_not_whole() -> None:
    h = Harness(PlacerCore()).given(dgx("d1"), dgx("d2"))
    (p,) = of(place(h, elastic("el", min=1, max=4, step=1), "el"), JobPlaced)
    assert len(p.allocations) == 4
    out = place(h, make_job().gpus(4), "four")  # a job holding quota, 4 GPUs: one replica's room
    (r,) = of(out, JobResized)
    assert (r.job_id, r.from_replicas, r.to_replicas, r.reason.code, r.for_job) == ("el", 4, 3, "shrink", "four")
    assert not of(out, JobPlaced)
    # told again (another event, another retry) while the resize is under way: nothing more is asked
    assert not of(h.when(submitted(make_job("x").gpus(1), "x")), JobResized)
    out = resized_run(h, "el", 3, 1, {a.replica: a.node_id for a in p.allocations})
    got = {e.payload.job_id: e.payload for e in out if isinstance(e.payload, JobPlaced)}
    assert len(got["el"].allocations) == 3 and got["el"].attempt == 2  # at 3, on the nodes it kept
    assert len(got["four"].allocations) == 1


def test_no_shrink_when_even_every_elastic_job_at_its_min_leaves_no_room() -> None:
    h = Harness(PlacerCore()).given(dgx("d1"), dgx("d2"))
    place(h, elastic("el"), "el")  # 4 x 4 GPUs; at min 2 it leaves 8
    out = place(h, make_job().gpus(8).replicas(2), "sixteen")
    assert not of(out, JobResized)  # giving back 8 GPUs would not seat 16: nobody restarts for nothing


def test_an_elastic_job_grows_after_its_cooldown_only_when_nothing_waits() -> None:
    config = parse_config({"placement": {"elasticGrowAfter": "60s"}})
    h = Harness(PlacerCore(config)).given(dgx("d1"), dgx("d2"))
    place(h, make_job().gpus(8).max_runtime("10m"), "other")
    (p,) = of(place(h, elastic("el"), "el"), JobPlaced)
    assert len(p.allocations) == 2
    h.given(exited("other", "d1" if p.allocations[0].node_id == "d2" else "d2"))
    assert not h.tick(T0 + timedelta(seconds=30))  # too soon after its placement
    h.given(submitted(make_job("w").gpus(8).replicas(3), "w"))
    h.given(quota_reserved(make_job("w").gpus(8).replicas(3), "w"))  # waits for nodes: it comes first
    assert not h.tick(T0 + timedelta(seconds=90))
    h.given(cancelled("w"))  # nothing waits now
    (r,) = of(h.tick(T0 + timedelta(seconds=90)), JobResized)
    assert (r.from_replicas, r.to_replicas, r.reason.code, r.attempt) == (2, 4, "grow", 1)


# ---------------------------------------------------------------- the guardian


def test_the_guardian_resumes_a_resized_run_and_counts_the_replicas_placed_for_its_success() -> None:
    h = Harness(GuardianCore())
    spec = elastic().spec()
    h.given(submitted(elastic(), "el"), placed("el", ("n1", [0]), ("n1", [1]), ("n2", [0]), ("n2", [1])))
    for replica in range(3):
        assert not h.when(exited("el", "n1", replica=replica))  # 3 of 4 done (its min is 2): not yet
    assert [e.type for e in h.when(exited("el", "n2", replica=3))] == ["job.succeeded"]
    g = Harness(GuardianCore()).given(submitted(elastic(), "e2"), placed("e2", ("n1", [0]), ("n1", [1])))
    out = g.when(event(JobResized(job_id="e2", from_replicas=2, to_replicas=4, attempt=1,
                                  reason=Reason(code="grow", message="room"))))
    (resume,) = of(out, JobResumeRequested)
    assert (resume.attempt, resume.reason.code) == (2, "resized") and spec.replicas == 2
    # a resize of a run that is over already changes nothing
    assert not g.when(event(JobResized(job_id="e2", from_replicas=2, to_replicas=4, attempt=1,
                                       reason=Reason(code="grow", message="room"))))


# ---------------------------------------------------------------- the whole mesh on the sim clock

SCENARIO = """
seed: 1
config: {placement: {elasticGrowAfter: 60s}}
nodes: [{shape: h100x8, count: 2, prefix: h}]
jobs:
  - {at: 0s, name: el, spec: {type: training, replicas: {min: 2, max: 4, step: 2}, resources: {gpu: 4},
                              sim: {duration: 2h}}}
  - {at: 10m, name: big, spec: {resources: {gpu: 8}, sim: {duration: 20m}}}
"""


def test_on_the_sim_clock_it_shrinks_for_a_job_and_grows_back_once_that_job_ends() -> None:
    s = Simulation(load_scenario(yaml.safe_load(SCENARIO)))
    s.run()
    report = s.report()
    assert report["jobs"] == {"succeeded": 2} and report["audit"]["ok"], report["audit"]
    el = [e for e in s.log if e.job_id == "el"]
    sizes = [(e.payload.attempt, len(e.payload.allocations)) for e in el if isinstance(e.payload, JobPlaced)]
    assert sizes == [(1, 4), (2, 2), (3, 4)]
    resizes = [(p.reason.code, p.from_replicas, p.to_replicas) for p in (e.payload for e in el)
               if isinstance(p, JobResized)]
    assert resizes == [("shrink", 4, 2), ("grow", 2, 4)]
    big_placed = next(e.occurred_at for e in s.log if e.job_id == "big" and e.type == "job.placed")
    assert (big_placed - s.log[0].occurred_at).total_seconds() == pytest.approx(600, abs=1)  # not preempted whole
    lines = [it.line() for it in interruptions(list(enumerate(el, 1)))]
    assert "4 -> 2 (shrink, for big) replicas" in lines[0] and "with 2" in lines[0]
    assert "2 -> 4 (grow) replicas" in lines[1] and "with 4" in lines[1]


# ---------------------------------------------------------------- a real training script, process driver

STEPS = 160
TRAIN = '''
import json, os, sys, time
from gpufleet.sdk import checkpoint

steps, out = int(sys.argv[1]), sys.argv[2]
checkpoint.stop_requested()  # SIGTERM: save, then exit (a resize restarts the run from it)
start = checkpoint.resume()
x, first = (json.loads((start.path / "state.json").read_text())["x"], start.step + 1) if start else (1, 0)
rank, world = checkpoint.rank(), checkpoint.world_size()
if rank == 0:
    with open(out + ".runs", "a") as f:
        f.write(json.dumps({"attempt": int(os.environ["GPUFLEET_ATTEMPT"]), "world": world, "first": first,
                            "saved_world": start.world_size if start else None}) + "\\n")
for step in range(first, steps):
    # data parallel: each of `world` replicas takes its share of the same global batch of 8 items
    # and the update is their all-reduced sum (computed here from every rank's share, for the
    # all-reduce a real job does): the same at any world size, so a resize changes no result
    shares = [sum(i for i in range(8) if i % world == r) for r in range(world)]
    x = (x * 31 + step + sum(shares)) % 1000003
    time.sleep(0.05)
    if rank == 0 and (step % 10 == 9 or checkpoint.stop_requested()):
        checkpoint.save(step, {"state.json": json.dumps({"x": x}).encode()})
    if checkpoint.stop_requested():
        sys.exit(0)
if rank == 0:
    with open(out, "w") as f:
        f.write(str(x))
'''


def expected(steps: int) -> int:
    x = 1
    for step in range(steps):
        x = (x * 31 + step + 28) % 1000003
    return x


async def test_a_training_script_is_shrunk_4_to_2_by_a_job_needing_room_and_grown_back_with_the_same_result(
        bus: Any, nats_url: str, tmp_path: Path, job_dir: Path) -> None:
    from gpufleet.services.admission.core import AdmissionCore
    from gpufleet.services.executor.agent import ExecutorAgent
    from gpufleet.services.executor.core import ExecutorCore
    from gpufleet.services.executor.process_driver import ProcessDriver
    from gpufleet.services.guardian.agent import GuardianAgent
    from gpufleet.services.quota.core import QuotaCore
    from gpufleet.tools.audit import audit

    from .helpers import agent_running, job_status, read_log, running, submit_cmd, wait_until, workload_python
    from .test_telemetry import node, of_type, wait_for_type

    root = job_dir / "ckpt"
    config = parse_config({"placement": {"elasticGrowAfter": "1s"}})
    script = job_dir / "train.py"
    script.write_text(TRAIN)
    out = job_dir / "result"
    job = submit_cmd({"name": "train", "tenant": "acme", "type": "training", "replicas": {"min": 2, "max": 4, "step": 2},
                      "resources": {"gpu": 1}, "command": [*workload_python(), str(script), str(STEPS), str(out)]})
    other = submit_cmd({"name": "other", "tenant": "acme", "type": "batch", "resources": {"gpu": 2},
                        "command": ["sleep", "1"]})
    inv = node("a", gpus=4).model_copy(update={"driver": "process"})
    executor = agent_running(nats_url, "executor-a", lambda b: ExecutorAgent(
        ExecutorCore({"a": inv}), b, ProcessDriver("a", tmp_path / "a", checkpoint_root=root), instance="a",
        heartbeat_s=0.3, reconcile_s=0.1, grace_s=2.0, checkpoint_root=str(root)))
    cores = [AdmissionCore(config), QuotaCore(config), PlacerCore(config), GuardianCore(config)]
    async with running(nats_url, cores) as rts, executor:
        watcher = GuardianAgent(rts[3], str(root), watch_s=0.2)
        task = asyncio.create_task(watcher.run())
        try:
            await bus.publish(job)
            await wait_for_type(bus, "job.checkpoint_saved", job.job_id)  # running at 4, step 9 saved
            await bus.publish(other)

            async def both_done() -> bool:
                return (await job_status(bus, other.job_id or "") == "succeeded"
                        and await job_status(bus, job.job_id or "") == "succeeded")
            await wait_until(both_done, timeout_s=60)
        finally:
            watcher.stop()
            await task
    assert out.read_text() == str(expected(STEPS))  # the result of a run never resized
    runs = [json.loads(line) for line in (job_dir / "result.runs").read_text().splitlines()]
    assert [(r["attempt"], r["world"], r["saved_world"]) for r in runs] == [(1, 4, None), (2, 2, 4), (3, 4, 2)]
    assert 0 < runs[1]["first"] < runs[2]["first"] < STEPS  # each from the checkpoint the last one saved
    resized = [e.payload for e in await of_type(bus, "job.resized", job.job_id)]
    assert [(r.reason.code, r.from_replicas, r.to_replicas) for r in resized] == [("shrink", 4, 2), ("grow", 2, 4)]
    assert resized[0].for_job == other.job_id
    placed_ = [e.payload for e in await of_type(bus, "job.placed", job.job_id)]
    assert [(p.attempt, len(p.allocations)) for p in placed_] == [(1, 4), (2, 2), (3, 4)]
    assert not await of_type(bus, "job.preempted", job.job_id) and not await of_type(
        bus, "job.preemption_requested", job.job_id)  # shrunk, never preempted
    log = await read_log(bus)
    report = audit(log, config, pending_grace_s=0)
    assert report.ok, report.violations
    # billing charges each replica's own run: 4 + 2 + 4 intervals, each closed once, none overlapping
    from gpufleet.services.billing.core import BillingCore

    billing = Harness(BillingCore(config, keep_charges=True)).given(*(e for _, e in log))
    charges = sorted((c.attempt, c.replica) for c in billing.state.charges if c.job_id == job.job_id)
    assert charges == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2), (3, 3)]
    runs_at = {a: [c for c in billing.state.charges if c.job_id == job.job_id and c.attempt == a] for a in (1, 2, 3)}
    assert max(c.ended_at for c in runs_at[1]) <= min(c.started_at for c in runs_at[2])
    assert max(c.ended_at for c in runs_at[2]) <= min(c.started_at for c in runs_at[3])


def test_admission_holds_an_elastic_job_at_its_max_to_the_tenants_gpu_limit() -> None:
    from gpufleet.services.admission.core import AdmissionCore
    from gpufleet.shared.contract.events import JobRejected

    from .helpers import submit_cmd

    config = parse_config({"tenants": {"acme": {"maxGpusPerJob": 8}}})
    h = Harness(AdmissionCore(config))
    spec = {"name": "el", "tenant": "acme", "type": "training", "replicas": {"min": 2, "max": 4, "step": 2},
            "resources": {"gpu": 4}}
    (rejected,) = of(h.when(submit_cmd(spec)), JobRejected)
    (reason,) = rejected.reasons
    assert (reason.code, reason.field) == ("too_many_gpus", "elastic.max")
    assert "16 GPUs (4 x 4 at its elastic max)" in reason.message
    ok = h.when(submit_cmd({**spec, "replicas": {"min": 1, "max": 2}}))
    assert "job.submitted" in [e.type for e in ok]


def test_a_run_stopping_for_its_resize_is_not_asked_to_shrink_again() -> None:
    h = Harness(PlacerCore()).given(dgx("d1"), dgx("d2"))
    (p,) = of(place(h, elastic("el", min=1, max=4, step=1), "el"), JobPlaced)
    assert of(place(h, make_job().gpus(4), "four"), JobResized)  # 4 -> 3 (folded at once)
    h.given(event(JobResumeRequested(job_id="el", attempt=2, reason=Reason(code="resized", message="r"))))
    ex = exited("el", p.allocations[0].node_id, replica=0, reason="killed", exit_code=143)
    # its replicas exit one by one: meanwhile a second job needing room finds the stopping run counted
    # as what it gives back, and nothing asks it to resize again
    out = h.when(ex)
    out += place(h, make_job("x").gpus(4), "x")
    assert not of(out, JobResized)
