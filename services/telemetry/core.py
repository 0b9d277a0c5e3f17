"""Telemetry: which jobs run on which node's GPUs — the ground truth zombie detection needs.

folds: nodes, running replicas and their GPUs     decides: nothing yet (NVML sampling, zombie,
unhealthy, idle and node-lost facts come with the executor/telemetry issue)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufleet.shared.events import Envelope, JobExited, JobPlaced, NodeRegistered
from gpufleet.shared.runtime import BaseCore


@dataclass
class TelemetryState:
    gpus_by_node: dict[str, int] = field(default_factory=dict)
    jobs_on_node: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)


class TelemetryCore(BaseCore[TelemetryState]):
    name = "telemetry"
    subjects = ("fleet.evt.sys.node.*.registered", "fleet.evt.*.job.*.placed", "fleet.evt.*.job.*.exited")

    def initial_state(self) -> TelemetryState:
        return TelemetryState()

    def evolve(self, state: TelemetryState, env: Envelope) -> TelemetryState:
        p = env.payload
        if isinstance(p, NodeRegistered):
            state.gpus_by_node[p.node_id] = len(p.inventory.gpus)
        elif isinstance(p, JobPlaced):
            for a in p.allocations:
                state.jobs_on_node.setdefault(a.node_id, {})[p.job_id] = a.gpu_indices
        elif isinstance(p, JobExited):
            state.jobs_on_node.get(p.node_id, {}).pop(p.job_id, None)
        return state
