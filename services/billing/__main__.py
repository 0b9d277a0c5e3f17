"""python -m gpufleet.services.billing (with GPUFLEET_PG_DSN set, the ledger runs beside it)"""

from gpufleet.services.billing.core import BillingCore
from gpufleet.shared.contract.clusterconfig import load_config
from gpufleet.shared.runtime.service import serve

if __name__ == "__main__":
    serve("billing", lambda args: BillingCore(load_config(args.config)))
