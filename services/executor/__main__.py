"""python -m gpufleet.services.executor [--driver sim|process|docker] ...

`sim` (the default): --sim-nodes simulated nodes in this process. `process` / `docker`: this
machine is one node (--node-id, default the host name); its inventory comes from NVML and the OS,
jobs run for real, and a restart re-adopts what still runs (--work-dir keeps the pid files).
"""

from gpufleet.services.executor.agent import main

if __name__ == "__main__":
    main()
