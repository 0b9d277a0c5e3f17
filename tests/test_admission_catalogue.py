"""The catalogue of bad inputs, through admission on a real nats-server: every one gets a clear
reason (a code and the field), none crashes a service, nothing is lost; good jobs still run."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.autoscaler.core import AutoscalerCore
from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.guardian.core import GuardianCore
from gpufleet.services.placer.core import PlacerCore
from gpufleet.services.quota.core import QuotaCore
from gpufleet.shared.contract.clusterconfig import ClusterConfig, parse_config
from gpufleet.shared.contract.events import utc
from gpufleet.shared.contract.ids import derive_id
from gpufleet.shared.node.cluster import sim_fleet
from gpufleet.shared.runtime.bus import Bus

from .helpers import cancel_cmd, new_id, read_log, running, submit_cmd, wait_until

CONFIG = parse_config({
    "tenants": {
        "acme": {
            "queues": ["default", "research"], "maxGpusPerJob": 16, "allowedGpuModels": ["H100", "A100"],
            "allowedJobTypes": ["training", "finetune", "batch", "inference"],
            "allowedImages": ["registry.local/acme/*"], "checkpointRequiredAfter": "4h",
        },
        "globex": {"queues": ["default"], "maxGpusPerJob": 64},
    },
    "priorityClasses": {"high": 1000, "low": -10},
})


def job(**over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": "j", "tenant": "acme", "resources": {"gpu": 1, "cpu": 2, "memory": "8Gi"},
                            "sim": {"duration": "0.2s"}}
    for key, value in over.items():
        if key.startswith("r_"):
            spec["resources"][key[2:]] = value
        elif value is None:
            spec.pop(key, None)
        else:
            spec[key] = value
    return spec


# name -> (spec, submitting tenant or None for spec.tenant, expected code, expected field)
SPECS: dict[str, tuple[dict[str, Any], str | None, str, str | None]] = {
    "negative gpus": (job(r_gpu=-1), None, "invalid_spec", "resources.gpu"),
    "fractional gpus": (job(r_gpu=0.5), None, "invalid_spec", "resources.gpu"),
    "gpus as a word": (job(r_gpu="eight"), None, "invalid_spec", "resources.gpu"),
    "gang of size 0": (job(replicas=0), None, "invalid_spec", "replicas"),
    "negative gang": (job(replicas=-2), None, "invalid_spec", "replicas"),
    "replicas as a string": (job(replicas="2"), None, "invalid_spec", "replicas"),
    "priority as a word": (job(priority="high"), None, "invalid_spec", "priority"),
    "memory nonsense": (job(r_memory="lots"), None, "invalid_spec", "resources.memory"),
    "negative cpu": (job(r_cpu="-1"), None, "invalid_spec", "resources.cpu"),
    "max runtime nonsense": (job(maxRuntime="forever"), None, "invalid_spec", "maxRuntime"),
    "unknown job type": (job(type="party"), None, "invalid_spec", "type"),
    "unknown field": (job(colour="red"), None, "invalid_spec", "colour"),
    "unknown resource field": (job(r_tpu=4), None, "invalid_spec", "resources.tpu"),
    "name with a dot": (job(name="a.b"), None, "invalid_spec", "name"),
    "name with a star": (job(name="a*"), None, "invalid_spec", "name"),
    "name with a space": (job(name="a b"), None, "invalid_spec", "name"),
    "queue with >": (job(queue="q>"), None, "invalid_spec", "queue"),
    "tenant sys": (job(tenant="sys"), "sys", "unknown_tenant", "tenant"),
    "gpu model without gpus": (job(r_gpu=0, r_gpuModel="H100"), None, "invalid_spec", "resources.gpuModels"),
    "no name": (job(name=None), None, "invalid_spec", "name"),
    "unknown tenant": (job(tenant="initech"), None, "unknown_tenant", "tenant"),
    "tenant mismatch": (job(tenant="globex"), "acme", "tenant_mismatch", "tenant"),
    "unknown queue": (job(queue="nope"), None, "unknown_queue", "queue"),
    "job type not allowed": (job(type="interactive"), None, "job_type_not_allowed", "type"),
    "too many gpus for the tenant": (job(replicas=4, r_gpu=8), None, "too_many_gpus", "resources.gpu"),
    "gpu model not allowed": (job(r_gpuModel="A10"), None, "gpu_model_not_allowed", "resources.gpuModels"),
    "gpu model not in the cluster": (job(tenant="globex", r_gpuModel="TPUv5"), None, "gpu_model_unknown",
                                     "resources.gpuModels"),
    "memory over any node": (job(tenant="globex", r_memory="4Ti"), None, "exceeds_node", "resources.memory"),
    "cpu over any node": (job(tenant="globex", r_cpu=1000), None, "exceeds_node", "resources.cpu"),
    "gpus per replica over any node": (job(tenant="globex", r_gpu=16), None, "exceeds_node", "resources.gpu"),
    "gpu memory over any gpu": (job(tenant="globex", r_gpu=1, r_gpuMemory="200Gi"), None, "exceeds_node",
                                "resources.gpuMemory"),
    "image not allowed": (job(image="docker.io/evil:latest"), None, "image_not_allowed", "image"),
    "training without checkpoint": (job(type="training", maxRuntime="12h"), None, "checkpoint_required",
                                    "checkpoint"),
    "oversized payload": (job(env={"BLOB": "x" * 70_000}), None, "payload_too_large", "spec"),
    "unknown priority class": (job(priorityClass="vip"), None, "unknown_priority_class", "priorityClass"),
    "priority and class": (job(priorityClass="high", priority=5), None, "invalid_spec", "priorityClass"),
    "priority class with a dot": (job(priorityClass="a.b"), None, "invalid_spec", "priorityClass"),
    "mig with whole gpus": (job(r_mig={"1g.10gb": 1}), None, "invalid_spec", "resources.mig"),
    "mig profile nonsense": (job(r_gpu=0, r_mig={"half": 1}), None, "invalid_spec", "resources.mig"),
    "mig profile not in the cluster": (job(r_gpu=0, r_mig={"1g.5gb": 1}), None, "mig_profile_unknown",
                                       "resources.mig"),
    "mig instances over any node": (job(r_gpu=0, r_mig={"3g.40gb": 3}), None, "exceeds_node", "resources.mig"),
}


def cores(config: ClusterConfig = CONFIG, nodes: int = 10) -> list[Any]:
    # (the autoscaler reads every command too: a bad one must still be dead-lettered once)
    out: list[Any] = [AdmissionCore(config), QuotaCore(), PlacerCore(), GuardianCore(), AutoscalerCore(config)]
    if nodes:  # the default mix, and one node with GPUs in MIG mode
        out.append(ExecutorCore(sim_fleet(nodes) | sim_fleet(1, prefix="mig", mix="h100mig")))
    return out


async def _raw(bus: Bus, subject: str, data: bytes) -> int:
    ack = await bus.js.publish(subject, data, headers={"Nats-Msg-Id": new_id()})
    return int(ack.seq)


async def test_every_bad_input_gets_a_clear_reason_and_nothing_is_lost(bus: Bus, nats_url: str) -> None:
    async with running(nats_url, cores()):
        # the nodes are registered before the first submit, so cluster checks apply
        await wait_until(lambda: _count(bus, "node.registered", 10), timeout_s=10)
        expect: dict[str, tuple[str, str | None]] = {}
        for spec, tenant, code, field in SPECS.values():
            job_id = new_id()
            env = submit_cmd(spec, job_id=job_id, tenant=tenant or spec.get("tenant", "acme"))
            await bus.publish(env)
            expect[job_id] = (code, field)

        # commands refused about jobs that exist
        good = submit_cmd(job(name="good"), job_id=new_id())
        await bus.publish(good)
        mig = submit_cmd(job(name="mig", r_gpu=0, r_mig={"1g.10gb": 2}), job_id=new_id())
        await bus.publish(mig)
        gid = good.payload.job_id  # type: ignore[union-attr]
        again = submit_cmd(job(name="again"), job_id=gid)
        again = again.model_copy(update={"event_id": derive_id(gid, "again")})
        await bus.publish(again)
        await bus.publish(cancel_cmd(gid, tenant="globex"))  # another tenant's job
        await bus.publish(cancel_cmd(new_id(), tenant="acme"))  # no such job

        # messages that are not the contract at all: dead letters, with the reason
        dead = {
            await _raw(bus, "fleet.cmd.acme.submit", b"{not json"): "invalid message",
            await _raw(bus, "fleet.cmd.acme.submit", json.dumps({"type": "cmd.submit"}).encode()): "event_id",
            await _raw(bus, "fleet.cmd.acme.submit", _envelope_json("j.1", job())): "job_id",
            await _raw(bus, "fleet.cmd.acme.submit", _envelope_json(new_id(), ["not", "a", "mapping"])): "spec",
            await _raw(bus, "fleet.cmd.globex.submit", submit_cmd(job(), new_id()).to_json()): "belongs on",
        }

        async def all_decided() -> bool:
            log = await read_log(bus)
            decided = {e.job_id for _, e in log if e.type in ("job.rejected", "job.request_refused")}
            letters = {e.payload.stream_seq for _, e in log if e.type == "sys.dead_letter"}  # type: ignore[union-attr]
            ok = {gid, mig.job_id} <= {e.job_id for _, e in log if e.type == "job.succeeded"}
            return set(expect) <= decided and set(dead) <= letters and ok

        await wait_until(all_decided, timeout_s=30)

    log = [e for _, e in await read_log(bus)]
    for job_id, (code, field) in expect.items():
        outcomes = [e for e in log if e.job_id == job_id and e.type.startswith("job.")]
        name = next(n for n, j in zip(SPECS, expect, strict=True) if j == job_id)
        assert [e.type for e in outcomes] == ["job.rejected"], (name, outcomes)
        reasons = outcomes[0].payload.reasons  # type: ignore[union-attr]
        assert (reasons[0].code, reasons[0].field) == (code, field), (name, reasons)
        assert len(reasons[0].message) > 10
    refused = [e for e in log if e.type == "job.request_refused"]
    assert sorted(r.payload.reasons[0].code for r in refused) == [  # type: ignore[union-attr]
        "duplicate_job_id", "unknown_job", "unknown_job"]
    assert {r.tenant for r in refused} == {"acme", "globex"}  # each told under its own subject
    letters = {e.payload.stream_seq: e.payload.reason for e in log if e.type == "sys.dead_letter"}  # type: ignore[union-attr]
    for seq, words in dead.items():
        assert words in letters[seq], (seq, letters[seq])
    # one dead letter per bad command, admission's (the autoscaler reads commands too, silently)
    per_seq = [(e.payload.stream_seq, e.payload.service) for e in log if e.type == "sys.dead_letter"]  # type: ignore[union-attr]
    assert sorted(per_seq) == sorted((seq, "admission") for seq in dead)
    # the good job ran; its life is untouched by the refused commands about it
    assert [e.type for e in log if e.job_id == gid][-1] == "job.succeeded"
    assert len(SPECS) >= 30


def _envelope_json(job_id: str, spec: Any) -> bytes:
    return json.dumps({
        "event_id": new_id(), "type": "cmd.submit", "occurred_at": utc(time.time()).isoformat(),
        "tenant": "acme", "actor": "test", "payload": {"job_id": job_id, "spec": spec},
    }).encode()


async def _count(bus: Bus, type_: str, n: int) -> bool:
    return sum(1 for _, e in await read_log(bus) if e.type == type_) >= n


async def test_rate_limit_and_pending_cap_name_the_limit_and_spare_other_tenants(bus: Bus, nats_url: str) -> None:
    config = parse_config({"tenants": {
        "flood": {"submitRatePerS": 2, "submitBurst": 5, "maxPendingJobs": 100},
        "calm": {"maxPendingJobs": 3},
    }})
    # no executor: no nodes, so admitted jobs wait (pending) for ever
    async with running(nats_url, cores(config, nodes=0)):
        flood = [submit_cmd(job(tenant="flood", name=f"f{i}"), job_id=new_id()) for i in range(30)]
        await bus.publish_batch(flood)
        calm = [submit_cmd(job(tenant="calm", name=f"c{i}"), job_id=new_id()) for i in range(5)]
        for c in calm:
            await bus.publish(c)

        async def decided() -> bool:
            log = await read_log(bus)
            done = {e.job_id for _, e in log if e.type in ("job.admitted", "job.rejected")}
            return {c.payload.job_id for c in flood + calm} <= done  # type: ignore[union-attr]

        await wait_until(decided, timeout_s=20)
    log = [e for _, e in await read_log(bus)]
    rejected = {e.job_id: e.payload.reasons[0] for e in log if e.type == "job.rejected"}  # type: ignore[union-attr]
    flood_rejected = [rejected[c.payload.job_id] for c in flood if c.payload.job_id in rejected]  # type: ignore[union-attr]
    assert 20 <= len(flood_rejected) <= 25  # a burst of 5 (+ what 2/s refills meanwhile) got through
    assert {r.code for r in flood_rejected} == {"rate_limited"}
    assert "submitRatePerS" in flood_rejected[0].message
    calm_outcomes = [rejected.get(c.payload.job_id) for c in calm]  # type: ignore[union-attr]
    assert calm_outcomes[:3] == [None, None, None]  # the flood did not starve another tenant
    assert [r.code for r in calm_outcomes[3:] if r] == ["too_many_pending", "too_many_pending"]
    assert "maxPendingJobs" in calm_outcomes[3].message  # type: ignore[union-attr]


@pytest.mark.parametrize("text", ["tenants: {acme: {queuez: [a]}}", "tenants: {acme: {maxGpusPerJob: -1}}",
                                  "tenants: [acme]", "tenants: {'a.b': {}}"])
def test_a_bad_cluster_config_names_the_field(text: str) -> None:
    import yaml

    from gpufleet.shared.contract.errors import SpecError

    with pytest.raises((SpecError, ValueError)) as exc:
        parse_config(yaml.safe_load(text))
    assert "tenants" in str(exc.value)




def test_a_priority_class_is_recorded_as_its_number() -> None:
    from .builders import Harness, submit, types

    h = Harness(AdmissionCore(CONFIG))
    out = h.when(submit(job(priorityClass="high"), "p1"))
    assert types(out) == ["job.submitted", "job.admitted"]
    assert out[0].payload.spec.priority == 1000  # type: ignore[union-attr]


async def test_a_broken_envelope_is_answered_on_the_jobs_own_subject(bus: Bus, nats_url: str) -> None:
    """A client following its job (`fleet.evt.<tenant>.job.<id>.>`) is told when its command
    could not be read, with one reason per field; the dead letter names the tenant and the job."""
    def raw(job_id: str, **change: Any) -> bytes:
        doc = json.loads(_envelope_json(job_id, job()))
        for k, v in change.items():
            if v is None:
                doc.pop(k, None)
            else:
                doc[k] = v
        return json.dumps(doc).encode()

    no_actor, extra, mismatch, two_bad = new_id(), new_id(), new_id(), new_id()
    async with running(nats_url, cores(nodes=0)):
        good = submit_cmd(job(name="good"), job_id=new_id())
        await bus.publish(good)
        gid = good.payload.job_id  # type: ignore[union-attr]
        await wait_until(lambda: _count(bus, "job.submitted", 1), timeout_s=10)
        await _raw(bus, "fleet.cmd.acme.submit", raw(no_actor, actor=None))
        await _raw(bus, "fleet.cmd.acme.submit", raw(extra, colour="red"))
        await _raw(bus, "fleet.cmd.globex.submit", raw(mismatch))  # globex published an acme envelope
        await _raw(bus, "fleet.cmd.acme.submit", raw(two_bad, actor=None, occurred_at="yesterday"))
        bad_cancel = json.dumps({"type": "cmd.cancel", "tenant": "acme", "payload": {"job_id": gid}}).encode()
        await _raw(bus, "fleet.cmd.acme.cancel", bad_cancel)
        junk = await _raw(bus, "fleet.cmd.acme.submit", b"{not json")
        # the rules the docs state: Nats-Msg-Id = event_id, event_id a ULID
        no_header, other_header, not_ulid = new_id(), new_id(), new_id()
        cmd = submit_cmd(job(name="h1"), job_id=no_header)
        await bus.js.publish(cmd.subject(), cmd.to_json())
        cmd = submit_cmd(job(name="h2"), job_id=other_header)
        await bus.js.publish(cmd.subject(), cmd.to_json(), headers={"Nats-Msg-Id": new_id()})
        cmd = submit_cmd(job(name="h3"), job_id=not_ulid).model_copy(update={"event_id": "x" * 26})
        await bus.js.publish(cmd.subject(), cmd.to_json(), headers={"Nats-Msg-Id": "x" * 26})

        async def answered() -> Any:
            log = [e for _, e in await read_log(bus)]
            told = {e.job_id: e for e in log if e.type in ("job.rejected", "job.request_refused")}
            letters = [e for e in log if e.type == "sys.dead_letter"]
            want = {no_actor, extra, mismatch, two_bad, gid, no_header, other_header, not_ulid}
            return (told, letters) if want <= set(told) and len(letters) >= 9 else None

        told, letters = await wait_until(answered, timeout_s=20)
    fields = {j: [(r.code, r.field) for r in told[j].payload.reasons] for j in told}  # type: ignore[union-attr]
    assert told[no_actor].type == "job.rejected" and fields[no_actor] == [("invalid_envelope", "actor")]
    assert fields[extra] == [("invalid_envelope", "colour")]
    assert told[mismatch].tenant == "globex" and fields[mismatch] == [("invalid_envelope", "tenant")]
    assert sorted(f for _, f in fields[two_bad]) == ["actor", "occurred_at"]  # every field, separately
    assert fields[no_header] == [("invalid_envelope", "Nats-Msg-Id")]
    assert fields[other_header] == [("invalid_envelope", "Nats-Msg-Id")]
    assert fields[not_ulid] == [("invalid_envelope", "event_id")]
    assert told[no_header].type == "job.rejected"
    # a broken cancel of a job that exists refuses the request; the job itself goes on
    assert told[gid].type == "job.request_refused" and told[gid].payload.command == "cancel"  # type: ignore[union-attr]
    assert {"event_id", "occurred_at", "actor"} <= {f for _, f in fields[gid]}
    assert "job.cancel_requested" not in [e.type for e in letters]
    # the dead letters name the tenant (from the subject) and the job when they can be read
    by_seq = {e.payload.stream_seq: e.payload for e in letters}  # type: ignore[union-attr]
    assert by_seq[junk].tenant == "acme" and by_seq[junk].about_job is None  # type: ignore[union-attr]
    assert {p.about_job for p in by_seq.values()} >= {no_actor, extra, mismatch, two_bad}  # type: ignore[union-attr]
