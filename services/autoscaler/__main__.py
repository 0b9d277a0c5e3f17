"""python -m gpufleet.services.autoscaler [--config cluster.yaml] (node pools: its `nodePools`)"""

from gpufleet.services.registry import make_core
from gpufleet.shared.runtime.service import serve

if __name__ == "__main__":
    serve("autoscaler", lambda args: make_core("autoscaler", args))
