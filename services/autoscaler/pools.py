"""Node pools, pure helpers: a pool's node inventory, whether a job fits a pool's node shape, and
how many new nodes a set of waiting jobs needs (first fit, gangs all or nothing)."""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.shared.contract.clusterconfig import NodePoolConfig
from gpufleet.shared.contract.spec import JobSpec
from gpufleet.shared.node.cluster import pool_inventory

MILLI = 1000
__all__ = ["Room", "empty_room", "pack", "pool_inventory", "replica_fits_shape"]


@dataclass
class Room:
    """What is free on one node (or on one node that will come): GPUs in milli, CPU, memory."""

    gpu_milli: list[int]
    cpu_milli: int
    memory_mib: int
    node_id: str | None = None  # None: a node not asked for yet


def replica_fits_shape(pool_name: str, pool: NodePoolConfig, spec: JobSpec) -> bool:
    """Whether one replica of the job could run on an empty node of the pool."""
    r, s = spec.resources, pool.shape
    if r.mig:
        return False  # pool nodes have no MIG instances
    labels = {**s.labels, "pool": pool_name}
    if any(labels.get(k) != v for k, v in spec.node_selector.items()):
        return False
    if any(t not in spec.tolerations for t in s.taints):
        return False
    if r.gpu:
        if r.gpu > s.gpus or (r.gpu_models and s.gpu_model not in r.gpu_models):
            return False
        if r.gpu_memory_mib and s.gpu_memory_mib < r.gpu_memory_mib:
            return False
    return r.cpu_milli <= s.cpu_milli and r.memory_mib <= s.memory_mib


def empty_room(pool: NodePoolConfig) -> Room:
    s = pool.shape
    return Room([MILLI] * s.gpus, s.cpu_milli, s.memory_mib)


def _take(room: Room, spec: JobSpec) -> bool:
    """Put one replica on `room` if it fits (mutates it)."""
    r = spec.resources
    if r.cpu_milli > room.cpu_milli or r.memory_mib > room.memory_mib:
        return False
    picked: list[int] = []
    if r.gpu:
        want = r.gpu_milli if r.gpu_milli < MILLI else MILLI
        picked = [i for i, left in enumerate(room.gpu_milli) if left >= want][: r.gpu]
        if len(picked) < r.gpu:
            return False
        for i in picked:
            room.gpu_milli[i] -= want
    room.cpu_milli -= r.cpu_milli
    room.memory_mib -= r.memory_mib
    return True


def pack(rooms: list[Room], spec: JobSpec, pool: NodePoolConfig, new_max: int) -> tuple[list[Room], set[str]] | None:
    """Place every replica of the job on `rooms` (first fit), opening new empty nodes of the pool
    as needed (at most `new_max`). Returns the rooms after (new ones appended) and the existing
    nodes it used, or None when the gang does not fit: then `rooms` is unchanged."""
    trial = [Room(list(x.gpu_milli), x.cpu_milli, x.memory_mib, x.node_id) for x in rooms]
    used: set[str] = set()
    opened = 0
    for _ in range(spec.replicas):
        for room in trial:
            if _take(room, spec):
                if room.node_id is not None:
                    used.add(room.node_id)
                break
        else:
            if opened >= new_max:
                return None
            room = empty_room(pool)
            if not _take(room, spec):
                return None
            trial.append(room)
            opened += 1
    return trial, used
