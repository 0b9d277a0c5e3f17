"""Any client: a Go client (the standard library, nats.go and nkeys, nothing of gpufleet), written
only from docs/clients.md, docs/schemas/, README.md and docs/security.md (clients/go/), submits a
good job, bad specs and broken envelopes, and follows each to its end against a live mesh
(issue 17: an outside client in a second language beside clients/node/).

Needs `go` and the sources of nats.go and nkeys in a GOPATH (Debian's golang-go and
golang-github-nats-io-go-nats-dev, which `.ci/run` installs: /usr/share/gocode); the client is
built offline in GOPATH mode. Skips, saying why, without them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from gpufleet.shared.runtime.bus import Bus

from . import outside_clients as outside

CLIENT = Path(__file__).resolve().parent.parent / "clients" / "go"
SOURCE = CLIENT / "submit_and_follow.go"
NATS_PACKAGES = ("github.com/nats-io/nats.go", "github.com/nats-io/nkeys")


def go_path() -> str | None:
    """A GOPATH that holds the sources of nats.go and nkeys: $GOPATH's, else Debian's."""
    candidates = [p for p in os.environ.get("GOPATH", "").split(os.pathsep) if p] + ["/usr/share/gocode"]
    for root in candidates:
        if all((Path(root) / "src" / pkg).is_dir() for pkg in NATS_PACKAGES):
            return root
    return None


def go_env(gopath: str, cache: Path) -> dict[str, str]:
    """GOPATH mode (no module proxy needed: the packages' sources are on disk), offline."""
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": gopath, "GOFLAGS": "", "GOPROXY": "off"}
    if "GOCACHE" not in env and not (env.get("HOME") or env.get("XDG_CACHE_HOME")):
        env["GOCACHE"] = str(cache)
    return env


pytestmark = [
    pytest.mark.skipif(shutil.which("go") is None,
                       reason="no `go` on this machine (Debian: apt-get install golang-go)"),
    pytest.mark.skipif(go_path() is None,
                       reason="no nats.go / nkeys sources in $GOPATH or /usr/share/gocode "
                              "(Debian: apt-get install golang-github-nats-io-go-nats-dev)"),
]


@pytest.fixture(scope="session")
def go_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gopath = go_path()
    assert gopath is not None
    out = tmp_path_factory.mktemp("go-client")
    env = go_env(gopath, out / "cache")
    proc = subprocess.run(["go", "build", "-o", str(out / "submit_and_follow"), SOURCE.name], cwd=CLIENT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"go build failed:\n{proc.stderr[-3000:]}"
    return out / "submit_and_follow"


async def run_client(client: Path, url: str, spec: dict[str, Any], *extra: str,
                     timeout_s: float = 60) -> outside.Result:
    """The built client, as the tenant acme (tests/outside_clients.py)."""
    return await outside.run_outside_client([str(client)], url, spec, *extra, timeout_s=timeout_s)


def test_the_go_client_imports_only_the_standard_library_nats_and_nkeys(go_client: Path) -> None:
    gopath = go_path()
    assert gopath is not None
    proc = subprocess.run(["go", "list", "-f", "{{join .Imports \"\\n\"}}", SOURCE.name], cwd=CLIENT,
                          env=go_env(gopath, go_client.parent / "cache"), capture_output=True, text=True,
                          timeout=120, check=True)
    imports = [i for i in proc.stdout.split() if i]
    foreign = {i for i in imports if "." in i.split("/")[0] and i not in NATS_PACKAGES}
    assert imports and not foreign, foreign
    assert [p.name for p in CLIENT.glob("*.go")] == [SOURCE.name]  # one file, package main


async def test_a_go_client_submits_and_follows_its_job_to_the_end(bus: Bus, nats_url: str, go_client: Path) -> None:
    async with outside.one_node_mesh(bus, nats_url):
        result = await run_client(go_client, nats_url, outside.good_spec("from-go"), "--verdict")
    job_id = await outside.check_followed_to_the_end(bus, result)
    assert result[1][-1] == {"done": "job.succeeded", "job_id": job_id, "reasons": []}  # to the letter


async def test_a_go_client_is_told_which_field_of_a_bad_spec_is_wrong(bus: Bus, nats_url: str,
                                                                      go_client: Path) -> None:
    async with outside.one_node_mesh(bus, nats_url):  # one mesh for all three
        runs = [await run_client(go_client, nats_url, spec, "--verdict") for spec, _, _ in outside.BAD_SPECS]
    for (_, code, field), result in zip(outside.BAD_SPECS, runs, strict=True):
        await outside.check_rejected_spec(bus, result, code, field)


async def test_a_go_client_is_answered_on_its_job_when_its_envelope_is_broken(bus: Bus, nats_url: str,
                                                                             go_client: Path) -> None:
    spec = outside.BROKEN_ENVELOPE_SPEC
    run = partial(run_client, go_client, nats_url, spec, "--verdict", "--bad-envelope")
    async with outside.one_node_mesh(bus, nats_url):
        runs = {bad: await run(bad) for bad, _ in outside.BROKEN}
        letters = await outside.dead_letters(bus)
    await outside.check_broken_envelopes(bus, runs, letters)


async def test_a_go_client_without_a_readable_job_id_gets_only_a_dead_letter(bus: Bus, nats_url: str,
                                                                            go_client: Path) -> None:
    run = partial(run_client, go_client, nats_url, outside.BAD_JSON_SPEC)
    async with outside.one_node_mesh(bus, nats_url):
        outside.check_unanswered(await run("--bad-envelope", "bad-json", timeout_s=3))
        # asked for, the verdict says refused, with no events
        refused = await run("--verdict", "--bad-envelope", "bad-json", timeout_s=10)
        letters = await outside.dead_letters(bus)
    outside.check_refused_with_only_a_dead_letter(refused, letters)
