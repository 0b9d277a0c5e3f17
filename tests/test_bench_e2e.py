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
