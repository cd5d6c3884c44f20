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
- `rlfabric.worker.state` (gauge): 1 for the state a worker is in (`state`), 0 for the others;
- `rlfabric.weight.update.size` (histogram, bytes) and `rlfabric.weight.update.duration`
  (histogram, s): what a worker fetched for each weight update (a delta's own bytes) and how
  long the update took it, from the command to its ack, by `transport` and `outcome`;
- `rlfabric.weight.push.size` (histogram, bytes) and `rlfabric.weight.push.duration`
  (histogram, s): what a trainer's `update_weights` staged and how long it took, every worker's
  ack included;
- `rlfabric.fleet.workers` (gauge) and `rlfabric.job.share` (gauge, 0..1): the members by
  `state`, and each job's share of the tokens served in the last minute, as the dashboard
  reads them;
- `rlfabric.rollout.staleness` (histogram, versions): for each sample a trainer takes, how many
  versions its oldest token is behind the version the trainer pushed last;
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

#: histogram buckets: 1 MiB to 64 GiB by 4x; 10 ms to 10 min
_BYTES = tuple(float(4 ** k * 2 ** 20) for k in range(9))
_SECONDS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 600.0)


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
        self.worker_state = meter.create_gauge(
            "rlfabric.worker.state", unit="", description="1 for the worker's state, else 0")
        self.update_size = meter.create_histogram(
            "rlfabric.weight.update.size", unit="By", description="bytes a weight update fetched",
            explicit_bucket_boundaries_advisory=_BYTES)
        self.update_duration = meter.create_histogram(
            "rlfabric.weight.update.duration", unit="s",
            description="a worker's weight update, command to ack",
            explicit_bucket_boundaries_advisory=_SECONDS)
        self.push_size = meter.create_histogram(
            "rlfabric.weight.push.size", unit="By", description="bytes a weight push staged",
            explicit_bucket_boundaries_advisory=_BYTES)
        self.push_duration = meter.create_histogram(
            "rlfabric.weight.push.duration", unit="s",
            description="a weight push, staging to every ack",
            explicit_bucket_boundaries_advisory=_SECONDS)
        self.fleet_workers = meter.create_gauge(
            "rlfabric.fleet.workers", unit="{worker}", description="members, by state")
        self.job_share = meter.create_gauge(
            "rlfabric.job.share", unit="1",
            description="a job's share of the tokens served in the last minute")
        self.staleness = meter.create_histogram(
            "rlfabric.rollout.staleness", unit="{version}",
            description="versions a sample's oldest token is behind the trainer's last push",
            explicit_bucket_boundaries_advisory=(0, 1, 2, 3, 4, 8, 16))
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
