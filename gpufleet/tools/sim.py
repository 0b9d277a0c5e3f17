"""`gpufleet sim SCENARIO.yaml --seed S`: the whole mesh, deterministic, in one process.

The real service cores (admission, quota, placer, executor with the sim driver, guardian,
telemetry's lease and facts) run against a simulated clock and an in-memory log. Every event is
appended with a sequence number, delivered in order to each core whose subjects match, and
decided as the runtime does (own outputs folded at once; ids derived from causes; duplicates
dropped by event id, as JetStream does). Time jumps from one thing that can happen to the next.
Same scenario and seed: the same log, byte for byte (the report prints its sha256).

Scenario (YAML; examples/sim/):

    seed: 7                      # default seed (the command line's --seed wins)
    until: 4h                    # stop when the clock reaches this (default: when all jobs ended)
    config: {...}                # the cluster config (tenants, queues, placement), as docs/config.md
    nodes: [{shape: h100x8, count: 12, prefix: h}]
    jobs:                        # submits; `count` repeats one, `every` spaces the repeats
      - {at: 0s, name: gang, spec: {replicas: 8, resources: {gpu: 8}, sim: {duration: 2h}}}
      - {at: 1m, name: small, count: 40, every: 2m, spec: {resources: {gpu: 8}, sim: {duration: 20m}},
         jitter: 0.2}            # duration x uniform(1 - j, 1 + j), from the seed
    faults:
      - {at: 30m, node_lost: h03}          # its executor goes silent: telemetry's lease does the rest
      - {at: 40m, gpu_unhealthy: {node: h04, gpu: 2, reason: XID 79}}
      - {at: 50m, zombie: {node: h05, gpu: 1, pid: 4242, used_mib: 4096}}
      - {at: 60m, restart: placer}         # the service folds the log again, as after a crash
      - {at: 70m, duplicate: job.placed}   # the next such event is delivered twice to everyone
      - {at: 80m, delay: {service: quota, by: 5m}}   # a slow service: it consumes nothing for 5 min,
                                                     # then catches up, in order
      - {at: 90m, cordon: h06}             # and uncordon: h06; drain: h06; gpu_cleared: {node: h05, gpu: 1}
                                           # (gpu_cleared: {..., returned: true}: an operator's return)
      - {at: 95m, cancel: small-0003}      # a user cancels a job (cancel: {job: J, tenant: T})
    load:                        # what an inference service's load balancer reports (cmd.report_load):
      - {service: chat, at: 10m, every: 1m, rps: [5, 20, 40, 40, 10, 0], p99_ms: 120}
    chaos:                       # delivery faults drawn from the seed, per delivery of an event to
      duplicate: 0.01            #   a service: delivered twice (decided again, as a redelivery)
      delay: 0.005               #   the service stalls for delay_by, then catches up in order
      delay_by: 20s
      restart: 0.001             #   the service restarts (folds the log again) before the delivery

The autoscaler runs too: `config.nodePools` (provider sim) grow and shrink the cluster, an
inference job with `autoscale` gets its replicas from the load reports.

With chaos, the seed decides which deliveries go wrong: a seed that breaks an invariant (the
report's audit) is a regression test as it stands — same seed, same faults, same log.
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.services.autoscaler.core import AutoscalerCore
from gpufleet.services.executor.core import ExecutorCore
from gpufleet.services.guardian.core import GuardianCore
from gpufleet.services.placer.core import PlacerCore
from gpufleet.services.quota.core import QuotaCore
from gpufleet.services.telemetry.core import Rules, TelemetryCore
from gpufleet.shared.contract.clusterconfig import ClusterConfig, parse_config
from gpufleet.shared.contract.events import (
    RUN_ENDED_JOB_TYPES,
    SYS_TENANT,
    CancelRequestedCmd,
    Envelope,
    NodeCordoned,
    NodeGpuCleared,
    NodeGpuUnhealthy,
    NodeGpuZombieDetected,
    NodeInventory,
    NodeRegistered,
    NodeUncordoned,
    ReportLoadCmd,
    SubmitRequested,
    utc,
)
from gpufleet.shared.contract.ids import derive_id
from gpufleet.shared.contract.spec import parse_duration_s
from gpufleet.shared.node.cluster import SHAPES, shape_inventory
from gpufleet.shared.runtime.engine import Engine
from gpufleet.shared.runtime.loop import Core, Ctx
from gpufleet.shared.trust.authz import owner_actor
from gpufleet.tools.audit import audit

EPOCH = datetime(2026, 1, 1, tzinfo=UTC).timestamp()
MAX_STEPS = 2_000_000
MAX_EVENTS_PER_INSTANT = 50_000  # more new events than this at one simulated instant: a decision loop
QUIET_S = 86_400.0  # nothing in the log for a simulated day, and nothing scheduled: the run is over


class ScenarioError(ValueError):
    pass


@dataclass
class Submit:
    at: float
    job_id: str
    tenant: str
    spec: dict[str, Any]


@dataclass
class Fault:
    at: float
    kind: str
    arg: Any


@dataclass(frozen=True)
class Chaos:
    """Per-delivery probabilities of delivery faults, drawn from the scenario's seed."""

    duplicate: float = 0.0
    delay: float = 0.0
    delay_by: float = 20.0
    restart: float = 0.0

    @property
    def on(self) -> bool:
        return bool(self.duplicate or self.delay or self.restart)


