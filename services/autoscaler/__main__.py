"""python -m gpufleet.services.autoscaler"""

from gpufleet.services.autoscaler.core import AutoscalerCore
from gpufleet.shared.service import serve

if __name__ == "__main__":
    serve("autoscaler", lambda args: AutoscalerCore())
