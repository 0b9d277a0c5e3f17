"""Any client: a plain-Python client (the standard library and nats-py, nothing of gpufleet),
written only from docs/clients.md and docs/schemas/ (clients/python/), submits a good job, a bad
spec and a bad envelope, and follows each to its end against a live mesh (issue 17: the second
outside client beside clients/node/)."""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from gpufleet.shared.runtime.bus import Bus

from . import outside_clients as outside

CLIENT = Path(__file__).resolve().parent.parent / "clients" / "python" / "submit_and_follow.py"
ALLOWED_IMPORTS = {"nats", "nkeys"}  # and the standard library


async def run_client(url: str, spec: dict[str, Any], *extra: str, timeout_s: float = 60) -> outside.Result:
    """As the tenant acme (tests/outside_clients.py), in a Python that has nats-py (this one) but
    with nothing of gpufleet on its path."""
    return await outside.run_outside_client([sys.executable, "-I", str(CLIENT)], url, spec, *extra,
                                            timeout_s=timeout_s, drop_env=("PYTHONPATH",), cwd=CLIENT.parent)


def test_the_client_imports_only_the_standard_library_and_nats() -> None:
    tree = ast.parse(CLIENT.read_text())
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports"
            roots.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            raise AssertionError("no dynamic imports")
    foreign = {r for r in roots if r not in sys.stdlib_module_names and r not in ALLOWED_IMPORTS}
    assert not foreign, foreign
    # and loaded, it brings in nothing of gpufleet (installed in this Python) either
    probe = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('client', sys.argv[1]); "
             "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
             "print(sorted(n for n in sys.modules if n.split('.')[0] in ('gpufleet', 'shared', 'services')))")
    out = subprocess.run([sys.executable, "-I", "-c", probe, str(CLIENT)], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]", out


async def test_a_python_client_submits_and_follows_its_job_to_the_end(bus: Bus, nats_url: str) -> None:
    async with outside.one_node_mesh(bus, nats_url):
        result = await run_client(nats_url, outside.good_spec("from-python"), "--verdict")
    await outside.check_followed_to_the_end(bus, result)


@pytest.mark.parametrize("spec,code,field", outside.BAD_SPECS)
async def test_a_python_client_is_told_which_field_of_a_bad_spec_is_wrong(
        bus: Bus, nats_url: str, spec: dict[str, Any], code: str, field: str) -> None:
    async with outside.one_node_mesh(bus, nats_url):  # a mesh for each
        result = await run_client(nats_url, spec, "--verdict")
    await outside.check_rejected_spec(bus, result, code, field)


async def test_a_python_client_is_answered_on_its_job_when_its_envelope_is_broken(bus: Bus, nats_url: str) -> None:
    run = partial(run_client, nats_url, outside.BROKEN_ENVELOPE_SPEC, "--verdict", "--bad-envelope")
    async with outside.one_node_mesh(bus, nats_url):
        runs = {bad: await run(bad) for bad, _ in outside.BROKEN}
        letters = await outside.dead_letters(bus)
    await outside.check_broken_envelopes(bus, runs, letters)


async def test_a_message_without_a_readable_job_id_gets_only_a_dead_letter(bus: Bus, nats_url: str) -> None:
    run = partial(run_client, nats_url, outside.BAD_JSON_SPEC)
    async with outside.one_node_mesh(bus, nats_url):
        outside.check_unanswered(await run("--bad-envelope", "bad-json", timeout_s=3))
        # asked for, the verdict says refused, with no events
        refused = await run("--verdict", "--bad-envelope", "bad-json", timeout_s=10)
        letters = await outside.dead_letters(bus)
    outside.check_refused_with_only_a_dead_letter(refused, letters)
