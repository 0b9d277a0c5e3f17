"""A workload the executor starts never sees a credential (issue 14), tested by workloads that try.

The executor here is this test process (root on these machines), with the mesh's credentials in
its environment (GPUFLEET_CREDS, NATS_CREDS, a NATS token, the PostgreSQL DSN) and a data dir
laid out as the mesh's: creds/admin.creds (0600 in a 0700 dir), executor/<node> (the driver's
work dir), checkpoints/. The process driver runs real processes; the docker driver's request is
checked as data, and on a real engine (`docker` mark) a container runs `env` itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pwd
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpufleet.services.executor import process_driver
from gpufleet.services.executor.docker_driver import DockerDriver
from gpufleet.services.executor.drivers import DriverError, Launch
from gpufleet.services.executor.process_driver import (
    JOB_USER,
    ProcessDriver,
    inherited_env,
    is_credential_name,
    workload_user,
)
from gpufleet.shared.node import checkpoints

from .dockerd import DockerEngine
from .helpers import wait_until
from .test_executor_process import job_dir, wait_exit, workload_python  # noqa: F401 - job_dir is a fixture

NODE = "iso-0"
SEED = "SUAGPUFLEETADMINSEEDDONOTLEAK0000000000000000000000000000"
TOKEN = "nats-token-do-not-leak"
PG_PASSWORD = "pg-password-do-not-leak"
SECRETS = (SEED, TOKEN, PG_PASSWORD)
CREDENTIAL_VARS = ("GPUFLEET_CREDS", "NATS_CREDS", "NATS_TOKEN", "GPUFLEET_PG_DSN", "MY_SERVICE_PASSWORD")

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="workloads switch users only when the executor runs as root")


@dataclass(frozen=True)
class Mesh:
    base: Path  # what the data dir lives in (searchable, as /var/lib is)
    data: Path  # the mesh's data dir
    creds: Path  # <data>/creds/admin.creds

    @property
    def work(self) -> Path:
        return self.data / "executor" / NODE  # the agent's default work dir for the node

    @property
    def checkpoints(self) -> Path:
        return self.data / "checkpoints"  # the agent's default checkpoint root


@pytest.fixture
def mesh(monkeypatch: pytest.MonkeyPatch) -> Iterator[Mesh]:
    """A data dir with the admin's credentials, and them in the executor's environment."""
    base = Path(tempfile.mkdtemp(prefix="gpufleet-iso-", dir="/tmp"))
    base.chmod(0o755)
    data = base / "data"
    data.mkdir(mode=0o755)
    (data / "creds").mkdir(mode=0o700)
    creds = data / "creds" / "admin.creds"
    creds.write_text(json.dumps({"name": "admin", "seed": SEED}))
    creds.chmod(0o600)
    (data / "mesh.json").write_text(json.dumps({"nats_url": "nats://127.0.0.1:4222"}))
    monkeypatch.setenv("GPUFLEET_CREDS", str(creds))
    monkeypatch.setenv("NATS_CREDS", str(creds))
    monkeypatch.setenv("NATS_TOKEN", TOKEN)
    monkeypatch.setenv("GPUFLEET_PG_DSN", f"postgresql://gpufleet:{PG_PASSWORD}@127.0.0.1:5432/gpufleet")
    monkeypatch.setenv("MY_SERVICE_PASSWORD", PG_PASSWORD)
    monkeypatch.setenv("LANG", "C.UTF-8")
    monkeypatch.delenv("GPUFLEET_CHECKPOINT_ROOT", raising=False)
    try:
        yield Mesh(base, data, creds)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def launch(key: str, *command: str, **kw: Any) -> Launch:
    return Launch(job_id=key, tenant="acme", replica=0, attempt=1, node_id=NODE, command=command, **kw)


def sections(log: str) -> dict[str, str]:
    """The workload's output, by the `--- name` lines it printed."""
    out: dict[str, str] = {}
    name = ""
    for line in log.splitlines():
        if line.startswith("--- "):
            name = line[4:].strip()
            out[name] = ""
        else:
            out[name] = out.get(name, "") + line + "\n"
    return out


