"""`gpufleet dashboard`: a live web view fed from the event stream (no database, no build step).

The server folds FLEET from the start (an ordered consumer) into a `Board`, and serves:

    GET /              one HTML page (plain JS): cluster map, queues, live event feed, job pages
    GET /state         the board as JSON: nodes with each GPU (free, allocated to a job, unhealthy,
                       quarantined), queues, jobs by status
    GET /events        server-sent events: every new log event as it is folded, and the `state`
                       (at most every 0.25 s), so the page updates without reload
    GET /#job/<id>     the page with that job open (its page follows the job live)
    GET /job/<id>      the job's timeline, its interruptions and why it waits (what `gpufleet explain` says)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from gpufleet.shared.events import (
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
from gpufleet.shared.view import ClusterView, apply, interruptions, pending_reasons

log = logging.getLogger(__name__)
ENDED = ("job.succeeded", "job.failed", "job.cancelled", "job.preempted", "job.rejected")
FEED = 500
RECENT = 40  # jobs in the page's job table, the most recently active first
CLIENT_EVENTS = 1000  # events kept for a page that reads slowly
STATE_EVERY_S = 0.25  # a page gets the whole state at most this often (it is big at 5,000 nodes)


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

    def fold(self, seq: int, env: Envelope) -> None:
        apply(self.view, env, seq)
        self.fold_extra(seq, env)

    def fold_extra(self, seq: int, env: Envelope) -> None:
        """What the board keeps beyond the cluster view (GPU cells, queue usage, histories)."""
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
            reasons -= {"zombie_detected", "unclean"}
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
        if env.job_id:
            self.history.setdefault(env.job_id, []).append((seq, env))
            self.recent.pop(env.job_id, None)
            self.recent[env.job_id] = None
            if len(self.recent) > 4 * RECENT:
                for old in list(self.recent)[: len(self.recent) - RECENT]:
                    del self.recent[old]
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

    def state(self) -> dict[str, Any]:
        pending: dict[str, int] = {}
        by_status: dict[str, int] = {}
        for j in self.view.jobs.values():
            by_status[j.status] = by_status.get(j.status, 0) + 1
            if j.status in ("submitted", "admitted", "queued", "reserved"):
                pending[j.queue] = pending.get(j.queue, 0) + 1
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
                cells.append({"gpu": g, "state": state, "job": ",".join(sorted(jobs)) or None, "milli": milli,
                              "why": bad})
            nodes.append({"node_id": node_id, "status": row.status, "model": row.gpu_model, "gpus": cells,
                          "jobs": list(row.running_jobs)})
        queues = [{"queue": q, "gpus_used": v["gpus"], "running_or_placed": v["jobs"], "pending": pending.get(q, 0)}
                  for q, v in sorted(self.queues.items())]
        queues += [{"queue": q, "gpus_used": 0, "running_or_placed": 0, "pending": n}
                   for q, n in sorted(pending.items()) if q not in self.queues]
        recent = []
        for job_id in reversed(list(self.recent)[-RECENT:]):
            jr = self.view.jobs.get(job_id)
            if jr is not None:
                recent.append({"job_id": job_id, "tenant": jr.tenant, "queue": jr.queue, "name": jr.name,
                               "status": jr.status, "gpus": jr.gpus, "nodes": jr.node_ids, "reason": jr.reason})
        return {"seq": self.view.seq, "nodes": nodes, "queues": queues, "jobs": by_status, "recent": recent}

    def job(self, job_id: str) -> dict[str, Any] | None:
        hist = self.history.get(job_id)
        if not hist:
            return None
        row = self.view.jobs.get(job_id)
        return {"job_id": job_id, "status": row.status if row else "?", "reason": row.reason if row else "",
                "timeline": [event_doc(s, e) for s, e in hist],
                "interruptions": [i.line() for i in interruptions(hist)],
                "pending": [r["text"] for r in pending_reasons(hist)]}


def event_doc(seq: int, env: Envelope) -> dict[str, Any]:
    payload = env.payload.model_dump(mode="json", exclude={"type"}, exclude_none=True)
    payload.pop("spec", None)  # big, and in job.submitted only
    return {"seq": seq, "type": env.type, "at": env.occurred_at.isoformat(), "tenant": env.tenant,
            "job_id": env.job_id, "node_id": env.node_id, "actor": env.actor, "payload": payload}


@dataclass(eq=False)  # each page is itself (kept in a set)
class Client:
    """A connected page: the events it has not been sent yet (the newest CLIENT_EVENTS) and only
    the latest state, so a stalled page holds one state (3 MB at 5,000 nodes), not a backlog."""

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
    def __init__(self, bus: Any) -> None:
        self.bus = bus
        self.board = Board()
        self.clients: set[Client] = set()
        self._sub: Any = None
        self._dirty = asyncio.Event()

    async def push_state(self) -> None:
        """Send the state to every page after a change, at most every STATE_EVERY_S."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            if self.clients:
                data = sse("state", self.board.state())
                for c in list(self.clients):
                    c.state = data  # replaces one not sent yet
                    c.wake.set()
            await asyncio.sleep(STATE_EVERY_S)

    def _send(self, data: bytes) -> None:
        for c in list(self.clients):
            c.events.append(data)  # (the oldest unsent goes when a page falls CLIENT_EVENTS behind)
            c.wake.set()

    async def follow(self) -> None:
        """Fold the stream from its start, then live; tell every connected page."""
        from nats.js.api import DeliverPolicy

        self._sub = await self.bus.js.subscribe("fleet.evt.>", ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
        async for msg in self._sub.messages:
            try:
                env = parse_envelope(msg.data)
            except Exception:  # noqa: BLE001 - not the contract: the services dead-letter it
                continue
            seq = msg.metadata.sequence.stream
            self.board.fold(seq, env)
            if self.clients:
                self._send(sse("event", event_doc(seq, env)))
            self._dirty.set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):  # a client that does not send its request in time is dropped
                line = (await reader.readline()).decode("latin-1").split()
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
            path = (line[1] if len(line) > 1 else "/").split("?", 1)[0]
            if path == "/events":
                await self._events(writer)
                return
            if path == "/":
                await respond(writer, 200, "text/html; charset=utf-8", PAGE.encode())
            elif path == "/state":
                await respond(writer, 200, "application/json", json.dumps(self.board.state()).encode())
            elif path.startswith("/job/"):
                doc = self.board.job(unquote(path.removeprefix("/job/")))
                await respond(writer, 200 if doc else 404, "application/json",
                              json.dumps(doc or {"error": "no such job"}).encode())
            else:
                await respond(writer, 404, "text/plain", b"not found")
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ValueError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _events(self, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     b"Connection: keep-alive\r\n\r\n")
        writer.write(sse("state", self.board.state()))
        for doc in self.board.feed[-50:]:
            writer.write(sse("event", doc))
        await writer.drain()
        client = Client()
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


