"""Telemetry: what runs on which GPU, and the facts derived from watching the GPUs.

folds: nodes, running replicas (GPUs, pids), quarantined GPUs, facts already said
decides (from observations the shell hands in, never from the clock or I/O itself):
  - `check_leases`: a node whose heartbeats stopped for `lease_s` -> `node.lost`, and each of
    its running replicas -> `job.exited` (reason node_lost), so quota and GPUs are released
    and the guardian can run the job again; never leaked.
  - `observe`: one node's GPU samples (+ each job's CPU / I/O use) ->
      `node.gpu_zombie_detected`  memory held by a process of no job running on that GPU
      `node.gpu_cleared`          a quarantined GPU passed the occupancy check
      `node.gpu_unhealthy`        uncorrected ECC errors or a fatal XID
      `job.idle_detected`         the job's GPUs below `idle_pct` for `idle_after_s`
      `job.gpu_starved`           GPUs underused while the job's CPUs are saturated / it waits on I/O
The windows behind idle / starved live in `Windows`, which the shell owns (samples are not in
the log; after a restart they start again).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gpufleet.shared.contract.events import (
    RUN_ENDED_JOB_TYPES,
    Envelope,
    GpuDevice,
    JobExited,
    JobGpuStarved,
    JobIdleDetected,
    JobIdleEnded,
    JobPlaced,
    JobStarted,
    JobSubmitted,
    NodeDeregistered,
    NodeGpuCleared,
    NodeGpuUnhealthy,
    NodeGpuZombieDetected,
    NodeLost,
    NodeRegistered,
)
from gpufleet.shared.contract.spec import SimSpec
from gpufleet.shared.node.gpu import FATAL_XIDS, GpuSample
from gpufleet.shared.runtime.loop import BaseCore, Ctx

LOST_EXIT = 137


@dataclass(frozen=True)
class Rules:
    lease_s: float = 30.0  # no heartbeat for this long: the node is lost
    # this share of the nodes (of at least hold_min_nodes) silent at once: none is declared lost
    # (Kubernetes' node lifecycle controller stops evicting at 55% of a zone); `silent_fleet`
    hold_fraction: float = 0.55
    hold_min_nodes: int = 3
    idle_pct: float = 5.0
    idle_after_s: float = 1800.0
    starved_gpu_pct: float = 40.0
    starved_cpu_pct: float = 90.0  # of the CPUs the job asked for
    starved_io_pct: float = 30.0
    starved_after_s: float = 120.0


@dataclass
class Replica:
    job_id: str
    tenant: str
    replica: int
    attempt: int
    node_id: str
    gpus: tuple[int, ...]
    cpu_milli: int
    started_at: float = 0.0
    started_event_id: str | None = None
    placed_event_id: str = ""
    pid: int | None = None
    container_id: str | None = None


@dataclass
class NodeInfo:
    gpus: tuple[GpuDevice, ...]
    driver: str


@dataclass(slots=True)
class Spells:
    """What was said of one attempt of a job: an idle warning not over yet, the idle spells that ended
    (the next warning's id counts them), a starvation warning."""

    idle: bool = False
    idle_ended: int = 0
    starved: bool = False


@dataclass(slots=True)
class TelemetryJob:
    """Everything telemetry knows of one job: one record, forgotten when its run ends
    (`TelemetryState.end`). Collections stay None until needed: a pending job costs one small record."""

    sim: SimSpec | None = None  # how its sim replicas behave (the spec's own, shared)
    replicas: dict[int, Replica] | None = None  # replica -> placed / running here
    spells: dict[int, Spells] | None = None  # attempt -> what was said of it

    def said(self, attempt: int) -> Spells:
        """What was said of that attempt (nothing: an empty one, not kept)."""
        said = self.spells.get(attempt) if self.spells is not None else None
        return said if said is not None else Spells()

    def spells_of(self, attempt: int) -> Spells:
        if self.spells is None:
            self.spells = {}
        said = self.spells.get(attempt)
        if said is None:
            said = self.spells[attempt] = Spells()
        return said


@dataclass
class TelemetryState:
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    registered_at: dict[str, float] = field(default_factory=dict)  # a registration counts as a heartbeat
    registration: dict[str, str] = field(default_factory=dict)  # node -> its registration's event id
    lost: set[str] = field(default_factory=set)
    jobs: dict[str, TelemetryJob] = field(default_factory=dict)
    # (node, gpu) -> why it takes no new work: unhealthy, zombie, unclean (a clear lifts the last two)
    quarantined: dict[tuple[str, int], set[str]] = field(default_factory=dict)
    episodes: dict[tuple[str, int], int] = field(default_factory=dict)  # (node, gpu) -> quarantines so far
    zombies_said: set[tuple[str, int, int]] = field(default_factory=set)  # (node, gpu, pid)
    last_job_on: dict[tuple[str, int], str] = field(default_factory=dict)  # (node, gpu) -> last job there
    # index of the jobs' replicas by node (kept by `add`, `drop` and `end`, nowhere else)
    by_node: dict[str, dict[tuple[str, int], Replica]] = field(default_factory=dict)

    def job(self, job_id: str) -> TelemetryJob:
        rec = self.jobs.get(job_id)
        if rec is None:
            rec = self.jobs[job_id] = TelemetryJob()
        return rec

    def replica(self, job_id: str, replica: int) -> Replica | None:
        rec = self.jobs.get(job_id)
        return rec.replicas.get(replica) if rec is not None and rec.replicas is not None else None

    def on_node(self, node_id: str) -> list[Replica]:
        return list(self.by_node.get(node_id, {}).values())

    def add(self, r: Replica) -> None:
        old = self.replica(r.job_id, r.replica)
        if old is not None:
            self.drop(old)
        rec = self.job(r.job_id)
        if rec.replicas is None:
            rec.replicas = {}
        rec.replicas[r.replica] = r
        self.by_node.setdefault(r.node_id, {})[(r.job_id, r.replica)] = r

    def drop(self, r: Replica) -> None:
        rec = self.jobs.get(r.job_id)
        if rec is not None and rec.replicas is not None:
            rec.replicas.pop(r.replica, None)
            if not rec.replicas:
                rec.replicas = None
        self._off_node(r)

    def end(self, job_id: str) -> None:
        """A job that ended (or was preempted: a resume is placed again) holds nothing here any more:
        its record goes (its sim behaviour, its idle and starvation spells), its replicas with it."""
        rec = self.jobs.pop(job_id, None)
        for r in (rec.replicas or {}).values() if rec is not None else ():
            self._off_node(r)

    def _off_node(self, r: Replica) -> None:
        on = self.by_node.get(r.node_id)
        if on is not None:
            on.pop((r.job_id, r.replica), None)
            if not on:
                del self.by_node[r.node_id]


@dataclass
class JobUse:
    """A job's CPU and I/O use over the last sample window (from its processes / container)."""

    cpu_pct: float  # of the CPUs it asked for
    iowait_pct: float = 0.0


@dataclass
class Windows:
    """Since when each job has looked idle / starved (samples, not the log: the shell owns this)."""

    low_since: dict[tuple[str, int], float] = field(default_factory=dict)
    starved_since: dict[tuple[str, int, str], float] = field(default_factory=dict)


Owner = Callable[[int], tuple[str, int, int] | None]  # pid -> (job, replica, attempt) it belongs to


def _hold(state: TelemetryState, key: tuple[str, int], why: str) -> None:
    held = state.quarantined.setdefault(key, set())
    if not held:
        state.episodes[key] = state.episodes.get(key, 0) + 1
    held.add(why)


def _attempt(rec: TelemetryJob) -> int:
    """The job's attempt placed here now (what is said of the job is said of this attempt)."""
    return max((r.attempt for r in (rec.replicas or {}).values()), default=1)


class TelemetryCore(BaseCore[TelemetryState]):
    name = "telemetry"
    subjects = (
        "fleet.evt.sys.node.*.*",
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.placed", "fleet.evt.*.job.*.started",
        "fleet.evt.*.job.*.exited", "fleet.evt.*.job.*.idle_detected", "fleet.evt.*.job.*.gpu_starved",
        "fleet.evt.*.job.*.idle_ended",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.preempted", "fleet.evt.*.job.*.rejected",
    )
    state_format = 2  # one record per job (TelemetryJob)

    def __init__(self, rules: Rules | None = None) -> None:
        self.rules = rules or Rules()

    def initial_state(self) -> TelemetryState:
        return TelemetryState()

    def evolve(self, state: TelemetryState, env: Envelope) -> TelemetryState:
        p = env.payload
        if isinstance(p, NodeRegistered):
            state.nodes[p.node_id] = NodeInfo(p.inventory.gpus, p.inventory.driver)
            state.registered_at[p.node_id] = env.occurred_at.timestamp()
            state.registration[p.node_id] = env.event_id
            state.lost.discard(p.node_id)
        elif isinstance(p, NodeLost):
            state.lost.add(p.node_id)
        elif isinstance(p, NodeDeregistered):  # removed on purpose (a node pool): no lease to keep
            state.nodes.pop(p.node_id, None)
            state.registered_at.pop(p.node_id, None)
            state.registration.pop(p.node_id, None)
            state.lost.discard(p.node_id)
        elif isinstance(p, NodeGpuZombieDetected):
            _hold(state, (p.node_id, p.gpu_index), "zombie")
            state.zombies_said.add((p.node_id, p.gpu_index, p.pid))
        elif isinstance(p, NodeGpuUnhealthy):
            _hold(state, (p.node_id, p.gpu_index), "unhealthy")
        elif isinstance(p, NodeGpuCleared):
            key = (p.node_id, p.gpu_index)
            held = set() if p.returned else state.quarantined.get(key, set()) - {"zombie", "unclean"}
            if held:
                state.quarantined[key] = held
            else:
                state.quarantined.pop(key, None)
            state.zombies_said = {z for z in state.zombies_said if z[:2] != key}
        elif isinstance(p, JobSubmitted):
            state.job(p.job_id).sim = p.spec.sim
        elif isinstance(p, JobPlaced):
            for a in p.allocations:
                state.add(Replica(p.job_id, env.tenant, a.replica, p.attempt, a.node_id, a.gpu_indices, a.cpu_milli,
                                  placed_event_id=env.event_id))
                for g in a.gpu_indices:
                    state.last_job_on[(a.node_id, g)] = p.job_id
        elif isinstance(p, JobStarted):
            r = state.replica(p.job_id, p.replica)
            if r is not None and r.attempt == p.attempt:
                r.started_at = env.occurred_at.timestamp()
                r.started_event_id = env.event_id
                r.pid, r.container_id = p.pid, p.container_id
        elif isinstance(p, JobExited):
            r = state.replica(p.job_id, p.replica)
            if r is not None and r.attempt == p.attempt:
                state.drop(r)
            for g in p.unclean_gpus:
                _hold(state, (p.node_id, g), "unclean")
        elif isinstance(p, JobIdleDetected):
            rec = state.job(p.job_id)
            rec.spells_of(_attempt(rec)).idle = True
        elif isinstance(p, JobIdleEnded):
            rec = state.job(p.job_id)
            said = rec.spells_of(_attempt(rec))
            said.idle = False
            said.idle_ended += 1
        elif isinstance(p, JobGpuStarved):
            rec = state.job(p.job_id)
            rec.spells_of(_attempt(rec)).starved = True
        elif env.type in RUN_ENDED_JOB_TYPES and env.job_id:
            state.end(env.job_id)
        return state

    # ------------------------------------------------------------ leases

    def silent_fleet(self, state: TelemetryState, last_seen: dict[str, float], now: float) -> tuple[int, int] | None:
        """(silent, watched) when so much of the fleet went silent at once that a fault between the
        nodes and NATS (a switch, a NATS outage, the executor that hosts them) is likelier than
        that many node failures: at least `hold_fraction` of at least `hold_min_nodes` nodes not
        yet lost. Then none is declared lost (its jobs would be re-run while they may be running
        fine); once enough are heard again, the agent gives every node a full lease from then, and
        the ones still silent after it are lost as usual. None otherwise."""
        watched = [n for n in state.nodes if n not in state.lost]
        if len(watched) < self.rules.hold_min_nodes:
            return None
        silent = sum(1 for n in watched
                     if now - max(last_seen.get(n, 0.0), state.registered_at.get(n, 0.0)) >= self.rules.lease_s)
        return (silent, len(watched)) if silent > 1 and silent >= self.rules.hold_fraction * len(watched) else None

    def check_leases(self, state: TelemetryState, last_seen: dict[str, float], now: float, ctx: Ctx) -> list[Envelope]:
        out: list[Envelope] = []
        for node_id in sorted(state.nodes):
            seen = max(last_seen.get(node_id, 0.0), state.registered_at.get(node_id, 0.0))
            if node_id in state.lost or now - seen < self.rules.lease_s:
                continue
            # ids derive from the node's registration and the replica's placement, not the clock:
            # deciding the same loss again (a retry, a second telemetry) says the same facts
            reg = state.registration.get(node_id)
            out.append(ctx.emit(NodeLost(node_id=node_id, reason=(
                f"no heartbeat for {now - seen:.0f}s (lease {self.rules.lease_s:.0f}s)")),
                cause_id=reg, key=f"lost:{node_id}"))
            for r in sorted(state.on_node(node_id), key=lambda r: (r.job_id, r.replica)):
                out.append(ctx.emit(JobExited(
                    job_id=r.job_id, node_id=node_id, replica=r.replica, exit_code=LOST_EXIT, reason="node_lost",
                    runtime_s=round(max(0.0, now - r.started_at), 3) if r.started_at else 0.0, attempt=r.attempt,
                ), tenant=r.tenant, cause_id=r.placed_event_id or reg, key=f"lost:{r.replica}:{r.attempt}"))
        return out

    # ------------------------------------------------------------ samples

    def observe(self, state: TelemetryState, windows: Windows, node_id: str, samples: list[GpuSample],
                owner: Owner, use: dict[tuple[str, int], JobUse], now: float, ctx: Ctx) -> list[Envelope]:
        """Facts from one node's samples. `owner` says which job a pid belongs to; `use` is each
        running replica's CPU / I/O use. Mutates only `windows`."""
        if node_id not in state.nodes or node_id in state.lost:
            return []
        out: list[Envelope] = []
        reg = state.registration.get(node_id)
        replicas = state.on_node(node_id)
        on_gpu: dict[int, set[tuple[str, int, int]]] = {}
        for r in replicas:  # placed counts, not only started: its process may run before the start is folded
            for g in r.gpus:
                on_gpu.setdefault(g, set()).add((r.job_id, r.replica, r.attempt))
        by_index = {s.index: s for s in samples}
        for s in samples:
            key = (node_id, s.index)
            mine = on_gpu.get(s.index, set())
            foreign = [pr for pr in s.processes if owner(pr.pid) not in mine]
            for pr in foreign:
                if (node_id, s.index, pr.pid) in state.zombies_said:
                    continue
                was = owner(pr.pid)
                episode = state.episodes.get(key, 0)
                out.append(ctx.emit(NodeGpuZombieDetected(
                    node_id=node_id, gpu_index=s.index, pid=pr.pid, used_mib=pr.used_mib, process_name=pr.name,
                    last_job_id=was[0] if was else state.last_job_on.get(key)),
                    cause_id=reg, key=f"zombie:{s.index}:{pr.pid}:{episode}"))
            why = state.quarantined.get(key, set())
            if why & {"zombie", "unclean"} and not foreign:
                out.append(ctx.emit(NodeGpuCleared(node_id=node_id, gpu_index=s.index, reason=(
                    f"occupancy check passed: no process outside a running job holds memory "
                    f"({', '.join(sorted(why & {'zombie', 'unclean'}))} before)")),
                    cause_id=reg, key=f"cleared:{s.index}:{state.episodes.get(key, 0)}"))
            bad = sorted(set(s.xids) & FATAL_XIDS)
            if "unhealthy" not in why and (bad or s.ecc_uncorrected > 0):
                reason = (f"XID {', '.join(map(str, bad))}" if bad
                          else f"{s.ecc_uncorrected} uncorrected ECC error(s)")
                out.append(ctx.emit(NodeGpuUnhealthy(
                    node_id=node_id, gpu_index=s.index, reason=reason, xid=bad[0] if bad else None,
                    ecc_uncorrected=s.ecc_uncorrected or None),
                    cause_id=reg, key=f"unhealthy:{s.index}:{state.episodes.get(key, 0)}"))
        for r in replicas:
            if r.started_event_id is None or not r.gpus:
                continue
            utils = [by_index[g].util_pct for g in r.gpus if g in by_index and by_index[g].util_pct is not None]
            if not utils:
                continue
            util = sum(u for u in utils if u is not None) / len(utils)
            out += self._idle(state, windows, r, util, now, ctx)
            out += self._starved(state, windows, r, util, use.get((r.job_id, r.replica)), now, ctx)
        return out

    def _idle(self, state: TelemetryState, w: Windows, r: Replica, util: float, now: float, ctx: Ctx) -> list[Envelope]:
        key = (r.job_id, r.attempt)
        said = state.jobs[r.job_id].said(r.attempt)
        n = said.idle_ended
        if util >= self.rules.idle_pct:
            w.low_since.pop(key, None)
            if said.idle:  # busy again: the warning is over (and the rule re-armed)
                return [ctx.emit(JobIdleEnded(job_id=r.job_id, node_id=r.node_id, gpu_util_pct=round(util, 2)),
                                 tenant=r.tenant, cause_id=r.started_event_id, key=f"idle_ended:{r.attempt}:{n}")]
            return []
        since = w.low_since.setdefault(key, now)
        if now - since < self.rules.idle_after_s or said.idle:
            return []
        return [ctx.emit(JobIdleDetected(job_id=r.job_id, gpu_util_pct=round(util, 2), idle_s=round(now - since, 3),
                                         node_id=r.node_id, threshold_pct=self.rules.idle_pct),
                         tenant=r.tenant, cause_id=r.started_event_id, key=f"idle:{r.attempt}:{n}")]

    def _starved(self, state: TelemetryState, w: Windows, r: Replica, util: float, use: JobUse | None, now: float,
                 ctx: Ctx) -> list[Envelope]:
        causes = []
        if use is not None and util < self.rules.starved_gpu_pct:
            if use.cpu_pct >= self.rules.starved_cpu_pct:
                causes.append("cpu")
            if use.iowait_pct >= self.rules.starved_io_pct:
                causes.append("io")
        for cause in ("cpu", "io"):
            if cause not in causes:
                w.starved_since.pop((r.job_id, r.attempt, cause), None)
        if use is None or state.jobs[r.job_id].said(r.attempt).starved:
            return []
        for cause in causes:
            since = w.starved_since.setdefault((r.job_id, r.attempt, cause), now)
            if now - since >= self.rules.starved_after_s:
                what = (f"its CPUs are {use.cpu_pct:.0f}% busy" if cause == "cpu"
                        else f"it waits on I/O {use.iowait_pct:.0f}% of the time")
                return [ctx.emit(JobGpuStarved(
                    job_id=r.job_id, node_id=r.node_id, cause="cpu" if cause == "cpu" else "io",
                    gpu_util_pct=round(util, 2), cpu_util_pct=round(use.cpu_pct, 2),
                    iowait_pct=round(use.iowait_pct, 2), window_s=round(now - since, 3),
                    message=(f"GPUs {util:.0f}% busy while {what}: the input pipeline cannot feed them "
                             + ("(more data-loader workers or CPUs?)" if cause == "cpu"
                                else "(data on slow storage? cache the dataset locally)"))),
                    tenant=r.tenant, cause_id=r.started_event_id, key=f"starved:{r.attempt}")]
        return []
