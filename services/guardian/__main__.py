"""python -m gpufleet.services.guardian"""

from gpufleet.services.guardian.core import GuardianCore
from gpufleet.shared.contract.clusterconfig import load_config
from gpufleet.shared.runtime.service import serve

if __name__ == "__main__":
    serve("guardian", lambda args: GuardianCore(load_config(args.config)))
