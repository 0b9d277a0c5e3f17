"""python -m gpufleet.services.admission [--config cluster.yaml]"""

from gpufleet.services.registry import make_core
from gpufleet.shared.runtime.service import serve

if __name__ == "__main__":
    serve("admission", lambda args: make_core("admission", args))
