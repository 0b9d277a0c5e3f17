"""The guardian's shell: watch the checkpoint locations of running training / finetune jobs.

Every `watch_s` it looks at each running job's location (`shared/node/checkpoints.py`): at the start
of a run whether it can be written, then which checkpoints are good, and hands that to
`GuardianCore.watch`, whose facts it publishes. It also keeps the job's `checkpoint.keep` newest
good checkpoints and removes older ones. The root comes from GPUFLEET_CHECKPOINT_ROOT (the
embedded mesh sets `<data dir>/checkpoints`); without one there is nothing to watch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from gpufleet.shared.contract.events import Envelope
from gpufleet.shared.node import checkpoints
from gpufleet.shared.runtime.loop import ServiceRuntime, every

from .core import GuardianCore, GuardianState

log = logging.getLogger(__name__)
WATCH_S = 2.0


class GuardianAgent:
    def __init__(self, runtime: ServiceRuntime[GuardianState], root: str, watch_s: float = WATCH_S,
                 clock: Callable[[], float] = time.time) -> None:
        assert isinstance(runtime.core, GuardianCore)
        self.core: GuardianCore = runtime.core
        self.runtime = runtime
        self.root = root
        self.watch_s = watch_s
        self.clock = clock
        self._stop = asyncio.Event()

    async def start(self) -> None:
        fs = await asyncio.to_thread(checkpoints.filesystem_of, self.root)
        gone = checkpoints.ephemeral_filesystem(fs, self.root)
        if gone is not None:  # every job without a path of its own checkpoints there
            log.error("the checkpoint root %s: checkpoints under it are lost with the machine; set "
                      "GPUFLEET_CHECKPOINT_ROOT to a persistent filesystem", gone)
        else:
            log.info("checkpoint root %s on %s", self.root, f"{fs[0]} at {fs[1]}" if fs else "an unknown filesystem")

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        await every(self._stop, self.watch_s, self.watch_once, "guardian checkpoints")

    def location_of(self, state: GuardianState, job_id: str) -> str:
        rec = state.jobs[job_id]
        spec = rec.spec
        assert spec is not None  # (only training / finetune jobs are watched)
        own = spec.checkpoint.path if spec.checkpoint else None
        return checkpoints.location(self.root, rec.tenant or spec.tenant, job_id, own)

    async def watch_once(self) -> int:
        await self.runtime.ensure_fresh()
        state = self.runtime.state
        facts: list[Envelope] = []
        for job_id in state.watched():
            where = self.location_of(state, job_id)
            rec = state.jobs[job_id]
            assert rec.started is not None and rec.spec is not None
            attempt, spec = rec.started[0], rec.spec
            try:
                store = checkpoints.store_for(where)
            except ValueError as exc:
                log.warning("%s: %s", job_id, exc)
                continue
            unwritable, fs = None, None
            if attempt not in (rec.said.verified or ()):
                unwritable = await asyncio.to_thread(store.check_writable, where)
                of = getattr(store, "filesystem", None)  # (an object store is on none)
                fs = await asyncio.to_thread(of, where) if of is not None else None
            scans = await asyncio.to_thread(store.scan, where)
            facts += self.core.watch(state, job_id, where, unwritable, scans, self.clock(), self.runtime.ctx(),
                                     filesystem=fs)
            await asyncio.to_thread(store.prune, where, spec.checkpoint.keep if spec.checkpoint else 3)
        for f in facts:
            if f.type in ("job.checkpoint_invalid", "job.checkpoint_overdue", "job.failed"):
                log.warning("%s %s: %s", f.job_id, f.type, f.payload.model_dump(exclude={"type"}))
        await self.runtime.publish_local(facts)
        return len(facts)


def sidecar(runtime: ServiceRuntime[GuardianState]) -> GuardianAgent | None:
    root = os.environ.get("GPUFLEET_CHECKPOINT_ROOT")
    return GuardianAgent(runtime, root) if root else None
