"""`gpufleet bench bus` measures both ways of writing on a real nats-server, every event stored."""

from __future__ import annotations

from gpufleet.bench.bus import run


def test_both_ways_of_writing_are_measured() -> None:
    doc = run(events=60, chunks=(3,), syncs=("lazy",))
    modes = {(c["mode"], c["chunk"]) for c in doc["cases"]}
    assert modes == {("pipelined", 3), ("batch", 3)}
    for case in doc["cases"]:
        assert case["events"] == case["stored"] == 60 and case["events_per_s"] > 0 and case["chunk_ms_median"] > 0
