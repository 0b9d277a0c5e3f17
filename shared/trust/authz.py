"""Who may write what: the owner of every event type, the identities, and the nats-server
authorization generated from them (docs/security.md).

The log is only as trustworthy as its writers. Every connection has an identity (an nkey: the
server holds public keys only), and its permissions come from one table, `OWNERS`, so a subject
proves its author: only the placer can publish on `fleet.evt.*.job.*.placed`, only a tenant's
own credentials on `fleet.cmd.<tenant>.>`. The same table is checked a second time by every
core (`foreign_author`: an event whose actor is not an owner of its type is dead-lettered, not
folded) and by `gpufleet audit` over the whole log.

Identities (`Identity`):
- `admin`: the operator (the CLI on the mesh's machine). Reads everything, publishes any command
  and the operator facts (`OPERATOR_TYPES`), manages streams and consumers. A command it sends
  on behalf of nobody goes on `fleet.cmd.sys.<verb>` (an admin cancel is an admin event).
- `svc-<name>`: one per service process (a grouped process holds the union of its services).
- `tenant-<name>`: publishes only `fleet.cmd.<tenant>.>`, reads only its own events through
  consumers whose create subject carries the filter `fleet.evt.<tenant>.>`; private inboxes.

A credentials file (`<identity>.creds`, mode 0600) is JSON: `{"identity", "kind", "name",
"seed", "public_key", "inbox_prefix"}`; any NATS client authenticates with the nkey `seed` and
must use `inbox_prefix` for its reply subjects.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.shared.contract.config import write_private
from gpufleet.shared.contract.events import (
    EVENT_TYPES,
    LOGS_PREFIX,
    STREAM,
    SYS_TENANT,
    TELEMETRY_STREAM,
    Envelope,
    capacity_subject,
)
from gpufleet.shared.trust.tls import TLS_TIMEOUT_S, ServerTls, tls_block

CREDS_VERSION = 1
CREDS_DIR = "creds"
REALM_FILE = "realm.json"
NATS_CONF = "nats.conf"
ADMIN = "admin"

SERVICES = ("admission", "quota", "placer", "executor", "telemetry", "guardian", "billing", "autoscaler")

# ---------------------------------------------------------------- the table

# event type -> the services that may author it. Commands (`cmd.*`) are the clients': their
# subject names the tenant, and only that tenant (or the admin, or the autoscaler for the
# replicas of an inference service) may publish there.
OWNERS: dict[str, frozenset[str]] = {
    "cmd.submit": frozenset({"autoscaler"}),
    "cmd.cancel": frozenset({"autoscaler"}),
    "cmd.report_load": frozenset(),
    "job.submitted": frozenset({"admission"}),
    "job.admitted": frozenset({"admission"}),
    "job.rejected": frozenset({"admission"}),
    "job.cancel_requested": frozenset({"admission"}),
    "job.request_refused": frozenset({"admission"}),
    "job.queued": frozenset({"quota"}),
    "job.quota_reserved": frozenset({"quota"}),
    "job.preemption_requested": frozenset({"quota", "guardian"}),
    "job.placed": frozenset({"placer"}),
    "job.backfill_reserved": frozenset({"placer"}),
    "job.unschedulable": frozenset({"placer"}),
    "job.resized": frozenset({"placer"}),
    # the placer ends a job it never placed (cancelled, never fits, preempted while waiting)
    "job.cancelled": frozenset({"placer", "guardian"}),
    "job.failed": frozenset({"placer", "guardian"}),
    "job.preempted": frozenset({"placer", "guardian"}),
    "job.resume_requested": frozenset({"placer", "guardian"}),
    "job.succeeded": frozenset({"guardian"}),
    "job.checkpoint_saved": frozenset({"guardian"}),
    "job.checkpoint_verified": frozenset({"guardian"}),
    "job.checkpoint_invalid": frozenset({"guardian"}),
    "job.checkpoint_overdue": frozenset({"guardian"}),
    "job.data_staging": frozenset({"executor"}),
    "job.data_staged": frozenset({"executor"}),
    "job.started": frozenset({"executor"}),
    "job.heartbeat": frozenset({"executor"}),
    # telemetry reports the exits of the replicas of a node it declared lost
    "job.exited": frozenset({"executor", "telemetry"}),
    "job.idle_detected": frozenset({"telemetry"}),
    "job.idle_ended": frozenset({"telemetry"}),
    "job.gpu_starved": frozenset({"telemetry"}),
    "job.scaled": frozenset({"autoscaler"}),
    "node.registered": frozenset({"executor"}),
    "node.deregistered": frozenset({"executor"}),
    "node.heartbeat": frozenset({"executor"}),
    "node.datasets_cached": frozenset({"executor"}),
    "node.lost": frozenset({"telemetry"}),
    "node.gpu_unhealthy": frozenset({"telemetry"}),
    "node.gpu_zombie_detected": frozenset({"telemetry"}),
    "node.gpu_cleared": frozenset({"telemetry"}),
    "node.cordoned": frozenset({"autoscaler"}),
    "node.uncordoned": frozenset({"autoscaler"}),
    "node.provision_requested": frozenset({"autoscaler"}),
    "node.removal_requested": frozenset({"autoscaler"}),
    "budget.threshold_reached": frozenset({"billing"}),
    "budget.exceeded": frozenset({"billing"}),
    "sys.dead_letter": frozenset(SERVICES),  # each on its own subject: deadletter.<service>
    "sys.capacity_committed": frozenset({"placer"}),  # on capacity.<service>: the placer's guard
}
# facts an operator states by command (cordon a node, return a GPU to service, requeue a job)
OPERATOR_TYPES = frozenset({"node.cordoned", "node.uncordoned", "node.gpu_cleared", "job.resume_requested"})

missing = set(EVENT_TYPES) ^ set(OWNERS)
if missing:  # pragma: no cover - a new event type must name its owner here
    raise RuntimeError(f"authz.OWNERS out of step with the contract: {sorted(missing)}")


def subject_pattern(event_type: str, service: str | None = None) -> str:
    """The NATS subject pattern every event of `event_type` is published on (events.subject_for)."""
    area, _, short = event_type.partition(".")
    if area == "cmd":
        return f"fleet.cmd.*.{short}"
    if area == "job":
        return f"fleet.evt.*.job.*.{short}"
    if event_type == "node.heartbeat":
        return "fleet.tel.node.*.heartbeat"
    if area == "node":
        return f"fleet.evt.{SYS_TENANT}.node.*.{short}"
    if event_type == "sys.dead_letter":
        return f"fleet.evt.{SYS_TENANT}.deadletter.{service or '*'}"
    if event_type == "sys.capacity_committed":
        return capacity_subject(service or "*")
    if area == "budget":
        return f"fleet.evt.{SYS_TENANT}.budget.*.*.{short}"
    raise ValueError(f"no subject for {event_type}")


def actor_service(actor: str) -> str:
    """`placer/0` -> `placer` (a service instance's actor is `<service>/<instance>`)."""
    return actor.split("/", 1)[0]


def foreign_author(env: Envelope) -> str | None:
    """Why `env` cannot be by its actor (None when it can): a fact whose actor is not one of its
    type's owners. Commands carry any actor: their subject, which only that tenant (or the admin,
    on `fleet.cmd.sys.*`) may publish on, names who sent them; admission answers every one."""
    if env.type.startswith("cmd."):
        return None
    owners = OWNERS.get(env.type)
    if owners is None:
        return None  # not the contract: the parse already refused it
    who = actor_service(env.actor)
    if who in owners or (who == ADMIN and env.type in OPERATOR_TYPES):
        return None
    allowed = sorted(owners | ({ADMIN} if env.type in OPERATOR_TYPES else set()))
    return f"{env.type} by {env.actor!r}: only {', '.join(allowed)} may author it"


def owner_actor(event_type: str) -> str:
    """An actor that may author `event_type` (test builders, tools that write the log)."""
    owners = sorted(OWNERS.get(event_type, ()))
    return f"{owners[0]}/0" if owners else "client"


# ---------------------------------------------------------------- identities


@dataclass(frozen=True)
class Identity:
    kind: str  # admin | service | tenant
    name: str  # admin, the service process's name (services joined by '-'), the tenant
    services: tuple[str, ...] = ()
    public_key: str = ""

    @property
    def id(self) -> str:
        return ADMIN if self.kind == "admin" else f"{'svc' if self.kind == 'service' else 'tenant'}-{self.name}"

    @property
    def inbox_prefix(self) -> str:
        if self.kind == "admin":
            return "_INBOX.admin"
        return f"_INBOX.{'svc' if self.kind == 'service' else 'tenant'}.{self.name}"

    def permissions(self, durables: Iterable[str] = ()) -> dict[str, Any]:
        if self.kind == "admin":
            return admin_permissions()
        if self.kind == "service":
            return service_permissions(self.services, self.inbox_prefix)
        return tenant_permissions(self.name, self.inbox_prefix, durables)


# JetStream API a service uses: its consumers, reads, acks; never stream management.
_SERVICE_API = (
    "$JS.API.INFO", f"$JS.API.STREAM.INFO.{STREAM}", f"$JS.API.STREAM.INFO.{TELEMETRY_STREAM}",
    "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST",
    "$JS.API.CONSUMER.>", f"$JS.API.DIRECT.GET.{STREAM}", f"$JS.API.DIRECT.GET.{STREAM}.>",
    f"$JS.API.STREAM.MSG.GET.{STREAM}", "$JS.ACK.>", "$JS.FC.>",
)
# what nobody may do to the log, the admin included: erase it (the stream also denies purge and
# delete of messages; changing that is a deliberate edit of the server config, not a command)
_ERASE = (f"$JS.API.STREAM.DELETE.{STREAM}", f"$JS.API.STREAM.PURGE.{STREAM}", f"$JS.API.STREAM.MSG.DELETE.{STREAM}")


def snapshot_subjects(core: str) -> list[str]:
    """What a core's identity needs to keep its snapshots (shared/runtime/snapshots.py): its own object
    store bucket, `SNAP_<core>`, and no other's."""
    stream = f"OBJ_SNAP_{core}"
    return [f"$O.SNAP_{core}.>", f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.INFO.{stream}",
            f"$JS.API.STREAM.PURGE.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>"]


def lease_subjects(core: str) -> list[str]:
    """What a service's identity needs to hold its lease (shared/runtime/lease.py): its own key of the
    bucket `LEASES` (reading the bucket's messages shows only which instance holds which lease)."""
    return [f"$KV.LEASES.{core}", "$JS.API.STREAM.INFO.KV_LEASES", f"$JS.API.DIRECT.GET.KV_LEASES.$KV.LEASES.{core}",
            "$JS.API.STREAM.MSG.GET.KV_LEASES"]


def admin_permissions() -> dict[str, Any]:
    return {"publish": {"allow": [">"], "deny": list(_ERASE)}, "subscribe": {"allow": [">"]}}


def service_permissions(services: Sequence[str], inbox_prefix: str) -> dict[str, Any]:
    pub: list[str] = list(_SERVICE_API)
    for svc in services:
        pub += [subject_pattern(t, svc) for t, owners in OWNERS.items() if svc in owners]
        pub += snapshot_subjects(svc)
        pub += lease_subjects(svc)
        if svc == "telemetry":
            pub.append("fleet.tel.node.*.gpu")  # GPU samples (its own; heartbeats are the executor's)
        if svc == "admission":  # a command's verdict, on the sender's own inbox (shared/runtime/loop.py REPLY_HEADER)
            pub += ["_INBOX.tenant.*.>", "_INBOX.admin.>"]
        if svc == ARCHIVE_PROCESS:  # it purges what it has archived first (shared/runtime/archive.py), nothing else
            pub.append(f"$JS.API.STREAM.PURGE.{STREAM}")
    sub = [f"{inbox_prefix}.>"]
    if "telemetry" in services:
        sub.append("fleet.tel.node.*.heartbeat")  # heartbeats feed its leases
    if "executor" in services:
        # it serves its nodes' logs (services/executor/logs.py: a NATS micro service) and answers
        # each request once on the asker's reply subject (allow_responses), no other inbox
        sub += [f"{LOGS_PREFIX}.*.*", "$SRV.>"]
    # deny wins over allow in the server: the archive process's purge is not denied to it
    deny = [d for d in _ERASE if not (ARCHIVE_PROCESS in services and d == f"$JS.API.STREAM.PURGE.{STREAM}")]
    out: dict[str, Any] = {"publish": {"allow": sorted(set(pub)), "deny": deny}, "subscribe": {"allow": sub}}
    if "executor" in services:
        out["allow_responses"] = {"max": 1, "expires": "1m"}
    return out


def tenant_permissions(tenant: str, inbox_prefix: str, durables: Iterable[str] = ()) -> dict[str, Any]:
    """Its own commands; consumers on its own subjects only (push: no MSG.NEXT, which would let it
    pull from any consumer by name); never a service's consumer (a create on that name would
    re-point it)."""
    own = [f"fleet.evt.{tenant}.>", f"fleet.cmd.{tenant}.>"]
    # STREAM.NAMES: clients find the stream of a subject (it lists names, nothing of the content)
    pub = [f"fleet.cmd.{tenant}.>", f"{LOGS_PREFIX}.{tenant}.>", "$JS.API.INFO", "$JS.API.STREAM.NAMES",
           *(f"$JS.API.CONSUMER.CREATE.{STREAM}.*.{s}" for s in own)]
    deny = [*_ERASE, *(f"$JS.API.CONSUMER.CREATE.{STREAM}.{d}.>" for d in sorted(set(durables)))]
    # allow_responses: it may answer what it was sent with a reply subject (the flow control of
    # its push consumers), nothing else
    return {"publish": {"allow": pub, "deny": deny},
            "subscribe": {"allow": [f"{inbox_prefix}.>", f"fleet.evt.{tenant}.>"]},
            "allow_responses": {"max": 1, "expires": "1m"}}


def service_durables() -> list[str]:
    """The consumer names the mesh's own processes use (and their replicas 1-9)."""
    from gpufleet.mesh import LAYOUTS, durables

    base = {"readmodel", "billing-ledger", *SERVICES, *(d for layout in LAYOUTS for d in durables(layout))}
    return sorted({*base, *(f"{b}-{i}" for b in base for i in range(1, 10))})


# ---------------------------------------------------------------- the realm: identities on disk


def _nkeys() -> Any:
    import nkeys  # type: ignore[import-untyped]

    return nkeys


def new_keypair() -> tuple[str, str]:
    """(seed, public key) of a fresh user nkey."""
    import nacl.signing

    nk = _nkeys()
    raw = nacl.signing.SigningKey.generate().encode()
    seed = nk.encode_seed(raw, nk.PREFIX_BYTE_USER).decode()
    kp = nk.from_seed(bytearray(seed.encode()))
    return seed, kp.public_key.decode()


@dataclass
class Realm:
    """The identities of one mesh, under `<dir>/creds`: one creds file each (0600, dir 0700)
    and `realm.json` (public keys only), from which `nats.conf`'s authorization is generated."""

    dir: Path
    identities: dict[str, Identity] = field(default_factory=dict)
    # core -> the key its snapshots are signed with (HMAC): in the creds of every process that runs it
    snapshot_keys: dict[str, str] = field(default_factory=dict)

    @property
    def creds_dir(self) -> Path:
        return self.dir / CREDS_DIR

    @classmethod
    def load(cls, d: Path) -> Realm:
        realm = cls(d)
        try:
            doc = json.loads((realm.creds_dir / REALM_FILE).read_text())
        except FileNotFoundError:
            return realm
        for item in doc.get("identities", []):
            ident = Identity(item["kind"], item["name"], tuple(item.get("services", ())), item["public_key"])
            realm.identities[ident.id] = ident
        realm.snapshot_keys = dict(doc.get("snapshot_keys", {}))
        return realm

    def exists(self) -> bool:
        return (self.creds_dir / REALM_FILE).exists()

    def creds_path(self, ident_id: str) -> Path:
        return self.creds_dir / f"{ident_id}.creds"

    def add(self, kind: str, name: str, services: tuple[str, ...] = ()) -> Identity:
        """The identity (created with a new key and creds file if it is not there yet)."""
        probe = Identity(kind, name, services)
        if probe.id in self.identities and self.creds_path(probe.id).exists():
            return self.identities[probe.id]
        if kind == "tenant":
            from gpufleet.shared.contract.ids import check_token

            check_token(name, "tenant")
            if name == SYS_TENANT:
                raise ValueError(f"tenant {SYS_TENANT!r} is reserved for the cluster's own facts")
        seed, pub = new_keypair()
        ident = Identity(kind, name, services, pub)
        self.identities[ident.id] = ident
        self._write_creds(ident, seed)
        self.save()
        return ident

    def _write_creds(self, ident: Identity, seed: str) -> None:
        for svc in ident.services:
            self.snapshot_keys.setdefault(svc, secrets.token_hex(32))
        write_private(self.creds_path(ident.id), json.dumps({
            "gpufleet_creds": CREDS_VERSION, "identity": ident.id, "kind": ident.kind, "name": ident.name,
            "services": list(ident.services), "seed": seed, "public_key": ident.public_key,
            "inbox_prefix": ident.inbox_prefix,
            "snapshot_keys": self._keys_of(ident),
        }, indent=2) + "\n", private_dir=True)

    def _keys_of(self, ident: Identity) -> dict[str, str]:
        """The snapshot keys an identity holds: a service process those of the cores it runs; the
        admin every core's, to verify them (the tools start from the cores' snapshots)."""
        if ident.kind == "admin":
            return dict(self.snapshot_keys)
        return {svc: self.snapshot_keys[svc] for svc in ident.services}

    def ensure_snapshot_keys(self) -> None:
        """Creds made before snapshots were signed get their cores' keys (the seeds are kept)."""
        for ident in self.identities.values():
            if not (ident.kind == "service" and ident.services) and ident.kind != "admin":
                continue
            path = self.creds_path(ident.id)
            try:
                doc = json.loads(path.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            if doc.get("snapshot_keys", {}) != self._keys_of(ident):
                self._write_creds(ident, str(doc["seed"]))
        self.save()

    def save(self) -> None:
        doc = {"identities": [
            {"kind": i.kind, "name": i.name, "services": list(i.services), "public_key": i.public_key}
            for i in sorted(self.identities.values(), key=lambda i: i.id)],
            "snapshot_keys": self.snapshot_keys}
        write_private(self.creds_dir / REALM_FILE, json.dumps(doc, indent=2) + "\n", private_dir=True)

    def tenants(self) -> list[str]:
        return sorted(i.name for i in self.identities.values() if i.kind == "tenant")

    def authorization(self) -> dict[str, Any]:
        """The `authorization` block of nats.conf: one nkey user per identity."""
        durables = service_durables()
        return {"users": [
            {"nkey": i.public_key, "permissions": i.permissions(durables)}
            for i in sorted(self.identities.values(), key=lambda i: i.id)]}




VIEW_PROCESS = "view"  # the mesh's process that stores snapshots of the cluster view (gpufleet/tools/viewsnap.py)
ARCHIVE_PROCESS = "archive"  # with a retention: archives FLEET's oldest events, then purges them (shared/runtime/archive.py)


def ensure_realm(d: Path, tenants: Iterable[str] = ()) -> Realm:
    """The mesh's identities: the admin, every service (alone, and as each group of services a
    layout runs in one process), the read-model projector, and `tenants`. Existing keys are kept."""
    from gpufleet.mesh import LAYOUTS

    groups = [g for gs in LAYOUTS.values() for g in gs]
    realm = Realm.load(d)
    realm.add("admin", ADMIN)
    for svc in SERVICES:
        realm.add("service", svc, (svc,))
    realm.add("service", "readmodel", ())
    realm.add("service", VIEW_PROCESS, (VIEW_PROCESS,))  # gpufleet/tools/viewsnap.py: its snapshots alone
    realm.add("service", ARCHIVE_PROCESS, (ARCHIVE_PROCESS,))  # shared/runtime/archive.py: a purge of what it archived
    for g in groups:
        if len(g) > 1:
            realm.add("service", "-".join(g), tuple(g))
    for t in tenants:
        realm.add("tenant", t)
    realm.snapshot_keys.setdefault("audit", secrets.token_hex(32))  # the audit's record (the admin's alone)
    realm.ensure_snapshot_keys()
    return realm


def service_identity_id(services: Sequence[str]) -> str:
    return "svc-" + "-".join(services)


# ---------------------------------------------------------------- the server config

# JetStream's fsync policy. The server's default flushes every 2 minutes: an acknowledged write
# can be lost on a power cut (Jepsen, NATS 2.12.1). The embedded mesh fsyncs each write
# ("always"); bench e2e measured its cost (docs/security.md, docs/benchmarks.md).
DEFAULT_SYNC = "always"


def nats_config(store_dir: Path, port: int, realm: Realm | None, host: str = "127.0.0.1",
                sync_interval: str = DEFAULT_SYNC) -> dict[str, Any]:
    """nats-server's configuration (its format accepts JSON)."""
    js: dict[str, Any] = {"store_dir": str(store_dir)}
    sync_interval = os.environ.get("GPUFLEET_NATS_SYNC", sync_interval)  # bench e2e --nats-sync
    if sync_interval and sync_interval != "lazy":
        js["sync_interval"] = sync_interval
    conf: dict[str, Any] = {"host": host, "port": port, "jetstream": js, "max_payload": 8 * 1024 * 1024}
    if realm is not None:
        conf["authorization"] = realm.authorization()
    return conf


def write_nats_config(path: Path, conf: dict[str, Any]) -> Path:
    write_private(path, json.dumps(conf, indent=2) + "\n")
    return path


def cluster_nats_config(realm: Realm | None, server_name: str, store_dir: Path, client_port: int,
                        cluster_port: int, routes: Sequence[str], tls: ServerTls | None, *, host: str = "127.0.0.1",
                        cluster_host: str | None = None, cluster_name: str = "gpufleet",
                        sync_interval: str = DEFAULT_SYNC, tls_timeout: float = TLS_TIMEOUT_S,
                        http_port: int | None = None, lab: bool = False) -> dict[str, Any]:
    """One node of a JetStream cluster (distributed mode, deploy/README.md): the same
    authorization as the single server (`realm`'s users and permissions), JetStream fsyncing
    every write, TLS for clients (the server's certificate; clients authenticate with their
    nkey, so no client certificate: `verify: false`) and mutual TLS between the nodes (`cluster.tls`,
    `verify: true`: each route presents its certificate, signed by the same CA). `routes`: every
    node's route URL, `nats://host:port` (a node skips the one to itself). `tls` None: a cluster
    on this machine's loopback only (`gpufleet up --nats-cluster 3`), whose traffic never leaves it;
    `lab`: on the addresses of a network-namespace lab on this machine (`--nats-netns`), which
    never leave it either."""
    conf = nats_config(store_dir, client_port, realm, host=host, sync_interval=sync_interval)
    conf["server_name"] = server_name
    conf["cluster"] = {
        "name": cluster_name,
        "listen": f"{cluster_host or host}:{cluster_port}",
        "routes": list(routes),
    }
    if tls is None:
        loopback = {host, cluster_host or host} <= {"127.0.0.1", "localhost", "::1"}
        in_lab = lab and all(ipaddress.ip_address(h) in ipaddress.ip_network("198.18.0.0/15")
                             for h in {host, cluster_host or host})
        if not loopback and not in_lab:
            raise ValueError("a cluster without TLS listens on loopback only (127.0.0.1): give it certificates")
        return conf
    conf["tls"] = tls_block(tls, verify=False, timeout=tls_timeout)
    conf["cluster"]["tls"] = tls_block(tls, verify=True, timeout=tls_timeout)
    if http_port is not None:
        conf["http"] = f"{host}:{http_port}"
    return conf


# ---------------------------------------------------------------- clients


@dataclass(frozen=True)
class Creds:
    """A parsed credentials file."""

    path: Path
    identity: str
    kind: str
    name: str
    seed: str
    inbox_prefix: str
    snapshot_keys: dict[str, str] = field(default_factory=dict)

    def snapshot_key(self, core: str) -> bytes | None:
        """The key `core`'s snapshots are signed with, if this identity runs that core."""
        k = self.snapshot_keys.get(core)
        return bytes.fromhex(k) if k else None

    @property
    def tenant(self) -> str | None:
        return self.name if self.kind == "tenant" else None

    @property
    def is_admin(self) -> bool:
        return self.kind == "admin"

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for nats.connect."""
        return {"nkeys_seed_str": self.seed, "inbox_prefix": self.inbox_prefix}


class CredsError(ValueError):
    pass


def load_creds(path: str | Path) -> Creds:
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise CredsError(f"credentials file {p} does not exist") from None
    except PermissionError:
        raise CredsError(f"credentials file {p} is not readable by this user") from None
    except json.JSONDecodeError as exc:
        raise CredsError(f"credentials file {p} is not gpufleet credentials (JSON): {exc}") from None
    try:
        return Creds(p, str(doc["identity"]), str(doc["kind"]), str(doc["name"]), str(doc["seed"]),
                     str(doc["inbox_prefix"]), dict(doc.get("snapshot_keys") or {}))
    except (KeyError, TypeError) as exc:
        raise CredsError(f"credentials file {p} lacks {exc}") from None


def find_creds(explicit: str | Path | None = None, data_dir: str | Path | None = None) -> Creds | None:
    """The caller's credentials: `explicit` (--creds), else $GPUFLEET_CREDS, else the data dir's
    admin credentials (the local operator) when it has a realm, else None (a server without auth)."""
    if explicit:
        return load_creds(explicit)
    env = os.environ.get("GPUFLEET_CREDS")
    if env:
        return load_creds(env)
    if data_dir is not None:
        p = Path(data_dir) / CREDS_DIR / f"{ADMIN}.creds"
        if p.exists():
            return load_creds(p)
    return None
