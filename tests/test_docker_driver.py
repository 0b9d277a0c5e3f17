"""The docker driver: its container request as data, and real containers on a private dockerd.

The request tests need no engine. The `docker`-marked ones run against the session's dockerd
(tests/dockerd.py) and are skipped, with the reason, only where no engine can be started.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiodocker
import pytest
from aiodocker.exceptions import DockerError

from gpufleet.services.executor.docker_driver import (
    DockerDriver,
    container_config,
    container_name,
)
from gpufleet.services.executor.drivers import DriverError, Launch, Workload

from .dockerd import DockerEngine


def launch(**kw: Any) -> Launch:
    base: dict[str, Any] = dict(
        job_id="job-1", tenant="acme", replica=0, attempt=1, node_id="node-a",
        command=("sh", "-c", "echo hi"), image="gpufleet-test/busybox:1",
        cpu_milli=1000, memory_mib=256, placed_event_id="01PLACED")
    base.update(kw)
    return Launch(**base)


# ---------------------------------------------------------------- the request, as data

def test_config_gpus_limits_user_mounts_labels_env() -> None:
    la = launch(gpu_indices=(1, 3), gpu_uuids=("GPU-aaa", "GPU-ccc"), cpu_milli=2500, memory_mib=512,
                checkpoint_dir="/data/ckpt/job-1", env={"LR": "0.1"}, replica=2, attempt=3)
    c = container_config(la, "1000:1000", started_at=1234.5, pids_limit=77)
    host = c["HostConfig"]
    assert host["DeviceRequests"] == [{"Driver": "nvidia", "DeviceIDs": ["GPU-aaa", "GPU-ccc"], "Capabilities": [["gpu"]]}]
    assert host["NanoCpus"] == 2_500_000_000
    assert host["Memory"] == 512 * 1024 * 1024 and host["MemorySwap"] == host["Memory"]
    assert host["PidsLimit"] == 77
    assert host["NetworkMode"] == "none"
    assert host["Binds"] == ["/data/ckpt/job-1:/data/ckpt/job-1:rw"]
    assert host["Init"] is True and host["AutoRemove"] is False
    assert c["User"] == "1000:1000"
    assert c["Image"] == "gpufleet-test/busybox:1"
    assert c["Cmd"] == ["sh", "-c", "echo hi"]
    assert c["Labels"] == {
        "gpufleet.job": "job-1", "gpufleet.tenant": "acme", "gpufleet.replica": "2", "gpufleet.attempt": "3",
        "gpufleet.node": "node-a", "gpufleet.allocation": "01PLACED", "gpufleet.started_at": "1234.500000",
        "gpufleet.gpus": "1,3"}
    env = dict(e.split("=", 1) for e in c["Env"])
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-aaa,GPU-ccc"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-aaa,GPU-ccc"
    assert env["GPUFLEET_CHECKPOINT_DIR"] == "/data/ckpt/job-1"
    assert env["LR"] == "0.1"
    assert env["GPUFLEET_JOB_ID"] == "job-1" and env["GPUFLEET_REPLICA"] == "2" and env["GPUFLEET_ATTEMPT"] == "3"


def test_config_cpu_only_job_gets_no_gpu_at_all() -> None:
    c = container_config(launch())
    assert "DeviceRequests" not in c["HostConfig"]
    assert "Binds" not in c["HostConfig"]
    env = dict(e.split("=", 1) for e in c["Env"])
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "GPUFLEET_CHECKPOINT_DIR" not in env
    assert c["User"] == "65534:65534"


def test_config_mounts_the_staged_dataset_and_model_read_only() -> None:
    c = container_config(launch(checkpoint_dir="/data/ckpt/job-1",
                                data_dirs=(("dataset", "/cache/ab12/data"), ("model", "/cache/cd34/data"))))
    assert c["HostConfig"]["Binds"] == ["/data/ckpt/job-1:/data/ckpt/job-1:rw", "/cache/ab12/data:/cache/ab12/data:ro",
                                        "/cache/cd34/data:/cache/cd34/data:ro"]
    env = dict(e.split("=", 1) for e in c["Env"])
    assert env["GPUFLEET_DATASET_DIR"] == "/cache/ab12/data" and env["GPUFLEET_MODEL_DIR"] == "/cache/cd34/data"
    with pytest.raises(DriverError) as e:  # a cache dir that would show the container the mesh's data dir
        container_config(launch(data_dirs=(("dataset", "/srv"),)), protected=("/srv/mesh",))
    assert e.value.code == "data_dir_not_allowed" and "dataset" in e.value.message


def test_config_empty_command_runs_the_images_own() -> None:
    assert "Cmd" not in container_config(launch(command=()))


@pytest.mark.parametrize(("kw", "user", "code", "names"), [
    ({"image": None}, "65534:65534", "image_required", "image"),
    ({}, "0:0", "root_user", "user='0:0'"),
    ({}, "root", "root_user", "user='root'"),
    ({"cpu_milli": 0}, "65534:65534", "bad_resources", "cpu_milli"),
    ({"memory_mib": -1}, "65534:65534", "bad_resources", "memory_mib"),
    ({"checkpoint_dir": "relative/ckpt"}, "65534:65534", "bad_checkpoint_dir", "checkpoint_dir"),
    ({"data_dirs": (("model", "rel/m"),)}, "65534:65534", "bad_data_dir", "model dir"),
])
def test_config_refuses_with_the_field_named(kw: dict[str, Any], user: str, code: str, names: str) -> None:
    with pytest.raises(DriverError) as e:
        container_config(launch(**kw), user)
    assert e.value.code == code
    assert names in e.value.message and "job-1" in e.value.message


def test_container_name_and_driver_arguments(tmp_path: Path) -> None:
    assert container_name("job-1.0.2") == "gpufleet-job-1-0-2"
    with pytest.raises(ValueError, match="root"):
        DockerDriver("n", tmp_path, user="0")
    with pytest.raises(ValueError, match="pull"):
        DockerDriver("n", tmp_path, pull="sometimes")  # type: ignore[arg-type]


# ---------------------------------------------------------------- a real engine


@pytest.fixture
async def node(docker_engine: DockerEngine, tmp_path: Path) -> AsyncIterator[DockerDriver]:
    """A driver for a node of its own (the engine is shared by the session's tests)."""
    d = DockerDriver(f"node-{uuid.uuid4().hex[:8]}", tmp_path / "data", docker_url=docker_engine.url)
    try:
        yield d
    finally:
        for w in await d.list():
            await d.cleanup(w.key)
        await d.close()


@pytest.fixture
async def engine(docker_engine: DockerEngine) -> AsyncIterator[aiodocker.Docker]:
    client = aiodocker.Docker(url=docker_engine.url)
    try:
        yield client
    finally:
        await client.close()


def on(d: DockerDriver, **kw: Any) -> Launch:
    return launch(node_id=d.node_id, **kw)


async def until(d: DockerDriver, key: str, pred: Callable[[Workload], bool], timeout_s: float = 15.0) -> Workload:
    deadline = time.monotonic() + timeout_s
    while True:
        found = {w.key: w for w in await d.list()}
        w = found.get(key)
        if w is not None and pred(w):
            return w
        if time.monotonic() > deadline:
            raise AssertionError(f"{key}: not there within {timeout_s}s: {w}")
        await asyncio.sleep(0.05)


async def exited(d: DockerDriver, key: str, timeout_s: float = 15.0) -> Workload:
    return await until(d, key, lambda w: not w.running and w.exit_code is not None, timeout_s)


@pytest.mark.docker
async def test_start_applies_limits_labels_user_mount_and_is_idempotent(
        node: DockerDriver, engine: aiodocker.Docker, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt" / "job-1"
    script = ("id -u; echo CVD=[$CUDA_VISIBLE_DEVICES]; echo saved > $GPUFLEET_CHECKPOINT_DIR/state; "
              "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes; "
              "exec sleep 60")
    la = on(node, command=("sh", "-c", script), cpu_milli=500, memory_mib=64, checkpoint_dir=str(ckpt),
            env={"FOO": "bar"})
    w = await node.start(la)
    assert w.running and w.container_id and w.pid
    assert (w.job_id, w.replica, w.attempt, w.node_id) == ("job-1", 0, 1, node.node_id)
    assert abs(w.started_at - time.time()) < 30

    again = await node.start(la)
    assert again.container_id == w.container_id, "a second start returns the same container"
    assert [x.key for x in await node.list()] == [la.key]

    info = await engine.containers.container(w.container_id).show()
    assert info["Name"] == "/gpufleet-job-1-0-1"
    host = info["HostConfig"]
    assert host["NanoCpus"] == 500_000_000
    assert host["Memory"] == 64 * 1024 * 1024
    assert host["PidsLimit"] == 4096
    assert host["NetworkMode"] == "none"
    assert host["Binds"] == [f"{ckpt}:{ckpt}:rw"]
    assert info["Config"]["User"] == "65534:65534"
    labels = info["Config"]["Labels"]
    assert labels["gpufleet.job"] == "job-1" and labels["gpufleet.tenant"] == "acme"
    assert labels["gpufleet.replica"] == "0" and labels["gpufleet.attempt"] == "1"
    assert labels["gpufleet.node"] == node.node_id and labels["gpufleet.allocation"] == "01PLACED"
    assert "FOO=bar" in info["Config"]["Env"]

    for _ in range(200):  # up to 10 s
        if (ckpt / "state").exists():
            break
        await asyncio.sleep(0.05)
    assert (ckpt / "state").read_text() == "saved\n", "the job wrote through the checkpoint mount as uid 65534"

    pids = await node.pids(la.key)
    assert w.pid in pids and len(pids) >= 2, pids  # tini (pid 1 inside) and the job's sleep

    await node.stop(la.key, grace_s=5)
    gone = await exited(node, la.key)
    assert gone.stopped_by_us and gone.exit_code == 143, gone  # sleep took the SIGTERM tini passed on
    assert await node.pids(la.key) == set()
    await node.cleanup(la.key)
    out = (node.logs_dir / f"{la.key}.log").read_text()
    lines = out.splitlines()
    assert lines[0] == "65534", out
    assert "CVD=[]" in lines, out
    assert str(64 * 1024 * 1024) in lines, f"the memory limit is not what the job's cgroup says: {out}"


@pytest.mark.docker
async def test_exit_codes_logs_kept_and_container_removed(node: DockerDriver, engine: aiodocker.Docker) -> None:
    ok = on(node, job_id="ok", command=("true",))
    bad = on(node, job_id="bad", command=("sh", "-c", "echo to-stdout; echo to-stderr >&2; exit 3"))
    await asyncio.gather(node.start(ok), node.start(bad))
    w_ok, w_bad = await exited(node, ok.key), await exited(node, bad.key)
    assert (w_ok.exit_code, w_bad.exit_code) == (0, 3)
    assert not w_ok.stopped_by_us and not w_bad.stopped_by_us
    assert w_bad.pid is None and w_bad.container_id

    await node.stop(bad.key, grace_s=1)  # already exited: nothing to do, and not "ours"
    assert not (await exited(node, bad.key)).stopped_by_us

    await node.cleanup(bad.key)
    log = (node.logs_dir / f"{bad.key}.log").read_text()
    assert "to-stdout" in log and "to-stderr" in log
    with pytest.raises(DockerError) as e:
        await engine.containers.get(w_bad.container_id)
    assert e.value.status == 404
    assert [w.key for w in await node.list()] == [ok.key]

    await node.cleanup(bad.key)  # again: no container, no error, the log stays
    await node.stop(bad.key)
    assert await node.pids(bad.key) == set()
    assert (node.logs_dir / f"{bad.key}.log").read_text() == log


@pytest.mark.docker
async def test_stop_lets_a_trapping_job_exit_on_its_own_within_the_grace(node: DockerDriver) -> None:
    la = on(node, command=("sh", "-c", "trap 'echo got-term; exit 7' TERM; echo ready; while :; do sleep 0.1; done"))
    await node.start(la)
    await until(node, la.key, lambda w: w.running)
    await asyncio.sleep(0.3)  # let sh set its trap
    t0 = time.monotonic()
    await node.stop(la.key, grace_s=10)
    w = await exited(node, la.key)
    assert time.monotonic() - t0 < 5, "it exited on SIGTERM, not after the grace"
    assert w.exit_code == 7 and w.stopped_by_us
    await node.cleanup(la.key)
    assert "got-term" in (node.logs_dir / f"{la.key}.log").read_text()


@pytest.mark.docker
async def test_stop_kills_after_the_grace_a_job_that_ignores_sigterm(node: DockerDriver) -> None:
    la = on(node, command=("sh", "-c", "trap '' TERM; while :; do sleep 0.1; done"))
    await node.start(la)
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    await node.stop(la.key, grace_s=1)
    assert (await node.list())[0].running, "stop returns before the grace is over"
    w = await exited(node, la.key)
    took = time.monotonic() - t0
    assert 0.8 <= took < 6, took
    assert w.exit_code == 137 and w.stopped_by_us


@pytest.mark.docker
async def test_a_new_driver_on_the_node_readopts_its_containers(docker_engine: DockerEngine, tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = DockerDriver("node-readopt", data, docker_url=docker_engine.url)
    running = launch(node_id="node-readopt", job_id="long", command=("sleep", "60"))
    done = launch(node_id="node-readopt", job_id="short", command=("sh", "-c", "exit 5"))
    w_run = await first.start(running)
    await first.start(done)
    await exited(first, done.key)
    await first.close()  # the executor goes away; its containers do not

    second = DockerDriver("node-readopt", data, docker_url=docker_engine.url)
    other = DockerDriver("node-other", tmp_path / "other", docker_url=docker_engine.url)
    try:
        seen = {w.key: w for w in await second.list()}
        assert set(seen) == {running.key, done.key}
        assert seen[running.key].running and seen[running.key].container_id == w_run.container_id
        assert seen[running.key].started_at == w_run.started_at
        assert seen[done.key].exit_code == 5
        assert await other.list() == [], "another node's driver does not see them"
        with pytest.raises(DriverError) as e:  # nor can it take the name
            await other.start(launch(node_id="node-other", job_id="long", command=("sleep", "1")))
        assert e.value.code == "name_conflict"

        assert (await second.start(running)).container_id == w_run.container_id, "adopted, not started twice"
        assert await second.pids(running.key)
        await second.stop(running.key, grace_s=2)
        assert (await exited(second, running.key)).stopped_by_us
    finally:
        for w in await second.list():
            await second.cleanup(w.key)
        await second.close()
        await other.close()
    assert (data / "logs" / f"{done.key}.log").exists()


@pytest.mark.docker
async def test_image_not_allowed_is_refused_and_nothing_is_created(docker_engine: DockerEngine, tmp_path: Path) -> None:
    d = DockerDriver("node-policy", tmp_path, docker_url=docker_engine.url,
                     allowed_images=lambda tenant, image: tenant == "trusted")
    try:
        with pytest.raises(DriverError) as e:
            await d.start(launch(node_id="node-policy", tenant="acme"))
        assert e.value.code == "image_not_allowed"
        assert "gpufleet-test/busybox:1" in e.value.message and "acme" in e.value.message
        assert await d.list() == []
        w = await d.start(launch(node_id="node-policy", tenant="trusted", command=("true",)))
        assert w.container_id
    finally:
        for w in await d.list():
            await d.cleanup(w.key)
        await d.close()


@pytest.mark.docker
async def test_missing_image_with_pull_never(docker_engine: DockerEngine, tmp_path: Path) -> None:
    d = DockerDriver("node-never", tmp_path, docker_url=docker_engine.url, pull="never")
    try:
        with pytest.raises(DriverError) as e:
            await d.start(launch(node_id="node-never", image="gpufleet-test/absent:9"))
        assert e.value.code == "image_missing" and "gpufleet-test/absent:9" in e.value.message
        assert await d.list() == []
    finally:
        await d.close()


@pytest.mark.docker
async def test_gpu_request_reaches_the_engine(node: DockerDriver, engine: aiodocker.Docker) -> None:
    """Without the NVIDIA runtime the engine refuses the device request: start says so, leaves nothing."""
    info = await engine.system.info()
    if "nvidia" in (info.get("Runtimes") or {}):
        pytest.skip("this engine has the NVIDIA runtime: the refusal cannot be shown here")
    with pytest.raises(DriverError) as e:
        await node.start(on(node, gpu_indices=(0,), gpu_uuids=("GPU-0000",), command=("true",)))
    assert e.value.code == "start_failed"
    assert "gpu" in e.value.message.lower(), e.value.message
    assert await node.list() == []
