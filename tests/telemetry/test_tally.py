"""Metrics summed in the process (`telemetry.tally`): what a reader collects equals what was
recorded, per attribute set, and a weighted histogram's buckets are Prometheus' (`le`
inclusive, cumulative)."""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest

from rlfabric.telemetry.tally import Last, Spread, SpreadCollector, Sum


def _points(reader: InMemoryMetricReader) -> dict[str, dict[tuple, float]]:
    data = reader.get_metrics_data()
    assert data is not None
    return {m.name: {tuple(sorted(p.attributes.items())): p.value for p in m.data.data_points}
            for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


def test_sums_and_gauges_reach_an_otel_reader_per_attribute_set() -> None:
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    results, depth = Sum(meter, "r", "1", "r"), Last(meter, "q", "1", "q")
    for _ in range(3):
        results.add(2, {"outcome": "ok", "rlfabric.job": "a"})
    results.add(1, {"rlfabric.job": "a", "outcome": "ok"})  # same set, other order
    results.add(5, {"outcome": "timeout"})
    depth.set(7, {"w": "0"})
    depth.set(4, {"w": "0"})
    got = _points(reader)
    assert got["r"] == {(("outcome", "ok"), ("rlfabric.job", "a")): 7,
                        (("outcome", "timeout"),): 5}
    assert got["q"] == {(("w", "0"),): 4}
    results.add(1, {"outcome": "timeout"})
    assert _points(reader)["r"][(("outcome", "timeout"),)] == 6  # cumulative


def test_a_weighted_spread_is_a_prometheus_histogram() -> None:
    sp = Spread("rlfabric_test_versions", "versions behind", bounds=(0, 1, 4))
    sp.record(0, {"rlfabric.job": "a"}, weight=10)
    sp.record(1, {"rlfabric.job": "a"}, weight=3)  # on a bound: in that bucket
    sp.record(2, {"rlfabric.job": "a"}, weight=2)
    sp.record(9, {"rlfabric.job": "a"})
    registry = CollectorRegistry()
    registry.register(SpreadCollector(lambda: [sp]))
    text = generate_latest(registry).decode()
    lines = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1])
             for ln in text.splitlines() if ln and not ln.startswith("#")}
    job = 'rlfabric_job="a"'
    assert lines[f'rlfabric_test_versions_bucket{{le="0.0",{job}}}'] == 10
    assert lines[f'rlfabric_test_versions_bucket{{le="1.0",{job}}}'] == 13
    assert lines[f'rlfabric_test_versions_bucket{{le="4.0",{job}}}'] == 15
    assert lines[f'rlfabric_test_versions_bucket{{le="+Inf",{job}}}'] == 16
    assert lines[f"rlfabric_test_versions_count{{{job}}}"] == 16
    assert lines[f"rlfabric_test_versions_sum{{{job}}}"] == 0 * 10 + 1 * 3 + 2 * 2 + 9
