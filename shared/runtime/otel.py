"""OpenTelemetry for the mesh: metrics (Prometheus scrape, OTLP) and one trace per job.

Nothing here does anything until `setup()` ran: every helper first checks one module flag and
returns, so a service or a test that never sets it up pays a function call per helper.

Traces. W3C trace context travels in the NATS headers (`traceparent`, `tracestate`) of every
event the bus publishes. The runtime records one span per decision that published something
(or failed), named "<service> decide <type>", parented to the `traceparent` of the message it
decided; the outputs of that decision carry the span's context. A message without one (a client
in another language, an output of a restarted service) is decided in a root span whose trace id
is `job_trace_id(job_id)`, sha256 of the job id: every service derives the same one, so a job is
one trace even where the chain of headers is broken. Outputs that no consumed message caused
(ticks: the sim executor ending a job) or that belong to another job than the message in hand
(quota reserving the next job in line) get a span of their own, "<service> emit <type>",
parented to the last span that service recorded for that job, else to the job's trace.

Metrics. Counters are plain dicts bumped in the runtime and read by observable instruments
when a reader collects, so the hot path costs a dict update: events consumed / published per
service and type, dead letters, compare-and-set conflicts, re-folds; a histogram of the
decision batch latency; and gauges other services feed: `record_gpu`, `record_queue`,
`record_job_state`. They are served in the Prometheus text format (0.0.4) on
http://<host>:<port>/metrics and, given an endpoint, pushed over OTLP/HTTP.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Histogram, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import Gauge, InMemoryMetricReader, MetricReader, MetricsData, Sum
from opentelemetry.sdk.metrics.export import Histogram as HistogramData
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

if TYPE_CHECKING:
    from gpufleet.shared.contract.events import Envelope

log = logging.getLogger(__name__)

SCOPE = "gpufleet"
LAST_SPANS_MAX = 65_536  # per service: jobs whose last span an `emit` span can be parented to
BOUND_MAX = 200_000  # outputs decided but not yet published (a safety bound; released per commit)
BATCH_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MIB = 1024 * 1024

# The hot paths read these two flags (bus: inject headers; runtime: spans, counters).
TRACING = False
METRICS = False


# ---------------------------------------------------------------- trace ids


def job_trace_id(job_id: str) -> int:
    """The trace id of a job whose messages carry no trace context: sha256(job id)[:16]."""
    tid = int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:16], "big")
    return tid or 1


_FORCED_TRACE_ID: contextvars.ContextVar[int] = contextvars.ContextVar("gpufleet_trace_id", default=0)


class JobIdGenerator(RandomIdGenerator):
    """Random ids, except the trace id of a root span started for a job (`in_job_trace`)."""

    def generate_trace_id(self) -> int:
        return _FORCED_TRACE_ID.get() or super().generate_trace_id()


_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


def parse_traceparent(value: str | None, tracestate: str | None = None) -> SpanContext | None:
    """The remote span context of a W3C `traceparent` header; None if absent or invalid."""
    if not value:
        return None
    m = _TRACEPARENT.match(value.strip().lower())
    if m is None or m.group(1) == "ff" or (m.group(1) == "00" and m.group(5)):
        return None
    trace_id, span_id = int(m.group(2), 16), int(m.group(3), 16)
    if not trace_id or not span_id:
        return None
    state = TraceState.from_header([tracestate]) if tracestate else None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(int(m.group(4), 16)),
                       trace_state=state)


def format_traceparent(sc: SpanContext) -> str:
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags & 0xFF:02x}"


def context_headers(sc: SpanContext) -> dict[str, str]:
    headers = {"traceparent": format_traceparent(sc)}
    if sc.trace_state:
        headers["tracestate"] = sc.trace_state.to_header()
    return headers


def header_context(headers: Mapping[str, str] | None) -> SpanContext | None:
    """The remote span context in NATS headers (`traceparent`, any case of its first letter)."""
    if not headers:
        return None
    value = headers.get("traceparent") or headers.get("Traceparent")
    if value is None:
        return None
    return parse_traceparent(value, headers.get("tracestate") or headers.get("Tracestate"))


def extract_context(headers: Mapping[str, str] | None) -> Context:
    """An OpenTelemetry context holding the remote span of the headers (empty if they have none)."""
    sc = header_context(headers)
    return trace.set_span_in_context(NonRecordingSpan(sc), Context()) if sc is not None else Context()


# Outputs decided but not published yet -> the span context they carry (runtime binds, bus reads).
_bound: dict[str, SpanContext] = {}


def bind(event_id: str, sc: SpanContext) -> None:
    if len(_bound) >= BOUND_MAX:
        _bound.clear()  # outputs never published (a failed batch decided again): drop the lot
    _bound[event_id] = sc


def release(envs: Iterable[Envelope]) -> None:
    for env in envs:
        _bound.pop(env.event_id, None)


def inject_headers(env: Envelope) -> dict[str, str]:
    """The trace headers an envelope goes out with: the span that decided it, else the current
    span, else none (its consumer then uses the job's own trace). {} when tracing is off."""
    if not TRACING:
        return {}
    sc = _bound.get(env.event_id)
    if sc is None:
        sc = trace.get_current_span().get_span_context()
        if not sc.is_valid:
            return {}
    return context_headers(sc)


# ---------------------------------------------------------------- set-up


@dataclass
class _State:
    service: str
    resource_attrs: dict[str, str]
    processors: list[SpanProcessor]
    meter_provider: MeterProvider
    batch_hist: Histogram
    prom_reader: InMemoryMetricReader | None = None
    server: ThreadingHTTPServer | None = None
    tracers: dict[str, trace.Tracer] = field(default_factory=dict)
    providers: list[TracerProvider] = field(default_factory=list)
    decisions: dict[str, Decisions] = field(default_factory=dict)


_state: _State | None = None
_lock = threading.Lock()

# counters: (service, type) -> n, and service -> n; read by observable instruments on collection
_consumed: dict[tuple[str, str], int] = {}
_published: dict[tuple[str, str], int] = {}
_dead_letters: dict[str, int] = {}
_cas_conflicts: dict[str, int] = {}
_refolds: dict[str, int] = {}
# gauges: fed by other services
_gpus: dict[tuple[str, str], tuple[float | None, float, float, float | None, float | None]] = {}
_jobs: dict[str, int] = {}
_queues: dict[str, tuple[float, float, float]] = {}  # queue -> (pending, GPUs used, oldest wait s)
_tenants: dict[tuple[str, str], tuple[float, float, float]] = {}  # (tenant, currency) -> (cost, idle cost, GPUs)
_allocated: dict[tuple[str, str], str] = {}  # (node, GPU index) -> tenant


def setup(service: str, prometheus_port: int | None = None, otlp_endpoint: str | None = None, *,
          instance: str | None = None, span_exporter: SpanExporter | None = None,
          metric_readers: Sequence[MetricReader] = (), prometheus_host: str | None = None,
          tracing: bool | None = None) -> None:
    """Build the meter and tracer providers (resource service.name=gpufleet-<service>).

    prometheus_port: serve /metrics there (None or 0: no). otlp_endpoint: the collector's
    OTLP/HTTP base URL (http://host:4318), for traces and metrics. span_exporter /
    metric_readers: more exporters (tests: an InMemorySpanExporter, exported synchronously).
    Tracing (spans, trace headers) is on where there is a span exporter, unless `tracing` says
    otherwise: with metrics alone a service makes no spans. With nothing to export at all it
    sets up nothing (every helper stays a no-op). Calling it again replaces all.
    """
    global _state, TRACING, METRICS
    shutdown()
    if not (prometheus_port or otlp_endpoint or span_exporter or metric_readers or tracing):
        return
    attrs = {"service.name": f"gpufleet-{service}", "service.namespace": "gpufleet"}
    if instance is not None:
        attrs["service.instance.id"] = instance
    readers: list[MetricReader] = list(metric_readers)
    processors: list[SpanProcessor] = []
    if span_exporter is not None:
        processors.append(SimpleSpanProcessor(span_exporter))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        base = otlp_endpoint.rstrip("/")
        processors.append(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{base}/v1/traces")))
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=f"{base}/v1/metrics")))
    prom_reader = InMemoryMetricReader() if prometheus_port else None
    if prom_reader is not None:
        readers.append(prom_reader)
    mp = MeterProvider(resource=Resource.create(attrs), metric_readers=readers, shutdown_on_exit=False)
    meter = mp.get_meter(SCOPE)
    meter.create_observable_counter("gpufleet.events.consumed", [_observe(_consumed, ("service", "type"))],
                                    "{event}", "Events a service decided, by type")
    meter.create_observable_counter("gpufleet.events.published", [_observe(_published, ("service", "type"))],
                                    "{event}", "Events a service published, by type")
    meter.create_observable_counter("gpufleet.dead_letters", [_observe(_dead_letters, ("service",))],
                                    "{event}", "Messages a service dead-lettered")
    meter.create_observable_counter("gpufleet.cas_conflicts", [_observe(_cas_conflicts, ("service",))],
                                    "{conflict}", "Compare-and-set publishes another writer won")
    meter.create_observable_counter("gpufleet.refolds", [_observe(_refolds, ("service",))],
                                    "{refold}", "State rebuilds from the log")
    hist = meter.create_histogram("gpufleet.decision.batch.duration", "s",
                                  "Time to decide, publish and ack one fetched batch",
                                  explicit_bucket_boundaries_advisory=BATCH_BUCKETS_S)
    for i, (name, unit, desc) in enumerate((
        ("gpufleet.gpu.utilization", "%", "GPU utilisation"),
        ("gpufleet.gpu.memory.used", "By", "GPU memory in use"),
        ("gpufleet.gpu.memory.total", "By", "GPU memory"),
        ("gpufleet.gpu.temperature", "Cel", "GPU temperature"),
        ("gpufleet.gpu.power", "W", "GPU power draw"),
    )):
        meter.create_observable_gauge(name, [_observe_gpu(i)], unit, desc)
    meter.create_observable_gauge("gpufleet.jobs", [_observe(_jobs, ("state",))], "{job}", "Jobs by state")
    meter.create_observable_gauge("gpufleet.queue.pending", [_observe_queue(0)], "{job}", "Jobs waiting in a queue")
    meter.create_observable_gauge("gpufleet.queue.gpus_used", [_observe_queue(1)], "{gpu}", "GPUs a queue holds")
    meter.create_observable_gauge("gpufleet.queue.oldest_wait", [_observe_queue(2)], "s",
                                  "How long the queue's longest-waiting job has waited for quota")
    for i, (name, desc) in enumerate((
        ("gpufleet.tenant.cost", "What the tenant's runs cost so far (closed and running), in the price currency"),
        ("gpufleet.tenant.idle_cost", "What of it went to GPUs the tenant held idle"),
        ("gpufleet.tenant.gpus", "GPUs the tenant's running replicas hold (a share: its fraction)"),
    )):
        meter.create_observable_gauge(name, [_observe_tenant(i)], "{gpu}" if i == 2 else "{currency}", desc)
    meter.create_observable_gauge("gpufleet.gpu.allocated", [_observe_allocated], "{gpu}",
                                  "1 for each GPU a running replica holds, with its tenant (join on node, gpu)")
    state = _State(service, attrs, processors, mp, hist, prom_reader)
    if prom_reader is not None and prometheus_port:
        host = prometheus_host or os.environ.get("GPUFLEET_METRICS_HOST", "0.0.0.0")
        state.server = _serve_metrics(host, prometheus_port, prom_reader, attrs)
    with _lock:
        _state = state
        TRACING, METRICS = bool(processors) if tracing is None else tracing, True


