"""Simulated cluster shapes: a heterogeneous fleet of nodes for the sim driver and tests."""

from __future__ import annotations

import hashlib

from .events import GpuDevice, NodeInventory

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


def shape_inventory(shape: str, node_id: str, rack: str = "rack-0") -> NodeInventory:
    model, n, gpu_mem, islands, cores, mem = SHAPES[shape]
    return NodeInventory(
        cpu_milli=cores * 1000, memory_mib=mem, gpus=_gpus(model, n, gpu_mem, islands, node_id),
        numa_nodes=2 if n else 1, labels={"rack": rack, "shape": shape}, driver="sim",
    )


def sim_fleet(n: int, prefix: str = "sim") -> dict[str, NodeInventory]:
    """`n` nodes in the default mix, 16 per rack; deterministic for a given n."""
    order = MIX_CYCLE
    nodes: dict[str, NodeInventory] = {}
    for i in range(n):
        node_id = f"{prefix}-{i:05d}"
        nodes[node_id] = shape_inventory(order[i % len(order)], node_id, rack=f"rack-{i // 16:03d}")
    return nodes


def inventory_digest(inv: NodeInventory) -> str:
    return hashlib.blake2b(inv.model_dump_json().encode(), digest_size=8).hexdigest()
