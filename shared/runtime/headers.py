"""nats-py's parse of a message's header block, at the cost of a header instead of its letters.

Every event in the log carries headers (`Nats-Msg-Id`, and those of the atomic batch and the
compare-and-set it was written with: `Nats-Batch-Id`, `Nats-Batch-Sequence`,
`Nats-Expected-Last-Subject-Sequence-Subject` ...), and every process that reads the log has
nats-py parse them for every message it is delivered. nats-py 2.16 checks each name for
whitespace one character at a time with a generator (`any(c.isspace() for c in key)`): 5 % of
the view process's samples under `bench e2e`, 3-5 % of the executor's and the read model's.

`parse_header_lines` returns what nats-py's own does for every input - the same names and
values, the same lines skipped (tests/test_headers.py holds the two side by side on random
blocks) - with one C-level search per name instead. `install()` puts it in place of the
library's, once per process, for the version it was checked against; any other nats-py keeps
its own.
"""

from __future__ import annotations

import re

import nats.aio.client
from nats.aio.client import Client

CHECKED_NATS_PY = ("2.16.0",)
# the ASCII characters str.isspace() is true of (a name that is not ASCII is skipped before)
_SPACE = re.compile(rb"[\t\n\x0b\x0c\r\x1c-\x1f ]")
_CRLF = b"\r\n"

_original = Client._parse_header_lines


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """A NATS header block (`Name: Value\\r\\n` per line) as nats-py 2.16 parses it."""
    out: dict[str, str] = {}
    for line in raw.split(_CRLF):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        name = name.strip()
        if not name.isascii() or _SPACE.search(name) is not None:
            continue  # (nats-py: a name that does not decode as ASCII, or has whitespace in it)
        out[name.decode("ascii")] = value.strip().decode("utf-8", "replace")
    return out


def install() -> bool:
    """Use `parse_header_lines` in nats-py's client; False where its version was not checked."""
    if nats.aio.client.__version__ not in CHECKED_NATS_PY:
        return False
    Client._parse_header_lines = staticmethod(parse_header_lines)  # type: ignore[method-assign]
    return True


def original() -> object:
    """nats-py's own parse (for the test that holds the two side by side)."""
    return _original
