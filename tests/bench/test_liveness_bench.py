"""`rlfabric bench liveness`: the server's CPU per liveness operation, read off a real
nats-server, and the arithmetic from it."""

from __future__ import annotations

import anyio
import pytest

from rlfabric.bench.liveness import arithmetic, measure


def test_the_arithmetic_counts_each_kind_at_its_interval() -> None:
    costs = {"beat": {"server_us": 50.0, "bytes": 20.0},
             "key write": {"server_us": 100.0, "bytes": 100.0},
             "command poll": {"server_us": 200.0, "bytes": 0.0}}
    rows = {(r["workers"], r["design"]): r for r in arithmetic(costs, [1000, 10000])}
    now = rows[(1000, "now")]
    # a beat every 5/4 s, a key write every 60/3 s, a poll every 8 s
    assert (now["beats_s"], now["key_writes_s"], now["polls_s"]) == (800, 50, 125)
    assert now["server_pct"] == pytest.approx((800 * 50 + 50 * 100 + 125 * 200) / 1e4)
    assert now["bytes_s"] == 800 * 20 + 50 * 100
    before = rows[(1000, "before")]
    assert (before["beats_s"], before["key_writes_s"], before["polls_s"]) == (0, 800, 1000)
    assert rows[(10000, "now")]["server_pct"] == pytest.approx(10 * now["server_pct"])


@pytest.mark.nats
def test_each_operation_costs_the_server_some_cpu() -> None:
    costs = anyio.run(measure, 2000.0, 1.0)
    assert set(costs) == {"beat", "key write", "command poll"}
    for name, c in costs.items():
        assert 0 < c["server_us"] < 10_000, (name, c)
    assert costs["beat"]["bytes"] < costs["key write"]["bytes"]
