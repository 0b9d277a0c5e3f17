"""python -m gpufleet.services.admission"""

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.shared.service import serve

if __name__ == "__main__":
    serve("admission", lambda args: AdmissionCore())
