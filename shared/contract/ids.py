"""Identifiers: time-ordered event ids, deterministic derived ids, and subject tokens.

An event id is a ULID (48-bit millisecond time + 80 bits, Crockford base32), so ids sort by
time. Ids of a decision's outputs are *derived* from the input event id, so a service that
crashes between publish and ack re-publishes the same ids and JetStream drops the copies.
"""

from __future__ import annotations

import hashlib
import re

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_DECODE = {c: i for i, c in enumerate(_CROCKFORD)}
ULID_LEN = 26
TOKEN_LEN_MAX = 64
# what `is_ulid` takes, as a regular expression (the JSON Schema `pattern` of event_id): 26
# characters of Crockford's base32 in upper case (0-9 A-Z without I L O U), the first 0-7
ULID_PATTERN = "^[0-7][0-9A-HJKMNP-TV-Z]{25}$"  # (tests/test_schema.py: it takes exactly what is_ulid takes)
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]+$")


def _encode(value: int, length: int) -> str:
    out = []
    for _ in range(length):
        out.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(out))


def ulid(time_ms: int, entropy: bytes) -> str:
    """A ULID from a millisecond timestamp and 10 bytes of entropy (from the caller: no randomness here)."""
    if len(entropy) < 10:
        raise ValueError("entropy must be at least 10 bytes")
    if not 0 <= time_ms < 2**48:
        raise ValueError("time_ms out of range")
    return _encode(time_ms, 10) + _encode(int.from_bytes(entropy[:10], "big"), 16)


def ulid_time_ms(event_id: str) -> int:
    """The millisecond timestamp embedded in a ULID."""
    value = 0
    for c in event_id[:10]:
        value = value * 32 + _DECODE[c]
    return value


def derive_id(parent_id: str, key: str | int, time_ms: int | None = None) -> str:
    """A deterministic ULID for output `key` of the decision on `parent_id`.

    Same input, same id: the server's duplicate window drops a re-published output.
    The time part is the parent's, so outputs sort right after their cause.
    """
    digest = hashlib.blake2b(f"{parent_id}/{key}".encode(), digest_size=10).digest()
    if time_ms is None:
        try:
            time_ms = ulid_time_ms(parent_id) if len(parent_id) == ULID_LEN else 0
        except KeyError:
            time_ms = 0
    return ulid(time_ms, digest)


def is_ulid(value: str) -> bool:
    """26 characters of Crockford's base32 (upper case), the first no more than 7 (48-bit time)."""
    return len(value) == ULID_LEN and all(c in _DECODE for c in value) and value[0] <= "7"


def is_token(value: str) -> bool:
    """Whether `value` may be embedded in a NATS subject (no '.', '*', '>', spaces or leading '$')."""
    return 0 < len(value) <= TOKEN_LEN_MAX and bool(_TOKEN_RE.fullmatch(value))


def check_token(value: str, field: str = "id") -> str:
    if not isinstance(value, str) or not is_token(value):
        raise ValueError(
            f"{field} must be 1-{TOKEN_LEN_MAX} characters of letters, digits, '-' or '_' "
            f"(it is used in NATS subjects), got {value!r}"
        )
    return value
