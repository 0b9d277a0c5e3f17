"""The placement framework: filter plugins, score plugins with weights in a profile (the
kube-scheduler framework's shape), on a plain model of nodes and of what one replica asks.

    profile = PROFILES["fgd"]             # or bestfit, packing, topology, ...
    pick = schedule(nodes, ask, profile)  # -> Pick(node, positions, score) | Unfit(counts per filter)

Outcomes are data: a node a filter removes is counted under the filter's name, so
`job.unschedulable` can say "37 cpu, 12 gpu_model". The placer core, `gpufleet bench placement`
and the tests all run this same code.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from gpufleet.shared.contract.spec import TOPOLOGY_LEVELS

from .frag import MILLI, FragKey, TaskShape, Typical, fits_gpus, memo_frag

# ---------------------------------------------------------------- the model


@dataclass(slots=True)
class Node:
    """A node as the placer sees it. GPUs are by position: `left[i]` is the milli-GPU free on the
    GPU with device index `gpu_ids[i]` (1000: free; GPUs in MIG mode are not here)."""

    node_id: str
    model: str = ""
    gpu_ids: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    cpu_left: int = 0
    mem_left: int = 0
    cpu_total: int = 0
    mem_total: int = 0
    gpu_mem_mib: int = 0  # the least memory of its GPUs
    island: list[int] = field(default_factory=list)  # NVLink island per position
    switch: list[int] = field(default_factory=list)  # PCIe switch per position
    numa: list[int] = field(default_factory=list)  # NUMA node per position
    labels: dict[str, str] = field(default_factory=dict)
    taints: frozenset[str] = frozenset()
    healthy: bool = True
    datasets: frozenset[str] = frozenset()  # datasets in the node's local cache
    version: int = 0  # bumped on every change: score caches key on it

    @property
    def gpus_total(self) -> int:
        return len(self.left)

    @property
    def free_whole(self) -> int:
        return sum(1 for x in self.left if x >= MILLI)

    @property
    def free_gpus(self) -> list[int]:
        """The device indices of the GPUs with nothing taken."""
        return [g for g, x in zip(self.gpu_ids, self.left, strict=True) if x >= MILLI]

    def copy(self) -> Node:
        """A copy to plan on (lists copied; the rest shared, as it does not change in a plan)."""
        return dataclasses.replace(self, left=list(self.left))

    @property
    def rack(self) -> str:
        return self.labels.get("rack", "")

    @property
    def leaf(self) -> str:
        return self.labels.get("leaf", self.labels.get("rack", ""))

    def domain(self, level: str) -> str:
        """Its domain at a topology level (`node`, `leaf`, `rack`, `spine`); '' when unlabelled."""
        if level == "node":
            return self.node_id
        if level == "leaf":
            return self.leaf
        return self.labels.get(level, "")

    def take(self, positions: Sequence[int], milli: int, cpu: int, mem: int) -> None:
        for p in positions:
            self.left[p] -= milli
        self.cpu_left -= cpu
        self.mem_left -= mem
        self.version += 1

    def give(self, positions: Sequence[int], milli: int, cpu: int, mem: int) -> None:
        for p in positions:
            self.left[p] = min(MILLI, self.left[p] + milli)
        self.cpu_left += cpu
        self.mem_left += mem
        self.version += 1


@dataclass(frozen=True, slots=True)
class Ask:
    """What one replica asks of one node."""

    cpu: int = 0
    mem: int = 0
    gpus: int = 0
    milli: int = MILLI  # of each GPU: < 1000 is a share of one GPU
    models: frozenset[str] = frozenset()  # allowed GPU models; empty: any
    gpu_mem: int = 0  # MiB per GPU, at least
    selector: tuple[tuple[str, str], ...] = ()  # node labels it requires
    tolerations: frozenset[str] = frozenset()  # taints it tolerates
    dataset: str | None = None  # prefers nodes that have it cached

    @property
    def shape(self) -> TaskShape:
        return TaskShape(self.cpu, self.gpus, self.milli if self.gpus else 0, self.models)

    @property
    def gpu_milli_total(self) -> int:
        return self.gpus * self.milli


@dataclass(frozen=True, slots=True)
class Pick:
    node: Node
    positions: tuple[int, ...]  # GPU positions on the node
    score: float


@dataclass(frozen=True, slots=True)
class Unfit:
    filtered: dict[str, int]  # filter name -> nodes it removed (the first filter that failed)


# ---------------------------------------------------------------- filters

FilterFn = Callable[[Node, Ask], bool]


def _healthy(n: Node, a: Ask) -> bool:
    return n.healthy


def _taints(n: Node, a: Ask) -> bool:
    return not n.taints or n.taints <= a.tolerations


def _labels(n: Node, a: Ask) -> bool:
    return all(n.labels.get(k) == v for k, v in a.selector)


def _gpu_model(n: Node, a: Ask) -> bool:
    return not a.gpus or (bool(n.left) and (not a.models or n.model in a.models))


def _cpu(n: Node, a: Ask) -> bool:
    return n.cpu_left >= a.cpu


def _memory(n: Node, a: Ask) -> bool:
    return n.mem_left >= a.mem


def _gpu(n: Node, a: Ask) -> bool:
    return fits_gpus(n.left, a.gpus, a.milli) and (not a.gpu_mem or n.gpu_mem_mib >= a.gpu_mem)


# in order: a node is counted under the first filter that removes it
FILTERS: tuple[tuple[str, FilterFn], ...] = (
    ("unhealthy", _healthy), ("taints", _taints), ("labels", _labels), ("gpu_model", _gpu_model),
    ("cpu", _cpu), ("memory", _memory), ("gpu_count", _gpu),
)


# what a node must be for a job, whatever is free on it (the never-fits check uses these)
NODE_CONSTRAINTS: tuple[FilterFn, ...] = (_healthy, _taints, _labels)
# what a node's state cannot change: a lost node or a quarantined GPU may come back, these do not
LASTING_CONSTRAINTS: tuple[FilterFn, ...] = (_taints, _labels)


def feasible(n: Node, a: Ask) -> bool:
    """All filters at once (the hot path; `why_not` says which one failed)."""
    return (n.healthy and n.cpu_left >= a.cpu and n.mem_left >= a.mem and _gpu_model(n, a)
            and fits_gpus(n.left, a.gpus, a.milli) and (not n.taints or n.taints <= a.tolerations)
            and (not a.selector or _labels(n, a)) and (not a.gpu_mem or n.gpu_mem_mib >= a.gpu_mem))


def why_not(nodes: Iterable[Node], a: Ask) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in nodes:
        for name, f in FILTERS:
            if not f(n, a):
                counts[name] = counts.get(name, 0) + 1
                break
    return counts


Positions = tuple[int, ...]

# ---------------------------------------------------------------- score plugins
#
# A plugin scores one feasible node (higher is better) and may say which GPUs it would take
# there; the profile's `chooser` is the plugin whose GPU choice is used. Scores are summed with
# the profile's weights; a plugin with `normalize` has its scores min-max scaled to 0..100 over
# the feasible nodes first (kube-scheduler's NormalizeScore).

@dataclass
class Context:
    """What plugins may read besides the node: the typical workload (FGD), a seeded RNG for
    ties and random choices, and caches that key on node versions."""

    typical: tuple[Typical, ...] = ()
    # where a gang's placed replicas are: (level, domain) -> count, for every topology level
    gang: dict[tuple[str, str], int] = field(default_factory=dict)
    prefer: str = "leaf"  # the gang's preferred topology level (its spec's `topology.preferred`)
    shapes: tuple[TaskShape, ...] = ()  # the workload's job shapes, one per job (policies derive their own typical set)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    frag_cache: dict[FragKey, float] = field(default_factory=dict)
    # (plugin, node) -> ask -> (cpu_left, left, score, positions): a node's score for a kind of ask
    # holds until the node changes, and most asks are of a few kinds
    score_cache: dict[tuple[str, str], dict[Any, tuple[int, list[int], float, Positions | None]]] = field(
        default_factory=dict)

    def cached(self, plugin: str, n: Node, a: Ask) -> tuple[float, Positions | None] | None:
        hit = self.score_cache.get((plugin, n.node_id), {}).get((a.cpu, a.gpus, a.milli, a.models))
        if hit is not None and hit[0] == n.cpu_left and hit[1] == n.left:
            return hit[2], hit[3]
        return None

    def remember(self, plugin: str, n: Node, a: Ask, score: float, pos: Positions | None) -> None:
        kinds = self.score_cache.setdefault((plugin, n.node_id), {})
        if len(kinds) >= 256:  # bounded: a service sees ever new kinds of asks
            kinds.clear()
        kinds[(a.cpu, a.gpus, a.milli, a.models)] = (n.cpu_left, list(n.left), score, pos)

    def frag(self, model: str, cpu_left: int, left: Sequence[int]) -> float:
        return memo_frag(self.frag_cache, self.typical, model, cpu_left, left)


def whole_gpus_lowest(n: Node, a: Ask) -> Positions:
    """The lowest-index GPUs with all their milli free (the simulator's AllocateExclusiveGpuId)."""
    out: list[int] = []
    for i, x in enumerate(n.left):
        if len(out) == a.gpus:
            break
        if x >= a.milli:
            out.append(i)
    return tuple(out)


def share_tightest(n: Node, a: Ask) -> Positions:
    """For a share: the GPU with the least room that still fits (first index on ties)."""
    best = -1
    for i, x in enumerate(n.left):
        if x >= a.milli and (best < 0 or x < n.left[best]):
            best = i
    return (best,) if best >= 0 else ()


def topology_gpus(n: Node, a: Ask) -> Positions:
    """Whole GPUs spanning the fewest NVLink islands, then PCIe switches, then NUMA nodes; for a
    share, the tightest GPU."""
    if not a.gpus:
        return ()
    if a.milli < MILLI:
        return share_tightest(n, a)
    free = tuple(i for i, x in enumerate(n.left) if x >= MILLI)
    if len(free) == a.gpus or not n.island:
        return free[:a.gpus]
    # the choice depends only on the node's topology, which GPUs are free and how many are asked:
    # nodes of one kind share it, so the combinations below are weighed once per free pattern
    # (a 50,000-job backlog on 5,000 partly used nodes spent 30 % of the placer here)
    key = (free, a.gpus, tuple(n.island), tuple(n.switch), tuple(n.numa))
    hit = _TOPOLOGY_MEMO.get(key)
    if hit is None:
        if len(_TOPOLOGY_MEMO) >= _TOPOLOGY_MEMO_MAX:
            _TOPOLOGY_MEMO.clear()
        hit = _TOPOLOGY_MEMO[key] = _topology_choice(n, free, a.gpus)
    return hit


_TOPOLOGY_MEMO: dict[tuple[Any, ...], Positions] = {}
_TOPOLOGY_MEMO_MAX = 1 << 16


def _topology_choice(n: Node, free: Positions, gpus: int) -> Positions:
    best: tuple[tuple[int, int, int, int], Positions] | None = None
    # group the free GPUs by island; fill from the islands with the fewest free GPUs that still
    # hold the job (best fit per island), else from the fullest islands first
    by_island: dict[int, list[int]] = {}
    for i in free:
        by_island.setdefault(n.island[i], []).append(i)
    fitting = sorted((len(v), k) for k, v in by_island.items() if len(v) >= gpus)
    if fitting:
        candidates = [by_island[fitting[0][1]]]
    else:
        order = sorted(by_island.values(), key=len, reverse=True)
        chosen: list[int] = []
        for group in order:
            chosen += group[: gpus - len(chosen)]
            if len(chosen) == gpus:
                break
        candidates = [chosen]
    for group in candidates:
        if len(group) > gpus and len(group) <= 12:
            for combo in combinations(group, gpus):
                key = (len({n.island[i] for i in combo}), len({n.switch[i] for i in combo}) if n.switch else 0,
                       len({n.numa[i] for i in combo}) if n.numa else 0, combo[0])
                if best is None or key < best[0]:
                    best = (key, combo)
        else:
            combo = tuple(group[: gpus])
            key = (len({n.island[i] for i in combo}), 0, 0, 0)
            if best is None or key < best[0]:
                best = (key, combo)
    assert best is not None
    return tuple(sorted(best[1]))


def spread(n: Node, positions: Positions) -> tuple[int, int, int]:
    """(NVLink islands, PCIe switches, NUMA nodes) that the GPUs span."""
    if not positions or not n.island:
        return (1 if positions else 0, 1 if positions else 0, 1 if positions else 0)
    return (len({n.island[i] for i in positions}), len({n.switch[i] for i in positions}) if n.switch else 1,
            len({n.numa[i] for i in positions}) if n.numa else 1)


class Plugin:
    name = "plugin"
    normalize = False

    def evaluate(self, n: Node, a: Ask, ctx: Context) -> tuple[float, Positions | None]:
        raise NotImplementedError


def _sigmoid(x: float) -> float:
    if x < -60:
        return 0.0
    return 1.0 / (1.0 + math.exp(-x))


def frag_gradient(n: Node, a: Ask, frag: Callable[[str, int, Sequence[int]], float], truncate: bool,
                  tight_ties: bool) -> tuple[float, Positions]:
    """sigmoid((F_before - F_after) / 1000) * 100 (truncated to an integer, as FGD scores) and the
    GPUs: for a share, the GPU with the best score (ties: the lowest index, or the tightest GPU);
    whole GPUs: the lowest-index free ones."""
    before = frag(n.model, n.cpu_left, n.left)
    cpu_after = n.cpu_left - a.cpu
    if a.gpus == 1 and a.milli < MILLI:
        best: tuple[float, int] | None = None
        left = list(n.left)
        for i, x in enumerate(n.left):
            if x >= a.milli:
                left[i] = x - a.milli
                s = _sigmoid((before - frag(n.model, cpu_after, left)) / 1000) * 100
                left[i] = x
                if truncate:
                    s = float(int(s))
                if best is None or s > best[0] or (tight_ties and s == best[0] and x < n.left[best[1]]):
                    best = (s, i)
        assert best is not None  # (the node passed the GPU filter)
        return best[0], (best[1],)
    positions = whole_gpus_lowest(n, a)
    left = list(n.left)
    for i in positions:
        left[i] -= a.milli
    s = _sigmoid((before - frag(n.model, cpu_after, left)) / 1000) * 100
    return (float(int(s)) if truncate else s), positions


def cached_score(plugin: Plugin, n: Node, a: Ask, ctx: Context,
                 compute: Callable[[], tuple[float, Positions | None]]) -> tuple[float, Positions | None]:
    """The plugin's score of the node for this kind of ask, computed once per state of the node."""
    key = f"{plugin.name}:{id(plugin)}"
    hit = ctx.cached(key, n, a)
    if hit is None:
        hit = compute()
        ctx.remember(key, n, a, *hit)
    return hit


class FGD(Plugin):
    """Fragmentation gradient descent (Weng et al., ATC '23), as the published simulator scores:
    int(sigmoid((F_before - F_after) / 1000) * 100); for a share, the GPU with the best
    (truncated) score, the lowest index on ties; whole GPUs: the lowest-index free ones."""

    name = "fgd"

    def evaluate(self, n: Node, a: Ask, ctx: Context) -> tuple[float, Positions | None]:
        return cached_score(self, n, a, ctx, lambda: frag_gradient(n, a, ctx.frag, truncate=True, tight_ties=False))


class BestFit(Plugin):
    """The simulator's BestFit: (1 - sum of 0.5 * (free - asked) / max) * 100 over CPU and GPU
    (max: 128 cores, 8 GPUs), min-max normalised over the feasible nodes; the tightest GPU."""

    name = "bestfit"
    normalize = True

    def evaluate(self, n: Node, a: Ask, ctx: Context) -> tuple[float, Positions | None]:
        gpu_free = sum(n.left)
        s = (1 - (0.5 * (n.cpu_left - a.cpu) / 128_000 + 0.5 * (gpu_free - a.gpu_milli_total) / 8_000)) * 100
        return float(int(s)), None


class LeastAllocated(Plugin):
    """kube-scheduler's default scoring (NodeResourcesFit, strategy LeastAllocated) with the GPU
    added to its resources: the mean over CPU, memory and GPU of the share left free after the
    job, times 100 (spreads work over the emptiest nodes). The baseline a cluster gets from a
    stock scheduler."""

    name = "leastallocated"

    def evaluate(self, n: Node, a: Ask, ctx: Context) -> tuple[float, Positions | None]:
        parts = []
        if n.cpu_total:
            parts.append((n.cpu_left - a.cpu) / n.cpu_total)
        if n.mem_total:
            parts.append((n.mem_left - a.mem) / n.mem_total)
        if n.left:
            parts.append((sum(n.left) - a.gpu_milli_total) / (MILLI * len(n.left)))
        return (float(int(100 * sum(parts) / len(parts))) if parts else 0.0), None


class DotProd(Plugin):
    """The simulator's DotProd: 100 * (1 - <node free, ask> / 2) over [CPU / 128 cores, GPU / 8]."""

    name = "dotprod"

    def evaluate(self, n: Node, a: Ask, ctx: Context) -> tuple[float, Positions | None]:
        dot = (n.cpu_left / 128_000) * (a.cpu / 128_000) + (sum(n.left) / 8_000) * (a.gpu_milli_total / 8_000)
        return float(int(100 * (1 - dot / 2))), None


class GpuPacking(Plugin):
    """The simulator's GpuPacking: partly used GPUs first (the fullest node), then nodes with
    some GPUs free (using the fewest), idle nodes last."""

    name = "packing"

    def evaluate(self, n: Node, a: Ask, ctx: Context) -> tuple[float, Positions | None]:
        if not a.gpus:
            return 0.0, None
        fully_free = sum(1 for x in n.left if x >= MILLI)
        if fully_free == n.gpus_total:  # an idle node: last
            return float(max(100 // 3 - fully_free, fully_free)), None
        need = a.gpus
        fully_free_used = 0
        for x in sorted(n.left):
            if need == 0:
                break
            if a.milli <= x:
                need -= 1
                if x >= MILLI:
                    fully_free_used += 1
        if fully_free_used > 0:
            return float(max(100 // 2 - fully_free_used, 100 // 3)), None
        return float(max(100 - sum(x * 100 // 1000 for x in n.left) // 10, 100 // 2)), None


class GpuClustering(Plugin):
    """The simulator's GpuClustering: jobs of one kind (a share, or n whole GPUs) together."""

    name = "clustering"

    def __init__(self) -> None:
        self.tags: dict[str, dict[str, int]] = {}  # node -> affinity tag -> jobs

    @staticmethod
    def tag(a: Ask) -> str:
        return "share-gpu" if a.milli < MILLI else f"{a.gpus}-gpu"

    def evaluate(self, n: Node, a: Ask, ctx: Context) -> tuple[float, Positions | None]:
        if not a.gpus:
            return 0.0, None
        base = 25 * (8000 - sum(n.left)) // 8000
        tags = {t for t, c in self.tags.get(n.node_id, {}).items() if c > 0}
        mine = self.tag(a)
        if tags == {mine}:
            return float(base + 75), None
        if mine in tags:
            return float(base + 50), None
        if not tags:
            return float(base + 25), None
        return float(base), None

    def placed(self, n: Node, a: Ask) -> None:
        if a.gpus:
            t = self.tags.setdefault(n.node_id, {})
            t[self.tag(a)] = t.get(self.tag(a), 0) + 1


class RandomScore(Plugin):
    name = "random"

    def evaluate(self, n: Node, a: Ask, ctx: Context) -> tuple[float, Positions | None]:
        return ctx.rng.random(), None


class Topology(Plugin):
    """Prefer the node where the job's GPUs span the fewest NVLink islands, PCIe switches and NUMA
    nodes (100: one of each)."""

    name = "topology"

    def evaluate(self, n: Node, a: Ask, ctx: Context) -> tuple[float, Positions | None]:
        if a.gpus < 2 or a.milli < MILLI:
            return 100.0, None
        pos = topology_gpus(n, a)
        islands, switches, numas = spread(n, pos)
        return 100.0 / islands - 10 * (switches - 1) / max(1, a.gpus) - 5 * (numas - 1), pos


class DataLocality(Plugin):
    """Prefer nodes that hold the job's dataset in their local cache."""

    name = "locality"

    def evaluate(self, n: Node, a: Ask, ctx: Context) -> tuple[float, Positions | None]:
        return (100.0 if a.dataset and a.dataset in n.datasets else 0.0), None


class GangLocality(Plugin):
    """The replicas of a gang close together: within the domain of its preferred topology level
    (`topology.preferred`, default the leaf switch) of a replica already placed (100), within the
    next level up (50), elsewhere (0). No effect on a single replica."""

    name = "gang"

    def evaluate(self, n: Node, a: Ask, ctx: Context) -> tuple[float, Positions | None]:
        if not ctx.gang:
            return 0.0, None
        at = TOPOLOGY_LEVELS.index(ctx.prefer)
        for level in TOPOLOGY_LEVELS[:at + 1]:  # (the same node is within every wider domain too)
            if (level, n.domain(level)) in ctx.gang:
                return 100.0, None
        up = TOPOLOGY_LEVELS[min(at + 1, len(TOPOLOGY_LEVELS) - 1)]
        return (50.0 if (up, n.domain(up)) in ctx.gang else 0.0), None


@dataclass
class Profile:
    """Score plugins with weights; `chooser`: how the GPUs on the chosen node are picked ("tightest"
    for shares and lowest-index whole GPUs, "topology", "random", or a plugin's own choice by name)."""

    name: str
    plugins: tuple[tuple[Plugin, float], ...]
    chooser: str = "tightest"
    # "first": ties go to the first node in the cluster's order — what reproduces the FGD paper's
    # published numbers (its simulator keeps nodes in a random but fixed order); uniform random
    # ties spread CPU-only jobs over empty GPU nodes and cost FGD 5 points (measured: 90.4 vs 95.2)
    ties: str = "first"


def choose_gpus(n: Node, a: Ask, how: str, ctx: Context) -> Positions:
    if not a.gpus:
        return ()
    if how == "auto":  # shares: the tightest GPU; whole GPUs: by topology
        how = "topology"
    if a.milli < MILLI:
        if how == "random":
            fits = [i for i, x in enumerate(n.left) if x >= a.milli]
            return (ctx.rng.choice(fits),)
        return share_tightest(n, a)
    if how == "topology":
        return topology_gpus(n, a)
    return whole_gpus_lowest(n, a)


def schedule(nodes: Iterable[Node], a: Ask, profile: Profile, ctx: Context, *, filtered: bool = False,
             ) -> Pick | None:
    """The best feasible node and the GPUs to take there, or None when no node is feasible.
    `filtered`: the caller passes only nodes that passed the filters already."""
    cands = list(nodes) if filtered else [n for n in nodes if feasible(n, a)]
    if not cands:
        return None
    totals = [0.0] * len(cands)
    choices: list[Positions | None] = [None] * len(cands)
    for plugin, weight in profile.plugins:
        scores = []
        for i, n in enumerate(cands):
            s, pos = plugin.evaluate(n, a, ctx)
            scores.append(s)
            if pos is not None and profile.chooser == plugin.name:
                choices[i] = pos
        if plugin.normalize:
            lo, hi = min(scores), max(scores)
            scores = [(s - lo) * 100 // (hi - lo) if hi > lo else 0.0 for s in scores]
        for i, s in enumerate(scores):
            totals[i] += weight * s
    top = max(totals)
    best = [i for i, t in enumerate(totals) if t == top]
    i = best[0] if profile.ties == "first" or len(best) == 1 else best[ctx.rng.randrange(len(best))]
    n = cands[i]
    pos = choices[i]
    if pos is None:
        pos = choose_gpus(n, a, profile.chooser, ctx)
    return Pick(n, pos, top)


def profiles() -> dict[str, Profile]:
    """The built-in profiles, fresh (GpuClustering keeps per-node state)."""
    return {
        "default": Profile("default", ((BestFit(), 1.0), (Topology(), 1.0), (GangLocality(), 1.0),
                                       (DataLocality(), 0.5)), chooser="auto"),
        "random": Profile("random", ((RandomScore(), 1.0),), chooser="random"),
        "leastallocated": Profile("leastallocated", ((LeastAllocated(), 1.0),)),
        "dotprod": Profile("dotprod", ((DotProd(), 1.0),)),
        "clustering": Profile("clustering", ((GpuClustering(), 1.0),)),
        "packing": Profile("packing", ((GpuPacking(), 1.0),)),
        "bestfit": Profile("bestfit", ((BestFit(), 1.0),)),
        "fgd": Profile("fgd", ((FGD(), 1.0),), chooser="fgd"),
        "fragaware": Profile("fragaware", ((FragAware(), 1.0),), chooser="fragaware"),
        "topology": Profile("topology", ((BestFit(), 1.0), (Topology(), 2.0), (DataLocality(), 0.5)),
                            chooser="topology"),
    }


class FragAware(Plugin):
    """Our policy: FGD's fragmentation gradient, plus keeping shared GPUs apart from whole ones.

    The score is FGD's, int(sigmoid(dF / 1000) * 100), and `affinity` points (2) more where the
    job keeps GPU sharing together: a share on a node that already has a partly used GPU, a
    whole-GPU job on a node that has none (GpuClustering's idea, weighed against the gradient).
    The bonus is for workloads where shares are a minority of the GPU pods: once the typical
    workload (the set FGD weighs fragmentation over) has more shares than whole-GPU pods, it is
    off (`adapt="minority"`; `"none"`: always on) and the gradient alone decides.
    A job without GPUs goes, among equals, where it strands the least free GPU per free core.
    Ties go to the first node in the cluster's order, as in FGD. Measured against FGD on every
    workload of the Alibaba trace: docs/benchmarks.md (with the variants that did worse).

    Options: `by="gpu"|"blend"` weighs the typical workload by GPU demand, `truncate=False`
    scores the exact gradient, `coverage` widens the typical set, `tiebreak="tight"` breaks
    ties by the least GPU and CPU left, `"none"` as FGD.
    """

    name = "fragaware"

    def __init__(self, by: str = "count", truncate: bool = True, tiebreak: str = "affinity", affinity: float = 2.0,
                 cpu_jobs: bool = True, coverage: float = 0.95, adapt: str = "minority") -> None:
        self.by = by
        self.adapt = adapt
        self._bonus = affinity
        self.truncate = truncate
        self.tiebreak = tiebreak
        self.affinity = affinity
        self.cpu_jobs = cpu_jobs
        self.coverage = coverage
        self._typical: tuple[Typical, ...] | None = None
        self._source: tuple[Typical, ...] | None = None
        self._cache: dict[FragKey, float] = {}

    def typical(self, ctx: Context) -> tuple[Typical, ...]:
        if self._typical is None or self._source is not ctx.typical:
            self._source = ctx.typical
            self._cache.clear()
            if (self.by != "count" or self.coverage != 0.95) and ctx.shapes:
                from .frag import typical_tasks

                self._typical = typical_tasks(ctx.shapes, coverage=self.coverage, weight=self.by)
            else:
                self._typical = ctx.typical
            self._bonus = self.affinity * self.bonus_scale(self._typical)
        return self._typical

    def bonus_scale(self, typical: Sequence[Typical]) -> float:
        """1 while shares are at most half of the typical GPU pods (by weight), else 0 ("minority")."""
        if self.adapt != "minority":
            return 1.0
        gpu = sum(t.weight for t in typical if t.shape.gpus)
        share = sum(t.weight for t in typical if t.shape.gpus and t.shape.milli < MILLI)
        return 1.0 if not gpu or share <= 0.5 * gpu else 0.0

    def frag(self, ctx: Context, model: str, cpu_left: int, left: Sequence[int]) -> float:
        return memo_frag(self._cache, self.typical(ctx), model, cpu_left, left)

    def evaluate(self, n: Node, a: Ask, ctx: Context) -> tuple[float, Positions | None]:
        return cached_score(self, n, a, ctx, lambda: self._evaluate(n, a, ctx))

    def _evaluate(self, n: Node, a: Ask, ctx: Context) -> tuple[float, Positions | None]:
        score, pos = frag_gradient(n, a, lambda m, c, left: self.frag(ctx, m, c, left), self.truncate,
                                   tight_ties=True)
        cpu_after = n.cpu_left - a.cpu
        gpu_left = sum(n.left) - a.gpu_milli_total
        if self.tiebreak == "affinity" and a.gpus:
            shared = any(0 < x < MILLI for x in n.left)
            if shared == (a.milli < MILLI):
                score += self._bonus
        elif self.tiebreak == "tight":
            score -= 1e-6 * (gpu_left / 8000 + cpu_after / 128_000)
        if not a.gpus and self.cpu_jobs and self.tiebreak != "none":
            # stranding: free GPU per free core after the job (0 when the GPUs are all taken)
            score -= 1e-3 * min(1.0, gpu_left / max(1, cpu_after) * 10)
        return score, pos
