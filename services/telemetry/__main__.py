"""python -m gpufleet.services.telemetry"""

from gpufleet.services.telemetry.core import TelemetryCore
from gpufleet.shared.service import serve

if __name__ == "__main__":
    serve("telemetry", lambda args: TelemetryCore())
