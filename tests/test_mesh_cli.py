"""The embedded stack end to end, through the CLI as a user runs it: up, submit, jobs, replay,
status, a service killed and restarted, down. Real processes, real nats-server and PostgreSQL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

pytestmark = pytest.mark.slow


def cli(data_dir: Path, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli", *args, "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"gpufleet {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def jobs(data_dir: Path) -> list[dict[str, Any]]:
    return list(json.loads(cli(data_dir, "jobs", "--json").stdout))


def wait_jobs(data_dir: Path, ids: set[str], status: str, timeout_s: float = 60) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = [r for r in jobs(data_dir) if r["job_id"] in ids]
        if len(rows) == len(ids) and all(r["status"] == status for r in rows):
            return rows
        if time.monotonic() > deadline:
            raise AssertionError(f"not all {status}: {[(r['job_id'], r['status']) for r in rows]}")
        time.sleep(0.3)


@pytest.fixture
def mesh(tmp_path: Path) -> Any:
    data_dir = tmp_path / "mesh"
    cli(data_dir, "up", "--detach", "--sim-nodes", "6")
    try:
        yield data_dir
    finally:
        subprocess.run([sys.executable, "-m", "gpufleet.cli", "down", "--data-dir", str(data_dir)],
                       capture_output=True, timeout=120)


def test_a_training_job_runs_end_to_end_and_replay_equals_the_read_model(mesh: Path) -> None:
    st = json.loads(cli(mesh, "status", "--json").stdout)
    assert st["running"] and all(p["alive"] for p in st["parts"].values()), st
    assert {"nats", "postgres", "admission", "quota", "placer", "executor", "telemetry", "guardian",
            "billing", "autoscaler", "readmodel", "view"} <= set(st["parts"])

    again = cli(mesh, "up", "--detach", check=False)
    assert again.returncode != 0 and "already running" in again.stderr

    bad = cli(mesh, "submit", str(EXAMPLES / "bad-spec.yaml"), check=False)
    assert bad.returncode == 2 and "resources.gpu" in bad.stderr

    job_id = json.loads(cli(mesh, "submit", str(EXAMPLES / "train-resnet.yaml"), "--json").stdout)["job_id"]
    [row] = wait_jobs(mesh, {job_id}, "succeeded", timeout_s=60)
    assert row["gpus"] == 8 and row["tenant"] == "acme" and len(row["node_ids"]) == 1

    explained = json.loads(cli(mesh, "explain", job_id, "--json").stdout)
    assert explained["job_id"] == job_id and explained["pending"] == [] and explained["interruptions"] == []
    timeline = explained["events"]
    assert [e["type"] for e in timeline] == [
        "cmd.submit", "job.submitted", "job.admitted", "job.quota_reserved", "job.placed",
        "job.started", "job.exited", "job.succeeded",
    ]

    # the read model catches up asynchronously; replay at the head must then equal it exactly
    deadline = time.monotonic() + 20
    while True:
        replay = json.loads(cli(mesh, "replay", "--json", "--all").stdout)
        live_jobs = jobs(mesh)
        live_nodes = json.loads(cli(mesh, "nodes", "--json").stdout)
        if replay["jobs"] == live_jobs and replay["nodes"] == live_nodes:
            break
        assert time.monotonic() < deadline, "replay never equalled the live read model"
        time.sleep(0.3)
    assert replay["seq"] > 0 and len(replay["nodes"]) == 6
    assert all(n["gpus_allocated"] == 0 for n in replay["nodes"])

    # a mesh without a config prices at public list prices (it says so in its cluster.yaml): the
    # run is billed, and an estimate says what the next one would cost, not 0.00
    assert "list prices" in (mesh / "cluster.yaml").read_text()
    billed = {r["key"]: r for r in json.loads(cli(mesh, "bill", "--json", "--by", "job").stdout)["rows"]}
    assert Decimal(billed[job_id]["cost"]) > 0 and Decimal(str(billed[job_id]["gpu_hours"])) > 0, billed
    est = json.loads(cli(mesh, "estimate", str(EXAMPLES / "train-resnet.yaml"), "--json").stdout)
    assert Decimal(str(est["cost"])) > 0, est


def test_a_service_killed_mid_flight_is_restarted_and_loses_nothing(mesh: Path, tmp_path: Path) -> None:
    doc = json.loads((mesh / "mesh.json").read_text())
    spec = tmp_path / "one-gpu.yaml"
    spec.write_text("name: tiny\ntenant: acme\nresources: {gpu: 1, cpu: 1, memory: 1Gi}\nsim: {duration: 1s}\n")
    ids = {json.loads(cli(mesh, "submit", str(spec), "--json").stdout)["job_id"] for _ in range(3)}
    for name in ("placer", "guardian"):
        os.kill(int(doc["parts"][name]["pid"]), signal.SIGKILL)
    ids |= {json.loads(cli(mesh, "submit", str(spec), "--json").stdout)["job_id"] for _ in range(3)}
    wait_jobs(mesh, ids, "succeeded", timeout_s=90)
    st = json.loads(cli(mesh, "status", "--json").stdout)
    assert st["parts"]["placer"]["restarts"] >= 1 and st["parts"]["guardian"]["restarts"] >= 1
    assert all(p["alive"] for p in st["parts"].values())


def test_down_stops_every_part(tmp_path: Path) -> None:
    data_dir = tmp_path / "m2"
    cli(data_dir, "up", "--detach", "--sim-nodes", "2", "--no-postgres", "--layout", "separate")
    parts = json.loads((data_dir / "mesh.json").read_text())["parts"]
    try:
        # every service as its own process: `python -m gpufleet.services.<name>` each, and the view's
        assert len({p["pid"] for name, p in parts.items() if name not in ("nats", "view")}) == 8
        assert parts["view"]["pid"] not in {p["pid"] for name, p in parts.items() if name != "view"}
    except AssertionError:
        cli(data_dir, "down", check=False)  # not left running for the rest of the suite
        raise
    pids = [int(p["pid"]) for p in parts.values() if p["pid"]]
    pids.append(int(json.loads((data_dir / "mesh.json").read_text())["supervisor_pid"]))
    cli(data_dir, "down")
    deadline = time.monotonic() + 15
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.1)
    assert not alive, f"still running: {alive}"
    assert not (data_dir / "mesh.json").exists()
    assert json.loads(cli(data_dir, "status", "--json", check=False).stdout)["running"] is False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours is not running
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


def test_cancel_and_watch(mesh: Path, tmp_path: Path) -> None:
    spec = tmp_path / "long.yaml"
    spec.write_text("name: long\ntenant: globex\nresources: {gpu: 2, cpu: 2, memory: 2Gi}\nsim: {duration: 10m}\n")
    job_id = json.loads(cli(mesh, "submit", str(spec), "--json").stdout)["job_id"]
    wait_jobs(mesh, {job_id}, "running", timeout_s=30)
    cli(mesh, "cancel", job_id)
    [row] = wait_jobs(mesh, {job_id}, "cancelled", timeout_s=30)
    assert row["tenant"] == "globex"

    # watch --from-start --json: one JSON object per line, filtered to the job, in log order
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufleet.cli", "watch", "--job", job_id, "--from-start", "--json",
         "--data-dir", str(mesh)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )
    try:
        out, _ = proc.communicate(timeout=8)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=10)
    events = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert {e["payload"]["job_id"] for e in events} == {job_id}
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    types = [e["type"] for e in events]
    assert types[:2] == ["job.submitted", "job.admitted"]
    assert "job.cancel_requested" in types and types[-1] == "job.cancelled"
    assert any(e["type"] == "job.exited" and e["payload"]["reason"] == "cancelled" for e in events)


def test_queues_and_explain_name_the_quota_a_job_waits_for(tmp_path: Path) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(
        "tenants:\n  acme: {queues: [small]}\n"
        "queues:\n  small: {cohort: team, nominal: {gpu: 8}}\n"
        "cohorts:\n  team: {parent: org, borrowingLimit: {gpu: 0}}\n  org: {}\n"
    )
    data_dir = tmp_path / "q"
    cli(data_dir, "up", "--detach", "--sim-nodes", "4", "--no-postgres", "--config", str(config))
    try:
        spec = tmp_path / "eight.yaml"
        spec.write_text("name: eight\ntenant: acme\nqueue: small\nresources: {gpu: 8, cpu: 1, memory: 1Gi}\n"
                        "sim: {duration: 10m}\n")
        first = json.loads(cli(data_dir, "submit", str(spec), "--json").stdout)["job_id"]
        second = json.loads(cli(data_dir, "submit", str(spec), "--json").stdout)["job_id"]
        deadline = time.monotonic() + 30
        while True:
            doc = json.loads(cli(data_dir, "queues", "--json").stdout)
            [q] = [r for r in doc["queues"] if r["queue"] == "small"]
            if q["usage"].get("gpu") == 8 and q["pending"] == 1:
                break
            assert time.monotonic() < deadline, doc
            time.sleep(0.3)
        assert q["nominal"] == {"gpu": 8} and q["reserved_jobs"] == 1 and q["cohort"] == "team"
        cohorts = {c["cohort"]: c for c in doc["cohorts"]}
        assert cohorts["team"]["parent"] == "org" and cohorts["org"]["children"] == ["team"]
        assert cohorts["org"]["usage"] == {"gpu": 8} and cohorts["org"]["quota"]["gpu"] == 8
        assert cohorts["team"]["pending"] == cohorts["org"]["pending"] == 1
        assert "org" in cli(data_dir, "queues").stdout
        out = cli(data_dir, "explain", second).stdout
        assert "pending (quota" in out and "queue small: gpu 8 used + 8 requested > 0 available" in out
        assert "[cohort_limit]" in out or "[queue_limit]" in out
        cli(data_dir, "cancel", first)
        deadline = time.monotonic() + 30
        while "job.placed" not in cli(data_dir, "explain", second).stdout:
            assert time.monotonic() < deadline, "the waiting job never got the quota back"
            time.sleep(0.3)
    finally:
        subprocess.run([sys.executable, "-m", "gpufleet.cli", "down", "--data-dir", str(data_dir)],
                       capture_output=True, timeout=120)


def test_explain_shows_the_backfill_reservation_a_big_job_waits_with(mesh: Path, tmp_path: Path) -> None:
    busy = tmp_path / "busy.yaml"
    busy.write_text("name: busy\ntenant: acme\nmaxRuntime: 1h\nresources: {gpu: 8, gpuModel: H100, cpu: 1, memory: 1Gi}\n"
                    "sim: {duration: 10m}\n")
    ids = {json.loads(cli(mesh, "submit", str(busy), "--json").stdout)["job_id"] for _ in range(2)}
    wait_jobs(mesh, ids, "running")  # both H100 nodes of the 6 are busy
    big = tmp_path / "big.yaml"
    big.write_text("name: big\ntenant: acme\nreplicas: 2\nresources: {gpu: 8, gpuModel: H100, cpu: 1, memory: 1Gi}\n")
    big_id = json.loads(cli(mesh, "submit", str(big), "--json").stdout)["job_id"]
    deadline = time.monotonic() + 30
    while "backfill reservation" not in (out := cli(mesh, "explain", big_id).stdout):
        assert time.monotonic() < deadline, out
        time.sleep(0.3)
    assert "pending (placement" in out and "[no_fit]" in out
    line = next(x for x in out.splitlines() if x.startswith("backfill reservation"))
    assert line.count("sim-") == 2  # the two H100 nodes, held from when the busy jobs' hour is up


def test_a_tenant_added_to_a_running_mesh_works_as_itself_and_only_as_itself(mesh: Path, tmp_path: Path) -> None:
    """`tenant add` admits a new identity at once (the server reloads); with its credentials a
    tenant submits and follows its own job, sees only its own jobs, and cannot cancel another
    tenant's; the admin can, and the log says the admin did."""
    added = json.loads(cli(mesh, "tenant", "add", "initech", "--json").stdout)
    assert added["reloaded"] is True and Path(added["creds"]).stat().st_mode & 0o077 == 0
    creds = tmp_path / "initech.creds"
    cli(mesh, "tenant", "creds", "initech", "-o", str(creds))
    assert "initech" in cli(mesh, "tenant", "list").stdout.split()

    other = tmp_path / "other.yaml"
    other.write_text("name: theirs\ntenant: globex\nresources: {gpu: 1, cpu: 1, memory: 1Gi}\nsim: {duration: 10m}\n")
    theirs = json.loads(cli(mesh, "submit", str(other), "--json", "--yes").stdout)["job_id"]
    mine = tmp_path / "mine.yaml"
    mine.write_text("name: mine\nresources: {gpu: 1, cpu: 1, memory: 1Gi}\nsim: {duration: 1s}\n")  # no tenant: the creds'
    out = cli(mesh, "--creds", str(creds), "submit", str(mine), "--wait", "--yes", "--json").stdout
    lines = [json.loads(x) for x in out.splitlines() if x.strip()]
    assert lines[-1]["type"] == "job.succeeded" and lines[-1]["tenant"] == "initech"

    seen = json.loads(cli(mesh, "--creds", str(creds), "jobs", "--json").stdout)
    assert {r["tenant"] for r in seen} == {"initech"}

    # its logs, from the executor of the node it ran on (sim: lines from its events), its own only
    mine_id = lines[0]["job_id"]
    text = cli(mesh, "--creds", str(creds), "logs", mine_id, "-f").stdout.splitlines()
    assert "attempt 1 started on sim-" in text[0] and text[-1].endswith("exited with code 0 (completed)"), text
    doc = json.loads(cli(mesh, "--creds", str(creds), "logs", mine_id, "--tail", "1", "--json").stdout)
    assert doc["data"] == text[-1] + "\n" and doc["running"] is False and doc["driver"] == "sim"
    hidden = cli(mesh, "--creds", str(creds), "logs", theirs, check=False)
    assert hidden.returncode == 1 and "no run of replica 0 started" in hidden.stderr, hidden.stderr

    # adjust and run again: a copy of its own past job, changed, validated like any spec
    copy = json.loads(cli(mesh, "--creds", str(creds), "submit", "--from", mine_id, "--set", "resources.gpu=2",
                          "--set", "sim.duration=2s", "--yes", "--json").stdout)["job_id"]
    got = json.loads(cli(mesh, "explain", copy, "--json").stdout)
    [sub] = [e for e in got["events"] if e["type"] == "job.submitted"]
    spec = sub["payload"]["spec"]
    assert (sub["tenant"], spec["name"], spec["resources"]["gpu"], spec["sim"]["duration_s"]) == ("initech", "mine", 2, 2.0)
    assert spec["resources"]["cpu_milli"] == 1000 and spec["resources"]["memory_mib"] == 1024  # the rest as it was
    not_mine = cli(mesh, "--creds", str(creds), "submit", "--from", theirs, "--yes", check=False)
    assert not_mine.returncode == 1 and f"no job {theirs}" in not_mine.stderr  # another tenant's spec is not read
    bad = cli(mesh, "submit", "--from", mine_id, "--set", "resources.gpu=lots", "--yes", check=False)
    assert bad.returncode == 2 and "resources.gpu" in bad.stderr, bad.stderr

    wait_jobs(mesh, {theirs}, "running", timeout_s=30)
    assert "started on sim-" in cli(mesh, "logs", theirs, "--tail", "5").stdout  # the admin reads any
    cli(mesh, "--creds", str(creds), "cancel", theirs)  # asked on initech's own subject: refused
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("name: x\ntenant: globex\nresources: {cpu: 1}\n")
    refused = cli(mesh, "--creds", str(creds), "submit", str(wrong), "--yes", check=False)
    assert refused.returncode == 1 and "tenant" in refused.stderr and "initech" in refused.stderr
    cli(mesh, "cancel", theirs)  # the admin
    wait_jobs(mesh, {theirs}, "cancelled", timeout_s=30)
    doc = json.loads(cli(mesh, "explain", theirs, "--json").stdout)
    kinds = [(e["type"], e["tenant"]) for e in doc["events"]]
    assert ("job.request_refused", "initech") in kinds  # told to the asker, on its own subjects
    asks = [e for e in doc["events"] if e["type"] == "job.cancel_requested"]
    assert len(asks) == 1 and asks[0]["payload"]["requested_by"].startswith("admin")

    report = json.loads(cli(mesh, "audit", "--json").stdout)
    assert report["ok"], report


