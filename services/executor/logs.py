"""A job's logs, served by the executor of its node over NATS request/reply (`gpufleet logs`).

Each executor runs a NATS micro service, `gpufleet-logs` (discoverable with `nats micro ls`, its
stats on `$SRV.STATS.gpufleet-logs`), with one endpoint on `fleet.logs.<tenant>.<node_id>`:

- the tenant is in the subject, so the server's permissions decide who may ask: a tenant may
  publish only `fleet.logs.<its own>.>` (shared/trust/authz.py); the executor then answers only
  for a workload of that tenant (a job of another tenant is "not found", as if it did not exist);
- every executor instance listens in a queue group of its own and answers only for the nodes it
  hosts (the others stay silent), so the request reaches the node wherever its executor runs.

A request is JSON (`LogRequest`): the workload (`job_id`, `replica`, `attempt`), and either a
byte `offset` to read on from or `tail` (the last N lines); at most `limit` bytes come back. The
reply (`LogReply`) carries the bytes (`data`, UTF-8 with bad bytes replaced), the `offset` of
their first byte and `next` (where to ask again), the log's `size` and whether the workload
still `running`, so `gpufleet logs -f` reads on from `next` until it ended and nothing is left.
A bad request gets a micro error (header `Nats-Service-Error-Code` 400, the field and the reason).

Where the bytes are, per driver:
- `process`: `logs/<job>.<replica>.<attempt>.log` under the node's data dir (kept after the
  workload's clean-up, one file per attempt, so a resumed job's earlier runs stay readable);
- `docker`: the engine's log of the container while it exists, then the copy the driver saved at
  clean-up (same path);
- `sim`: a few synthetic lines rendered from the job's own events in the log (started, each tenth
  of its simulated duration, checkpoints, its exit), the same bytes each time they are asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gpufleet.shared.contract.events import LOGS_PREFIX
from gpufleet.shared.contract.logs import LogReply, LogRequest

__all__ = ["LogReply", "LogRequest", "LogServer", "LogText", "cut", "parse_request", "sim_lines"]

log = logging.getLogger(__name__)

SERVICE_NAME = "gpufleet-logs"
TAIL_SCAN = 4 * 1024 * 1024  # `tail` looks back at most this many bytes


@dataclass(frozen=True)
class LogText:
    """A workload's log as one driver has it now."""

    tenant: str
    data: bytes | None = None  # the whole log (docker while it runs; sim)
    path: Path | None = None  # or a file holding it
    running: bool = False


def tenant_file(logs_dir: Path, key: str) -> Path:
    """Whose workload `key`'s log is (written by the driver at start, kept with the log)."""
    return logs_dir / f"{key}.tenant"