async def respond(writer: asyncio.StreamWriter, status: int, ctype: str, body: bytes) -> None:
    reason = {200: "OK", 404: "Not Found"}.get(status, "OK")
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                 f"Connection: close\r\n\r\n".encode() + body)
    await writer.drain()


async def serve(bus: Any, host: str = "127.0.0.1", port: int = 8080) -> tuple[Dashboard, asyncio.Server, asyncio.Task[None]]:
    dash = Dashboard(bus)

    async def run() -> None:
        pusher = asyncio.create_task(dash.push_state())
        try:
            await dash.follow()
        finally:
            pusher.cancel()

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
</style></head><body>
<b>gpufleet</b> <span id="seq"></span> <span id="jobs"></span>
<h2>Cluster</h2><div id="map"></div>
<h2>Queues</h2><table id="queues"></table>
<h2>Jobs</h2><table id="recent"></table>
<h2>Events <input id="filter" placeholder="filter: type, job, node, tenant"></h2><div id="feed"></div>
<h2 id="jobtitle"></h2><div id="job"></div>
<script>
const $ = id => document.getElementById(id), esc = s => String(s ?? "").replace(/[&<>"']/g, c => "&#" + c.charCodeAt(0) + ";");
function drawState(s){
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
</script></body></html>
"""