def test_the_supervisor_brings_back_nats_and_postgresql_after_a_kill(mesh: Path, tmp_path: Path) -> None:
    """kill -9 of nats-server and of PostgreSQL: the supervisor starts each again (same port,
    same store), status says so, and the mesh runs jobs again; a client told of a dead read
    model folds the log instead of failing."""
    st = json.loads(cli(mesh, "status", "--json").stdout)
    nats_pid = st["parts"]["nats"]["pid"]
    os.kill(nats_pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:  # the supervisor notices within its 0.5 s loop
        st = json.loads(cli(mesh, "status", "--json").stdout)
        if st["parts"]["nats"]["restarts"] == 1 and st["parts"]["nats"]["alive"] and "stream" in st:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.3)
    assert st["parts"]["nats"]["pid"] != nats_pid
    spec = tmp_path / "after.yaml"
    spec.write_text("name: after\ntenant: acme\nresources: {gpu: 1, cpu: 1, memory: 1Gi}\nsim: {duration: 1s}\n")
    job_id = json.loads(cli(mesh, "submit", str(spec), "--json", "--yes").stdout)["job_id"]
    wait_jobs(mesh, {job_id}, "succeeded", timeout_s=90)

    pg_pid = st["parts"]["postgres"]["pid"]
    os.kill(pg_pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        st = json.loads(cli(mesh, "status", "--json").stdout)
        if st["parts"]["postgres"].get("restarts") == 1 and st["parts"]["postgres"]["alive"]:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.3)
    wait_jobs(mesh, {job_id}, "succeeded", timeout_s=30)  # the read model answers again


