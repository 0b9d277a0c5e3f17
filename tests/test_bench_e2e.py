"""`gpufleet bench e2e` on a small mesh: every job's outcome is counted, the config is printed
with the figures, and a steady offered load (--rate) is what the bench offers."""

from __future__ import annotations

from gpufleet.bench.e2e import run_e2e


def test_a_steady_rate_places_every_job_and_reports_its_budget() -> None:
    said: list[str] = []
    result = run_e2e(sim_nodes=20, jobs=60, postgres=False, layouts=("grouped",), rate=100.0, progress=said.append)
    assert result["placed"] == 60
    assert result["unaccounted"] == 0 and result["refused"] == 0 and result["queued"] == 0
    assert result["config"]["offered_rate_jobs_s"] == 100.0 and result["config"]["jobs"] == 60
    assert any(line.startswith("config: ") for line in said)
    # offered at 100 a second: the 60 submits take about 0.6 s, not a burst
    assert result["submit_rate_jobs_s"] < 150
    per_job = result["cpu_us_per_job"]
    assert per_job["total"] == round(1e6 * sum(result["cpu_s"].values()) / 60)
    assert set(per_job) >= {"placer", "executor", "nats-server", "total"}
    # every runtime stopped cleanly and said how many compare-and-sets it lost (one placer: none)
    assert any(a.startswith("placer") for a in result["stats_from"]) and any(
        a.startswith("quota") for a in result["stats_from"])
    assert result["cas_conflicts_total"] == 0


def test_a_process_cpu_counts_its_children_when_asked() -> None:
    """PostgreSQL's CPU is its backends' (one process per connection): the budget counts them."""
    import os
    import subprocess
    import sys

    from gpufleet.bench.e2e import _cpu_s

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('burnt', flush=True)\ninput()"
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "burnt"
        me = os.getpid()
        assert _cpu_s(me, children=True) - _cpu_s(me) >= 0.25  # the living child's 0.3 s
    finally:
        child.communicate("\n", timeout=10)


def test_until_ended_counts_every_placed_jobs_whole_life() -> None:
    """`--until-ended --duration 1s`: the run lasts until each placed job has ended, and says so."""
    from pathlib import Path

    cluster = Path(__file__).resolve().parents[1] / "examples" / "bench-cluster.yaml"  # limits a burst stays under
    result = run_e2e(sim_nodes=20, jobs=40, postgres=False, layouts=("grouped",), duration="1s", until_ended=True,
                     config=cluster)
    assert result["config"]["cluster_config"] == str(cluster) and "100000 submits/s" in result["config"]["limits"]
    assert result["placed"] == 40 and result["unaccounted"] == 0
    assert result["ended"] == 40 and result["not_ended"] == 0
    assert result["ended_wall_s"] >= 1.0  # no job ends before it has run its second
    assert result["config"]["sim_duration"] == "1s" and result["config"]["until_ended"] is True
