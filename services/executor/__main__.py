"""python -m gpufleet.services.executor --sim-nodes N [--node-prefix sim]"""

from gpufleet.services.executor.core import ExecutorCore
from gpufleet.shared.cluster import sim_fleet
from gpufleet.shared.service import base_parser, serve

if __name__ == "__main__":
    ap = base_parser("executor")
    ap.add_argument("--sim-nodes", type=int, default=4, help="simulated nodes this executor hosts")
    ap.add_argument("--node-prefix", default="sim", help="node id prefix")
    ap.add_argument("--sim-mix", default="", help="node shapes cycled over the sim nodes (h100x8,h100mig,...)")
    serve("executor", lambda args: ExecutorCore(sim_fleet(args.sim_nodes, args.node_prefix, args.sim_mix)), parser=ap)
