"""Metrics kept in this process and read when a reader collects them: recording one is a dict
update, where a synchronous OTel SDK instrument costs microseconds a call, and the hot paths
(a result, a token span) record at rates where that is a share of the work.

- `Sum`: a counter, reported through an OTel observable counter;
- `Last`: a gauge (the last value per attribute set), through an OTel observable gauge;
- `Spread`: a histogram with weights (a sample's tokens at once), read by Prometheus only
  (`SpreadCollector`): OTel's API has no histogram to hand aggregated counts to.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

Attributes = Mapping[str, Any]
_Key = frozenset[tuple[str, Any]]
_NONE: _Key = frozenset()


def _key(attributes: Attributes | None) -> _Key:
    return frozenset(attributes.items()) if attributes else _NONE


class Sum:
    """A monotonic counter summed per attribute set."""

    def __init__(self, meter: metrics.Meter, name: str, unit: str, description: str) -> None:
        self._sums: dict[_Key, float] = {}
        self._lock = threading.Lock()
        meter.create_observable_counter(name, [self._observe], unit=unit,
                                        description=description)

    def add(self, amount: float, attributes: Attributes | None = None) -> None:
        key = _key(attributes)
        with self._lock:
            self._sums[key] = self._sums.get(key, 0) + amount

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            items = list(self._sums.items())
        return [Observation(v, dict(k)) for k, v in items]


class Last:
    """A gauge: the last value set per attribute set."""

    def __init__(self, meter: metrics.Meter, name: str, unit: str, description: str) -> None:
        self._last: dict[_Key, float] = {}
        meter.create_observable_gauge(name, [self._observe], unit=unit, description=description)

    def set(self, amount: float, attributes: Attributes | None = None) -> None:
        self._last[_key(attributes)] = amount  # one store: atomic under the GIL

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(v, dict(k)) for k, v in list(self._last.items())]


class Spread:
    """A histogram: per attribute set, the weight that fell in each bucket (`bounds` are the
    buckets' upper edges, inclusive, as Prometheus' `le`), the weighted sum and the total
    weight."""

    def __init__(self, name: str, description: str, bounds: Sequence[float]) -> None:
        self.name, self.description = name, description
        self.bounds = tuple(sorted(bounds))
        #: per attribute set: [weight per bucket (the last: above every bound), sum, count]
        self._cells: dict[_Key, list[Any]] = {}
        self._lock = threading.Lock()

    def record(self, value: float, attributes: Attributes | None = None,
               weight: int = 1) -> None:
        key = _key(attributes)
        at = bisect.bisect_left(self.bounds, value)
        with self._lock:
            cell = self._cells.get(key)
            if cell is None:
                cell = self._cells[key] = [[0] * (len(self.bounds) + 1), 0.0, 0]
            cell[0][at] += weight
            cell[1] += value * weight
            cell[2] += weight

    def snapshot(self) -> list[tuple[dict[str, Any], list[int], float, int]]:
        """Per attribute set: its attributes, the weight per bucket, the sum and the count."""
        with self._lock:
            return [(dict(k), list(c[0]), c[1], c[2]) for k, c in self._cells.items()]


class SpreadCollector:
    """prometheus_client's view of the `Spread`s `spreads()` returns at each scrape: one
    histogram family each, its labels the attributes with dots as underscores."""

    def __init__(self, spreads: Callable[[], Iterable[Spread]]) -> None:
        self._spreads = spreads

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        for sp in self._spreads():
            cells = sp.snapshot()
            labels = sorted({k for attrs, *_ in cells for k in attrs})
            family = HistogramMetricFamily(sp.name, sp.description,
                                           labels=[k.replace(".", "_") for k in labels])
            for attrs, weights, total, _count in cells:
                buckets, acc = [], 0
                for bound, w in zip((*map(floatToGoString, sp.bounds), "+Inf"), weights,
                                    strict=True):
                    acc += w
                    buckets.append((bound, acc))
                family.add_metric([str(attrs.get(k, "")) for k in labels], buckets, total)
            yield family

