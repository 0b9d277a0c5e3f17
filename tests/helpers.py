"""Test helpers: run service cores in-process against a real nats-server, build events."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.guardian.core import GuardianCore
from gpufleet.services.placer.core import PlacerCore
from gpufleet.services.quota.core import QuotaCore
from gpufleet.shared.contract.events import CancelRequestedCmd, Envelope, SubmitRequested, parse_envelope, utc
from gpufleet.shared.contract.ids import derive_id, ulid
from gpufleet.shared.node.cluster import sim_fleet
from gpufleet.shared.read.view import ClusterView, apply
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.loop import Core, ServiceRuntime


def new_id() -> str:
    return ulid(int(time.time() * 1000), os.urandom(10))


def submit_cmd(spec: dict[str, Any], job_id: str | None = None, tenant: str | None = None) -> Envelope:
    job_id = job_id or new_id()
    tenant = tenant or str(spec.get("tenant", "acme"))
    return Envelope(
        event_id=derive_id(job_id, "submit"), type="cmd.submit", occurred_at=utc(time.time()), tenant=tenant,
        actor="test", correlation_id=job_id, payload=SubmitRequested(job_id=job_id, spec=spec),
    )


def cancel_cmd(job_id: str, tenant: str = "acme") -> Envelope:
    return Envelope(
        event_id=new_id(), type="cmd.cancel", occurred_at=utc(time.time()), tenant=tenant, actor="test",
        correlation_id=job_id, payload=CancelRequestedCmd(job_id=job_id),
    )


def default_cores(sim_nodes: int = 4) -> list[Core[Any]]:
    return [AdmissionCore(), QuotaCore(), PlacerCore(), ExecutorCore(sim_fleet(sim_nodes)), GuardianCore()]


# The cluster config the test's services ran with, for the audit of its log (tests/conftest.py):
# quota limits can only be checked against the queues the services were given.
AUDIT: dict[str, Any] = {}


@asynccontextmanager
async def running(url: str, cores: list[Core[Any]]) -> AsyncIterator[list[ServiceRuntime[Any]]]:
    """Start each core's runtime (own connection) and run them until the block ends."""
    for core in cores:
        config = getattr(core, "config", None)
        if core.name == "quota" and config is not None:
            AUDIT["config"] = config
    rts: list[ServiceRuntime[Any]] = []
    tasks = []
    for core in cores:
        bus = await Bus.connect(url, name=core.name, creds=service_creds(core.name))
        rt: ServiceRuntime[Any] = ServiceRuntime(core, bus, fetch_timeout_s=0.05)
        await rt.start()
        rts.append(rt)
        tasks.append(asyncio.create_task(rt.run()))
    try:
        yield rts
    finally:
        for rt in rts:
            rt.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rt in rts:
            await rt.bus.close()


def service_creds(name: str) -> Path | None:
    """The test server's credentials of service `name` (conftest's realm), so a core runs with
    exactly the permissions `gpufleet up` gives it; None (the admin's) for a test's own core."""
    realm = os.environ.get("GPUFLEET_TEST_REALM")
    if not realm:
        return None
    from gpufleet.shared.trust.authz import Realm

    p = Realm(Path(realm)).creds_path(f"svc-{name}")
    return p if p.exists() else None


async def read_log(bus: Bus) -> list[tuple[int, Envelope]]:
    """Every event in FLEET, in order (direct get by sequence)."""
    last = await bus.last_seq()
    out = []
    for seq in range(1, last + 1):
        msg = await bus.js.get_msg("FLEET", seq)
        try:
            out.append((seq, parse_envelope(msg.data or b"")))
        except Exception:  # noqa: BLE001 - bad messages are part of some tests' logs
            continue
    return out


async def nodes_registered(bus: Bus, n: int = 1) -> bool:
    """Whether at least `n` nodes have registered (so cluster checks and placement apply)."""
    return sum(1 for _, e in await read_log(bus) if e.type == "node.registered") >= n


async def fold_log(bus: Bus) -> ClusterView:
    view = ClusterView()
    for seq, env in await read_log(bus):
        apply(view, env, seq)
    return view


async def wait_until(pred: Callable[[], Any], timeout_s: float = 20.0, every_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = await pred() if asyncio.iscoroutinefunction(pred) else pred()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met in {timeout_s}s")
        await asyncio.sleep(every_s)


async def job_status(bus: Bus, job_id: str) -> str | None:
    view = await fold_log(bus)
    row = view.jobs.get(job_id)
    return row.status if row else None


@asynccontextmanager
async def agent_running(url: str, name: str, make: Callable[[Bus], Any], creds: Any = None) -> AsyncIterator[Any]:
    """A service agent (executor, telemetry) on its own connection (as `creds`, else the test's
    admin), running until the block ends."""
    bus = await Bus.connect(url, name=name, creds=creds)
    agent = make(bus)
    agent.runtime.fetch_timeout_s = 0.05
    await agent.start()
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        agent.stop()
        await task
        await bus.close()


# ---------------------------------------------------------------- what a workload can reach
# Run as root (as here), the process driver runs every workload as an unprivileged user, which
# cannot reach pytest's tmp_path (under a 0700 dir) nor this venv's interpreter where that is a
# pyenv under a 0700 /root: a job writes by path into `job_dir` and runs Python by `workload_python`.

import shutil  # noqa: E402
import stat  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from gpufleet.services.executor.process_driver import unsearchable, workload_user  # noqa: E402


@pytest.fixture
def job_dir() -> Iterator[Path]:
    """A directory workloads can reach and write whoever they run as (sticky, world-writable,
    under /tmp): for what a test's job writes by path (its outputs, a checkpoint root)."""
    d = Path(tempfile.mkdtemp(prefix="gpufleet-jobs-", dir="/tmp"))
    d.chmod(0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def workload_python() -> list[str]:
    """The start of a command that runs a Python script (the rest: the script and its arguments)
    the way a workload can, with gpufleet importable: this interpreter, or where the workload's
    user cannot reach it (a pyenv under a 0700 /root), the system's of the same version, given
    this venv's site-packages."""
    who = workload_user()
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for exe in (sys.executable, shutil.which(version) or "", f"/usr/bin/{version}"):
        real = Path(os.path.realpath(exe)) if exe else None
        if real is None or not real.is_file() or not real.name.startswith(version):
            continue
        if who.switch and (not real.stat().st_mode & stat.S_IXOTH or unsearchable(real.parent, who) is not None):
            continue
        if real == Path(os.path.realpath(sys.executable)):
            return [sys.executable]
        site_packages = [p for p in sys.path if p.startswith(sys.prefix) and p.endswith("site-packages")]
        boot = (f"import runpy, site, sys; [site.addsitedir(p) for p in {site_packages!r}]; "
                "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
        return [str(real), "-c", boot]
    pytest.skip(f"no Python interpreter that {who.name} can run")
