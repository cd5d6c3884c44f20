"""`rlfabric bench gateway` end to end on the echo engine: every row served, the cost block's
turns done on the same tokens both ways (the bench asserts it), the CPU counted."""

from __future__ import annotations

import argparse
import math

import anyio
import pytest

from rlfabric.bench.gateway import add_arguments, run

pytest.importorskip("starlette", reason="the gateway extra is not installed (README, tests)")


def test_the_gateway_rows_and_its_cost_block_run_on_the_echo_engine() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--engine", "null", "--workers", "1", "--requests", "64",
                         "--concurrency", "8", "--max-tokens", "4", "--sessions", "2",
                         "--turns", "2"])
    out = anyio.run(run, args)
    [row] = out["rows"]
    assert row["path"] == "gateway + 1 worker"
    assert row["requests_s"] > 0 and row["tokens"] == 64 * 4, row
    # the fleet's CPU includes the gateway's (both counted in 10 ms ticks)
    assert row["all_cpu_ms"] >= row["cpu_ms"] >= 0 and row["all_cpu_ms"] > 0, row
    assert math.isnan(row["x_vllm"])  # no vLLM row on this engine
    cost = out["cost"]
    assert cost["turns"] == 4 and cost["gateway_p50_ms"] > 0 and cost["direct_p50_ms"] > 0
    assert cost["prompt_tokens_last"] > 0
    assert cost["text_floor_p50_ms"] > 0 and cost["http_floor_p50_ms"] > 0