FAULT_KINDS = ("node_lost", "gpu_unhealthy", "zombie", "gpu_cleared", "cordon", "uncordon", "drain", "cancel", "restart",
               "duplicate", "delay", "load")


@dataclass
class Scenario:
    nodes: dict[str, NodeInventory]
    submits: list[Submit]
    faults: list[Fault]
    config: ClusterConfig
    until: float | None
    seed: int
    chaos: Chaos = field(default_factory=Chaos)


def _dur(v: Any, where: str) -> float:
    try:
        return parse_duration_s(v)
    except (ValueError, TypeError) as exc:
        raise ScenarioError(f"{where}: {exc}") from None


def load_scenario(doc: dict[str, Any], seed: int | None = None) -> Scenario:
    if not isinstance(doc, dict):
        raise ScenarioError("a scenario is a mapping (nodes, jobs, faults ...)")
    seed = int(doc.get("seed", 0)) if seed is None else seed
    rng = random.Random(seed)
    config = parse_config(doc.get("config") or {})
    nodes: dict[str, NodeInventory] = {}
    for i, group in enumerate(doc.get("nodes") or []):
        shape = group.get("shape", "h100x8")
        if shape not in SHAPES:
            raise ScenarioError(f"nodes[{i}].shape: unknown {shape!r} (one of {', '.join(SHAPES)})")
        prefix = group.get("prefix", shape.split("x")[0])
        for k in range(int(group.get("count", 1))):
            node_id = f"{prefix}{k:02d}"
            if node_id in nodes:
                raise ScenarioError(f"nodes[{i}]: node {node_id} twice (give each group its own prefix)")
            nodes[node_id] = shape_inventory(shape, node_id, rack=group.get("rack", f"rack-{i}"))
    if not nodes:
        raise ScenarioError("nodes: at least one group of nodes")
    submits: list[Submit] = []
    for i, job in enumerate(doc.get("jobs") or []):
        at = _dur(job.get("at", 0), f"jobs[{i}].at")
        every = _dur(job.get("every", 0), f"jobs[{i}].every")
        jitter = float(job.get("jitter", 0.0))
        for k in range(int(job.get("count", 1))):
            spec = json.loads(json.dumps(job.get("spec") or {}))
            name = str(job.get("name", f"job{i}"))
            spec.setdefault("name", name)
            spec.setdefault("tenant", job.get("tenant", "acme"))
            sim = spec.setdefault("sim", {})
            if jitter:
                base = _dur(sim.get("duration", "10s"), f"jobs[{i}].spec.sim.duration")
                sim["duration"] = round(base * rng.uniform(1 - jitter, 1 + jitter), 3)
            job_id = f"{name}-{k:04d}" if int(job.get("count", 1)) > 1 else name
            submits.append(Submit(at + k * every, job_id, spec["tenant"], spec))
    faults = []
    for i, f in enumerate(doc.get("faults") or []):
        kinds = [k for k in FAULT_KINDS if k in f] if isinstance(f, dict) else []
        if len(kinds) != 1:
            raise ScenarioError(f"faults[{i}]: one of {', '.join(FAULT_KINDS)}")
        if kinds[0] in ("gpu_unhealthy", "zombie", "gpu_cleared") and (
                not isinstance(f[kinds[0]], dict) or "node" not in f[kinds[0]] or "gpu" not in f[kinds[0]]):
            raise ScenarioError(f"faults[{i}].{kinds[0]}: {{node: NODE, gpu: INDEX}}")
        if kinds[0] == "cancel":
            c = f["cancel"]
            c = {"job": c} if isinstance(c, str) else c
            if not isinstance(c, dict) or "job" not in c:
                raise ScenarioError(f"faults[{i}].cancel: a job id, or {{job: J, tenant: T}}")
            f = {**f, "cancel": c}
        if kinds[0] == "delay":
            d = f["delay"]
            if not isinstance(d, dict) or "service" not in d:
                raise ScenarioError(f"faults[{i}].delay: {{service: NAME, by: DURATION}}")
            f = {**f, "delay": {"service": d["service"], "by": _dur(d.get("by", "30s"), f"faults[{i}].delay.by")}}
        faults.append(Fault(_dur(f.get("at", 0), f"faults[{i}].at"), kinds[0], f[kinds[0]]))
    for i, ld in enumerate(doc.get("load") or []):
        faults += _load_reports(ld, f"load[{i}]")
    until = _dur(doc["until"], "until") if "until" in doc else None
    return Scenario(nodes, sorted(submits, key=lambda s: (s.at, s.job_id)), sorted(faults, key=lambda f: f.at),
                    config, until, seed, load_chaos(doc.get("chaos")))


