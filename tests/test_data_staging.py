"""Datasets staged into the node-local cache, through the mesh: a real nats-server, the real control
cores and the executor agent with the process driver (as tests/test_executor_process.py), running
as the executor's own credentials.

Given a dataset on the node's filesystem, when a job names it (`dataset: file:///...`), then the
executor copies it into its cache before the job starts (`job.data_staging`, `job.data_staged`
with the bytes and seconds), the workload reads it at GPUFLEET_DATASET_DIR, the node reports it in
`node.datasets_cached` (which the placer folds), and a second job on it starts without a copy
(`job.data_staged` cached). A source that is not there fails the job naming the field and the URI;
a job cancelled while its data is copied stops the copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufleet.sdk import Fleet
from gpufleet.services.executor.agent import ExecutorAgent
from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.executor.process_driver import ProcessDriver
from gpufleet.services.executor.staging import DataStager
from gpufleet.shared.contract.events import JobDataStaged, JobDataStaging, JobFailed, NodeDatasetsCached
from gpufleet.shared.node.datasets import StagingCancelled, register_source
from gpufleet.shared.runtime.bus import Bus

from .helpers import (  # noqa: F401
    agent_running,
    cancel_cmd,
    job_dir,
    read_log,
    running,
    service_creds,
    submit_cmd,
    wait_until,
)
from .test_executor_process import NODE, events_of, process_node, spec, until_status

MiB = 1 << 20


def data_cores(root: Path) -> list[Any]:
    """The control services, with the sources jobs may name: the test's own directory, the slow test store."""
    from gpufleet.services.admission.core import AdmissionCore
    from gpufleet.services.guardian.core import GuardianCore
    from gpufleet.services.placer.core import PlacerCore
    from gpufleet.services.quota.core import QuotaCore
    from gpufleet.shared.contract.clusterconfig import parse_config

    config = parse_config({"datasetCache": {"allowedSources": [f"{root.as_uri()}/*", "slowtest://*"]}})
    return [AdmissionCore(config), QuotaCore(), PlacerCore(), GuardianCore()]


def agent(url: str, data: Path, cache_dir: Path, capacity_bytes: int = 64 * MiB) -> Any:
    return agent_running(url, "executor-0", lambda bus: ExecutorAgent(
        ExecutorCore({NODE: process_node()}), bus, ProcessDriver(NODE, data), instance="0", reconcile_s=0.1,
        grace_s=0.5, heartbeat_s=1.0, data=DataStager(cache_dir, capacity_bytes), progress_every_s=0.2),
        creds=service_creds("executor"))


async def one(bus: Bus, job_id: str, type_: str) -> Any:
    async def got() -> Any:
        evs = await events_of(bus, job_id, type_)
        return evs[0] if evs else None
    return await wait_until(got)


async def test_second_job_on_a_dataset_starts_without_the_copy(bus: Bus, nats_url: str, tmp_path: Path,
                                                               job_dir: Path) -> None:  # noqa: F811
    src = job_dir / "c4-shards"
    src.mkdir()
    (src / "shard-0").write_bytes(b"x" * (3 * MiB + 7))
    (src / "shard-1").write_bytes(b"y" * 1000)
    uri = src.as_uri()
    reads = ["sh", "-c", 'wc -c < "$GPUFLEET_DATASET_DIR/shard-0"']
    first = submit_cmd(spec(reads, gpu=0, dataset=uri))
    second = submit_cmd(spec(reads, gpu=0, dataset=uri))
    missing = submit_cmd(spec(["true"], gpu=0, dataset=(job_dir / "no-such-dataset").as_uri()))
    async with running(nats_url, data_cores(job_dir)) as rts, agent(nats_url, tmp_path / "exec", job_dir / "cache"):
        await bus.publish(first)
        await until_status(bus, first.job_id or "", "succeeded")

        async def said_cached() -> Any:
            facts = [e.payload for _, e in await read_log(bus) if isinstance(e.payload, NodeDatasetsCached)]
            return facts and uri in facts[-1].datasets
        await wait_until(said_cached)
        placer = next(rt for rt in rts if rt.core.name == "placer")
        await wait_until(lambda: uri in placer.state.nodes[NODE].datasets)  # data locality has it to score

        await bus.publish(second)
        await until_status(bus, second.job_id or "", "succeeded")
        await bus.publish(missing)
        await until_status(bus, missing.job_id or "", "failed")
        explained = await Fleet(bus).explain(first.job_id or "")

    log = await read_log(bus)
    seq = {(e.job_id, e.type): s for s, e in reversed(log)}  # the first of each
    a, b = first.job_id, second.job_id
    # job 1: copied before it started, the copy's progress said while it ran
    assert seq[(a, "job.placed")] < seq[(a, "job.data_staging")] < seq[(a, "job.data_staged")] < seq[(a, "job.started")]
    staged = (await events_of(bus, a or "", "job.data_staged"))[0].payload
    assert isinstance(staged, JobDataStaged) and not staged.cached
    assert staged.copied_bytes == staged.size_bytes == 3 * MiB + 7 + 1000 and staged.staging_s > 0
    assert staged.name == uri and staged.field == "dataset" and staged.path.startswith(str(job_dir / "cache"))
    progress = (await events_of(bus, a or "", "job.data_staging"))[0].payload
    assert isinstance(progress, JobDataStaging) and progress.uri == uri
    # job 2: the same dataset on the same node, no copy
    again = (await events_of(bus, b or "", "job.data_staged"))[0].payload
    assert isinstance(again, JobDataStaged) and again.cached and again.copied_bytes == 0
    assert again.path == staged.path and again.node_id == staged.node_id == NODE
    assert not await events_of(bus, b or "", "job.data_staging")
    for job in (a, b):  # each workload read the cached copy at GPUFLEET_DATASET_DIR
        assert (tmp_path / "exec" / "logs" / f"{job}.0.1.log").read_text().strip() == str(3 * MiB + 7)
    # a source that is not there: the job fails, naming the field and the URI, and never started
    failed = (await events_of(bus, missing.job_id or "", "job.failed"))[0].payload
    assert isinstance(failed, JobFailed) and failed.reason.code == "data_staging_failed"
    assert failed.reason.field == "dataset" and "no-such-dataset" in failed.reason.message
    assert not await events_of(bus, missing.job_id or "", "job.started")
    # explain: job 1's staging, with its bytes and seconds
    assert explained is not None
    [line] = explained.staging
    assert line["copied_bytes"] == staged.copied_bytes and line["staging_s"] == staged.staging_s
    assert "copied in" in line["text"] and uri in line["text"]


