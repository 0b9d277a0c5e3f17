"""The cluster view: jobs and nodes as a pure fold of the log.

The PostgreSQL read model and `gpufleet replay` both use this fold, so the state rebuilt from
the log and the live read model are the same by construction (and a test checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpufleet.shared.contract.events import (
    TERMINAL_JOB_TYPES,
    Envelope,
    JobCancelled,
    JobCancelRequested,
    JobCheckpointVerified,
    JobDataStaged,
    JobDataStaging,
    JobExited,
    JobFailed,
    JobPlaced,
    JobPreempted,
    JobQueued,
    JobRejected,
    JobResized,
    JobResumeRequested,
    JobScaled,
    JobSubmitted,
    JobUnschedulable,
    NodeDeregistered,
    NodeRegistered,
    _NodePayload,
)

# The documented job statuses, in life-cycle order. `serving`: an inference service (autoscale),
# which holds nothing itself, once the autoscaler set its replicas (`replicas`: how many it wants).
JOB_STATUSES: tuple[str, ...] = (
    "submitted", "admitted", "queued", "reserved", "placed", "running", "serving",
    "succeeded", "failed", "cancelled", "preempted", "rejected",
)
TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled", "rejected"})
NODE_STATUSES: tuple[str, ...] = ("ready", "cordoned", "lost")


@dataclass
class JobRow:
    job_id: str
    tenant: str
    queue: str = "default"
    name: str = ""
    type: str = ""
    status: str = "submitted"
    reason: str = ""
    priority: int = 0
    replicas: int = 1
    gpus: int = 0
    node_ids: list[str] = field(default_factory=list)
    submitted_at: str = ""
    updated_at: str = ""
    last_seq: int = 0


@dataclass
class NodeRow:
    node_id: str
    status: str = "ready"
    gpu_model: str = ""
    gpus_total: int = 0
    gpus_allocated: int = 0
    cpu_milli: int = 0
    memory_mib: int = 0
    running_jobs: list[str] = field(default_factory=list)
    last_seq: int = 0


@dataclass
class ClusterView:
    seq: int = 0
    jobs: dict[str, JobRow] = field(default_factory=dict)
    nodes: dict[str, NodeRow] = field(default_factory=dict)
    # job_id -> {replica: (node_id, GPUs it holds)}; a gang's replicas end one by one
    allocations: dict[str, dict[int, tuple[str, int]]] = field(default_factory=dict)

    def as_json(self, keep: Callable[[JobRow], bool] | None = None) -> dict[str, Any]:
        """`seq`, the job rows (those `keep` keeps) and the node rows, by id, as plain dicts."""
        rows = (self.jobs[k] for k in sorted(self.jobs))
        return {
            "seq": self.seq,
            "jobs": [_row_doc(r) for r in rows if keep is None or keep(r)],
            "nodes": [_row_doc(self.nodes[k]) for k in sorted(self.nodes)],
        }


def _row_doc(row: JobRow | NodeRow) -> dict[str, Any]:
    """`asdict` of a row, without its deep copy of every field (10x faster: replay prints 100k rows)."""
    d = dict(row.__dict__)
    for k, v in d.items():
        if isinstance(v, list):
            d[k] = list(v)
    return d


def _release(view: ClusterView, job_id: str, seq: int, touched: set[str], replica: int | None = None) -> None:
    """Free what the job (or just one of its replicas) holds."""
    held = view.allocations.get(job_id)
    if not held:
        return
    for r in [replica] if replica is not None else list(held):
        if r not in held:
            continue
        node_id, gpus = held.pop(r)
        node = view.nodes.get(node_id)
        if node is not None:
            node.gpus_allocated = max(0, node.gpus_allocated - gpus)
            if job_id in node.running_jobs and not any(n == node_id for n, _ in held.values()):
                node.running_jobs.remove(job_id)
            node.last_seq = seq
            touched.add(node_id)
    if not held:
        del view.allocations[job_id]


def apply(view: ClusterView, env: Envelope, seq: int) -> tuple[set[str], set[str]]:
    """Fold one event into the view; return the (job ids, node ids) whose rows changed."""
    view.seq = max(view.seq, seq)
    jobs_touched: set[str] = set()
    nodes_touched: set[str] = set()
    p = env.payload
    at = env.occurred_at.isoformat()
    t = env.type
    if isinstance(p, _NodePayload):  # every node.* fact
        node_id = p.node_id
        node = view.nodes.get(node_id)
        if isinstance(p, NodeRegistered):
            inv = p.inventory
            models = sorted({g.model for g in inv.gpus})
            if node is None:
                node = view.nodes[node_id] = NodeRow(node_id=node_id)
            node.status = "ready"
            node.gpu_model = ",".join(models)
            node.gpus_total = len(inv.gpus)
            node.cpu_milli = inv.cpu_milli
            node.memory_mib = inv.memory_mib
        elif node is None:
            return jobs_touched, nodes_touched
        elif isinstance(p, NodeDeregistered):  # removed by its pool's provider: the row goes
            del view.nodes[node_id]
            nodes_touched.add(node_id)
            return jobs_touched, nodes_touched
        elif t == "node.lost":
            node.status = "lost"
        elif t == "node.cordoned":
            node.status = "cordoned"
        elif t == "node.uncordoned":
            node.status = "ready"
        else:
            return jobs_touched, nodes_touched
        node.last_seq = seq
        nodes_touched.add(node_id)
        return jobs_touched, nodes_touched
    job_id = env.job_id
    if job_id is None:
        return jobs_touched, nodes_touched
    job = view.jobs.get(job_id)
    if t == "cmd.submit":
        return jobs_touched, nodes_touched
    if job is None:
        if t not in ("job.submitted", "job.rejected"):
            return jobs_touched, nodes_touched
        job = view.jobs[job_id] = JobRow(job_id=job_id, tenant=env.tenant, submitted_at=at)
    if job.status in TERMINAL_STATUSES:
        # A job's end is final: a decision that raced it, a late exit of another replica, a copy,
        # change nothing in its row (what it held was released at the end). So a view that put
        # the rows of ended jobs away (gpufleet/tools/viewsnap.py) folds on exactly as one that kept them.
        return jobs_touched, nodes_touched
    if isinstance(p, JobSubmitted):
        spec = p.spec
        job.queue, job.name, job.type = spec.queue, spec.name, spec.type
        job.priority, job.replicas, job.gpus = spec.priority, spec.replicas, spec.gpus_total
        job.status = "submitted"
    elif t == "job.admitted":
        job.status, job.reason = "admitted", ""
    elif isinstance(p, JobRejected):
        job.status = "rejected"
        job.reason = "; ".join(r.message for r in p.reasons)
    elif isinstance(p, JobQueued):
        job.status = "queued"
        job.reason = p.reason.message if p.reason else ""
    elif t == "job.quota_reserved":
        job.status, job.reason = "reserved", "waiting for placement"
    elif isinstance(p, JobUnschedulable):
        job.reason = "; ".join(r.message for r in p.reasons)
    elif isinstance(p, JobPlaced):
        job.status, job.reason = "placed", ""
        job.replicas = len(p.allocations)  # (an elastic job: its size now)
        _release(view, job_id, seq, nodes_touched)
        held = view.allocations[job_id] = {
            a.replica: (a.node_id, len(a.gpu_indices)) for a in p.allocations
        }
        job.node_ids = sorted({n for n, _ in held.values()})
        for node_id, gpus in held.values():
            node = view.nodes.get(node_id)
            if node is not None:
                node.gpus_allocated += gpus
                if job_id not in node.running_jobs:
                    node.running_jobs.append(job_id)
                node.last_seq = seq
                nodes_touched.add(node_id)
    elif isinstance(p, JobDataStaging):  # placed, its data being copied to its node: not started yet
        job.reason = f"staging {p.field} {p.uri} on {p.node_id}: {_bytes(p.done_bytes)}" + (
            f" of {_bytes(p.total_bytes)}" if p.total_bytes is not None else "")
    elif isinstance(p, JobDataStaged):
        job.reason = f"{p.field} {p.name} on {p.node_id}: {_staged_text(p)}"
    elif t == "job.started":
        if job.status not in TERMINAL_STATUSES:
            job.status = "running"
    elif isinstance(p, JobExited):
        _release(view, job_id, seq, nodes_touched, replica=p.replica)
        if job.status not in TERMINAL_STATUSES:
            job.reason = f"exited {p.exit_code} ({p.reason})"
    elif t == "job.succeeded":
        job.status, job.reason = "succeeded", ""
        _release(view, job_id, seq, nodes_touched)
    elif isinstance(p, JobFailed):
        job.status, job.reason = "failed", p.reason.message
        _release(view, job_id, seq, nodes_touched)
    elif isinstance(p, JobCancelled):
        job.status, job.reason = "cancelled", p.reason
        _release(view, job_id, seq, nodes_touched)
    elif isinstance(p, JobPreempted):
        job.status, job.reason = "preempted", p.reason.message
        _release(view, job_id, seq, nodes_touched)
    elif isinstance(p, JobCancelRequested):
        job.reason = f"cancelling: {p.reason}"
    elif isinstance(p, JobResumeRequested):
        job.status, job.reason = "queued", p.reason.message
    elif isinstance(p, JobResized):  # an elastic job: it stops with a checkpoint, then runs at its new size
        job.reason = f"resizing {p.from_replicas} -> {p.to_replicas} replicas ({p.reason.code})"
    elif isinstance(p, JobScaled):  # an inference service: its replicas are jobs of their own
        job.status, job.replicas = "serving", p.to_replicas
        job.reason = f"{p.to_replicas} replica(s) ({p.reason.code}): {p.reason.message}"
    else:
        return jobs_touched, nodes_touched
    job.updated_at = at
    job.last_seq = seq
    jobs_touched.add(job_id)
    return jobs_touched, nodes_touched


@dataclass
class Interruption:
    """One run of a job that ended before the job did, and what came after it (for `explain`)."""

    attempt: int
    node_id: str
    reason: str  # the exit's reason (node_lost, preempted, error, killed) or the resume's code
    seq: int  # of the exit, or of the resume when nothing exited
    resume_seq: int
    resume_code: str
    checkpoint_uri: str | None
    lost_work_s: float
    next_node: str | None = None  # where the next run was placed, once it was
    next_seq: int | None = None
    resumed_from: str | None = None  # the checkpoint the next run really found good (its verification)
    resized: str | None = None  # an elastic job's resize that ended the run: "4 -> 2 (shrink, for JOB)"
    next_replicas: int | None = None  # the replicas of the next run, once placed

    def line(self) -> str:
        where = f"on {self.node_id}" if self.node_id else "before it started"
        uri = self.resumed_from or self.checkpoint_uri
        frm = f"from {uri}" if uri else "from the start"
        nxt = (f"run {self.attempt + 1} placed on {self.next_node} (seq {self.next_seq})" if self.next_node
               else f"run {self.attempt + 1} not placed yet")
        if self.resized:
            nxt = f"{self.resized} replicas; {nxt}" + (f" with {self.next_replicas}" if self.next_replicas else "")
        return (f"interrupted: run {self.attempt} {where} ended {self.reason} (seq {self.seq}); "
                f"{self.resume_code}: {nxt}, {frm}, {self.lost_work_s:.1f} s of work lost (seq {self.resume_seq})")


def interruptions(history: list[tuple[int, Envelope]]) -> list[Interruption]:
    """Each interruption of a job's history: the run that ended, why, and where it resumed from."""
    out: list[Interruption] = []
    last_exit: dict[int, tuple[int, JobExited]] = {}
    resized: dict[int, JobResized] = {}
    for seq, env in history:
        p = env.payload
        if isinstance(p, JobResized):
            resized.setdefault(p.attempt, p)
        elif isinstance(p, JobExited):
            last_exit.setdefault(p.attempt, (seq, p))
            late = next((i for i in out if i.attempt == p.attempt and not i.node_id), None)
            if late is not None:  # the run was told to stop (a failing GPU) and ended after the resume
                late.node_id, late.reason, late.seq = p.node_id, f"{late.reason} ({p.reason})", seq
        elif isinstance(p, JobResumeRequested):
            attempt = len(out) + 1
            ex = last_exit.get(attempt)
            out.append(Interruption(
                attempt=attempt, node_id=ex[1].node_id if ex else "", reason=ex[1].reason if ex else p.reason.code,
                seq=ex[0] if ex else seq, resume_seq=seq, resume_code=p.reason.code,
                checkpoint_uri=p.checkpoint_uri, lost_work_s=p.lost_work_s))
            rz = resized.get(attempt)
            if p.reason.code == "resized" and rz is not None:
                out[-1].resized = f"{rz.from_replicas} -> {rz.to_replicas} ({rz.reason.code}" + (
                    f", for {rz.for_job})" if rz.for_job else ")")
        elif isinstance(p, JobCheckpointVerified) and out and p.attempt == out[-1].attempt + 1:
            out[-1].resumed_from = p.latest_uri
        elif env.type == "job.placed" and out:
            placed = env.payload
            if getattr(placed, "attempt", 1) == out[-1].attempt + 1 and out[-1].next_node is None:
                allocs = getattr(placed, "allocations", ())
                out[-1].next_node = ",".join(sorted({a.node_id for a in allocs}))
                out[-1].next_replicas = len(allocs)
                out[-1].next_seq = seq
    return out


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _staged_text(p: JobDataStaged) -> str:
    if p.cached:
        return f"cached ({_bytes(p.size_bytes)}), no copy"
    return f"staged from {p.uri}: {_bytes(p.copied_bytes)} copied in {p.staging_s:.2f} s"


