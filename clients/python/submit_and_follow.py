#!/usr/bin/env python3
"""Submit a job to gpufleet and follow it to its end, from the published contract only.

Written from docs/clients.md, docs/schemas/ and docs/security.md: it imports nothing of
gpufleet, only the standard library and `nats-py` (import name `nats`; nkey authentication
needs its `nkeys` dependency).

    python submit_and_follow.py NATS_URL SPEC_JSON --creds FILE [--timeout-s N] [--job-id ID]
                                [--actor NAME] [--verdict] [--bad-envelope KIND]

SPEC_JSON is the job spec as JSON text, or @FILE. `tenant` is filled in from the credentials
when the spec has none.

It prints one JSON object per line on stdout:

    {"submitted": JOB_ID, "seq": N, "subject": ..., "event_id": ..., "stream": "FLEET"}   the publish's ack
    {"seq": N, "subject": ..., "type": ..., "event": {the envelope}}                      each event of the job
    {"verdict": {"accepted": ..., "events": [...]}}                                        with --verdict
    {"done": TYPE | null, "job_id": JOB_ID, ...}                                           last line

Exit status:
  0  the job ended with job.succeeded;
  1  it ended otherwise (job.rejected, job.failed, job.cancelled, or our submit was refused with
     job.request_refused): `done` says which; also when --verdict refused a message that had no
     readable job id (`"refused": true`);
  2  the client could not do its part (usage, connection, credentials, permissions: on stderr);
  3  no end within --timeout-s (`done` is null): a message without a readable job id is only
     dead-lettered (docs/clients.md section 5), so that is its documented outcome.

--bad-envelope KIND publishes a deliberately broken envelope, to see how the mesh answers:
no-actor, tenant-mismatch, no-msg-id, msg-id-mismatch, event-id-not-ulid, extra-field,
bad-json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
from nats.aio.msg import Msg

STREAM = "FLEET"
CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
TERMINAL = ("job.succeeded", "job.failed", "job.cancelled", "job.rejected")
BAD_ENVELOPES = ("no-actor", "tenant-mismatch", "no-msg-id", "msg-id-mismatch", "event-id-not-ulid",
                 "extra-field", "bad-json")
VERDICT_GRACE_S = 5.0  # after the job's end, how long to wait for a verdict still on its way (and vice versa)

EXIT_SUCCEEDED, EXIT_ENDED_OTHERWISE, EXIT_CLIENT_ERROR, EXIT_TIMEOUT = 0, 1, 2, 3


class ClientError(Exception):
    """Something this client could not do (exit 2)."""


def new_ulid() -> str:
    """26 characters of Crockford base32: 48-bit milliseconds, then 80 random bits."""
    value = (int(time.time() * 1000) << 80) | secrets.randbits(80)
    return "".join(CROCKFORD[(value >> shift) & 31] for shift in range(125, -1, -5))


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, separators=(",", ":")), flush=True)


def load_creds(path: Path) -> dict[str, str]:
    try:
        creds = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ClientError(f"cannot read credentials {path}: {e}") from e
    for key in ("seed", "inbox_prefix", "kind", "name"):
        if not isinstance(creds.get(key), str):
            raise ClientError(f"credentials {path} have no {key!r}")
    if creds["kind"] != "tenant":
        raise ClientError(f"credentials {path} are a {creds['kind']!r} identity's; this client acts as a tenant")
    return creds


def load_spec(text: str) -> dict[str, Any]:
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise ClientError(f"SPEC_JSON is not JSON: {e}") from e
    if not isinstance(spec, dict):
        raise ClientError("SPEC_JSON must be a JSON object")
    return spec


def stream_seq(reply: str) -> int | None:
    """The stream sequence of a pushed message, from its reply subject.

    docs/clients.md: the sixth token of `$JS.ACK.FLEET.<consumer>.<delivered>.<seq>.…`. Servers
    that add a domain and account hash (`$JS.ACK.<domain>.<hash>.FLEET.<consumer>.…`, 12+
    tokens) put it two tokens later.
    """
    tokens = reply.split(".")
    if len(tokens) < 6 or tokens[:2] != ["$JS", "ACK"]:
        return None
    index = 7 if len(tokens) >= 12 else 5
    try:
        return int(tokens[index])
    except (IndexError, ValueError):
        return None


def build_submit(tenant: str, job_id: str, spec: dict[str, Any], actor: str,
                 bad: str | None) -> tuple[str, bytes, dict[str, str]]:
    """The subject, body and headers of the cmd.submit (or of the broken one `bad` asks for)."""
    event_id = new_ulid()
    envelope: dict[str, Any] = {
        "event_id": event_id,
        "type": "cmd.submit",
        "schema_version": 1,
        "occurred_at": now_rfc3339(),
        "tenant": tenant,
        "actor": actor,
        "correlation_id": job_id,
        "payload": {"type": "cmd.submit", "job_id": job_id, "spec": spec},
    }
    headers = {"Nats-Msg-Id": event_id}
    if bad == "no-actor":
        del envelope["actor"]
    elif bad == "tenant-mismatch":
        envelope["tenant"] = "not-" + tenant
    elif bad == "no-msg-id":
        headers = {}
    elif bad == "msg-id-mismatch":
        headers = {"Nats-Msg-Id": new_ulid()}
    elif bad == "event-id-not-ulid":
        envelope["event_id"] = headers["Nats-Msg-Id"] = "not-a-ulid-but-26-chars-xx"
    elif bad == "extra-field":
        envelope["colour"] = "red"
    body = json.dumps(envelope).encode()
    if bad == "bad-json":
        body = b'{"type": "cmd.submit", "payload": {"job_id": "' + job_id.encode() + b'"'  # cut off
    return f"fleet.cmd.{tenant}.submit", body, headers


class Follower:
    """Collects the job's events (pushed by our consumer) and the verdict, if asked for."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[tuple[int | None, str, dict[str, Any]]] = asyncio.Queue()
        self.verdict: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.errors: list[str] = []

    async def on_event(self, msg: Msg) -> None:
        try:
            doc = json.loads(msg.data)
        except ValueError:
            self.errors.append(f"an event that is not JSON on {msg.subject}")
            return
        await self.events.put((stream_seq(msg.reply or ""), msg.subject, doc))

    async def on_verdict(self, msg: Msg) -> None:
        if not self.verdict.done():
            try:
                self.verdict.set_result(json.loads(msg.data))
            except ValueError:
                self.verdict.set_result({"unreadable": msg.data.decode(errors="replace")})


