"""A FastStream kit for your own subscribers on gpufleet's events (`pip install 'gpufleet[ext]'`).

The mesh's own services read the log through a batched nats-py loop (FastStream's per-message
path measured 2-4x slower there); for the low-rate subscribers people write themselves (a
notifier on `job.failed`, a cost exporter, a dashboard of their own) FastStream is the tool:

    from faststream import FastStream
    from gpufleet.ext import FleetRouter, fleet_broker
    from gpufleet.shared.contract.events import Envelope

    fleet = FleetRouter()

    @fleet.subscriber("job.failed", durable="failed-to-csv")
    async def failed(env: Envelope) -> None:
        print(env.job_id, env.payload.reason.code)

    broker = fleet_broker()          # the mesh of ~/.gpufleet (or --data-dir / nats_url / creds)
    broker.include_router(fleet)
    app = FastStream(broker)         # `faststream run mymodule:app`

- `FleetRouter.subscriber` takes an event type of the contract (`job.failed`, `node.lost`, ...;
  a misspelt one is refused, naming the known ones) and narrows it to a tenant or a job; the
  handler gets the parsed `Envelope` (the payload its pydantic type). A raw subject passes through.
- Consumers are made as the mesh expects on `FLEET` (never declared or changed by the app): a
  `durable` name is a pull consumer of its own that survives restarts, starts from the first
  event kept, and is shared by the app's instances (acked once handled: a handler that raises
  gets the event again); a service's consumer name is refused. Without one, a plain
  subscription to what comes from now on, as it is published. A tenant's router
  (`FleetRouter(tenant="acme")`, on the tenant's credentials) has only the latter: a tenant
  may make push consumers on its own subjects only, and nats-py's durable path asks for a
  consumer's info by name, which would let it name anyone's.
- `fleet_broker` connects with gpufleet's credentials (the admin's of the data dir,
  `$GPUFLEET_CREDS`, or `creds=`): a tenant's see their own events only, through push consumers
  on their own subjects, which is what these are.
- The AsyncAPI document of the app (`faststream docs gen mymodule:app`, or
  `faststream.specification.AsyncAPI(broker)`) lists the fleet channels it subscribes to.
"""

from __future__ import annotations

import os
from typing import Any

from faststream import AckPolicy
from faststream.nats import JStream, NatsBroker, NatsRouter
from nats.js.api import DeliverPolicy

from gpufleet.shared.contract.events import EVENT_TYPES, STREAM
from gpufleet.shared.contract.ids import check_token

FLEET = JStream(name=STREAM, declare=False)  # the mesh's stream: read, never declared or changed here


def event_subject(event_type: str, tenant: str | None = None, job_id: str | None = None,
                  node_id: str | None = None) -> str:
    """The subject of `event_type`'s events, narrowed to a tenant, a job or a node."""
    if event_type not in EVENT_TYPES or event_type.startswith("cmd.") or event_type == "node.heartbeat":
        known = ", ".join(t for t in sorted(EVENT_TYPES) if not t.startswith("cmd.") and t != "node.heartbeat")
        raise ValueError(f"event type {event_type!r} is not an event of the contract (one of {known})")
    for value, name in ((tenant, "tenant"), (job_id, "job_id"), (node_id, "node_id")):
        if value is not None:
            check_token(value, name)
    from gpufleet.shared.trust.authz import subject_pattern

    toks = subject_pattern(event_type).split(".")  # fleet.evt.*.job.*.<t> / fleet.evt.sys.node.*.<t> / ...
    if toks[3] == "job":
        toks[2], toks[4] = tenant or "*", job_id or "*"
    elif toks[3] == "node":
        toks[4] = node_id or "*"
    return ".".join(toks)


class FleetRouter(NatsRouter):
    """A FastStream `NatsRouter` over the fleet contract: subscribers on event types."""

    def __init__(self, tenant: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tenant = tenant

    def subscriber(self, subject: str = "", *args: Any, tenant: str | None = None,  # type: ignore[override]
                   job_id: str | None = None, node_id: str | None = None, durable: str | None = None,
                   **kwargs: Any) -> Any:
        """`subject`: an event type (`job.failed`) or a raw subject (`fleet.evt.acme.>`)."""
        if not subject.startswith("fleet."):
            subject = event_subject(subject, tenant or self.tenant, job_id, node_id)
        if durable is not None:
            from gpufleet.shared.trust.authz import service_durables

            check_token(durable, "durable")
            if durable in service_durables():
                raise ValueError(f"durable: {durable!r} is a consumer of the mesh's own services; choose another name")
        if durable is None:
            # what comes from now on, as it is published: a plain subscription, which a tenant's
            # credentials allow on its own events (`fleet.evt.<tenant>.>`)
            return super().subscriber(subject, *args, **kwargs)
        if (tenant or self.tenant) is not None:
            raise ValueError("durable: a durable consumer is the admin's or a service's (nats-py asks for a "
                             "consumer's info by name, which a tenant may not: it would name any consumer); "
                             "a tenant's router subscribes to what comes from now on")
        kwargs.setdefault("stream", FLEET)
        kwargs.setdefault("deliver_policy", DeliverPolicy.ALL)
        kwargs.setdefault("pull_sub", True)  # a pull consumer: instances of the app share it
        kwargs.setdefault("ack_policy", AckPolicy.NACK_ON_ERROR)  # acked once handled; a raise: again
        return super().subscriber(subject, *args, durable=durable, **kwargs)  # type: ignore[call-overload]


def fleet_broker(data_dir: str | None = None, nats_url: str | None = None, creds: str | None = None,
                 **kwargs: Any) -> NatsBroker:
    """A FastStream `NatsBroker` for the mesh: its NATS address (`nats_url`, else the data dir's)
    and gpufleet credentials (`creds`, else `$GPUFLEET_CREDS`, else the data dir's admin)."""
    from gpufleet.shared.contract.config import data_dir as resolve_data_dir
    from gpufleet.shared.contract.config import resolve_nats_url
    from gpufleet.shared.contract.errors import MeshNotRunning
    from gpufleet.shared.trust.authz import find_creds

    try:
        url = nats_url or resolve_nats_url(data_dir)
    except MeshNotRunning:  # (an app imported with no mesh here, e.g. under TestNatsBroker: it says so at start)
        url = os.environ.get("GPUFLEET_NATS_URL", "nats://127.0.0.1:4222")
    ident = find_creds(creds, resolve_data_dir(data_dir))
    kwargs.setdefault("name", "gpufleet-ext")
    if ident is not None:
        from faststream.nats.security import NatsNKey

        kwargs.setdefault("security", NatsNKey.from_seed(ident.seed))
        kwargs.setdefault("inbox_prefix", ident.inbox_prefix)
    return NatsBroker([u for u in url.split(",") if u], **kwargs)
