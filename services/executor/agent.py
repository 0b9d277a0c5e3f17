"""The executor as a process: the runtime (fold, consume, decide) plus what only a shell can do.

- heartbeats for every node it hosts, to FLEET_TELEMETRY (telemetry holds the lease);
- on driver nodes (`process`, `docker`), a reconcile loop: the pure `reconcile` compares what
  the log says should run with what the driver sees, and this loop starts, stops, reports and
  cleans up. A restarted executor folds the log, lists the driver's workloads (pid files,
  container labels) and so re-adopts what still runs instead of losing or duplicating it;
- after a workload ended, the GPU cleanliness check: a process of the job still holding memory
  on one of its GPUs (NVML) marks that GPU unclean in `job.exited`, so it is not handed out
  again until telemetry's occupancy check passes;
- before a replica starts, its `dataset` / `model` staged into the node's cache (`staging.py`):
  `job.data_staging` while the copy runs, `job.data_staged` (bytes, seconds, or cached) once it is
  there, the local path as GPUFLEET_DATASET_DIR / GPUFLEET_MODEL_DIR; `node.datasets_cached`
  whenever what the cache holds changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gpufleet.shared.contract.events import (
    SYS_TENANT,
    Envelope,
    JobDataStaged,
    JobDataStaging,
    NodeDatasetsCached,
    NodeHeartbeat,
    Reason,
    utc,
)
from gpufleet.shared.contract.ids import derive_id
from gpufleet.shared.node.checkpoints import CHECKPOINTED_TYPES, latest_good
from gpufleet.shared.node.checkpoints import location as checkpoint_location
from gpufleet.shared.node.gpu import GpuBackend
from gpufleet.shared.runtime import gcpolicy
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.runtime.loop import Ctx, ServiceRuntime, every

from .core import (
    Action,
    Adopt,
    Cleanup,
    ExecutorCore,
    ExecutorState,
    ReportExit,
    Start,
    Stop,
    exited_event,
    reconcile,
    started_event,
)
from .datacache import DataNeed, data_needs, in_use
from .drivers import Driver, DriverError, Launch, Workload
from .logs import LogRequest, LogServer, LogText, sim_lines
from .staging import PROGRESS_EVERY_S, DataStager

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
# a workload still there this long after its grace ran out (SIGKILL did not end it: a process stuck
# in the kernel) is reported ended anyway, its GPUs through the cleanliness check
FORCE_AFTER_S = 30.0
RECONCILE_S = 0.5
HEARTBEAT_CHUNK = 500  # node ids per heartbeat message (one executor may host thousands of sim nodes)
EXIT_CANNOT_RUN = 126


class ExecutorAgent:
    def __init__(self, core: ExecutorCore, bus: Bus, driver: Driver | None = None, gpu: GpuBackend | None = None,
                 instance: str = "0", heartbeat_s: float = HEARTBEAT_S, reconcile_s: float = RECONCILE_S,
                 grace_s: float = 10.0, checkpoint_root: str | None = None, force_after_s: float = FORCE_AFTER_S,
                 clock: Callable[[], float] = time.time, batch: int = 256,
                 runtime: ServiceRuntime[ExecutorState] | None = None, serve_logs: bool = True,
                 data: DataStager | None = None, progress_every_s: float = PROGRESS_EVERY_S) -> None:
        self.core = core
        self.bus = bus
        self.driver = driver
        self.gpu = gpu
        self.heartbeat_s = heartbeat_s
        self.reconcile_s = reconcile_s
        self.grace_s = grace_s
        self.force_after_s = force_after_s
        self.checkpoint_root = checkpoint_root
        self.clock = clock
        # in a co-located group the group owns the runtime; the agent adds heartbeats (and reconcile)
        self.owns_runtime = runtime is None
        self.runtime: ServiceRuntime[ExecutorState] = runtime or ServiceRuntime(
            core, bus, instance=instance, batch=batch, clock=clock)
        self._stop = asyncio.Event()
        self._beat: asyncio.Task[None] | None = None
        self._stopping: dict[str, float] = {}  # workload key -> when we asked it to stop
        self._forced: set[str] = set()
        self.beating = True  # tests turn heartbeats off to play a lost node
        self.heartbeats_sent = 0
        self.data = data  # the node's dataset / model cache (driver nodes)
        self.progress_every_s = progress_every_s
        self._staging_said: dict[tuple[str, str], tuple[int, float]] = {}  # (key, name) -> (facts said, when)
        self._cached_said: tuple[str, ...] | None = None  # what node.datasets_cached said last
        self.logs: LogServer | None = LogServer(
            bus, self.runtime.actor, lambda: self.core.hosted(self.state), self._log_text,
            lambda n: self.driver.name if self.driver is not None and n in self.core.driver_nodes else "sim",
        ) if serve_logs else None

    @property
    def state(self) -> ExecutorState:
        return self.runtime.state

    async def start(self) -> None:
        # heartbeats first: folding a long log, or a slow first reconcile, must not cost the lease
        await self.heartbeat()
        self._beat = asyncio.create_task(self._every(self.heartbeat_s, self.heartbeat))
        if self.logs is not None:
            try:
                await self.logs.start()
            except Exception as e:  # noqa: BLE001 - logs are a convenience: the node runs without them
                log.error("the logs service did not start (%s): `gpufleet logs` cannot reach this node", e)
                self.logs = None
        if self.data is not None:
            await asyncio.to_thread(self.data.scan)  # what the cache really holds (said once registered)
        if self.owns_runtime:
            await self.runtime.start()
        if self.driver is not None:
            await self.reconcile_once()  # re-adopt / report what happened while we were away

    def stop(self) -> None:
        self._stop.set()
        self.runtime.stop()

    async def run(self) -> None:
        tasks = [self._beat or asyncio.create_task(self._every(self.heartbeat_s, self.heartbeat))]
        if self.driver is not None:
            tasks.append(asyncio.create_task(self._every(self.reconcile_s, self.reconcile_once)))
        if self.owns_runtime:
            tasks.append(asyncio.create_task(self.runtime.run()))
        try:
            await self._stop.wait()
        finally:
            self.runtime.stop()
            for t in tasks:
                if t is not tasks[-1] or not self.owns_runtime:
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.logs is not None:
                await self.logs.stop()
            if self.data is not None:
                await self.data.close()
            if self.driver is not None:
                await self.driver.close()

    async def _log_text(self, node_id: str, key: str, tenant: str, req: LogRequest) -> LogText | None:
        """A workload's log: the driver's on a driver node; on a sim node, lines from the job's events."""
        if node_id in self.core.driver_nodes:
            return await self.driver.log_text(key) if self.driver is not None else None
        from gpufleet.shared.contract.events import parse_envelope
        from gpufleet.shared.runtime.log import read_stream

        events = []
        async for batch in read_stream(self.bus, (f"fleet.evt.{tenant}.job.{req.job_id}.>",)):
            for m in batch:
                with contextlib.suppress(Exception):  # a bad message is dead-lettered elsewhere
                    events.append(parse_envelope(m.data))
        got = sim_lines(events, req.replica, req.attempt, self.clock())
        return None if got is None else LogText(tenant, data=got[0].encode(), running=got[1])

    async def _every(self, period_s: float, fn: Callable[[], Any]) -> None:
        await every(self._stop, period_s, fn, self.runtime.actor)

    # ------------------------------------------------------------ heartbeats

    async def heartbeat(self) -> None:
        if not self.beating:
            return
        nodes = self.core.hosted(self.state)
        running = {n: [job_id for job_id, _ in self.state.on_node.get(n, ())] for n in self.core.driver_nodes}
        now = self.clock()
        for i in range(0, len(nodes), HEARTBEAT_CHUNK):
            chunk = nodes[i:i + HEARTBEAT_CHUNK]
            payload = NodeHeartbeat(node_id=chunk[0], also_nodes=tuple(chunk[1:]),
                                    running_jobs=tuple(sorted(j for n in chunk for j in running.get(n, ()))))
            env = Envelope(event_id=derive_id(f"hb:{chunk[0]}", 0, time_ms=int(now * 1000)), type=payload.type,
                           occurred_at=utc(now), tenant=SYS_TENANT, actor=self.runtime.actor, payload=payload)
            await self.bus.publish_telemetry(env.subject(), env.to_json())
        self.heartbeats_sent += 1

    # ------------------------------------------------------------ reconcile

    async def reconcile_once(self) -> int:
        """One round; returns how many actions it took. One action failing (a driver error) is
        logged and retried next round; it does not hold up the others."""
        assert self.driver is not None
        await self.runtime.ensure_fresh()
        observed = await self.driver.list()
        nodes = {n: self.core.nodes[n] for n in self.core.driver_nodes}
        now = self.clock()
        actions = reconcile(self.state, nodes, observed, now, self.grace_s, self.checkpoint_root)
        ctx = self.runtime.ctx()
        out: list[Envelope] = []
        cleanups: list[str] = []
        if self.data is not None:  # what running and starting jobs use is never evicted
            self.data.in_use = in_use([self.state.peek(w.job_id).spec for w in observed if w.running]
                                      + [self.state.peek(a.launch.job_id).spec for a in actions if isinstance(a, Start)],
                                      self.data.sources)
        for a in actions:
            try:
                await self._act(a, ctx, now, out, cleanups)
            except Exception:  # noqa: BLE001 - the next round tries this one again
                log.exception("%s: %s failed; retrying next round", _key_of(a), type(a).__name__)
        if self.data is not None:
            starting = {a.launch.key for a in actions if isinstance(a, Start)}
            self.data.want_only(starting)  # a copy for a job cancelled meanwhile stops
            for k in [k for k in self._staging_said if k[0] not in starting]:
                del self._staging_said[k]
            await self.data.trim()
            out += self._cached_fact(ctx)
        if out:
            try:
                await self.runtime.publish_local(out)  # published (and folded) before anything is removed
            except Exception:
                self._cached_said = None  # said again next round
                raise
        for key in cleanups:
            try:
                await self.driver.cleanup(key)
                self._stopping.pop(key, None)
                self._forced.discard(key)
            except Exception:  # noqa: BLE001
                log.exception("%s: clean-up failed; retrying next round", key)
        return len(actions)

    async def _act(self, a: Action, ctx: Ctx, now: float, out: list[Envelope], cleanups: list[str]) -> None:
        assert self.driver is not None
        if isinstance(a, Start):
            launch = await self._staged(a, ctx, out) if self.data is not None else a.launch
            if launch is None:
                return  # its data is being copied (or could not be: its exit is in `out`)
            try:
                w = await self.driver.start(launch)
            except DriverError as exc:
                log.warning("%s: cannot start: %s", a.launch.key, exc.message)
                never = Workload(a.launch.job_id, a.launch.replica, a.launch.attempt, a.launch.node_id, handle="",
                                 running=False, exit_code=EXIT_CANNOT_RUN, started_at=now)
                out.append(exited_event(ctx, ReportExit(never, "error", None, a.desired)))
                return
            out.append(started_event(ctx, w, a.desired, self.driver.name))
        elif isinstance(a, Adopt):
            log.info("re-adopted %s (pid %s, container %s)", a.workload.key, a.workload.pid, a.workload.container_id)
            out.append(started_event(ctx, a.workload, a.desired, self.driver.name))
        elif isinstance(a, Stop):
            if a.key not in self._stopping:
                log.info("stopping %s (%s), grace %.1fs", a.key, a.reason, a.grace_s)
                await self.driver.stop(a.key, a.grace_s)
                self._stopping[a.key] = now + a.grace_s  # (only once it was asked: a failed stop is tried again)
            elif now > self._stopping[a.key] + self.force_after_s and a.key not in self._forced:
                await self._force_end(a, ctx, now, out)
        elif isinstance(a, ReportExit):
            unclean = await self.unclean_gpus(a)
            if unclean:
                log.warning("%s exited but still holds memory on GPU(s) %s", a.workload.key, unclean)
            out.append(exited_event(ctx, a, unclean, await self.last_checkpoint(a.workload.job_id)))
            if a.workload.handle:
                cleanups.append(a.workload.key)
        elif isinstance(a, Cleanup):
            cleanups.append(a.key)

    # ------------------------------------------------------------ datasets and models

    async def _staged(self, a: Start, ctx: Ctx, out: list[Envelope]) -> Launch | None:
        """The launch with the local paths of its dataset / model once all are in the node's cache;
        None while a copy runs, or when one failed (its exit is then in `out`, with why)."""
        assert self.data is not None
        cache, launch, d = self.data, a.launch, a.desired
        needs = data_needs(self.state.peek(launch.job_id).spec, cache.sources)
        ready: list[DataNeed] = []
        waiting = False
        for n in needs:
            why = cache.failed.pop((launch.key, n.name), None)
            if why is None and "://" in n.name:  # the job's own URI: allowed for its tenant, on this node too
                why = cache.refusal(d.tenant, n.name)
            if why is not None:
                never = Workload(launch.job_id, launch.replica, launch.attempt, launch.node_id, handle="",
                                 running=False, exit_code=EXIT_CANNOT_RUN, started_at=self.clock())
                out.append(exited_event(ctx, ReportExit(never, "error", None, d), detail=Reason(
                    code="data_staging_failed", field=n.field, message=f"{n.field} {n.uri}: cannot stage it: {why}")))
                return None
            if cache.has(n.name):
                ready.append(n)
            elif n.uri is not None:
                waiting = True
                c = cache.copies.get(n.name)
                if c is None or launch.key not in c.waiters:
                    c = cache.begin(n, launch.key)
                said, at = self._staging_said.get((launch.key, n.name), (0, 0.0))
                now = self.clock()
                if said == 0 or now - at >= self.progress_every_s:
                    out.append(ctx.emit(JobDataStaging(
                        job_id=launch.job_id, node_id=launch.node_id, replica=launch.replica, attempt=launch.attempt,
                        field=n.field, uri=n.uri, done_bytes=c.done_bytes, total_bytes=c.total_bytes,
                        elapsed_s=round(max(0.0, now - c.started_at_s), 3)),
                        tenant=d.tenant, cause_id=d.placed_event_id, key=f"staging:{launch.replica}:{n.field}:{said}"))
                    self._staging_said[(launch.key, n.name)] = (said + 1, now)
            # else: a bare name nobody configured a source for, not held here: it starts without it
        if waiting:
            return None
        dirs = []
        for n in ready:
            copy = cache.staged.pop((launch.key, n.name), None)
            path = str(cache.path_of(n.name))
            entry = cache.cache.entries[n.name]
            out.append(ctx.emit(JobDataStaged(
                job_id=launch.job_id, node_id=launch.node_id, replica=launch.replica, attempt=launch.attempt,
                field=n.field, name=n.name, uri=n.uri, path=path, cached=copy is None, size_bytes=entry.size_bytes,
                copied_bytes=copy.copied_bytes if copy else 0, staging_s=copy.staging_s if copy else 0.0),
                tenant=d.tenant, cause_id=d.placed_event_id, key=f"staged:{launch.replica}:{n.field}"))
            cache.use(n.name)
            dirs.append((n.field, path))
            self._staging_said.pop((launch.key, n.name), None)
        return replace(launch, data_dirs=tuple(dirs)) if dirs else launch

    def _cached_fact(self, ctx: Ctx) -> list[Envelope]:
        """`node.datasets_cached` for each driver node, when what the cache holds changed."""
        assert self.data is not None
        listing = self.data.listing()
        if listing == self._cached_said:
            return []
        self._cached_said = listing
        digest = hashlib.sha256("\n".join(listing).encode()).hexdigest()[:16]
        return [ctx.emit(NodeDatasetsCached(node_id=n, datasets=listing), tenant=SYS_TENANT,
                         key=f"datasets:{n}:{digest}") for n in sorted(self.core.driver_nodes)]

    async def _force_end(self, a: Stop, ctx: Ctx, now: float, out: list[Envelope]) -> None:
        """Stuck terminating: report the end the workload will not report itself (once)."""
        w = next((x for x in await self.driver.list() if x.key == a.key), None) if self.driver else None
        self._forced.add(a.key)
        if w is None or not w.running or self.state.exit_logged(w.job_id, w.replica, w.attempt):
            return
        run = self.state.run(w.job_id, w.replica)
        run = run if run is not None and run.attempt == w.attempt else None
        d = (self.state.peek_driver(w.job_id).desired or {}).get(w.replica)
        report = ReportExit(replace(w, running=False, exit_code=137), a.reason, run,
                            d if d is not None and d.attempt == w.attempt else None)
        unclean = await self.unclean_gpus(report)
        log.error("%s did not end %.0fs after its grace (stuck in the kernel?): reported ended; GPUs %s unclean",
                  a.key, self.force_after_s, list(unclean))
        out.append(exited_event(ctx, report, unclean))

    async def last_checkpoint(self, job_id: str) -> tuple[str, int, float] | None:
        """The latest good checkpoint of a training job, as the run ends (one saved in its grace
        included), so the guardian resumes from exactly that one."""
        rec = self.state.peek(job_id)
        spec = rec.spec
        if self.checkpoint_root is None or spec is None or spec.type not in CHECKPOINTED_TYPES:
            return None
        run = next(iter((rec.running or {}).values()), None)
        d = next(iter((self.state.peek_driver(job_id).desired or {}).values()), None)
        tenant = run.tenant if run else (d.tenant if d else spec.tenant)
        where = checkpoint_location(self.checkpoint_root, tenant, job_id, spec.checkpoint.path if spec.checkpoint else None)
        c = await asyncio.to_thread(latest_good, where)
        return (c.uri, c.step, c.created_at) if c else None

    async def unclean_gpus(self, a: ReportExit) -> tuple[int, ...]:
        """GPUs of the allocation on which a process of this workload still holds memory."""
        if self.gpu is None or self.driver is None or not a.workload.handle:
            return ()
        from .process_driver import job_of_pid

        w = a.workload
        mine = await self.driver.pids(w.key)
        ident = (w.job_id, w.replica, w.attempt)
        unclean = []
        for index in a.desired.alloc.gpu_indices if a.desired is not None else w.gpu_indices:
            procs = await asyncio.to_thread(self.gpu.processes, index)
            if any(p.pid in mine or job_of_pid(p.pid) == ident for p in procs):
                unclean.append(index)
        return tuple(unclean)