def assert_no_credential(text: str, mesh: Mesh) -> None:
    for secret in SECRETS:
        assert secret not in text, f"a credential leaked: {secret!r} in\n{text}"
    for var in CREDENTIAL_VARS:
        assert f"{var}=" not in text, f"{var} leaked into\n{text}"


# ---------------------------------------------------------------- the process driver


@as_root
async def test_a_workload_that_tries_finds_no_credential(mesh: Mesh) -> None:
    d = ProcessDriver(NODE, mesh.work)
    job = launch("snoop", "sh", "-c", f"""
        echo "--- id"; id -u; id -g; id -G
        echo "--- cat"; cat {mesh.creds} 2>&1; echo "rc=$?"
        echo "--- ls"; ls -la {mesh.data}/creds 2>&1; echo "rc=$?"
        echo "--- env"; env
        echo "--- executor"; tr '\\0' '\\n' < /proc/{os.getpid()}/environ 2>&1; echo "rc=$?"
        echo "--- meta"; cat {mesh.work}/jobs/snoop.0.1/meta.json 2>&1; echo "rc=$?"
        echo "--- forge"; echo '{{"pid": 1}}' > {mesh.work}/jobs/snoop.0.1/meta.json 2>&1; echo "rc=$?"
        echo "--- jobs"; ls {mesh.work}/jobs 2>&1; echo "rc=$?"
        echo "--- logs"; ls {mesh.work}/logs 2>&1; echo "rc=$?"
        echo "--- home"; echo mine > "$HOME/note" && pwd && echo "rc=$?"
        """, env={"LR": "0.1"})
    w = await d.start(job)
    assert await wait_exit(d, job.key) == 0
    log = (mesh.work / "logs" / f"{job.key}.log").read_text()
    out = sections(log)

    assert_no_credential(log, mesh)
    job_user = pwd.getpwnam(d.run_as.name)
    assert d.run_as.name in (JOB_USER, "nobody") and job_user.pw_uid != 0
    uid, gid, groups = out["id"].split("\n")[:3]
    assert (int(uid), int(gid)) == (job_user.pw_uid, job_user.pw_gid), out["id"]
    assert groups.split() == [str(job_user.pw_gid)], "no supplementary group (root's least of all)"

    for name in ("cat", "ls", "executor", "meta", "forge", "jobs", "logs"):
        assert "Permission denied" in out[name] and "rc=0" not in out[name], (name, out[name])
    assert "admin.creds" not in out["ls"].replace(str(mesh.data), "")

    env = dict(line.split("=", 1) for line in out["env"].splitlines() if "=" in line)
    assert not [k for k in env if is_credential_name(k)], env
    assert str(mesh.creds) not in out["env"]
    assert env["GPUFLEET_JOB_ID"] == "snoop" and env["GPUFLEET_ATTEMPT"] == "1" and env["LR"] == "0.1"
    assert env["HOME"] == str(mesh.work / "jobs" / job.key / "work") and env["USER"] == d.run_as.name
    assert env["PATH"] == os.environ["PATH"] and env["LANG"] == "C.UTF-8"
    assert "rc=0" in out["home"] and out["home"].splitlines()[0] == env["HOME"]  # its working dir too

    # the executor's state is untouched and still its own; the job's left file keeps its work dir
    meta = json.loads((mesh.work / "jobs" / job.key / "meta.json").read_text())
    assert meta["pid"] == w.pid and meta["uid"] == job_user.pw_uid
    st = (mesh.work / "jobs" / job.key / "meta.json").stat()
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE((mesh.data / "creds").stat().st_mode) == 0o700
    await d.cleanup(job.key)
    assert (mesh.work / "jobs" / job.key / "work" / "note").read_text() == "mine\n"
    assert not (mesh.work / "jobs" / job.key / "meta.json").exists()