def shutdown() -> None:
    """Flush and stop everything `setup` started; the helpers are no-ops again."""
    global _state, TRACING, METRICS
    with _lock:
        state, _state = _state, None
        TRACING = METRICS = False
        for d in (_consumed, _published, _dead_letters, _cas_conflicts, _refolds, _gpus, _jobs, _queues, _tenants,
                  _allocated, _bound):
            d.clear()
    if state is None:
        return
    if state.server is not None:
        state.server.shutdown()
        state.server.server_close()
    for p in state.processors:
        try:
            p.shutdown()
        except Exception:  # noqa: BLE001 - an exporter that cannot flush must not stop the service
            log.exception("span processor shutdown failed")
    try:
        state.meter_provider.shutdown()
    except Exception:  # noqa: BLE001
        log.exception("meter provider shutdown failed")


def enabled() -> bool:
    return _state is not None


def metrics_address() -> tuple[str, int] | None:
    """Where /metrics is served (host, port), if it is."""
    if _state is None or _state.server is None:
        return None
    host, port = _state.server.server_address[:2]
    return str(host), int(port)


def tracer(service: str | None = None) -> trace.Tracer:
    """A tracer whose spans carry resource service.name=gpufleet-<service> (default: the
    process's); a no-op tracer when tracing is off."""
    state = _state
    if state is None or not TRACING:
        return trace.NoOpTracer()
    name = service or state.service
    t = state.tracers.get(name)
    if t is None:
        attrs = {**state.resource_attrs, "service.name": f"gpufleet-{name}"}
        provider = TracerProvider(resource=Resource.create(attrs), id_generator=JobIdGenerator(),
                                  shutdown_on_exit=False)
        for p in state.processors:  # shared: shut down once, by `shutdown`
            provider.add_span_processor(p)
        state.providers.append(provider)
        t = state.tracers[name] = provider.get_tracer(SCOPE)
    return t


