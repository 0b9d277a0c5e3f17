"""Distributed mode's TLS (issue 14): the test PKI (shared/trust/tls.py, `gpufleet certs make`), the
cluster config (shared/trust/authz.py `cluster_nats_config`), a real nats-server that requires TLS and
the generated authorization, and (slow) a 3-node JetStream cluster with mutual TLS on its routes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import ssl
import stat
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from typer.testing import CliRunner

from gpufleet.cli import app
from gpufleet.shared.contract.events import STREAM, TELEMETRY_STREAM, parse_envelope
from gpufleet.shared.embedded.procs import free_port, nats_server_binary, start_nats, stop_process
from gpufleet.shared.runtime.bus import Bus
from gpufleet.shared.trust.authz import (
    ADMIN,
    Realm,
    cluster_nats_config,
    ensure_realm,
    load_creds,
    nats_config,
    write_nats_config,
)
from gpufleet.shared.trust.tls import (
    Pki,
    ServerTls,
    client_context,
    load_pki,
    make_test_pki,
    tls_block,
    write_local_cluster,
)

from .helpers import submit_cmd, wait_until

REPO = Path(__file__).resolve().parent.parent
NODES = ["nats-1", "nats-2", "nats-3"]
ROUTE_REFUSED = re.compile(r"TLS route handshake error: .*(unknown authority|bad certificate)")


@pytest.fixture
def realm(tmp_path: Path) -> Realm:
    return ensure_realm(tmp_path / "realm", tenants=["acme"])


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_test_pki(tmp_path / "certs", NODES, ["nats"])


@pytest.fixture(autouse=True)
def _no_ambient_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Who connects, and which CA it trusts, is what each test says."""
    monkeypatch.delenv("GPUFLEET_CREDS", raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.delenv("GPUFLEET_STREAM_REPLICAS", raising=False)


def nats_check(conf: Path) -> None:
    """`nats-server -t`: the config parses and its certificates and includes load."""
    out = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- the PKI


def test_pki_files_modes_and_extensions(pki: Pki) -> None:
    assert sorted(p.name for p in pki.dir.iterdir()) == sorted(
        ["ca.pem", "ca-key.pem", *(f"{n}.pem" for n in NODES), *(f"{n}-key.pem" for n in NODES)])
    for p in pki.dir.iterdir():
        mode = stat.S_IMODE(p.stat().st_mode)
        if p.name.endswith("-key.pem"):
            assert mode == 0o600, (p.name, oct(mode))
        else:
            assert mode & 0o077 == 0o044, (p.name, oct(mode))  # certificates are public
    ca = x509.load_pem_x509_certificate(pki.ca_file.read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert 360 <= (ca.not_valid_after_utc - ca.not_valid_before_utc).days <= 366
    for name in NODES:
        cert = x509.load_pem_x509_certificate(pki.server(name).cert_file.read_bytes())
        cert.verify_directly_issued_by(ca)
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(eku)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(san.get_values_for_type(x509.DNSName)) >= {name, "nats", "localhost"}
        assert "127.0.0.1" in {str(i) for i in san.get_values_for_type(x509.IPAddress)}
        assert cert.not_valid_after_utc <= ca.not_valid_after_utc


def test_pki_reuses_its_ca_and_refuses_bad_names(pki: Pki) -> None:
    ca_before = pki.ca_file.read_bytes()
    more = make_test_pki(pki.dir, ["nats-4"], ["10.1.2.3", "*.nats-headless.gpufleet.svc.cluster.local"])
    assert more.ca_reused and pki.ca_file.read_bytes() == ca_before
    cert = x509.load_pem_x509_certificate(more.server("nats-4").cert_file.read_bytes())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_before))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "*.nats-headless.gpufleet.svc.cluster.local" in san.get_values_for_type(x509.DNSName)
    assert "10.1.2.3" in {str(i) for i in san.get_values_for_type(x509.IPAddress)}
    assert sorted(load_pki(pki.dir).servers) == [*NODES, "nats-4"]
    for bad in (["../etc"], ["a/b"], ["ca"], ["x-key"], ["n", "n"], []):
        with pytest.raises(ValueError):
            make_test_pki(pki.dir, bad)


