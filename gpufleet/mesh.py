"""The embedded mesh: nats-server, PostgreSQL and the services under one data dir, supervised.

    gpufleet up [--detach]    -> Supervisor.run(): start NATS, PostgreSQL, every service;
                                 restart a service that dies; write <data-dir>/mesh.json
    gpufleet down             -> SIGTERM to the supervisor, which stops everything in order
    python -m gpufleet.mesh supervise ...   (what `up --detach` runs in background)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.shared.contract.config import MESH_FILE, data_dir, write_private
from gpufleet.shared.embedded.procs import free_port, pid_alive, start_nats, stop_process
from gpufleet.shared.trust.authz import (
    ADMIN,
    NATS_CONF,
    Realm,
    ensure_realm,
    find_creds,
    load_creds,
    nats_config,
    write_nats_config,
)

log = logging.getLogger("gpufleet.mesh")

SERVICES = ("admission", "quota", "placer", "executor", "telemetry", "guardian", "billing", "autoscaler")
# How the services map onto processes. "grouped" (the default) co-locates the light services in
# one process sharing one consumer, so each event is delivered and parsed once there instead of
# six times; "separate" runs every service as its own process (as the distributed mode does).
LAYOUTS: dict[str, tuple[tuple[str, ...], ...]] = {
    "separate": tuple((name,) for name in SERVICES),
    # (telemetry's agent, sampling and leases, runs beside the group's loop in the same process)
    "grouped": (("admission", "quota", "guardian", "telemetry", "billing", "autoscaler"), ("placer",), ("executor",)),
}
RESTART_BACKOFF_S = (0.5, 1, 2, 5, 10)
OPEN_CONFIG = """\
# Written by `gpufleet up` without --config: the open default, explicit.
# Every tenant that has credentials (`gpufleet tenant add NAME`) may submit, to any queue, under
# the default policy, and an unknown queue is an implicit one without quota. To close the
# cluster, start it with `gpufleet up --config cluster.yaml` listing tenants and queues
# (docs/config.md); listing tenants sets openTenants: false.
openTenants: true
"""


def open_config() -> str:
    """The open default, with the prices it gets said out loud (it lists none, so the public list
    prices apply: shared/contract/clusterconfig.py LIST_PRICES, docs/billing.md)."""
    from gpufleet.shared.contract.clusterconfig import LIST_PRICES as P

    gpus = ", ".join(f"{m} {v}" for m, v in P.gpu_hour.items())
    return OPEN_CONFIG + (
        f"# No prices: block, so public on-demand list prices apply ({P.currency}, AWS us-east-1): per GPU-hour\n"
        f"# {gpus}; per CPU core-hour {P.cpu_core_hour}, per GiB-hour {P.memory_gib_hour}.\n"
        "# Your own rates: a prices: block (docs/billing.md) replaces the whole table.\n")


@dataclass
class MeshOptions:
    data_dir: Path
    sim_nodes: int = 16
    nats_port: int = 0
    pg_port: int = 0
    postgres: bool = True
    log_level: str = "INFO"
    layout: str = "grouped"
    config: Path | None = None  # cluster config (tenants, policies); copied into the data dir
    sim_mix: str = ""  # node shapes cycled over the sim nodes; '' = the default mix
    driver: str = "sim"  # process / docker: the executor runs jobs for real on this machine (one node)
    retention: str = ""  # FLEET's retention ('' keeps everything): older events are archived, then purged
    nats_cluster: int = 1  # nats-servers: 1, or a JetStream cluster of 3 (or 5) on loopback, FLEET at R3
    instances: int = 1  # 2: each service twice (separate layout): leased ones active/passive, placers side by side
    nats_netns: bool = False  # each clustered nats-server in a network namespace of its own (partitions: netns.py)
    # sim: the sim nodes split over this many executor processes (as GPU nodes each have their own):
    # one lost executor is a part of the fleet going silent, not all of it
    sim_executors: int = 1


@dataclass
class Child:
    name: str
    argv: list[str]
    services: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0


@dataclass
class Supervisor:
    opts: MeshOptions
    children: dict[str, Child] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.dir = self.opts.data_dir
        self.logs = self.dir / "logs"
        self.nats_proc: subprocess.Popen[bytes] | None = None
        self.cluster: list[dict[str, Any]] = []  # with --nats-cluster: each node's name, ports, config, process
        self.pg: Any = None
        self.nats_url = ""
        self.pg_dsn = ""
        self._stopping = False
        self.config_path: Path | None = None
        self.realm: Realm | None = None
        self._nats_conf: Path | None = None
        self.infra_restarts: dict[str, int] = {}
        self.lab: Any = None  # with --nats-netns: the NetLab the clustered servers run in
        self.node_ns: int | None = None  # ... and the namespace of the second sim node agent

    # -------------------------------------------------------------- mesh.json

    def write_mesh(self, state: str) -> None:
        doc = {
            "state": state,
            "supervisor_pid": os.getpid(),
            "data_dir": str(self.dir),
            "nats_url": self.nats_url,
            "pg_dsn": self.pg_dsn,
            "auth": "nkeys",
            "creds_dir": str(self.realm.creds_dir) if self.realm is not None else None,
            "sim_nodes": self.opts.sim_nodes,
            "started_at": time.time(),
            **({"netns": {"owner": self.lab.owner, "n": self.lab.n, "net": str(self.lab.net), "node_ns": self.node_ns}}
               if self.lab is not None else {}),
            "parts": {
                "nats": {"pid": self.nats_proc.pid if self.nats_proc else None,
                         "restarts": self.infra_restarts.get("nats", 0)},
                **{n["name"]: {"pid": n["proc"].pid, "restarts": self.infra_restarts.get(n["name"], 0),
                               "port": n["port"], "server_name": n["server_name"]}
                   for n in self.cluster[1:]},
                **({"postgres": {"pid": self.pg.running_pid(), "restarts": self.infra_restarts.get("postgres", 0)}}
                   if self.pg is not None else {}),
                **{
                    svc + (c.name[c.name.index("@"):] if "@" in c.name else ""):
                        {"pid": c.proc.pid if c.proc else None, "restarts": c.restarts, "process": c.name}
                    for c in self.children.values() for svc in (c.services or (c.name,))
                },
            },
        }
        # the owner's only: it names the PostgreSQL endpoint (a job on this host must not find it)
        write_private(self.dir / MESH_FILE, json.dumps(doc, indent=2))

    # -------------------------------------------------------------- start / stop

    def start_infra(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        from gpufleet.shared.runtime.archive import ARCHIVE_DIR_ENV, RETENTION_ENV

        # the stream's config (no purge unless a retention is set), every reader and the archive
        # process read these; the children inherit them
        os.environ[ARCHIVE_DIR_ENV] = str(self.dir / "archive")
        if self.opts.retention:
            os.environ[RETENTION_ENV] = self.opts.retention
        else:
            os.environ.pop(RETENTION_ENV, None)
        if self.opts.config is not None:
            from gpufleet.shared.contract.clusterconfig import load_config

            load_config(self.opts.config)  # refuse a bad config before anything starts
            self.config_path = self.dir / "cluster.yaml"
            self.config_path.write_text(Path(self.opts.config).read_text())
        else:
            # the open default, said out loud: in the config the services run with, and at start
            self.config_path = self.dir / "cluster.yaml"
            self.config_path.write_text(open_config())
            log.warning("open cluster: any tenant with credentials may submit, to any queue, without limits "
                        "(%s; give `gpufleet up --config` tenants and queues to close it: docs/config.md)",
                        self.config_path)
        self.logs.mkdir(exist_ok=True)
        port = self.opts.nats_port or free_port()
        # identities for every service process, the admin and the configured tenants; the server
        # admits only them, each with the permissions shared/trust/authz.py generates (docs/security.md)
        self.realm = ensure_realm(self.dir, tenants=self._config_tenants())
        if self.opts.nats_cluster > 1:
            self._start_cluster()
        else:
            conf = write_nats_config(self.dir / NATS_CONF, nats_config(self.dir / "nats", port, self.realm))
            self._nats_conf = conf
            self.nats_proc = start_nats(self.dir / "nats", port, log_file=self.logs / "nats.log", config=conf)
            self.nats_url = f"nats://127.0.0.1:{port}"
        log.info("nats-server up at %s (auth: %d identities, creds in %s)", self.nats_url,
                 len(self.realm.identities), self.realm.creds_dir)
        asyncio.run(_create_streams(self.nats_url, self.realm.creds_path(ADMIN)))
        if self.opts.postgres:
            from gpufleet.shared.embedded.pg import EmbeddedPostgres

            self.pg = EmbeddedPostgres(self.dir / "postgres", self.opts.pg_port or free_port())
            self.pg.start()
            self.pg_dsn = self.pg.dsn
            log.info("postgres up at %s", self.pg_dsn)

    def _config_tenants(self) -> list[str]:
        if self.opts.config is None:
            return []
        from gpufleet.shared.contract.clusterconfig import load_config

        return sorted(load_config(self.opts.config).tenants)

    def _start_cluster(self) -> None:
        """A JetStream cluster of `nats_cluster` servers on loopback (routes between them on
        127.0.0.1: no TLS, the traffic never leaves the machine), FLEET and every bucket at R3.
        With `nats_netns`, each server in a network namespace of its own on one bridge
        (shared/embedded/netns.py), so that a partition between them is a real one."""
        from gpufleet.shared.trust.authz import cluster_nats_config

        assert self.realm is not None
        n = self.opts.nats_cluster
        if self.opts.nats_netns:
            from gpufleet.shared.embedded import netns

            why = netns.available()
            if why is not None:
                raise SystemExit(f"--nats-netns: {why}")
            netns.sweep()
            # with several sim node agents, the second runs in a namespace of its own too, so that
            # a node can be cut from NATS (bench chaos `cut_node`) while the control plane is not
            agent_ns = self.opts.sim_executors > 1 and self.opts.driver == "sim"
            self.lab = netns.NetLab(n + (1 if agent_ns else 0)).create()
            self.node_ns = n + 1 if agent_ns else None
        hosts = [self.lab.addr(i + 1) if self.lab is not None else "127.0.0.1" for i in range(n)]
        ports = [(self.opts.nats_port + i if self.opts.nats_port else free_port(), free_port()) for i in range(n)]
        routes = [f"nats://{h}:{rp}" for h, (_, rp) in zip(hosts, ports, strict=True)]
        for i, (cp, rp) in enumerate(ports):
            name = "nats" if i == 0 else f"nats-{i + 1}"
            store = self.dir / "nats-cluster" / f"nats-{i + 1}"
            conf = write_nats_config(self.dir / f"nats-{i + 1}.conf", cluster_nats_config(
                self.realm, f"nats-{i + 1}", store, cp, rp, routes, None, host=hosts[i], lab=self.lab is not None))
            node = {"name": name, "server_name": f"nats-{i + 1}", "index": i + 1, "host": hosts[i], "port": cp,
                    "conf": conf, "store": store}
            self.cluster.append(node)
            node["proc"] = self._start_node(node)
        self.nats_proc = self.cluster[0]["proc"]
        self.nats_url = ",".join(f"nats://{c['host']}:{c['port']}" for c in self.cluster)
        os.environ["GPUFLEET_STREAM_REPLICAS"] = str(min(n, 3))  # the supervisor's streams and every child's buckets

    def _start_node(self, node: dict[str, Any]) -> subprocess.Popen[bytes]:
        lab = self.lab
        return start_nats(node["store"], node["port"], log_file=self.logs / f"{node['server_name']}.log",
                          config=node["conf"], host=node["host"],
                          wrap=(lambda argv: lab.argv(node["index"], argv)) if lab is not None else None)

    def child_creds(self, services: tuple[str, ...]) -> Path:
        name = "-".join(services)  # (the read model's and the view's are named after them too)
        assert self.realm is not None, "start_infra makes the realm"
        return self.realm.creds_path(f"svc-{name}")

    def child_argv(self, services: tuple[str, ...]) -> list[str]:
        py = sys.executable
        common = ["--nats-url", self.nats_url, "--log-level", self.opts.log_level]
        if self.config_path is not None:
            common += ["--config", str(self.config_path)]
        if services == ("readmodel",):
            return [py, "-m", "gpufleet.shared.read.readmodel", "--nats", self.nats_url, "--dsn", self.pg_dsn]
        if services == ("archive",):  # with a retention: archive, then purge (shared/runtime/archive.py)
            return [py, "-m", "gpufleet.shared.runtime.archive", "--nats-url", self.nats_url, "--log-level", self.opts.log_level]
        if services == ("view",):  # view snapshots, at a low priority (gpufleet/tools/viewsnap.py)
            return [py, "-m", "gpufleet.tools.viewsnap", "--nats-url", self.nats_url, "--log-level", self.opts.log_level]
        if len(services) == 1:
            argv = [py, "-m", f"gpufleet.services.{services[0]}", *common]
        else:
            argv = [py, "-m", "gpufleet.shared.runtime.service", *services, *common]
        if "executor" in services and self.opts.driver != "sim":
            argv += ["--driver", self.opts.driver, "--data-dir", str(self.dir)]
        elif "executor" in services:
            argv += ["--sim-nodes", str(self.opts.sim_nodes)]
            if self.opts.sim_mix:
                argv += ["--sim-mix", self.opts.sim_mix]
        return argv

    def spawn(self, child: Child) -> None:
        out = open(self.logs / f"{child.name}.log", "ab")  # noqa: SIM115 - handed to the child
        # checkpoints live under the data dir (persistent), unless the environment names a root
        env = {"GPUFLEET_CHECKPOINT_ROOT": str(self.dir / "checkpoints"), **os.environ}
        env["GPUFLEET_CREDS"] = str(self.child_creds(child.services or (child.name,)))
        if self.pg_dsn:
            env["GPUFLEET_PG_DSN"] = self.pg_dsn  # billing's ledger writes to it (services/billing/ledger.py)
        child.proc = subprocess.Popen(child.argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        child.started_at = time.monotonic()
        out.close()

    def start_services(self) -> None:
        groups = [*LAYOUTS[self.opts.layout], *([("readmodel",)] if self.opts.postgres else []), ("view",),
                  *([("archive",)] if self.opts.retention else [])]
        from gpufleet.shared.runtime.lease import LEASED

        for services in groups:
            name = "+".join(services)
            if services == ("executor",) and self.opts.driver == "sim" and self.opts.sim_executors > 1:
                self._start_sim_executors()
                continue
            twice = self.opts.instances > 1 and len(services) == 1 and (
                services[0] in LEASED or services[0] in ("placer", "telemetry"))
            for i in range(2 if twice else 1):
                argv = self.child_argv(services)
                if twice:
                    # a leased service: one decides, one waits (shared/runtime/lease.py); placers: side by side,
                    # each with its own consumer, their capacity decisions compare-and-set
                    argv += ["--instance", str(i), *(["--lease"] if services[0] in LEASED else [])]
                child = Child(name if i == 0 else f"{name}@{i}", argv, services)
                self.children[child.name] = child
                self.spawn(child)

    def _start_sim_executors(self) -> None:
        """The sim nodes split over `sim_executors` processes: executor i hosts its share under the
        prefix `sim` (i = 0) or `sim<i>`, as instance i (a durable and a snapshot of its own); only
        the first provides the autoscaler's sim pools."""
        k, n = self.opts.sim_executors, self.opts.sim_nodes
        for i in range(k):
            share = n // k + (1 if i < n % k else 0)
            argv = self.child_argv(("executor",))
            at = argv.index("--sim-nodes")
            argv[at + 1] = str(share)
            if i:
                argv += ["--node-prefix", f"sim{i}", "--instance", str(i), "--no-sim-pools"]
            if i == 1 and self.lab is not None and self.node_ns is not None:
                argv = self.lab.argv(self.node_ns, argv)  # a node that can be cut from NATS
            child = Child("executor" if i == 0 else f"executor@{i}", argv, ("executor",))
            self.children[child.name] = child
            self.spawn(child)

    def check_infra(self) -> None:
        """nats-server or PostgreSQL died: start it again, on the same port with the same store
        (the services reconnect by themselves); counted in mesh.json."""
        if self._stopping:
            return
        for node in self.cluster:  # a clustered node: the same port and store, it rejoins
            if node["proc"].poll() is not None:
                log.warning("%s exited with %s; restarting it", node["server_name"], node["proc"].returncode)
                self.infra_restarts[node["name"]] = self.infra_restarts.get(node["name"], 0) + 1
                node["proc"] = self._start_node(node)
                if node["name"] == "nats":
                    self.nats_proc = node["proc"]
                self.write_mesh("running")
        if self.nats_proc is not None and self.nats_proc.poll() is not None and self._nats_conf is not None:
            log.warning("nats-server exited with %s; restarting it", self.nats_proc.returncode)
            self.infra_restarts["nats"] = self.infra_restarts.get("nats", 0) + 1
            port = int(self.nats_url.rsplit(":", 1)[1])
            self.nats_proc = start_nats(self.dir / "nats", port, log_file=self.logs / "nats.log", config=self._nats_conf)
            self.write_mesh("running")
        if self.pg is not None and self.pg.running_pid() is None:
            log.warning("PostgreSQL is not running; starting it again")
            _reap_children()  # a killed postmaster left as a zombie still holds its lock file
            try:
                self.pg.start()
            except Exception:  # noqa: BLE001 - try again at the next check
                log.exception("starting PostgreSQL again")
                return
            self.infra_restarts["postgres"] = self.infra_restarts.get("postgres", 0) + 1
            self.write_mesh("running")

    def check_children(self) -> None:
        """Restart a service that died, with backoff; every restart is counted in mesh.json."""
        self.check_infra()
        for child in self.children.values():
            if child.proc is not None and child.proc.poll() is not None and not self._stopping:
                wait = RESTART_BACKOFF_S[min(child.restarts, len(RESTART_BACKOFF_S) - 1)]
                if time.monotonic() - child.started_at < wait:
                    continue
                log.warning("%s exited with %s; restarting", child.name, child.proc.returncode)
                child.restarts += 1
                self.spawn(child)
                self.write_mesh("running")

    def stop_all(self) -> None:
        self._stopping = True
        for child in self.children.values():
            if child.proc and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in self.children.values():
            if child.proc:
                stop_process(child.proc, timeout_s=10)
        if self.pg is not None:
            try:
                self.pg.stop()
            except Exception:  # noqa: BLE001 - keep stopping the rest
                log.exception("stopping postgres")
        if self.nats_proc is not None:
            stop_process(self.nats_proc)
        for node in self.cluster[1:]:
            stop_process(node["proc"])
        if self.lab is not None:
            self.lab.destroy()
        try:
            (self.dir / MESH_FILE).unlink()
        except FileNotFoundError:
            pass

    def run(self, on_ready: Any = None) -> None:
        stop = {"flag": False}

        def handler(signum: int, frame: Any) -> None:
            stop["flag"] = True

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        try:
            self.start_infra()
            self.start_services()
            self.write_mesh("starting")
            wait_services_ready(self.nats_url, timeout_s=90, layout=self.opts.layout, data_dir=self.dir,
                                meanwhile=self.check_children,
                                also={f"executor-{i}" for i in range(1, self.opts.sim_executors)}
                                if self.opts.driver == "sim" else set())
            self.write_mesh("running")
            if on_ready:
                on_ready(self)
            while not stop["flag"]:
                time.sleep(0.5)
                self.check_children()
        finally:
            self.stop_all()


