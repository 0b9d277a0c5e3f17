"""docker-compose.yml run without Docker: every container a process in a network namespace of its own.

Where a machine has no Docker engine that can pull images (the CI machine reaches no registry),
the shipped compose file still has to be shown to run: the same services with the same
commands, environment, NATS configs (TLS between the servers and to the clients, the generated
authorization), identities and start order. `ComposeProcesses` reads docker-compose.yml and
runs each service as the image would run it:

- **network**: a namespace per container on one bridge (`NetLab`), and a hosts file per
  namespace (`/etc/netns/<ns>/hosts`, which `ip netns exec` puts over /etc/hosts) naming every
  service, its hostname and its network aliases (`nats`: the three NATS nodes), as Docker's DNS
  would. PostgreSQL runs on the host's end of the bridge under the name `postgres`.
- **volumes**: each container's bind mounts and named volumes are laid out under a root of its
  own (`roots/<service>/<target>`), and the target paths in its command, environment and in the
  files it is given (the NATS config names its certificates and its store) are rewritten to
  them. `./deploy/generated/` (never committed) is generated first, as the compose header says:
  `gpufleet certs make` and `gpufleet certs authorization`.
- **images**: `gpufleet:dev` is the Dockerfile's `python -m` (this interpreter, this checkout);
  `nats:*` is nats-server from the venv; `postgres:*` the embedded PostgreSQL.
- **order**: `depends_on` with `service_healthy` waits for the dependency's health check (run as
  the compose file says, in its namespace: deploy/healthcheck.py for the services, /healthz for
  NATS) and `service_completed_successfully` for its exit 0.

Needs root and iproute2 (`netns.available()` says why not).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpufleet.shared.embedded.netns import NetLab

REPO = Path(__file__).resolve().parent.parent.parent
GENERATED = "./deploy/generated/"
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


class ComposeFailed(RuntimeError):
    """A container did not start, a health check never passed, or a one-shot job failed."""


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """`${VAR}` and `${VAR:-default}` in every string, as compose does."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def load(path: Path, env: Mapping[str, str]) -> dict[str, Any]:
    doc = interpolate(yaml.safe_load(path.read_text()), env)  # (anchors and `<<` merges: YAML's own)
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
        raise ComposeFailed(f"{path}: no services")
    return doc


