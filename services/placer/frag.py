"""GPU fragmentation, as defined by FGD (Weng et al., USENIX ATC 2023, "Beware of Fragmentation").

A node's fragmentation with respect to a task: the unallocated GPU (in milli-GPU) that the task
cannot use there. If the task cannot run on the node at all (no GPU of a fitting model, not
enough free GPU, not enough CPU) every unallocated GPU of the node is a fragment; if it can, the
fragments are the GPUs whose unallocated part is smaller than what the task asks of one GPU.
A task asking for no GPU cannot use GPU at all: all of it counts. Over a workload, the expected
fragmentation weights each typical task by its share of the workload:

    F_n(M) = sum over typical tasks m of  p_m * F_n(m)

FGD places a task where F grows least (the fragmentation gradient). Pure functions on plain
values; the placer's FGD and own score plugins, and `gpufleet bench placement`, use these.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MILLI = 1000
ANY_MODEL: frozenset[str] = frozenset()  # one object for every shape of any model: the placer keeps thousands


@dataclass(frozen=True, slots=True)
class TaskShape:
    """One typical task: CPU (milli), GPUs, milli of each GPU, the GPU models it may use (empty: any)."""

    cpu: int
    gpus: int
    milli: int
    models: frozenset[str] = ANY_MODEL


@dataclass(frozen=True, slots=True)
class Typical:
    shape: TaskShape
    weight: float  # its share of the workload (tasks), summing to 1 over the typical set


def typical_tasks(shapes: Iterable[TaskShape], coverage: float = 0.95, weight: str = "count") -> tuple[Typical, ...]:
    """The most frequent shapes that together cover `coverage` of the tasks, weights renormalised
    (the FGD simulator's rule). weight="gpu": by GPU demand (count x milli-GPU) instead of by
    count, a CPU-only job counting as 100 milli-GPU."""
    counts: Counter[TaskShape] | dict[TaskShape, float] = Counter(shapes)
    if weight == "gpu":
        counts = {s: n * (s.gpus * s.milli if s.gpus else 100) for s, n in counts.items()}
    elif weight == "blend":  # half by count, half by GPU demand
        n_all = sum(counts.values())
        g_all = sum(n * (s.gpus * s.milli if s.gpus else 100) for s, n in counts.items()) or 1
        counts = {s: n / n_all + n * (s.gpus * s.milli if s.gpus else 100) / g_all for s, n in counts.items()}
    total = sum(counts.values())
    if not total:
        return ()
    chosen: list[tuple[TaskShape, float]] = []
    covered = 0.0
    # most frequent first; ties by (cpu, milli, gpus, models), descending, as the FGD simulator sorts
    for shape, n in sorted(counts.items(), key=lambda kv: (kv[1], kv[0].cpu, kv[0].milli, kv[0].gpus,
                                                          sorted(kv[0].models)), reverse=True):
        if covered >= coverage * total:
            break
        chosen.append((shape, n))
        covered += n
    return tuple(Typical(s, n / covered) for s, n in chosen)


def fits_gpus(left: Sequence[int], gpus: int, milli: int) -> bool:
    """Whether `gpus` GPUs with `milli` each fit: whole GPUs need fully free ones, a share one with room."""
    if gpus == 0:
        return True
    if milli < MILLI:
        return any(x >= milli for x in left)
    return sum(1 for x in left if x >= MILLI) >= gpus


def task_frag(model: str, cpu_left: int, left: Sequence[int], t: TaskShape) -> int:
    """F_n(m): the milli-GPU of the node the task `t` could not use."""
    total = sum(left)
    if t.gpus == 0 or (t.models and model not in t.models) or cpu_left < t.cpu:
        return total
    if not fits_gpus(left, t.gpus, t.milli):
        return total
    return sum(x for x in left if x < t.milli)


def node_frag(model: str, cpu_left: int, left: Sequence[int], typical: Sequence[Typical]) -> float:
    """F_n(M): the expected fragmentation of the node over the typical workload."""
    total = sum(left)
    if total == 0:
        return 0.0
    out = 0.0
    for ty in typical:
        t = ty.shape
        if t.gpus == 0 or (t.models and model not in t.models) or cpu_left < t.cpu:
            out += ty.weight * total
        elif t.milli < MILLI:
            if any(x >= t.milli for x in left):
                out += ty.weight * sum(x for x in left if x < t.milli)
            else:
                out += ty.weight * total
        elif sum(1 for x in left if x >= MILLI) >= t.gpus:
            out += ty.weight * (total - MILLI * sum(1 for x in left if x >= MILLI))
        else:
            out += ty.weight * total
    return out


FragKey = tuple[str, int, tuple[int, ...]]


def memo_frag(cache: dict[FragKey, float], typical: Sequence[Typical], model: str, cpu_left: int,
              left: Sequence[int]) -> float:
    """`node_frag`, remembered in `cache` by node state (cleared past a million states)."""
    key = (model, cpu_left, tuple(left))
    v = cache.get(key)
    if v is None:
        if len(cache) > 1_000_000:
            cache.clear()
        v = cache[key] = node_frag(model, cpu_left, left, typical)
    return v
