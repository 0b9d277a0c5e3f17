"""Cost gauges from the billing service's folded state (a read-only sidecar of its shell): what
each tenant has spent and how much of it the GPUs sat idle (closed intervals plus the running
ones so far), the GPUs each holds, and which tenant holds each GPU (`gpufleet_gpu_allocated`, 1
per held GPU: joined with the agents' `gpufleet_gpu_utilization_percent` on node and gpu, it
gives each tenant's GPU utilisation; deploy/grafana/gpufleet.json does)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from gpufleet.shared.runtime import otel
from gpufleet.shared.runtime.loop import ServiceRuntime
from gpufleet.shared.runtime.sidecars import EVERY_S, StateMetrics

from .core import BillingCore, BillingState
from .pricing import ZERO


def export(core: BillingCore, state: BillingState, now: datetime | None = None) -> None:
    now = now or datetime.now(UTC)
    cost = {name: v for (kind, name), v in state.spent.items() if kind == "tenant"}
    idle = {name: v for (kind, name), v in state.idle_spent.items() if kind == "tenant"}
    gpus: dict[str, float] = {}
    held: dict[tuple[str, str], str] = {}
    for iv in state.open.values():
        charge = core.charge_of(iv, now, "running", open_=True)
        cost[iv.tenant] = cost.get(iv.tenant, ZERO) + charge.cost
        idle[iv.tenant] = idle.get(iv.tenant, ZERO) + charge.idle_cost
        gpus[iv.tenant] = gpus.get(iv.tenant, 0.0) + float(iv.usage.gpu_count)  # (a share: its fraction)
        for g in iv.gpus:
            held[(iv.node_id, str(g))] = iv.tenant
    currency = core.prices.currency
    otel.set_tenant_costs({t: (float(cost.get(t, ZERO)), float(idle.get(t, ZERO)), gpus.get(t, 0.0))
                           for t in set(cost) | set(idle) | set(gpus)}, currency)
    otel.set_gpu_allocations(held)


def sidecar(runtime: ServiceRuntime[Any], every_s: float = EVERY_S) -> StateMetrics:
    """The billing shell's gauges, every `every_s`."""
    core = runtime.core
    assert isinstance(core, BillingCore)
    return StateMetrics(runtime, lambda state: export(core, state), "billing metrics", every_s)
