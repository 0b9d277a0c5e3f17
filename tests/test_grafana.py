"""deploy/grafana/gpufleet.json: every query names metrics and labels the services really export
(rendered by the same code that serves /metrics, fed one sample of each)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from gpufleet.shared.contract.events import Envelope, JobPlaced, utc
from gpufleet.shared.contract.ids import derive_id
from gpufleet.shared.runtime import otel

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "gpufleet.json"


def exported() -> dict[str, set[str]]:
    """Metric name -> its labels, as /metrics shows them after one sample of everything."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    otel.setup("group", metric_readers=[reader])
    try:
        env = Envelope(event_id=derive_id("x", "placed", 1_800_000_000_000), type="job.placed",
                       occurred_at=utc(1_800_000_000), tenant="acme", actor="placer/0",
                       payload=JobPlaced(job_id="j1", allocations=()))
        otel.count_consumed("placer", {"job.quota_reserved": 1})
        otel.count_published("placer", [env])
        otel.count_dead_letter("placer")
        otel.count_cas_conflict("placer")
        otel.count_refold("placer")
        otel.observe_batch("placer", 0.01)
        otel.record_gpu("n0", 0, 50.0, 1024, 81920)
        otel.record_job_state("running", 1)
        otel.record_queue("research", 2, 4, 30.0)
        otel.set_tenant_costs({"acme": (12.5, 2.5, 4.0)}, "USD")
        otel.set_gpu_allocations({("n0", "0"): "acme"})
        text = otel.render_prometheus(reader.get_metrics_data())
    finally:
        otel.shutdown()
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s", line)
        assert m, line
        labels = set(re.findall(r'(\w+)="', m.group(2) or ""))
        out.setdefault(m.group(1), set()).update(labels)
    return out


def test_every_panel_queries_what_the_services_export() -> None:
    metrics = exported()
    doc = json.loads(DASHBOARD.read_text())
    assert doc["panels"] and all(p["targets"] for p in doc["panels"])
    used: set[str] = set()
    for panel in doc["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            names = set(re.findall(r"\bgpufleet_[a-z0-9_]+", expr))
            assert names, (panel["title"], expr)
            for name in names:
                assert name in metrics, f"{panel['title']}: {name} is not exported (there: {sorted(metrics)})"
                used.add(name)
            labels = set(re.findall(r"\b(\w+)\s*=~?\s*\"", expr))
            labels |= {w for grp in re.findall(r"by \(([^)]*)\)", expr) for w in re.split(r"[,\s]+", grp) if w}
            have = set().union(*(metrics[n] for n in names))
            assert labels <= have | {"le"}, f"{panel['title']}: labels {labels - have} not on {names}"
    # each kind of thing the issue asks about has a panel: GPUs, queues, placements, CAS conflicts
    for wanted in ("gpufleet_gpu_utilization_percent", "gpufleet_queue_pending", "gpufleet_queue_oldest_wait_seconds",
                   "gpufleet_events_published_total", "gpufleet_gpu_allocated", "gpufleet_tenant_cost",
                   "gpufleet_tenant_idle_cost", "gpufleet_tenant_gpus",
                   "gpufleet_cas_conflicts_total", "gpufleet_decision_batch_duration_seconds_bucket"):
        assert wanted in used, wanted
