"""TLS for distributed mode: a test PKI for the NATS servers, and the configs of a local cluster.

Distributed mode runs the same generated authorization as the embedded mesh (shared/trust/authz.py:
one nkey user per identity, with its permissions) and adds TLS on both of NATS's links:

- clients -> servers: every server presents a certificate signed by the cluster's CA; clients
  verify it (`ssl.create_default_context(cafile=ca.pem)`, or `SSL_CERT_FILE=ca.pem` for a process
  that builds its default context: nats-py does when the server requires TLS). Clients do not
  present certificates (`verify: false`): they prove who they are with their nkey.
- server <-> server (cluster routes): mutual TLS (`verify: true`), so every server certificate
  carries both the serverAuth and clientAuth extended key usages.

`make_test_pki` makes such a CA and one certificate per server (`gpufleet certs make`). It is a
*test* PKI: a self-signed CA valid one year, its key beside it. Certificates and keys are
generated, never committed (deploy/README.md). Keys are written mode 0600.

`write_local_cluster` writes the configs of an N-node cluster on this machine (loopback ports,
TLS on client and route ports, the realm's authorization): `gpufleet certs cluster-config`.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufleet.shared.contract.config import write_private

if TYPE_CHECKING:  # authz imports this module's types; the import back is for the checker only
    from gpufleet.shared.trust.authz import Realm

CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
VALID_DAYS = 365
# every server certificate names these too: a client or route on the same machine
LOOPBACK_DNS = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1", "::1")
# how long a TLS handshake may take (seconds) before the server drops the connection
TLS_TIMEOUT_S = 5.0

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass(frozen=True)
class ServerTls:
    """The TLS files one NATS server uses: its certificate and key, and the CA it trusts."""

    name: str
    cert_file: Path
    key_file: Path
    ca_file: Path


@dataclass(frozen=True)
class Pki:
    """A generated CA and the certificates it signed, as files under `dir`."""

    dir: Path
    ca_file: Path
    ca_key_file: Path
    servers: dict[str, ServerTls] = field(default_factory=dict)
    ca_reused: bool = False

    def server(self, name: str) -> ServerTls:
        try:
            return self.servers[name]
        except KeyError:
            raise KeyError(f"no certificate for server {name!r} in {self.dir} "
                           f"(have: {', '.join(sorted(self.servers)) or 'none'})") from None

    def files(self) -> list[Path]:
        """Every file written, CA first."""
        out = [self.ca_file, self.ca_key_file]
        for s in self.servers.values():
            out += [s.cert_file, s.key_file]
        return out

    def to_json(self) -> dict[str, Any]:
        return {"dir": str(self.dir), "ca": str(self.ca_file), "ca_key": str(self.ca_key_file),
                "ca_reused": self.ca_reused,
                "servers": {n: {"cert": str(s.cert_file), "key": str(s.key_file)} for n, s in self.servers.items()}}


def tls_block(st: ServerTls, verify: bool, timeout: float = TLS_TIMEOUT_S) -> dict[str, Any]:
    """nats-server's `tls { }` for `st`: `verify` asks the peer for a certificate signed by the CA
    (routes: true; clients, who prove who they are with their nkey: false)."""
    return {"cert_file": str(st.cert_file), "key_file": str(st.key_file), "ca_file": str(st.ca_file),
            "verify": verify, "timeout": timeout}


def check_server_name(name: str) -> str:
    """A server name is a file name and a DNS name: 1-63 of [A-Za-z0-9._-], no leading dot."""
    if not _NAME.match(name) or ".." in name:
        raise ValueError(f"invalid server name {name!r}: 1-63 of [A-Za-z0-9._-], starting with a letter or digit")
    return name




def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _new_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    pem: bytes = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption())
    return pem


def _cert_pem(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    pem: bytes = cert.public_bytes(serialization.Encoding.PEM)
    return pem


def _make_ca(common_name: str, days: int) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gpufleet"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _load_ca(cert_file: Path, key_file: Path) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    return key, cert


def subject_alt_names(server_name: str, hosts: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """(DNS names, IP addresses) a server's certificate names: its own name, `hosts` (names or
    addresses; a DNS name may be a wildcard such as `*.nats-headless.gpufleet.svc.cluster.local`),
    and the loopback names."""
    dns: list[str] = []
    ips: list[str] = []
    for h in (server_name, *hosts, *LOOPBACK_DNS, *LOOPBACK_IPS):
        h = h.strip()
        if not h:
            continue
        try:
            ip = str(ipaddress.ip_address(h))
        except ValueError:
            if h.lower() not in (d.lower() for d in dns):
                dns.append(h)
        else:
            if ip not in ips:
                ips.append(ip)
    return dns, ips


def _make_server_cert(ca_key: Any, ca_cert: Any, server_name: str, hosts: Sequence[str], days: int) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = _new_key()
    dns, ips = subject_alt_names(server_name, hosts)
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    now = _now()
    not_after = min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gpufleet"),
                                 x509.NameAttribute(NameOID.COMMON_NAME, server_name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                     crl_sign=False, content_commitment=False, data_encipherment=False,
                                     key_agreement=True, encipher_only=False, decipher_only=False), critical=True)
        # routes are mutual TLS: a server is the TLS client of the routes it dials
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def make_test_pki(out_dir: Path, server_names: Sequence[str], hosts: Sequence[str] = (), *,
                  days: int = VALID_DAYS, new_ca: bool = False, ca_name: str = "gpufleet test CA") -> Pki:
    """Write a test CA (`ca.pem`, `ca-key.pem`) and, for each server, `<server>.pem` and
    `<server>-key.pem` under `out_dir`: EC P-256, SHA-256, valid `days` (one year). Each server
    certificate names the server, every one of `hosts` and the loopback names, and may act as TLS
    server and TLS client (routes). A CA already in `out_dir` is reused (so certificates made
    later still verify against the `ca.pem` the clients have) unless `new_ca`."""
    names = [check_server_name(n) for n in server_names]
    if not names:
        raise ValueError("at least one server name is needed")
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate server names: {names}")
    if CA_CERT[:-4] in names or CA_KEY[:-4] in names or any(n.endswith("-key") for n in names):
        raise ValueError(f"server names may not be 'ca' or end in '-key' (they name the files): {names}")
    out_dir = Path(out_dir).resolve()  # the configs that name these files work from any directory
    ca_file, ca_key_file = out_dir / CA_CERT, out_dir / CA_KEY
    reused = not new_ca and ca_file.exists() and ca_key_file.exists()
    if reused:
        ca_key, ca_cert = _load_ca(ca_file, ca_key_file)
    else:
        ca_key, ca_cert = _make_ca(ca_name, days)
        write_private(ca_key_file, _key_pem(ca_key), mode=0o600)
        write_private(ca_file, _cert_pem(ca_cert), mode=0o644)
    servers: dict[str, ServerTls] = {}
    for name in names:
        key, cert = _make_server_cert(ca_key, ca_cert, name, hosts, days)
        st = ServerTls(name, out_dir / f"{name}.pem", out_dir / f"{name}-key.pem", ca_file)
        write_private(st.key_file, _key_pem(key), mode=0o600)
        write_private(st.cert_file, _cert_pem(cert), mode=0o644)
        servers[name] = st
    return Pki(out_dir, ca_file, ca_key_file, servers, reused)


def load_pki(d: Path) -> Pki:
    """The PKI already under `d` (every `<name>.pem` with its `<name>-key.pem`)."""
    d = Path(d).resolve()
    ca_file = d / CA_CERT
    if not ca_file.exists():
        raise FileNotFoundError(f"no {CA_CERT} in {d}: run `gpufleet certs make --out {d} --server ...` first")
    servers: dict[str, ServerTls] = {}
    for cert in sorted(d.glob("*.pem")):
        name = cert.name[:-4]
        if name in ("ca", "ca-key") or name.endswith("-key"):
            continue
        key = d / f"{name}-key.pem"
        if key.exists():
            servers[name] = ServerTls(name, cert, key, ca_file)
    return Pki(d, ca_file, d / CA_KEY, servers, True)


def client_context(ca_file: Path | str) -> Any:
    """An ssl.SSLContext for a NATS client that trusts only the cluster's CA (`tls=` of nats.connect)."""
    import ssl

    return ssl.create_default_context(cafile=str(ca_file))


