"""Node providers: what makes and deletes the nodes of a pool.

The autoscaler decides in the log (`node.provision_requested`, `node.removal_requested`, node ids
chosen in advance); a provider carries those decisions out, idempotently by node id, and the node
registers itself when it is up (its executor: `node.registered`, heartbeats) and says when it is
gone (`node.deregistered`). A cloud provider implements `NodeProvider` with its API (create an
instance from the pool's shape and the node id as its name; delete it) and is added to
`PROVIDERS`; the pool names it in the cluster config (`nodePools.<name>.provider`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from gpufleet.shared.contract.events import NodeProvisionRequested, NodeRemovalRequested

if TYPE_CHECKING:
    from gpufleet.shared.runtime.loop import ServiceRuntime

    from .core import AutoscalerState

log = logging.getLogger(__name__)


class NodeProvider(Protocol):
    @property
    def name(self) -> str: ...

    async def create(self, request: NodeProvisionRequested) -> None:
        """Ask for the node (again after a restart: it must be idempotent by `request.node_id`)."""

    async def delete(self, request: NodeRemovalRequested) -> None:
        """Remove the node (idempotent likewise); it is drained: nothing runs there."""


class SimProvider:
    """Built in. The sim executor (`ExecutorCore(sim_pools=True)`) folds the requests from the log
    and plays the node: it registers it after the pool's provision delay, heartbeats it, and
    deregisters it on removal. Nothing is left to do here."""

    name = "sim"

    async def create(self, request: NodeProvisionRequested) -> None:
        return None

    async def delete(self, request: NodeRemovalRequested) -> None:
        return None


PROVIDERS: dict[str, Callable[[], NodeProvider]] = {"sim": SimProvider}


class ProviderAgent:
    """Beside the autoscaler's runtime: hands each decision to its pool's provider once per process
    (a restart hands them again; providers are idempotent)."""

    def __init__(self, runtime: ServiceRuntime[AutoscalerState], providers: dict[str, NodeProvider] | None = None, every_s: float = 1.0) -> None:
        self.runtime = runtime
        self.providers = providers or {name: make() for name, make in PROVIDERS.items()}
        self.every_s = every_s
        self._created: set[str] = set()
        self._deleted: set[str] = set()
        self._stop = asyncio.Event()

    async def start(self) -> None:
        return None

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        from gpufleet.shared.runtime.loop import every

        await every(self._stop, self.every_s, self.once, "autoscaler providers")

    async def once(self) -> None:
        for node_id, (made, removed) in sorted(self.runtime.state.requests.items()):
            provider = self.providers.get(made.provider)
            if provider is None:
                continue
            if node_id not in self._created:
                await provider.create(made)
                self._created.add(node_id)
            if removed is not None and node_id not in self._deleted:
                await provider.delete(removed)
                self._deleted.add(node_id)
