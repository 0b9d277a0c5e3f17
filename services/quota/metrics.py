"""Queue and job gauges from the quota service's folded state (a read-only sidecar of its shell)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from gpufleet.shared.runtime import otel
from gpufleet.shared.runtime.loop import ServiceRuntime
from gpufleet.shared.runtime.sidecars import EVERY_S, StateMetrics

from .core import QuotaState

log = logging.getLogger(__name__)


def export(state: QuotaState, now: float | None = None) -> None:
    now = time.time() if now is None else now
    waiting = state.waiting()
    pending = Counter(spec.queue for _, _, spec in waiting)
    oldest: dict[str, float] = {}
    for _, rec, spec in waiting:
        oldest[spec.queue] = max(oldest.get(spec.queue, 0.0), now - rec.since_s)
    queues = set(pending) | set(state.usage)
    for q in sorted(queues):
        otel.record_queue(q, pending.get(q, 0), state.usage.get(q, {}).get("gpu", 0), round(oldest.get(q, 0.0), 3))
    otel.set_job_states({"pending": len(state.pending), "admitted": len(state.reserved),
                         "preempting": len(state.preempting)})


def sidecar(runtime: ServiceRuntime[Any], every_s: float = EVERY_S) -> StateMetrics:
    """The quota shell's gauges, every `every_s`."""
    return StateMetrics(runtime, export, "quota metrics", every_s)