class in_job_trace:  # noqa: N801 - used as a context manager, like a function
    """Within this block a root span (one started with an empty parent context) gets
    `job_trace_id(job_id)` as its trace id: a span of a shell, or a client, in the job's trace."""

    def __init__(self, job_id: str) -> None:
        self.trace_id = job_trace_id(job_id)
        self._token: contextvars.Token[int] | None = None

    def __enter__(self) -> int:
        self._token = _FORCED_TRACE_ID.set(self.trace_id)
        return self.trace_id

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _FORCED_TRACE_ID.reset(self._token)


# ---------------------------------------------------------------- decisions (the runtime's spans)


class Decisions:
    """The spans of one service's decisions, and the contexts its outputs are published with."""

    def __init__(self, service: str, tracer_: trace.Tracer) -> None:
        self.service = service
        self.tracer = tracer_
        self._last: OrderedDict[str, SpanContext] = OrderedDict()  # job -> its last span here

    def _remember(self, job_id: str, sc: SpanContext) -> None:
        last = self._last
        last[job_id] = sc
        last.move_to_end(job_id)
        if len(last) > LAST_SPANS_MAX:
            last.popitem(last=False)

    def _start(self, name: str, parent: SpanContext | None, job_id: str | None, kind: SpanKind,
               attributes: dict[str, Any], start_ns: int | None) -> trace.Span:
        if parent is not None:
            ctx = trace.set_span_in_context(NonRecordingSpan(parent), Context())
            return self.tracer.start_span(name, ctx, kind, attributes, start_time=start_ns)
        if job_id is None:
            return self.tracer.start_span(name, Context(), kind, attributes, start_time=start_ns)
        token = _FORCED_TRACE_ID.set(job_trace_id(job_id))
        try:
            return self.tracer.start_span(name, Context(), kind, attributes, start_time=start_ns)
        finally:
            _FORCED_TRACE_ID.reset(token)

    def decided(self, env: Envelope, headers: Mapping[str, str] | None, seq: int, outputs: Sequence[Envelope],
                start_ns: int, error: BaseException | None = None) -> None:
        """Record the span of one decision (already made: it ran from `start_ns` to now) and bind
        its outputs of the same job (or of none) to it."""
        job_id = env.correlation_id or env.job_id
        parent = header_context(headers)
        if parent is None and job_id is None:
            return  # not a job's, and no trace to join: no span
        attrs: dict[str, Any] = {"gpufleet.event_id": env.event_id, "gpufleet.stream_seq": seq,
                                 "gpufleet.outputs": len(outputs)}
        if job_id is not None:
            attrs["gpufleet.job_id"] = job_id
        span = self._start(f"{self.service} decide {env.type}", parent, job_id, SpanKind.CONSUMER, attrs, start_ns)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:500]))
            span.record_exception(error)
        span.end()
        sc = span.get_span_context()
        if job_id is not None:
            self._remember(job_id, sc)
        for out in outputs:
            out_job = out.correlation_id
            if out_job is None or out_job == job_id:
                bind(out.event_id, sc)

    def emitted(self, outputs: Sequence[Envelope]) -> None:
        """A span for each output of a job that no decision span carries (ticks, start-up, the
        shell's own, another job's), parented to this service's last span for the job."""
        for out in outputs:
            job_id = out.correlation_id
            if job_id is None or out.event_id in _bound:
                continue
            attrs: dict[str, Any] = {"gpufleet.event_id": out.event_id, "gpufleet.job_id": job_id}
            if out.causation_id:
                attrs["gpufleet.causation_id"] = out.causation_id
            span = self._start(f"{self.service} emit {out.type}", self._last.get(job_id), job_id,
                               SpanKind.PRODUCER, attrs, None)
            span.end()
            sc = span.get_span_context()
            self._remember(job_id, sc)
            bind(out.event_id, sc)