def _key_of(a: Action) -> str:
    if isinstance(a, Start):
        return a.launch.key
    if isinstance(a, Adopt | ReportExit):
        return a.workload.key
    return str(a.key)


def sidecar(runtime: ServiceRuntime[ExecutorState], bus: Bus) -> ExecutorAgent:
    """The agent for a sim executor co-located in a group: its heartbeats."""
    assert isinstance(runtime.core, ExecutorCore)
    return ExecutorAgent(runtime.core, bus, runtime=runtime)


# ---------------------------------------------------------------- the process


def node_id_of_host() -> str:
    import socket

    from gpufleet.shared.contract.ids import is_token

    name = socket.gethostname().split(".")[0].replace(" ", "-") or "node"
    return name if is_token(name) else "node-0"


def main(argv: list[str] | None = None) -> None:
    import os
    from pathlib import Path

    from gpufleet.shared.contract.config import data_dir, resolve_nats_url
    from gpufleet.shared.node.cluster import sim_fleet
    from gpufleet.shared.runtime.service import base_parser

    ap = base_parser("executor")
    ap.add_argument("--driver", choices=("sim", "process", "docker"), default=os.environ.get("GPUFLEET_DRIVER", "sim"))
    ap.add_argument("--sim-nodes", type=int, default=4, help="simulated nodes this executor hosts (sim)")
    ap.add_argument("--node-prefix", default="sim", help="node id prefix (sim)")
    ap.add_argument("--sim-mix", default="", help="node shapes cycled over the sim nodes (h100x8,h100mig,...)")
    ap.add_argument("--no-sim-pools", action="store_true",
                    help="do not provide the autoscaler's sim node pools (sim; run one provider per mesh)")
    ap.add_argument("--node-id", default=os.environ.get("GPUFLEET_NODE_ID"), help="this node (process/docker; default: host name)")
    ap.add_argument("--work-dir", default=None, help="job files and logs (default: <data dir>/executor/<node>)")
    ap.add_argument("--checkpoint-root", default=os.environ.get("GPUFLEET_CHECKPOINT_ROOT"),
                    help="training / finetune jobs get <root>/<tenant>/<job> as GPUFLEET_CHECKPOINT_DIR "
                         "(default: <data dir>/checkpoints, which outlives the job)")
    ap.add_argument("--heartbeat-s", type=float, default=HEARTBEAT_S)
    ap.add_argument("--grace-s", type=float, default=10.0, help="SIGTERM, then this long, then SIGKILL")
    ap.add_argument("--dataset-cache-dir", default=os.environ.get("GPUFLEET_DATASET_CACHE_DIR"),
                    help="the node's dataset / model cache (default: datasetCache.dir, else <data dir>/datasets/<node>)")
    ap.add_argument("--dataset-cache-size", default=os.environ.get("GPUFLEET_DATASET_CACHE_SIZE"),
                    help="its size, like 500Gi (default: datasetCache.size, 100Gi)")
    ap.add_argument("--docker-url", default=os.environ.get("DOCKER_HOST"))
    ap.add_argument("--docker-user", default="65534:65534", help="uid:gid containers run as (never root)")
    ap.add_argument("--pull", choices=("never", "if-not-present", "always"), default="if-not-present")
    args = ap.parse_args(argv)
    setup_process("executor", args)
    url = args.nats_url or resolve_nats_url(args.data_dir)
    driver: Driver | None = None
    gpu: GpuBackend | None = None
    data: DataStager | None = None
    sim_pools = False
    if args.driver == "sim":
        nodes = sim_fleet(args.sim_nodes, args.node_prefix, args.sim_mix)
        sim_pools = not args.no_sim_pools
    else:
        from gpufleet.shared.node.hostinfo import host_inventory
        from gpufleet.shared.node.nvml import nvml_status, open_backend

        node_id = args.node_id or node_id_of_host()
        gpu = open_backend()
        if gpu is None:
            log.warning("no GPUs through NVML (%s): node %s registers with CPUs only", nvml_status(), node_id)
        nodes = {node_id: host_inventory(gpu.devices() if gpu else (), driver=args.driver)}
        mesh_dir = data_dir(args.data_dir)
        work = Path(args.work_dir) if args.work_dir else mesh_dir / "executor" / node_id
        args.checkpoint_root = args.checkpoint_root or str(mesh_dir / "checkpoints")
        from gpufleet.shared.contract.clusterconfig import load_config
        from gpufleet.shared.contract.spec import parse_memory_mib

        config = load_config(args.config)
        cache = config.dataset_cache
        size_mib = parse_memory_mib(args.dataset_cache_size) if args.dataset_cache_size else cache.size_mib
        def source_allowed(tenant: str, uri: str) -> str | None:
            import os
            from urllib.parse import unquote, urlparse

            from gpufleet.shared.contract.clusterconfig import source_refusal

            real = None
            if uri.startswith("file://"):  # where it really points, its symlinks followed
                real = "file://" + os.path.realpath(unquote(urlparse(uri).path))
            return source_refusal(uri, config.data_sources_for(tenant), real)

        data = DataStager(args.dataset_cache_dir or cache.dir or mesh_dir / "datasets" / node_id,
                          size_mib << 20, cache.sources, allowed=source_allowed)
        if args.driver == "process":
            from .process_driver import ProcessDriver

            driver = ProcessDriver(node_id, work, checkpoint_root=args.checkpoint_root)
        else:
            from .docker_driver import DockerDriver

            def allowed(tenant: str, image: str) -> bool:
                policy = config.policy(tenant)
                return policy is not None and policy.image_allowed(image)

            driver = DockerDriver(node_id, work, docker_url=args.docker_url, user=args.docker_user, pull=args.pull,
                                  allowed_images=allowed, mesh_data_dir=mesh_dir)

    async def run() -> None:
        bus = await Bus.connect(url, name=f"gpufleet-executor-{args.instance}")
        agent = ExecutorAgent(ExecutorCore(nodes, sim_pools=sim_pools), bus, driver, gpu, instance=args.instance,
                              heartbeat_s=args.heartbeat_s, grace_s=args.grace_s,
                              checkpoint_root=args.checkpoint_root, batch=args.batch, data=data)
        _stop_on_signals(agent.stop)
        try:
            await agent.start()
            log.info("executor ready: %d node(s), driver %s", len(nodes), args.driver)
            await agent.run()
        finally:
            await bus.close()

    gcpolicy.install()
    asyncio.run(run())


def setup_process(name: str, args: Any) -> None:
    """Logging, uvloop and (when asked for) OpenTelemetry, as every service process does."""
    logging.basicConfig(level=str(args.log_level).upper(), format=f"%(asctime)s {name} %(levelname)s %(message)s")
    try:
        from gpufleet.shared.runtime import otel

        setup = getattr(otel, "setup", None)
        if setup is not None:
            setup(name, getattr(args, "metrics_port", None) or None, getattr(args, "otlp_endpoint", None) or None)
    except ImportError:
        pass
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()


def _stop_on_signals(stop: Callable[[], None]) -> None:
    import signal

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop)
