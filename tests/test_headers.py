"""The header parse put in nats-py's place returns what nats-py's own does, for any block."""

from __future__ import annotations

import random

import pytest

from gpufleet.shared.runtime import headers

ALPHABET = [b"a", b"Z", b"-", b":", b" ", b"\t", b"\r", b"\n", b"\r\n", b"\x1c", b"\x1f", b"\x0b", b"\x00",
            b"\xc3\xa9", b"\xff", b"Nats-Msg-Id", b"01KDWQT62", b"fleet.evt.*.job.*.placed", b"\xe2\x80\x83"]


def _block(rng: random.Random) -> bytes:
    lines = []
    for _ in range(rng.randrange(0, 6)):
        name = b"".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 5)))
        value = b"".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 5)))
        lines.append(name + rng.choice([b":", b": ", b"", b" :\t"]) + value)
    return b"\r\n".join(lines) + rng.choice([b"", b"\r\n", b"\r\n\r\n"])


def test_the_same_names_values_and_skipped_lines_as_nats_pys_own() -> None:
    rng = random.Random(20261207)
    theirs = headers.original()
    blocks = [_block(rng) for _ in range(20_000)]
    blocks += [b"Nats-Msg-Id: e1\r\nNats-Batch-Id: b\r\nNats-Batch-Sequence: 3\r\n\r\n", b"", b":", b" a b : c",
               b"\x1ckey: v", b"k\x1f: v", "clé: v".encode(), b"k: \xff\xfe", b"dup: 1\r\ndup: 2"]
    differ = [b for b in blocks if headers.parse_header_lines(b) != theirs(b)]  # type: ignore[operator]
    assert not differ, differ[:5]
    some = sum(1 for b in blocks if headers.parse_header_lines(b))
    assert some > 1000  # (the random blocks are not all skipped: the two were compared on real headers)


def test_installed_in_every_process_that_has_a_bus() -> None:
    import nats.aio.client
    from nats.aio.client import Client

    import gpufleet.shared.runtime.bus  # noqa: F401 - installs it

    if nats.aio.client.__version__ not in headers.CHECKED_NATS_PY:
        pytest.skip("another nats-py keeps its own parse")
    assert Client._parse_header_lines is headers.parse_header_lines