def decisions(service: str) -> Decisions | None:
    """The span recorder of a service, None when tracing is off."""
    state = _state
    if state is None or not TRACING:
        return None
    d = state.decisions.get(service)
    if d is None:
        d = state.decisions[service] = Decisions(service, tracer(service))
    return d


# ---------------------------------------------------------------- metric helpers


def count_consumed(service: str, by_type: Mapping[str, int]) -> None:
    if not METRICS:
        return
    for t, n in by_type.items():
        key = (service, t)
        _consumed[key] = _consumed.get(key, 0) + n


def count_published(service: str, envs: Iterable[Envelope]) -> None:
    if not METRICS:
        return
    for env in envs:
        key = (service, env.type)
        _published[key] = _published.get(key, 0) + 1


def count_dead_letter(service: str) -> None:
    if METRICS:
        _dead_letters[service] = _dead_letters.get(service, 0) + 1


def count_cas_conflict(service: str) -> None:
    if METRICS:
        _cas_conflicts[service] = _cas_conflicts.get(service, 0) + 1


def count_refold(service: str) -> None:
    if METRICS:
        _refolds[service] = _refolds.get(service, 0) + 1


def observe_batch(service: str, seconds: float) -> None:
    state = _state
    if state is not None:
        state.batch_hist.record(seconds, {"service": service})


