"""OpenTelemetry: one trace per job across the services, trace context in the NATS headers,
Prometheus metrics over HTTP, and no-op helpers without set-up (shared/runtime/otel.py)."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gpufleet.services.admission.core import AdmissionCore
from gpufleet.shared.contract.events import STREAM, Envelope, parse_envelope
from gpufleet.shared.embedded.procs import free_port
from gpufleet.shared.runtime import otel
from gpufleet.shared.runtime.bus import Bus

from .helpers import default_cores, job_status, running, submit_cmd, wait_until

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train-resnet.yaml"
SERVICES = {"admission", "quota", "placer", "executor", "guardian"}


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    otel.setup("test", None, None, span_exporter=exporter)
    try:
        yield exporter
    finally:
        otel.shutdown()


@pytest.fixture
def no_otel() -> Iterator[None]:
    otel.shutdown()
    yield
    otel.shutdown()


async def job_log(bus: Bus, job_id: str) -> list[tuple[Envelope, dict[str, str]]]:
    """The job's events in log order, each with the NATS headers it was stored with."""
    out = []
    for seq in range(1, await bus.last_seq() + 1):
        msg = await bus.js.get_msg(STREAM, seq)
        env = parse_envelope(msg.data or b"")
        if env.correlation_id == job_id:
            out.append((env, dict(msg.headers or {})))
    return out


def service_of(span: ReadableSpan) -> str:
    name = str(span.resource.attributes["service.name"])
    assert name.startswith("gpufleet-")
    return name.removeprefix("gpufleet-")


async def run_job(bus: Bus, nats_url: str, cmds: list[Envelope], publish: Any = None) -> None:
    async with running(nats_url, default_cores(4)):
        for cmd in cmds:
            await (publish(cmd) if publish else bus.publish(cmd))

        async def done() -> bool:
            return all([await job_status(bus, c.correlation_id or "") == "succeeded" for c in cmds])

        await wait_until(done, timeout_s=30)


def short_job_spec() -> dict[str, Any]:
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["sim"]["duration"] = "0.3s"
    return dict(spec)


async def test_one_trace_per_job_following_the_causation_chain(
        bus: Bus, nats_url: str, spans: InMemorySpanExporter) -> None:
    cmd = submit_cmd(short_job_spec())
    job_id = cmd.correlation_id
    assert job_id is not None
    await run_job(bus, nats_url, [cmd])  # published with no trace context, as a non-Python client would

    mine = [s for s in spans.get_finished_spans() if s.attributes and s.attributes.get("gpufleet.job_id") == job_id]
    assert SERVICES <= {service_of(s) for s in mine}, [s.name for s in mine]
    # every service's spans for the job are in ONE trace: the one derived from the job id
    assert {s.context.trace_id for s in mine} == {otel.job_trace_id(job_id)}
    by_id = {s.context.span_id: s for s in mine}
    decided = {str(s.attributes["gpufleet.event_id"]): s for s in mine if " decide " in s.name and s.attributes}
    emitted = {str(s.attributes["gpufleet.event_id"]): s for s in mine if " emit " in s.name and s.attributes}

    events = await job_log(bus, job_id)
    assert [e.type for e, _ in events] == [
        "cmd.submit", "job.submitted", "job.admitted", "job.quota_reserved", "job.placed",
        "job.started", "job.exited", "job.succeeded",
    ]
    by_event = {e.event_id: e for e, _ in events}
    # the submit carried no traceparent: its decision is the root of the job's trace
    root = decided[cmd.event_id]
    assert root.parent is None and root.name == "admission decide cmd.submit"
    for env, headers in events[1:]:
        # each event carries the context of the span that made it, in the service that published it
        ctx = otel.parse_traceparent(headers.get("traceparent"))
        assert ctx is not None, (env.type, headers)
        assert ctx.trace_id == otel.job_trace_id(job_id)
        maker = by_id[ctx.span_id]
        assert service_of(maker) == env.actor.split("/")[0]
        cause = by_event.get(env.causation_id or "")
        if maker is emitted.get(env.event_id):
            assert maker.name == f"{service_of(maker)} emit {env.type}"  # a tick's output (the sim exit)
        elif cause is not None:
            assert maker is decided[cause.event_id], (env.type, maker.name)
        else:  # caused by the job as a whole (quota's reservation): made deciding an earlier event
            assert maker.attributes is not None and maker.name.startswith(f"{service_of(maker)} decide ")
            earlier = [e.event_id for e, _ in events[:events.index((env, headers))]]
            assert maker.attributes["gpufleet.event_id"] in earlier
        # and every decision of that event by a service that published something is its child
        if env.event_id in decided:
            child = decided[env.event_id]
            assert child.parent is not None and child.parent.span_id == ctx.span_id
            assert child.attributes is not None and int(str(child.attributes["gpufleet.stream_seq"])) > 0
    # the chain from the root to the end: succeeded <- guardian <- exited <- executor ... <- admission
    chain, span = [], decided[events[-2][0].event_id]  # guardian's decision on job.exited
    while span is not None:
        chain.append(f"{service_of(span)}:{span.name.split(' ', 1)[1]}")
        span = by_id[span.parent.span_id] if span.parent is not None else None
    assert chain == [
        "guardian:decide job.exited", "executor:emit job.exited", "executor:decide job.placed",
        "placer:decide job.quota_reserved", "quota:decide job.admitted", "admission:decide cmd.submit",
    ]


