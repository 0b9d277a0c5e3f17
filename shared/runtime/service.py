"""The shell every service runs as a process: `python -m gpufleet.services.<name>`.

It finds NATS (flag, GPUFLEET_NATS_URL, or the running mesh's data dir), builds the core,
starts the runtime (fold, durable consumer) and runs until SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufleet.shared.contract.config import resolve_nats_url
from gpufleet.shared.runtime import gcpolicy, otel
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.loop import Core, RuntimeGroup, ServiceRuntime

log = logging.getLogger(__name__)


def base_parser(name: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m gpufleet.services.{name}", description=f"gpufleet {name} service")
    ap.add_argument("--nats-url", default=None, help="NATS URL (default: GPUFLEET_NATS_URL or the mesh in --data-dir)")
    ap.add_argument("--data-dir", default=None, help="the mesh's data dir (default: GPUFLEET_DATA_DIR)")
    ap.add_argument("--instance", default=os.environ.get("GPUFLEET_INSTANCE", "0"),
                    help="replica name; each replica has its own durable consumer")
    ap.add_argument("--config", default=os.environ.get("GPUFLEET_CONFIG"),
                    help="cluster config YAML: tenants and policies (default: GPUFLEET_CONFIG; none: open)")
    ap.add_argument("--batch", type=int, default=int(os.environ.get("GPUFLEET_BATCH", "256")), help="messages per fetch")
    ap.add_argument("--lease", action="store_true", default=os.environ.get("GPUFLEET_LEASE") == "1",
                    help="run as one of several instances: decide only while holding the service's lease "
                         "(shared/runtime/lease.py; default: GPUFLEET_LEASE=1)")
    ap.add_argument("--log-level", default=os.environ.get("GPUFLEET_LOG_LEVEL", "INFO"))
    ap.add_argument("--metrics-port", type=int, default=int(os.environ.get("GPUFLEET_METRICS_PORT") or 0),
                    help="serve Prometheus metrics on http://0.0.0.0:PORT/metrics (default: GPUFLEET_METRICS_PORT; 0: off)")
    ap.add_argument("--otlp-endpoint", default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None,
                    help="push traces and metrics over OTLP/HTTP to this collector, e.g. http://otel-collector:4318 "
                         "(default: OTEL_EXPORTER_OTLP_ENDPOINT; none: off)")
    return ap


def setup_otel(service: str, args: argparse.Namespace) -> None:
    """Metrics and traces as the flags say; nothing at all when neither is given."""
    port = getattr(args, "metrics_port", 0) or None
    endpoint = getattr(args, "otlp_endpoint", None) or None
    if port or endpoint:
        otel.setup(service, port, endpoint, instance=getattr(args, "instance", None))


def _stop_on_signals(stop: Callable[[], None]) -> None:
    """SIGTERM / SIGINT stop the loop gracefully (the batch in hand is finished, then acked)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop)
        except (NotImplementedError, RuntimeError):
            pass


async def _start_sidecars(runtimes: list[ServiceRuntime[Any]], bus: Bus, into: list[Any]) -> None:
    """Start the agent each core with I/O of its own runs beside its runtime (telemetry's
    sampling, the executor's heartbeats, the guardian's checkpoint watch, quota's gauges)."""
    from gpufleet.services.registry import make_sidecar

    for rt in runtimes:
        side = make_sidecar(rt, bus)
        if side is not None:
            await side.start()
            into.append(side)


def _stop_all(loop: ServiceRuntime[Any] | RuntimeGroup, sidecars: list[Any]) -> None:
    loop.stop()
    for s in sidecars:
        s.stop()


async def run_core(core: Core[Any], nats_url: str, instance: str = "0", batch: int = 256,
                   ready: Callable[[ServiceRuntime[Any]], None] | None = None, lease: bool = False) -> bool:
    """Run the service until stopped. With `lease`: wait to hold the service's lease, decide while
    it is held; returns False when it was lost (the process exits non-zero: started again, it waits
    as a standby)."""
    from gpufleet.shared.runtime.lease import Lease

    bus = await Bus.connect(nats_url, name=f"gpufleet-{core.name}-{instance}")
    rt: ServiceRuntime[Any] = ServiceRuntime(core, bus, instance=instance, batch=batch, shared_durable=lease)
    sidecars: list[Any] = []
    stopped = asyncio.Event()
    held: Lease | None = Lease(bus, core.name, rt.actor) if lease else None
    lost = False

    def stop() -> None:
        stopped.set()
        _stop_all(rt, sidecars)

    def on_lost() -> None:
        nonlocal lost
        lost = True
        stop()

    _stop_on_signals(stop)
    try:
        if held is not None:
            if not await held.acquire(stopped):
                return True
            rt.fence = held.valid
        await rt.start()
        await _start_sidecars([rt], bus, sidecars)
        log.info("%s ready (folded to seq %d)", rt.actor, rt.applied_seq)
        if ready:
            ready(rt)
        async def decide() -> None:
            await rt.run()
            stop()  # (stopped by a signal, or by its fence: the sidecars and the lease go with it)
            if held is not None and not held.valid():
                on_lost()

        await asyncio.gather(decide(), *(s.run() for s in sidecars),
                             *([held.hold(stopped, on_lost)] if held is not None else []))
        if not lost:
            await _flush_snapshots([rt])
        return not lost
    finally:
        _write_stats([rt])
        log.info("%s stopped: %s", rt.actor, rt.stats)
        await bus.close()


