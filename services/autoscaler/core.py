"""Autoscaler: watch unschedulable demand and idle nodes.

folds: jobs waiting unschedulable, nodes     decides: nothing yet (inference replicas and
node pools come with the autoscaler issue)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufleet.shared.events import Envelope
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
        if env.type == "node.registered":
            state.nodes.add(env.payload.node_id)  # type: ignore[union-attr]
        elif env.type == "job.unschedulable":
            state.unschedulable[env.job_id or ""] = env.payload.nodes_total  # type: ignore[union-attr]
        elif env.type in ("job.placed", "job.cancelled"):
            state.unschedulable.pop(env.job_id or "", None)
        return state
