"""One exception root for the project, split into retryable and permanent.

Only the service shell turns these into ack, nak-with-delay or terminate.
"""

from __future__ import annotations


class GpufleetError(Exception):
    """Root of every error gpufleet raises on purpose."""


class RetryableError(GpufleetError):
    """A transient failure: the same input may succeed later (nak with delay)."""


class PermanentError(GpufleetError):
    """The input can never succeed: terminate it and record a dead letter."""


class InvalidMessage(PermanentError):
    """A message that is not valid JSON or does not match the contract."""


class SpecError(PermanentError):
    """A job spec that breaks a rule; `field` names the offending field."""

    def __init__(self, field: str, reason: str, errors: list[tuple[str, str]] | None = None) -> None:
        super().__init__(reason if reason.startswith(f"{field}:") else f"{field}: {reason}")
        self.field = field
        self.reason = reason
        # every (field, message) when several rules broke: a client is told each, separately
        self.errors = errors or [(field, reason.removeprefix(f"{field}: "))]


class CasConflict(RetryableError):
    """A compare-and-set publish lost: someone else wrote since our view (err_code 10071)."""


class MeshNotRunning(GpufleetError):
    """No running mesh was found for the data directory."""
