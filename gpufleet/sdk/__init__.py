"""The Python SDK: submit and cancel jobs, follow their events, rebuild the cluster state.

    async with await Fleet.connect(data_dir=None) as fleet:
        job_id = await fleet.submit(spec_dict)
        async for env in fleet.watch(job_id=job_id):
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

import nats
from nats.js.api import ConsumerConfig, DeliverPolicy

from gpufleet.shared.contract.config import data_dir as resolve_data_dir
from gpufleet.shared.contract.config import resolve_nats_url
from gpufleet.shared.contract.errors import GpufleetError, MeshNotRunning, RetryableError
from gpufleet.shared.contract.events import (
    SYS_TENANT,
    TERMINAL_JOB_TYPES,
    CancelRequestedCmd,
    Envelope,
    JobSubmitted,
    ReportLoadCmd,
    SubmitRequested,
    parse_envelope,
    utc,
)
from gpufleet.shared.contract.ids import check_token, derive_id, ulid, ulid_time_ms
from gpufleet.shared.contract.spec import parse_spec, spec_to_user
from gpufleet.shared.read.view import ClusterView
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.log import read_stream
from gpufleet.shared.trust.authz import ADMIN, find_creds

log = logging.getLogger(__name__)

# how long a command is sent again while the stream does not answer: a cut-off leader is replaced
# after its election timeout (4-9 s in nats-server), and a client on the cut server moves first
COMMAND_RETRY_S = 20.0
# one try's wait for the stream's ack: short, so that a try through a server cut from the quorum
# leaves time for more once the bus has moved to another (shared/runtime/bus.py watch_server)
COMMAND_TRY_S = 2.0

if TYPE_CHECKING:
    from gpufleet.tools.dashboard import Board


def new_job_id() -> str:
    return ulid(int(time.time() * 1000), os.urandom(10))


def submit_envelope(spec: dict[str, Any], job_id: str, actor: str = "sdk") -> Envelope:
    """The cmd.submit message; its id derives from the job id, so a retried submit is dropped."""
    check_token(job_id, "job_id")
    tenant = spec.get("tenant")
    check_token(str(tenant), "tenant")
    return Envelope(
        event_id=derive_id(job_id, "submit"), type="cmd.submit", occurred_at=utc(time.time()),
        tenant=str(tenant), actor=actor, correlation_id=job_id, payload=SubmitRequested(job_id=job_id, spec=spec),
    )


def job_filter(tenant: str | None = None, job_id: str | None = None, type_pattern: str | None = None) -> str:
    if type_pattern and type_pattern.startswith("node.") and not job_id and tenant in (None, "sys"):
        return f"fleet.evt.sys.node.*.{type_pattern.removeprefix('node.')}"  # node facts: node.lost ...
    short = (type_pattern or "*").removeprefix("job.")
    if job_id or tenant or type_pattern:
        return f"fleet.evt.{tenant or '*'}.job.{job_id or '*'}.{short}"
    return "fleet.>"


@dataclass
class Explanation:
    job_id: str
    history: list[tuple[int, Envelope]]  # (seq, event), in log order
    pending: list[dict[str, Any]]  # why it waits: {seq, kind, code, message, text, ...}
    interruptions: list[dict[str, Any]]  # each run that ended and how it went on: {..., text}
    # how each run got its dataset / model onto its node (bytes and seconds, or cached): {..., text}
    staging: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """`gpufleet explain --json`: {job_id, events, pending, interruptions, staging}."""
        return {"job_id": self.job_id,
                "events": [{"seq": s, **e.model_dump(mode="json", exclude_none=True)} for s, e in self.history],
                "pending": self.pending, "interruptions": self.interruptions, "staging": self.staging}


CONNECT_DEADLINE_S = 6.0


class Fleet:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.commands_read = 0  # by the last explain (it reads only the job's window)

    @classmethod
    async def connect(cls, data_dir: str | None = None, nats_url: str | None = None,
                      creds: str | None = None) -> Fleet:
        """Connect as `creds` (a credentials file), else $GPUFLEET_CREDS, else the data dir's admin
        (the local operator). A server that is down is reported within seconds (MeshNotRunning)."""
        url = nats_url or resolve_nats_url(data_dir)
        ident = find_creds(creds, resolve_data_dir(data_dir))
        errors: list[str] = []

        async def quiet(exc: Exception) -> None:  # nats-py would print a traceback per attempt
            errors.append(str(exc) or type(exc).__name__)

        who = ident.identity if ident else "no credentials"
        try:
            # the first connection within CONNECT_DEADLINE_S, or an error saying why; once
            # connected it reconnects for as long as the command runs (a long `watch`)
            bus = await asyncio.wait_for(Bus.connect(url, name="gpufleet-sdk", creds=ident, connect_timeout=2,
                                                     error_cb=quiet), CONNECT_DEADLINE_S)
        except (nats.errors.NoServersError, OSError, TimeoutError, nats.errors.Error) as exc:
            said = " ".join(errors[-1:]) or str(exc) or type(exc).__name__
            if any("authorization" in e.lower() for e in [*errors, str(exc)]):
                raise GpufleetError(f"NATS at {url} refused {who}: authorization violation") from None
            raise MeshNotRunning(f"NATS at {url} does not answer (within {CONNECT_DEADLINE_S:.0f} s: {said}); "
                                 "is the mesh up? (`gpufleet status`)") from None
        return cls(bus)

    @property
    def tenant(self) -> str | None:
        """The tenant this client acts as (its credentials'), None for the admin or no auth."""
        return self.bus.tenant_scope

    @property
    def is_admin(self) -> bool:
        return self.bus.creds is not None and self.bus.creds.is_admin

    async def __aenter__(self) -> Fleet:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        await self.bus.close()

    async def _send(self, env: Envelope, within_s: float = COMMAND_RETRY_S, headers: dict[str, str] | None = None) -> None:
        """Publish a command and wait for the stream's ack, again for `within_s` while the stream
        does not answer (a cluster electing a new leader, a server restarting): the same command,
        the same Nats-Msg-Id, so the server keeps it once however often it is sent."""
        deadline = time.monotonic() + within_s
        wait = 0.2
        unanswered = 0
        while True:
            try:
                await self.bus.publish(env, headers_extra=headers, ack_within_s=COMMAND_TRY_S)
                return
            except RetryableError:
                if time.monotonic() + wait > deadline:
                    raise
                unanswered += 1
                if unanswered % 2 == 0:  # twice unanswered here: the next try goes through another server
                    await self.bus.move_server(f"left {env.type} unanswered {unanswered} times")
                await asyncio.sleep(wait)
                wait = min(wait * 2, 2.0)

    async def submit(self, spec: dict[str, Any], job_id: str | None = None, validate: bool = True) -> str:
        """Publish a submit command; returns the job id. Raises SpecError on a bad spec. A tenant's
        credentials submit for that tenant only (a spec without `tenant` gets it)."""
        if self.tenant is not None:
            named = spec.get("tenant")
            if named is None:
                spec = {**spec, "tenant": self.tenant}
            elif named != self.tenant:
                raise GpufleetError(f"tenant: these credentials are tenant {self.tenant}'s; the spec names "
                                    f"tenant {named!r}")
        if validate:
            parse_spec(spec)
        job_id = job_id or new_job_id()
        await self._send(submit_envelope(spec, job_id))
        return job_id

    async def submit_for_verdict(self, spec: dict[str, Any], job_id: str | None = None,
                                 timeout_s: float = 10.0) -> dict[str, Any]:
        """Submit and wait for admission's verdict on this connection's own inbox (request/reply,
        header `Gpufleet-Reply`): `{"job_id", "accepted", "events": [job.admitted | job.rejected with
        its reasons | job.request_refused]}`. The verdict is in the log first; on a timeout the job's
        events say it (`watch --job`). Raises TimeoutError when no verdict came in `timeout_s`."""
        from gpufleet.shared.runtime.loop import REPLY_HEADER

        inbox = self.bus.nc.new_inbox()
        sub = await self.bus.nc.subscribe(inbox, max_msgs=1)
        try:
            if self.tenant is not None and spec.get("tenant") is None:
                spec = {**spec, "tenant": self.tenant}
            job_id = job_id or new_job_id()
            if self.tenant is not None and spec.get("tenant") != self.tenant:
                raise GpufleetError(f"tenant: these credentials are tenant {self.tenant}'s; the spec names "
                                    f"tenant {spec.get('tenant')!r}")
            await self._send(submit_envelope(spec, job_id), headers={REPLY_HEADER: inbox})
            msg = await sub.next_msg(timeout=timeout_s)
            return {"job_id": job_id, **json.loads(msg.data)}
        except nats.errors.TimeoutError:
            raise TimeoutError(f"no verdict on {job_id} within {timeout_s:g}s (the log has it: watch --job)") from None
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def cancel(self, job_id: str, tenant: str | None = None, reason: str = "cancelled by user") -> None:
        """Ask to cancel a job, as the caller's own identity: a tenant's credentials cancel on its
        own subject (admission refuses another tenant's job); the admin's on `fleet.cmd.sys.cancel`
        (an admin cancel, logged as the admin's). `tenant` is for a server without auth only."""
        actor = "sdk"
        if self.tenant is not None:
            if tenant not in (None, self.tenant):
                raise GpufleetError(f"tenant: these credentials are tenant {self.tenant}'s, not {tenant!r}'s")
            tenant = self.tenant
        elif self.is_admin:
            tenant, actor = SYS_TENANT, f"{ADMIN}/cli"
        elif tenant is None:
            raise GpufleetError("tenant: say whose job it is (a server without auth has no identities)")
        env = Envelope(
            event_id=derive_id(job_id, f"cancel:{time.time_ns()}"), type="cmd.cancel", occurred_at=utc(time.time()),
            tenant=tenant, actor=actor, correlation_id=job_id, payload=CancelRequestedCmd(job_id=job_id, reason=reason),
        )
        await self._send(env)

    async def operator_fact(self, payload: Any, who: str | None = None) -> Envelope:
        """State an operator fact (`node.cordoned` / `node.uncordoned`, a drain, a GPU returned to
        service: `OPERATOR_TYPES`) as the admin, in the log with the operator's name as its actor
        (`admin/<who>`, the local user by default). The node must have registered; a GPU must be
        one of its own. GpufleetError otherwise, and for any identity but the admin's."""
        from gpufleet.shared.contract.events import NodeRegistered
        from gpufleet.shared.trust.authz import OPERATOR_TYPES

        if not self.is_admin:
            raise GpufleetError(f"{payload.type}: only the admin states operator facts; these credentials are "
                                f"{'tenant ' + self.tenant + chr(39) + 's' if self.tenant else 'not the admin'}")
        if payload.type not in OPERATOR_TYPES:
            raise GpufleetError(f"{payload.type} is not an operator fact (one of {', '.join(sorted(OPERATOR_TYPES))})")
        node_id = payload.node_id
        check_token(node_id, "node")
        regs = [e.payload for _s, e in await self.history(f"fleet.evt.{SYS_TENANT}.node.{node_id}.registered")
                if isinstance(e.payload, NodeRegistered)]
        if not regs:
            raise GpufleetError(f"node {node_id}: no such node has registered (`gpufleet nodes`)")
        gpu = getattr(payload, "gpu_index", None)
        gpus = regs[-1].inventory.gpus
        if gpu is not None and gpu not in {g.index for g in gpus}:
            have = ", ".join(str(g.index) for g in gpus) or "none"
            raise GpufleetError(f"gpu: node {node_id} has no GPU {gpu} (its GPUs: {have})")
        now = time.time()
        env = Envelope(event_id=derive_id(f"op:{node_id}", f"{payload.type}:{time.time_ns()}"), type=payload.type,
                       occurred_at=utc(now), tenant=SYS_TENANT, actor=self._operator(who), payload=payload)
        await self._send(env)
        return env

    async def requeue(self, job_id: str, reason: str = "requeued by an operator", who: str | None = None) -> Envelope:
        """Stop a placed or running job and place it again (from its last checkpoint), as the
        admin: `job.resume_requested` with reason `requeued`, the operator as its actor; it spends
        none of the job's retries. GpufleetError for a job that is not placed or running now."""
        from gpufleet.shared.contract.events import (
            RUN_ENDED_JOB_TYPES,
            JobCheckpointSaved,
            JobPlaced,
            JobResumeRequested,
            Reason,
        )

        if not self.is_admin:
            raise GpufleetError("job.resume_requested: only the admin requeues a job")
        check_token(job_id, "job_id")
        hist = await self.history(job_filter(job_id=job_id))
        if not hist:
            raise GpufleetError(f"no job {job_id}")
        if any(e.type in RUN_ENDED_JOB_TYPES for _s, e in hist):
            raise GpufleetError(f"job {job_id} has ended: nothing to requeue (`gpufleet submit --from {job_id}`)")
        placed = [e.payload for _s, e in hist if isinstance(e.payload, JobPlaced)]
        resumed = [e.payload.attempt or 0 for _s, e in hist if isinstance(e.payload, JobResumeRequested)]
        attempt = max([1, *resumed])
        if not placed or placed[-1].attempt != attempt:
            raise GpufleetError(f"job {job_id} is not placed or running now (attempt {attempt} waits): nothing to requeue")
        ckpt = next((e.payload.uri for _s, e in reversed(hist) if isinstance(e.payload, JobCheckpointSaved)), None)
        payload = JobResumeRequested(job_id=job_id, checkpoint_uri=ckpt, attempt=attempt + 1, reason=Reason(
            code="requeued", message=f"{reason}; " + (f"from checkpoint {ckpt}" if ckpt else "from the start")))
        env = Envelope(event_id=derive_id(job_id, f"requeue:{attempt}"), type=payload.type, occurred_at=utc(time.time()),
                       tenant=hist[0][1].tenant, actor=self._operator(who), correlation_id=job_id, payload=payload)
        await self._send(env)
        return env

    def _operator(self, who: str | None) -> str:
        import getpass
        import re

        return f"{ADMIN}/" + re.sub(r"[^A-Za-z0-9_.-]", "-", who or os.environ.get("USER") or getpass.getuser() or "operator")

    async def report_load(self, job_id: str, tenant: str, rps: float, p99_ms: float | None = None,
                          window_s: float = 10.0, actor: str = "sdk") -> Envelope:
        """Tell the autoscaler the load an inference service (its job id) is under: requests per
        second of all its replicas together and the p99 latency, measured over `window_s`
        (`cmd.report_load`, docs/autoscaling.md). Raises pydantic's ValidationError on bad values."""
        payload = ReportLoadCmd(job_id=job_id, rps=rps, p99_ms=p99_ms, window_s=window_s)
        env = Envelope(
            event_id=derive_id(job_id, f"load:{time.time_ns()}"), type=payload.type, occurred_at=utc(time.time()),
            tenant=tenant, actor=actor, correlation_id=job_id, payload=payload,
        )
        await self._send(env)
        return env

    async def board_at(self, until_seq: int | None = None, until_time: float | None = None,
                       ended: bool = True) -> tuple[Board, int]:
        """The cluster's board (the view's jobs and nodes, every GPU's cell, queue usage) after
        `until_seq` (default: the head), or as it was at `until_time` (the last event stored by
        then), with the sequence of the view snapshot it started from (0: sequence 1). The admin
        starts from the nearest snapshot at or before that point (gpufleet/tools/viewsnap.py) and folds
        only the tail; a tenant folds its own events. With `ended=False` the rows of jobs that ended
        before that snapshot are left out (what costs the same at any length of history); some
        that ended after it may be there."""
        from gpufleet.tools.dashboard import Board
        from gpufleet.tools.viewsnap import VIEW, RowsMissing, ViewSnapshots, fold_board

        until_ms = int(until_time * 1000) if until_time is not None else None
        start = None
        if self.tenant is None and self.bus.creds is not None:
            snaps = ViewSnapshots(self.bus, self.bus.creds.snapshot_key(VIEW))
            start = await snaps.nearest(until_seq, until_ms)
            if start is not None and ended:
                try:
                    start[0].view.jobs.update(await snaps.rows_until(start[1]))
                except RowsMissing as exc:
                    log.warning("%s; folding from sequence 1", exc)
                    start = None
        board, from_seq = start if start is not None else (Board(), 0)
        await fold_board(self.bus, board, until_seq, until_ms)
        if until_time is None and self.tenant is None:
            board.view.seq = max(board.view.seq, until_seq or await self.bus.last_seq())
        elif until_seq is not None:
            board.view.seq = max(board.view.seq, until_seq)
        return board, from_seq

    async def fold(self, until_seq: int | None = None, until_time: float | None = None) -> ClusterView:
        """The cluster view (jobs and nodes, what the read model holds) after `until_seq` (default:
        the head), or as it was at `until_time`: `board_at`'s, from the nearest view snapshot."""
        board, _ = await self.board_at(until_seq, until_time)
        return board.view

    async def state_at(self, until_seq: int | None = None, until_time: float | None = None,
                       ended: bool = False) -> dict[str, Any]:
        """What `gpufleet replay --json` prints: the fold (`seq`, `jobs`, `nodes`: what the read
        model holds), each node's GPUs (free, allocated or shared to which jobs, unhealthy,
        quarantined), each queue's usage and waiting jobs, as the dashboard shows them, and
        `from_snapshot`: the sequence of the view snapshot the fold started from (0: none).

        `jobs` are the jobs that had not ended by then (the state; its cost does not grow with the
        history), `job_counts` every job by status; with `ended=True` (`replay --all`) `jobs` holds
        the ended ones too, read from the view's row segments."""
        from gpufleet.shared.read.view import TERMINAL_STATUSES

        board, from_seq = await self.board_at(until_seq, until_time, ended=ended)
        extra = board.state()
        doc = board.view.as_json(None if ended else lambda r: r.status not in TERMINAL_STATUSES)
        return {**doc, "job_counts": dict(sorted(extra["jobs"].items())), "ended_included": ended,
                "gpus": {n["node_id"]: n["gpus"] for n in extra["nodes"]},
                "queues": extra["queues"], "from_snapshot": from_seq}

    async def history(self, subject: str | Sequence[str] = "fleet.>", until_seq: int | None = None,
                      from_time: datetime | None = None, seen: Callable[[Any], None] | None = None,
                      ) -> list[tuple[int, Envelope]]:
        """(seq, event) of every event on `subject` (or subjects), stored since `from_time`, to
        `until_seq`; `seen` is given every message read, parsed or not."""
        out: list[tuple[int, Envelope]] = []
        subjects = (subject,) if isinstance(subject, str) else tuple(subject)
        async for batch in read_stream(self.bus, subjects, until_seq=until_seq, from_time=from_time):
            for msg in batch:
                if seen is not None:
                    seen(msg)
                try:
                    out.append((msg.metadata.sequence.stream, parse_envelope(msg.data)))
                except Exception:  # noqa: BLE001 - a bad message is dead-lettered; its seq still counts
                    continue
        return out

    async def _commands_of(self, job_id: str, events: list[tuple[int, Envelope]]) -> list[tuple[int, Envelope]]:
        """The client commands that may name the job: its tenant's (and the admin's), sent during
        the job's life, not every command in the log. The submit came before `job.submitted`
        (its cause; the window opens a minute before the earlier of that command's own clock and
        the first event's) and every later command about it left an event on the job's subjects
        (a cancel, a refusal): the window closes at the job's last event. With no event of the
        job (its submit was dead-lettered) every command is read."""
        self.commands_read = 0
        if not events:
            subjects, start, until = ["fleet.cmd.*.*"], None, None
        else:
            tenant = events[0][1].tenant
            first = min(events, key=lambda x: x[0])[1]
            cause = next((e.causation_id for _, e in events if e.type == "job.submitted" and e.causation_id), None)
            at = first.occurred_at.timestamp()
            if cause:
                with contextlib.suppress(KeyError, ValueError):
                    at = min(at, ulid_time_ms(cause) / 1000)
            subjects = [f"fleet.cmd.{tenant}.*", f"fleet.cmd.{SYS_TENANT}.*"]
            start, until = utc(at - 60), max(s for s, _ in events)
        def count(_msg: Any) -> None:
            self.commands_read += 1

        return await self.history(subjects, until_seq=until, from_time=start, seen=count)

    async def submitted(self, job_id: str) -> Envelope | None:
        """The job's `job.submitted` (its tenant, its normalised spec); None when the log has no such
        job (of this tenant, with a tenant's credentials)."""
        check_token(job_id, "job_id")
        hist = await self.history(job_filter(tenant=self.tenant, job_id=job_id, type_pattern="job.submitted"))
        return next((env for _seq, env in hist if isinstance(env.payload, JobSubmitted)), None)

    async def spec_of(self, job_id: str) -> dict[str, Any] | None:
        """The spec job `job_id` was submitted with, as a person writes it (`spec_to_user`):
        what `gpufleet submit --from JOB` copies. None when the log has no such job (of this
        tenant, with a tenant's credentials)."""
        env = await self.submitted(job_id)
        return spec_to_user(env.payload.spec) if env is not None and isinstance(env.payload, JobSubmitted) else None

    async def runs_of(self, job_id: str) -> list[dict[str, Any]]:
        """Every run of the job that started: {tenant, replica, attempt, node_id, driver, seq}, in log
        order (what `gpufleet logs` asks the nodes for). [] when none started (or, with a
        tenant's credentials, the job is another tenant's)."""
        from gpufleet.shared.contract.events import JobStarted

        check_token(job_id, "job_id")
        hist = await self.history(job_filter(tenant=self.tenant, job_id=job_id, type_pattern="job.started"))
        return [{"tenant": e.tenant, "replica": e.payload.replica, "attempt": e.payload.attempt,
                 "node_id": e.payload.node_id, "driver": e.payload.driver, "seq": s}
                for s, e in hist if isinstance(e.payload, JobStarted)]

    async def logs(self, job_id: str, tenant: str, node_id: str, replica: int = 0, attempt: int = 1,
                   offset: int = 0, tail: int | None = None, limit: int | None = None,
                   timeout_s: float = 5.0) -> dict[str, Any]:
        """One read of a run's log from the executor of its node (services/executor/logs.py): {data,
        offset, next, size, running, ...}. GpufleetError when no executor answers for the node or
        it has no such log (its reason)."""
        from gpufleet.shared.contract.logs import logs_subject

        req: dict[str, Any] = {"job_id": job_id, "replica": replica, "attempt": attempt, "offset": offset}
        if tail is not None:
            req["tail"] = tail
        if limit is not None:
            req["limit"] = limit
        try:
            msg = await self.bus.nc.request(logs_subject(tenant, node_id), json.dumps(req).encode(), timeout=timeout_s)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError):
            raise GpufleetError(f"no executor answers for node {node_id} within {timeout_s:g} s (is it up? "
                                f"`gpufleet nodes`)") from None
        code = (msg.headers or {}).get("Nats-Service-Error-Code")
        if code:
            raise GpufleetError(f"node {node_id}: {(msg.headers or {}).get('Nats-Service-Error', 'error')} ({code})")
        return json.loads(msg.data)  # type: ignore[no-any-return]

    async def explain(self, job_id: str) -> Explanation | None:
        """What `gpufleet explain JOB` says: the job's events (with the client commands that name
        it) in log order, why it waits (each statement with the seq of its event) and its
        interruptions; None when the log has nothing of the job."""
        from gpufleet.shared.read.view import data_staging, interruptions, pending_reasons

        hist = await self.history(job_filter(job_id=job_id))
        hist += [(s, e) for s, e in await self._commands_of(job_id, hist) if e.job_id == job_id]
        hist.sort(key=lambda x: x[0])
        if not hist:
            return None
        return Explanation(job_id, hist, pending_reasons(hist),
                           [{**it.__dict__, "text": it.line()} for it in interruptions(hist)], data_staging(hist))

    async def watch(self, subject: str = "fleet.>", from_start: bool = False,
                    until_terminal: str | None = None, since: float | None = None,
                    ) -> AsyncIterator[tuple[int, Envelope]]:
        """Live events on `subject` (an ordered consumer), new ones, all (`from_start`) or those
        stored since the unix time `since`; stops after the terminal event of job `until_terminal`.
        A tenant watches its own subjects only (a push consumer on the one it may read)."""
        if self.tenant is not None:
            from gpufleet.shared.runtime.log import scoped, tenant_subscribe

            policy = (DeliverPolicy.BY_START_TIME if since is not None else
                      DeliverPolicy.ALL if from_start else DeliverPolicy.NEW)
            sub = await tenant_subscribe(self.bus, scoped(subject, self.tenant), policy,
                                         opt_start_time=utc(since) if since is not None else None)
        elif since is not None:
            sub = await self.bus.js.subscribe(
                subject, ordered_consumer=True, deliver_policy=DeliverPolicy.BY_START_TIME,
                config=ConsumerConfig(opt_start_time=utc(since)))
        else:
            sub = await self.bus.js.subscribe(
                subject, ordered_consumer=True,
                deliver_policy=DeliverPolicy.ALL if from_start else DeliverPolicy.NEW,
            )
        try:
            async for msg in sub.messages:
                try:
                    env = parse_envelope(msg.data)
                except Exception:  # noqa: BLE001
                    continue
                yield msg.metadata.sequence.stream, env
                if until_terminal and env.job_id == until_terminal and env.type in TERMINAL_JOB_TYPES:
                    return
        finally:
            await sub.unsubscribe()