def test_certs_make_cli(tmp_path: Path) -> None:
    out = tmp_path / "deploy-certs"
    res = CliRunner().invoke(app, ["certs", "make", "--out", str(out), "--server", "nats-1", "--server", "nats-2",
                                   "--host", "nats", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["ca"] == str(out / "ca.pem") and not doc["ca_reused"]
    assert doc["servers"]["nats-2"] == {"cert": str(out / "nats-2.pem"), "key": str(out / "nats-2-key.pem")}
    assert stat.S_IMODE((out / "nats-1-key.pem").stat().st_mode) == 0o600
    res = CliRunner().invoke(app, ["certs", "make", "--out", str(out), "--server", "nats-3"])
    assert res.exit_code == 0, res.output
    assert "reused" in res.output and str(out / "nats-3.pem") in res.output
    res = CliRunner().invoke(app, ["certs", "make", "--out", str(out), "--server", "../x"])
    assert res.exit_code == 2


# ---------------------------------------------------------------- the configs


def test_cluster_nats_config(tmp_path: Path, realm: Realm, pki: Pki) -> None:
    routes = ["nats://127.0.0.1:6222", "nats://127.0.0.1:6223"]
    conf = cluster_nats_config(realm, "nats-1", tmp_path / "store", 4222, 6222, routes, pki.server("nats-1"))
    assert conf["authorization"] == realm.authorization()  # the single server's users and permissions
    assert conf["server_name"] == "nats-1" and conf["port"] == 4222
    assert conf["jetstream"] == {"store_dir": str(tmp_path / "store"), "sync_interval": "always"}
    st = pki.server("nats-1")
    files = {"cert_file": str(st.cert_file), "key_file": str(st.key_file), "ca_file": str(pki.ca_file)}
    assert conf["tls"] == {**files, "verify": False, "timeout": conf["tls"]["timeout"]}
    assert conf["cluster"]["name"] == "gpufleet" and conf["cluster"]["listen"] == "127.0.0.1:6222"
    assert conf["cluster"]["routes"] == routes
    assert conf["cluster"]["tls"] == {**files, "verify": True, "timeout": conf["tls"]["timeout"]}
    nats_check(write_nats_config(tmp_path / "nats-1.conf", conf))


def test_cluster_config_cli(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["certs", "cluster-config", "--realm", str(tmp_path / "realm"),
                                   "--out", str(tmp_path / "cluster"), "--nodes", "3", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["url"] == "tls://127.0.0.1:4222,tls://127.0.0.1:4223,tls://127.0.0.1:4224"
    realm = Realm.load(tmp_path / "realm")
    assert ADMIN in realm.identities and "svc-placer" in realm.identities
    for node in doc["nodes"]:
        conf_path = Path(node["config"])
        assert stat.S_IMODE(conf_path.stat().st_mode) == 0o600
        conf = json.loads(conf_path.read_text())
        assert conf["authorization"] == realm.authorization()
        assert len(conf["cluster"]["routes"]) == 3 and conf["cluster"]["tls"]["verify"] is True
        nats_check(conf_path)


def test_deploy_templates_with_generated_files(tmp_path: Path) -> None:
    """deploy/nats/*.conf (and the Kubernetes ConfigMap) are valid once the generated
    authorization include and certificates are in place (what deploy/validate.sh checks)."""
    import yaml

    runner = CliRunner()
    res = runner.invoke(app, ["certs", "make", "--out", str(tmp_path / "certs"), *sum((["--server", n] for n in NODES), []),
                              "--server", "nats", "--host", "nats"])
    assert res.exit_code == 0, res.output
    conf_dir = tmp_path / "nats"
    res = runner.invoke(app, ["certs", "authorization", "--realm", str(tmp_path / "gen"),
                              "--out", str(conf_dir / "authorization.conf")])
    assert res.exit_code == 0, res.output
    templates = {f.name: f.read_text() for f in sorted((REPO / "deploy" / "nats").glob("*.conf"))}
    assert sorted(templates) == [f"{n}.conf" for n in NODES]
    k8s = next(d for d in yaml.safe_load_all((REPO / "deploy/k8s/10-nats.yaml").read_text()) if d["kind"] == "ConfigMap")
    templates["k8s.conf"] = k8s["data"]["nats.conf"]
    for name, text in templates.items():
        assert re.search(r"^include\s+\"?authorization\.conf\"?", text, re.M), name
        assert re.search(r"^tls\s*\{", text, re.M) and "verify: true" in text, name
        (conf_dir / name).write_text(text.replace("/etc/nats/certs/", f"{tmp_path / 'certs'}/"))
        env = {**os.environ, "POD_NAME": "nats"}
        out = subprocess.run([nats_server_binary(), "-c", str(conf_dir / name), "-t"], capture_output=True,
                             text=True, timeout=30, env=env)
        assert out.returncode == 0, (name, out.stdout + out.stderr)


# ---------------------------------------------------------------- one server: TLS + authorization


@dataclass
class TlsServer:
    port: int
    realm: Realm
    pki: Pki

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.port}"

    def creds(self, ident: str = ADMIN) -> Path:
        return Path(self.realm.creds_path(ident))


@pytest.fixture
def tls_server(tmp_path: Path, realm: Realm, pki: Pki) -> Iterator[TlsServer]:
    port = free_port()
    conf = nats_config(tmp_path / "nats", port, realm)
    conf["tls"] = tls_block(pki.server("nats-1"), verify=False)
    path = write_nats_config(tmp_path / "nats.conf", conf)
    proc = start_nats(tmp_path / "nats", port, config=path, log_file=tmp_path / "nats.log")
    try:
        yield TlsServer(port, realm, pki)
    finally:
        stop_process(proc)


async def _publish_and_read(bus: Bus) -> None:
    cmd = submit_cmd({"tenant": "acme", "name": "tls", "replicas": 1, "resources": {"gpus": 0, "cpus": 1}})
    seq = await bus.publish(cmd)
    msg = await bus.js.get_msg(STREAM, seq)
    got = parse_envelope(msg.data or b"")
    assert got.event_id == cmd.event_id and got.type == "cmd.submit"


async def test_tls_client_with_ca_and_creds(tls_server: TlsServer) -> None:
    bus = await Bus.connect(tls_server.url, name="tls-admin", creds=load_creds(tls_server.creds()),
                            tls=client_context(tls_server.pki.ca_file))
    try:
        assert bus.nc.is_connected and bus.nc.connected_url is not None
        assert bus.nc.connected_url.scheme == "tls"
        await bus.ensure_streams()
        assert {STREAM, TELEMETRY_STREAM} <= {s.config.name for s in await bus.js.streams_info()}
        await _publish_and_read(bus)
    finally:
        await bus.close()


async def test_ssl_cert_file_is_enough(tls_server: TlsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A service given only SSL_CERT_FILE (the deploy files' way: no code knows about TLS) and a
    nats:// URL: nats-py upgrades to TLS because the server requires it, and trusts the CA."""
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_server.pki.ca_file))
    monkeypatch.setenv("GPUFLEET_CREDS", str(tls_server.creds("svc-readmodel")))
    bus = await Bus.connect(f"nats://127.0.0.1:{tls_server.port}", name="tls-env")
    try:
        info = await bus.nc.request("$JS.API.INFO", b"", timeout=5)
        assert "error" not in json.loads(info.data)
    finally:
        await bus.close()


async def test_deploy_healthcheck_over_tls(tls_server: TlsServer) -> None:
    """deploy/healthcheck.py, as the containers run it: tls:// URL, SSL_CERT_FILE, GPUFLEET_CREDS."""
    from nats.js.api import ConsumerConfig

    bus = await Bus.connect(tls_server.url, creds=load_creds(tls_server.creds()), tls=client_context(tls_server.pki.ca_file))
    try:
        await bus.ensure_streams()
        await bus.js.add_consumer(STREAM, ConsumerConfig(durable_name="readmodel", filter_subject="fleet.evt.>"))
    finally:
        await bus.close()

    def check(**env: str) -> subprocess.CompletedProcess[str]:
        full = {k: v for k, v in os.environ.items() if k not in ("GPUFLEET_CREDS", "SSL_CERT_FILE")}
        full.update(GPUFLEET_NATS_URL=tls_server.url, **env)
        return subprocess.run([sys.executable, str(REPO / "deploy/healthcheck.py"), "readmodel", "--durable", "readmodel"],
                              capture_output=True, text=True, timeout=60, env=full)

    ca, creds = str(tls_server.pki.ca_file), str(tls_server.creds("svc-readmodel"))
    ok = await asyncio.to_thread(check, SSL_CERT_FILE=ca, GPUFLEET_CREDS=creds)
    assert ok.returncode == 0, ok.stderr
    no_creds = await asyncio.to_thread(check, SSL_CERT_FILE=ca)
    assert no_creds.returncode == 1 and "Authorization" in no_creds.stderr, no_creds.stderr
    no_ca = await asyncio.to_thread(check, GPUFLEET_CREDS=creds)
    assert no_ca.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in no_ca.stderr, no_ca.stderr


def _plaintext_exchange(port: int) -> tuple[dict[str, Any], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        f = s.makefile("rb")
        line = f.readline()
        assert line.startswith(b"INFO ")
        info = json.loads(line[5:])
        s.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return info, got


async def test_plain_client_refused(tls_server: TlsServer) -> None:
    info, reply = await asyncio.to_thread(_plaintext_exchange, tls_server.port)
    assert info["tls_required"] is True
    assert b"PONG" not in reply  # the server drops a connection that does not start TLS
    # and a TLS client that does not trust the cluster's CA does not connect either
    with pytest.raises(ssl.SSLCertVerificationError):
        await nats.connect(tls_server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3,
                           tls=ssl.create_default_context(), **load_creds(tls_server.creds()).connect_options())


async def test_tls_client_without_creds_refused(tls_server: TlsServer) -> None:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(tls_server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3,
                           tls=client_context(tls_server.pki.ca_file), error_cb=on_error)
    # a tenant's credentials connect, but may not manage streams (the same authorization as `gpufleet up`)
    nc = await nats.connect(tls_server.url, allow_reconnect=False, connect_timeout=3,
                            tls=client_context(tls_server.pki.ca_file),
                            **load_creds(tls_server.creds("tenant-acme")).connect_options())
    try:
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request(f"$JS.API.STREAM.CREATE.{STREAM}", b"{}", timeout=1)
    finally:
        await nc.close()


# ---------------------------------------------------------------- three nodes, mutual TLS on the routes


@pytest.fixture
async def tls_cluster(tmp_path: Path, realm: Realm, pki: Pki) -> AsyncIterator[tuple[Any, list[int]]]:
    ports = [free_port() for _ in range(9)]
    client, routes, http = ports[0:3], ports[3:6], ports[6:9]
    cluster = write_local_cluster(realm, tmp_path / "cluster", 3, pki, client, routes, http_ports=http)
    procs = []
    try:
        for node in cluster.nodes:
            procs.append(start_nats(node.store_dir, node.client_port, config=node.config,
                                    log_file=tmp_path / f"{node.name}.log"))
        yield cluster, http
    finally:
        for p in procs:
            stop_process(p)


async def _js_ready(nc: Any) -> bool:
    """JetStream answers (a meta leader was elected)."""
    try:
        msg = await nc.request("$JS.API.INFO", b"", timeout=1)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return False
    return "error" not in json.loads(msg.data)


def _varz(http_port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/varz", timeout=5) as r:  # noqa: S310 - loopback
        varz: dict[str, Any] = json.loads(r.read())
        return varz


def _routes(http_port: int) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/routez", timeout=5) as r:  # noqa: S310 - loopback
        routes: list[dict[str, Any]] = json.loads(r.read())["routes"] or []
        return routes


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_three_node_tls_cluster(tls_cluster: tuple[Any, list[int]], realm: Realm, pki: Pki) -> None:
    cluster, http = tls_cluster
    bus = await Bus.connect(cluster.url, name="tls-cluster", creds=load_creds(realm.creds_path(ADMIN)),
                            tls=client_context(pki.ca_file), replicas=3)
    try:
        await wait_until(lambda: _js_ready(bus.nc), timeout_s=60, every_s=0.2)

        async def streams_created() -> bool:
            try:
                await bus.ensure_streams()
            except Exception:  # noqa: BLE001 - peers still joining: "insufficient resources", timeouts
                return False
            return True

        await wait_until(streams_created, timeout_s=60, every_s=0.5)
        info = await bus.js.stream_info(STREAM)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and info.cluster.leader in NODES
        assert len(info.cluster.replicas or []) == 2
        await _publish_and_read(bus)
        # every node routes to the two others, and its routes require and verify TLS
        for port in http:
            varz = _varz(port)
            others = set(NODES) - {varz["server_name"]}

            def routed(p: int = port, o: set[str] = others) -> bool:
                return {r.get("remote_name") for r in _routes(p)} >= o

            await wait_until(routed, timeout_s=20, every_s=0.2)
            assert varz["tls_required"] is True
            assert varz["cluster"]["tls_required"] is True and varz["cluster"]["tls_verify"] is True
    finally:
        await bus.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_route_without_the_cas_cert_is_refused(tmp_path: Path, realm: Realm, pki: Pki) -> None:
    """A node whose certificate another CA signed cannot join: the routes are mutual TLS."""
    rogue = make_test_pki(tmp_path / "rogue", ["nats-2"]).server("nats-2")
    rogue = ServerTls("nats-2", rogue.cert_file, rogue.key_file, pki.ca_file)  # trusts ours, signed by another
    c1, c2, r1, r2, h1 = (free_port() for _ in range(5))
    routes = [f"nats://127.0.0.1:{r1}", f"nats://127.0.0.1:{r2}"]
    good = cluster_nats_config(realm, "nats-1", tmp_path / "s1", c1, r1, routes, pki.server("nats-1"), http_port=h1)
    bad = cluster_nats_config(realm, "nats-2", tmp_path / "s2", c2, r2, routes, rogue)
    p1 = start_nats(tmp_path / "s1", c1, config=write_nats_config(tmp_path / "n1.conf", good), log_file=tmp_path / "n1.log")
    p2 = start_nats(tmp_path / "s2", c2, config=write_nats_config(tmp_path / "n2.conf", bad), log_file=tmp_path / "n2.log")
    try:
        log = tmp_path / "n1.log"
        await wait_until(lambda: ROUTE_REFUSED.search(log.read_text()), timeout_s=30)
        assert _routes(h1) == []
    finally:
        stop_process(p1)
        stop_process(p2)
