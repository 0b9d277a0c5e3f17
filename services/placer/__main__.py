"""python -m gpufleet.services.placer [--config cluster.yaml] (its `placement` and `nodePools`)"""

from gpufleet.services.registry import make_core
from gpufleet.shared.runtime.service import serve

if __name__ == "__main__":
    serve("placer", lambda args: make_core("placer", args))
