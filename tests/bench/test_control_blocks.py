"""`rlfabric bench control` in interleaved blocks: every path's calls split evenly, the order
rotating from block to block, the other fleets' idle workers stopped meanwhile, a ratio the
median of the per-block ratios."""

from __future__ import annotations

import itertools
import subprocess
import sys

import anyio
import pytest

from rlfabric.bench import control
from rlfabric.bench.control import (
    SETTLE_CALLS,
    _Path,
    _proc_state,
    block_sizes,
    interleave,
    rotations,
    run,
)


def test_calls_split_into_blocks_as_equal_as_can_be() -> None:
    assert block_sizes(100, 10) == [10] * 10
    assert block_sizes(25, 10) == [3, 3, 3, 3, 3, 2, 2, 2, 2, 2]
    assert block_sizes(3, 10) == [1, 1, 1]  # fewer calls than blocks: no empty block
    assert sum(block_sizes(12, 5)) == 12


def test_the_order_rotates_so_no_path_always_runs_first() -> None:
    orders = rotations(["a", "b", "c"], 4)
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert {o[0] for o in orders} == {"a", "b", "c"}


def test_blocks_interleave_and_a_ratio_is_the_median_of_the_blocks() -> None:
    log: list[tuple[str, int]] = []
    slow = {"a": [1.0, 1.0, 9.0], "b": [2.0, 2.0, 2.0]}  # a's third block ran on a slow host

    def path(name: str, calls: int) -> _Path:
        async def call(i: int) -> None:
            log.append((name, i))

        return _Path(name, calls, call, [], [])

    a, b = path("a", 6), path("b", 3)
    anyio.run(interleave, [a, b], 3)
    after = [n for n, i in log if i >= 10]  # after the 10 warm-up calls of each
    runs = [(n, len(list(g))) for n, g in itertools.groupby(after)]
    # a's 6 calls in 3 blocks of 2, b's 3 in blocks of 1, each block after SETTLE_CALLS
    # unmeasured ones; a first, then b first, then a first
    s = SETTLE_CALLS
    assert runs == [("a", s + 2), ("b", 2 * (s + 1)), ("a", 2 * (s + 2)), ("b", s + 1)]
    # pause/resume alternation goes on across blocks: each path numbers its calls in turn
    assert [i for n, i in log if n == "a"] == list(range(10 + 3 * (s + 2)))
    assert len(a.lat) == 6 and len(a.block_p50) == 3 and len(b.block_p50) == 3
    a.block_p50, b.block_p50 = slow["a"], slow["b"]
    # per block: 2/1, 2/1, 2/9; the median is 2 (the ratio of the pooled p50s would not be)
    assert b.row(a, b)["x_vs_fabric"] == 2.0 and b.row(a, b)["x_floor"] == 1.0
    assert a.row(a, b)["x_vs_fabric"] == 1.0 and a.row(a, b)["blocks"] == 3
    assert a.row(a, b)["x_floor"] == 0.5  # a against b as the floor: the inverse per block


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_fleets_idle_processes_are_stopped_while_another_path_runs() -> None:
    # busy processes: one that is running when SIGSTOP is sent stops only once the kernel
    # next switches it, so a block that did not wait for the stop would see it still running
    # (without that wait this test failed in every run here)
    fleet = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        seen: dict[str, set[str]] = {"a": set(), "b": set()}

        def path(name: str, quiet: list[int]) -> _Path:
            async def call(i: int) -> None:
                if i >= 10:  # calls in blocks (the 10 warm-up calls run before any)
                    seen[name].update(_proc_state(p.pid) for p in fleet)

            return _Path(name, 4, call, [], [], quiet=quiet)

        anyio.run(interleave, [path("a", [p.pid for p in fleet]), path("b", [])], 2)
        assert seen["b"] == {"T"}  # a's fleet stopped while b ran
        assert "T" not in seen["a"]  # and going while a ran
        assert all(_proc_state(p.pid) != "T" for p in fleet)  # going again after the last block
    finally:
        for p in fleet:
            p.kill()
            p.wait(timeout=10)


@pytest.mark.nats
@pytest.mark.slow
def test_every_path_answers_in_every_block_with_every_fleet_up(monkeypatch) -> None:
    # real fleets: 2 simulated rlfabric workers, 2 floor responders, 2 aiohttp servers
    monkeypatch.setattr(control, "IDLE_SETTLE_S", 0.0)
    rows = anyio.run(run, [2], 20, 2, 0, 4)
    by_path = {r["path"]: r for r in rows}
    assert set(by_path) == {"rlfabric", "nats-py floor", "nats-py floor, same work", "aiohttp",
                            "httpx"}
    for r in rows:
        assert r["responders"] == 2 and r["blocks"] == 4, r
        assert r["rounds"] == 20, r
        assert 0 < r["p50_ms"] <= r["p99_ms"], r
        assert r["cpu_us"] > 0, r
    assert by_path["rlfabric"]["x_vs_fabric"] == 1.0 == by_path["nats-py floor"]["x_floor"]
    assert by_path["rlfabric"]["x_floor"] == pytest.approx(
        1 / by_path["nats-py floor"]["x_vs_fabric"], rel=0.5)  # medians of per-block ratios
    assert "idle_server_pct" in by_path["rlfabric"]
    assert "idle_server_pct" not in by_path["aiohttp"]


def test_a_baseline_that_fails_marks_its_row_failed_and_the_others_go_on() -> None:
    calls = {"rlfabric": 0, "httpx": 0}

    def path(name: str, fail_at: int | None = None) -> _Path:
        async def call(i: int) -> None:
            calls[name] += 1
            if fail_at is not None and i >= fail_at:
                raise ConnectionResetError("peer closed the connection")

        return _Path(name, 6, call, [], [], may_fail=fail_at is not None and name == "httpx")

    fabric, httpx = path("rlfabric"), path("httpx", fail_at=12)
    anyio.run(interleave, [fabric, httpx], 3)
    assert len(fabric.lat) == 6  # every block of the others ran
    assert httpx.failed == "ConnectionResetError: peer closed the connection"
    row = httpx.row(fabric, fabric)
    assert row["path"].startswith("httpx (failed: ConnectionResetError")
    assert calls["httpx"] == 13  # no call after the one that failed
    with pytest.raises(ConnectionResetError):  # a path that may not fail still raises
        anyio.run(interleave, [path("rlfabric", fail_at=0)], 1)