async def test_a_clients_trace_context_is_followed(bus: Bus, nats_url: str, spans: InMemorySpanExporter) -> None:
    cmd = submit_cmd(short_job_spec())
    client = otel.tracer("client")

    async def publish(env: Envelope) -> None:
        with client.start_as_current_span("submit") as span:
            client_ctx.append(span.get_span_context())
            await bus.publish(env)

    client_ctx: list[Any] = []
    await run_job(bus, nats_url, [cmd], publish)
    events = await job_log(bus, cmd.correlation_id or "")
    submitted = otel.parse_traceparent(events[0][1].get("traceparent"))
    assert submitted is not None and submitted.span_id == client_ctx[0].span_id
    mine = [s for s in spans.get_finished_spans() if s.attributes and s.attributes.get("gpufleet.job_id") == cmd.correlation_id]
    # the client's trace, not the derived one, is the job's trace in every service
    assert SERVICES <= {service_of(s) for s in mine}
    assert {s.context.trace_id for s in mine} == {client_ctx[0].trace_id} != {otel.job_trace_id(cmd.correlation_id or "")}
    first = next(s for s in mine if s.name == "admission decide cmd.submit")
    assert first.parent is not None and first.parent.span_id == client_ctx[0].span_id


async def scrape(port: int, path: str = "/metrics") -> tuple[str, str]:
    def get() -> tuple[str, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.read().decode(), r.headers["Content-Type"]
    return await asyncio.to_thread(get)


async def test_prometheus_endpoint_serves_service_counters_and_gauges(bus: Bus, nats_url: str) -> None:
    port = free_port()
    otel.setup("admission", port, None)
    try:
        assert otel.metrics_address() == ("0.0.0.0", port)
        cmd = submit_cmd(short_job_spec())
        async with running(nats_url, [AdmissionCore()]):
            await bus.publish(cmd)
            await wait_until(lambda: job_status(bus, cmd.correlation_id or ""), timeout_s=10)
            otel.record_gpu("node-a", 3, 87.5, 1024, 81920, 61.0, 301.5)
            otel.record_gpu("node-b", 0, None, 0, 40960)  # util unknown: no util series for it
            otel.record_queue("team-a", pending=4, gpus_used=12, oldest_wait_s=42.5)
            otel.record_job_state("running", 3)
            otel.record_job_state("running", -1)
            body, ctype = await scrape(port)
    finally:
        otel.shutdown()
    assert ctype.startswith("text/plain; version=0.0.4")
    lines = set(body.splitlines())
    assert "# TYPE gpufleet_events_consumed_total counter" in lines
    assert 'gpufleet_events_consumed_total{service="admission",type="cmd.submit"} 1' in lines
    assert 'gpufleet_events_published_total{service="admission",type="job.submitted"} 1' in lines
    assert 'gpufleet_events_published_total{service="admission",type="job.admitted"} 1' in lines
    assert not any(line.startswith("gpufleet_events_consumed_total{service=\"placer\"") for line in lines)
    assert 'gpufleet_gpu_utilization_percent{node="node-a",gpu="3"} 87.5' in lines
    assert not any('node="node-b"' in line and "utilization" in line for line in lines)
    assert f'gpufleet_gpu_memory_used_bytes{{node="node-a",gpu="3"}} {1024 * 1024 * 1024}' in lines
    assert f'gpufleet_gpu_memory_total_bytes{{node="node-b",gpu="0"}} {40960 * 1024 * 1024}' in lines
    assert 'gpufleet_gpu_temperature_celsius{node="node-a",gpu="3"} 61.0' in lines
    assert 'gpufleet_gpu_power_watts{node="node-a",gpu="3"} 301.5' in lines
    assert 'gpufleet_queue_pending{queue="team-a"} 4' in lines
    assert 'gpufleet_queue_gpus_used{queue="team-a"} 12' in lines
    assert 'gpufleet_queue_oldest_wait_seconds{queue="team-a"} 42.5' in lines
    assert 'gpufleet_jobs{state="running"} 2' in lines
    assert "# TYPE gpufleet_decision_batch_duration_seconds histogram" in lines
    count = next(line for line in lines if line.startswith('gpufleet_decision_batch_duration_seconds_count{service="admission"}'))
    assert int(count.split()[-1]) >= 1
    assert any(line.startswith('gpufleet_decision_batch_duration_seconds_bucket{service="admission",le="+Inf"}')
               for line in lines)
    assert any(line.startswith("target_info{") and 'service_name="gpufleet-admission"' in line for line in lines)
    # after shutdown the port is free again, and nothing answers there
    with pytest.raises(urllib.error.URLError):
        await scrape(port)


async def test_without_setup_helpers_do_nothing_and_fast(bus: Bus, nats_url: str, no_otel: None) -> None:
    assert not otel.enabled() and not otel.TRACING and not otel.METRICS
    cmd = submit_cmd(short_job_spec())
    assert otel.inject_headers(cmd) == {}
    assert otel.decisions("admission") is None
    assert otel.scrape() == "" and otel.metrics_address() is None
    n = 20_000
    t0 = time.perf_counter()
    for i in range(n):
        otel.record_gpu("n", i % 8, 50.0, 1, 2, 3.0, 4.0)
        otel.record_queue("q", i, i)
        otel.record_job_state("running", 1)
        otel.count_published("admission", (cmd,))
        otel.count_dead_letter("admission")
        otel.inject_headers(cmd)
    per_call_us = (time.perf_counter() - t0) / (6 * n) * 1e6
    assert per_call_us < 2.0, per_call_us
    assert otel._gpus == {} and otel._jobs == {} and otel._queues == {} and otel._published == {}
    # and the runtime publishes no trace context
    async with running(nats_url, [AdmissionCore()]):
        await bus.publish(cmd)
        await wait_until(lambda: job_status(bus, cmd.correlation_id or ""), timeout_s=10)
    events = await job_log(bus, cmd.correlation_id or "")
    assert len(events) == 3 and all("traceparent" not in h and "Nats-Msg-Id" in h for _, h in events)


def test_trace_context_parsing_and_job_trace_ids() -> None:
    assert otel.job_trace_id("job-1") == otel.job_trace_id("job-1") != otel.job_trace_id("job-2")
    assert 0 < otel.job_trace_id("job-1") < 2**128
    sc = otel.parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "a=1,b=2")
    assert sc is not None and sc.is_remote and sc.trace_flags == 1
    assert otel.context_headers(sc) == {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                                        "tracestate": "a=1,b=2"}
    for bad in (None, "", "garbage", "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"):
        assert otel.parse_traceparent(bad) is None, bad
    assert otel.parse_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future") is not None
    ctx = otel.extract_context({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    from opentelemetry import trace
    assert trace.get_current_span(ctx).get_span_context().span_id == 0x00F067AA0BA902B7
    assert not trace.get_current_span(otel.extract_context({})).get_span_context().is_valid


def test_prometheus_names_and_escaping() -> None:
    assert otel.prometheus_name("gpufleet.events.consumed", "{event}", True) == "gpufleet_events_consumed_total"
    assert otel.prometheus_name("gpufleet.decision.batch.duration", "s", False) == "gpufleet_decision_batch_duration_seconds"
    assert otel.prometheus_name("gpufleet.gpu.memory.used", "By", False) == "gpufleet_gpu_memory_used_bytes"
    assert otel._labels({"node": 'a"b\\c\nd', "k8s.pod": "x"}) == '{node="a\\"b\\\\c\\nd",k8s_pod="x"}'


def test_setup_with_nothing_to_export_sets_up_nothing(no_otel: None) -> None:
    otel.setup("executor", None, None)
    assert not otel.enabled() and not otel.METRICS and not otel.TRACING
    otel.setup("executor", None, None, span_exporter=InMemorySpanExporter())
    assert otel.enabled() and otel.TRACING
    assert otel.decisions("executor") is not None


async def test_gpu_queue_and_job_gauges_come_from_the_services(bus: Bus, nats_url: str) -> None:
    """Telemetry's samples and quota's state reach /metrics, through the services themselves."""
    from gpufleet.services.billing.core import BillingCore
    from gpufleet.services.billing.metrics import sidecar as billing_metrics
    from gpufleet.services.quota.core import QuotaCore
    from gpufleet.services.quota.metrics import sidecar as quota_metrics

    from .test_telemetry import mesh, node

    port = free_port()
    otel.setup("group", port, None)
    try:
        async with mesh(nats_url, {"n0": node("n0")}):
            jobs = [submit_cmd({"name": "g", "tenant": "acme", "queue": "research", "resources": {"gpu": 2},
                                "sim": {"duration": "60s", "gpuUtil": 77}}) for _ in range(2)]
            for j in jobs:
                await bus.publish(j)

            async def gpus_busy() -> bool:
                body, _ = await scrape(port)
                return 'gpufleet_gpu_utilization_percent{node="n0",gpu="1"} 77.0' in body
            await wait_until(gpus_busy, timeout_s=15)
            # quota's gauges, exported by its sidecar from the folded state of a quota runtime
            async with running(nats_url, [QuotaCore(), BillingCore()]) as rts:
                await wait_until(lambda: len(rts[0].state.reserved) == 2 and rts[1].state.open, timeout_s=10)
                for side in (quota_metrics(rts[0]), billing_metrics(rts[1])):
                    await side.start()
                body, _ = await scrape(port)
    finally:
        otel.shutdown()
    lines = set(body.splitlines())
    assert 'gpufleet_gpu_utilization_percent{node="n0",gpu="0"} 77.0' in lines
    assert f'gpufleet_gpu_memory_used_bytes{{node="n0",gpu="0"}} {2048 * 1024 * 1024}' in lines
    assert 'gpufleet_queue_gpus_used{queue="research"} 4' in lines  # both hold quota; one waits for GPUs
    assert 'gpufleet_jobs{state="admitted"} 2' in lines
    # billing's: the running job's two GPUs, its tenant's cost so far (list prices: not zero)
    held = sorted(line for line in lines if line.startswith("gpufleet_gpu_allocated{"))
    assert len(held) == 2 and all('node="n0"' in h and 'tenant="acme"' in h and h.endswith(" 1") for h in held)
    assert 'gpufleet_tenant_gpus{tenant="acme"} 2.0' in lines
    [cost] = [line for line in lines if line.startswith('gpufleet_tenant_cost{tenant="acme",currency="USD"}')]
    assert float(cost.split()[-1]) > 0
