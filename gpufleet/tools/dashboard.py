"""`gpufleet dashboard`: a live web view fed from the event stream (no database, no build step).

The server folds FLEET from the start (an ordered consumer) into a `Board`, and serves:

    GET /              one HTML page (plain JS): cluster map with a legend, charts over time
                       (gpufleet/tools/charts.py: GPU allocation and utilisation per model, queue
                       depth and wait p50/p95 per queue, cost and idle cost per tenant,
                       preemptions and failures), queues, live event feed, job pages
    GET /state         the board as JSON: nodes with each GPU (free, allocated to a job, unhealthy,
                       quarantined), queues, jobs by status
    GET /events        server-sent events: every new log event as it is folded, and the `state`
                       (at most every 0.25 s), so the page updates without reload; the charts'
                       `series` on connect and again with each new point
    GET /#job/<id>     the page with that job open (its page follows the job live)
    GET /job/<id>      the job's timeline, its interruptions and why it waits (what `gpufleet explain` says)

Every request needs a token (else 401): `Authorization: Bearer <token>`, or `?token=<token>`, which
also sets an HttpOnly, SameSite=Strict cookie so the page's own requests and feed carry it. The
tokens are in `<data-dir>/dashboard-tokens.json` (mode 0600), token -> `{"role": "admin"}` (sees
everything) or `{"role": "tenant", "tenant": "acme"}` (sees its own jobs and their events; the
cluster map shows other tenants' GPUs as held by "other"). `ensure_admin_token` and `tenant_token`
make them; `gpufleet dashboard --token` gives the admin token on the command line instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote

from gpufleet.shared.contract.clusterconfig import PriceTable
from gpufleet.shared.contract.config import write_private
from gpufleet.shared.contract.events import (
    RUN_ENDED_JOB_TYPES,
    SYS_TENANT,
    Envelope,
    JobExited,
    JobPlaced,
    JobQuotaReserved,
    JobResumeRequested,
    NodeDeregistered,
    NodeGpuCleared,
    NodeGpuUnhealthy,
    NodeGpuZombieDetected,
    NodeRegistered,
    parse_envelope,
)
from gpufleet.shared.contract.ids import check_token
from gpufleet.shared.read.view import TERMINAL_STATUSES, ClusterView, apply, interruptions, pending_reasons
from gpufleet.shared.runtime.engine import refusal
from gpufleet.shared.runtime.retention import EndedJobs
from gpufleet.tools.charts import Charts

log = logging.getLogger(__name__)
ENDED = RUN_ENDED_JOB_TYPES
FEED = 500
RECENT = 40  # jobs in the page's job table, the most recently active first
HISTORY_JOBS = 2000  # jobs whose events the board keeps, the most recently active (older: read from the log)
CLIENT_EVENTS = 1000  # events kept for a page that reads slowly
STATE_EVERY_S = 0.25  # a page gets the whole state at most this often (it is big at 5,000 nodes)
OTHER = "other"  # what a tenant's page shows for another tenant's job
TOKENS_FILE = "dashboard-tokens.json"
_WORD = re.compile(r"[A-Za-z0-9_-]+")  # what a job id is made of (shared/contract/ids.py)
_COOKIE_SAFE = re.compile(r"[A-Za-z0-9._~+/=-]+")  # a token that can be a cookie's value as it is
_KEEP = frozenset({"seq", "type", "at", "tenant"})  # fields of a document never scrubbed


@dataclass
class Board:
    view: ClusterView = field(default_factory=ClusterView)
    gpus: dict[str, list[int]] = field(default_factory=dict)  # node -> whole-GPU indices
    held: dict[str, dict[int, dict[str, int]]] = field(default_factory=dict)  # node -> gpu -> job -> milli
    placed: dict[str, list[tuple[int, str, tuple[int, ...]]]] = field(default_factory=dict)  # job -> (replica, node, gpus)
    attempt: dict[str, int] = field(default_factory=dict)
    bad: dict[str, dict[int, set[str]]] = field(default_factory=dict)  # node -> gpu -> reasons
    queues: dict[str, dict[str, int]] = field(default_factory=dict)  # queue -> {gpus, jobs}
    reserved: dict[str, tuple[str, int]] = field(default_factory=dict)  # job -> (queue, gpus)
    history: dict[str, list[tuple[int, Envelope]]] = field(default_factory=dict)  # job -> its events
    feed: list[dict[str, Any]] = field(default_factory=list)
    recent: dict[str, None] = field(default_factory=dict)  # job ids, least recently active first
    recent_of: dict[str, dict[str, None]] = field(default_factory=dict)  # the same, per tenant
    # (tenant, queue, status) -> jobs: what the page counts, kept as the jobs move (no scan of every
    # job ever at each state push)
    counts: dict[tuple[str, str, str], int] = field(default_factory=dict)
    # jobs whose row ended (succeeded, failed, cancelled, rejected), for the retention window of log
    # time: a fact about one whose row was put away (a view snapshot's row segment) changes nothing
    ended: EndedJobs = field(default_factory=EndedJobs)
    charts: Charts = field(default_factory=Charts)  # the page's time series (gpufleet/tools/charts.py)

    def fold(self, seq: int, env: Envelope) -> None:
        job_id = env.job_id
        row = self.view.jobs.get(job_id) if job_id else None
        if row is None and job_id and job_id in self.ended:  # (its end is final: shared/read/view.py)
            self.view.seq = max(self.view.seq, seq)
            self.fold_extra(seq, env)
            return
        before = (row.tenant, row.queue, row.status) if row is not None else None
        apply(self.view, env, seq)
        if job_id:
            row = self.view.jobs.get(job_id)
            after = (row.tenant, row.queue, row.status) if row is not None else None
            if row is not None and row.status in TERMINAL_STATUSES and (before is None or before[2] != row.status):
                self.ended.add(job_id, env.occurred_at)
            if after != before:
                if before is not None:
                    self.counts[before] -= 1
                    if not self.counts[before]:
                        del self.counts[before]
                if after is not None:
                    self.counts[after] = self.counts.get(after, 0) + 1
        self.fold_extra(seq, env)

    def fold_extra(self, seq: int, env: Envelope) -> None:
        """What the board keeps beyond the cluster view (GPU cells, queue usage, histories, charts)."""
        self.charts.observe(self, env)  # (first: the steps this event closes are drawn from the board before it)
        p = env.payload
        if isinstance(p, NodeRegistered):
            self.gpus[p.node_id] = [g.index for g in p.inventory.gpus if not g.mig_enabled]
        elif isinstance(p, NodeDeregistered):  # removed by its pool's provider: off the map
            self.gpus.pop(p.node_id, None)
            self.held.pop(p.node_id, None)
            self.bad.pop(p.node_id, None)
        elif isinstance(p, NodeGpuUnhealthy | NodeGpuZombieDetected):
            self.bad.setdefault(p.node_id, {}).setdefault(p.gpu_index, set()).add(p.type.split("_", 1)[1])
        elif isinstance(p, NodeGpuCleared):
            reasons = self.bad.get(p.node_id, {}).get(p.gpu_index, set())
            reasons -= set(reasons) if p.returned else {"zombie_detected", "unclean"}
        elif isinstance(p, JobPlaced):
            self._release(p.job_id)
            self.attempt[p.job_id] = p.attempt
            self.placed[p.job_id] = [(a.replica, a.node_id, a.gpu_indices) for a in p.allocations]
            for a in p.allocations:
                for g in a.gpu_indices:
                    self.held.setdefault(a.node_id, {}).setdefault(g, {})[p.job_id] = a.gpu_milli
        elif isinstance(p, JobExited):
            for g in p.unclean_gpus:
                self.bad.setdefault(p.node_id, {}).setdefault(g, set()).add("unclean")
            if p.attempt == self.attempt.get(p.job_id, p.attempt):  # a late exit of an earlier run frees nothing
                self._release(p.job_id, p.replica)
        elif isinstance(p, JobResumeRequested) and p.reason.code == "preempted":
            self._unreserve(p.job_id)  # it gave its quota back
        elif isinstance(p, JobQuotaReserved):
            self._unreserve(p.job_id)
            self.reserved[p.job_id] = (p.queue, p.gpus)
            q = self.queues.setdefault(p.queue, {"gpus": 0, "jobs": 0})
            q["gpus"] += p.gpus
            q["jobs"] += 1
        if env.type in ENDED and env.job_id:
            self._release(env.job_id)
            self._unreserve(env.job_id)
            self.attempt.pop(env.job_id, None)  # (placed again: the placement says its attempt)
        if env.job_id:
            hist = self.history.pop(env.job_id, None) or []
            hist.append((seq, env))
            self.history[env.job_id] = hist  # the most recently active last
            if len(self.history) > HISTORY_JOBS:
                del self.history[next(iter(self.history))]
            for recent in (self.recent, self.recent_of.setdefault(self.owner(env.job_id) or env.tenant, {})):
                recent.pop(env.job_id, None)
                recent[env.job_id] = None
                if len(recent) > 4 * RECENT:
                    for old in list(recent)[: len(recent) - RECENT]:
                        del recent[old]
        self.feed.append(event_doc(seq, env))
        del self.feed[:-FEED]

    def _release(self, job_id: str, replica: int | None = None) -> None:
        left = []
        for r, node, gpus in self.placed.get(job_id, []):
            if replica is None or r == replica:
                for g in gpus:
                    self.held.get(node, {}).get(g, {}).pop(job_id, None)
            else:
                left.append((r, node, gpus))
        if left:
            self.placed[job_id] = left
        else:
            self.placed.pop(job_id, None)

    def _unreserve(self, job_id: str) -> None:
        held = self.reserved.pop(job_id, None)
        if held is not None:
            q = self.queues[held[0]]
            q["gpus"] -= held[1]
            q["jobs"] -= 1

    def owner(self, job_id: str) -> str | None:
        """The tenant whose job it is (the one that submitted it); None for an id never seen."""
        row = self.view.jobs.get(job_id)
        if row is not None:
            return row.tenant
        hist = self.history.get(job_id)
        return hist[0][1].tenant if hist else None

    def _label(self, job_id: str, tenant: str | None) -> str:
        """The job id as `tenant`'s page shows it: OTHER for another tenant's (None: the admin's page)."""
        return job_id if tenant is None or self.owner(job_id) == tenant else OTHER

    def scrub(self, doc: Any, tenant: str) -> Any:
        """A copy of `doc` for `tenant`'s page: every other tenant's job id in it (a field or a word
        of a message: "preempted for job X") replaced by OTHER."""
        def word(m: re.Match[str]) -> str:
            w = m.group()
            return w if w not in self.view.jobs and w not in self.history else self._label(w, tenant)
        if isinstance(doc, str):
            return _WORD.sub(word, doc)
        if isinstance(doc, dict):
            return {k: v if k in _KEEP else self.scrub(v, tenant) for k, v in doc.items()}
        if isinstance(doc, list | tuple):
            return [self.scrub(v, tenant) for v in doc]
        return doc

    def event_for(self, doc: dict[str, Any], tenant: str | None) -> dict[str, Any] | None:
        """An event document as `tenant`'s page may see it (None: not at all). A tenant sees its own
        jobs' events, node events (other tenants' jobs in them as OTHER) and its own budget's."""
        if tenant is None:
            return doc
        job_id = doc.get("job_id")
        if job_id:
            if self.owner(job_id) != tenant or doc.get("tenant") not in (tenant, SYS_TENANT):
                return None  # (a refused command of another tenant about this job is that tenant's)
        elif str(doc.get("type", "")).startswith("budget."):
            p = doc.get("payload", {})
            if p.get("scope") != "tenant" or p.get("budget") != tenant:
                return None
        elif not str(doc.get("type", "")).startswith("node."):
            return None  # dead letters and the like: the operator's
        return dict(self.scrub(doc, tenant))

    def queues_of(self, tenant: str) -> set[str]:
        """The queues `tenant` has jobs in (what its page shows of the queues)."""
        return {queue for (t, queue, _status) in self.counts if t == tenant}

    def series(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """The charts' points as `tenant`'s page shows them (None: the admin's)."""
        return self.charts.series(tenant, None if tenant is None else self.queues_of(tenant))

    def state(self, tenant: str | None = None) -> dict[str, Any]:
        """The board as a page shows it; with `tenant`, as that tenant's page does: its own jobs only,
        its queues, and other tenants' jobs on the cluster map as OTHER."""
        pending: dict[str, int] = {}
        by_status: dict[str, int] = {}
        its_queues: set[str] = set()
        for (t, queue, status), n in self.counts.items():
            if tenant is None or t == tenant:
                by_status[status] = by_status.get(status, 0) + n
                its_queues.add(queue)
            if status in ("submitted", "admitted", "queued", "reserved"):
                pending[queue] = pending.get(queue, 0) + n
        nodes = []
        for node_id in sorted(self.view.nodes):
            row = self.view.nodes[node_id]
            cells = []
            for g in self.gpus.get(node_id, []):
                bad = sorted(self.bad.get(node_id, {}).get(g, set()))
                jobs = self.held.get(node_id, {}).get(g, {})
                milli = sum(jobs.values())
                state = ("unhealthy" if "unhealthy" in bad else "quarantined" if bad
                         else "allocated" if milli >= 1000 else "shared" if milli else "free")
                label = ",".join(sorted({self._label(j, tenant) for j in jobs})) or None
                cells.append({"gpu": g, "state": state, "job": label, "milli": milli, "why": bad})
            nodes.append({"node_id": node_id, "status": row.status, "model": row.gpu_model, "gpus": cells,
                          "jobs": list(dict.fromkeys(self._label(j, tenant) for j in row.running_jobs))})
        queues = [{"queue": q, "gpus_used": v["gpus"], "running_or_placed": v["jobs"], "pending": pending.get(q, 0)}
                  for q, v in sorted(self.queues.items())]
        queues += [{"queue": q, "gpus_used": 0, "running_or_placed": 0, "pending": n}
                   for q, n in sorted(pending.items()) if q not in self.queues]
        recent: list[dict[str, Any]] = []
        ids = list(self.recent if tenant is None else self.recent_of.get(tenant, {}))
        for job_id in reversed(ids):
            jr = self.view.jobs.get(job_id)
            if jr is not None and (tenant is None or jr.tenant == tenant):
                recent.append({"job_id": job_id, "tenant": jr.tenant, "queue": jr.queue, "name": jr.name,
                               "status": jr.status, "gpus": jr.gpus, "nodes": jr.node_ids, "reason": jr.reason})
                if len(recent) == RECENT:
                    break
        if tenant is None:
            return {"seq": self.view.seq, "nodes": nodes, "queues": queues, "jobs": by_status, "recent": recent}
        return {"seq": self.view.seq, "tenant": tenant, "nodes": nodes,
                "queues": [q for q in queues if q["queue"] in its_queues], "jobs": by_status,
                "recent": self.scrub(recent, tenant)}

    def job(self, job_id: str, tenant: str | None = None,
            hist: list[tuple[int, Envelope]] | None = None) -> dict[str, Any] | None:
        """The job's page (from its events: those the board keeps, else `hist`); with `tenant`,
        None unless it is that tenant's job (as for an unknown id)."""
        hist = self.history.get(job_id) or hist
        if not hist:
            return None
        row = self.view.jobs.get(job_id)
        if row is None:  # an ended job whose row the board put away (or never had): its row from its events
            own = ClusterView()
            for s, e in hist:
                apply(own, e, s)
            row = own.jobs.get(job_id)
        if tenant is not None:
            owner = row.tenant if row is not None else self.owner(job_id)
            hist = [(s, e) for s, e in hist if e.tenant in (tenant, SYS_TENANT)] if owner == tenant else []
            if not hist:
                return None
        doc = {"job_id": job_id, "status": row.status if row else "?", "reason": row.reason if row else "",
               "timeline": [event_doc(s, e) for s, e in hist],
               "interruptions": [i.line() for i in interruptions(hist)],
               "pending": [r["text"] for r in pending_reasons(hist)]}
        return doc if tenant is None else dict(self.scrub(doc, tenant))


def event_doc(seq: int, env: Envelope) -> dict[str, Any]:
    payload = env.payload.model_dump(mode="json", exclude={"type"}, exclude_none=True)
    payload.pop("spec", None)  # big, and in job.submitted only
    return {"seq": seq, "type": env.type, "at": env.occurred_at.isoformat(), "tenant": env.tenant,
            "job_id": env.job_id, "node_id": env.node_id, "actor": env.actor, "payload": payload}


# ------------------------------------------------------------------ tokens


@dataclass(frozen=True)
class Viewer:
    """Who a page is for: the admin (tenant None), who sees everything, or one tenant."""

    tenant: str | None = None

    @property
    def admin(self) -> bool:
        return self.tenant is None


ADMIN = Viewer()


def tokens_path(data_dir: str | os.PathLike[str]) -> Path:
    return Path(data_dir) / TOKENS_FILE


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One writer of the tokens file at a time (two `gpufleet dashboard --tenant` at once)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_tokens(path: Path) -> dict[str, Any]:
    """The tokens file ({} when there is none); ValueError when it is not a JSON object."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a JSON object of token -> role")
    return doc


def _write_tokens(path: Path, doc: dict[str, Any]) -> None:
    """Replace the file at once (a reader never sees half of it), readable by its owner only."""
    write_private(path, json.dumps(doc, indent=2) + "\n")


def _viewer(entry: Any) -> Viewer | None:
    if not isinstance(entry, dict):
        return None
    if entry.get("role") == "admin":
        return ADMIN
    tenant = entry.get("tenant")
    if entry.get("role") == "tenant" and isinstance(tenant, str) and tenant and tenant != SYS_TENANT:
        return Viewer(tenant)
    return None


def _tighten(path: Path) -> None:
    if path.exists() and path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)


def ensure_admin_token(data_dir: str | os.PathLike[str]) -> str:
    """The admin token in `<data_dir>/dashboard-tokens.json`; made (secrets.token_urlsafe(32)),
    with the file (mode 0600), when there is none."""
    path = tokens_path(data_dir)
    with _locked(path):
        doc = _read_tokens(path)
        for token, entry in doc.items():
            if token and _viewer(entry) == ADMIN:
                _tighten(path)
                return token
        token = secrets.token_urlsafe(32)
        _write_tokens(path, {**doc, token: {"role": "admin"}})
        return token


def tenant_token(data_dir: str | os.PathLike[str], tenant: str) -> str:
    """The token of `tenant`'s page (its own jobs only), made when it has none."""
    check_token(tenant, "tenant")
    if tenant == SYS_TENANT:
        raise ValueError(f"{SYS_TENANT!r} is the system's own, not a tenant")
    path = tokens_path(data_dir)
    with _locked(path):
        doc = _read_tokens(path)
        for token, entry in doc.items():
            if token and _viewer(entry) == Viewer(tenant):
                _tighten(path)
                return token
        token = secrets.token_urlsafe(32)
        _write_tokens(path, {**doc, token: {"role": "tenant", "tenant": tenant}})
        return token


class Tokens:
    """Who a token is: the tokens file (read again when it changes, so a tenant token made while
    the dashboard runs works at once) and, when given, the admin token of the command line, which
    replaces the file's admin tokens."""

    def __init__(self, path: Path | None = None, admin: str | None = None) -> None:
        self.path = path
        self.admin = admin or None
        self._stamp: tuple[int, int, int] | None = None
        self._known: list[tuple[bytes, Viewer]] = []

    @classmethod
    def of(cls, data_dir: str | os.PathLike[str], admin: str | None = None) -> Tokens:
        return cls(tokens_path(data_dir), admin)

    def _refresh(self) -> None:
        if self.path is None:
            return
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._stamp, self._known = None, []
            return
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return
        try:
            doc = _read_tokens(self.path)
        except (OSError, ValueError) as exc:  # keep the tokens read before
            log.warning("dashboard tokens not read again: %s", exc)
            return
        known = [(t.encode(), v) for t, e in doc.items() if t and (v := _viewer(e)) is not None]
        self._known = [(t, v) for t, v in known if not (v.admin and self.admin)]
        self._stamp = stamp

    def viewer(self, token: str | None) -> Viewer | None:
        """Whom the token is for; None for no token or an unknown one (compared in constant time)."""
        if not token or len(token) > 1024:
            return None
        self._refresh()
        given = token.encode("utf-8", "replace")
        known = self._known + ([(self.admin.encode(), ADMIN)] if self.admin else [])
        found: Viewer | None = None
        for t, v in known:  # every one compared, whichever matches
            if hmac.compare_digest(t, given) and found is None:
                found = v
        return found


def is_loopback(host: str) -> bool:
    """Whether only this machine reaches an address the server listens on."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name (or "", every address)


def page_url(host: str, port: int, token: str) -> str:
    """The URL to open: the token in it sets the page's cookie."""
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/?token={quote(token, safe='')}"


def exposure_warning(host: str, port: int) -> str | None:
    """The line to print when the dashboard listens on more than loopback."""
    if is_loopback(host):
        return None
    return (f"warning: dashboard listens on {host or '*'}:{port}: reachable from other machines; every request "
            f"needs the token (plain HTTP: on an untrusted network put TLS in front of it)")


def check_admin_token(token: str) -> str:
    """A token given on the command line: long enough, and fit for a URL, a header and a cookie."""
    if not _COOKIE_SAFE.fullmatch(token) or len(token) < 16:
        raise ValueError("a dashboard token is 16 or more characters of letters, digits and . _ ~ + / = -")
    return token


def unauthorized(wrong: bool) -> bytes:
    first = "the token given is not valid" if wrong else "this dashboard needs a token"
    return (f"401 Unauthorized: {first}.\n"
            "Open the URL `gpufleet dashboard` printed (http://HOST:PORT/?token=TOKEN), or send the header\n"
            "`Authorization: Bearer TOKEN`. `gpufleet dashboard --tenant NAME` prints a tenant's URL.\n").encode()


def request_token(headers: dict[str, str], query: str, cookie: str) -> tuple[str | None, bool]:
    """The token a request carries, and whether it came in the URL: the Authorization header
    (Bearer), else ?token=, else the page's cookie."""
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, cred = auth.partition(" ")
        return (cred.strip() if scheme.lower() == "bearer" else ""), False
    given = parse_qs(query).get("token")
    if given:
        return given[0], True
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == cookie:
            return value, False
    return None, False


# ------------------------------------------------------------------ the server


@dataclass(eq=False)  # each page is itself (kept in a set)
class Client:
    """A connected page: the events it has not been sent yet (the newest CLIENT_EVENTS) and only
    the latest state, so a stalled page holds one state (3 MB at 5,000 nodes), not a backlog."""

    viewer: Viewer
    events: deque[bytes] = field(default_factory=lambda: deque(maxlen=CLIENT_EVENTS))
    state: bytes | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def take(self) -> bytes:
        out = b"".join(self.events) + (self.state or b"")
        self.events.clear()
        self.state = None
        self.wake.clear()
        return out


class Dashboard:
    def __init__(self, bus: Any, tokens: Tokens) -> None:
        self.bus = bus
        self.tokens = tokens
        self.board = Board()
        self.clients: set[Client] = set()
        self._sub: Any = None
        self._dirty = asyncio.Event()
        self.caught_up = False  # the board has folded all the stream held (live from here)
        self._points_sent = 0

    async def push_state(self) -> None:
        """Send the state to every page after a change, at most every STATE_EVERY_S (made once for
        the admin's pages and once for each tenant's)."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            states: dict[str | None, bytes] = {}
            made = self.board.charts.made
            new_point = made != self._points_sent
            self._points_sent = made
            for c in list(self.clients):
                key = c.viewer.tenant
                if key not in states:
                    states[key] = sse("state", self.board.state(key))
                    if new_point:  # the whole series, once per new point (not with every state)
                        states[key] += sse("series", self.board.series(key))
                c.state = states[key]  # replaces one not sent yet
                c.wake.set()
            await asyncio.sleep(STATE_EVERY_S)

    async def tick_charts(self) -> None:
        """While live, close the charts' steps in which nothing was logged (a quiet cluster still
        draws its line), and follow the nodes' GPU samples for the utilisation chart."""
        async def on_sample(msg: Any) -> None:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                self.board.charts.sample(json.loads(msg.data), time.time())

        sub = None
        with contextlib.suppress(Exception):  # (an identity that may not read samples draws no utilisation)
            sub = await self.bus.nc.subscribe("fleet.tel.node.*.gpu", cb=on_sample)
        try:
            while True:
                await asyncio.sleep(min(1.0, self.board.charts.step_s / 2))
                if self.caught_up and self.board.charts.advance(self.board, time.time()):
                    self._dirty.set()
        finally:
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    def _send(self, doc: dict[str, Any]) -> None:
        data: dict[str | None, bytes | None] = {}
        for c in list(self.clients):
            key = c.viewer.tenant
            if key not in data:
                shown = self.board.event_for(doc, key)
                data[key] = None if shown is None else sse("event", shown)
            if (out := data[key]) is not None:
                c.events.append(out)  # (the oldest unsent goes when a page falls CLIENT_EVENTS behind)
                c.wake.set()

    async def _start_board(self) -> int:
        """The board from the newest view snapshot (gpufleet/tools/viewsnap.py), when these creds hold the
        key to check it (the admin's); the sequence it covers (0: fold from the start)."""
        creds = getattr(self.bus, "creds", None)
        if creds is None or creds.kind == "tenant":
            return 0
        from gpufleet.tools.viewsnap import VIEW, ViewSnapshots

        try:
            got = await ViewSnapshots(self.bus, creds.snapshot_key(VIEW)).nearest()
        except Exception as exc:  # noqa: BLE001 - an optimisation: fold from the start
            log.warning("dashboard: no view snapshot (%s: %s); folding from the start", type(exc).__name__, exc)
            return 0
        if got is None:
            return 0
        charts = self.board.charts
        self.board, seq = got
        self.board.charts = Charts(enabled=charts.enabled, clock=charts.clock, step_s=charts.step_s,
                                   prices=charts.prices)  # (a snapshot keeps no charts)
        log.info("dashboard: from the view snapshot at seq %d", seq)
        return seq

    async def follow(self) -> None:
        """Fold the stream from the newest view snapshot (else its start), then live; tell every connected page."""
        from nats.js.api import ConsumerConfig, DeliverPolicy

        start = await self._start_board()
        config = (ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start + 1) if start
                  else ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        self._sub = await self.bus.js.subscribe("fleet.evt.>", ordered_consumer=True, config=config)
        async for msg in self._sub.messages:
            try:
                env = parse_envelope(msg.data)
            except Exception:  # noqa: BLE001 - not the contract: the services dead-letter it
                continue
            if refusal(env, msg.subject, msg.headers) is not None:
                continue  # what no core folds (shared/runtime/engine.py), the board does not show
            seq = msg.metadata.sequence.stream
            self.board.fold(seq, env)
            self.caught_up = msg.metadata.num_pending == 0
            if self.clients:
                self._send(event_doc(seq, env))
            self._dirty.set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):  # a client that does not send its request in time is dropped
                line = (await reader.readline()).decode("latin-1").split()
                headers: dict[str, str] = {}
                for _ in range(100):
                    raw = await reader.readline()
                    if raw in (b"\r\n", b"\n", b""):
                        break
                    name, _, value = raw.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                else:
                    raise ValueError("too many headers")
            path, _, query = (line[1] if len(line) > 1 else "/").partition("?")
            sock = writer.get_extra_info("sockname")
            cookie = f"gpufleet_dashboard_{sock[1]}" if isinstance(sock, tuple) and len(sock) > 1 else "gpufleet_dashboard"
            token, in_url = request_token(headers, query, cookie)
            viewer = self.tokens.viewer(token)
            if viewer is None:
                await respond(writer, 401, "text/plain; charset=utf-8", unauthorized(wrong=token is not None),
                              ['WWW-Authenticate: Bearer realm="gpufleet dashboard"'])
                return
            extra = ([f"Set-Cookie: {cookie}={token}; HttpOnly; SameSite=Strict; Path=/"]
                     if in_url and token and _COOKIE_SAFE.fullmatch(token) else [])
            tenant = viewer.tenant
            if path == "/events":
                await self._events(writer, viewer, extra)
                return
            if path == "/":
                await respond(writer, 200, "text/html; charset=utf-8", PAGE.encode(), extra)
            elif path == "/state":
                await respond(writer, 200, "application/json", json.dumps(self.board.state(tenant)).encode(), extra)
            elif path.startswith("/job/"):
                doc = await self.job_page(unquote(path.removeprefix("/job/")), tenant)
                await respond(writer, 200 if doc else 404, "application/json",
                              json.dumps(doc or {"error": "no such job"}).encode(), extra)
            else:
                await respond(writer, 404, "text/plain", b"not found", extra)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ValueError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def job_page(self, job_id: str, tenant: str | None) -> dict[str, Any] | None:
        """A job's page; the events of one the board no longer keeps (or never saw: it started from a
        view snapshot) are read from the log by the job's own subjects (its id is in them)."""
        hist = None
        if job_id not in self.board.history:  # (also one the board never had a row of: ended before its snapshot)
            from gpufleet.shared.contract.ids import is_token
            from gpufleet.shared.runtime.log import read_stream

            if is_token(job_id):
                hist = []
                async for msgs in read_stream(self.bus, (f"fleet.evt.*.job.{job_id}.>",),
                                              until_seq=self.board.view.seq):
                    for msg in msgs:
                        with contextlib.suppress(Exception):
                            env = parse_envelope(msg.data)
                            if refusal(env, msg.subject, msg.headers) is None:
                                hist.append((int(msg.metadata.sequence.stream), env))
        return self.board.job(job_id, tenant, hist)

    async def _events(self, writer: asyncio.StreamWriter, viewer: Viewer, extra: list[str]) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n"
                     + "".join(f"{h}\r\n" for h in extra).encode() + b"Connection: keep-alive\r\n\r\n")
        tenant = viewer.tenant
        writer.write(sse("state", self.board.state(tenant)))
        writer.write(sse("series", self.board.series(tenant)))
        shown = [d for d in (self.board.event_for(doc, tenant) for doc in self.board.feed) if d is not None]
        for doc in shown[-50:]:
            writer.write(sse("event", doc))
        await writer.drain()
        client = Client(viewer)
        self.clients.add(client)
        try:
            while True:
                await client.wake.wait()
                writer.write(client.take())
                await writer.drain()
        finally:
            self.clients.discard(client)


