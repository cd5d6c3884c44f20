"""rlfabric's metrics, through the OpenTelemetry metrics API: no-ops until a `MeterProvider`
exists (`configure(metrics_path=...)`, OTLP, or the application's own global one). Counters
and gauges are summed in the process and read at collection (`tally`); histograms of rare
events (a command, a push) go through the SDK.

- `rlfabric.rollout.results` (counter): results and errors the trainer hands to callers,
  by `outcome` (ok, or the error code);
- `rlfabric.rollout.tokens` (counter): completion tokens, per worker and job (`rlfabric.job`:
  a job's share of the pool is its rate over the sum of all);
- `rlfabric.rollout.queue_depth` (gauge): requests awaiting results on the trainer, in flight
  on a worker;
- `rlfabric.control.command.duration` (histogram, s): from a command's publish to the end of
  the wait for its acks, by op and `outcome` (ok, failed, missing);
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
- `rlfabric_rollout_staleness_versions` (histogram, Prometheus only): the completion tokens a
  trainer takes, by how many versions each is behind the version of its policy (the base
  weights, or the request's adapter) the trainer pushed last;
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

from rlfabric.telemetry.tally import Last, Spread, Sum

#: histogram buckets: 1 MiB to 64 GiB by 4x; 10 ms to 10 min
_BYTES = tuple(float(4 ** k * 2 ** 20) for k in range(9))
_SECONDS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 600.0)
#: 1 ms to 60 s
_COMMAND_SECONDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
                    30.0, 60.0)


class Instruments:
    def __init__(self, meter: metrics.Meter) -> None:
        self.results = Sum(meter, "rlfabric.rollout.results", "{result}",
                           "results and errors handed to callers")
        self.tokens = Sum(meter, "rlfabric.rollout.tokens", "{token}",
                          "completion tokens generated")
        self.queue_depth = Last(meter, "rlfabric.rollout.queue_depth", "{request}",
                                "requests awaiting results (trainer) or in flight (worker)")
        self.command_duration = meter.create_histogram(
            "rlfabric.control.command.duration", unit="s",
            description="a command, from its publish to the end of the wait for its acks",
            explicit_bucket_boundaries_advisory=_COMMAND_SECONDS)
        self.weight_version = Last(meter, "rlfabric.weight.version", "{version}",
                                   "weight version served")
        self.worker_state = Last(meter, "rlfabric.worker.state", "",
                                 "1 for the worker's state, else 0")
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
        self.fleet_workers = Last(meter, "rlfabric.fleet.workers", "{worker}",
                                  "members, by state")
        self.job_share = Last(meter, "rlfabric.job.share", "1",
                              "a job's share of the tokens served in the last minute")
        self.staleness = Spread(
            "rlfabric_rollout_staleness_versions",
            "completion tokens a trainer took, by how many versions each is behind the "
            "version it pushed last", bounds=(0, 1, 2, 3, 4, 8, 16))
        self.errors = Sum(meter, "rlfabric.errors", "{error}", "typed errors, by code")
        self.gateway_segments = Sum(
            meter, "rlfabric.gateway.segments", "{segment}",
            "session turns that start a trajectory segment, by reason")
        self.gateway_turns = meter.create_histogram(
            "rlfabric.gateway.turn.duration", unit="s",
            description="a gateway turn, from request to recorded")
        self.gateway_requests = Sum(
            meter, "rlfabric.gateway.requests", "{request}",
            "HTTP requests answered by the gateway, by route and status")
        #: read by Prometheus' scrape (`tally.SpreadCollector`)
        self.spreads = (self.staleness,)


#: the instruments in use; `use()` replaces them
current = Instruments(metrics.get_meter("rlfabric"))


def use(meter: metrics.Meter | None) -> None:
    """Record to `meter` from now on (None: the global meter, a no-op unless the application
    set a MeterProvider)."""
    global current
    current = Instruments(meter if meter is not None else metrics.get_meter("rlfabric"))
