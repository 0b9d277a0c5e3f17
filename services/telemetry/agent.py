"""Telemetry as a process: the runtime (fold), heartbeats in, GPU samples out, facts decided.

- Heartbeats arrive on `fleet.tel.node.*.heartbeat` (a plain subscription: samples are lossy
  by design); the lease check turns a silence into `node.lost`.
- Every `sample_s` each node's backend is sampled: the samples go to FLEET_TELEMETRY
  (`fleet.tel.node.<node>.gpu`, one JSON document per node) and to `TelemetryCore.observe`,
  whose facts go to the main log.
- Backends: real GPUs through NVML for the local node(s), and `SimWorld` for `sim` nodes: their
  GPUs are played from the log (a started replica is a process holding `sim.gpuMemoryUsed` on
  each of its GPUs at `sim.gpuUtil`; with `sim.leaveZombie` the process outlives the replica),
  so every rule runs on machines without a GPU, and tests can change the world directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from gpufleet.shared.contract.spec import parse_duration_s
from gpufleet.shared.node.gpu import GpuBackend, GpuSample, SimGpuBackend, sample_doc
from gpufleet.shared.runtime import gcpolicy
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.loop import ServiceRuntime, every

from .core import JobUse, Owner, Rules, TelemetryCore, TelemetryState, Windows

log = logging.getLogger(__name__)

SAMPLE_S = 5.0
LEASE_CHECK_S = 1.0
# A sampling round over a sim world of thousands of nodes takes 0.3-0.5 s of this process's
# loop; in a group that loop is every co-located service's, so the round gives the loop back
# after each slice of this long (a job that arrived during an unsliced round waited for it: the
# p99 submit->placed at a steady 300 jobs/s was 1.1 s with sampling on, 0.29 s with it off).
SAMPLE_SLICE_S = 0.005
ALERTS = frozenset({"node.gpu_zombie_detected", "node.gpu_unhealthy"})


class SimWorld:
    """The simulated GPUs of the `sim` nodes, kept in step with the log."""

    def __init__(self) -> None:
        self.backends: dict[str, SimGpuBackend] = {}
        self.owners: dict[int, tuple[str, int, int]] = {}  # pid -> (job, replica, attempt)
        self._pid_of: dict[tuple[str, int, int], int] = {}
        self._node_of: dict[int, str] = {}  # pid -> the node its process is on
        self._on_node: dict[str, set[tuple[str, int, int]]] = {}  # node -> its replicas with a process
        self._zombie: dict[tuple[str, int, int], bool] = {}
        self._next_pid = 100_000

    def sync(self, state: TelemetryState) -> None:
        for node_id, info in state.nodes.items():
            if info.driver == "sim" and node_id not in self.backends:
                self.backends[node_id] = SimGpuBackend(info.gpus)
        for node_id in self.backends:
            self.sync_node(state, node_id)

    def sync_node(self, state: TelemetryState, node_id: str) -> None:
        """The node's processes as the log has them now: one for each started replica on it, and
        the ended ones gone (a zombie's stays on its GPUs, held by nobody). A sampling round syncs
        each node just before it samples it: the round gives the loop back between slices, and a
        replica that ended meanwhile must not be sampled as a process nobody owns."""
        live = {(r.job_id, r.replica, r.attempt): r for r in state.on_node(node_id) if r.started_event_id is not None}
        mine = self._on_node.setdefault(node_id, set())
        for ident, r in live.items():
            if ident in self._pid_of:
                continue
            spec = state.jobs[r.job_id].sim
            if spec is None or not r.gpus:
                continue
            pid = self._next_pid
            self._next_pid += 1
            self._pid_of[ident] = pid
            self._zombie[ident] = spec.leave_zombie
            self.owners[pid] = ident
            self._node_of[pid] = r.node_id
            mine.add(ident)
            for g in r.gpus:
                self.backends[r.node_id].add_process(g, pid, spec.gpu_mem_used_mib, name="python",
                                                     util_pct=spec.gpu_util_pct)
        gone = {ident for ident in mine if ident not in live}
        if gone:
            mine -= gone
            self._end(gone)

    def _end(self, idents: set[tuple[str, int, int]]) -> None:
        for ident in idents:
            pid = self._pid_of.pop(ident, None)
            if pid is None:
                continue
            if not self._zombie.pop(ident, False):  # a zombie stays on its GPUs, held by nobody
                node = self._node_of.pop(pid, None)
                if node in self.backends:
                    self.backends[node].remove_process(pid)
                self.owners.pop(pid, None)

    def pid_of(self, job_id: str, replica: int = 0, attempt: int = 1) -> int | None:
        return self._pid_of.get((job_id, replica, attempt))

    def use(self, state: TelemetryState, node_id: str) -> dict[tuple[str, int], JobUse]:
        out = {}
        for r in state.on_node(node_id):
            spec = state.jobs[r.job_id].sim
            if spec is not None and r.started_event_id is not None:
                out[(r.job_id, r.replica)] = JobUse(spec.cpu_util_pct, spec.iowait_pct)
        return out


class ProcUse:
    """A real job's CPU and I/O-wait use from /proc, per process group, between two samples."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[float, float, float]] = {}  # pgid -> (at, cpu ticks, blkio ticks)
        self._hz = os.sysconf("SC_CLK_TCK")

    def use(self, state: TelemetryState, node_id: str, now: float) -> dict[tuple[str, int], JobUse]:
        out = {}
        for r in state.on_node(node_id):
            if r.pid is None:
                continue
            cpu, blkio = _group_ticks(r.pid)
            last = self._last.get(r.pid)
            self._last[r.pid] = (now, cpu, blkio)
            if last is None or now <= last[0]:
                continue
            dt = now - last[0]
            cores = max(r.cpu_milli, 1) / 1000
            out[(r.job_id, r.replica)] = JobUse(
                cpu_pct=100.0 * (cpu - last[1]) / self._hz / dt / cores,
                iowait_pct=100.0 * (blkio - last[2]) / self._hz / dt)
        return out


def _group_ticks(pgid: int) -> tuple[float, float]:
    cpu = blkio = 0.0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = open(f"/proc/{entry.name}/stat").read()  # noqa: SIM115 - short read
        except OSError:
            continue
        f = raw[raw.rfind(")") + 2:].split()
        if int(f[2]) == pgid:
            cpu += int(f[11]) + int(f[12])  # utime + stime
            blkio += int(f[39])  # delayacct_blkio_ticks
    return cpu, blkio


LEASE_ENV = "GPUFLEET_NODE_LEASE_S"  # the heartbeat lease (`--lease-s`), for every telemetry of a mesh


def rules_from_env() -> Rules:
    """The default rules, with the heartbeat lease from GPUFLEET_NODE_LEASE_S where it is set (a
    duration: `12s`, `1m`); a bad value is refused, naming the variable."""
    raw = os.environ.get(LEASE_ENV, "").strip()
    if not raw:
        return Rules()
    try:
        lease = parse_duration_s(raw)
    except ValueError as exc:
        raise SystemExit(f"{LEASE_ENV}={raw!r}: {exc}") from None
    if lease <= 0:
        raise SystemExit(f"{LEASE_ENV}={raw!r}: the lease must be longer than 0 s")
    return Rules(lease_s=lease)


class TelemetryAgent:
    def __init__(self, core: TelemetryCore, bus: Bus, *, sim: bool = True,
                 local: dict[str, GpuBackend] | None = None, sample_s: float = SAMPLE_S,
                 lease_check_s: float = LEASE_CHECK_S, publish_samples: bool = True, instance: str = "0",
                 clock: Callable[[], float] = time.time, batch: int = 256,
                 runtime: ServiceRuntime[TelemetryState] | None = None) -> None:
        self.core = core
        self.bus = bus
        self.world = SimWorld() if sim else None
        self.local = dict(local or {})  # node id -> its real GPUs
        self.sample_s = sample_s
        self.lease_check_s = lease_check_s
        self.publish_samples = publish_samples
        self.clock = clock
        # in a co-located group the group owns the runtime (fold, consumer); the agent adds its loops
        self.owns_runtime = runtime is None
        self.runtime: ServiceRuntime[TelemetryState] = runtime or ServiceRuntime(
            core, bus, instance=instance, batch=batch, clock=clock)
        self.windows = Windows()
        self.last_seen: dict[str, float] = {}
        self._blind = False  # its own connection was down: it heard no one
        self._reconnects = 0
        self.lease_checks = 0  # the checks that could decide (it heard the nodes)
        self.holding = False  # most of the fleet is silent at once: nobody is declared lost (silent_fleet)
        self.lease_holds = 0
        self.proc_use = ProcUse()
        self._stop = asyncio.Event()
        self._sub: Any = None
        self.samples_taken = 0

    @property
    def state(self) -> TelemetryState:
        return self.runtime.state

    async def start(self) -> None:
        if self.owns_runtime:
            await self.runtime.start()
        now = self.clock()
        for node_id in self.state.nodes:  # a restarted telemetry gives every node a full lease
            self.last_seen[node_id] = now
        self._reconnects = int(self.bus.nc.stats.get("reconnects", 0))
        self._sub = await self.bus.nc.subscribe("fleet.tel.node.*.heartbeat", cb=self._on_heartbeat)

    async def _on_heartbeat(self, msg: Any) -> None:
        try:
            payload = json.loads(msg.data)["payload"]
        except (ValueError, KeyError, TypeError):
            return
        now = self.clock()
        for node_id in (payload.get("node_id"), *payload.get("also_nodes", ())):
            if isinstance(node_id, str):
                self.last_seen[node_id] = now

    def stop(self) -> None:
        self._stop.set()
        self.runtime.stop()

    async def run(self) -> None:
        tasks = [asyncio.create_task(self._every(self.sample_s, self.sample_once)),
                 asyncio.create_task(self._every(self.lease_check_s, self.check_leases))]
        if self.owns_runtime:
            tasks.append(asyncio.create_task(self.runtime.run()))
        try:
            await self._stop.wait()
        finally:
            self.runtime.stop()
            for t in tasks[:2]:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._sub is not None:
                with contextlib.suppress(Exception):
                    await self._sub.unsubscribe()
            for b in self.local.values():
                b.close()

    async def _every(self, period_s: float, fn: Callable[[], Any]) -> None:
        await every(self._stop, period_s, fn, self.runtime.actor)

    async def check_leases(self) -> None:
        """Turn a node's silence into `node.lost`, but only a silence this telemetry could have
        heard: while its own connection is down it hears no one, and after it reconnects every
        node gets a full lease from then (a NATS outage longer than the lease is not every node
        lost at once; issue: the distributed mode under faults). And while most of the fleet is
        silent at once though telemetry itself is connected (its nodes' executor frozen, a switch
        between them and NATS), none is declared lost: `TelemetryCore.silent_fleet`."""
        nc = self.bus.nc
        if not nc.is_connected:
            if not self._blind:
                log.warning("telemetry is cut off from NATS: no node is declared lost until it hears them again")
            self._blind = True
            return
        reconnects = int(nc.stats.get("reconnects", 0))
        if self._blind or reconnects != self._reconnects:
            self._blind, self._reconnects = False, reconnects
            self._full_leases("telemetry is back on NATS")
            return
        held = self.core.silent_fleet(self.state, self.last_seen, self.clock())
        if held is not None:
            if not self.holding:
                log.error("ALERT %d of %d nodes went silent at once: none is declared lost (a fault between them "
                          "and NATS is likelier than %d failures); the ones still silent once the rest are heard "
                          "again are. Check the network, NATS and the executors (`gpufleet nodes`, `gpufleet status`)",
                          held[0], held[1], held[0])
            self.holding = True
            self.lease_holds += 1
            return
        if self.holding:
            # as after its own reconnect: one whose agent is still catching up (its connection
            # moved meanwhile) is not lost the moment the rest is heard
            self._full_leases("the fleet is heard again")
            self.holding = False
            return
        self.lease_checks += 1
        facts = self.core.check_leases(self.state, self.last_seen, self.clock(), self.runtime.ctx())
        for f in facts:
            if f.type == "node.lost":
                log.warning("ALERT node.lost: %s", f.payload.model_dump(exclude={"type"}))
                _forget_metrics(f.node_id or "")
        await self.runtime.publish_local(facts)

    def _full_leases(self, why: str) -> None:
        """Every node a full lease from now (after a time in which telemetry could not tell)."""
        now = self.clock()
        for node_id in self.state.nodes:
            self.last_seen[node_id] = max(self.last_seen.get(node_id, 0.0), now)
        log.warning("%s: every node gets a full lease (%.0fs) from now", why, self.core.rules.lease_s)

    def backends(self) -> dict[str, GpuBackend]:
        out: dict[str, GpuBackend] = dict(self.local)
        if self.world is not None:
            self.world.sync(self.state)
            out.update({n: b for n, b in self.world.backends.items() if n not in out})
        return out

    async def sample_once(self) -> None:
        from gpufleet.services.executor.process_driver import job_of_pid

        now = self.clock()
        facts = []
        docs: list[tuple[str, bytes]] = []  # the round's samples, published together at its end
        slice_end = time.perf_counter() + SAMPLE_SLICE_S
        synced = True  # the world is in step with the state (backends() synced it)
        for node_id, backend in sorted(self.backends().items()):
            if time.perf_counter() >= slice_end:
                await asyncio.sleep(0)  # the rest of the loop runs: this round is not a stall
                slice_end = time.perf_counter() + SAMPLE_SLICE_S
                synced = False  # the log may have moved meanwhile
            if node_id in self.state.lost:
                continue
            if not synced and node_id not in self.local and self.world is not None:
                self.world.sync_node(self.state, node_id)
            samples: list[GpuSample] = (await asyncio.to_thread(backend.sample) if node_id in self.local
                                        else backend.sample())
            self.samples_taken += 1
            if node_id in self.local:
                owner: Owner = job_of_pid
                use = self.proc_use.use(self.state, node_id, now)
            else:
                assert self.world is not None
                owner = self.world.owners.get
                use = self.world.use(self.state, node_id)
            if self.publish_samples:
                docs.append(self._doc(node_id, samples, now))
            _record_metrics(node_id, samples)
            facts += self.core.observe(self.state, self.windows, node_id, samples, owner, use, now, self.runtime.ctx())
        await self.bus.publish_telemetry_many(docs)
        for f in facts:
            if f.type in ALERTS:  # the alert: in the log (watch, dashboards) and in this service's log
                log.warning("ALERT %s: %s", f.type, f.payload.model_dump(exclude={"type"}))
        await self.runtime.publish_local(facts)

    @staticmethod
    def _doc(node_id: str, samples: list[GpuSample], now: float) -> tuple[str, bytes]:
        doc = {"node_id": node_id, "at": now, "gpus": [sample_doc(s) for s in samples]}
        return f"fleet.tel.node.{node_id}.gpu", json.dumps(doc).encode()


def _forget_metrics(node_id: str) -> None:
    from gpufleet.shared.runtime import otel

    otel.forget_gpus(node_id)


def _record_metrics(node_id: str, samples: list[GpuSample]) -> None:
    try:
        from gpufleet.shared.runtime import otel
    except ImportError:  # the metrics module is optional until it lands
        return
    record = getattr(otel, "record_gpu", None)
    if record is None:
        return
    for s in samples:
        record(node_id, s.index, s.util_pct, s.mem_used_mib, s.mem_total_mib, s.temp_c, s.power_w)


def local_gpus(node_id: str | None) -> dict[str, GpuBackend]:
    """This machine's GPUs through NVML, as node `node_id` (default: the host name); {} without."""
    from gpufleet.services.executor.agent import node_id_of_host
    from gpufleet.shared.node.nvml import open_backend

    backend = open_backend()
    return {node_id or node_id_of_host(): backend} if backend is not None else {}


def sidecar(runtime: ServiceRuntime[TelemetryState], bus: Bus) -> TelemetryAgent:
    """The agent for a telemetry core co-located in a group (settings from the environment)."""
    import os

    assert isinstance(runtime.core, TelemetryCore)
    return TelemetryAgent(runtime.core, bus, local=local_gpus(os.environ.get("GPUFLEET_NODE_ID")),
                          sample_s=float(os.environ.get("GPUFLEET_SAMPLE_S", SAMPLE_S)), runtime=runtime)


def main(argv: list[str] | None = None) -> None:
    import os

    from gpufleet.services.executor.agent import _stop_on_signals, setup_process
    from gpufleet.shared.contract.config import resolve_nats_url
    from gpufleet.shared.runtime.service import base_parser

    d = rules_from_env()
    ap = base_parser("telemetry")
    ap.add_argument("--sample-s", type=float, default=float(os.environ.get("GPUFLEET_SAMPLE_S", SAMPLE_S)),
                    help="seconds between GPU samples")
    ap.add_argument("--lease-s", type=parse_duration_s, default=d.lease_s, help="no heartbeat this long: node lost")
    ap.add_argument("--idle-pct", type=float, default=d.idle_pct, help="GPU utilisation under which a job is idle")
    ap.add_argument("--idle-after", type=parse_duration_s, default=d.idle_after_s, help="idle this long: job.idle_detected")
    ap.add_argument("--starved-after", type=parse_duration_s, default=d.starved_after_s)
    ap.add_argument("--node-id", default=os.environ.get("GPUFLEET_NODE_ID"), help="the node this machine's GPUs belong to")
    ap.add_argument("--no-sim", action="store_true", help="do not play the sim nodes' GPUs")
    ap.add_argument("--no-nvml", action="store_true", help="do not sample this machine's GPUs")
    ap.add_argument("--no-samples", action="store_true", help="derive facts, but publish no samples")
    args = ap.parse_args(argv)
    setup_process("telemetry", args)
    url = args.nats_url or resolve_nats_url(args.data_dir)
    local = {} if args.no_nvml else local_gpus(args.node_id)
    rules = Rules(lease_s=args.lease_s, idle_pct=args.idle_pct, idle_after_s=args.idle_after,
                  starved_after_s=args.starved_after)

    async def run() -> None:
        bus = await Bus.connect(url, name=f"gpufleet-telemetry-{args.instance}")
        agent = TelemetryAgent(TelemetryCore(rules), bus, sim=not args.no_sim, local=local, sample_s=args.sample_s,
                               publish_samples=not args.no_samples, instance=args.instance, batch=args.batch)
        _stop_on_signals(agent.stop)
        try:
            await agent.start()
            log.info("telemetry ready: %d local node(s) on NVML, sim %s", len(local), "on" if agent.world else "off")
            await agent.run()
        finally:
            await bus.close()

    gcpolicy.install()
    asyncio.run(run())