@as_root
async def test_a_normal_workload_runs_and_writes_its_checkpoints(mesh: Mesh) -> None:
    d = ProcessDriver(NODE, mesh.work)  # its checkpoint root: the default, <data dir>/checkpoints
    ckpt = mesh.checkpoints / "acme" / "train"
    script = mesh.base / "train.py"
    script.write_text(
        "import os, sys\n"
        "from gpufleet.sdk import checkpoint\n"
        "for step in range(3):\n"
        "    checkpoint.save(step, {'state.json': b'{\"step\": %d}' % step}, keep=2)\n"
        "open('in-cwd', 'w').write(os.getcwd())\n"
        "sys.exit(7)\n")
    job = launch("train", *workload_python(), str(script), checkpoint_dir=str(ckpt))
    await d.start(job)
    assert await wait_exit(d, job.key, timeout_s=30) == 7, (mesh.work / "logs" / f"{job.key}.log").read_text()

    scanned = checkpoints.scan(ckpt)
    assert [(s.step, s.checkpoint is not None) for s in scanned] == [(2, True), (1, True)]  # step 0 pruned
    assert (ckpt / "in-cwd").read_text() == str(ckpt)  # its working dir is its checkpoint dir
    uid = d.run_as.uid
    assert ckpt.stat().st_uid == uid and (ckpt / "step-000000002").stat().st_uid == uid
    assert mesh.checkpoints.stat().st_uid == os.geteuid() and (mesh.checkpoints / "acme").stat().st_uid == os.geteuid()

    # a second run of the job (attempt 2) finds its dir still its own and goes on from there
    again = Launch(job_id="train", tenant="acme", replica=0, attempt=2, node_id=NODE,
                   command=("sh", "-c", 'echo more > "$GPUFLEET_CHECKPOINT_DIR/more"'), checkpoint_dir=str(ckpt))
    await d.start(again)
    assert await wait_exit(d, again.key) == 0
    assert (ckpt / "more").read_text() == "more\n"


@as_root
async def test_a_checkpoint_dir_made_by_an_older_executor_is_handed_over(mesh: Mesh) -> None:
    ckpt = mesh.checkpoints / "acme" / "old"
    (ckpt / "step-000000001").mkdir(parents=True)
    (ckpt / "step-000000001" / "state.json").write_text("{}")  # root's, as jobs ran as root before
    (ckpt / "link").symlink_to("/etc/passwd")
    d = ProcessDriver(NODE, mesh.work)
    job = launch("old", "sh", "-c", 'rm -r "$GPUFLEET_CHECKPOINT_DIR/step-000000001" && echo ok > new',
                 checkpoint_dir=str(ckpt))
    await d.start(job)
    assert await wait_exit(d, job.key) == 0
    assert not (ckpt / "step-000000001").exists() and (ckpt / "new").read_text() == "ok\n"
    assert os.stat("/etc/passwd").st_uid == 0, "a symlink in it is not followed"


@as_root
async def test_a_checkpoint_path_of_the_jobs_own_is_never_made_by_root(mesh: Mesh, job_dir: Path) -> None:  # noqa: F811
    d = ProcessDriver(NODE, mesh.work)
    system = mesh.base / "system"  # root's (as /etc, /usr/lib/python3/dist-packages are)
    system.mkdir(mode=0o755)
    refused = launch("elsewhere", "sh", "-c", 'pwd; test ! -d "$GPUFLEET_CHECKPOINT_DIR"',
                     checkpoint_dir=str(system / "sitecustomize"))
    allowed = launch("mine", "sh", "-c", 'echo x > "$GPUFLEET_CHECKPOINT_DIR/x"',
                     checkpoint_dir=str(job_dir / "tenant-volume" / "run"))
    await d.start(refused)
    await d.start(allowed)
    assert await wait_exit(d, refused.key) == 0
    assert await wait_exit(d, allowed.key) == 0
    assert not (system / "sitecustomize").exists()
    assert (mesh.work / "logs" / f"{refused.key}.log").read_text().strip() == str(
        mesh.work / "jobs" / refused.key / "work")  # it ran, in its work dir
    made = job_dir / "tenant-volume" / "run"
    assert made.stat().st_uid == d.run_as.uid and (made / "x").read_text() == "x\n"