def _load_reports(doc: Any, where: str) -> list[Fault]:
    """`{service, at, every, rps: N | [N...], p99_ms: M | [M...], tenant}`: one report per value."""
    if not isinstance(doc, dict) or "service" not in doc or "rps" not in doc:
        raise ScenarioError(f"{where}: {{service: JOB, at: DURATION, every: DURATION, rps: N or [N, ...], p99_ms: M}}")
    rps = doc["rps"] if isinstance(doc["rps"], list) else [doc["rps"]]
    p99 = doc.get("p99_ms")
    p99s = p99 if isinstance(p99, list) else [p99] * len(rps)
    if len(p99s) != len(rps):
        raise ScenarioError(f"{where}.p99_ms: as many values as rps ({len(rps)})")
    at, every = _dur(doc.get("at", 0), f"{where}.at"), _dur(doc.get("every", "30s"), f"{where}.every")
    out = []
    for k, (r, q) in enumerate(zip(rps, p99s, strict=True)):
        try:
            arg = {"job": str(doc["service"]), "tenant": doc.get("tenant"), "rps": float(r),
                   "p99_ms": None if q is None else float(q), "window_s": float(every) or 10.0}
        except (TypeError, ValueError):
            raise ScenarioError(f"{where}: rps and p99_ms are numbers") from None
        out.append(Fault(at + k * every, "load", arg))
    return out


def load_chaos(doc: Any) -> Chaos:
    if doc is None:
        return Chaos()
    if not isinstance(doc, dict):
        raise ScenarioError("chaos: a mapping {duplicate: P, delay: P, delay_by: DURATION, restart: P}")
    unknown = set(doc) - {"duplicate", "delay", "delay_by", "restart"}
    if unknown:
        raise ScenarioError(f"chaos.{sorted(unknown)[0]}: unknown (duplicate, delay, delay_by, restart)")
    probs = {}
    for k in ("duplicate", "delay", "restart"):
        try:
            probs[k] = float(doc.get(k, 0.0))
        except (TypeError, ValueError):
            raise ScenarioError(f"chaos.{k}: a probability between 0 and 1, not {doc[k]!r}") from None
        if not 0.0 <= probs[k] <= 1.0:
            raise ScenarioError(f"chaos.{k}: a probability between 0 and 1, not {probs[k]}")
    return Chaos(delay_by=_dur(doc.get("delay_by", "20s"), "chaos.delay_by"), **probs)


@dataclass
class _Member:
    engine: Engine[Any]  # the core, its state and the delivery rules (shared/runtime/engine.py), as the runtime plays them
    delivered: int = 0  # log index up to which it has seen
    next_tick: float = 0.0
    paused_until: float = 0.0  # a slow service consumes nothing until then

    @property
    def core(self) -> Core[Any]:
        return self.engine.core

    @property
    def state(self) -> Any:
        return self.engine.state


def _by_owner(env: Envelope) -> Envelope:
    """A fact the scenario states (a GPU failing, an operator's cordon) as its owner says it: the
    telemetry for GPU facts, the admin (operator) for cordons (shared/trust/authz.py); the id stays
    the scenario's."""
    owner = "admin" if env.type in ("node.cordoned", "node.uncordoned") else owner_actor(env.type).split("/")[0]
    return env.model_copy(update={"actor": f"{owner}/sim"})


