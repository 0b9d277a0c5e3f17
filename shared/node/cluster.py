"""Simulated cluster shapes: a heterogeneous fleet of nodes for the sim driver and tests."""

from __future__ import annotations

import hashlib

from gpufleet.shared.contract.clusterconfig import ClusterConfig, NodePoolConfig
from gpufleet.shared.contract.events import GpuDevice, MigDevice, NodeInventory

GIB = 1024


def _gpus(model: str, n: int, memory_mib: int, islands: int, node_id: str) -> tuple[GpuDevice, ...]:
    per_island = max(1, n // islands)
    return tuple(
        GpuDevice(
            index=i, uuid=f"GPU-{hashlib.blake2b(f'{node_id}/{i}'.encode(), digest_size=8).hexdigest()}",
            model=model, memory_mib=memory_mib, nvlink_island=i // per_island,
            pcie_switch=i // max(1, n // 4), numa_node=0 if i < n // 2 or n == 1 else 1,
        )
        for i in range(n)
    )


# name -> (gpu model, gpus, GPU memory, NVLink islands, CPU cores, memory)
SHAPES: dict[str, tuple[str, int, int, int, int, int]] = {
    "h100x8": ("H100", 8, 80 * GIB, 1, 96, 1024 * GIB),
    "a100x8": ("A100", 8, 80 * GIB, 2, 64, 512 * GIB),
    "a10x4": ("A10", 4, 24 * GIB, 4, 32, 256 * GIB),
    "cpu64": ("", 0, 0, 1, 64, 256 * GIB),
}
# The default mix, 4 : 3 : 2 : 1, interleaved so that even a few nodes have every shape.
MIX_CYCLE: tuple[str, ...] = (
    "h100x8", "a100x8", "a10x4", "cpu64", "h100x8", "a100x8", "h100x8", "a10x4", "a100x8", "h100x8",
)


# shape -> GPU index -> the MIG instances it is split into (the GPU is in MIG mode). Not in the
# default mix: tests and `--sim-shapes` ask for it.
MIG_LAYOUTS: dict[str, dict[int, tuple[str, ...]]] = {
    "h100mig": {4: ("1g.10gb",) * 7, 5: ("1g.10gb",) * 7, 6: ("3g.40gb", "3g.40gb"), 7: ("2g.20gb",) * 3},
}
SHAPES["h100mig"] = SHAPES["h100x8"]


def _with_mig(gpus: tuple[GpuDevice, ...], layout: dict[int, tuple[str, ...]]) -> tuple[GpuDevice, ...]:
    out = []
    for g in gpus:
        profiles = layout.get(g.index)
        if profiles:
            g = g.model_copy(update={"mig_enabled": True, "mig_devices": tuple(
                MigDevice(profile=p, uuid=f"MIG-{g.uuid.removeprefix('GPU-')}-{i}") for i, p in enumerate(profiles))})
        out.append(g)
    return tuple(out)


def _spine(rack: str) -> int:
    """8 racks (leaf switches) per spine."""
    digits = "".join(c for c in rack if c.isdigit())
    return int(digits or 0) // 8


def shape_inventory(shape: str, node_id: str, rack: str = "rack-0") -> NodeInventory:
    model, n, gpu_mem, islands, cores, mem = SHAPES[shape]
    gpus = _gpus(model, n, gpu_mem, islands, node_id)
    if shape in MIG_LAYOUTS:
        gpus = _with_mig(gpus, MIG_LAYOUTS[shape])
    return NodeInventory(
        cpu_milli=cores * 1000, memory_mib=mem, gpus=gpus,
        numa_nodes=2 if n else 1, driver="sim",
        labels={"rack": rack, "leaf": f"leaf-{rack}", "spine": f"spine-{_spine(rack)}", "shape": shape},
    )


def parse_mix(mix: str) -> tuple[str, ...]:
    """`h100x8,h100mig` -> the shapes, cycled over the nodes; '' -> the default mix."""
    shapes = tuple(s.strip() for s in mix.split(",") if s.strip())
    for s in shapes:
        if s not in SHAPES:
            raise ValueError(f"unknown node shape {s!r} (one of {', '.join(SHAPES)})")
    return shapes or MIX_CYCLE


def sim_fleet(n: int, prefix: str = "sim", mix: str = "") -> dict[str, NodeInventory]:
    """`n` nodes in the default mix (or `mix`, cycled), 16 per rack; deterministic for a given n."""
    order = parse_mix(mix)
    nodes: dict[str, NodeInventory] = {}
    for i in range(n):
        node_id = f"{prefix}-{i:05d}"
        nodes[node_id] = shape_inventory(order[i % len(order)], node_id, rack=f"rack-{i // 16:03d}")
    return nodes


def pool_inventory(pool_name: str, pool: NodePoolConfig, node_id: str) -> NodeInventory:
    """What a node of an autoscaler pool registers with (the sim provider registers exactly this)."""
    s = pool.shape
    labels = {"rack": f"rack-{pool_name}", "leaf": f"leaf-{pool_name}", "spine": "spine-pools",
              **s.labels, "pool": pool_name}
    return NodeInventory(cpu_milli=s.cpu_milli, memory_mib=s.memory_mib,
                         gpus=_gpus(s.gpu_model, s.gpus, s.gpu_memory_mib, s.nvlink_islands, node_id),
                         numa_nodes=2 if s.gpus > 1 else 1, labels=labels, taints=s.taints, driver="sim")


def pool_shapes(config: ClusterConfig) -> dict[str, NodeInventory]:
    """pool name -> the inventory one of its nodes will have, for every pool that may have nodes
    (max > 0): capacity the cluster can grow to, which admission and the placer count as possible
    (a job only a pool's shape can hold waits for the autoscaler instead of being refused)."""
    return {name: pool_inventory(name, pool, f"{name}-shape")
            for name, pool in sorted(config.node_pools.items()) if pool.max > 0}


def inventory_digest(inv: NodeInventory) -> str:
    return hashlib.blake2b(inv.model_dump_json().encode(), digest_size=8).hexdigest()