@as_root
async def test_stop_reaches_a_workload_of_another_user(mesh: Mesh) -> None:
    d = ProcessDriver(NODE, mesh.work)
    job = launch("long", "sh", "-c", "sleep 30 & wait")
    w = await d.start(job)
    assert w.running and w.pid
    pgid = w.pid
    await wait_until(lambda: len(process_driver.group_pids(pgid)) >= 3, timeout_s=5, every_s=0.02)  # sh x2, sleep
    assert os.stat(f"/proc/{w.pid}").st_uid == d.run_as.uid
    assert process_driver.job_of_pid(w.pid) == ("long", 0, 1)  # telemetry still finds it by its env
    await d.stop(job.key, grace_s=1)
    assert await wait_exit(d, job.key) == 128 + 15
    assert not process_driver.group_pids(w.pid)


def test_the_environment_is_built_not_inherited(mesh: Mesh) -> None:
    for name in CREDENTIAL_VARS + ("nats_url", "NATS_USER", "HF_TOKEN", "PGPASSWORD", "WANDB_API_KEY",
                                   "SENTRY_DSN", "X_NKEY_SEED", "AWS_SECRET_ACCESS_KEY", "GPUFLEET_NATS_URL"):
        assert is_credential_name(name), name
    for name in ("PATH", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "GPUFLEET_JOB_ID", "HOME"):
        assert not is_credential_name(name), name
    env = {**os.environ, "LC_ALL": "C", "SOMETHING_ELSE": "x"}
    kept = inherited_env(env)
    assert set(kept) <= {"PATH", "LANG", "LC_ALL", "TZ", "TERM", "TMPDIR", "PYTHONPATH", "LANGUAGE",
                         "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "NVIDIA_DRIVER_CAPABILITIES"}
    assert kept["LC_ALL"] == "C" and kept["LANG"] == "C.UTF-8" and "SOMETHING_ELSE" not in kept
    assert not [k for k in ProcessDriver(NODE, mesh.work).base_env if is_credential_name(k)]
    given = ProcessDriver(NODE, mesh.work, base_env={"FOO": "1", "NATS_CREDS": "x", "API_TOKEN": "y"})
    assert given.base_env == {"FOO": "1"}  # an explicit base env, credentials dropped all the same


def test_not_root_runs_as_the_executors_user_and_says_so_once(
        mesh: Mesh, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(process_driver.os, "geteuid", lambda: 4242)
    monkeypatch.setattr(process_driver, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=process_driver.__name__):
        first = ProcessDriver(NODE, mesh.work)
        ProcessDriver(NODE, mesh.work)
    assert (first.run_as.uid, first.run_as.switch, first.run_as.popen_kwargs()) == (4242, False, {})
    warned = [r.getMessage() for r in caplog.records if "own user" in r.getMessage()]
    assert len(warned) == 1 and "credentials" in warned[0]
    with pytest.raises(ValueError, match="needs root"):
        workload_user("nobody")


@as_root
def test_workloads_never_run_as_root() -> None:
    with pytest.raises(ValueError, match="never run as root"):
        workload_user("root")
    with pytest.raises(ValueError, match="no such user"):
        workload_user("no-such-user-gpufleet")
    assert workload_user().uid != 0 and workload_user("nobody").switch


# ---------------------------------------------------------------- the docker driver


def container_env(config: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in config["Env"])


def test_a_containers_request_has_no_credential_and_mounts_only_its_checkpoint_dir(mesh: Mesh) -> None:
    d = DockerDriver(NODE, mesh.work)
    ckpt = mesh.checkpoints / "acme" / "j1"
    config = d.config_for(launch("j1", "env", image="busybox:1", checkpoint_dir=str(ckpt), env={"LR": "0.1"}))
    host = config["HostConfig"]
    assert host["Binds"] == [f"{ckpt}:{ckpt}:rw"]  # the job's own checkpoint dir, nothing else
    assert "Mounts" not in host and "Volumes" not in config and "VolumesFrom" not in host
    env = container_env(config)
    assert not [k for k in env if is_credential_name(k)]
    assert env == {**launch("j1", checkpoint_dir=str(ckpt), env={"LR": "0.1"}).job_env()}  # the job's, only
    assert_no_credential("\n".join(config["Env"]), mesh)
    assert str(mesh.creds) not in json.dumps(config)
    assert config["User"] == "65534:65534" and host["NetworkMode"] == "none"


@pytest.mark.parametrize("where", ["data", "data/creds", "data/creds/admin", "base", "/", "work", "work/logs",
                                   "work/docker/x", "elsewhere"])
def test_a_checkpoint_dir_that_would_show_the_mesh_is_refused(
        mesh: Mesh, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    other = mesh.base / "other-creds" / "creds"
    other.mkdir(parents=True)
    monkeypatch.setenv("GPUFLEET_CREDS", str(other / "admin.creds"))  # creds kept outside the data dir
    paths = {"data": mesh.data, "data/creds": mesh.data / "creds", "data/creds/admin": mesh.data / "creds" / "admin",
             "base": mesh.base, "/": Path("/"), "work": mesh.work, "work/logs": mesh.work / "logs",
             "work/docker/x": mesh.work / "docker" / "x", "elsewhere": other / "x"}
    d = DockerDriver(NODE, mesh.work)
    with pytest.raises(DriverError) as e:
        d.config_for(launch("j1", "true", image="busybox:1", checkpoint_dir=str(paths[where])))
    assert e.value.code == "checkpoint_dir_not_allowed" and "checkpoint_dir" in e.value.message


@pytest.mark.docker
async def test_a_container_that_tries_finds_no_credential(docker_engine: DockerEngine, mesh: Mesh) -> None:
    d = DockerDriver(NODE, mesh.work, docker_url=docker_engine.url)
    ckpt = mesh.checkpoints / "acme" / "peek"
    job = launch("peek", "sh", "-c", f"""
        echo "--- id"; id -u
        echo "--- env"; env
        echo "--- cat"; cat {mesh.creds} 2>&1; echo "rc=$?"
        echo "--- ls"; ls {mesh.data} {mesh.data}/creds 2>&1; echo "rc=$?"
        """, image=docker_engine.image, checkpoint_dir=str(ckpt))
    try:
        await d.start(job)
        deadline = time.monotonic() + 30
        while not [w for w in await d.list() if w.key == job.key and not w.running]:
            assert time.monotonic() < deadline, "the container did not end"
            await asyncio.sleep(0.05)
        await d.cleanup(job.key)
    finally:
        for w in await d.list():
            await d.cleanup(w.key)
        await d.close()
    log = (mesh.work / "logs" / f"{job.key}.log").read_text()
    out = sections(log)
    assert_no_credential(log, mesh)
    assert out["id"].strip() == "65534"
    env = dict(line.split("=", 1) for line in out["env"].splitlines() if "=" in line)
    assert not [k for k in env if is_credential_name(k)] and env["GPUFLEET_JOB_ID"] == "peek"
    assert "rc=0" not in out["cat"] and "rc=0" not in out["ls"]  # nothing of the data dir is there
    assert "admin.creds" not in out["ls"] and "mesh.json" not in out["ls"]
