"""Container health check for a gpufleet service: does its durable consumer on FLEET exist?

    python /opt/gpufleet-deploy/healthcheck.py SERVICE [--durable NAME] [--timeout S]

A service creates its durable consumer only after it has folded the stream (shared/runtime/loop.py),
so "the consumer is there" means "it started, folded and consumes". The durable is named as the
runtime names it: SERVICE for instance "0", SERVICE-INSTANCE otherwise (instance from
GPUFLEET_INSTANCE); the read-model projector's durable is "readmodel" (pass --durable).
NATS comes from GPUFLEET_NATS_URL; a comma-separated list of URLs is accepted here. It connects
as the service does: the identity in GPUFLEET_CREDS (a gpufleet credentials file, shared/trust/authz.py)
and, on a server that requires TLS (tls://...), trusting the CA that SSL_CERT_FILE names.

Exit 0: healthy. Exit 1: NATS unreachable or the consumer missing (the reason on stderr).
It is a readiness signal, not a liveness one: a crashed service already ends its container
(the restart policy brings it back), and a NATS outage must not restart every service.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import nats

STREAM = "FLEET"


def durable_name(service: str, instance: str) -> str:
    return service if instance == "0" else f"{service}-{instance}"


def creds_options(path: str | None) -> dict[str, str]:
    """nats.connect's options for a gpufleet credentials file (its nkey and inbox prefix)."""
    if not path:
        return {}
    with open(path) as f:
        doc = json.load(f)
    return {"nkeys_seed_str": str(doc["seed"]), "inbox_prefix": str(doc["inbox_prefix"])}


async def check(servers: list[str], durable: str, timeout_s: float, errors: list[BaseException],
                creds: dict[str, str] | None = None) -> None:
    async def on_error(exc: Exception) -> None:  # instead of nats-py's traceback on stderr
        errors.append(exc)

    nc = await nats.connect(servers, connect_timeout=timeout_s, allow_reconnect=False,
                            max_reconnect_attempts=0, name=f"healthcheck-{durable}", error_cb=on_error,
                            **(creds or {}))
    try:
        await nc.jetstream(timeout=timeout_s).consumer_info(STREAM, durable)
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="healthcheck.py")
    ap.add_argument("service")
    ap.add_argument("--durable", default=None, help="consumer name (default: from SERVICE and GPUFLEET_INSTANCE)")
    ap.add_argument("--timeout", type=float, default=3.0)
    args = ap.parse_args(argv)
    url = os.environ.get("GPUFLEET_NATS_URL", "nats://127.0.0.1:4222")
    servers = [u.strip() for u in url.split(",") if u.strip()]
    durable = args.durable or durable_name(args.service, os.environ.get("GPUFLEET_INSTANCE", "0"))
    errors: list[BaseException] = []
    try:
        creds = creds_options(os.environ.get("GPUFLEET_CREDS"))
        asyncio.run(asyncio.wait_for(check(servers, durable, args.timeout, errors, creds), args.timeout * 2))
    except Exception as exc:  # noqa: BLE001 - any failure is "not healthy"
        cause = errors[-1] if errors and isinstance(exc, TimeoutError) else exc
        print(f"unhealthy: consumer {durable} on {STREAM} via {url}: {type(cause).__name__}: {cause}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
