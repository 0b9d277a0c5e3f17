"""`gpufleet audit`: check invariants over the whole log, and name the first event that breaks each.

A pure fold, independent of the services' own code paths (it keeps its own books), so a bug in
a service shows up here instead of being agreed with:

- gpu_capacity: no GPU holds more than 1000 milli-GPU (whole GPUs and shares), and no allocation
  names a GPU its node does not have;
- quota_limit: no queue goes over nominal + borrowingLimit, no cohort over its subtree quota +
  borrowingLimit, no root over the quota it holds (the cluster config's tree); a reservation (or a
  placement) written just after its job ended, decided before, holds nothing, as quota and the
  placer drop it;
- pending_reason: every job submitted either ended, runs (a service: serves), or waits with a reason it was told
  (`job.queued`, `job.unschedulable`, `job.rejected` ...) — checked at the head of the log;
- lost_node: no job is placed on a node its placer knew was lost (until it registers again) or
  removed (`node.deregistered`: a removed node's GPUs leave the capacity books), and none is
  started on one. A placement written just after a loss but decided on an event before it (its
  cause, within RACE_WINDOW events of the loss) is the race every scheduler has (kube-scheduler
  binds to a node going NotReady): nothing can have told the placer yet, and NATS lets a publish
  carry one guard subject, the placements'. It is allowed as long as it never starts: the
  executor ends it (`node_lost`) and the job is placed again;
- preemption_request: every preemption (`job.preempted`, an exit `preempted`) follows a
  `job.preemption_requested` for that job;
- author: every fact is by an owner of its type (shared/trust/authz.py `OWNERS`), and sits on the
  subject its envelope names (the subject is what the server's permissions checked);
- gap: every sequence between the stream's first and last is there (none deleted);
- head: the stream starts at sequence 1, or an archive holds what came before (a purge, or limits
  that dropped the oldest events, leave a log whose fold is not the cluster's history).

The last three need the stream's own facts (`LogFacts`); without them only `author` is checked
(on the envelopes).

`Auditor` is the fold as one that can stop and go on; `audit_log` (`gpufleet audit`) stores its
books at the sequence it checked (`SNAP_audit`, HMAC-signed with the admin's audit key) and next
time reads only the log after them: the report is the whole log's either way (a violation found
before the record is still reported), `--full` reads it all. Ended jobs leave the books, so the
record does not grow with every job ever run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from gpufleet.services.quota.tree import QuotaTree
from gpufleet.shared.contract.clusterconfig import ClusterConfig
from gpufleet.shared.contract.events import (
    RUN_ENDED_JOB_TYPES,
    Envelope,
    JobExited,
    JobPlaced,
    JobQuotaReserved,
    JobResumeRequested,
    JobStarted,
    JobSubmitted,
    NodeDeregistered,
    NodeLost,
    NodeRegistered,
    ReplicaAllocation,
)
from gpufleet.shared.trust.authz import foreign_author

MILLI = 1000
INVARIANTS = ("gpu_capacity", "quota_limit", "pending_reason", "lost_node", "preemption_request",
              "author", "gap", "head")
ENDED = RUN_ENDED_JOB_TYPES
RACE_WINDOW = 10_000  # events: how far behind the log a placement's cause may be (and the loss before it)
TOLD = frozenset({"job.queued", "job.unschedulable", "job.backfill_reserved", "job.rejected"})


@dataclass
class Violation:
    invariant: str
    seq: int
    event_id: str
    event_type: str
    message: str
    job_id: str | None = None
    node_id: str | None = None


@dataclass
class LogFacts:
    """What the stream itself says, beside the parsed events: its first and last sequence, every
    sequence read (parsed or not) with its subject, and how far an archive reaches (1..archived)."""

    first_seq: int
    last_seq: int
    subjects: dict[int, str] = field(default_factory=dict)
    archived_to: int = 0
    exists: bool = True


@dataclass
class _Books:
    gpus: dict[str, set[int]] = field(default_factory=dict)  # node -> its whole-GPU indices
    mig: dict[str, set[str]] = field(default_factory=dict)  # node -> its MIG instance UUIDs
    mig_held: dict[str, str] = field(default_factory=dict)  # MIG UUID -> the job holding it
    used: dict[tuple[str, int], int] = field(default_factory=dict)  # (node, gpu) -> milli held
    held: dict[tuple[str, int], tuple[int, ReplicaAllocation]] = field(default_factory=dict)  # (job, replica)
    lost: set[str] = field(default_factory=set)
    lost_at: dict[str, int] = field(default_factory=dict)  # node -> the sequence it was lost at
    recent: dict[str, int] = field(default_factory=dict)  # event id -> seq, the last RACE_WINDOW events
    gone: set[str] = field(default_factory=set)  # removed (deregistered), until it registers again
    reserved: dict[str, tuple[str, dict[str, int]]] = field(default_factory=dict)  # job -> (queue, demand)
    usage: dict[str, dict[str, int]] = field(default_factory=dict)  # queue -> resource -> amount
    asked_to_stop: set[str] = field(default_factory=set)
    last: dict[str, tuple[int, Envelope]] = field(default_factory=dict)  # job -> its latest state event
    told_since: dict[str, bool] = field(default_factory=dict)  # job -> a reason after its latest state
    # job -> the sequence it ended at, for the last RACE_WINDOW events: a reservation or a placement
    # decided before the end and written after it holds nothing (quota and placer drop it too)
    ended: dict[str, int] = field(default_factory=dict)


@dataclass
class Report:
    events: int = 0
    head_seq: int = 0
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def first(self) -> dict[str, Violation | None]:
        return {name: next((v for v in self.violations if v.invariant == name), None) for name in INVARIANTS}

    def as_json(self) -> dict[str, Any]:
        first = self.first()
        return {"ok": self.ok, "events": self.events, "head_seq": self.head_seq,
                "invariants": {name: {"ok": first[name] is None,
                                      "violations": sum(1 for v in self.violations if v.invariant == name),
                                      "first": asdict(v) if (v := first[name]) is not None else None}
                               for name in INVARIANTS}}


def _remember(b: _Books, seq: int, env: Envelope) -> None:
    """Keep the ids of the last RACE_WINDOW events with their sequences (oldest first), so the
    cause of a placement on a lost node can be told older than the loss or not."""
    b.recent[env.event_id] = seq
    _trim(b.recent, seq)


def _trim(window: dict[str, int], seq: int) -> None:
    """Forget the entries (oldest first) from before the last RACE_WINDOW events."""
    while window:
        oldest = next(iter(window))
        if window[oldest] > seq - RACE_WINDOW:
            break
        del window[oldest]


def _ended(b: _Books, job: str, seq: int) -> None:
    """Remember that `job` ended at `seq`, for RACE_WINDOW events (oldest first, then forgotten)."""
    b.ended.pop(job, None)
    b.ended[job] = seq
    _trim(b.ended, seq)


def _decided_before_loss(b: _Books, seq: int, env: Envelope, node: str) -> bool:
    """Whether this placement on a lost node was decided on an event from before the loss: it
    lands within RACE_WINDOW events of the loss, and its cause is in the log before the loss
    (a cause older than the window is before it too: the loss is inside the window)."""
    lost = b.lost_at.get(node)
    if lost is None or seq - lost > RACE_WINDOW or env.causation_id is None:
        return False
    cause = b.recent.get(env.causation_id)
    return cause is None or cause < lost


def _log_integrity(rep: Report, log: LogFacts, verified_to: int = 0) -> None:
    """gap and head: what is missing from the stream itself (gaps after `verified_to`, checked before)."""
    if not log.exists:
        rep.violations.append(Violation("head", 0, "", "", "the FLEET stream does not exist: the log is gone"))
        return
    if log.first_seq > 1 and log.archived_to < log.first_seq - 1:
        lost = f"{log.archived_to + 1}..{log.first_seq - 1}"
        rep.violations.append(Violation(
            "head", log.first_seq, "", "",
            f"the log starts at seq {log.first_seq}: seqs {lost} are gone (purged or dropped by a limit) "
            f"and no archive holds them" if log.last_seq >= log.first_seq else
            f"the log is empty after seq {log.last_seq}: seqs {lost} were purged and no archive holds them"))
    start = max(log.first_seq, 1, verified_to + 1)
    run_from = None
    for seq in range(start, log.last_seq + 1):
        if seq not in log.subjects:
            run_from = seq if run_from is None else run_from
            continue
        if run_from is not None:
            _gap(rep, run_from, seq - 1)
            run_from = None
    if run_from is not None:
        _gap(rep, run_from, log.last_seq)


def _gap(rep: Report, a: int, b: int) -> None:
    rep.violations.append(Violation("gap", a, "", "", f"seqs {a}..{b} are missing from the stream (deleted)"
                                    if b > a else f"seq {a} is missing from the stream (deleted)"))


@dataclass
class AuditState:
    """Where an audit stands: its books, what it found, and the sequence every event up to which
    it has checked (`gpufleet audit` stores it and goes on from there next time)."""

    books: _Books = field(default_factory=_Books)
    violations: list[Violation] = field(default_factory=list)  # found in the events (not the head checks)
    events: int = 0
    head_at: float = 0.0
    verified_to: int = 0


class Auditor:
    """The audit as a fold that can stop and go on: `feed` events in order, `report` at any point."""

    def __init__(self, config: ClusterConfig | None = None, pending_grace_s: float = 10.0,
                 state: AuditState | None = None) -> None:
        self.tree = QuotaTree(config or ClusterConfig())
        self.grace = pending_grace_s
        self.st = state or AuditState()

    def feed(self, seq: int, env: Envelope, subject: str | None = None) -> None:
        """One event of the log (`subject`: what it was published on, when known)."""
        st, b = self.st, self.st.books
        if seq <= st.verified_to:
            return
        st.verified_to = seq
        st.events += 1
        st.head_at = max(st.head_at, env.occurred_at.timestamp())
        _remember(st.books, seq, env)  # (before the event is judged: a loss is its own cause's seq)

        def bad(name: str, seq: int, env: Envelope, message: str, node: str | None = None) -> None:
            st.violations.append(Violation(name, seq, env.event_id, env.type, message, env.job_id, node))

        forged = foreign_author(env)
        if forged is not None:
            bad("author", seq, env, forged)
            return  # not folded: the services dead-letter it too
        if subject is not None and subject != env.subject():
            bad("author", seq, env, f"published on {subject}, but the envelope belongs on {env.subject()}")
            return
        tree = self.tree
        p = env.payload
        job = env.job_id
        if isinstance(p, NodeRegistered):
            b.gpus[p.node_id] = {g.index for g in p.inventory.gpus if not g.mig_enabled}
            b.mig[p.node_id] = {m.uuid for g in p.inventory.gpus for m in g.mig_devices}
            b.lost.discard(p.node_id)
            b.lost_at.pop(p.node_id, None)
            b.gone.discard(p.node_id)
        elif isinstance(p, NodeLost):
            b.lost.add(p.node_id)
            b.lost_at.setdefault(p.node_id, seq)  # (the first loss: a repeat changes nothing)
        elif isinstance(p, NodeDeregistered):
            b.gone.add(p.node_id)
            b.gpus.pop(p.node_id, None)
            b.mig.pop(p.node_id, None)
        elif isinstance(p, JobPlaced | JobQuotaReserved) and p.job_id in b.ended:
            pass  # decided before the job ended, written after: it holds nothing (the services drop it)
        elif isinstance(p, JobPlaced):
            for a in p.allocations:
                if a.node_id in b.lost and not _decided_before_loss(b, seq, env, a.node_id):
                    bad("lost_node", seq, env, f"replica {a.replica} placed on {a.node_id}, which was lost "
                        f"at seq {b.lost_at.get(a.node_id, '?')}, before its placer decided", a.node_id)
                if a.node_id in b.gone:
                    bad("lost_node", seq, env, f"replica {a.replica} placed on {a.node_id}, which was removed",
                        a.node_id)
                for g in a.gpu_indices:
                    if a.node_id in b.gpus and g not in b.gpus[a.node_id]:
                        bad("gpu_capacity", seq, env, f"GPU {g} of {a.node_id} does not exist", a.node_id)
                    key = (a.node_id, g)
                    b.used[key] = b.used.get(key, 0) + a.gpu_milli
                    if b.used[key] > MILLI:
                        bad("gpu_capacity", seq, env, f"GPU {g} of {a.node_id} holds {b.used[key]} milli-GPU "
                            f"(more than {MILLI})", a.node_id)
                for uuid in a.mig_devices:
                    if a.node_id in b.mig and uuid not in b.mig[a.node_id]:
                        bad("gpu_capacity", seq, env, f"MIG instance {uuid} is not on {a.node_id}", a.node_id)
                    holder = b.mig_held.get(uuid)
                    if holder is not None and holder != p.job_id:
                        bad("gpu_capacity", seq, env, f"MIG instance {uuid} of {a.node_id} is held by {holder} already",
                            a.node_id)
                    b.mig_held[uuid] = p.job_id
                b.held[(p.job_id, a.replica)] = (p.attempt, a)
        elif isinstance(p, JobStarted):
            if p.node_id in b.lost or p.node_id in b.gone:
                bad("lost_node", seq, env, f"started on {p.node_id}, which was "
                    f"{'lost' if p.node_id in b.lost else 'removed'}", p.node_id)
        elif isinstance(p, JobExited):
            got = b.held.get((p.job_id, p.replica))
            if got is not None and got[0] == p.attempt:
                _free(b, p.job_id, p.replica)
            if p.reason == "preempted" and p.job_id not in b.asked_to_stop:
                bad("preemption_request", seq, env, "exited as preempted without a preemption request")
        elif isinstance(p, JobQuotaReserved):
            d = {"cpu": p.cpu_milli, "memory": p.memory_mib, "gpu": p.gpus}
            if p.flavor and p.gpus:
                d[f"gpu/{p.flavor}"] = p.gpus
            for profile, n in p.mig.items():
                d[f"mig/{profile}"] = n
            _unreserve(b, p.job_id)
            b.reserved[p.job_id] = (p.queue, d)
            use = b.usage.setdefault(p.queue, {})
            for r, v in d.items():
                use[r] = use.get(r, 0) + v
            for message in _over_quota(tree, b, p.queue):
                bad("quota_limit", seq, env, message)
        elif env.type == "job.preemption_requested" and job:
            b.asked_to_stop.add(job)
        elif isinstance(p, JobResumeRequested):
            if p.reason.code == "preempted":
                _unreserve(b, p.job_id)
        if env.type == "job.preempted" and job and job not in b.asked_to_stop:
            bad("preemption_request", seq, env, "preempted without a preemption request")
        if env.type in ENDED and job:
            _ended(b, job, seq)
            _unreserve(b, job)
            for held_job, replica in [k for k in b.held if k[0] == job]:
                _free(b, held_job, replica)
        if job is not None and env.type.startswith("job.") and (env.type in ENDED or job not in b.ended):
            if env.type in ENDED:  # nothing to wait for: forgotten (the books do not grow with every job run)
                b.last.pop(job, None)
                b.told_since.pop(job, None)
            elif env.type in TOLD:
                b.told_since[job] = True
            elif isinstance(p, JobSubmitted) or env.type in (
                    "job.admitted", "job.quota_reserved", "job.placed", "job.started", "job.resume_requested",
                    "job.exited", "job.scaled"):
                b.last[job] = (seq, env)
                b.told_since[job] = False

    def report(self, log: LogFacts | None = None, checked_to: int = 0) -> Report:
        """What the audit found so far, with the log's own checks (`log`: gaps after `checked_to`)
        and, at the head, every job waiting with no reason it was told."""
        st, b = self.st, self.st.books
        rep = Report(events=st.events, head_seq=st.verified_to, violations=list(st.violations))
        if log is not None:
            _log_integrity(rep, log, checked_to)
            rep.head_seq = max(rep.head_seq, log.last_seq)
        for job, (seq, env) in sorted(b.last.items(), key=lambda kv: kv[1][0]):
            if (env.type in ENDED or env.type in ("job.placed", "job.started", "job.exited", "job.scaled")
                    or b.told_since.get(job)):
                continue  # ended, running (an inference service: serving), or just ended a run (the guardian decides)
            if st.head_at - env.occurred_at.timestamp() < self.grace:
                continue  # just happened: its answer may be on its way
            rep.violations.append(Violation("pending_reason", seq, env.event_id, env.type,
                                            f"waiting since {env.type} (seq {seq}) and never told why", env.job_id))
        rep.violations.sort(key=lambda v: v.seq)
        return rep


def audit(history: Iterable[tuple[int, Envelope]], config: ClusterConfig | None = None,
          pending_grace_s: float = 10.0, log: LogFacts | None = None) -> Report:
    """Fold the log once and report every broken invariant (the first of each is what to read)."""
    a = Auditor(config, pending_grace_s)
    for seq, env in history:
        a.feed(seq, env, log.subjects.get(seq) if log is not None else None)
    return a.report(log)


def _free(b: _Books, job: str, replica: int) -> None:
    _, a = b.held.pop((job, replica))
    for uuid in a.mig_devices:
        if b.mig_held.get(uuid) == job:
            del b.mig_held[uuid]
    for g in a.gpu_indices:
        key = (a.node_id, g)
        b.used[key] = b.used.get(key, 0) - a.gpu_milli


def _unreserve(b: _Books, job: str) -> None:
    held = b.reserved.pop(job, None)
    if held is not None:
        use = b.usage.setdefault(held[0], {})
        for r, v in held[1].items():
            use[r] = use.get(r, 0) - v


def _over_quota(tree: QuotaTree, b: _Books, queue: str) -> list[str]:
    key = f"queue:{queue}"
    if key not in tree.nodes:
        return []

    def used(q: str, r: str) -> int:
        return b.usage.get(q, {}).get(r, 0)

    out = []
    for node_key in tree.path(key):
        node = tree.nodes[node_key]
        for r in sorted(tree.limited(queue)):
            u = tree.usage(node_key, r, used)
            if node.parent is None:
                cap = tree.subtree(node_key, r)
                if u > cap:
                    out.append(f"{node.label} uses {u} {r}, over the {cap} it holds")
            elif r in node.borrowing_limit:
                cap = tree.subtree(node_key, r) + node.borrowing_limit[r]
                if u > cap:
                    out.append(f"{node.label} uses {u} {r}, over its quota + borrowing limit ({cap})")
    return out


# ---------------------------------------------------------------- gpufleet audit, incremental

AUDIT = "audit"  # its record's bucket (SNAP_audit) and key (in the admin's creds)


class _AuditKind:
    """What the snapshot container needs: a name and a state format."""

    name = AUDIT
    state_format = 3  # 2: the books keep the last events' ids (lost_at, recent); 3: the jobs just ended


async def audit_log(bus: Any, config: ClusterConfig | None = None, pending_grace_s: float = 10.0,
                    full: bool = False) -> tuple[Report, int]:
    """`gpufleet audit`: go on from the audit's stored record (its books at the sequence it had
    checked, in `SNAP_audit`, HMAC-signed with the admin's audit key), read only the log after it,
    and store the new record; `full` (or no record that checks out) reads the log from sequence 1.
    The report covers the whole log either way. Returns it and the sequence it went on from (0: from 1)."""
    import nats.js.errors

    from gpufleet.shared.contract.events import STREAM, parse_envelope
    from gpufleet.shared.runtime.log import read_stream
    from gpufleet.shared.runtime.snapshots import SnapshotStore, take

    try:
        info = await bus.js.stream_info(STREAM)
    except nats.js.errors.NotFoundError:
        return Auditor(config, pending_grace_s).report(LogFacts(0, 0, exists=False)), 0
    facts = LogFacts(int(info.state.first_seq), int(info.state.last_seq))
    created = str(info.created or "")
    from gpufleet.shared.runtime.archive import Archive, archive_dir

    root = archive_dir()
    archive = Archive(root) if root is not None and root.is_dir() else None
    facts.archived_to = archive.archived_to if archive is not None else 0
    creds = getattr(bus, "creds", None)
    key = creds.snapshot_key(AUDIT) if creds is not None else None
    state, from_seq = None, 0
    store = SnapshotStore(bus, _AuditKind(), key) if key is not None else None
    if store is not None and not full:
        snap = await store.load(AuditState(), created)  # (one that does not check out: logged, audited in full)
        if snap is not None and snap.seq <= facts.last_seq:
            state, from_seq = snap.state(), snap.seq
    auditor = Auditor(config, pending_grace_s, state)
    async for msgs in read_stream(bus, ("fleet.>",), from_seq=from_seq + 1, until_seq=facts.last_seq):
        for msg in msgs:
            seq = int(msg.metadata.sequence.stream)
            facts.subjects[seq] = msg.subject
            try:
                env = parse_envelope(msg.data)
            except Exception:  # noqa: BLE001 - dead-lettered by the services; its seq still counts
                continue
            auditor.feed(seq, env, msg.subject)
    report = auditor.report(facts, checked_to=from_seq)
    for problem in archive.verify() if archive is not None else []:
        report.violations.insert(0, Violation("head", 0, "", "", f"the archive: {problem}"))
    auditor.st.verified_to = max(auditor.st.verified_to, facts.last_seq)
    if store is not None:
        await store.save(take(_AuditKind(), auditor.st, auditor.st.verified_to, 0, set(), created))
    return report, from_seq
