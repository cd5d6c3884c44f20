"""OTLP export, as a collector sees it: with `OTEL_EXPORTER_OTLP_ENDPOINT` set, `configure`
sends spans and metrics over OTLP/HTTP (protobuf) to a local HTTP server standing in for the
collector."""

from __future__ import annotations

import http.server
import importlib.util
import threading
from collections.abc import Iterator

import pytest

from rlfabric.telemetry import configure, instruments, spans

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("opentelemetry.exporter") is None
    or importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is None,
    reason="opentelemetry-exporter-otlp-proto-http is not installed (the dev extras have it)")


@pytest.fixture
def collector() -> Iterator[tuple[str, list[tuple[str, str, bytes]]]]:
    got: list[tuple[str, str, bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append((self.path, self.headers["Content-Type"], body))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", got
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=10)


def test_spans_and_metrics_reach_an_otlp_collector(collector, monkeypatch) -> None:
    url, got = collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
    tel = configure(role="trainer")  # no files: OTLP only
    assert tel.tracing and tel.meter_provider is not None and tel.files == []
    with spans.span("otlp-probe-span", attributes={spans.WORKER_ID: "w-otlp"}):
        instruments.current.errors.add(1, {"code": "otlp_probe_code"})
    tel.shutdown()  # flushes both
    paths = {p for p, _, _ in got}
    assert paths == {"/v1/traces", "/v1/metrics"}, paths
    assert all(ct == "application/x-protobuf" for _, ct, _ in got)
    traces = b"".join(b for p, _, b in got if p == "/v1/traces")
    assert b"otlp-probe-span" in traces and b"w-otlp" in traces and b"rlfabric" in traces
    metrics = b"".join(b for p, _, b in got if p == "/v1/metrics")
    assert b"rlfabric.errors" in metrics and b"otlp_probe_code" in metrics
    assert not spans.enabled()  # off again after shutdown
