"""Autoscaler: watch unschedulable demand and idle nodes.

folds: jobs waiting unschedulable, nodes     decides: nothing yet (inference replicas and
node pools come with the autoscaler issue)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufleet.shared.events import Envelope, JobUnschedulable, NodeRegistered
from gpufleet.shared.runtime import BaseCore


@dataclass
class AutoscalerState:
    unschedulable: dict[str, int] = field(default_factory=dict)  # job_id -> GPUs it waits for
    nodes: set[str] = field(default_factory=set)


class AutoscalerCore(BaseCore[AutoscalerState]):
    name = "autoscaler"
    subjects = ("fleet.evt.sys.node.*.registered", "fleet.evt.*.job.*.unschedulable", "fleet.evt.*.job.*.placed",
                "fleet.evt.*.job.*.cancelled")

    def initial_state(self) -> AutoscalerState:
        return AutoscalerState()

    def evolve(self, state: AutoscalerState, env: Envelope) -> AutoscalerState:
        p = env.payload
        if isinstance(p, NodeRegistered):
            state.nodes.add(p.node_id)
        elif isinstance(p, JobUnschedulable):
            state.unschedulable[p.job_id] = p.nodes_total
        elif env.type in ("job.placed", "job.cancelled"):
            state.unschedulable.pop(env.job_id or "", None)
        return state