async def _create_streams(nats_url: str, admin_creds: Path) -> None:
    """The admin creates the streams (a service may not): before any service starts."""
    from gpufleet.shared.runtime.bus import Bus

    bus = await Bus.connect(nats_url, name="gpufleet-supervisor", creds=admin_creds)
    try:
        deadline = time.monotonic() + 90
        while True:  # a fresh cluster elects its JetStream leader first: wait for it, saying so
            try:
                await bus.ensure_streams()
                return
            except Exception as exc:  # noqa: BLE001 - no quorum yet: "insufficient resources", timeouts
                if time.monotonic() > deadline:
                    raise
                log.info("creating the streams: %s (the cluster may not have its leader yet); again", exc)
                await asyncio.sleep(0.5)
    finally:
        await bus.close()


def durables(layout: str) -> set[str]:
    """The durable consumer each process of a layout creates (after its fold)."""
    return {group[0] if len(group) == 1 else "group-" + "-".join(group) for group in LAYOUTS[layout]}


def wait_services_ready(nats_url: str, timeout_s: float, layout: str = "grouped",
                        data_dir: Path | None = None, meanwhile: Any = None, also: set[str] | None = None) -> None:
    """Ready = every process's durable consumer exists (each creates it after folding; `also`
    names more). `meanwhile` runs at each look (the supervisor restarts a service that died starting)."""
    expected = durables(layout) | (also or set())
    import nats

    async def check() -> None:
        deadline = time.monotonic() + timeout_s
        admin = Realm(data_dir).creds_path(ADMIN) if data_dir is not None else None
        ident = load_creds(admin) if admin is not None and admin.exists() else find_creds()
        nc = await nats.connect([u for u in nats_url.split(",") if u], **(ident.connect_options() if ident else {}))
        try:
            js = nc.jetstream()
            while True:
                try:
                    names = {c.name async for c in _consumers(js)}
                except Exception:  # noqa: BLE001 - stream not there yet
                    names = set()
                if expected <= names:
                    return
                if meanwhile is not None:
                    meanwhile()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"services not ready after {timeout_s}s: missing {expected - names}")
                await asyncio.sleep(0.2)
        finally:
            await nc.close()

    asyncio.run(check())


