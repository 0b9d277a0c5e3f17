"""docker-compose.yml runs: the shipped topology (3 NATS nodes clustered over TLS with the
generated authorization, FLEET at R3, PostgreSQL, every service its own container and identity,
two placers) started in `depends_on` order with its health checks, a job run through it from
the CLI, and torn down.

With a Docker engine that can pull the images, that is `docker compose up`. The CI machine has
none (no registry reachable), so the same file runs as processes (gpufleet/tools/compose.py):
each container a process in a network namespace of its own, its names resolved as Docker's DNS
would, its volumes laid out under a root of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.shared.embedded import netns

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WHY_NOT_DOCKER = ("docker compose cannot pull nats, postgres and python images here (no registry is "
                  "reachable): docker-compose.yml runs as processes, one network namespace per container")


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> object:
    why = netns.available()
    if why is not None:
        pytest.skip(f"the compose topology needs network namespaces: {why}")
    from gpufleet.tools.compose import ComposeProcesses

    c = ComposeProcesses(tmp_path_factory.mktemp("compose"), env={"SIM_NODES": "4"})
    with c.up():
        yield c


def cli(compose: object, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    from gpufleet.tools.compose import ComposeProcesses

    assert isinstance(compose, ComposeProcesses)
    gen = compose.generated
    env = {**os.environ, "GPUFLEET_NATS_URL": "tls://nats:4222", "GPUFLEET_CREDS": str(gen / "creds" / "admin.creds"),
           "SSL_CERT_FILE": str(gen / "certs" / "ca.pem"),
           "GPUFLEET_PG_DSN": "postgresql://gpufleet@postgres:5432/gpufleet"}
    return subprocess.run(compose.client_argv([sys.executable, "-m", "gpufleet.cli", *args]), capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_the_compose_file_runs_a_job_end_to_end(compose: object, tmp_path: Path) -> None:
    print(WHY_NOT_DOCKER)
    spec = tmp_path / "job.yaml"
    spec.write_text("name: through-compose\ntenant: acme\nqueue: default\nresources: {cpu: 1, memory: 1Gi, gpu: 1}\n"
                    "maxRuntime: 10m\nsim: {duration: 2s}\n")
    sub = cli(compose, "submit", str(spec), "--yes", "--wait", "--json", timeout=180)
    assert sub.returncode == 0, sub.stdout[-1500:] + sub.stderr[-1500:]
    first, *events = (json.loads(line) for line in sub.stdout.strip().splitlines())
    job_id = first["job_id"]
    assert [e["type"] for e in events][-1] == "job.succeeded", sub.stdout[-1500:]
    assert {e["actor"].split("/")[0] for e in events} >= {"admission", "quota", "placer", "executor", "guardian"}
    # the read model (the projector in its container -> PostgreSQL) has it, ended well
    deadline_out = ""
    for _ in range(60):
        jobs = cli(compose, "jobs", "--json", "--limit", "0")
        if jobs.returncode == 0 and any(j["job_id"] == job_id and j["status"] == "succeeded"
                                        for j in json.loads(jobs.stdout)):
            break
        deadline_out = jobs.stdout[-800:] + jobs.stderr[-800:]
        time.sleep(1.0)  # (polling the read model for the positive signal above)
    else:
        raise AssertionError(f"{job_id} never succeeded in the read model: {deadline_out}")
    # the log it left is sound (no GPU given twice by the two placers, nothing pending unexplained)
    audit = cli(compose, "audit", "--json")
    assert audit.returncode == 0 and json.loads(audit.stdout)["ok"], audit.stdout[-1500:] + audit.stderr[-800:]


def test_a_service_identity_cannot_act_for_another(compose: object) -> None:
    # the generated authorization is the one the servers run: the placer's identity may not publish a submit
    from gpufleet.tools.compose import ComposeProcesses

    assert isinstance(compose, ComposeProcesses)
    gen = compose.generated
    code = ("import asyncio, nats, os\n"
            "async def main():\n"
            "    from gpufleet.shared.runtime.bus import Bus\n"
            "    bus = await Bus.connect('tls://nats:4222', name='t')\n"
            "    try:\n"
            "        await bus.js.publish('fleet.cmd.acme.submit', b'{}', timeout=5)\n"
            "        print('PUBLISHED')\n"
            "    except Exception as exc:\n"
            "        print('REFUSED', type(exc).__name__)\n"
            "    await bus.close()\n"
            "asyncio.run(main())\n")
    env = {**os.environ, "GPUFLEET_CREDS": str(gen / "creds" / "svc-placer.creds"),
           "SSL_CERT_FILE": str(gen / "certs" / "ca.pem")}
    proc = subprocess.run(compose.client_argv([sys.executable, "-c", code]), capture_output=True, text=True,
                          env=env, timeout=60)
    assert "REFUSED" in proc.stdout, proc.stdout + proc.stderr[-800:]


def test_the_log_is_replicated_on_the_three_servers(compose: object) -> None:
    from gpufleet.tools.compose import ComposeProcesses

    assert isinstance(compose, ComposeProcesses)
    gen = compose.generated
    code = ("import asyncio, json\n"
            "async def main():\n"
            "    from gpufleet.shared.runtime.bus import Bus\n"
            "    bus = await Bus.connect('tls://nats:4222', name='t')\n"
            "    info = await bus.js.stream_info('FLEET')\n"
            "    print(json.dumps([info.config.num_replicas, info.cluster.leader,\n"
            "                      [r.name for r in info.cluster.replicas or []]]))\n"
            "    await bus.close()\n"
            "asyncio.run(main())\n")
    env = {**os.environ, "GPUFLEET_CREDS": str(gen / "creds" / "admin.creds"), "SSL_CERT_FILE": str(gen / "certs" / "ca.pem")}
    proc = subprocess.run(compose.client_argv([sys.executable, "-c", code]), capture_output=True, text=True,
                          env=env, timeout=60)
    replicas, leader, followers = json.loads(proc.stdout)
    assert replicas == 3, proc.stdout + proc.stderr[-800:]
    assert sorted([leader, *followers]) == ["nats-1", "nats-2", "nats-3"], proc.stdout
