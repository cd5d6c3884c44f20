"""Traces and metrics: spans across processes with the trace context in NATS headers, metrics
through the OTel SDK. Off by default (no-op helpers); `configure()` turns them on."""

from rlfabric.telemetry import instruments
from rlfabric.telemetry.export import (
    JsonLinesSpanExporter,
    Telemetry,
    configure,
    prometheus_text,
    span_record,
)
from rlfabric.telemetry.spans import (
    carrier,
    consumer_span,
    enabled,
    parent_of,
    producer_span,
    span,
    start,
    within,
)

__all__ = [
    "JsonLinesSpanExporter",
    "Telemetry",
    "carrier",
    "configure",
    "consumer_span",
    "enabled",
    "instruments",
    "parent_of",
    "producer_span",
    "prometheus_text",
    "span",
    "span_record",
    "start",
    "within",
]
