"""Ended jobs, remembered for a retention window of log time, then forgotten.

Every core keeps the jobs that ended so that a late or copied event about one (a report from a
node that was lost, a duplicate published after a crash) changes nothing. Kept for ever, that
set grows with every job ever run (130 KB per 70k jobs in each of four cores, measured). Past
the window (default 24 h of log time, `GPUFLEET_ENDED_RETENTION_S`) such an event is far outside
anything the mesh re-publishes (the server's duplicate window is 120 s, a crash between publish
and ack re-publishes within seconds), so the job is forgotten.

The clock is the log's (`occurred_at` of the events folded), never the wall clock: a fold of the
same log forgets the same jobs, so a snapshot plus the tail equals the full fold.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

ENDED_RETENTION_S = float(os.environ.get("GPUFLEET_ENDED_RETENTION_S", str(24 * 3600)))


@dataclass
class EndedJobs:
    """A set of ended job ids (`in`, `len`, iteration) that forgets the oldest past the window."""

    at: OrderedDict[str, float] = field(default_factory=OrderedDict)  # job -> log time it ended (s)
    retention_s: float = ENDED_RETENTION_S

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.at

    def __len__(self) -> int:
        return len(self.at)

    def __iter__(self) -> Iterator[str]:
        return iter(self.at)

    def add(self, job_id: str, when: datetime) -> list[str]:
        """Remember that `job_id` ended at `when` (log time); returns the jobs now forgotten."""
        t = when.timestamp()
        if job_id not in self.at:
            self.at[job_id] = t
        return self.prune(t)

    def prune(self, now_s: float) -> list[str]:
        """Forget every job that ended more than the window before `now_s` (oldest first)."""
        gone: list[str] = []
        horizon = now_s - self.retention_s
        while self.at:
            job_id, t = next(iter(self.at.items()))
            if t >= horizon:
                break
            self.at.popitem(last=False)
            gone.append(job_id)
        return gone
