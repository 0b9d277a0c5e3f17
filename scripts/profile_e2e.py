"""Profile every process of the mesh under `bench e2e` with py-spy (a dev tool: `pip install py-spy`).

    .venv/bin/python scripts/profile_e2e.py [--jobs 20000] [--sim-nodes 5000] [--seconds 30] [--out DIR]
        [--only placer ...] [any other option of bench e2e, e.g. --config FILE --duration 20s]

Starts `gpufleet bench e2e --layouts grouped` (the embedded default), waits until the jobs are
being submitted, records each gpufleet process for --seconds at 50 Hz (py-spy's raw format) and
prints, per process, the functions with the most samples in them (self) and under them (total).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

PROCS = {
    "gpufleet.shared.runtime.service": "services group",
    "gpufleet.services.placer": "placer",
    "gpufleet.services.executor": "executor",
    "gpufleet.shared.read.readmodel": "read model",
    "gpufleet.tools.viewsnap": "view",
}


def _pids() -> dict[str, int]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    found: dict[str, int] = {}
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        for mod, name in PROCS.items():
            if f"-m {mod}" in args and name not in found:
                found[name] = int(pid)
    return found


def _summary(raw: Path, top: int) -> list[str]:
    self_n: collections.Counter[str] = collections.Counter()
    total_n: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        count = int(n)
        samples += count
        frames = [re.sub(r" \((?:/[^)]*/)?([^/)]+)\)", r" (\1)", f) for f in stack.split(";")[1:]]
        if not frames:
            continue
        self_n[frames[-1]] += count
        for f in set(frames):
            total_n[f] += count
    lines = [f"  {samples} samples"]
    lines += [f"  self  {100 * c / max(1, samples):5.1f}%  {f}" for f, c in self_n.most_common(top)]
    lines += [f"  total {100 * c / max(1, samples):5.1f}%  {f}" for f, c in total_n.most_common(top * 2)]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--sim-nodes", type=int, default=5000)
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path("/tmp/gpufleet-profile"))
    ap.add_argument("--only", action="append", help="profile only these processes (by name, e.g. placer)")
    args, extra = ap.parse_known_args()  # (the rest goes to the bench: --config, --duration, --until-ended)
    args.out.mkdir(parents=True, exist_ok=True)
    gpufleet = Path(sys.executable).with_name("gpufleet")
    bench = subprocess.Popen([str(gpufleet), "bench", "e2e", "--sim-nodes", str(args.sim_nodes),
                              "--jobs", str(args.jobs), "--layouts", "grouped", *extra],
                             stdout=(args.out / "bench.txt").open("w"), stderr=subprocess.PIPE, text=True)
    assert bench.stderr is not None
    for line in bench.stderr:  # the bench's progress: profile once the jobs flow
        sys.stderr.write(line)
        if line.startswith(("submitted ", "placed ")):
            break
    pids = {k: v for k, v in _pids().items() if not args.only or k in args.only}
    print(f"profiling {pids}", file=sys.stderr)
    spies = {name: subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "-r", "50", "-d", str(args.seconds), "-f", "raw", "-p",
                                     str(pid), "-o", str(args.out / f"{name.replace(' ', '_')}.txt")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name, pid in pids.items()}
    for spy in spies.values():
        spy.wait()
    for line in bench.stderr:
        sys.stderr.write(line)
    bench.wait()
    for name in spies:
        raw = args.out / f"{name.replace(' ', '_')}.txt"
        print(f"== {name}")
        print("\n".join(_summary(raw, args.top)) if raw.exists() else "  (no profile)")
    print((args.out / "bench.txt").read_text())
    return bench.returncode


if __name__ == "__main__":
    raise SystemExit(main())
