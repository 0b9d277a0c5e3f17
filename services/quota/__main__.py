"""python -m gpufleet.services.quota [--config cluster.yaml]"""

from gpufleet.services.registry import make_core
from gpufleet.shared.runtime.service import serve

if __name__ == "__main__":
    serve("quota", lambda args: make_core("quota", args))
