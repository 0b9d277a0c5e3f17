"""Any client: a JavaScript client (Node.js, the `nats` package from npm) submits a job by
publishing a schema-valid `cmd.submit` and follows its events to the end (clients/node/).

Needs `node` and `npm` (the test installs the package from clients/node/package-lock.json);
skips, saying why, without them.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gpufleet.shared.runtime.bus import Bus

from . import outside_clients as outside

CLIENT = Path(__file__).resolve().parent.parent / "clients" / "node"

pytestmark = pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None,
                                reason="no node / npm on this machine")


@pytest.fixture(scope="session")
def node_client() -> Path:
    if not (CLIENT / "node_modules" / "nats").exists():
        proc = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=CLIENT, capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            pytest.skip(f"npm ci failed (no registry?): {proc.stderr[-500:]}")
    return CLIENT / "submit-and-follow.mjs"


async def run_client(script: Path, url: str, spec: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """The script under node, as the tenant acme (tests/outside_clients.py)."""
    code, lines, _ = await outside.run_outside_client(["node", str(script)], url, spec, timeout_s=60)
    return code, lines


async def test_a_node_client_submits_and_follows_its_job_to_the_end(bus: Bus, nats_url: str,
                                                                   node_client: Path) -> None:
    async with outside.one_node_mesh(bus, nats_url):
        code, lines = await run_client(node_client, nats_url, outside.good_spec("from-node"))
    job_id = lines[0]["submitted"]
    types = [ln["type"] for ln in lines if "type" in ln]
    assert code == 0 and lines[-1] == {"done": "job.succeeded", "job_id": job_id}
    assert types[0] == "job.submitted" and types[-1] == "job.succeeded"
    for t in ("job.admitted", "job.quota_reserved", "job.placed", "job.started", "job.exited"):
        assert t in types, (t, types)
    seqs = [ln["seq"] for ln in lines if "seq" in ln and "type" in ln]
    assert seqs == sorted(seqs)  # in log order
    # what it published is a valid envelope by the published schema, and the services parsed it
    doc, headers = await outside.published(bus, lines[0]["seq"])
    jsonschema.validate(doc, outside.schema("cmd.submit"))
    assert doc["payload"]["job_id"] == job_id and headers.get("Nats-Msg-Id") == doc["event_id"]


async def test_a_node_client_is_told_why_a_bad_spec_is_rejected(bus: Bus, nats_url: str, node_client: Path) -> None:
    spec = {"name": "too-big", "tenant": "acme", "resources": {"gpu": 64}}  # no node has 64 GPUs
    async with outside.one_node_mesh(bus, nats_url):
        code, lines = await run_client(node_client, nats_url, spec)
    assert code == 1 and lines[-1]["done"] == "job.rejected"
