"""The shipped deploy files: `deploy/validate.sh` (YAML, every NATS config through `nats-server -t`
with generated identities and certificates, generated files kept out of git, ruff) runs here,
so CI runs it on every change."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_deploy_validate_sh_passes() -> None:
    venv = Path(sys.executable).parent
    env = {**os.environ, "PY": sys.executable, "NATS": str(venv / "nats-server"), "RUFF": str(venv / "ruff")}
    proc = subprocess.run(["bash", "deploy/validate.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "== deploy files valid" in proc.stdout and proc.stdout.count("nats-server -t") >= 1
    for conf in sorted((REPO / "deploy" / "nats").glob("*.conf")):
        assert f"deploy/nats/{conf.name}" in proc.stdout, f"{conf.name} was not checked"
