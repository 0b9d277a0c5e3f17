"""python -m gpufleet.services.billing"""

from gpufleet.services.billing.core import BillingCore
from gpufleet.shared.service import serve

if __name__ == "__main__":
    serve("billing", lambda args: BillingCore())
