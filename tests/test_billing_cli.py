"""Billing through the real CLI against an embedded mesh (`gpufleet up`: nats-server, PostgreSQL,
the services, sim nodes): estimate, submit's estimate, bill (--json, --csv, --by, --since /
--until, --tenant, --ledger), with values known from the prices and the log's own timestamps."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from .test_mesh_cli import REPO, cli, wait_jobs

pytestmark = pytest.mark.slow

CONFIG = """\
queues:
  research: {nominal: {gpu: 8}}
  default: {}   # listed: a cluster that configures queues has no implicit one
prices:
  currency: USD
  gpuHour: {H100: "36", A100: "18"}
  cpuCoreHour: "0.36"
  memoryGiBHour: "0.036"
"""
# per hour: 1 A100 (18) + 2 cores (0.72) + 4 GiB (0.144)
RATES = {"gpu/A100": Decimal("18"), "cpu": Decimal("0.72"), "memory": Decimal("0.144")}
ONE = "name: one\ntenant: acme\nmaxRuntime: 1h\nresources: {gpu: 1, gpuModel: A100, cpu: 2, memory: 4Gi}\n"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Two H100 nodes and one A100 node, prices and a research queue of 8 GPUs, PostgreSQL."""
    tmp = tmp_path_factory.mktemp("billing-cli")
    config = tmp / "cluster.yaml"
    config.write_text(CONFIG)
    data_dir = tmp / "mesh"
    cli(data_dir, "up", "--detach", "--sim-nodes", "3", "--sim-mix", "h100x8,h100x8,a100x8", "--config", str(config))
    try:
        yield data_dir
    finally:
        subprocess.run([sys.executable, "-m", "gpufleet.cli", "down", "--data-dir", str(data_dir)],
                       capture_output=True, timeout=120)