def record_gpu(node: str, gpu: int | str, util_pct: float | None, mem_used_mib: float, mem_total_mib: float,
               temp_c: float | None = None, power_w: float | None = None) -> None:
    """The latest sample of one GPU (None: the backend cannot say; that series is left out)."""
    if METRICS:
        _gpus[(node, str(gpu))] = (util_pct, mem_used_mib * MIB, mem_total_mib * MIB, temp_c, power_w)


def forget_gpus(node: str) -> None:
    """Drop a node's GPU series (a node lost or removed)."""
    if METRICS:
        for key in [k for k in _gpus.copy() if k[0] == node]:
            _gpus.pop(key, None)


def record_job_state(state: str, delta: int) -> None:
    """Jobs in `state` went up (or down) by `delta`."""
    if METRICS:
        _jobs[state] = _jobs.get(state, 0) + delta


def set_job_states(counts: Mapping[str, int]) -> None:
    """Jobs per state, as a whole (a service that holds the counts sets them outright)."""
    if METRICS:
        _jobs.clear()
        _jobs.update(counts)


def record_queue(queue: str, pending: int, gpus_used: int, oldest_wait_s: float = 0.0) -> None:
    if METRICS:
        _queues[queue] = (pending, gpus_used, oldest_wait_s)


def set_tenant_costs(by_tenant: Mapping[str, tuple[float, float, float]], currency: str) -> None:
    """Per tenant (cost, idle cost, GPUs held), as a whole (billing's folded state)."""
    if METRICS:
        _tenants.clear()
        _tenants.update({(t, currency): v for t, v in by_tenant.items()})


def set_gpu_allocations(held: Mapping[tuple[str, str], str]) -> None:
    """(node, GPU index) -> the tenant whose running replica holds it, as a whole."""
    if METRICS:
        _allocated.clear()
        _allocated.update(held)


def _observe_tenant(i: int) -> Any:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        for (tenant, currency), values in _tenants.copy().items():
            yield Observation(values[i], {"tenant": tenant} if i == 2 else {"tenant": tenant, "currency": currency})
    return callback


def _observe_allocated(options: CallbackOptions) -> Iterable[Observation]:
    for (node, gpu), tenant in _allocated.copy().items():
        yield Observation(1, {"node": node, "gpu": gpu, "tenant": tenant})


def _observe(counts: dict[Any, int], labels: tuple[str, ...]) -> Any:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        for key, n in counts.copy().items():  # copy: a scrape runs on its own thread
            values = key if isinstance(key, tuple) else (key,)
            yield Observation(n, dict(zip(labels, values, strict=True)))
    return callback


