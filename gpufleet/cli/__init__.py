"""The `gpufleet` command line. Every client command finds the mesh through --data-dir
(or GPUFLEET_DATA_DIR, default ~/.gpufleet); commands that scripts use take --json.

One module per command group, each registering its commands on the one app (common.py):
mesh (up, down, status), jobs (submit, cancel, jobs, nodes, watch, explain, estimate), logtools
(replay, sim, dashboard, audit), queues (queues, pools, bill, report-load), operator (node
cordon|uncordon|drain, gpu return), schema, bench, tenants, certs.
"""

from __future__ import annotations

import importlib
import sys

from gpufleet.cli.common import app

GROUPS = ("mesh", "jobs", "logtools", "queues", "operator", "schema", "bench", "tenants", "certs")
for _group in GROUPS:  # each registers its commands on the app, in the order `--help` lists them
    importlib.import_module(f"gpufleet.cli.{_group}")

__all__ = ["app", "main"]


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)

