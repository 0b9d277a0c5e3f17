"""python -m gpufleet.services.quota"""

from gpufleet.services.quota.core import QuotaCore
from gpufleet.shared.service import serve

if __name__ == "__main__":
    serve("quota", lambda args: QuotaCore())
