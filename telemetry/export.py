"""Where spans and metrics go: `configure()` once per process, `Telemetry.shutdown()` at exit.

    tel = configure(role="worker", worker_id="w0", trace_path="spans.jsonl")
    ...
    tel.shutdown()   # flushes what is buffered

- `trace_path`: spans as JSON lines, one object per span: `trace_id`, `span_id`, `parent`
  (the parent's span id or null), `name`, `kind`, `start`, `end` (unix seconds), `status`,
  `attributes`, `events`, `resource` (with the process's `process.pid` and `rlfabric.role`).
  Several processes may append to one file: each batch is one `write` on an O_APPEND file.
- `metrics_path`: the OTel metrics SDK's own JSON (`MetricsData.to_json`), one line per export
  (every `metrics_interval` seconds and at shutdown).
- `prometheus_port`: Prometheus' text format on `http://<prometheus_host>:<port>/metrics`
  (OpenTelemetry's Prometheus reader; names after Prometheus' conventions:
  `rlfabric_rollout_tokens_total`, `rlfabric_control_command_duration_seconds`, ...); where none
  is given, `RLFABRIC_METRICS_PORT` (a process started with it, every worker a bench starts
  with `--metrics`). `prometheus` alone: the reader, for a server that serves
  `prometheus_text()` itself (the gateway's and the dashboard's `/metrics`).
- OTLP, when an `OTEL_EXPORTER_OTLP_*ENDPOINT` is set or `OTEL_TRACES_EXPORTER` /
  `OTEL_METRICS_EXPORTER` names `otlp`, and the `opentelemetry-exporter-otlp` package is
  installed (a warning says so when it is not).
Neither: nothing is configured and every span helper stays a no-op.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any, cast

import msgspec
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from rlfabric.telemetry import instruments
from rlfabric.telemetry.spans import set_tracer
from rlfabric.telemetry.tally import SpreadCollector

log = logging.getLogger("rlfabric.telemetry")
#: where no port is given, serve Prometheus metrics on this one (0: any free port)
METRICS_PORT_ENV = "RLFABRIC_METRICS_PORT"
_json = msgspec.json.Encoder()
#: whether prometheus_client's registry reads the `Spread` histograms (once per process)
_spreads_served = False


class AppendFile:
    """A file several processes append whole lines to: each `write` is one `write(2)` on an
    O_APPEND descriptor, so lines of different processes never interleave."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, text: str | bytes) -> int:
        data = text.encode() if isinstance(text, str) else text
        if self._fd >= 0:
            os.write(self._fd, data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class JsonLinesSpanExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self._out = AppendFile(path)
        self._resources: dict[int, tuple[Resource, bytes]] = {}  # encoded once per process

    def _resource(self, r: Resource) -> bytes:
        hit = self._resources.get(id(r))
        if hit is None or hit[0] is not r:
            hit = self._resources[id(r)] = (r, _json.encode(dict(r.attributes)))
        return hit[1]

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        # NOTE: msgspec, and the resource encoded once: json.dumps of each span cost more
        # than making the span
        lines = [_json.encode(_fields(s))[:-1] + b',"resource":' + self._resource(s.resource)
                 + b"}\n" for s in spans]
        try:
            self._out.write(b"".join(lines))
        except OSError as exc:
            log.warning("spans not written to %s: %s", self._out.path, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._out.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_record(s: ReadableSpan) -> dict[str, Any]:
    """One line of the spans file, as a dict."""
    return {**_fields(s), "resource": dict(s.resource.attributes)}


def _fields(s: ReadableSpan) -> dict[str, Any]:
    ctx = s.get_span_context()
    assert ctx is not None
    return {
        "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent": f"{s.parent.span_id:016x}" if s.parent is not None else None,
        "name": s.name, "kind": s.kind.name,
        "start": (s.start_time or 0) / 1e9, "end": (s.end_time or 0) / 1e9,
        "status": s.status.status_code.name,
        "attributes": dict(s.attributes or {}),
        "events": [{"name": e.name, "time": e.timestamp / 1e9,
                    "attributes": dict(e.attributes or {})} for e in s.events],
    }


def _otlp_wanted(kind: str) -> bool:
    env = os.environ
    if "otlp" in env.get(f"OTEL_{kind.upper()}_EXPORTER", "").lower():
        return True
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or env.get(f"OTEL_EXPORTER_OTLP_{kind.upper()}_ENDPOINT"))


def _otlp(kind: str) -> Any | None:
    """The OTLP exporter for `kind` ("traces" or "metrics"), configured by `OTEL_*`."""
    if not _otlp_wanted(kind):
        return None
    try:
        if kind == "traces":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
            return OTLPSpanExporter()
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
            OTLPMetricExporter,
        )
        return OTLPMetricExporter()
    except ImportError:
        log.warning("OTEL_* asks for OTLP %s export, but opentelemetry-exporter-otlp is not "
                    "installed (pip install opentelemetry-exporter-otlp-proto-http); not "
                    "exported", kind)
        return None


