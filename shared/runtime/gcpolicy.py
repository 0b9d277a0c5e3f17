"""The cyclic garbage collector of a service process, kept from stalling its loop.

A service's state is a large heap of long-lived objects (5,000 nodes, every pending and running
job), and CPython's collector scans the whole oldest generation whenever a quarter of it was
promoted since the last full collection. With jobs coming and going that is every few seconds,
and each full collection stops the process for as long as the scan takes: in `bench e2e --rate
300` (5,000 sim nodes) the placer spent 2.3 s in 14 full collections of up to 0.45 s each, most
of them collecting nothing, and every job that arrived meanwhile waited for them (the p99).

The policy: after each full collection, what survived it is frozen (`gc.freeze`): the next full
collection scans only what was promoted since, so its cost follows the recent churn, not the
size of the state. A frozen object is still freed as soon as nothing refers to it (reference
counting); what freezing skips is only garbage *cycles* among frozen objects, so every
FULL_S (30 minutes) the frozen set is released first and one full collection covers the whole
heap again, collecting such cycles: a leak of them is bounded by that period, and the one long
pause comes once per period instead of every few seconds.

`install()` is called once by each service process's main (not by libraries or tests' own
processes); GPUFLEET_GC=default leaves CPython's collector as it is.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from typing import Any

FULL_S = float(os.environ.get("GPUFLEET_GC_FULL_S", "1800"))


@dataclass
class _Policy:
    full_s: float
    last_full: float
    whole_heap_next: bool = False  # the frozen set was released: the next full collection covers it all
    full_collections: int = 0  # full collections that covered the whole heap (released first)
    freezes: int = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase != "stop" or info.get("generation") != 2:
            return
        now = time.monotonic()
        if self.whole_heap_next:
            self.whole_heap_next = False
            self.full_collections += 1
            self.last_full = now
        elif now - self.last_full >= self.full_s:
            gc.unfreeze()  # the next full collection scans everything, cycles among old objects included
            self.whole_heap_next = True
            return
        gc.freeze()
        self.freezes += 1


_installed: _Policy | None = None


def install(full_s: float | None = None) -> _Policy | None:
    """Freeze what survives each full collection (once per process; idempotent). None where
    GPUFLEET_GC=default keeps CPython's own behaviour."""
    global _installed
    if os.environ.get("GPUFLEET_GC", "") == "default":
        return None
    if _installed is None:
        _installed = _Policy(FULL_S if full_s is None else full_s, time.monotonic())
        gc.callbacks.append(_installed)
    elif full_s is not None:
        _installed.full_s = full_s
    return _installed
