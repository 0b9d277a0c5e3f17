"""Every service core by name, built from command-line arguments (for groups and tools)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.loop import Core, ServiceRuntime

SERVICE_NAMES = ("admission", "quota", "placer", "executor", "telemetry", "guardian", "billing", "autoscaler")


def make_core(name: str, args: argparse.Namespace) -> Core[Any]:
    if name == "admission":
        from gpufleet.services.admission.core import AdmissionCore
        from gpufleet.shared.contract.clusterconfig import load_config
        return AdmissionCore(load_config(getattr(args, "config", None)))
    if name == "quota":
        from gpufleet.services.quota.core import QuotaCore
        from gpufleet.shared.contract.clusterconfig import load_config
        return QuotaCore(load_config(getattr(args, "config", None)))
    if name == "placer":
        from gpufleet.services.placer.core import PlacerCore
        from gpufleet.shared.contract.clusterconfig import load_config
        # (placement profile and backfill; the node pools' shapes count as capacity)
        return PlacerCore(load_config(getattr(args, "config", None)))
    if name == "executor":
        from gpufleet.services.executor.core import ExecutorCore
        from gpufleet.shared.node.cluster import sim_fleet
        # (the sim executor is also the `sim` provider of the autoscaler's node pools)
        return ExecutorCore(sim_fleet(getattr(args, "sim_nodes", 4), getattr(args, "node_prefix", "sim"),
                                      getattr(args, "sim_mix", "")), sim_pools=not getattr(args, "no_sim_pools", False))
    if name == "telemetry":
        from gpufleet.services.telemetry.agent import rules_from_env
        from gpufleet.services.telemetry.core import TelemetryCore
        return TelemetryCore(rules_from_env())
    if name == "guardian":
        from gpufleet.services.guardian.core import GuardianCore
        from gpufleet.shared.contract.clusterconfig import load_config
        return GuardianCore(load_config(getattr(args, "config", None)))
    if name == "billing":
        from gpufleet.services.billing.core import BillingCore
        from gpufleet.shared.contract.clusterconfig import load_config
        return BillingCore(load_config(getattr(args, "config", None)))
    if name == "autoscaler":
        from gpufleet.services.autoscaler.core import AutoscalerCore
        from gpufleet.services.autoscaler.providers import PROVIDERS
        from gpufleet.shared.contract.clusterconfig import load_config
        return AutoscalerCore(load_config(getattr(args, "config", None)), providers=tuple(PROVIDERS))
    raise ValueError(f"unknown service {name!r}; known: {', '.join(SERVICE_NAMES)}")


def make_sidecar(runtime: ServiceRuntime[Any], bus: Bus) -> Any:
    """The agent a co-located core needs beside the group's loop (its own I/O), or None."""
    if runtime.core.name == "telemetry":
        from gpufleet.services.telemetry.agent import sidecar

        return sidecar(runtime, bus)
    if runtime.core.name == "executor":
        from gpufleet.services.executor.agent import sidecar as executor_sidecar

        return executor_sidecar(runtime, bus)
    if runtime.core.name == "autoscaler":
        from gpufleet.services.autoscaler.providers import ProviderAgent

        return ProviderAgent(runtime)
    if runtime.core.name == "guardian":
        from gpufleet.services.guardian.agent import sidecar as guardian_sidecar

        return guardian_sidecar(runtime)
    if runtime.core.name == "billing":
        from gpufleet.services.billing.ledger import Ledger
        from gpufleet.services.billing.metrics import sidecar as billing_metrics
        from gpufleet.shared.runtime import otel
        from gpufleet.shared.runtime.sidecars import Sidecars

        # the ledger folds the log with a billing fold of its own (open intervals and the stream
        # sequence of each close), from what the runtime (or its group) is delivered once it has
        # caught up on its own: each event received and parsed once. The gauges read the core's state.
        parts: list[Any] = []
        if os.environ.get("GPUFLEET_PG_DSN"):
            ledger = Ledger(bus, os.environ["GPUFLEET_PG_DSN"], getattr(runtime.core, "config", None))
            source = runtime.group if runtime.group is not None else runtime
            source.taps.append(ledger.attach(source.filter_subject))
            parts.append(ledger)
        if otel.enabled():
            parts.append(billing_metrics(runtime))
        return Sidecars(*parts) if len(parts) > 1 else (parts[0] if parts else None)
    if runtime.core.name == "quota":
        from gpufleet.shared.runtime import otel

        if otel.enabled():
            from gpufleet.services.quota.metrics import sidecar as quota_metrics

            return quota_metrics(runtime)
    return None
