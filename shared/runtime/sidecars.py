"""Small shells beside a runtime: a state's gauges exported every few seconds, and several
sidecars run as one (a runtime has one sidecar slot)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .loop import ServiceRuntime, every

EVERY_S = 5.0


class StateMetrics:
    """`export(state)` from the runtime's folded state at start and every `every_s` (read-only:
    the state is only read between decisions, on the same event loop)."""

    def __init__(self, runtime: ServiceRuntime[Any], export: Callable[[Any], None], who: str,
                 every_s: float = EVERY_S) -> None:
        self.runtime, self.export, self.who, self.every_s = runtime, export, who, every_s
        self._stop = asyncio.Event()

    async def start(self) -> None:
        self.export(self.runtime.state)

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        async def once() -> None:
            self.export(self.runtime.state)
        await every(self._stop, self.every_s, once, self.who)  # a metrics bug never takes the group down


class Sidecars:
    """Several sidecars in one runtime's slot: started in order, run together, all stopped."""

    def __init__(self, *parts: Any) -> None:
        self.parts = parts

    async def start(self) -> None:
        for p in self.parts:
            await p.start()

    def stop(self) -> None:
        for p in self.parts:
            p.stop()

    async def run(self) -> None:
        await asyncio.gather(*(p.run() for p in self.parts))