def data_staging(history: list[tuple[int, Envelope]]) -> list[dict[str, Any]]:
    """For `explain`: how each run got its dataset / model onto its node (copied: bytes and seconds,
    or cached, no copy), and a copy still under way. One line per (attempt, replica, field)."""
    done: dict[tuple[int, int, str], dict[str, Any]] = {}
    going: dict[tuple[int, int, str], dict[str, Any]] = {}
    for seq, env in history:
        p = env.payload
        if isinstance(p, JobDataStaged):
            k = (p.attempt, p.replica, p.field)
            going.pop(k, None)
            done[k] = {"seq": seq, "attempt": p.attempt, "replica": p.replica, "node_id": p.node_id,
                       "field": p.field, "name": p.name, "uri": p.uri, "cached": p.cached,
                       "size_bytes": p.size_bytes, "copied_bytes": p.copied_bytes, "staging_s": p.staging_s,
                       "text": f"{p.field} {p.name} on {p.node_id} (run {p.attempt}, replica {p.replica}): "
                               f"{_staged_text(p)} (seq {seq})"}
        elif isinstance(p, JobDataStaging) and (p.attempt, p.replica, p.field) not in done:
            total = f" of {_bytes(p.total_bytes)}" if p.total_bytes is not None else ""
            going[(p.attempt, p.replica, p.field)] = {
                "seq": seq, "attempt": p.attempt, "replica": p.replica, "node_id": p.node_id, "field": p.field,
                "uri": p.uri, "done_bytes": p.done_bytes, "total_bytes": p.total_bytes, "elapsed_s": p.elapsed_s,
                "text": f"{p.field} {p.uri} on {p.node_id} (run {p.attempt}, replica {p.replica}): staging, "
                        f"{_bytes(p.done_bytes)}{total} after {p.elapsed_s:.1f} s (seq {seq})"}
    return [v for _, v in sorted({**done, **going}.items())]