def _prometheus(tel: Telemetry, port: int | None, host: str, *,
                inherited: bool = False) -> MetricReader:
    """OpenTelemetry's Prometheus reader (it registers with prometheus_client's registry), and
    prometheus_client's HTTP server on `port` (0: any free one; `tel.prometheus_port` says
    which) where one is asked for. `inherited`: the port came from the environment, which a
    process passes on to those it starts: taken already, a free one serves instead."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import REGISTRY, start_http_server

    global _spreads_served
    if port is not None:  # first: a port that fails leaves no reader registered
        try:
            server, _ = start_http_server(port, addr=host)
        except OSError as exc:
            if not inherited or not port:
                raise
            log.warning("%s=%d: %s (a process that started this one may serve there); "
                        "Prometheus metrics on a free port instead", METRICS_PORT_ENV, port, exc)
            server, _ = start_http_server(0, addr=host)
        tel.prometheus_port = server.server_address[1]
        tel._servers.append(server)
    if not _spreads_served:  # whichever `Instruments` are current when scraped
        REGISTRY.register(SpreadCollector(lambda: instruments.current.spreads))
        _spreads_served = True
    return PrometheusMetricReader()


def _port_of_env() -> int:
    value = os.environ[METRICS_PORT_ENV]
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"{METRICS_PORT_ENV}={value!r}: not a port; give 0..65535 (0: a free "
                         "one) or unset it")
    return port


def prometheus_text() -> tuple[bytes, str]:
    """This process's metrics in Prometheus' text format, and its content type."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


@dataclass
class Telemetry:
    """What `configure` set up in this process."""

    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    files: list[str] = field(default_factory=list)
    #: where Prometheus scrapes this process (None: nowhere)
    prometheus_port: int | None = None
    _open: list[AppendFile] = field(default_factory=list)
    _servers: list[Any] = field(default_factory=list)

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    def shutdown(self) -> None:
        """Flush and stop; rlfabric's spans and metrics are off again afterwards."""
        if self.tracer_provider is not None:
            set_tracer(None)
            self.tracer_provider.shutdown()
            self.tracer_provider = None
        if self.meter_provider is not None:
            instruments.use(None)
            self.meter_provider.shutdown()  # the last export, then the file is closed
            self.meter_provider = None
        for f in self._open:
            f.close()
        self._open.clear()
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers.clear()


def configure(*, role: str, worker_id: str = "", trace_path: str | None = None,
              metrics_path: str | None = None, metrics_interval: float = 5.0,
              prometheus: bool = False, prometheus_port: int | None = None,
              prometheus_host: str = "0.0.0.0") -> Telemetry:
    """Set up this process's spans and metrics (see the module doc); a no-op with neither a
    path nor OTLP asked for."""
    attrs: dict[str, Any] = {"service.name": "rlfabric", "process.pid": os.getpid(),
                             "rlfabric.role": role}
    if worker_id:
        attrs["rlfabric.worker.id"] = worker_id
    resource = Resource.create(attrs)  # OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME merge in
    tel = Telemetry()
    span_exporters: list[SpanExporter] = []
    if trace_path:
        span_exporters.append(JsonLinesSpanExporter(trace_path))
        tel.files.append(trace_path)
    if (otlp := _otlp("traces")) is not None:
        span_exporters.append(otlp)
    if span_exporters:
        tp = TracerProvider(resource=resource)
        for exp in span_exporters:
            tp.add_span_processor(BatchSpanProcessor(exp, schedule_delay_millis=500))
        tel.tracer_provider = tp
        set_tracer(tp.get_tracer("rlfabric"))
    readers: list[MetricReader] = []
    every = int(metrics_interval * 1000)
    if metrics_path:
        out = AppendFile(metrics_path)  # closed by shutdown()
        tel._open.append(out)
        readers.append(PeriodicExportingMetricReader(
            # the exporter only calls write() and flush()
            ConsoleMetricExporter(out=cast(IO[str], out),
                                  formatter=lambda m: m.to_json(indent=None) + "\n"),
            export_interval_millis=every))
        tel.files.append(metrics_path)
    if (otlp_m := _otlp("metrics")) is not None:
        readers.append(PeriodicExportingMetricReader(otlp_m, export_interval_millis=every))
    inherited = prometheus_port is None and bool(os.environ.get(METRICS_PORT_ENV))
    if inherited:
        prometheus_port = _port_of_env()
    if prometheus or prometheus_port is not None:
        readers.append(_prometheus(tel, prometheus_port, prometheus_host, inherited=inherited))
    if readers:
        mp = MeterProvider(resource=resource, metric_readers=readers)
        tel.meter_provider = mp
        instruments.use(mp.get_meter("rlfabric"))
    return tel
