"""The service processes' garbage-collection policy (shared/runtime/gcpolicy.py), in a process of
its own (the policy changes the interpreter's collector for good)."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = r'''
import gc, json, sys, weakref
from gpufleet.shared.runtime import gcpolicy
policy = gcpolicy.install(full_s=float(sys.argv[1]))
class Node:
    pass
def cycle():
    a = Node(); a.me = a
    return a
old = cycle(); old_ref = weakref.ref(old)
state = [{"n": [i]} for i in range(50_000)]
gc.collect()                       # a full collection: what survived is frozen
frozen = gc.get_freeze_count()
young = cycle(); young_ref = weakref.ref(young); del young
gc.collect()
young_collected = young_ref() is None
del old                            # a cycle among frozen objects becomes garbage
gc.collect(); gc.collect()         # (with full_s=0 the first releases the frozen set, the second covers it)
print(json.dumps({"frozen": frozen, "young_collected": young_collected, "old_collected": old_ref() is None,
                  "full": policy.full_collections, "freezes": policy.freezes}))
'''


def _probe(full_s: float, env: dict[str, str] | None = None) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(full_s)], capture_output=True, text=True, check=True,
                         env=env)
    return json.loads(out.stdout)


def test_survivors_of_a_full_collection_are_frozen_and_young_cycles_still_collected() -> None:
    got = _probe(1e9)
    assert got["frozen"] >= 50_000  # the state is not scanned again
    assert got["young_collected"] is True
    assert got["old_collected"] is False  # the price: a cycle among frozen objects waits for the full pass
    assert got["full"] == 0


def test_the_periodic_full_pass_collects_cycles_among_old_objects() -> None:
    got = _probe(0.0)
    assert got["young_collected"] is True
    assert got["old_collected"] is True
    assert got["full"] >= 1
