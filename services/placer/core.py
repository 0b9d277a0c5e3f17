"""Placer: give every replica of a job a node and exact GPUs, all or nothing, in one CAS write.

folds: nodes (inventory, health), allocations, jobs with reserved quota
decides: job.placed (compare-and-set on `fleet.evt.*.job.*.placed`) | job.unschedulable

Nodes are indexed by (GPU model, free GPU count), so a decision looks at a few buckets, not
at every node: best fit = the smallest free count that still fits. (Topology, fragmentation,
backfill and the plugin framework come with the placer issue.)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from gpufleet.shared.events import (
    Envelope,
    JobCancelled,
    JobCancelRequested,
    JobExited,
    JobFailed,
    JobPlaced,
    JobPreempted,
    JobPreemptionRequested,
    JobQuotaReserved,
    JobSubmitted,
    JobUnschedulable,
    NodeCordoned,
    NodeInventory,
    NodeLost,
    NodeRegistered,
    NodeUncordoned,
    Reason,
    ReplicaAllocation,
)
from gpufleet.shared.runtime import BaseCore, Ctx
from gpufleet.shared.spec import JobSpec

CPU_ONLY = ""  # the model key of nodes without GPUs
SCAN_NODES_MAX = 512  # per replica, per bucket: bound the work of one decision
RETRY_PENDING_MAX = 64  # pending jobs retried when capacity frees


@dataclass
class NodeSlot:
    node_id: str
    model: str
    gpus_total: int
    free_gpus: list[int]
    cpu_milli_free: int
    memory_mib_free: int
    healthy: bool = True
    cpu_milli_total: int = 0
    memory_mib_total: int = 0
    # MIG: GPUs in MIG mode are not handed out whole; their instances are, by profile
    mig_free: dict[str, list[str]] = field(default_factory=dict)  # profile -> free instance UUIDs
    mig_total: dict[str, int] = field(default_factory=dict)  # profile -> instances
    mig_profile: dict[str, str] = field(default_factory=dict)  # instance UUID -> profile


# what one decision's earlier plans took on a node: free GPUs, CPU, memory, MIG instances taken
Scratch = dict[str, tuple[list[int], int, int, frozenset[str]]]


@dataclass
class PlacerState:
    nodes: dict[str, NodeSlot] = field(default_factory=dict)
    # model -> free GPU count -> node ids (dicts as ordered sets: deterministic iteration)
    index: dict[str, dict[int, dict[str, None]]] = field(default_factory=dict)
    mig_nodes: dict[str, None] = field(default_factory=dict)  # nodes with MIG instances (ordered set)
    specs: dict[str, JobSpec] = field(default_factory=dict)
    pending: OrderedDict[str, None] = field(default_factory=OrderedDict)
    allocations: dict[str, tuple[ReplicaAllocation, ...]] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)
    unschedulable_said: dict[str, str] = field(default_factory=dict)


def _unindex(state: PlacerState, node: NodeSlot) -> None:
    bucket = state.index.get(node.model, {}).get(len(node.free_gpus))
    if bucket is not None:
        bucket.pop(node.node_id, None)


def _reindex(state: PlacerState, node: NodeSlot) -> None:
    if node.healthy:
        state.index.setdefault(node.model, {}).setdefault(len(node.free_gpus), {})[node.node_id] = None


def _take(state: PlacerState, alloc: ReplicaAllocation) -> None:
    node = state.nodes.get(alloc.node_id)
    if node is None:
        return
    _unindex(state, node)
    taken = set(alloc.gpu_indices)
    node.free_gpus = [g for g in node.free_gpus if g not in taken]
    node.cpu_milli_free -= alloc.cpu_milli
    node.memory_mib_free -= alloc.memory_mib
    _take_mig(node, alloc.mig_devices)
    _reindex(state, node)


def _take_mig(node: NodeSlot, uuids: tuple[str, ...]) -> None:
    for uuid in uuids:
        profile = node.mig_profile.get(uuid)
        if profile is not None and uuid in node.mig_free[profile]:
            node.mig_free[profile].remove(uuid)


def _give_back(state: PlacerState, alloc: ReplicaAllocation) -> None:
    node = state.nodes.get(alloc.node_id)
    if node is None:
        return
    _unindex(state, node)
    node.free_gpus = sorted(set(node.free_gpus) | set(alloc.gpu_indices))
    node.cpu_milli_free += alloc.cpu_milli
    node.memory_mib_free += alloc.memory_mib
    for uuid in alloc.mig_devices:
        profile = node.mig_profile.get(uuid)
        if profile is not None and uuid not in node.mig_free[profile]:
            node.mig_free[profile].append(uuid)
    _reindex(state, node)


def _register(state: PlacerState, node_id: str, inv: NodeInventory) -> None:
    old = state.nodes.get(node_id)
    if old is not None:
        _unindex(state, old)
    models = {g.model for g in inv.gpus}
    whole = [g.index for g in inv.gpus if not g.mig_enabled]
    node = NodeSlot(
        node_id=node_id, model=(sorted(models)[0] if models else CPU_ONLY), gpus_total=len(whole),
        free_gpus=whole, cpu_milli_free=inv.cpu_milli, memory_mib_free=inv.memory_mib,
        cpu_milli_total=inv.cpu_milli, memory_mib_total=inv.memory_mib,
    )
    for g in inv.gpus:
        if g.mig_enabled:
            for m in g.mig_devices:
                node.mig_free.setdefault(m.profile, []).append(m.uuid)
                node.mig_total[m.profile] = node.mig_total.get(m.profile, 0) + 1
                node.mig_profile[m.uuid] = m.profile
    state.nodes[node_id] = node
    if node.mig_total:
        state.mig_nodes[node_id] = None
    else:
        state.mig_nodes.pop(node_id, None)
    for allocs in state.allocations.values():  # re-registration keeps what is already held
        for a in allocs:
            if a.node_id == node_id:
                node.free_gpus = [g for g in node.free_gpus if g not in a.gpu_indices]
                node.cpu_milli_free -= a.cpu_milli
                node.memory_mib_free -= a.memory_mib
                _take_mig(node, a.mig_devices)
    _reindex(state, node)


class PlacerCore(BaseCore[PlacerState]):
    name = "placer"
    cas_subject = "fleet.evt.*.job.*.placed"
    subjects = (
        "fleet.evt.sys.node.*.*",
        "fleet.evt.*.job.*.submitted", "fleet.evt.*.job.*.quota_reserved", "fleet.evt.*.job.*.placed",
        "fleet.evt.*.job.*.unschedulable", "fleet.evt.*.job.*.exited", "fleet.evt.*.job.*.cancel_requested",
        "fleet.evt.*.job.*.preemption_requested",
        "fleet.evt.*.job.*.succeeded", "fleet.evt.*.job.*.failed", "fleet.evt.*.job.*.cancelled",
        "fleet.evt.*.job.*.preempted",
    )

    def initial_state(self) -> PlacerState:
        return PlacerState()

    # ------------------------------------------------------------ evolve

    def evolve(self, state: PlacerState, env: Envelope) -> PlacerState:
        t = env.type
        p = env.payload
        if isinstance(p, NodeRegistered):
            _register(state, p.node_id, p.inventory)
            return state
        if isinstance(p, NodeLost | NodeCordoned):
            node = state.nodes.get(p.node_id)
            if node is not None:
                _unindex(state, node)
                node.healthy = False
            return state
        if isinstance(p, NodeUncordoned):
            node = state.nodes.get(p.node_id)
            if node is not None and not node.healthy:
                node.healthy = True
                _reindex(state, node)
            return state
        job_id = env.job_id
        if job_id is None:
            return state
        if isinstance(p, JobSubmitted):
            state.specs[job_id] = p.spec
        elif isinstance(p, JobQuotaReserved):
            if job_id not in state.ended and job_id not in state.allocations:
                state.pending[job_id] = None
                flavor = p.flavor
                spec = state.specs.get(job_id)
                if flavor and spec is not None and spec.resources.gpu_models != (flavor,):
                    # quota was taken from this GPU model: place on it, or quota and placement disagree
                    state.specs[job_id] = spec.model_copy(
                        update={"resources": spec.resources.model_copy(update={"gpu_models": (flavor,)})})
        elif isinstance(p, JobUnschedulable):
            if job_id in state.pending:
                state.unschedulable_said[job_id] = "; ".join(r.message for r in p.reasons)
        elif isinstance(p, JobPlaced):
            if job_id in state.ended or job_id in state.allocations:
                return state
            state.pending.pop(job_id, None)
            state.unschedulable_said.pop(job_id, None)
            allocs = p.allocations
            state.allocations[job_id] = allocs
            for a in allocs:
                _take(state, a)
        elif t in ("job.exited", "job.succeeded", "job.failed", "job.cancelled", "job.preempted"):
            if t != "job.exited":
                state.ended.add(job_id)
                state.specs.pop(job_id, None)
                state.pending.pop(job_id, None)
                state.unschedulable_said.pop(job_id, None)
            held = state.allocations.pop(job_id, ())
            # one replica's exit frees that replica's resources only: the rest of a gang still runs
            keep = tuple(a for a in held if a.replica != p.replica) if isinstance(p, JobExited) else ()
            for a in held:
                if a not in keep:
                    _give_back(state, a)
            if keep:
                state.allocations[job_id] = keep
        return state

    # ------------------------------------------------------------ decide

    def decide(self, state: PlacerState, env: Envelope, ctx: Ctx) -> list[Envelope]:
        t, p = env.type, env.payload
        if isinstance(p, JobCancelRequested):
            job_id = p.job_id
            if job_id in state.specs and job_id not in state.allocations and job_id not in state.ended:
                # not placed (and, placements being ours alone, it never will be): cancelled here
                return [ctx.emit(JobCancelled(job_id=job_id, reason=p.reason), key="cancelled")]
            return []  # placed: the executor stops it, the guardian ends it
        if isinstance(p, JobPreemptionRequested):
            job_id = p.job_id
            if job_id in state.specs and job_id not in state.allocations and job_id not in state.ended:
                return [ctx.emit(JobPreempted(job_id=job_id, reason=p.reason), key="preempted")]
            return []
        if isinstance(p, JobQuotaReserved):
            job_id = p.job_id
            if job_id in state.pending:
                return self._try(state, job_id, ctx, {}, say_unschedulable=True)
            return []
        if t in ("job.exited", "job.succeeded", "job.failed", "job.cancelled", "job.preempted",
                 "node.registered", "node.uncordoned"):
            out: list[Envelope] = []
            scratch: Scratch = {}  # what earlier plans here took
            for job_id in list(state.pending)[:RETRY_PENDING_MAX]:
                out.extend(self._try(state, job_id, ctx, scratch, say_unschedulable=False))
            return out
        return []

    def _try(self, state: PlacerState, job_id: str, ctx: Ctx, scratch: Scratch,
             say_unschedulable: bool) -> list[Envelope]:
        spec = state.specs.get(job_id)
        if spec is None:
            return []
        allocs, models = self.plan(state, spec, scratch)
        if allocs is not None:
            # The runtime evolves this output at once, so the next decision sees the GPUs taken.
            return [ctx.emit(JobPlaced(job_id=job_id, allocations=allocs), tenant=spec.tenant, key=f"placed:{job_id}")]
        if not say_unschedulable:
            return []  # a retry that still does not fit: the reason was said when it first failed
        if state.nodes and not self.ever_fits(state, spec, models):
            # Quota and placement must agree: a job no healthy node set could ever hold must not
            # keep its quota (and block others) while it waits; it fails, and says why.
            return [ctx.emit(JobFailed(job_id=job_id, reason=Reason(code="never_fits", message=(
                f"{spec.replicas} x {_ask(spec)} ({', '.join(models) or 'CPU'}) cannot fit even on the "
                f"empty cluster of {sum(n.healthy for n in state.nodes.values())} healthy nodes"))),
                tenant=spec.tenant, key=f"never:{job_id}")]
        reasons = self._reasons(state, spec, models)
        filtered = self._filtered(state, spec, models)
        message = "; ".join(r.message for r in reasons)
        if state.unschedulable_said.get(job_id) == message:
            return []
        return [ctx.emit(JobUnschedulable(
            job_id=job_id, reasons=tuple(reasons), filtered=filtered, nodes_total=len(state.nodes),
        ), tenant=spec.tenant, key=f"unsched:{job_id}:{len(state.nodes)}:{message}")]

    @staticmethod
    def ever_fits(state: PlacerState, spec: JobSpec, models: list[str]) -> bool:
        """Whether all replicas would fit if every healthy node were empty."""
        r = spec.resources
        room = 0
        for node in state.nodes.values():
            if not node.healthy or ((r.gpu or r.mig) and node.model not in models):
                continue
            per = [node.gpus_total // r.gpu if r.gpu else spec.replicas,
                   node.cpu_milli_total // r.cpu_milli if r.cpu_milli else spec.replicas,
                   node.memory_mib_total // r.memory_mib if r.memory_mib else spec.replicas]
            per += [node.mig_total.get(profile, 0) // n for profile, n in r.mig.items()]
            room += max(0, min(per))
            if room >= spec.replicas:
                return True
        return False

    def plan(self, state: PlacerState, spec: JobSpec, scratch: Scratch | None = None,
             ) -> tuple[tuple[ReplicaAllocation, ...] | None, list[str]]:
        """All replicas or nothing, planned on `scratch`: the touched nodes' free resources.

        On success `scratch` holds what this plan took (so several plans in one decision stack);
        on failure it is left as it was.
        """
        outer = scratch if scratch is not None else {}
        scratch = dict(outer)
        r = spec.resources
        gpu_models = sorted(m for m in state.index if m != CPU_ONLY)
        if r.mig:
            models = list(r.gpu_models) if r.gpu_models else sorted({state.nodes[n].model for n in state.mig_nodes})
        elif r.gpu:
            models = list(r.gpu_models) if r.gpu_models else gpu_models
        else:
            models = [CPU_ONLY, *gpu_models]  # CPU-only nodes first, GPU nodes if need be
        allocs: list[ReplicaAllocation] = []
        for replica in range(spec.replicas):
            if r.mig:
                chosen = self._pick_mig(state, models, r.mig, r.cpu_milli, r.memory_mib, scratch)
            else:
                chosen = self._pick(state, models, r.gpu, r.cpu_milli, r.memory_mib, r.gpu_memory_mib, scratch)
            if chosen is None:
                return None, models
            node_id, gpus, mig = chosen
            free, cpu, mem, mig_taken = scratch.get(node_id) or self._view(state.nodes[node_id])
            scratch[node_id] = ([g for g in free if g not in gpus], cpu - r.cpu_milli, mem - r.memory_mib,
                                mig_taken | frozenset(mig))
            allocs.append(ReplicaAllocation(
                replica=replica, node_id=node_id, gpu_indices=tuple(gpus), cpu_milli=r.cpu_milli,
                memory_mib=r.memory_mib, mig_devices=tuple(mig),
            ))
        outer.update(scratch)
        return tuple(allocs), models

    @staticmethod
    def _view(node: NodeSlot) -> tuple[list[int], int, int, frozenset[str]]:
        return node.free_gpus, node.cpu_milli_free, node.memory_mib_free, frozenset()

    def _pick(self, state: PlacerState, models: list[str], gpus: int, cpu: int, mem: int, gpu_mem: int,
              scratch: Scratch) -> tuple[str, list[int], list[str]] | None:
        # nodes this decision already touched first (packs, keeps a gang together), then best fit
        for node_id, (free, c, m, _) in scratch.items():
            if len(free) >= gpus and c >= cpu and m >= mem and state.nodes[node_id].model in models:
                return node_id, free[:gpus], []
        for model in models:
            buckets = state.index.get(model)
            if not buckets:
                continue
            for count in sorted(k for k in buckets if k >= gpus):
                scanned = 0
                for node_id in buckets[count]:
                    if node_id in scratch:
                        continue
                    node = state.nodes[node_id]
                    scanned += 1
                    if scanned > SCAN_NODES_MAX:
                        break
                    if node.cpu_milli_free >= cpu and node.memory_mib_free >= mem and (
                        not gpu_mem or self._gpu_mem_ok(node, gpu_mem)
                    ):
                        return node_id, node.free_gpus[:gpus], []
        return None

    @staticmethod
    def _pick_mig(state: PlacerState, models: list[str], mig: dict[str, int], cpu: int, mem: int,
                  scratch: Scratch) -> tuple[str, list[int], list[str]] | None:
        """A node with the MIG instances one replica asks for: best fit (the fewest free instances
        of those profiles left over), nodes this decision touched first."""
        best: tuple[int, str, list[str]] | None = None
        for node_id in state.mig_nodes:
            node = state.nodes[node_id]
            if not node.healthy or node.model not in models:
                continue
            _, c, m, taken = scratch.get(node_id) or (None, node.cpu_milli_free, node.memory_mib_free, frozenset())
            if c < cpu or m < mem:
                continue
            chosen: list[str] = []
            left = 0
            for profile, n in mig.items():
                free = [u for u in node.mig_free.get(profile, ()) if u not in taken]
                if len(free) < n:
                    break
                chosen += free[:n]
                left += len(free) - n
            else:
                rank = (0 if node_id in scratch else 1, left)
                if best is None or rank < (0 if best[1] in scratch else 1, best[0]):
                    best = (left, node_id, chosen)
        return (best[1], [], best[2]) if best is not None else None

    @staticmethod
    def _gpu_mem_ok(node: NodeSlot, gpu_mem: int) -> bool:
        return True  # per-GPU memory is checked against the model's inventory in the placer issue

    def _filtered(self, state: PlacerState, spec: JobSpec, models: list[str]) -> dict[str, int]:
        r = spec.resources
        counts = {"unhealthy": 0, "gpu_model": 0, "gpu_count": 0, "mig": 0, "cpu": 0, "memory": 0}
        for node in state.nodes.values():
            if not node.healthy:
                counts["unhealthy"] += 1
            elif (r.gpu or r.mig) and node.model not in models:
                counts["gpu_model"] += 1
            elif len(node.free_gpus) < r.gpu:
                counts["gpu_count"] += 1
            elif any(len(node.mig_free.get(profile, ())) < n for profile, n in r.mig.items()):
                counts["mig"] += 1
            elif node.cpu_milli_free < r.cpu_milli:
                counts["cpu"] += 1
            elif node.memory_mib_free < r.memory_mib:
                counts["memory"] += 1
        return {k: v for k, v in counts.items() if v}

    def _reasons(self, state: PlacerState, spec: JobSpec, models: list[str]) -> list[Reason]:
        if not state.nodes:
            return [Reason(code="no_nodes", message="no nodes registered")]
        filtered = self._filtered(state, spec, models)
        parts = ", ".join(f"{v} {k}" for k, v in filtered.items()) or "replicas do not fit together"
        return [Reason(
            code="no_fit",
            message=f"{spec.replicas} x {_ask(spec)}: no fit on {len(state.nodes)} nodes ({parts})",
        )]


def _ask(spec: JobSpec) -> str:
    """What one replica asks for, in words: `8 GPU`, `2 MIG 1g.10gb`."""
    r = spec.resources
    if r.mig:
        return ", ".join(f"{n} MIG {profile}" for profile, n in r.mig.items())
    return f"{r.gpu} GPU"