class Simulation:
    def __init__(self, scenario: Scenario, lease_s: float = 30.0) -> None:
        self.sc = scenario
        self.now = EPOCH
        self.log: list[Envelope] = []
        self.submitted_jobs: set[str] = set()  # (from the log, as it is appended)
        self.ended_jobs: set[str] = set()
        self.ids: set[str] = set()
        self.dead: set[str] = set()
        self.duplicate_next: set[str] = set()
        self.duplicated: set[str] = set()
        self.redeliveries = 0
        self.chaos_faults: dict[str, int] = {"duplicate": 0, "delay": 0, "restart": 0}
        self.rng = random.Random(f"chaos:{scenario.seed}")  # only chaos draws from it
        self.last_event_at = EPOCH
        self.rules = Rules(lease_s=lease_s)
        self.telemetry = TelemetryCore(self.rules)
        cfg = scenario.config
        self.executor = ExecutorCore(scenario.nodes, sim_pools=True)  # also the sim provider of node pools
        cores: list[Core[Any]] = [AdmissionCore(cfg), QuotaCore(cfg), PlacerCore(cfg), self.executor,
                                  GuardianCore(cfg), self.telemetry, AutoscalerCore(cfg)]
        self.members = [_Member(Engine(c)) for c in cores]
        self.last_seen: dict[str, float] = {}

    # ------------------------------------------------------------ the log

    def ctx(self, actor: str, cause: Envelope | None = None) -> Ctx:
        return Ctx(now=utc(self.now), actor=f"{actor}/sim", cause=cause)

    def append(self, envs: list[Envelope], member: _Member | None = None) -> None:
        """Outputs into the log, as the server takes them; a member's own that got in are applied to it."""
        taken: list[Envelope] = []
        for env in envs:
            if env.subject().startswith("fleet.tel."):
                continue  # samples and heartbeats are not in the main log
            node = getattr(env.payload, "node_id", None)
            if member is not None and member.core.name == "executor" and node in self.dead:
                continue  # that node's executor is gone with it
            if env.event_id in self.ids:
                continue  # the server's duplicate window
            self.ids.add(env.event_id)
            self.log.append(env)
            if env.job_id is not None:  # (kept as it goes: `all_ended` is asked every simulated second)
                if env.type == "job.submitted":
                    self.submitted_jobs.add(env.job_id)
                elif env.type in RUN_ENDED_JOB_TYPES:
                    self.ended_jobs.add(env.job_id)
            self.last_event_at = self.now
            taken.append(env)
        if member is not None:
            member.engine.apply(taken)

    def deliver(self) -> int:
        """Every member catches up with the log, in order, until nothing new is decided."""
        n = 0
        progress = True
        start = len(self.log)
        while progress:
            progress = False
            for m in self.members:
                if self.now < m.paused_until:
                    continue
                while m.delivered < len(self.log) and self.now >= m.paused_until:
                    if len(self.log) - start > MAX_EVENTS_PER_INSTANT:
                        self._loop_found()
                    env = self.log[m.delivered]
                    if not m.engine.wants(env.subject()):
                        m.delivered += 1
                        continue
                    if self.sc.chaos.on and self._chaos(m):
                        continue  # it stalls (this event waits) or restarted (then takes it)
                    m.delivered += 1
                    times = 2 if env.type in self.duplicate_next else 1
                    if times == 1 and self.sc.chaos.duplicate and self.rng.random() < self.sc.chaos.duplicate:
                        times = 2
                        self.chaos_faults["duplicate"] += 1
                    if times == 2:
                        self.duplicated.add(env.type)
                        self.redeliveries += 1
                    m.engine.fold(env, m.delivered)  # its sequence: the log's index + 1
                    for _ in range(times):  # a redelivery is decided again, not folded again
                        self.append(m.engine.decide(env, self.ctx(m.core.name, env)), m)
                    n += 1
                    progress = True
        return n

    def _loop_found(self) -> None:
        kinds: dict[str, int] = {}
        for e in self.log[-1000:]:
            kinds[e.type] = kinds.get(e.type, 0) + 1
        top = ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:4])
        raise ScenarioError(
            f"seed {self.sc.seed}: more than {MAX_EVENTS_PER_INSTANT} events at t={self.now - EPOCH:.0f}s "
            f"without time passing: the services decide in a loop (the last 1,000: {top})")

    def _chaos(self, m: _Member) -> bool:
        """Draw this delivery's faults; True when the member stalls before it."""
        c = self.sc.chaos
        if c.restart and self.rng.random() < c.restart:
            self.chaos_faults["restart"] += 1
            self._restart(m)
            return False
        if c.delay and self.rng.random() < c.delay:
            self.chaos_faults["delay"] += 1
            m.paused_until = self.now + c.delay_by
            return True
        return False

    def _restart(self, m: _Member) -> None:
        """As the runtime starts: fold the log to its head, then take the deliveries from where it
        had got to (its ack floor); those the fold covered are decided on, not folded again."""
        m.engine = Engine(m.core)
        for i, env in enumerate(self.log):
            if m.engine.wants(env.subject()):
                m.engine.fold(env, i + 1)  # what it had not been delivered yet is decided, not folded again
        self.append(m.core.on_start(m.state, self.ctx(m.core.name)), m)

    def tick(self) -> None:
        for m in self.members:
            if self.now < m.paused_until:
                continue  # a slow service decides nothing, time-driven or not
            if m.core.tick_s is not None and self.now >= m.next_tick:
                m.next_tick = self.now + m.core.tick_s
                self.append(m.core.tick(m.state, self.ctx(m.core.name)), m)
        ex = next(m for m in self.members if m.core is self.executor)
        for node in self.executor.hosted(ex.state):  # its own nodes and the pool nodes it brought up
            if node not in self.dead:
                self.last_seen[node] = self.now
        tel = next(m for m in self.members if m.core is self.telemetry)
        if self.now >= tel.paused_until:
            self.append(self.telemetry.check_leases(tel.state, self.last_seen, self.now, self.ctx("telemetry")), tel)

    # ------------------------------------------------------------ faults

    def fault(self, f: Fault) -> None:
        ctx = self.ctx("sim")
        if f.kind == "node_lost":
            if f.arg not in self.sc.nodes:
                raise ScenarioError(f"fault node_lost: no node {f.arg!r}")
            self.dead.add(str(f.arg))
        elif f.kind == "gpu_unhealthy":
            self.append([_by_owner(ctx.emit(NodeGpuUnhealthy(node_id=f.arg["node"], gpu_index=int(f.arg["gpu"]),
                                                   reason=str(f.arg.get("reason", "XID 79"))),
                                  tenant=SYS_TENANT, key=f"fault:{f.at}:{f.kind}:{f.arg}"))])
        elif f.kind == "zombie":
            self.append([_by_owner(ctx.emit(NodeGpuZombieDetected(
                node_id=f.arg["node"], gpu_index=int(f.arg["gpu"]), pid=int(f.arg.get("pid", 4242)),
                used_mib=int(f.arg.get("used_mib", 4096))), tenant=SYS_TENANT, key=f"fault:{f.at}:{f.kind}:{f.arg}"))])
        elif f.kind == "gpu_cleared":
            self.append([_by_owner(ctx.emit(NodeGpuCleared(node_id=f.arg["node"], gpu_index=int(f.arg["gpu"]),
                                                           returned=bool(f.arg.get("returned", False))),
                                  tenant=SYS_TENANT, key=f"fault:{f.at}:{f.kind}:{f.arg}"))])
        elif f.kind in ("cordon", "uncordon", "drain"):
            if f.arg not in self.sc.nodes:
                raise ScenarioError(f"fault {f.kind}: no node {f.arg!r}")
            payload = (NodeCordoned(node_id=str(f.arg), reason="scenario", drain=f.kind == "drain")
                       if f.kind != "uncordon" else NodeUncordoned(node_id=str(f.arg)))
            self.append([_by_owner(ctx.emit(payload, tenant=SYS_TENANT, key=f"fault:{f.at}:{f.kind}:{f.arg}"))])
        elif f.kind == "cancel":
            job_id = str(f.arg["job"])
            tenant = str(f.arg.get("tenant") or next((s.tenant for s in self.sc.submits if s.job_id == job_id), "acme"))
            self.append([Envelope(event_id=derive_id(f"sim:{self.sc.seed}:{job_id}", f"cancel:{f.at}"),
                                  type="cmd.cancel", occurred_at=utc(self.now), tenant=tenant, actor="sim",
                                  correlation_id=job_id, payload=CancelRequestedCmd(job_id=job_id))])
        elif f.kind == "load":
            job_id = str(f.arg["job"])
            tenant = str(f.arg.get("tenant") or next((s.tenant for s in self.sc.submits if s.job_id == job_id), "acme"))
            self.append([Envelope(event_id=derive_id(f"sim:{self.sc.seed}:{job_id}", f"load:{f.at}"),
                                  type="cmd.report_load", occurred_at=utc(self.now), tenant=tenant, actor="sim",
                                  correlation_id=job_id,
                                  payload=ReportLoadCmd(job_id=job_id, rps=f.arg["rps"], p99_ms=f.arg.get("p99_ms"),
                                                        window_s=f.arg.get("window_s") or 10.0))])
        elif f.kind == "restart":
            m = next((m for m in self.members if m.core.name == f.arg), None)
            if m is None:
                raise ScenarioError(f"fault restart: no service {f.arg!r}")
            self._restart(m)
        elif f.kind == "duplicate":
            self.duplicate_next.add(str(f.arg))
        elif f.kind == "delay":
            m = next((m for m in self.members if m.core.name == f.arg["service"]), None)
            if m is None:
                raise ScenarioError(f"fault delay: no service {f.arg['service']!r}")
            m.paused_until = self.now + float(f.arg["by"])

    # ------------------------------------------------------------ the loop

    def run(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Play the scenario to its end; `progress(submitted, of)` now and then (each simulated minute)."""
        for m in self.members:
            self.append(m.core.on_start(m.state, self.ctx(m.core.name)), m)
        submits, faults = list(self.sc.submits), list(self.sc.faults)
        end = EPOCH + self.sc.until if self.sc.until is not None else None
        for step in range(MAX_STEPS):
            if progress is not None and step % 60 == 0:
                progress(len(self.sc.submits) - len(submits), len(self.sc.submits))
            while submits and EPOCH + submits[0].at <= self.now:
                s = submits.pop(0)
                self.append([Envelope(event_id=derive_id(f"sim:{self.sc.seed}:{s.job_id}", "submit",
                                                         time_ms=int(self.now * 1000)),
                                      type="cmd.submit", occurred_at=utc(self.now), tenant=s.tenant, actor="sim",
                                      correlation_id=s.job_id, payload=SubmitRequested(job_id=s.job_id, spec=s.spec))])
            while faults and EPOCH + faults[0].at <= self.now:
                self.fault(faults.pop(0))
            self.deliver()
            self.tick()
            self.deliver()
            self.duplicate_next -= self.duplicated  # each duplicate fault doubles the next such event once
            self.duplicated.clear()
            if end is not None and self.now >= end:
                return
            if end is None and not submits and not faults and (
                    self.all_ended() or self.now - self.last_event_at > QUIET_S):
                return  # all ended, or nothing happened for a day: what still waits, waits for ever
            self.now = round(self.now + 1.0, 3)  # the cores' ticks are 0.2-1 s: a second is their grain
        raise ScenarioError(f"the simulation did not settle in {MAX_STEPS} steps")

    def all_ended(self) -> bool:
        return bool(self.submitted_jobs) and self.submitted_jobs <= self.ended_jobs

    # ------------------------------------------------------------ what it did

    def log_bytes(self) -> bytes:
        return b"".join(e.to_json() + b"\n" for e in self.log)

    def report(self) -> dict[str, Any]:
        figures = workload_figures(self.log, EPOCH, self.now)
        audited = audit(list(enumerate(self.log, start=1)), self.sc.config, pending_grace_s=self.rules.lease_s)
        return {
            "seed": self.sc.seed, "events": len(self.log), "sim_seconds": round(max(1.0, self.now - EPOCH), 3),
            "log_sha256": hashlib.sha256(self.log_bytes()).hexdigest(),
            **figures,
            "resumes": sum(1 for e in self.log if e.type == "job.resume_requested"),
            "nodes_lost": sum(1 for e in self.log if e.type == "node.lost"),
            "nodes_provisioned": sum(1 for e in self.log if e.type == "node.provision_requested"),
            "nodes_removed": sum(1 for e in self.log if e.type == "node.deregistered"),
            "scale_events": sum(1 for e in self.log if e.type == "job.scaled"),
            "redeliveries": self.redeliveries,
            "chaos": dict(self.chaos_faults),
            "audit": {"ok": audited.ok, "violations": [v.__dict__ for v in audited.violations[:20]]},
        }


CURVE_SLICES = 20


def workload_figures(log: Sequence[Envelope], start: float, end: float) -> dict[str, Any]:
    """What the workload got, from a log (a simulated one, or a real mesh's history): jobs by
    status, the wait from submit to first placement (mean, p50, p95), the jobs that never ran,
    the GPU allocation over [start, end] (every replica from its placement to its exit, or the
    end) against the GPUs the registered nodes had, the same per twentieth of the span (the
    curve), and the preemptions. The dynamic placement benchmark's figures."""
    first_submit: dict[str, float] = {}
    first_place: dict[str, float] = {}
    status: dict[str, str] = {}
    held: list[tuple[float, float, int]] = []  # (from, to, GPUs): a replica's allocation
    running_gpus: dict[tuple[str, int], tuple[float, int]] = {}
    up: dict[str, tuple[float, int]] = {}
    nodes_up: list[tuple[float, float, int]] = []  # (from, to, GPUs): a node's life
    for e in log:
        t = e.occurred_at.timestamp()
        p = e.payload
        if isinstance(p, NodeRegistered) and p.node_id not in up:
            up[p.node_id] = (t, len([g for g in p.inventory.gpus if not g.mig_enabled]))
        elif e.type == "node.deregistered" and e.node_id in up:
            since, n = up.pop(e.node_id)
            nodes_up.append((since, t, n))
        j = e.job_id
        if j is None:
            continue
        if e.type == "job.submitted":
            first_submit.setdefault(j, t)
            status[j] = "pending"
        elif e.type == "job.placed":
            first_place.setdefault(j, t)
            status[j] = "running"
            for a in getattr(p, "allocations", ()):
                running_gpus[(j, a.replica)] = (t, len(a.gpu_indices))
        elif e.type == "job.exited":
            began = running_gpus.pop((j, getattr(p, "replica", 0)), None)
            if began is not None:
                held.append((began[0], t, began[1]))
        elif e.type in RUN_ENDED_JOB_TYPES:
            status[j] = e.type.removeprefix("job.")
    held += [(since, end, n) for since, n in running_gpus.values()]
    nodes_up += [(since, end, n) for since, n in up.values()]
    waits = sorted(first_place[j] - first_submit[j] for j in first_place if j in first_submit)
    by_status: dict[str, int] = {}
    for st in status.values():
        by_status[st] = by_status.get(st, 0) + 1
    span = max(1e-9, end - start)
    width = span / CURVE_SLICES

    def per_slice(intervals: list[tuple[float, float, int]]) -> list[float]:
        out = [0.0] * CURVE_SLICES
        for lo, hi, n in intervals:
            lo, hi = max(lo, start), min(hi, end)
            k = int((lo - start) / width) if hi > lo else CURVE_SLICES
            while k < CURVE_SLICES and hi > lo:
                edge = min(hi, start + (k + 1) * width)
                out[k] += (edge - lo) * n
                lo, k = edge, k + 1
        return out

    alloc, cap = per_slice(held), per_slice(nodes_up)
    return {
        "jobs": by_status,
        "wait_mean_s": round(statistics.mean(waits), 3) if waits else None,
        "wait_p50_s": round(statistics.median(waits), 3) if waits else None,
        "wait_p95_s": round(waits[min(len(waits) - 1, int(0.95 * len(waits)))], 3) if waits else None,
        "never_ran": sum(1 for j in first_submit if j not in first_place),
        "gpu_allocation_pct": round(100 * sum(alloc) / sum(cap), 2) if sum(cap) else 0.0,
        "gpu_allocation_curve": [round(100 * a / c, 1) if c else 0.0 for a, c in zip(alloc, cap, strict=True)],
        "gpu_hours_available": round(sum(cap) / 3600, 2),
        "preemptions": sum(1 for e in log if e.type == "job.preemption_requested"),
    }


def run_file(path: str | Path, seed: int | None = None,
             progress: Callable[[int, int], None] | None = None) -> Simulation:
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not YAML ({exc})") from None
    sim = Simulation(load_scenario(doc, seed))
    sim.run(progress)
    return sim


# ---------------------------------------------------------------- what-if: the recorded workload again


def scenario_from_log(history: list[tuple[int, Envelope]], config: ClusterConfig,
                      nodes_override: dict[str, NodeInventory] | None = None) -> Scenario:
    """The recorded workload as a scenario: the nodes as registered, each submit at its time with
    the run time it really had (or its sim duration if it never ran), each lost node lost again."""
    from gpufleet.shared.contract.events import JobExited, NodeLost

    if not history:
        raise ScenarioError("the log is empty: nothing to replay")
    t0 = min(e.occurred_at.timestamp() for _, e in history)
    nodes: dict[str, NodeInventory] = {}
    ran: dict[str, dict[int, tuple[float, int]]] = {}  # job -> attempt -> (runtime, exit code)
    started_at: dict[str, float] = {}
    head = max(e.occurred_at.timestamp() for _, e in history)
    accepted: set[str] = set()
    submits: list[Submit] = []
    faults: list[Fault] = []
    # the autoscaler's own work is not replayed: it runs again (its replica submits and cancels,
    # the pool nodes it brought up) under the config being tried
    pooled = {e.payload.node_id for _, e in history if e.type == "node.provision_requested"}  # type: ignore[union-attr]

    def by_autoscaler(e: Envelope) -> bool:
        return e.actor.split("/", 1)[0] == "autoscaler"

    for _, e in history:
        p = e.payload
        if isinstance(p, NodeRegistered):
            if p.node_id not in pooled:
                nodes.setdefault(p.node_id, p.inventory.model_copy(update={"driver": "sim"}))
        elif isinstance(p, ReportLoadCmd):
            faults.append(Fault(e.occurred_at.timestamp() - t0, "load", {
                "job": p.job_id, "tenant": e.tenant, "rps": p.rps, "p99_ms": p.p99_ms, "window_s": p.window_s}))
        elif isinstance(p, JobExited) and p.reason in ("completed", "error", "timeout"):
            ran.setdefault(p.job_id, {}).setdefault(p.attempt, (p.runtime_s, p.exit_code))  # each run as it ended
        elif e.type == "job.started" and e.job_id:
            started_at.setdefault(e.job_id, e.occurred_at.timestamp())
        elif e.type == "job.submitted" and e.job_id:
            accepted.add(e.job_id)
        elif isinstance(p, NodeLost):
            faults.append(Fault(e.occurred_at.timestamp() - t0, "node_lost", p.node_id))
        elif isinstance(p, NodeGpuUnhealthy | NodeGpuZombieDetected | NodeGpuCleared) and e.actor != "placer":
            # what the hardware did, as it did (a zombie of a job's own making is not re-made in sim)
            kind = {"node.gpu_unhealthy": "gpu_unhealthy", "node.gpu_zombie_detected": "zombie",
                    "node.gpu_cleared": "gpu_cleared"}[p.type]
            arg: dict[str, Any] = {"node": p.node_id, "gpu": p.gpu_index}
            if isinstance(p, NodeGpuUnhealthy):
                arg["reason"] = p.reason
            elif isinstance(p, NodeGpuZombieDetected):
                arg.update(pid=p.pid, used_mib=p.used_mib)
            elif p.returned:
                arg["returned"] = True
            faults.append(Fault(e.occurred_at.timestamp() - t0, kind, arg))
        elif isinstance(p, NodeCordoned | NodeUncordoned):
            kind = ("uncordon" if isinstance(p, NodeUncordoned) else "drain" if p.drain else "cordon")
            faults.append(Fault(e.occurred_at.timestamp() - t0, kind, p.node_id))
        elif isinstance(p, CancelRequestedCmd) and not by_autoscaler(e):
            faults.append(Fault(e.occurred_at.timestamp() - t0, "cancel", {"job": p.job_id, "tenant": e.tenant}))
    for _, e in history:
        p = e.payload
        if isinstance(p, SubmitRequested) and p.job_id in accepted and not by_autoscaler(e):
            spec = json.loads(json.dumps(p.spec))
            if p.job_id in ran:
                runs = ran[p.job_id]
                runtime, code = runs[max(runs)]  # the last run: later attempts play it
                sim = spec.setdefault("sim", {})
                sim["duration"], sim["exitCode"] = max(0.001, runtime), code
                if len(runs) > 1 or min(runs) > 1:
                    # the runs before it, each as it ended (one interrupted, by a lost node or a
                    # preemption, plays the last run: whether it is interrupted again is the what-if's)
                    sim["runs"] = [{"duration": max(0.001, runs.get(a, (runtime, code))[0]),
                                    "exitCode": runs.get(a, (runtime, code))[1]} for a in range(1, max(runs))]
                if code == 124:  # it ran past its max runtime: so it does again
                    spec["maxRuntime"] = max(0.001, runtime)
                    sim["exitCode"] = 0
                    sim["duration"] = runtime * 2 + 1
            elif p.job_id in started_at:  # still running at the head: it runs at least that long
                spec.setdefault("sim", {})["duration"] = max(0.001, head - started_at[p.job_id])
            submits.append(Submit(round(e.occurred_at.timestamp() - t0, 3), p.job_id, e.tenant, spec))
    if nodes_override:
        nodes = nodes_override
    # (a fault on a node not in the cluster tried, or on a pool node, which the autoscaler may not make again, is dropped)
    faults = [f for f in faults if f.kind in ("cancel", "load")
              or (f.arg["node"] if isinstance(f.arg, dict) else f.arg) in nodes]
    faults.sort(key=lambda f: f.at)  # (stable: recorded order within one instant)
    if not nodes:
        raise ScenarioError("no node registered in the log")
    return Scenario(nodes, submits, faults, config, None, 0)


def what_if(history: list[tuple[int, Envelope]], base: ClusterConfig, other: ClusterConfig,
            other_nodes: dict[str, NodeInventory] | None = None,
            progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """The recorded workload under the recorded config and under `other` (and, if given, on
    another cluster: `other_nodes`), side by side, beside the same figures read off the log itself
    (`logged`: what really happened, against which the recorded config's run can be judged);
    `progress(done, of)` over both runs' submits."""
    runs = {}
    ends: dict[str, dict[str, tuple[str, float]]] = {}
    for i, (name, cfg, nodes) in enumerate((("recorded", base, None), ("what_if", other, other_nodes))):
        sim = Simulation(scenario_from_log(history, cfg, nodes))
        sim.run(None if progress is None else _offset(progress, i))
        runs[name] = sim.report()
        ends[name] = {e.job_id: (e.type.removeprefix("job."), e.occurred_at.timestamp()) for e in sim.log
                      if e.job_id and e.type in RUN_ENDED_JOB_TYPES}
    a, b = runs["recorded"], runs["what_if"]
    common = set(ends["recorded"]) & set(ends["what_if"])
    earlier = sorted(j for j in common if ends["what_if"][j][1] < ends["recorded"][j][1] - 1)
    later = sorted(j for j in common if ends["what_if"][j][1] > ends["recorded"][j][1] + 1)
    failed = sorted(j for j in ends["what_if"] if ends["what_if"][j][0] != "succeeded"
                    and ends["recorded"].get(j, ("", 0))[0] == "succeeded")

    def delta(k: str) -> float | None:
        return round(b[k] - a[k], 3) if a.get(k) is not None and b.get(k) is not None else None

    envs = [e for _, e in history]
    logged = workload_figures(envs, min(e.occurred_at.timestamp() for e in envs),
                              max(e.occurred_at.timestamp() for e in envs))
    return {"logged": logged, "recorded": a, "what_if": b,
            "delta": {k: delta(k) for k in ("wait_mean_s", "wait_p50_s", "wait_p95_s", "never_ran",
                                            "gpu_allocation_pct", "preemptions")},
            "finished_earlier": len(earlier), "finished_later": len(later),
            "would_have_failed": failed, "jobs_compared": len(common)}


def _offset(progress: Callable[[int, int], None], run: int) -> Callable[[int, int], None]:
    """The progress of the `run`-th of two runs, as one bar over both."""
    return lambda done, of: progress(run * of + done, 2 * of)


def what_if_file(path: str | Path) -> tuple[ClusterConfig, dict[str, NodeInventory] | None]:
    """A what-if file: a cluster config, optionally with `nodes:` (scenario syntax) for another cluster."""
    doc = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(doc, dict):
        raise ScenarioError(f"{path}: a mapping (a cluster config, and optionally nodes:)")
    nodes_doc = doc.pop("nodes", None)
    nodes = load_scenario({"nodes": nodes_doc}).nodes if nodes_doc else None
    return parse_config(doc), nodes