def _observe_gpu(i: int) -> Any:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        for (node, gpu), sample in _gpus.copy().items():
            value = sample[i]
            if value is not None:
                yield Observation(value, {"node": node, "gpu": gpu})
    return callback


def _observe_queue(i: int) -> Any:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        for queue, values in _queues.copy().items():
            yield Observation(values[i], {"queue": queue})
    return callback


# ---------------------------------------------------------------- Prometheus exposition

_UNITS = {"s": "seconds", "ms": "milliseconds", "By": "bytes", "%": "percent", "Cel": "celsius", "W": "watts",
          "1": "ratio"}
_BAD_NAME = re.compile(r"[^a-zA-Z0-9_:]")
_BAD_LABEL = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(name: str, unit: str | None, counter: bool) -> str:
    """OpenTelemetry name and unit -> Prometheus name: dots to underscores, the unit as a suffix
    (`{annotations}` dropped), `_total` on counters."""
    out = _BAD_NAME.sub("_", name)
    suffix = _UNITS.get(unit or "", "" if not unit or unit.startswith("{") else _BAD_NAME.sub("_", unit))
    if suffix and not out.endswith("_" + suffix):
        out += "_" + suffix
    if counter:
        out += "_total"
    return out


def _label_name(key: str) -> str:
    out = _BAD_LABEL.sub("_", key)
    return "_" + out if out[:1].isdigit() else out


def _label_value(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(attrs: Mapping[str, Any] | None, extra: tuple[tuple[str, str], ...] = ()) -> str:
    pairs = [(_label_name(k), _label_value(v)) for k, v in (attrs or {}).items()] + list(extra)
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}"


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def render_prometheus(data: MetricsData | None, resource_attrs: Mapping[str, str] | None = None) -> str:
    """Collected metrics in the Prometheus text exposition format 0.0.4."""
    lines: list[str] = []
    if resource_attrs:
        lines += ["# HELP target_info Target metadata", "# TYPE target_info gauge",
                  f"target_info{_labels(resource_attrs)} 1"]
    seen: set[str] = set()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                d = metric.data
                if isinstance(d, Sum):
                    name = prometheus_name(metric.name, metric.unit, d.is_monotonic)
                    kind = "counter" if d.is_monotonic else "gauge"
                elif isinstance(d, Gauge):
                    name, kind = prometheus_name(metric.name, metric.unit, False), "gauge"
                elif isinstance(d, HistogramData):
                    name, kind = prometheus_name(metric.name, metric.unit, False), "histogram"
                else:
                    continue  # exponential histograms: none here
                if name not in seen:
                    seen.add(name)
                    lines.append(f"# HELP {name} {(metric.description or metric.name).replace(chr(10), ' ')}")
                    lines.append(f"# TYPE {name} {kind}")
                if isinstance(d, HistogramData):
                    for hp in d.data_points:
                        cumulative = 0
                        for bound, n in zip((*hp.explicit_bounds, math.inf), hp.bucket_counts, strict=True):
                            cumulative += n
                            le = (("le", _num(float(bound))),)
                            lines.append(f"{name}_bucket{_labels(hp.attributes, le)} {cumulative}")
                        lines.append(f"{name}_sum{_labels(hp.attributes)} {_num(hp.sum)}")
                        lines.append(f"{name}_count{_labels(hp.attributes)} {hp.count}")
                else:
                    for p in d.data_points:
                        lines.append(f"{name}{_labels(p.attributes)} {_num(p.value)}")
    return "\n".join(lines) + "\n"


def scrape() -> str:
    """What /metrics serves now (empty when there is no Prometheus reader)."""
    state = _state
    if state is None or state.prom_reader is None:
        return ""
    return render_prometheus(state.prom_reader.get_metrics_data(), state.resource_attrs)


def _serve_metrics(host: str, port: int, reader: InMemoryMetricReader,
                   resource_attrs: Mapping[str, str]) -> ThreadingHTTPServer | None:
    """/metrics on its own thread: a scrape never waits for the event loop, nor it for a scrape."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            try:
                body = render_prometheus(reader.get_metrics_data(), resource_attrs).encode()
            except Exception:  # noqa: BLE001 - a scrape must not kill the server thread
                log.exception("metrics collection failed")
                self.send_error(500)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
            pass

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        log.warning("metrics not served on %s:%d: %s", host, port, exc)
        return None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="gpufleet-metrics", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server
