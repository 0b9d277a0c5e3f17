"""One active instance of a service at a time: a lease in the JetStream KV bucket `LEASES`.

Two instances of a service that decides on its own clock (admission's rate limits, quota's
order of admission, the guardian's backoffs and checkpoint deadlines, billing's periods, the
autoscaler's cooldowns) would each decide the same event with the same derived id but possibly
another payload: the server keeps the first, and the second instance's state would hold its own
version. So such a service runs active/passive: the instance that holds the lease consumes and
decides (through the service's one shared durable consumer, so a successor goes on from its ack
floor), the other waits. Two placers decide side by side: their capacity decisions are
compare-and-set, the loser re-decides. Two telemetry instances too: a node's loss and a replica's
exit take their ids from their cause (the registration, the placement) and change every state the
same way whatever the reason's wording, so the second copy is dropped and harmless. An executor
is its node's agent: one per node.

- The lease is the key `<service>`, created only if absent (`kv.create`) and renewed with the
  revision it holds (`kv.update(last=revision)`) every TTL/3; the bucket's max age (`TTL`,
  `GPUFLEET_LEASE_TTL_S`, 10 s) expires a lease whose holder died, so a standby takes over within
  one TTL.
- The holder stops deciding as soon as it has not renewed for 0.8 TTL (`valid`: the runtime checks
  it before each commit), before another instance can have taken the lease: a paused process
  cannot publish on a lease it lost (a pause between the check and the publish of up to 0.2 TTL
  is the window the derived ids cover).
- A holder that loses the lease stops its service; the supervisor starts it again as a standby.
- Only the service's own identity may write its key (shared/trust/authz.py `lease_subjects`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

BUCKET = "LEASES"
TTL_S = float(os.environ.get("GPUFLEET_LEASE_TTL_S", "10"))
LEASED = ("admission", "quota", "guardian", "billing", "autoscaler")  # one active instance each


async def ensure_bucket(bus: Any) -> Any:
    """The bucket (created by the admin with the streams; others just open it)."""
    import nats.js.errors
    from nats.js.api import KeyValueConfig, StorageType

    try:
        return await bus.js.key_value(BUCKET)
    except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
        if bus.creds is not None and not bus.creds.is_admin:
            raise
        return await bus.js.create_key_value(KeyValueConfig(
            bucket=BUCKET, description="one active instance of each service (shared/runtime/lease.py)", history=1,
            ttl=TTL_S, storage=StorageType.FILE, replicas=bus.replicas))


class Lease:
    def __init__(self, bus: Any, name: str, holder: str, ttl_s: float | None = None) -> None:
        self.bus, self.name, self.holder = bus, name, holder
        self.ttl_s = TTL_S if ttl_s is None else ttl_s  # (the bucket's max age: the same)
        self.revision = 0
        self.renewed_at = 0.0
        self._kv: Any = None

    async def _bucket(self) -> Any:
        if self._kv is None:
            self._kv = await ensure_bucket(self.bus)
        return self._kv

    def valid(self) -> bool:
        """Held, and renewed recently enough that no other instance can have taken it."""
        return self.revision > 0 and time.monotonic() - self.renewed_at < 0.8 * self.ttl_s

    async def try_acquire(self) -> bool:
        import nats.js.errors

        kv = await self._bucket()
        t0 = time.monotonic()
        try:
            self.revision = await kv.create(self.name, self.holder.encode())
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError):
            return False
        self.renewed_at = t0
        return True

    async def acquire(self, stop: asyncio.Event | None = None) -> bool:
        """Wait for the lease (False when `stop` is set first)."""
        said = False
        while stop is None or not stop.is_set():
            try:
                if await self.try_acquire():
                    log.info("%s: holds the lease %s (revision %d)", self.holder, self.name, self.revision)
                    return True
            except Exception as exc:  # noqa: BLE001 - NATS away: try again
                log.warning("%s: lease %s: %s", self.holder, self.name, exc)
            if not said:
                log.info("%s: standby: another instance holds the lease %s", self.holder, self.name)
                said = True
            await asyncio.sleep(self.ttl_s / 4)
        return False

    async def renew(self) -> bool:
        kv = await self._bucket()
        t0 = time.monotonic()
        try:
            self.revision = await kv.update(self.name, self.holder.encode(), last=self.revision)
        except Exception as exc:  # noqa: BLE001 - lost (another holder) or NATS away: the caller stops
            log.warning("%s: renewing the lease %s failed (%s)", self.holder, self.name, exc)
            return False
        self.renewed_at = t0
        return True

    async def hold(self, stop: asyncio.Event, on_lost: Any) -> None:
        """Renew every TTL/3 until `stop`; call `on_lost` once when it can no longer be held."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.ttl_s / 3)
                break
            except TimeoutError:
                pass
            if not await self.renew() and not self.valid():
                log.warning("%s: lost the lease %s: stopping", self.holder, self.name)
                self.revision = 0
                on_lost()
                return
        await self.release()

    async def release(self) -> None:
        if self.revision:
            try:
                kv = await self._bucket()
                await kv.delete(self.name, last=self.revision)
            except Exception:  # noqa: BLE001 - it expires by itself
                pass
            self.revision = 0