def pending_reasons(hist: list[tuple[int, Any]]) -> list[dict[str, Any]]:
    """Why a job still waits, each statement with the sequence number of the event it comes from."""
    out: list[dict[str, Any]] = []
    last_seq, last = hist[-1]
    if last.type in TERMINAL_JOB_TYPES:
        return out
    why = [(s, e) for s, e in hist if e.type in ("job.queued", "job.unschedulable")]
    if why and why[-1][0] > max((s for s, e in hist if e.type in ("job.quota_reserved", "job.placed")), default=0):
        seq, env = why[-1]
        reasons = [env.payload.reason] if isinstance(env.payload, JobQueued) and env.payload.reason else \
            list(getattr(env.payload, "reasons", ()))
        kind = "quota" if env.type == "job.queued" else "placement"
        filtered = getattr(env.payload, "filtered", {}) or {}
        for r in reasons:
            out.append({"seq": seq, "kind": kind, "code": r.code, "message": r.message,
                        "filtered": filtered if kind == "placement" else {},
                        "text": f"pending ({kind}, seq {seq}): {r.message} [{r.code}]"})
    else:
        out.append({"seq": last_seq, "kind": "last_event", "code": last.type, "message": "",
                    "text": f"pending: last event {last.type} (seq {last_seq})"})
    held = [(s, e) for s, e in hist if e.type == "job.backfill_reserved"]
    if held and not any(e.type == "job.placed" for _, e in hist):
        seq, env = held[-1]
        p = env.payload
        runtime_s, runtime_from = getattr(p, "runtime_s", None), getattr(p, "runtime_from", None)
        after, after_from = getattr(p, "after_job", None), getattr(p, "after_from", None)
        rests = ""
        if after:
            rests += f"; it starts when {after} ends ({after_from})"
        if runtime_s is not None:
            rests += f"; it is expected to run {runtime_s:.0f} s ({runtime_from})"
        out.append({"seq": seq, "kind": "backfill", "code": "backfill_reserved", "message": "",
                    "nodes": list(getattr(p, "nodes", ())), "estimated_start": str(getattr(p, "estimated_start", "")),
                    "runtime_s": runtime_s, "runtime_from": runtime_from, "after_job": after, "after_from": after_from,
                    "text": f"backfill reservation (seq {seq}): nodes {', '.join(getattr(p, 'nodes', ()))} held for it "
                            f"from {getattr(p, 'estimated_start', '?')}{rests}; smaller jobs run there only if "
                            "they end before"})
    preempt = [(s, e) for s, e in hist if e.type == "job.preemption_requested"]
    if preempt and preempt[-1][0] > max((s for s, e in hist if e.type == "job.placed"), default=0):
        seq, env = preempt[-1]
        p = env.payload
        out.append({"seq": seq, "kind": "preempted", "code": p.reason.code, "message": p.reason.message,
                    "by_job_id": p.by_job_id,
                    "text": f"preempted (seq {seq}) by {p.by_job_id or 'policy'}: {p.reason.message}"})
    return out
