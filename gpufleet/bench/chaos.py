"""`gpufleet bench chaos --seed S --jobs N`: a seeded fault campaign on the distributed shape.

A fresh mesh as production runs it, on this machine: three nats-servers clustered on loopback
(`FLEET` at R3), PostgreSQL, every service in its own process and twice (`--instances 2`:
leased services active/passive, placers and telemetry side by side), simulated nodes. While a
workload of N jobs runs (single jobs, gangs, GPU shares, checkpointed training, high-priority jobs
that reclaim borrowed quota, cancels), faults are injected in an order drawn from the seed:

- `kill_service`: `kill -9` of one instance of a service (any of them; the supervisor restarts it);
- `kill_nats` / `kill_nats_leader`: `kill -9` of a NATS node (the stream's leader for the second),
  which the supervisor restarts on its port and store (it rejoins the cluster);
- `kill_postgres`: `kill -9` of PostgreSQL's postmaster (restarted; the read model catches up);
- `stop_executor`: the node agent frozen (SIGSTOP) for 2-6 s, then let go (SIGCONT): shorter than
  the heartbeat lease (15 s in the campaign's mesh, `GPUFLEET_NODE_LEASE_S`) less a heartbeat
  period, so no node may be declared lost for it;
- `lose_node`: one node agent (of two, each hosting half the sim nodes) frozen for 5-10 s longer
  than the lease: telemetry declares its nodes lost and their runs ended (`node_lost`), the guardian runs them again once the nodes
  register again (the agent, let go, hears that it was lost); a run must not end twice, nor
  be billed twice, nor hold GPUs on a node the log says is gone;
- `cut_node`: the second node agent (it runs in a network namespace of its own) cut from every
  NATS node for 5-10 s longer than the lease, while it runs on: telemetry declares its nodes lost
  and the jobs run again elsewhere; healed, the agent reconnects, hears of the loss and registers
  them again, and nothing it decided meanwhile may start, end or bill a run twice;
- `silence_fleet`: both node agents frozen 5-10 s past the lease, so the whole fleet goes silent
  at once while telemetry is connected: no node may be declared lost (a fault between the nodes
  and NATS is likelier than every node failing; `TelemetryCore.silent_fleet`);
- `partition`: one NATS node that does not lead the stream cut from the other two for 3-8 s (each
  server runs in a network namespace of its own, shared/embedded/netns.py: a pair of blackhole
  routes, while the clients on the host still reach it), then healed;
- `partition_leader`: the same for the stream's leader: the other two elect a new one, the old one
  is left with connected clients and no quorum (the bus moves them, shared/runtime/bus.py);
- `split_brain`: Jepsen's NATS 2.12.1 case, a single-node crash plus a partition: `kill -9` of a
  node that does not lead, and once the supervisor has it back, the leader cut off for 3-8 s, so
  that the node that just crashed must form the new quorum with the third.

The partition kinds need network namespaces (root, iproute2); without them the campaign runs
the other kinds and says why (`partitions`).

After each fault a probe job is submitted to a queue of its own (`probe`: 8 GPUs no other queue
may borrow, and the others' borrowing leaves 16 GPUs free), so that it waits for the control
plane, not behind the workload's backlog: its submit -> placed time is the fault's recovery time
(what a user sees). At the end, every figure is checked and counted, never assumed:

- every acknowledged submit reached an end (succeeded, failed, cancelled, rejected, preempted),
  and no job ended twice (terminal events per job in the log);
- `gpufleet audit --full` passes (no GPU double-booked, no quota exceeded, ...);
- `replay --all` equals the read model (`jobs`), row by row;
- the bill charges each run (job, attempt, replica) at most once, and every run that started.

The seed fixes the workload and the fault order; the timing of a real
cluster does not repeat exactly, so two runs of a seed inject the same faults at the same offsets
but may interleave them with the jobs differently.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PARTITION_KINDS = ("partition", "partition_leader", "split_brain", "cut_node")
FAULT_KINDS = ("kill_service", "kill_nats", "kill_nats_leader", "kill_postgres", "stop_executor", "lose_node",
               *PARTITION_KINDS, "silence_fleet")
SIM_EXECUTORS = 2  # the sim nodes split over two node agents: `lose_node` loses half the fleet
# the node agents each fault kind freezes or cuts off (`executor` hosts sim-*, `executor@1` sim1-*)
SILENCES = {"stop_executor": ("executor",), "lose_node": ("executor",), "cut_node": ("executor@1",),
            "silence_fleet": ("executor", "executor@1")}
RECONNECT_SLACK_S = 5.0  # an agent let go is heard again within this (its NATS connection may have moved)


def agent_of(node_id: str) -> str:
    """The node agent hosting a sim node: `sim-…` the first (`executor`), `sim<i>-…` `executor@<i>`."""
    prefix = node_id.split("-", 1)[0].removeprefix("sim")
    return f"executor@{prefix}" if prefix.isdigit() else "executor"


def _silenced_before(node_id: str, at: float, silenced: Sequence[tuple[str, float, float]]) -> bool:
    """Whether the node's agent was frozen or cut off for most of the lease before `at` (at least
    the lease less the slack an agent needs to be heard again, within the lease plus that slack):
    only then may telemetry have gone a whole lease without hearing it, and a loss is justified.
    A frozen agent inside the lease (`stop_executor`: 2-6 s) never justifies one."""
    agent = agent_of(node_id)
    window = (at - NODE_LEASE_S - RECONNECT_SLACK_S, at)
    quiet: float = sum(max(0.0, min(ended, window[1]) - max(began, window[0]))
                for a, began, ended in silenced if a == agent)
    return quiet >= NODE_LEASE_S - RECONNECT_SLACK_S
NODE_LEASE_S = 15.0  # the campaign mesh's heartbeat lease (30 s by default): a lost node costs less of the run
def campaign_config(sim_nodes: int) -> str:
    """The campaign's queues, scaled with the fleet: `prod` and `research` share a cohort and
    borrow from each other up to half their quota, `probe` has 8 GPUs nobody borrows, and 16
    GPUs stay free, so that a big campaign is not held to a small fleet's pace."""
    from gpufleet.shared.node.cluster import sim_fleet

    total = sum(len(inv.gpus) for inv in sim_fleet(sim_nodes).values())
    share = max(16, (total - 24) // 2)
    return (f"cohorts: {{shared: {{}}}}\nqueues:\n"
            f"  prod: {{cohort: shared, nominal: {{gpu: {share}}}, borrowingLimit: {{gpu: {share // 2}}}}}\n"
            f"  research: {{cohort: shared, nominal: {{gpu: {share}}}, borrowingLimit: {{gpu: {share // 2}}}}}\n"
            "  probe: {nominal: {gpu: 8}}\n")


class ChaosFailed(RuntimeError):
    """An invariant did not hold (the report says which)."""


def workload(seed: int, jobs: int) -> list[tuple[dict[str, Any], bool]]:
    """(spec, cancel it soon after) for each job, drawn from the seed."""
    rng = random.Random(f"chaos:{seed}")
    out: list[tuple[dict[str, Any], bool]] = []
    for i in range(jobs):
        r = rng.random()
        dur = f"{rng.choice((1, 2, 3, 4))}s"
        base: dict[str, Any] = {"name": f"chaos-{i}", "tenant": rng.choice(("acme", "beta")), "queue": "research",
                                "sim": {"duration": dur}}
        if r < 0.5:
            spec = {**base, "resources": {"gpu": rng.choice((1, 1, 2, 4))}}
        elif r < 0.65:
            spec = {**base, "replicas": 2, "resources": {"gpu": 4}}  # a gang: all or nothing
        elif r < 0.75:
            spec = {**base, "resources": {"gpu": 0.5, "gpuSharing": "shared"}}
        elif r < 0.9:
            spec = {**base, "type": "training", "resources": {"gpu": 2}, "checkpoint": {"interval": "1s"}}
        else:
            spec = {**base, "queue": "prod", "priority": 100, "resources": {"gpu": 8}}  # reclaims borrowed quota
        out.append((spec, rng.random() < 0.08))
    return out


def fault_kinds(partitions: bool) -> tuple[str, ...]:
    """The kinds a campaign injects: every one, or those without a partition (no network namespaces)."""
    return FAULT_KINDS if partitions else tuple(k for k in FAULT_KINDS if k not in PARTITION_KINDS)


def schedule(seed: int, window_s: float, extra: int, partitions: bool = True) -> list[tuple[float, str]]:
    """(offset in s, fault kind): every kind once, then `extra` more drawn from the seed."""
    rng = random.Random(f"chaos-faults:{seed}")
    pool = fault_kinds(partitions)
    kinds = list(pool) + [rng.choice(pool) for _ in range(extra)]
    rng.shuffle(kinds)
    gap = window_s / (len(kinds) + 1)
    return [(round(gap * (i + 1) + rng.uniform(-0.2, 0.2) * gap, 2), k) for i, k in enumerate(kinds)]


def _cli(d: Path, *args: str, timeout: float = 120, check: bool = True,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "gpufleet.cli", *args, "--data-dir", str(d)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise ChaosFailed(f"gpufleet {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    return proc


def _parts(d: Path) -> dict[str, Any]:
    parts: dict[str, Any] = json.loads((d / "mesh.json").read_text())["parts"]
    return parts


async def _leader(fleet: Any) -> str | None:
    from gpufleet.shared.contract.events import STREAM

    try:
        info = await fleet.bus.js.stream_info(STREAM)
        return str(info.cluster.leader) if info.cluster is not None and info.cluster.leader else None
    except Exception:  # noqa: BLE001 - no leader right now: any node will do
        return None


def _nats_nodes(parts: dict[str, Any]) -> list[str]:
    return sorted(n for n in parts if n == "nats" or n.startswith("nats-"))


def _node_index(parts: dict[str, Any], name: str) -> int:
    """A NATS part's place in the cluster (1 for `nats`, K for `nats-K`): its network namespace."""
    return int(parts[name].get("server_name", "nats-1").split("-")[1])


async def _partition(d: Path, fleet: Any, rng: random.Random, victim: str, what: str) -> str:
    """Cut `victim` from the other NATS nodes for 3-8 s (seeded), then heal."""
    from gpufleet.shared.embedded.netns import NetLab

    lab = NetLab.attach(json.loads((d / "mesh.json").read_text())["netns"])
    hold = rng.uniform(3.0, 8.0)
    parts = _parts(d)
    lab.isolate(_node_index(parts, victim), among=range(1, len(_nats_nodes(parts)) + 1))  # (not from the node agent)
    try:
        await asyncio.sleep(hold)
    finally:
        lab.heal()
    leader = await _leader(fleet)
    return f"{what}{victim} cut {hold:.1f} s (leader after: {leader})"


async def _back(d: Path, victim: str, pid: int, within_s: float = 30.0) -> bool:
    """The supervisor restarted `victim` (a new pid in mesh.json)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        now = _parts(d).get(victim, {}).get("pid")
        if now and int(now) != pid:
            return True
        await asyncio.sleep(0.2)
    return False


async def _freeze(pids: Sequence[int], pause: float) -> None:
    """SIGSTOP the processes, wait `pause`, SIGCONT them (one that died meanwhile is let be)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(pause)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def inject(kind: str, d: Path, fleet: Any, rng: random.Random) -> str:
    """Inject one fault; returns what was hit."""
    parts = _parts(d)
    nodes = _nats_nodes(parts)
    leader = await _leader(fleet) if kind in ("kill_nats_leader", "partition", "partition_leader", "split_brain") else None
    leading = next((n for n in nodes if parts[n].get("server_name", "nats-1") == leader), None)
    others = [n for n in nodes if n != leading]
    if kind == "kill_service":
        names = sorted(n for n, p in parts.items() if p.get("process") and p.get("pid"))
        victim = rng.choice(names)
    elif kind in ("kill_nats", "kill_nats_leader"):
        victim = rng.choice(nodes)
        if kind == "kill_nats_leader" and leading is not None:
            victim = leading
    elif kind == "partition":
        return await _partition(d, fleet, rng, rng.choice(others), "")
    elif kind == "partition_leader":
        return await _partition(d, fleet, rng, leading or rng.choice(nodes), "the leader " if leading else "")
    elif kind == "split_brain":
        crashed = rng.choice(others)
        pid = int(parts[crashed]["pid"])
        os.kill(pid, signal.SIGKILL)
        back = await _back(d, crashed, pid)
        cut = await _partition(d, fleet, rng, leading or rng.choice([n for n in nodes if n != crashed]),
                               "then the leader " if leading else "then ")
        return f"{crashed} (pid {pid}) killed, {'back' if back else 'NOT back'}; {cut}"
    elif kind == "kill_postgres":
        victim = "postgres"
    elif kind == "cut_node":  # the second node agent's namespace cut from every NATS node, past the lease
        doc = json.loads((d / "mesh.json").read_text()).get("netns") or {}
        ns = doc.get("node_ns")
        if not ns:
            return "no node agent in a namespace of its own (nothing hit)"
        from gpufleet.shared.embedded.netns import NetLab

        lab = NetLab.attach(doc)
        hold = NODE_LEASE_S + rng.uniform(5.0, 10.0)
        lab.isolate(int(ns), among=range(1, len(nodes) + 1))
        try:
            await asyncio.sleep(hold)
        finally:
            lab.heal()
        return f"executor@1 (its namespace, {ns}) cut from every NATS node {hold:.1f} s"
    elif kind == "silence_fleet":  # every node agent frozen past the lease: the fleet goes silent at once
        agents = sorted(n for n in parts if n.split("@")[0] == "executor" and parts[n].get("pid"))
        pids = [int(parts[n]["pid"]) for n in agents]
        pause = NODE_LEASE_S + rng.uniform(5.0, 10.0)
        await _freeze(pids, pause)
        return f"{', '.join(agents)} (pids {', '.join(map(str, pids))}) stopped {pause:.1f} s"
    else:  # stop_executor, lose_node
        victim = "executor"
    pid = parts.get(victim, {}).get("pid")
    if not pid:
        return f"{victim} (not running: nothing hit)"
    if kind in ("stop_executor", "lose_node"):
        pause = rng.uniform(2.0, 6.0) if kind == "stop_executor" else NODE_LEASE_S + rng.uniform(5.0, 10.0)
        await _freeze([int(pid)], pause)
        return f"{victim} (pid {pid}) stopped {pause:.1f} s"
    try:
        os.kill(int(pid), signal.SIGKILL)
    except ProcessLookupError:
        return f"{victim} (pid {pid} already gone)"
    return f"{victim} (pid {pid})"


async def campaign(d: Path, seed: int, jobs: int, extra_faults: int,
                   progress: Callable[[str], None] | None, partitions: bool = True) -> dict[str, Any]:
    from gpufleet.sdk import Fleet

    say = progress or (lambda _s: None)
    fleet = await Fleet.connect(data_dir=str(d))
    placed_at: dict[str, float] = {}

    async def on_placed(msg: Any) -> None:
        job_id = msg.subject.split(".")[4]
        placed_at.setdefault(job_id, time.monotonic())

    sub = await fleet.bus.nc.subscribe("fleet.evt.*.job.*.placed", cb=on_placed)
    rng = random.Random(f"chaos-run:{seed}")
    work = workload(seed, jobs)
    window_s = max(20.0, jobs / 15)
    faults = schedule(seed, window_s, extra_faults, partitions)
    accepted: dict[str, float] = {}
    refused: list[str] = []
    cancels: list[str] = []
    probes: dict[str, float] = {}
    probes_wall: dict[str, float] = {}  # (wall clock: a placement the live subscription missed is timed from the log)
    t0 = time.monotonic()

    async def submit(spec: dict[str, Any]) -> str | None:
        try:
            job_id: str = await fleet.submit(spec)
        except Exception as exc:  # noqa: BLE001 - not acknowledged: the client knows; counted
            refused.append(f"{spec['name']}: {type(exc).__name__}: {exc}")
            return None
        accepted[job_id] = time.monotonic()
        return job_id

    async def submitter() -> None:
        for i, (spec, cancel) in enumerate(work):
            await asyncio.sleep(max(0.0, t0 + window_s * i / max(1, len(work)) - time.monotonic()))
            job_id = await submit(spec)
            if job_id is not None and cancel:
                cancels.append(job_id)

                async def later(j: str = job_id) -> None:
                    await asyncio.sleep(0.5)
                    with_retry = 3
                    while with_retry:
                        try:
                            await fleet.cancel(j)
                            return
                        except Exception:  # noqa: BLE001 - a fault mid-cancel: once more
                            with_retry -= 1
                            await asyncio.sleep(1.0)
                asyncio.create_task(later())

    injected: list[dict[str, Any]] = []
    silenced: list[tuple[str, float, float]] = []  # (node agent, from, to): frozen or cut off

    async def injector() -> None:
        for at, kind in faults:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            began = time.time()
            hit = await inject(kind, d, fleet, rng)
            done = time.monotonic()
            for agent in SILENCES.get(kind, ()):  # (a node is lost only where its agent was silenced)
                silenced.append((agent, began, time.time()))
            probe = await submit({"name": f"probe-{len(injected)}", "tenant": "acme", "queue": "probe",
                                  "resources": {"gpu": 1}, "sim": {"duration": "1s"}})
            if probe is not None:
                probes[probe] = done
                probes_wall[probe] = time.time()
            row = {"at_s": round(done - t0, 1), "kind": kind, "hit": hit, "probe": probe}
            injected.append(row)
            say(f"[{done - t0:6.1f}s] {kind}: {hit}")

    await asyncio.gather(submitter(), injector())
    say(f"{len(accepted)} submits acknowledged, {len(refused)} not; waiting for every job to end ...")
    ends = await _wait_ends(fleet, set(accepted), timeout_s=240 + jobs * 0.2, say=say)
    for row in injected:
        job = row["probe"]
        if job in placed_at:
            row["recovery_s"] = round(placed_at[job] - probes[job], 2)
        elif job is not None:  # the live subscription is core NATS: a cut of this client's server loses what it sent
            row["recovery_s"] = await _placed_from_log(fleet, job, probes_wall[job])
        else:
            row["recovery_s"] = None
    await sub.unsubscribe()
    report = await _check(d, fleet, set(accepted), ends, say, silenced)
    await fleet.close()
    counts = Counter(ends[j][0] for j in accepted if j in ends)
    report.update({
        "seed": seed, "jobs": jobs, "submitted": len(accepted) , "not_acknowledged": len(refused),
        "not_acknowledged_why": refused[:10], "cancel_requests": len(cancels), "ended_by_type": dict(sorted(counts.items())),
        "faults": injected, "window_s": window_s,
    })
    return report


async def _retrying(what: Callable[[], Any], within_s: float = 60.0) -> Any:
    """`await what()`, again while JetStream does not answer (the cluster may still be electing a
    leader after the last fault): the bench's own reads must outlive the faults it injects."""
    import nats.errors

    from gpufleet.shared.runtime.bus import UNANSWERED, while_unanswered

    return await while_unanswered(what, within_s, pause_s=1.0,
                                  errors=(*UNANSWERED, TimeoutError, nats.errors.NoRespondersError))


async def _wait_ends(fleet: Any, jobs: set[str], timeout_s: float, say: Callable[[str], None]) -> dict[str, tuple[str, int]]:
    """Each job's end events from the log (type, how many), until every job has one or time runs out."""
    from gpufleet.shared.contract.events import TERMINAL_JOB_TYPES

    subjects = [f"fleet.evt.*.job.*.{t.split('.', 1)[1]}" for t in sorted(TERMINAL_JOB_TYPES | {"job.preempted"})]
    deadline = time.monotonic() + timeout_s
    while True:
        hist = await _retrying(lambda: fleet.history(subjects))
        by_job: dict[str, list[str]] = {}
        for _seq, env in hist:
            if env.job_id:
                by_job.setdefault(env.job_id, []).append(env.type)
        ends = {j: (ts[-1], sum(t in TERMINAL_JOB_TYPES for t in ts)) for j, ts in by_job.items()}
        left = jobs - set(ends)
        if not left or time.monotonic() > deadline:
            return ends
        say(f"  {len(left)} jobs not ended yet")
        await asyncio.sleep(3.0)


async def _audit(d: Path, within_s: float = 90.0) -> dict[str, Any]:
    """`gpufleet audit --json --full`, again while it cannot read the log (exit neither 0 nor 1, or no
    JSON: the cluster may still be electing a leader after the last fault). A run that never gets
    through comes back as `{"ok": false, "error": ...}` with the command's own words, so a failed
    audit always says why."""
    deadline = time.monotonic() + within_s
    while True:
        proc = _cli(d, "audit", "--json", "--full", check=False, timeout=300)
        try:
            doc: dict[str, Any] = json.loads(proc.stdout)
        except ValueError:
            doc = {}
        if proc.returncode in (0, 1) and "ok" in doc:
            return doc
        if time.monotonic() > deadline:
            return {"ok": False, "error": f"audit exited {proc.returncode}: "
                                          f"{(proc.stderr.strip() or proc.stdout.strip())[-800:]}"}
        await asyncio.sleep(2.0)


async def _placed_from_log(fleet: Any, job_id: str, since: float) -> float | None:
    """Seconds from `since` (wall clock) to the job's placement as the log holds it (its event's
    occurred_at), or None when the log holds none."""
    from gpufleet.shared.contract.events import STREAM, parse_envelope

    try:
        msg = await fleet.bus.js.get_last_msg(STREAM, f"fleet.evt.*.job.{job_id}.placed")
    except Exception:  # noqa: BLE001 - none (nats.js.errors.NotFoundError), or the server busy: not placed as far as we know
        return None
    return round(parse_envelope(msg.data).occurred_at.timestamp() - since, 2)


async def _check(d: Path, fleet: Any, jobs: set[str], ends: dict[str, tuple[str, int]],
                 say: Callable[[str], None], silenced: list[tuple[str, float, float]] | None = None) -> dict[str, Any]:
    from datetime import UTC, datetime

    from gpufleet.services.billing import report
    from gpufleet.services.billing.core import BillingCore
    from gpufleet.shared.contract.clusterconfig import load_config

    out: dict[str, Any] = {}
    out["not_ended"] = sorted(jobs - set(ends))[:20]
    out["not_ended_count"] = len(jobs - set(ends))
    out["ended_twice"] = sorted(j for j, (_t, n) in ends.items() if n > 1)
    audit = await _audit(d)
    out["audit_ok"] = bool(audit.get("ok"))
    # (the audit's JSON: each invariant's ok, its count of violations and the first of them)
    out["audit_violations"] = [{"invariant": name, "count": inv.get("violations"), "first": inv.get("first")}
                               for name, inv in audit.get("invariants", {}).items() if not inv.get("ok", True)]
    if "error" in audit:
        out["audit_error"] = audit["error"]
    deadline = time.monotonic() + 60
    while True:  # the read model catches up asynchronously (PostgreSQL was killed during the run)
        # (a replay folds the whole log: 125 s for the 10,000-job campaign on 2 idle cores)
        replay = json.loads(_cli(d, "replay", "--json", "--all", timeout=900).stdout)
        live = json.loads(_cli(d, "jobs", "--json", "--limit", "0", timeout=300).stdout)
        if replay["jobs"] == live or time.monotonic() > deadline:
            break
        await asyncio.sleep(1.0)
    diff = {j["job_id"] for j in replay["jobs"]} ^ {j["job_id"] for j in live}
    out["replay_equals_read_model"] = replay["jobs"] == live
    out["replay_read_model_differ"] = len(diff) or sum(a != b for a, b in zip(replay["jobs"], live, strict=False))
    cfg = load_config(d / "cluster.yaml")
    core = BillingCore(cfg, keep_charges=True)
    [state] = await _retrying(lambda: report.fold(fleet.bus, [core]))
    charges = report.charges(core, state, datetime.now(UTC))
    per_run = Counter((c.job_id, c.attempt, c.replica) for c in charges if not c.open)
    started = {(e.job_id, getattr(e.payload, "attempt", 1), getattr(e.payload, "replica", 0))
               for _s, e in await _retrying(lambda: fleet.history("fleet.evt.*.job.*.started"))}
    out["runs_started"] = len(started)
    out["runs_charged_twice"] = sorted(f"{j}/{a}/{r}" for (j, a, r), n in per_run.items() if n > 1)[:10]
    uncharged = started - set(per_run) - {(c.job_id, c.attempt, c.replica) for c in charges}
    out["runs_not_charged"] = len(uncharged)
    out["runs_not_charged_first"] = sorted(f"{j}/{a}/{r}" for j, a, r in uncharged)[:10]  # (job/attempt/replica)
    # a node is declared lost only where its agent was frozen or cut off for most of a lease
    # (lose_node, cut_node, or faults in a row); a frozen agent inside the lease, a NATS node
    # killed or cut, the whole fleet silent at once (the hold) must not cost anyone's run
    lost = await _retrying(lambda: fleet.history("fleet.evt.sys.node.*.lost"))
    out["nodes_lost"] = len(lost)
    out["nodes_lost_elsewhere"] = sorted(
        f"{e.node_id} at {e.occurred_at.isoformat()}" for _s, e in lost
        if not _silenced_before(e.node_id or "", e.occurred_at.timestamp(), silenced or ()))[:10]
    # the whole fleet silent at once (silence_fleet): each telemetry instance held its leases (its log says so)
    out["fleet_silent_holds"] = sum(f.read_text(errors="replace").count("went silent at once: none is declared lost")
                                    for f in (d / "logs").glob("telemetry*.log"))
    out["ok"] = (not out["not_ended_count"] and not out["ended_twice"] and out["audit_ok"]
                 and not out["nodes_lost_elsewhere"]
                 and out["replay_equals_read_model"] and not out["runs_charged_twice"] and not out["runs_not_charged"])
    say(f"checked: ok={out['ok']}")
    return out


def run(seed: int, jobs: int, sim_nodes: int = 8, extra_faults: int = 3, keep: Path | None = None,
        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Start the distributed shape, run the campaign, stop it; the report (`ok`: every check held).
    With network namespaces here, every NATS node in its own (the partition kinds); else without them."""
    from gpufleet.shared.embedded import netns

    no_netns = netns.available()
    tmp = tempfile.TemporaryDirectory(prefix="gpufleet-chaos-") if keep is None else None
    d = keep if keep is not None else Path(tmp.name if tmp is not None else ".") / "mesh"
    d.mkdir(parents=True, exist_ok=True)
    (d.parent / "chaos-cluster.yaml").write_text(campaign_config(sim_nodes))
    t0 = time.monotonic()
    _cli(d, "up", "--detach", "--nats-cluster", "3", "--layout", "separate", "--instances", "2",
         "--sim-nodes", str(sim_nodes), "--sim-executors", str(SIM_EXECUTORS),
         "--config", str(d.parent / "chaos-cluster.yaml"),
         *([] if no_netns else ["--nats-netns"]), timeout=300,
         env={**os.environ, "GPUFLEET_NODE_LEASE_S": f"{NODE_LEASE_S:g}s"})
    started_s = time.monotonic() - t0
    try:
        doc = asyncio.run(campaign(d, seed, jobs, extra_faults, progress, partitions=no_netns is None))
        doc["mesh_start_s"] = round(started_s, 1)
        doc["partitions"] = "injected (network namespaces)" if no_netns is None else f"not injected: {no_netns}"
        doc["restarts"] = {n: p.get("restarts", 0) for n, p in _parts(d).items() if p.get("restarts")}
        return doc
    finally:
        _cli(d, "down", check=False, timeout=180)
        if tmp is not None:
            tmp.cleanup()