async def run(args: argparse.Namespace) -> int:
    creds = load_creds(Path(args.creds))
    tenant, inbox = creds["name"], creds["inbox_prefix"]
    spec = load_spec(args.spec)
    spec.setdefault("tenant", tenant)
    job_id = args.job_id or new_ulid()
    follower = Follower()

    async def on_error(e: Exception) -> None:
        # permissions violations come here, asynchronously
        follower.errors.append(str(e))
        print(f"nats: {e}", file=sys.stderr, flush=True)

    try:
        nc = await nats.connect(args.url, nkeys_seed_str=creds["seed"], inbox_prefix=inbox,
                                name="gpufleet-python-client", error_cb=on_error, allow_reconnect=False,
                                connect_timeout=5)
    except Exception as e:  # noqa: BLE001 - anything here means we could not connect
        raise ClientError(f"cannot connect to {args.url}: {e!r}") from e
    try:
        # 1. the consumer first (section 3), into a subscription of our own inbox
        deliver = f"{inbox}.follow.{new_ulid()}"
        await nc.subscribe(deliver, cb=follower.on_event)
        name = f"follow-{new_ulid()}"  # unique: a create with a live consumer's name re-points it
        filt = f"fleet.evt.{tenant}.job.{job_id}.>"
        config = {"name": name, "filter_subject": filt, "deliver_subject": deliver, "ack_policy": "none",
                  "deliver_policy": "all", "inactive_threshold": 60_000_000_000, "mem_storage": True}
        try:
            resp = await nc.request(f"$JS.API.CONSUMER.CREATE.{STREAM}.{name}.{filt}",
                                    json.dumps({"stream_name": STREAM, "config": config}).encode(), timeout=5)
        except Exception as e:  # noqa: BLE001
            raise ClientError(f"cannot create the consumer: {e!r} {follower.errors}") from e
        answer = json.loads(resp.data)
        if "error" in answer:
            raise ClientError(f"consumer create refused: {answer['error']}")

        # 2. the verdict's inbox, before the publish (section 2)
        subject, body, headers = build_submit(tenant, job_id, spec, args.actor, args.bad_envelope)
        if args.verdict:
            reply_to = f"{inbox}.verdict.{new_ulid()}"
            await nc.subscribe(reply_to, cb=follower.on_verdict, max_msgs=1)
            headers["Gpufleet-Reply"] = reply_to

        # 3. the submit, through JetStream: acknowledged with its stream sequence
        try:
            ack = await nc.jetstream().publish(subject, body, headers=headers or None, timeout=5)
        except Exception as e:  # noqa: BLE001
            raise ClientError(f"publish on {subject} failed: {e!r}") from e
        event_id = headers.get("Nats-Msg-Id")
        emit({"submitted": job_id, "seq": ack.seq, "subject": subject, "event_id": event_id,
              "stream": ack.stream, **({"duplicate": True} if ack.duplicate else {})})
        return await follow(follower, job_id, ack.seq, event_id, args)
    finally:
        await nc.close()