def sse(kind: str, doc: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(doc)}\n\n".encode()


async def respond(writer: asyncio.StreamWriter, status: int, ctype: str, body: bytes,
                  headers: list[str] | None = None) -> None:
    reason = {200: "OK", 401: "Unauthorized", 404: "Not Found"}.get(status, "OK")
    more = "".join(f"{h}\r\n" for h in headers or [])
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                 f"Cache-Control: no-store\r\nReferrer-Policy: no-referrer\r\nX-Content-Type-Options: nosniff\r\n"
                 f"{more}Connection: close\r\n\r\n".encode() + body)
    await writer.drain()


async def serve(bus: Any, host: str = "127.0.0.1", port: int = 8080, *, tokens: Tokens,
                prices: PriceTable | None = None,
                chart_step_s: float | None = None) -> tuple[Dashboard, asyncio.Server, asyncio.Task[None]]:
    """Start the dashboard; every request needs one of `tokens`. The charts price GPUs at
    `prices` (the cluster config's; the list prices without any) and draw a point every
    `chart_step_s` of log time (10 s)."""
    dash = Dashboard(bus, tokens)
    dash.board.charts.enabled, dash.board.charts.clock = True, time.time
    if prices is not None:
        dash.board.charts.prices = prices
    if chart_step_s is not None:
        dash.board.charts.step_s = chart_step_s

    async def run() -> None:
        pusher = asyncio.create_task(dash.push_state())
        ticker = asyncio.create_task(dash.tick_charts())
        try:
            await dash.follow()
        finally:
            pusher.cancel()
            ticker.cancel()

    follow = asyncio.create_task(run())
    server = await asyncio.start_server(dash.handle, host, port)
    return dash, server, follow


PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>gpufleet</title>
<style>
body{font:13px system-ui,sans-serif;margin:12px;background:#fafafa} h2{font-size:14px;margin:14px 0 6px}
.node{display:inline-block;margin:3px;padding:4px;border:1px solid #ccc;background:#fff;vertical-align:top}
.node.lost,.node.cordoned{opacity:.45} .gpu{display:inline-block;width:14px;height:14px;margin:1px;border-radius:2px}
.free{background:#d9ead3}.allocated{background:#3c78d8}.shared{background:#9fc5e8}.unhealthy{background:#cc0000}.quarantined{background:#e69138}
table{border-collapse:collapse} td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:left}
#feed{height:300px;overflow:auto;font-family:monospace;background:#fff;border:1px solid #ddd}
a{color:#1155cc;cursor:pointer}
.chart{display:inline-block;margin:4px 8px 4px 0;padding:4px;background:#fff;border:1px solid #ddd;vertical-align:top}
.ctitle{font-weight:600;margin-bottom:2px} .key{margin-right:8px;white-space:nowrap} .key i{display:inline-block;width:10px;height:10px;margin-right:3px;border-radius:2px}
.legend .gpu{vertical-align:middle;margin-right:2px} .legend span.k{margin-right:10px}
</style></head><body>
<b>gpufleet</b> <span id="who"></span> <span id="seq"></span> <span id="jobs"></span>
<h2>Cluster</h2><div class="legend" id="legend"><span class="k"><span class="gpu free"></span>free</span><span class="k"><span class="gpu allocated"></span>allocated</span><span class="k"><span class="gpu shared"></span>shared (a fraction held)</span><span class="k"><span class="gpu unhealthy"></span>unhealthy</span><span class="k"><span class="gpu quarantined"></span>quarantined (zombie memory, left unclean)</span></div>
<div id="map"></div>
<h2>Over time <small id="span"></small></h2><div id="charts">
<div class="chart" id="c-alloc"></div><div class="chart" id="c-util"></div><div class="chart" id="c-pending"></div>
<div class="chart" id="c-wait50"></div><div class="chart" id="c-wait95"></div><div class="chart" id="c-cost"></div>
<div class="chart" id="c-idle"></div><div class="chart" id="c-bad"></div></div>
<h2>Queues</h2><table id="queues"></table>
<h2>Jobs</h2><table id="recent"></table>
<h2>Events <input id="filter" placeholder="filter: type, job, node, tenant"></h2><div id="feed"></div>
<h2 id="jobtitle"></h2><div id="job"></div>
<script>
const $ = id => document.getElementById(id), esc = s => String(s ?? "").replace(/[&<>"']/g, c => "&#" + c.charCodeAt(0) + ";");
// the token came in the URL once and is in the page's cookie now: out of the address bar and history
if (new URLSearchParams(location.search).has("token")) history.replaceState(null, "", location.pathname + location.hash);
function drawState(s){
  $("who").textContent = s.tenant ? "tenant " + s.tenant : "admin";
  $("seq").textContent = "seq " + s.seq;
  $("jobs").textContent = Object.entries(s.jobs).map(([k, v]) => k + " " + v).join(" · ");
  $("map").innerHTML = s.nodes.map(n => `<div class="node ${esc(n.status)}" title="${esc(n.node_id)} ${esc(n.status)}">`
    + `${esc(n.node_id)} <small>${esc(n.model)}</small><br>` + n.gpus.map(g => `<span class="gpu ${g.state}" `
    + `title="GPU ${g.gpu}: ${g.state} ${esc(g.job || g.why.join(","))}"></span>`).join("") + `</div>`).join("");
  $("queues").innerHTML = "<tr><th>queue</th><th>GPUs used</th><th>placed</th><th>pending</th></tr>" + s.queues.map(q =>
    `<tr><td>${esc(q.queue)}</td><td>${q.gpus_used}</td><td>${q.running_or_placed}</td><td>${q.pending}</td></tr>`).join("");
  $("recent").innerHTML = "<tr><th>job</th><th>tenant</th><th>queue</th><th>status</th><th>GPUs</th><th>nodes</th><th>why</th></tr>"
    + (s.recent || []).map(j => `<tr class="job" data-job="${esc(j.job_id)}" data-status="${esc(j.status)}">`
    + `<td><a onclick="job('${esc(j.job_id)}')">${esc(j.job_id)}</a> <small>${esc(j.name)}</small></td><td>${esc(j.tenant)}</td>`
    + `<td>${esc(j.queue)}</td><td class="status">${esc(j.status)}</td><td>${j.gpus}</td><td>${esc(j.nodes.join(" "))}</td>`
    + `<td><small>${esc(j.reason)}</small></td></tr>`).join("");
}
const COLORS = ["#3c78d8", "#e69138", "#6aa84f", "#cc0000", "#674ea7", "#45818e", "#bf9000", "#a64d79"];
const fmt = v => v >= 100 ? v.toFixed(0) : v >= 1 ? v.toFixed(1) : v.toPrecision(2);
function chart(id, title, pts, pick, unit){
  const el = $(id);
  if (pts.some(p => pick(p) === null)) { el.hidden = true; return; }  // (not shown to this viewer)
  el.hidden = false;
  const names = [...new Set(pts.flatMap(p => Object.keys(pick(p) || {})))].sort();
  const W = 330, H = 110, L = 38, B = 14;
  let max = 0;
  for (const p of pts) for (const n of names) max = Math.max(max, (pick(p) || {})[n] || 0);
  max = max || 1;
  const x = i => L + (pts.length < 2 ? 0 : i * (W - L - 4) / (pts.length - 1)), y = v => H - B - v * (H - B - 8) / max;
  const lines = names.map((n, k) => `<polyline class="series" data-series="${esc(n)}" fill="none" stroke="${COLORS[k % COLORS.length]}" `
    + `stroke-width="1.5" points="${pts.map((p, i) => x(i).toFixed(1) + "," + y((pick(p) || {})[n] || 0).toFixed(1)).join(" ")}"/>`).join("");
  const t0 = pts.length ? pts[0].t.slice(11, 19) : "", t1 = pts.length ? pts[pts.length - 1].t.slice(11, 19) : "";
  el.innerHTML = `<div class="ctitle">${esc(title)}</div><svg width="${W}" height="${H}" data-points="${pts.length}">`
    + `<line x1="${L}" y1="${H - B}" x2="${W}" y2="${H - B}" stroke="#999"/><line x1="${L}" y1="4" x2="${L}" y2="${H - B}" stroke="#999"/>`
    + `<text x="2" y="12" font-size="10">${fmt(max)}${esc(unit)}</text><text x="2" y="${H - B}" font-size="10">0</text>`
    + `<text x="${L}" y="${H - 2}" font-size="10">${esc(t0)}</text><text x="${W - 44}" y="${H - 2}" font-size="10">${esc(t1)}</text>`
    + lines + `</svg><div>` + (names.map((n, k) => `<span class="key"><i style="background:${COLORS[k % COLORS.length]}"></i>${esc(n)}</span>`).join("")
    || "<small>nothing yet</small>") + `</div>`;
}
function drawSeries(pts){
  $("span").textContent = pts.length ? `${pts.length} points, ${pts[0].t.slice(11, 19)} to ${pts[pts.length - 1].t.slice(11, 19)} (UTC)` : "";
  chart("c-alloc", "GPUs allocated, by model", pts, p => p.alloc, "");
  chart("c-util", "GPU utilisation of allocated GPUs, by model", pts, p => p.util, "%");
  chart("c-pending", "jobs waiting, by queue", pts, p => p.pending, "");
  chart("c-wait50", "queue wait p50 (submitted to placed), by queue", pts, p => p.wait_p50, "s");
  chart("c-wait95", "queue wait p95, by queue", pts, p => p.wait_p95, "s");
  chart("c-cost", "cost per step, by tenant", pts, p => p.cost, "$");
  chart("c-idle", "idle cost per step (GPUs under 5% busy), by tenant", pts, p => p.idle_cost, "$");
  chart("c-bad", "preemptions and failures per step", pts, p => p.preempted === null ? null : {preempted: p.preempted, failed: p.failed}, "");
}
function shown(row){ const f = $("filter").value.trim(); return !f || row.dataset.text.includes(f); }
function addEvent(e){
  const row = document.createElement("div");
  row.dataset.text = [e.type, e.job_id, e.node_id, e.tenant].join(" ");
  row.hidden = !shown(row);
  row.innerHTML = `${e.seq} ${esc(e.at.slice(11, 23))} ${esc(e.type)} ` + (e.job_id ? `<a onclick="job('${esc(e.job_id)}')">${esc(e.job_id)}</a>` : esc(e.node_id));
  $("feed").prepend(row);
  while ($("feed").childNodes.length > 1000) $("feed").lastChild.remove();
  if (e.job_id && e.job_id === openJob) job(openJob);  // the open job page follows the job live
}
let openJob = null;
async function job(id){
  openJob = id;
  if (location.hash !== "#job/" + id) history.replaceState(null, "", "#job/" + id);
  const r = await fetch("/job/" + encodeURIComponent(id));
  if (id !== openJob) return;
  if (!r.ok) { $("jobtitle").textContent = "Job " + id + ": no events"; $("job").innerHTML = ""; return; }
  const d = await r.json();
  if (id !== openJob) return;
  $("jobtitle").dataset.status = d.status;
  $("jobtitle").textContent = "Job " + id + ": " + d.status + " " + (d.reason || "");
  $("job").innerHTML = (d.pending || []).map(l => `<div class="why"><b>${esc(l)}</b></div>`).join("")
    + d.interruptions.map(l => `<div><b>${esc(l)}</b></div>`).join("")
    + d.timeline.map(e => `<div>${e.seq} ${esc(e.at.slice(11, 23))} ${esc(e.type)} <small>${esc(JSON.stringify(e.payload))}</small></div>`).join("");
}
$("filter").addEventListener("input", () => { for (const row of $("feed").children) row.hidden = !shown(row); });
if (location.hash.startsWith("#job/")) job(decodeURIComponent(location.hash.slice(5)));
const es = new EventSource("/events");
es.addEventListener("state", m => drawState(JSON.parse(m.data)));
es.addEventListener("event", m => addEvent(JSON.parse(m.data)));
es.addEventListener("series", m => drawSeries(JSON.parse(m.data)));
es.addEventListener("error", () => { if (es.readyState === EventSource.CLOSED)
  $("seq").textContent = "disconnected: reload the page (open the URL with ?token= if it asks for a token)"; });
</script></body></html>
"""