async def _consumers(js: Any) -> Any:
    for info in await js.consumers_info("FLEET"):
        yield info


def running_supervisor(ddir: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((ddir / MESH_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return doc if pid_alive(int(doc.get("supervisor_pid", 0))) else None


def up_detached(opts: MeshOptions, timeout_s: float = 90.0) -> dict[str, Any]:
    opts.data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "gpufleet.mesh", "supervise", "--data-dir", str(opts.data_dir),
        "--sim-nodes", str(opts.sim_nodes), "--nats-port", str(opts.nats_port), "--pg-port", str(opts.pg_port),
        "--log-level", opts.log_level, "--layout", opts.layout, "--sim-mix", opts.sim_mix, "--driver", opts.driver,
        "--retention", opts.retention, "--nats-cluster", str(opts.nats_cluster), "--instances", str(opts.instances),
        "--sim-executors", str(opts.sim_executors),
        *(["--nats-netns"] if opts.nats_netns else []),
        *(["--config", str(Path(opts.config).resolve())] if opts.config else []), *([] if opts.postgres else ["--no-postgres"]),
    ]
    (opts.data_dir / "logs").mkdir(exist_ok=True)
    out = open(opts.data_dir / "logs" / "supervisor.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            stdin=subprocess.DEVNULL)
    out.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"supervisor exited with {proc.returncode}; see {opts.data_dir / 'logs' / 'supervisor.log'}")
        doc = running_supervisor(opts.data_dir)
        if doc and doc.get("state") == "running":
            return doc
        time.sleep(0.2)
    raise TimeoutError(f"mesh not running after {timeout_s}s; see {opts.data_dir / 'logs'}")


def down(ddir: Path, timeout_s: float = 60.0) -> bool:
    """Stop the mesh of this data dir; False if none was running."""
    try:
        doc = json.loads((ddir / MESH_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    pid = int(doc.get("supervisor_pid", 0))
    if pid and pid_alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
            _reap(pid)
        if not pid_alive(pid):
            return True
    # the supervisor is gone: stop what it left behind
    for part in doc.get("parts", {}).values():
        p = part.get("pid")
        if p and pid_alive(int(p)):
            os.kill(int(p), signal.SIGTERM)
    if doc.get("netns"):  # its NATS nodes ran in network namespaces: remove them once the servers stop
        from gpufleet.shared.embedded import netns

        deadline = time.monotonic() + 10
        while any(pid_alive(int(p["pid"])) for n, p in doc.get("parts", {}).items()
                  if (n == "nats" or n.startswith("nats-")) and p.get("pid")) and time.monotonic() < deadline:
            time.sleep(0.1)
        netns.sweep()
    (ddir / MESH_FILE).unlink(missing_ok=True)
    return True


def _reap_children() -> None:
    """Collect every child that has exited (without blocking)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m gpufleet.mesh")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("supervise")
    sp.add_argument("--data-dir", required=True)
    sp.add_argument("--sim-nodes", type=int, default=16)
    sp.add_argument("--nats-port", type=int, default=0)
    sp.add_argument("--pg-port", type=int, default=0)
    sp.add_argument("--no-postgres", action="store_true")
    sp.add_argument("--log-level", default="INFO")
    sp.add_argument("--layout", default="grouped", choices=sorted(LAYOUTS))
    sp.add_argument("--config", default=None)
    sp.add_argument("--sim-mix", default="")
    sp.add_argument("--driver", default="sim", choices=("sim", "process", "docker"))
    sp.add_argument("--retention", default="")
    sp.add_argument("--nats-cluster", type=int, default=1)
    sp.add_argument("--instances", type=int, default=1)
    sp.add_argument("--nats-netns", action="store_true")
    sp.add_argument("--sim-executors", type=int, default=1)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    opts = MeshOptions(Path(args.data_dir), args.sim_nodes, args.nats_port, args.pg_port,
                       not args.no_postgres, args.log_level, args.layout,
                       Path(args.config) if args.config else None, args.sim_mix, args.driver, args.retention,
                       args.nats_cluster, args.instances, args.nats_netns, args.sim_executors)
    Supervisor(opts).run()


if __name__ == "__main__":
    main()


__all__ = ["MeshOptions", "Supervisor", "data_dir", "down", "running_supervisor", "up_detached"]
