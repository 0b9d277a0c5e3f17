"""Scenario: the seed story on a real nats-server — a 64-GPU all-or-nothing gang and 8-GPU jobs
on a 96-GPU cluster.

Policy (services/quota/core.py): no head-of-line blocking — while the gang cannot fit, 8-GPU
jobs behind it run, so the cluster is never idle while jobs wait; once the gang has waited
`starvationAfter`, jobs of its priority or lower that need GPUs are held back, so the gang runs
as soon as enough frees, and the held jobs after it.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.guardian.core import GuardianCore
from gpufleet.services.placer.core import PlacerCore
from gpufleet.services.quota.core import QuotaCore
from gpufleet.shared.contract.clusterconfig import parse_config
from gpufleet.shared.node.cluster import shape_inventory
from gpufleet.shared.read.view import ClusterView, apply
from gpufleet.shared.runtime.bus import Bus

from .helpers import new_id, read_log, running, submit_cmd, wait_until

pytestmark = pytest.mark.slow


def spec(name: str, replicas: int, seconds: float) -> dict[str, Any]:
    return {"name": name, "tenant": "acme", "replicas": replicas, "sim": {"duration": f"{seconds}s"},
            "resources": {"gpu": 8, "cpu": 8, "memory": "64Gi", "gpuModel": "H100"}}


async def test_big_gang_and_small_jobs_on_96_gpus(bus: Bus, nats_url: str) -> None:
    config = parse_config({"queues": {"default": {"nominal": {"gpu": 96}}}, "starvationAfter": "1.5s"})
    nodes = {f"h{i:02d}": shape_inventory("h100x8", f"h{i:02d}") for i in range(12)}
    cores = [AdmissionCore(config), QuotaCore(config), PlacerCore(), ExecutorCore(nodes), GuardianCore()]
    async with running(nats_url, cores):
        first = [submit_cmd(spec(f"small{i}", 1, 4), job_id=new_id()) for i in range(8)]
        for c in first:
            await bus.publish(c)
        gang = submit_cmd(spec("gang", 8, 2), job_id=new_id())
        await bus.publish(gang)
        late = [submit_cmd(spec(f"late{i}", 1, 2), job_id=new_id()) for i in range(6)]
        for c in late:
            await bus.publish(c)
        ids = [c.payload.job_id for c in [*first, gang, *late]]  # type: ignore[union-attr]

        async def all_done() -> bool:
            log = await read_log(bus)
            return sum(1 for _, e in log if e.type == "job.succeeded" and e.job_id in ids) == len(ids)

        await wait_until(all_done, timeout_s=60, every_s=0.5)

    log = await read_log(bus)
    gid = gang.payload.job_id  # type: ignore[union-attr]
    seq_of = {(e.type, e.job_id): s for s, e in log}
    gang_admitted, gang_placed = seq_of[("job.admitted", gid)], seq_of[("job.placed", gid)]

    # 1. while the gang waited for quota, the cluster was busy: fold the log and weigh the GPUs
    #    allocated after each event by how long they stayed so (the log's own times)
    first_queued = min(s for s, e in log if e.type == "job.queued" and e.job_id == gid)
    view = ClusterView()
    samples: list[tuple[float, int]] = []
    for s, e in log:
        apply(view, e, s)
        if first_queued <= s <= gang_placed:
            samples.append((e.occurred_at.timestamp(), sum(n.gpus_allocated for n in view.nodes.values())))
    weighted = sum((t2 - t1) * gpus for (t1, gpus), (t2, _) in zip(samples, samples[1:], strict=False))
    span = samples[-1][0] - samples[0][0]
    assert span > 0 and weighted / span >= 64, f"the cluster idled while the gang waited: {weighted / span:.1f} GPUs"
    assert max(g for _, g in samples) == 96  # small jobs behind the gang filled the rest (no HOL blocking)
    assert gang_admitted < gang_placed

    # 2. the gang was told why it waits, with the quota numbers
    queued = [e for _, e in log if e.type == "job.queued" and e.job_id == gid]
    assert queued and "gpu" in queued[0].payload.reason.message  # type: ignore[union-attr]

    # 3. no starvation: some late small jobs were held back and ran only after the gang got its GPUs
    late_ids = [c.payload.job_id for c in late]  # type: ignore[union-attr]
    held = [j for j in late_ids if any(e.type == "job.queued" and e.job_id == j
                                       and e.payload.reason.code == "behind_starving_job"  # type: ignore[union-attr]
                                       for _, e in log)]
    assert held, "no small job was held back for the starving gang"
    for j in held:
        assert seq_of[("job.placed", j)] > gang_placed
    # 4. the gang ran all or nothing: 8 replicas on 8 different nodes, 64 GPUs in one event
    placed = next(e for _, e in log if e.type == "job.placed" and e.job_id == gid)
    allocs = placed.payload.allocations  # type: ignore[union-attr]
    assert len(allocs) == 8 and sum(len(a.gpu_indices) for a in allocs) == 64