async def _flush_snapshots(runtimes: list[ServiceRuntime[Any]]) -> None:
    """On a clean stop: store each core's state, so the next start folds nothing (bounded)."""
    for rt in runtimes:
        try:
            await asyncio.wait_for(rt.flush_snapshot(), 10)
        except Exception as exc:  # noqa: BLE001 - the log holds everything; the next start folds more
            log.warning("%s: snapshot at stop failed (%s)", rt.actor, exc)


def serve(name: str, make_core: Callable[[argparse.Namespace], Core[Any]],
          parser: argparse.ArgumentParser | None = None, argv: list[str] | None = None) -> None:
    ap = parser or base_parser(name)
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {name} %(levelname)s %(message)s")
    url = args.nats_url or resolve_nats_url(args.data_dir)
    core = make_core(args)
    setup_otel(name, args)
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        pass
    try:
        gcpolicy.install()
        if not asyncio.run(run_core(core, url, args.instance, args.batch, lease=args.lease)):
            raise SystemExit(3)  # the lease was lost: started again, it waits as a standby
    finally:
        otel.shutdown()  # flush the spans and metrics not exported yet


async def run_group(cores: list[Core[Any]], nats_url: str, instance: str = "0", batch: int = 256) -> None:
    bus = await Bus.connect(nats_url, name=f"gpufleet-group-{'-'.join(c.name for c in cores)}")
    group = RuntimeGroup(cores, bus, instance=instance, batch=batch)
    sidecars: list[Any] = []
    _stop_on_signals(lambda: _stop_all(group, sidecars))
    try:
        await group.start()
        await _start_sidecars(group.runtimes, bus, sidecars)
        log.info("group %s ready", group.durable)
        await asyncio.gather(group.run(), *(s.run() for s in sidecars))
        await _flush_snapshots(group.runtimes)
    finally:
        _write_stats(group.runtimes)
        await bus.close()


def _write_stats(runtimes: list[ServiceRuntime[Any]]) -> None:
    """At the stop, with $GPUFLEET_STATS_DIR set (bench e2e): each runtime's counters (batches,
    compare-and-set conflicts, refolds, ...) as `<dir>/<service>-<instance>.json`."""
    where = os.environ.get("GPUFLEET_STATS_DIR")
    if not where:
        return
    for rt in runtimes:
        try:
            Path(where, f"{rt.actor.replace('/', '-')}.json").write_text(json.dumps(dataclasses.asdict(rt.stats)))
        except OSError as exc:
            log.warning("%s: its stats not written to %s (%s)", rt.actor, where, exc)


def main(argv: list[str] | None = None) -> None:
    """`python -m gpufleet.shared.runtime.service admission quota guardian ...`: co-locate services."""
    from gpufleet.services.registry import make_core

    ap = base_parser("group")
    ap.prog = "python -m gpufleet.shared.runtime.service"
    ap.add_argument("services", nargs="+", help="services to run together in this process")
    ap.add_argument("--sim-nodes", type=int, default=4, help="simulated nodes (if executor is one of them)")
    ap.add_argument("--node-prefix", default="sim")
    ap.add_argument("--sim-mix", default="", help="node shapes cycled over the sim nodes (h100x8,h100mig,...)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s group %(levelname)s %(message)s")
    url = args.nats_url or resolve_nats_url(args.data_dir)
    cores = [make_core(name, args) for name in args.services]
    setup_otel("+".join(args.services), args)
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    try:
        gcpolicy.install()
        asyncio.run(run_group(cores, url, args.instance, args.batch))
    finally:
        otel.shutdown()


if __name__ == "__main__":
    main()
