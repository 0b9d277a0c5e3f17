"""Cores are pure: no I/O, clock or randomness (time and ids come from ctx)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpufleet.shared.contract.ids import is_token

SERVICES = Path(__file__).resolve().parent.parent / "services"
FORBIDDEN = {"nats", "asyncpg", "pynvml", "aiodocker", "time", "random", "uuid", "datetime.datetime.now",
             "os", "socket", "subprocess", "asyncio", "faststream", "secrets"}


@pytest.mark.parametrize("core", sorted(SERVICES.glob("*/core.py")), ids=lambda p: p.parent.name)
def test_core_imports_nothing_impure(core: Path) -> None:
    tree = ast.parse(core.read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
            "now", "utcnow", "today", "time", "monotonic", "uuid4", "random"):
            raise AssertionError(f"{core}: reads the clock or randomness ({ast.unparse(node)})")
    assert not imported & FORBIDDEN, f"{core} imports {imported & FORBIDDEN}"


def test_every_service_has_a_core() -> None:
    names = {p.parent.name for p in SERVICES.glob("*/core.py")}
    assert names == {"admission", "quota", "placer", "executor", "telemetry", "guardian", "billing", "autoscaler"}


@pytest.mark.parametrize("bad", ["a.b", "a*", "a>", "a b", "$a", "", "a\n", "x" * 65, "é"])
def test_subject_tokens_refuse_what_nats_would_misread(bad: str) -> None:
    assert not is_token(bad)
