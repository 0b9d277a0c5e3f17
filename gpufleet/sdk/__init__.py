"""The Python SDK: submit and cancel jobs, follow their events, rebuild the cluster state.

    async with await Fleet.connect(data_dir=None) as fleet:
        job_id = await fleet.submit(spec_dict)
        async for env in fleet.watch(job_id=job_id):
            ...
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

from nats.js.api import ConsumerConfig, DeliverPolicy

from gpufleet.shared.bus import Bus
from gpufleet.shared.config import resolve_nats_url
from gpufleet.shared.events import (
    TERMINAL_JOB_TYPES,
    CancelRequestedCmd,
    Envelope,
    SubmitRequested,
    parse_envelope,
    utc,
)
from gpufleet.shared.ids import check_token, derive_id, ulid
from gpufleet.shared.log import read_stream
from gpufleet.shared.spec import parse_spec
from gpufleet.shared.view import ClusterView, apply


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


class Fleet:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    @classmethod
    async def connect(cls, data_dir: str | None = None, nats_url: str | None = None) -> Fleet:
        url = nats_url or resolve_nats_url(data_dir)
        return cls(await Bus.connect(url, name="gpufleet-sdk"))

    async def __aenter__(self) -> Fleet:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        await self.bus.close()

    async def submit(self, spec: dict[str, Any], job_id: str | None = None, validate: bool = True) -> str:
        """Publish a submit command; returns the job id. Raises SpecError on a bad spec."""
        if validate:
            parse_spec(spec)
        job_id = job_id or new_job_id()
        await self.bus.publish(submit_envelope(spec, job_id))
        return job_id

    async def cancel(self, job_id: str, tenant: str, reason: str = "cancelled by user") -> None:
        env = Envelope(
            event_id=derive_id(job_id, f"cancel:{time.time_ns()}"), type="cmd.cancel", occurred_at=utc(time.time()),
            tenant=tenant, actor="sdk", correlation_id=job_id, payload=CancelRequestedCmd(job_id=job_id, reason=reason),
        )
        await self.bus.publish(env)

    async def fold(self, until_seq: int | None = None, until_time: float | None = None) -> ClusterView:
        """The cluster state after `until_seq` (default: the head), or as it was at `until_time`
        (the last event that occurred by then), folded from the log."""
        view = ClusterView()
        last = 0
        async for batch in read_stream(self.bus, ("fleet.evt.>",), until_seq=until_seq):
            for msg in batch:
                try:
                    env = parse_envelope(msg.data)
                except Exception:  # noqa: BLE001 - dead letters are the services' business
                    continue
                stored = msg.metadata.timestamp  # the server's clock, as `watch --since` uses
                if until_time is not None and stored is not None and stored.timestamp() > until_time:
                    view.seq = max(view.seq, last)
                    return view
                last = msg.metadata.sequence.stream
                apply(view, env, last)
        view.seq = max(view.seq, until_seq or (last if until_time is not None else await self.bus.last_seq()))
        return view

    async def history(self, subject: str = "fleet.>") -> list[tuple[int, Envelope]]:
        out: list[tuple[int, Envelope]] = []
        async for batch in read_stream(self.bus, (subject,)):
            for msg in batch:
                try:
                    out.append((msg.metadata.sequence.stream, parse_envelope(msg.data)))
                except Exception:  # noqa: BLE001
                    continue
        return out

    async def watch(self, subject: str = "fleet.>", from_start: bool = False,
                    until_terminal: str | None = None, since: float | None = None,
                    ) -> AsyncIterator[tuple[int, Envelope]]:
        """Live events on `subject` (an ordered consumer), new ones, all (`from_start`) or those
        stored since the unix time `since`; stops after the terminal event of job `until_terminal`."""
        if since is not None:
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
