"""rlfabric's metrics, through the OpenTelemetry metrics API: no-ops until a `MeterProvider`
exists (`configure(metrics_path=...)`, OTLP, or the application's own global one).

- `rlfabric.rollout.results` (counter): results and errors the trainer hands to callers,
  by `outcome` (ok, or the error code);
- `rlfabric.rollout.tokens` (counter): completion tokens, per worker and job (`rlfabric.job`:
  a job's share of the pool is its rate over the sum of all);
- `rlfabric.rollout.queue_depth` (gauge): requests awaiting results on the trainer, in flight
  on a worker;
- `rlfabric.control.ack.duration` (histogram, s): from a command's publish to each worker's
  ack, by op and status;
- `rlfabric.weight.version` (gauge): the version a worker serves, set after every load;
- `rlfabric.errors` (counter): typed errors answered, by `code` (and worker);
- `rlfabric.gateway.segments` (counter): session turns that started a new trajectory segment,
  by `reason` and tenant (the first turn of a session counts too);
- `rlfabric.gateway.turn.duration` (histogram, s): a gateway turn, request to recorded, by
  tenant;
- `rlfabric.gateway.requests` (counter): HTTP requests answered, by route, status and tenant.

Rates (rollouts/s, tokens/s) are the counters' rates, as any backend computes them.
"""

from __future__ import annotations

from opentelemetry import metrics


class Instruments:
    def __init__(self, meter: metrics.Meter) -> None:
        self.results = meter.create_counter(
            "rlfabric.rollout.results", unit="{result}",
            description="results and errors handed to callers")
        self.tokens = meter.create_counter(
            "rlfabric.rollout.tokens", unit="{token}", description="completion tokens generated")
        self.queue_depth = meter.create_gauge(
            "rlfabric.rollout.queue_depth", unit="{request}",
            description="requests awaiting results (trainer) or in flight (worker)")
        self.ack_duration = meter.create_histogram(
            "rlfabric.control.ack.duration", unit="s",
            description="from a command's publish to a worker's ack")
        self.weight_version = meter.create_gauge(
            "rlfabric.weight.version", unit="{version}", description="weight version served")
        self.errors = meter.create_counter(
            "rlfabric.errors", unit="{error}", description="typed errors, by code")
        self.gateway_segments = meter.create_counter(
            "rlfabric.gateway.segments", unit="{segment}",
            description="session turns that start a trajectory segment, by reason")
        self.gateway_turns = meter.create_histogram(
            "rlfabric.gateway.turn.duration", unit="s",
            description="a gateway turn, from request to recorded")
        self.gateway_requests = meter.create_counter(
            "rlfabric.gateway.requests", unit="{request}",
            description="HTTP requests answered by the gateway, by route and status")


#: the instruments in use; `use()` replaces them
current = Instruments(metrics.get_meter("rlfabric"))


def use(meter: metrics.Meter | None) -> None:
    """Record to `meter` from now on (None: the global meter, a no-op unless the application
    set a MeterProvider)."""
    global current
    current = Instruments(meter if meter is not None else metrics.get_meter("rlfabric"))
