"""python -m gpufleet.services.telemetry [--sample-s 5] [--lease-s 30] [--idle-after 30m] ...

Samples the simulated GPUs of `sim` nodes, and this machine's real GPUs through NVML when there
are any (as node --node-id, default the host name).
"""

from gpufleet.services.telemetry.agent import main

if __name__ == "__main__":
    main()