def spec_file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def submit(mesh: Path, spec: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`gpufleet submit` as a script runs it: no terminal on stdin, stdout or stderr."""
    proc = subprocess.run([sys.executable, "-m", "gpufleet.cli", "submit", str(spec), *args, "--data-dir", str(mesh)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    return proc


def interval(mesh: Path, job_id: str) -> tuple[datetime, datetime]:
    """The job's start and exit, from the log (`gpufleet explain`)."""
    events = json.loads(cli(mesh, "explain", job_id, "--json").stdout)["events"]
    [start] = [datetime.fromisoformat(e["occurred_at"]) for e in events if e["type"] == "job.started"]
    [end] = [datetime.fromisoformat(e["occurred_at"]) for e in events if e["type"] == "job.exited"]
    return start, end


def cost(seconds: Decimal, rates: dict[str, Decimal] = RATES) -> Decimal:
    """What the lines cost, each rounded once to the micro-dollar (docs/billing.md)."""
    return sum(((rate * seconds / 3600).quantize(Decimal("0.000001")) for rate in rates.values()), Decimal(0))


def secs(a: datetime, b: datetime) -> Decimal:
    return Decimal((b - a) // timedelta(microseconds=1)).scaleb(-6)


def iso(t: datetime) -> str:
    return t.astimezone(UTC).replace(tzinfo=None).isoformat()


def bill(mesh: Path, *args: str) -> dict[str, Any]:
    return dict(json.loads(cli(mesh, "bill", "--json", *args).stdout))


def rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["key"]: r for r in doc["rows"]}


def test_estimate_submit_and_bill_through_the_cli(mesh: Path, tmp_path: Path) -> None:
    one = spec_file(tmp_path, "one", ONE + "sim: {duration: 3s}\n")

    # estimate: every replica's resources x maxRuntime x the prices; an idle A100 node: no wait
    est = json.loads(cli(mesh, "estimate", str(one), "--json").stdout)
    assert (est["cost"], est["currency"], est["gpu_model"], est["gpu_hours"]) == ("18.864", "USD", "A100", "1.000000")
    assert {line["resource"]: line["cost"] for line in est["lines"]} == {"gpu/A100": "18.00", "cpu": "0.72",
                                                                         "memory": "0.144"}
    assert est["wait_s"] == 0 and est["wait_note"] == "fits the free capacity and quota now"
    # its queue (default: listed, without limits) holds nothing back
    assert est["wait"]["ahead"] == 0 and est["wait"]["quota"]["full_now"] is False
    assert est["wait"]["quota"]["reason"] is None
    assert json.loads(cli(mesh, "estimate", str(one), "--json", "--duration", "3s").stdout)["cost"] == "0.01572"
    text = cli(mesh, "estimate", str(one)).stdout
    assert "cost: 18.864 USD" in text and "expected wait: none, it fits now" in text
    assert est["admission"] == [] and "admission would reject" not in text
    # a job admission would refuse is priced, and the estimate says it would be refused, and why
    huge = spec_file(tmp_path, "huge", ONE.replace("gpu: 1,", "gpu: 64,") + "sim: {duration: 3s}\n")
    refused = json.loads(cli(mesh, "estimate", str(huge), "--json").stdout)["admission"]
    assert [(r["code"], r["field"]) for r in refused] == [("exceeds_node", "resources.gpu")], refused

    # submit in a script: the estimate (cost only, no log folded) on stderr, the job id on stdout
    out = submit(mesh, one)
    first = out.stdout.strip()
    assert first.startswith("job") or len(first) >= 20, out.stdout
    assert "estimate for one (acme/default, 1 replica(s), 1.000 h)" in out.stderr
    assert "cost: 18.864 USD" in out.stderr and "expected wait" in out.stderr
    # --json carries it in the object; --yes skips it
    doc = json.loads(submit(mesh, one, "--json").stdout)
    second = doc["job_id"]
    assert doc["estimate"]["cost"] == "18.864"
    quiet = submit(mesh, spec_file(tmp_path, "other", ONE.replace("acme", "globex") + "sim: {duration: 1s}\n"), "--yes")
    other = quiet.stdout.strip()
    assert quiet.stderr == "" and "estimate" not in quiet.stdout
    wait_jobs(mesh, {first, second, other}, "succeeded", timeout_s=60)

    # the bill of each job is its allocation time x the prices, from the log's own timestamps
    spans = {j: interval(mesh, j) for j in (first, second, other)}
    expected = {j: cost(secs(*spans[j])) for j in spans}
    for j in (first, second):  # 3 s of sim, ended on the executor's tick
        assert Decimal("3") <= secs(*spans[j]) <= Decimal("4"), spans[j]
        assert cost(Decimal(3)) <= expected[j] <= cost(Decimal(4))
    by_job = rows(bill(mesh, "--by", "job"))
    assert {j: Decimal(by_job[j]["cost"]) for j in spans} == expected
    assert by_job[first]["intervals"] == 1 and by_job[first]["running"] == 0
    hours = secs(*spans[first]) / 3600
    assert Decimal(by_job[first]["gpu_hours"]) == hours.quantize(Decimal("0.000001"))

    # by tenant (the default), and its total
    doc = bill(mesh)
    assert doc["by"] == "tenant" and doc["source"] == "log"
    assert Decimal(rows(doc)["acme"]["cost"]) == expected[first] + expected[second]
    assert Decimal(rows(doc)["globex"]["cost"]) == expected[other]
    assert Decimal(doc["total"]["cost"]) == sum(expected.values())

    # by GPU model: the GPU lines under the model, CPU and memory under "-"
    by_model = rows(bill(mesh, "--by", "gpu-model"))
    gpu_only = sum((cost(secs(*spans[j]), {"gpu/A100": RATES["gpu/A100"]}) for j in spans), Decimal(0))
    assert set(by_model) == {"A100", "-"} and Decimal(by_model["A100"]["cost"]) == gpu_only
    assert Decimal(by_model["-"]["cost"]) == sum(expected.values()) - gpu_only
    # by queue
    assert set(rows(bill(mesh, "--by", "queue"))) == {"default"}

    # CSV: the same rows and total
    table = list(csv.DictReader(io.StringIO(cli(mesh, "bill", "--csv", "--by", "job").stdout)))
    assert [r["key"] for r in table][-1] == "total"
    assert {r["key"]: Decimal(r["cost"]) for r in table[:-1]} == expected
    assert Decimal(table[-1]["cost"]) == sum(expected.values())

    # a window cuts the interval at its edges: one whole second inside the first job's run
    s0, _ = spans[first]
    since = (s0 + timedelta(seconds=1)).replace(microsecond=0)
    window = bill(mesh, "--by", "job", "--tenant", "acme", "--since", iso(since), "--until",
                  iso(since + timedelta(seconds=1)))
    assert Decimal(rows(window)[first]["cost"]) == cost(Decimal(1)) == Decimal("0.00524")
    before = bill(mesh, "--until", iso(min(s for s, _ in spans.values()) - timedelta(seconds=1)))
    assert before["rows"] == [] and before["total"]["cost"] == "0.00"
    assert set(rows(bill(mesh, "--tenant", "globex"))) == {"globex"}

    # the ledger in PostgreSQL says the same (written by the billing service's ledger)
    deadline = time.monotonic() + 30
    while True:
        ledger = bill(mesh, "--by", "job", "--ledger")
        if {r["key"] for r in ledger["rows"]} >= set(expected):
            break
        assert time.monotonic() < deadline, ledger
        time.sleep(0.5)
    assert ledger["source"] == "ledger"
    assert {j: Decimal(rows(ledger)[j]["cost"]) for j in expected} == expected

    bad = cli(mesh, "bill", "--by", "color", check=False)
    assert bad.returncode == 2 and "--by must be one of" in bad.stderr


def test_the_estimate_counts_the_queue_quota_and_the_jobs_ahead(mesh: Path, tmp_path: Path) -> None:
    """research has 8 GPUs of quota: `busy` holds them for its max runtime (1 h), `next` waits
    for them ahead of us; so a 4-GPU research job starts when `next` ends, two hours after
    `busy` was placed, though an H100 node is free now."""
    eight = spec_file(tmp_path, "eight", "name: eight\ntenant: acme\nqueue: research\nmaxRuntime: 1h\n"
                      "resources: {gpu: 8, gpuModel: H100, cpu: 1, memory: 1Gi}\nsim: {duration: 1h}\n")
    busy = submit(mesh, eight, "--yes").stdout.strip()
    wait_jobs(mesh, {busy}, "running", timeout_s=30)
    nxt = submit(mesh, eight, "--yes").stdout.strip()
    try:
        deadline = time.monotonic() + 30
        while "pending (quota" not in cli(mesh, "explain", nxt).stdout:
            assert time.monotonic() < deadline, "the second job never waited for quota"
            time.sleep(0.3)
        placed_at = min(datetime.fromisoformat(e["occurred_at"])
                        for e in json.loads(cli(mesh, "explain", busy, "--json").stdout)["events"]
                        if e["type"] == "job.placed")
        four = spec_file(tmp_path, "four", "name: four\ntenant: acme\nqueue: research\nmaxRuntime: 30m\n"
                         "resources: {gpu: 4, gpuModel: H100, cpu: 1, memory: 1Gi}\n")
        asked = datetime.now(UTC)
        est = json.loads(cli(mesh, "estimate", str(four), "--json").stdout)
        start = placed_at + timedelta(hours=2)
        assert abs(est["wait_s"] - (start - asked).total_seconds()) < 5, est
        w = est["wait"]
        assert (w["ahead"], w["ahead_first"], w["running_ends"]) == (1, 1, 1)
        assert w["quota"]["queue"] == "research" and w["quota"]["full_now"]
        assert w["quota"]["reason"] == "queue research: gpu 8 used + 4 requested > nominal 8"
        assert abs(datetime.fromisoformat(w["quota"]["until"]) - start) < timedelta(seconds=1)
        assert est["wait_note"].startswith("1 job ahead (1 start first); waits for 1 running job to end; "
                                           "quota of queue research full until ")
        text = cli(mesh, "estimate", str(four)).stdout
        assert "expected wait: 1 h 59 min" in text or "expected wait: 2 h 0 min" in text, text
        # the same job in the unlimited default queue takes the free H100 node now
        free = spec_file(tmp_path, "free", four.read_text().replace("queue: research", "queue: default"))
        assert json.loads(cli(mesh, "estimate", str(free), "--json").stdout)["wait_s"] == 0
    finally:
        for j in (busy, nxt):
            cli(mesh, "cancel", j, check=False)
