"""The quota tree: queues are leaves, cohorts the inner nodes, each with nominal / borrowing /
lending limits per resource (Kueue's hierarchical cohorts, same arithmetic).

    cohorts:
      org: {nominal: {gpu/H100: 8}}                    # a cohort may hold quota of its own
      lab: {parent: org, borrowingLimit: {gpu/H100: 16}, lendingLimit: {gpu/H100: 4}}
    queues:
      research: {cohort: lab, nominal: {gpu/H100: 32}}

For a node n and a resource r:
  local(n)     = subtree - lendingLimit (what n keeps for itself; 0 without a lending limit)
  subtree(n)   = own nominal + sum over children c of (subtree(c) - local(c))   [what n holds]
  usage(n)     = a queue's reserved usage; a cohort's: sum over children of max(0, usage(c) - local(c))
  available(n) = subtree - usage at a root; else max(0, local - usage) + min(available(parent),
                 subtree - local - max(0, usage - local) + borrowingLimit)

A resource is limited for a queue when the queue or a cohort above it has a nominal for it;
otherwise the queue may use any amount and its usage does not count towards its cohorts. A
cohort a queue names but the config does not list is an implicit root with no quota of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gpufleet.shared.contract.clusterconfig import ClusterConfig


@dataclass(frozen=True)
class TreeNode:
    key: str  # "queue:<name>" or "cohort:<name>"
    name: str
    parent: str | None  # the parent's key
    nominal: dict[str, int]
    borrowing_limit: dict[str, int]
    lending_limit: dict[str, int]
    children: list[str] = field(default_factory=list)

    @property
    def is_queue(self) -> bool:
        return self.key.startswith("queue:")

    @property
    def label(self) -> str:
        return f"{'queue' if self.is_queue else 'cohort'} {self.name}"


Usage = Callable[[str, str], int]  # (queue name, resource) -> reserved amount


@dataclass(frozen=True)
class Limit:
    """Why `available` is what it is: the node whose limit binds, and the figures."""

    node: TreeNode
    kind: str  # "nominal" (a root is full) | "borrowing_limit"
    available: int


class QuotaTree:
    def __init__(self, config: ClusterConfig) -> None:
        self.nodes: dict[str, TreeNode] = {}
        for name, c in config.cohorts.items():
            self.nodes[f"cohort:{name}"] = TreeNode(
                f"cohort:{name}", name, f"cohort:{c.parent}" if c.parent else None,
                dict(c.nominal), dict(c.borrowing_limit), dict(c.lending_limit))
        for name, q in config.queues.items():
            self.nodes[f"queue:{name}"] = TreeNode(
                f"queue:{name}", name, f"cohort:{q.cohort}" if q.cohort else None,
                dict(q.nominal), dict(q.borrowing_limit), dict(q.lending_limit))
        for node in list(self.nodes.values()):
            if node.parent and node.parent not in self.nodes:  # an implicit cohort: a root, no quota
                self.nodes[node.parent] = TreeNode(node.parent, node.parent.removeprefix("cohort:"), None, {}, {}, {})
        for node in self.nodes.values():
            if node.parent:
                self.nodes[node.parent].children.append(node.key)
        self._subtree: dict[tuple[str, str], int] = {}
        self._limited: dict[str, frozenset[str]] = {}
        self._flavors: dict[str, list[str]] = {}
        for key, node in self.nodes.items():
            if node.is_queue:
                names = list(dict.fromkeys(r for n in self.path(key) for r in self.nodes[n].nominal))
                self._limited[node.name] = frozenset(names)
                self._flavors[node.name] = [r.removeprefix("gpu/") for r in names if r.startswith("gpu/")]

    # ------------------------------------------------------------ structure

    def path(self, key: str) -> list[str]:
        """The node and its ancestors, up to the root."""
        out = []
        cur: str | None = key
        while cur is not None:
            out.append(cur)
            cur = self.nodes[cur].parent
        return out

    def root(self, queue: str) -> str:
        return self.path(f"queue:{queue}")[-1]

    def queues_under(self, key: str) -> list[str]:
        node = self.nodes[key]
        if node.is_queue:
            return [node.name]
        return [q for child in node.children for q in self.queues_under(child)]

    def limited(self, queue: str) -> frozenset[str]:
        """The resources limited for the queue (it or a cohort above it has a nominal for them)."""
        return self._limited.get(queue, frozenset())

    def flavors(self, queue: str) -> list[str]:
        """The GPU models limited for the queue, in the config's order (the queue's, then its cohorts')."""
        return self._flavors.get(queue, [])

    def is_limited(self, queue: str) -> bool:
        return f"queue:{queue}" in self.nodes

    # ------------------------------------------------------------ arithmetic

    def local(self, key: str, r: str) -> int:
        """What the node keeps of the quota it holds: subtree - lendingLimit (0 without a limit)."""
        lend = self.nodes[key].lending_limit.get(r)
        return max(0, self.subtree(key, r) - lend) if lend is not None else 0

    def subtree(self, key: str, r: str) -> int:
        cached = self._subtree.get((key, r))
        if cached is None:
            node = self.nodes[key]
            cached = node.nominal.get(r, 0) + sum(
                self.subtree(c, r) - self.local(c, r) for c in node.children)
            self._subtree[(key, r)] = cached
        return cached

    def usage(self, key: str, r: str, used: Usage) -> int:
        node = self.nodes[key]
        if node.is_queue:
            return used(node.name, r) if r in self.limited(node.name) else 0
        return sum(max(0, self.usage(c, r, used) - self.local(c, r)) for c in node.children)

    def available(self, key: str, r: str, used: Usage) -> tuple[int, Limit]:
        """What the node may still take of `r`, and the limit that binds."""
        node = self.nodes[key]
        u = self.usage(key, r, used)
        if node.parent is None:
            free = self.subtree(key, r) - u
            return free, Limit(node, "nominal", free)
        local = self.local(key, r)
        parent_free, limit = self.available(node.parent, r, used)
        bl = node.borrowing_limit.get(r)
        if bl is not None:
            from_parent = self.subtree(key, r) - local - max(0, u - local) + bl
            if from_parent < parent_free:
                parent_free, limit = from_parent, Limit(node, "borrowing_limit", from_parent)
        return max(0, local - u) + max(0, parent_free), limit

    def borrowed(self, key: str, r: str, used: Usage) -> int:
        """What the node uses beyond the quota it holds (taken from its parent's other children)."""
        return max(0, self.usage(key, r, used) - self.subtree(key, r))

    def lent(self, key: str, r: str, used: Usage) -> int:
        """What the node holds but does not use, and may lend (at most its lending limit)."""
        node = self.nodes[key]
        free = max(0, self.subtree(key, r) - self.usage(key, r, used))
        lend = node.lending_limit.get(r)
        return min(free, lend) if lend is not None else free