async def follow(follower: Follower, job_id: str, submit_seq: int, event_id: str | None,
                 args: argparse.Namespace) -> int:
    """Print the job's events in log order until its end (and the verdict, if asked for)."""
    deadline = time.monotonic() + args.timeout_s
    done: dict[str, Any] | None = None
    verdict: dict[str, Any] | None = None
    while True:
        if done is not None and (verdict is not None or not args.verdict):
            break
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if args.verdict and verdict is None and follower.verdict.done():
            verdict = follower.verdict.result()
            emit({"verdict": verdict})
            if done is None and not verdict.get("accepted", True):
                # the job's own subject should say the same soon; a message without a readable
                # job id is answered only here (and in the dead letters)
                deadline = min(deadline, time.monotonic() + VERDICT_GRACE_S)
            continue
        try:
            seq, subject, doc = await asyncio.wait_for(follower.events.get(), timeout=min(left, 0.2))
        except TimeoutError:
            continue
        kind = doc.get("type")
        emit({"seq": seq, "subject": subject, "type": kind, "event": doc})
        if done is not None:
            continue
        if seq is not None and seq < submit_seq:
            continue  # an earlier job of this id (our submit will be refused): not our end
        payload = doc.get("payload") or {}
        ours = payload.get("command_id") in (None, event_id) and payload.get("command") == "submit"
        if kind in TERMINAL or (kind == "job.request_refused" and ours):
            done = {"done": kind, "job_id": job_id, "seq": seq}
            if kind != "job.succeeded":
                done["reasons"] = payload.get("reasons", [])
            if args.verdict and verdict is None:
                deadline = min(deadline, time.monotonic() + VERDICT_GRACE_S)
    if done is None:
        if verdict is not None and not verdict.get("accepted", True):
            # refused, but nothing came on the job's subjects: a message without a readable job
            # id is answered with no events at all ({"accepted": false, "events": []})
            first = (verdict.get("events") or [{}])[0]
            emit({"done": first.get("type"), "job_id": job_id, "refused": True,
                  "reasons": (first.get("payload") or {}).get("reasons", [])})
            return EXIT_ENDED_OTHERWISE
        emit({"done": None, "job_id": job_id, "timeout": True})
        return EXIT_TIMEOUT
    if args.verdict and verdict is None:
        done["verdict"] = None  # best effort (section 2): none came
    emit(done)
    return EXIT_SUCCEEDED if done["done"] == "job.succeeded" else EXIT_ENDED_OTHERWISE


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", help="the mesh's nats_url (gpufleet status --json)")
    p.add_argument("spec", help="the job spec as JSON, or @FILE")
    p.add_argument("--creds", required=True, help="a tenant's credentials file (gpufleet tenant creds NAME)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="how long to follow the job (default 120)")
    p.add_argument("--job-id", help="the job id (default: a new ULID)")
    p.add_argument("--actor", default="gpufleet-python-client/1.0", help="the envelope's actor")
    p.add_argument("--verdict", action="store_true", help="also ask admission for its verdict (Gpufleet-Reply)")
    p.add_argument("--bad-envelope", choices=BAD_ENVELOPES, help="publish a deliberately broken envelope")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(run(args))
    except ClientError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_CLIENT_ERROR


if __name__ == "__main__":
    sys.exit(main())
