"""Telemetry: which jobs run on which node's GPUs — the ground truth zombie detection needs.

folds: nodes, running replicas and their GPUs     decides: nothing yet (NVML sampling, zombie,
unhealthy, idle and node-lost facts come with the executor/telemetry issue)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufleet.shared.events import Envelope
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
        if env.type == "node.registered":
            state.gpus_by_node[p.node_id] = len(p.inventory.gpus)  # type: ignore[union-attr]
        elif env.type == "job.placed":
            for a in p.allocations:  # type: ignore[union-attr]
                state.jobs_on_node.setdefault(a.node_id, {})[env.job_id] = a.gpu_indices  # type: ignore[index]
        elif env.type == "job.exited":
            state.jobs_on_node.get(p.node_id, {}).pop(env.job_id, None)  # type: ignore[union-attr,arg-type]
        return state