class SlowSource:
    """A source that copies one chunk at a time until it is told to stop (or `release` is set)."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.release = threading.Event()

    def size(self, uri: str) -> int:
        return 1000 * MiB

    def fetch(self, uri: str, dest: Path, progress: Callable[[int], None], cancelled: Callable[[], bool]) -> int:
        done = 0
        while not self.release.wait(0.02):
            if cancelled():
                self.stopped.set()
                raise StagingCancelled(uri)
            done += MiB
            progress(done)
        return done


async def test_a_job_cancelled_while_staging_stops_the_copy(bus: Bus, nats_url: str, tmp_path: Path,
                                                           job_dir: Path) -> None:  # noqa: F811
    slow = SlowSource()
    register_source("slowtest", lambda: slow)
    job = submit_cmd(spec(["true"], gpu=0, dataset="slowtest://bucket/huge"))
    try:
        async with running(nats_url, data_cores(job_dir)), agent(nats_url, tmp_path / "exec", job_dir / "cache"):
            await bus.publish(job)

            async def progressing() -> bool:  # a progress fact while it copies, with bytes done
                evs = [e.payload for e in await events_of(bus, job.job_id or "", "job.data_staging")]
                return len(evs) >= 2 and evs[-1].done_bytes > 0 and evs[-1].total_bytes == 1000 * MiB
            await wait_until(progressing)
            assert (await events_of(bus, job.job_id or "", "job.placed"))
            await bus.publish(cancel_cmd(job.job_id or ""))
            await until_status(bus, job.job_id or "", "cancelled")
            await wait_until(slow.stopped.is_set)
            await wait_until(lambda: not list((job_dir / "cache").iterdir()))  # nothing half-copied left
    finally:
        slow.release.set()
    assert not await events_of(bus, job.job_id or "", "job.started")
    assert not await events_of(bus, job.job_id or "", "job.data_staged")


async def test_the_placer_sends_the_next_job_to_the_node_that_holds_its_dataset(
        bus: Bus, nats_url: str, tmp_path: Path, job_dir: Path) -> None:  # noqa: F811
    """Two identical, empty process nodes, and a dataset only proc-b holds (a job pinned there staged
    it): the next job on that dataset goes to proc-b, by what proc-b said in node.datasets_cached,
    where the tie-break alone sends a job to proc-a (the node changed least recently), as the job
    without a dataset after it shows. (With the DataLocality plugin scoring 0 this test fails.)"""
    src = job_dir / "imagenet"
    src.mkdir()
    (src / "train.tar").write_bytes(b"z" * MiB)
    uri = src.as_uri()

    def node_agent(node: str) -> Any:
        inv = process_node().model_copy(update={"labels": {"host": node}})
        return agent_running(nats_url, f"executor-{node}", lambda bus: ExecutorAgent(
            ExecutorCore({node: inv}), bus, ProcessDriver(node, tmp_path / node), instance=node, reconcile_s=0.1,
            heartbeat_s=1.0, data=DataStager(job_dir / f"cache-{node}", 64 * MiB)), creds=service_creds("executor"))

    warm = submit_cmd(spec(["true"], gpu=0, dataset=uri, nodeSelector={"host": "proc-b"}))
    plain = submit_cmd(spec(["true"], gpu=0))
    local = submit_cmd(spec(["true"], gpu=0, dataset=uri))
    async with running(nats_url, data_cores(job_dir)) as rts, node_agent("proc-a"), node_agent("proc-b"):
        await bus.publish(warm)
        await until_status(bus, warm.job_id or "", "succeeded")
        placer = next(rt for rt in rts if rt.core.name == "placer")
        await wait_until(lambda: uri in placer.state.nodes["proc-b"].datasets)
        for job in (local, plain):
            await bus.publish(job)
            await until_status(bus, job.job_id or "", "succeeded")

    def node_of(placed: list[Any]) -> str:
        return str(placed[0].payload.allocations[0].node_id)
    assert node_of(await events_of(bus, local.job_id or "", "job.placed")) == "proc-b"
    assert node_of(await events_of(bus, plain.job_id or "", "job.placed")) == "proc-a"
    staged = (await events_of(bus, local.job_id or "", "job.data_staged"))[0].payload
    assert staged.cached and staged.node_id == "proc-b"