def test_an_operator_drains_a_node_and_returns_a_gpu(mesh: Path, tmp_path: Path) -> None:
    """`node drain` moves what runs there, without spending a retry; `gpu return` lifts a hold;
    each is a fact in the log by the operator; only the admin may state them."""
    spec = tmp_path / "long.yaml"
    spec.write_text("name: long\ntenant: acme\nresources: {gpu: 1, cpu: 1, memory: 1Gi}\nmaxRetries: 0\n"
                    "sim: {duration: 10m}\n")
    job = json.loads(cli(mesh, "submit", str(spec), "--json", "--yes").stdout)["job_id"]
    wait_jobs(mesh, {job}, "running", timeout_s=30)

    def runs() -> list[dict[str, Any]]:
        doc = json.loads(cli(mesh, "explain", job, "--json").stdout)
        return [e for e in doc["events"] if e["type"] == "job.started"]
    node = runs()[0]["payload"]["node_id"]
    said = json.loads(cli(mesh, "node", "drain", node, "--reason", "kernel upgrade", "--json").stdout)
    assert said["type"] == "node.cordoned" and said["drain"] is True and said["actor"].startswith("admin/")
    deadline = time.monotonic() + 60
    while len(runs()) < 2:
        assert time.monotonic() < deadline, "the drained job did not run again"
        time.sleep(0.5)
    again = runs()[1]["payload"]
    assert again["attempt"] == 2 and again["node_id"] != node  # elsewhere: the node takes no new work
    doc = json.loads(cli(mesh, "explain", job, "--json").stdout)
    [resume] = [e for e in doc["events"] if e["type"] == "job.resume_requested"]
    assert resume["payload"]["reason"]["code"] == "node_drained" and "kernel upgrade" in resume["payload"]["reason"]["message"]
    wait_jobs(mesh, {job}, "running", timeout_s=30)  # maxRetries 0, and still running: a drain is no failure

    # only the admin; a node and a GPU that exist
    cli(mesh, "tenant", "add", "initech")
    creds = tmp_path / "initech.creds"
    cli(mesh, "tenant", "creds", "initech", "-o", str(creds))
    refused = cli(mesh, "--creds", str(creds), "node", "cordon", node, check=False)
    assert refused.returncode == 1 and "only the admin" in refused.stderr, refused.stderr
    nosuch = cli(mesh, "node", "cordon", "nosuch", check=False)
    assert nosuch.returncode == 1 and "node nosuch: no such node" in nosuch.stderr, nosuch.stderr
    badgpu = cli(mesh, "gpu", "return", node, "99", check=False)
    assert badgpu.returncode == 1 and f"gpu: node {node} has no GPU 99" in badgpu.stderr, badgpu.stderr
    # requeue: stopped and placed again, no retry spent (maxRetries 0), the operator's reason in the log
    req = json.loads(cli(mesh, "job", "requeue", job, "--reason", "rebalance", "--json").stdout)
    assert req["attempt"] == 3 and req["reason"]["code"] == "requeued" and req["actor"].startswith("admin/")
    deadline = time.monotonic() + 60
    while len(runs()) < 3:
        assert time.monotonic() < deadline, "the requeued job did not run again"
        time.sleep(0.5)
    assert runs()[2]["payload"]["attempt"] == 3
    wait_jobs(mesh, {job}, "running", timeout_s=30)
    theirs = cli(mesh, "--creds", str(creds), "job", "requeue", job, check=False)
    assert theirs.returncode == 1 and "only the admin" in theirs.stderr, theirs.stderr
    back = json.loads(cli(mesh, "gpu", "return", node, "0", "--reason", "reseated", "--json").stdout)
    assert back["type"] == "node.gpu_cleared" and back["returned"] is True and back["gpu_index"] == 0
    assert "uncordoned" in cli(mesh, "node", "uncordon", node).stdout
    cli(mesh, "cancel", job)
    wait_jobs(mesh, {job}, "cancelled", timeout_s=30)
    over = cli(mesh, "job", "requeue", job, check=False)
    assert over.returncode == 1 and "has ended" in over.stderr, over.stderr
    report = json.loads(cli(mesh, "audit", "--json").stdout)
    assert report["ok"], report


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")
def test_top_is_live_under_a_real_terminal_and_q_quits(mesh: Path, tmp_path: Path) -> None:
    """`gpufleet top` in a real terminal (tmux): it shows the fleet, a job submitted after it started
    appears without a keypress, and `q` quits with status 0 (the terminal given back)."""
    session = f"gftop{os.getpid()}"
    done = tmp_path / "exited"
    cmd = (f"cd {REPO} && {sys.executable} -m gpufleet.cli top --data-dir {mesh}; echo $? > {done}; sleep 30")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "50", cmd], check=True)

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

    def wait_for(text: str, timeout_s: float = 30) -> str:
        deadline = time.monotonic() + timeout_s
        while text not in (shown := screen()):
            assert time.monotonic() < deadline, f"{text!r} not on the screen:\n{shown}"
            time.sleep(0.2)
        return shown

    try:
        first = wait_for("gpufleet top")
        assert "nodes 6 (6 ready" in first and "queues" in first, first
        spec = tmp_path / "j.yaml"
        spec.write_text("name: seen-live\ntenant: acme\nresources: {gpu: 1}\nsim: {duration: 2s}\n")
        job = json.loads(cli(mesh, "submit", str(spec), "--json", "--yes").stdout)["job_id"]
        wait_for(job)  # fed by the stream, no keypress
        wait_for("succeeded")
        # the tables a person reads: in colour on a terminal (forced here), plain text to a pipe
        coloured = subprocess.run([sys.executable, "-m", "gpufleet.cli", "jobs", "--data-dir", str(mesh)],
                                  capture_output=True, text=True, timeout=60, cwd=REPO,
                                  env={**os.environ, "GPUFLEET_COLOR": "always"}).stdout
        assert "\x1b[" in coloured and job in coloured and "STATUS" in coloured, coloured
        plain = cli(mesh, "jobs").stdout
        assert "\x1b[" not in plain and plain.startswith("JOB") and job in plain, plain
        for command, header, cell in (("queues", "QUEUE", "PENDING"), ("bill", "GPU-HOURS", "TOTAL")):
            table = subprocess.run([sys.executable, "-m", "gpufleet.cli", command, "--data-dir", str(mesh)],
                                   capture_output=True, text=True, timeout=60, cwd=REPO,
                                   env={**os.environ, "GPUFLEET_COLOR": "always"}).stdout
            assert "\x1b[" in table and header in table and cell in table, (command, table)
            plain = cli(mesh, command).stdout
            assert "\x1b[" not in plain and header in plain and cell in plain, (command, plain)
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        deadline = time.monotonic() + 10
        while not done.exists():
            assert time.monotonic() < deadline, screen()
            time.sleep(0.1)
        assert done.read_text().strip() == "0"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
