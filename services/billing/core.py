"""Billing: meter allocation intervals from the log's own timestamps.

folds: allocation intervals -> GPU-seconds per tenant     decides: nothing yet (prices, the
PostgreSQL ledger, budgets and estimates come with the billing issue)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from gpufleet.shared.events import Envelope, JobExited, JobPlaced, JobStarted
from gpufleet.shared.runtime import BaseCore


@dataclass
class BillingState:
    open: dict[tuple[str, int], tuple[datetime, int]] = field(default_factory=dict)  # (job, replica) -> start, gpus
    gpus_by_job: dict[tuple[str, int], int] = field(default_factory=dict)
    gpu_seconds: dict[str, float] = field(default_factory=dict)  # tenant -> GPU-seconds


class BillingCore(BaseCore[BillingState]):
    name = "billing"
    subjects = ("fleet.evt.*.job.*.placed", "fleet.evt.*.job.*.started", "fleet.evt.*.job.*.exited")

    def initial_state(self) -> BillingState:
        return BillingState()

    def evolve(self, state: BillingState, env: Envelope) -> BillingState:
        p = env.payload
        job_id = env.job_id or ""
        if isinstance(p, JobPlaced):
            for a in p.allocations:
                state.gpus_by_job[(job_id, a.replica)] = len(a.gpu_indices)
        elif isinstance(p, JobStarted):
            key = (job_id, p.replica)
            state.open.setdefault(key, (env.occurred_at, state.gpus_by_job.get(key, 0)))
        elif isinstance(p, JobExited):
            key = (job_id, p.replica)
            started = state.open.pop(key, None)
            state.gpus_by_job.pop(key, None)
            if started is not None:
                seconds = (env.occurred_at - started[0]).total_seconds()
                state.gpu_seconds[env.tenant] = state.gpu_seconds.get(env.tenant, 0.0) + seconds * started[1]
        return state