def write_tenant(logs_dir: Path, key: str, tenant: str) -> None:
    import os

    fd = os.open(tenant_file(logs_dir, key), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(tenant)


def read_tenant(logs_dir: Path, key: str) -> str | None:
    try:
        return tenant_file(logs_dir, key).read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def cut(text: LogText, req: LogRequest) -> tuple[bytes, int, int]:
    """(bytes, their offset, the log's size) of what `req` asks of `text`."""
    if text.data is not None:
        whole = text.data
        size = len(whole)

        def read(at: int, n: int) -> bytes:
            return whole[at:at + n]
    else:
        assert text.path is not None
        path: Path = text.path
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = 0

        def read(at: int, n: int) -> bytes:
            try:
                with open(path, "rb") as f:
                    f.seek(at)
                    return f.read(n)
            except FileNotFoundError:
                return b""
    if req.tail is not None:
        back = min(size, TAIL_SCAN)
        window = read(size - back, back)
        lines = window.splitlines(keepends=True)
        if back < size and lines:
            lines = lines[1:]  # the first may be cut
        keep = lines[-req.tail:] if req.tail else []
        start = size - sum(len(x) for x in keep)
    else:
        start = min(req.offset, size)
    data = read(start, min(req.limit, size - start))
    return data, start, size


class BadLogRequest(ValueError):
    pass


def parse_request(raw: bytes) -> LogRequest:
    try:
        doc = json.loads(raw or b"{}")
    except ValueError as e:
        raise BadLogRequest(f"the request is not JSON: {e}") from e
    try:
        return LogRequest.model_validate(doc)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "request"
        raise BadLogRequest(f"{where}: {first.get('msg')}") from e


class LogServer:
    """The micro service on one executor: `source(node, key, tenant)` finds a workload's log."""

    def __init__(self, bus: Any, instance: str, hosted: Callable[[], Iterable[str]],
                 source: Callable[[str, str, str, LogRequest], Any], driver_of: Callable[[str], str]) -> None:
        self.bus = bus
        self.instance = instance
        self.hosted = hosted
        self.source = source
        self.driver_of = driver_of
        self._svc: Any = None

    async def start(self) -> None:
        from nats.micro import add_service

        from gpufleet import __version__

        version = __version__ if __version__.count(".") == 2 else "0.1.0"
        self._svc = await add_service(self.bus.nc, name=SERVICE_NAME, version=version,
                                      description="a job's logs from the executor of its node",
                                      queue_group=f"logs-{self.instance}".replace(".", "-"))
        await self._svc.add_endpoint(name="logs", subject=f"{LOGS_PREFIX}.*.*", handler=self._handle)

    async def stop(self) -> None:
        if self._svc is not None:
            with contextlib.suppress(Exception):
                await self._svc.stop()
            self._svc = None

    async def _handle(self, req: Any) -> None:
        parts = req.subject.split(".")
        if len(parts) != 4:
            return
        tenant, node = parts[2], parts[3]
        if node not in set(self.hosted()):
            return  # another executor's node: it answers
        try:
            r = parse_request(req.data)
        except BadLogRequest as e:
            await req.respond_error("400", str(e))
            return
        from gpufleet.services.executor.drivers import workload_key

        key = workload_key(r.job_id, r.replica, r.attempt)
        try:
            text = await self.source(node, key, tenant, r)
        except Exception as e:  # noqa: BLE001 - the asker hears why; the service goes on
            log.warning("logs of %s on %s: %s", key, node, e)
            await req.respond_error("503", f"the logs of {key} on {node} cannot be read now: {e}")
            return
        if text is None or text.tenant != tenant:
            await req.respond_error("404", f"no logs of job {r.job_id} replica {r.replica} attempt {r.attempt} "
                                           f"of tenant {tenant} on node {node}")
            return
        data, start, size = await asyncio.to_thread(cut, text, r)
        reply = LogReply(job_id=r.job_id, replica=r.replica, attempt=r.attempt, node_id=node, driver=self.driver_of(node),
                         data=data.decode("utf-8", "replace"), offset=start, next=start + len(data), size=size,
                         running=text.running)
        await req.respond(reply.model_dump_json().encode())


# ---------------------------------------------------------------- sim: lines from the job's events


def sim_lines(events: list[Any], replica: int, attempt: int, now: float) -> tuple[str, bool] | None:
    """The synthetic log of a sim workload, from the job's events in log order; (text, running),
    or None when that run never started. The same events and clock give the same bytes, and a
    later clock only adds lines."""
    from gpufleet.shared.contract.events import JobExited, JobStarted, JobSubmitted

    started = None
    exited = None
    duration = None
    checkpoints: list[Any] = []
    for env in events:
        p = env.payload
        if isinstance(p, JobSubmitted):
            sim = p.spec.sim
            duration = sim.runs[attempt - 1].duration_s if attempt <= len(sim.runs) else sim.duration_s
        elif isinstance(p, JobStarted) and p.replica == replica and p.attempt == attempt:
            started = (env, p)
        elif isinstance(p, JobExited) and p.replica == replica and p.attempt == attempt:
            exited = (env, p)
        elif env.type == "job.checkpoint_saved" and started is not None and exited is None:
            checkpoints.append(env)
    if started is None:
        return None
    env, p = started
    t0 = env.occurred_at.timestamp()
    end = exited[0].occurred_at.timestamp() if exited else now
    out = [f"{_ts(t0)} [sim] job {p.job_id} replica {replica} attempt {attempt} started on {p.node_id}"]
    try:
        total = float(duration) if duration is not None else 0.0
    except (TypeError, ValueError):
        total = 0.0
    marks: list[tuple[float, str]] = []
    if total > 0:
        for i in range(1, 10):
            at = t0 + total * i / 10
            if at <= end:
                marks.append((at, f"{_ts(at)} [sim] step {i * 10}% of {total:g} s, loss {2.0 * 0.8 ** i:.4f}"))
    for c in checkpoints:
        at = c.occurred_at.timestamp()
        step = getattr(c.payload, "step", None)
        marks.append((at, f"{_ts(at)} [sim] checkpoint written" + (f" at step {step}" if step is not None else "")))
    out += [line for _, line in sorted(marks)]
    if exited:
        x = exited[1]
        out.append(f"{_ts(end)} [sim] exited with code {x.exit_code} ({x.reason})")
    return "\n".join(out) + "\n", exited is None


def _ts(t: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"