def volumes_of(svc: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of every volume: a bind's path as written, a named volume's name."""
    out = []
    for v in svc.get("volumes") or ():
        if isinstance(v, str):
            src, dst = v.split(":")[:2]
        else:
            src, dst = str(v["source"]), str(v["target"])
        out.append((src, dst))
    return out


@dataclass
class Container:
    name: str
    spec: dict[str, Any]
    index: int  # its namespace in the lab
    root: Path
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    targets: dict[str, Path] = field(default_factory=dict)  # container path -> where it lies here

    def rewrite(self, text: str) -> str:
        """Every target path (or a path under one) in `text`, as where it lies here."""
        for target in sorted(self.targets, key=len, reverse=True):
            text = re.sub(rf"(?<![\w./-]){re.escape(target)}(?=[/\"'\s,;:]|$)", str(self.targets[target]), text)
        return text


class ComposeProcesses:
    """`with ComposeProcesses(work).up() as c:` ... `c.client_argv([...])`; stopped at the end."""

    def __init__(self, work: Path, compose: Path = REPO / "docker-compose.yml",
                 env: Mapping[str, str] | None = None, progress: Any = None) -> None:
        self.work = work.absolute()
        self.env = {**os.environ, **(env or {})}
        self.doc = load(compose, self.env)
        self.say = progress or (lambda msg: None)
        names = [n for n, s in self.doc["services"].items() if not str(s.get("image", "")).startswith("postgres")]
        self.pg_name = next((n for n, s in self.doc["services"].items()
                             if str(s.get("image", "")).startswith("postgres")), None)
        self.lab = NetLab(len(names) + 1)  # (+1: the client's namespace, last)
        self.containers = {n: Container(n, self.doc["services"][n], i + 1, self.work / "roots" / n)
                           for i, n in enumerate(names)}
        self.pg: Any = None
        self.generated = self.work / "generated"

    # ------------------------------------------------------------ set-up

    def _generate(self) -> None:
        """deploy/generated/, as the compose file's header says (certificates, authorization, identities)."""
        gf = [sys.executable, "-m", "gpufleet.cli"]
        nats = sorted(n for n, s in self.doc["services"].items() if str(s.get("image", "")).startswith("nats"))
        aliases = sorted({a for n in nats for a in self._aliases(n)})
        for argv in ([*gf, "certs", "make", "--out", str(self.generated / "certs"), *[a for n in nats for a in
                      ("--server", n)], *[a for h in aliases for a in ("--host", h)]],
                     [*gf, "certs", "authorization", "--realm", str(self.generated),
                      "--out", str(self.generated / "nats" / "authorization.conf")]):
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
            if proc.returncode != 0:
                raise ComposeFailed(f"{' '.join(argv[2:4])}: {proc.stderr.strip()[-500:]}")

    def _aliases(self, name: str) -> list[str]:
        nets = self.doc["services"][name].get("networks") or {}
        out = []
        for net in nets.values() if isinstance(nets, dict) else ():
            out += list((net or {}).get("aliases") or ())
        return out

    def _source(self, src: str) -> Path:
        if src.startswith(GENERATED):
            return self.generated / src.removeprefix(GENERATED)
        if src.startswith(("./", "../", "/")):
            return (REPO / src).resolve()
        vol = self.work / "volumes" / src  # a named volume: a directory of its own
        vol.mkdir(parents=True, exist_ok=True)
        return vol

    def _lay_out(self, c: Container) -> None:
        """Each volume under the container's root at its target path: a link to its source, or, for
        a config file, a copy with the container's paths in it rewritten (the NATS config names its
        certificates, its authorization and its store by their paths in the container)."""
        mounts = [(self._source(src), dst) for src, dst in volumes_of(c.spec)]
        for source, dst in mounts:
            if not source.exists():
                raise ComposeFailed(f"{c.name}: the volume for {dst} has no source ({source})")
            c.targets[dst] = c.root / dst.lstrip("/")
        for source, dst in mounts:
            here = c.targets[dst]
            here.parent.mkdir(parents=True, exist_ok=True)
            if source.is_file() and source.suffix in (".conf", ".yaml", ".yml", ".json"):
                here.write_text(c.rewrite(source.read_text()))
            else:
                here.symlink_to(source, target_is_directory=source.is_dir())
        (c.root / "home").mkdir(parents=True, exist_ok=True)

    def _hosts(self) -> None:
        lines = ["127.0.0.1 localhost"]
        for c in self.containers.values():
            names = {c.name, str(c.spec.get("hostname") or c.name), *self._aliases(c.name)}
            lines += [f"{self.lab.addr(c.index)} {n}" for n in sorted(names)]
        if self.pg_name:
            lines.append(f"{self.lab.host_addr} {self.pg_name}")
        for i in range(1, self.lab.n + 1):
            d = Path("/etc/netns") / self.lab.ns(i)
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("\n".join(lines) + "\n")

    # ------------------------------------------------------------ running

    def _argv(self, c: Container) -> list[str]:
        spec = c.spec
        image = str(spec.get("image", ""))
        entry = spec.get("entrypoint")
        cmd = spec.get("command") or []
        entry = [entry] if isinstance(entry, str) else list(entry or [])
        cmd = [cmd] if isinstance(cmd, str) else list(cmd)
        if image.startswith("nats"):
            entry = entry or ["nats-server"]
        elif not entry:
            entry = ["python", "-m"]  # the Dockerfile's ENTRYPOINT
        exe = {"python": sys.executable, "nats-server": str(Path(sys.executable).parent / "nats-server")}
        argv = [exe.get(entry[0], entry[0]), *entry[1:], *cmd]
        return [c.rewrite(a) if not a.startswith(("import ", "\n")) and "\n" not in a else a for a in argv]

    def _environ(self, c: Container) -> dict[str, str]:
        env = {k: str(v) for k, v in (c.spec.get("environment") or {}).items()}
        env = {k: c.rewrite(v) for k, v in env.items()}
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TMPDIR")}
        return {**keep, "PYTHONUNBUFFERED": "1", "HOME": str(c.root / "home"),
                "GPUFLEET_DATA_DIR": str(c.root / "home" / ".gpufleet"), **env}

    def _start(self, c: Container) -> None:
        c.log = self.work / "logs" / f"{c.name}.log"
        c.log.parent.mkdir(parents=True, exist_ok=True)
        with c.log.open("ab") as out:
            c.proc = subprocess.Popen(self.lab.argv(c.index, self._argv(c)), stdout=out, stderr=subprocess.STDOUT,
                                      env=self._environ(c), cwd=c.root, start_new_session=True)
        self.say(f"started {c.name} (pid {c.proc.pid}) at {self.lab.addr(c.index)}")

    def _healthy(self, c: Container) -> bool:
        test = list((c.spec.get("healthcheck") or {}).get("test") or [])
        if test[:1] == ["CMD"]:
            test = test[1:]
        if not test:
            return c.proc is not None and c.proc.poll() is None
        if test[0] == "wget":  # (the NATS image's: /healthz over HTTP, from inside its namespace)
            url = test[-1].replace("127.0.0.1", self.lab.addr(c.index))
            try:
                with urllib.request.urlopen(url, timeout=3) as r:  # noqa: S310 - our own address
                    return bool(r.status == 200)
            except OSError:
                return False
        argv = [sys.executable if test[0] == "python" else test[0], *test[1:]]
        argv = [str(REPO / "deploy" / "healthcheck.py") if a == "/opt/gpufleet-deploy/healthcheck.py" else a
                for a in argv]
        proc = subprocess.run(self.lab.argv(c.index, argv), capture_output=True, env=self._environ(c), timeout=60)
        return proc.returncode == 0

    def _wait(self, name: str, condition: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        if name == self.pg_name:
            return  # started before every container (below): accepting by then
        c = self.containers[name]
        while time.monotonic() < deadline:
            if condition == "service_completed_successfully":
                assert c.proc is not None
                rc = c.proc.poll()
                if rc == 0:
                    return
                if rc is not None:
                    raise ComposeFailed(f"{name} exited {rc}: {self.tail(name)}")
            else:
                if c.proc is not None and c.proc.poll() is not None:
                    raise ComposeFailed(f"{name} exited {c.proc.returncode}: {self.tail(name)}")
                if self._healthy(c):
                    return
            time.sleep(1.0)
        raise ComposeFailed(f"{name} not {condition} within {timeout_s:.0f} s: {self.tail(name)}")

    def tail(self, name: str, n: int = 15) -> str:
        c = self.containers.get(name)
        if c is None or c.log is None or not c.log.exists():
            return ""
        return " | ".join(c.log.read_text(errors="replace").splitlines()[-n:])

    def _order(self) -> list[str]:
        done: list[str] = []
        def visit(n: str, path: tuple[str, ...] = ()) -> None:
            if n in done or n == self.pg_name:
                return
            if n in path:
                raise ComposeFailed(f"depends_on cycle: {' -> '.join((*path, n))}")
            for dep in self._deps(n):
                visit(dep, (*path, n))
            done.append(n)
        for n in self.containers:
            visit(n)
        return done

    def _deps(self, name: str) -> dict[str, str]:
        deps = self.doc["services"][name].get("depends_on") or {}
        if isinstance(deps, list):
            return {d: "service_started" for d in deps}
        return {d: str((v or {}).get("condition", "service_started")) for d, v in deps.items()}

    @contextmanager
    def up(self) -> Iterator[ComposeProcesses]:
        self.work.mkdir(parents=True, exist_ok=True)
        self._generate()
        self.lab.create()
        try:
            self._hosts()
            if self.pg_name:
                self._start_postgres()
            for c in self.containers.values():
                self._lay_out(c)
            for name in self._order():
                for dep, condition in self._deps(name).items():
                    if condition != "service_started":
                        self._wait(dep, condition)
                self._start(self.containers[name])
            for name, c in self.containers.items():  # every long-running one healthy, as `compose up --wait`
                if c.spec.get("restart") != "no":
                    self._wait(name, "service_healthy")
            yield self
        finally:
            self.down()

    def _start_postgres(self) -> None:
        from gpufleet.shared.embedded.pg import EmbeddedPostgres

        assert self.pg_name is not None
        spec = self.doc["services"][self.pg_name]
        env = {k: str(v) for k, v in (spec.get("environment") or {}).items()}
        port = int(str((spec.get("ports") or ["5432:5432"])[0]).rsplit(":", 1)[-1])
        self.pg = EmbeddedPostgres(self.work / "volumes" / "postgres", port, fsync=False,
                           user=env.get("POSTGRES_USER", "postgres"), database=env.get("POSTGRES_DB", "postgres"),
                           also_listen=self.lab.host_addr, allow=str(self.lab.net))
        self.pg.start()
        self.say(f"started {self.pg_name} at {self.lab.host_addr}:{port}")

    def client_argv(self, argv: list[str]) -> list[str]:
        """`argv` run in a namespace of the lab (the names resolve as in the containers)."""
        return self.lab.argv(self.lab.n, argv)

    def down(self) -> None:
        for c in self.containers.values():
            if c.proc is not None and c.proc.poll() is None:
                os.killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for c in self.containers.values():
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait(10)
        if self.pg is not None:
            self.pg.stop()
        self.lab.destroy()
        for i in range(1, self.lab.n + 1):
            shutil.rmtree(Path("/etc/netns") / self.lab.ns(i), ignore_errors=True)
