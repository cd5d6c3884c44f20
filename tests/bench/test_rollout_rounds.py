"""`rlfabric bench rollout` in rounds: a row is the median of its rounds, a ratio the median of
the per-round ratios; every path keeps serving after idling while the others run."""

from __future__ import annotations

import functools
import math

import anyio
import pytest

from rlfabric.bench.rollout import _Runs, paired, run


def runs(**by_round: float) -> _Runs:
    """`r0=10, r1=30`: round 0 did 10 results/s, round 1 did 30 (fleet size 1)."""
    out = _Runs()
    for key, value in by_round.items():
        out.by_round[(1, int(key[1:]))] = {"results_s": value, "tokens_s": 16 * value,
                                           "latencies": [1 / value]}
    return out


def test_a_ratio_is_the_median_of_the_rounds_ratios_not_the_ratio_of_medians() -> None:
    a, b = runs(r0=10, r1=30, r2=40), runs(r0=5, r1=10, r2=40)
    # rounds: 2, 3 and 1; the ratio of the medians would say 30 / 10 = 3
    assert paired(a, b, "results_s") == 2.0
    assert paired(a, b, "tokens_s") == 2.0


def test_without_a_round_in_common_a_ratio_is_of_the_medians() -> None:
    a, b = runs(r0=10, r1=30), _Runs()
    b.by_round[(0, 0)] = {"results_s": 4.0}  # measured on its own (vLLM's direct path)
    b.by_round[(0, 1)] = {"results_s": 6.0}
    assert paired(a, b, "results_s") == 20 / 5
    assert math.isnan(paired(a, None, "results_s"))
    assert math.isnan(paired(a, _Runs(), "results_s"))


def test_a_row_is_the_median_of_its_rounds_with_percentiles_over_all() -> None:
    r = runs(r0=10, r1=30, r2=20)
    r.by_round[(1, 0)]["latencies"] = [0.001] * 98 + [0.5, 0.5]
    row = r.row()
    assert row["results_s"] == 20 and row["tokens_s"] == 320
    assert row["rounds"] == 3 and row["results_s_rounds"] == [10.0, 30.0, 20.0]
    assert row["p50_ms"] == pytest.approx(1.0)
    assert row["p99_ms"] == pytest.approx(500.0)


def test_cpu_per_request_is_over_every_round_and_nan_for_what_a_path_lacks() -> None:
    r = runs(r0=10, r1=30)
    r.by_round[(1, 0)].update(latencies=[0.1] * 100, cpu=(0.002, 0.004, math.nan))
    r.by_round[(1, 1)].update(latencies=[0.1] * 300, cpu=(0.006, 0.004, math.nan))
    row = r.row()  # 400 requests in all
    assert row["client_cpu_us"] == pytest.approx(20.0)
    assert row["workers_cpu_us"] == pytest.approx(20.0)
    assert math.isnan(row["nats_cpu_us"])  # no nats-server (HTTP)
    assert math.isnan(runs(r0=10).row()["client_cpu_us"])  # not measured (a traced row)


@pytest.mark.nats
@pytest.mark.slow
def test_every_path_serves_every_round_after_idling_between_them() -> None:
    # real fleets: one aiohttp server, one rlfabric worker, one nats-py floor responder, the
    # direct engine; each idles (seconds) while the others run and must not stall after it.
    # Completions of 4 tokens, not the workload's 16 (`--max-tokens`): every path gets them
    rows = anyio.run(functools.partial(run, ["null"], [1], 0.05, rounds=3, completion=4))
    by_path = {r["path"]: r for r in rows}
    assert set(by_path) == {"direct", "http", "rlfabric", "nats-py floor"}
    for r in rows:
        assert r["requests"] == 150 and r["rounds"] == 3, r
        assert len(r["results_s_rounds"]) == 3 and min(r["results_s_rounds"]) > 0, r
        assert r["max_tokens"] == 4 and r["tokens_s"] == pytest.approx(4 * r["results_s"]), r
    assert by_path["http"]["vs_http"] == 1.0 and by_path["direct"]["vs_direct"] == 1.0
    assert by_path["rlfabric"]["vs_http"] > 0 and by_path["rlfabric"]["vs_direct"] > 0
    # CPU: every path's client loop; workers' loops for a fleet; nats-servers for the buses
    assert all(r["client_cpu_us"] > 0 for r in rows), rows
    fleets = ("http", "rlfabric", "nats-py floor")
    assert all(by_path[p]["workers_cpu_us"] >= 0 for p in fleets), rows
    assert all(by_path[p]["nats_cpu_us"] >= 0 for p in ("rlfabric", "nats-py floor")), rows
    assert math.isnan(by_path["direct"]["workers_cpu_us"]), rows
    assert math.isnan(by_path["http"]["nats_cpu_us"]), rows


@pytest.mark.nats
@pytest.mark.slow
def test_a_queue_deeper_than_the_workers_capacity_is_served_by_every_path() -> None:
    # 128 lanes against one worker of capacity 64 holding up to 64 more (`--prefetch`): the
    # worker parks and unparks requests the whole run, and the request count grows with the
    # lanes (3000 * 0.05 * 128 / 64)
    rows = anyio.run(functools.partial(run, ["null"], [1], 0.05, rounds=1, completion=4,
                                       lanes=128, capacity=64, prefetch=64))
    assert {r["path"] for r in rows} == {"direct", "http", "rlfabric", "nats-py floor"}
    for r in rows:
        assert (r["requests"], r["concurrency"]) == (300, 128), r
        assert (r["worker_capacity"], r["prefetch"]) == (64, 64), r
        assert r["results_s"] > 0 and r["tokens_s"] == pytest.approx(4 * r["results_s"]), r


@pytest.mark.nats
@pytest.mark.slow
def test_every_path_samples_the_same_tokens_with_the_torch_engine() -> None:
    # the same workload for each row: each request's seed reaches its engine on every path,
    # so requests end (at EOS or the limit) alike and tokens per request are equal
    rows = anyio.run(functools.partial(run, ["torch"], [1], 0.25, rounds=1))
    per_request = {r["path"]: r["tokens_s"] / r["results_s"] for r in rows}
    assert set(per_request) == {"direct", "http", "rlfabric", "nats-py floor"}
    assert all(r["requests"] == 96 for r in rows), rows
    # some requests end early at EOS: a path whose seeds differed would differ here
    assert per_request["direct"] < 16
    assert all(v == pytest.approx(per_request["direct"], abs=1e-9)
               for v in per_request.values()), per_request
