"""python -m gpufleet.services.placer"""

from gpufleet.services.placer.core import PlacerCore
from gpufleet.shared.service import serve

if __name__ == "__main__":
    serve("placer", lambda args: PlacerCore())