# ---------------------------------------------------------------- a cluster on this machine


@dataclass(frozen=True)
class LocalNode:
    name: str
    config: Path
    store_dir: Path
    client_port: int
    cluster_port: int

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.client_port}"


@dataclass(frozen=True)
class LocalCluster:
    nodes: list[LocalNode]
    pki: Pki

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (Bus.connect, GPUFLEET_NATS_URL)."""
        return ",".join(n.url for n in self.nodes)

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "ca": str(self.pki.ca_file),
                "nodes": [{"name": n.name, "config": str(n.config), "store_dir": str(n.store_dir),
                           "client_port": n.client_port, "cluster_port": n.cluster_port} for n in self.nodes]}


def node_names(n: int, prefix: str = "nats-") -> list[str]:
    if n < 1:
        raise ValueError(f"a cluster has at least 1 node, not {n}")
    return [f"{prefix}{i}" for i in range(1, n + 1)]


def write_local_cluster(realm: Realm, out_dir: Path, nodes: int = 3, pki: Pki | None = None,
                        client_ports: Sequence[int] | None = None, cluster_ports: Sequence[int] | None = None,
                        host: str = "127.0.0.1", http_ports: Sequence[int] | None = None) -> LocalCluster:
    """The configs of a `nodes`-server JetStream cluster on this machine: `<out_dir>/nats-<i>.conf`
    (mode 0600: it holds the authorization), stores under `<out_dir>/data/nats-<i>`, TLS with
    `pki`'s certificates (made for nats-1..N in `<out_dir>/certs` when not given). Ports default to
    4222+i-1 (clients) and 6222+i-1 (routes). Start each with `nats-server -c <config>`."""
    from gpufleet.shared.trust.authz import cluster_nats_config, write_nats_config

    names = node_names(nodes)
    cports = list(client_ports) if client_ports is not None else [4222 + i for i in range(nodes)]
    rports = list(cluster_ports) if cluster_ports is not None else [6222 + i for i in range(nodes)]
    hports = list(http_ports) if http_ports is not None else [None] * nodes
    if not (len(cports) == len(rports) == len(hports) == nodes):
        raise ValueError(f"{nodes} nodes need {nodes} client, cluster (and http) ports")
    out_dir = Path(out_dir).resolve()
    if pki is None:
        pki = make_test_pki(out_dir / "certs", names)
    routes = [f"nats://{host}:{p}" for p in rports]
    written: list[LocalNode] = []
    for name, cport, rport, hport in zip(names, cports, rports, hports, strict=True):
        store = out_dir / "data" / name
        conf = cluster_nats_config(realm, name, store, cport, rport, routes, pki.server(name), host=host,
                                   http_port=hport)
        path = write_nats_config(out_dir / f"{name}.conf", conf)
        written.append(LocalNode(name, path, store, cport, rport))
    return LocalCluster(written, pki)
