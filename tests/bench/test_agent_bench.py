"""`rlfabric bench agent` runs its two rows on the torch engine (a few short sessions): every
turn answered, and with affinity every later turn on its session's worker."""

from __future__ import annotations

import argparse

import anyio
import pytest

from rlfabric.bench.agent import add_arguments, run

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(300)]


def test_agent_bench_rows_on_the_torch_engine() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--engine", "torch", "--sessions", "3", "--turns", "3",
                         "--system-tokens", "16", "--first-tokens", "32", "--user-tokens", "8",
                         "--max-tokens", "2"])
    out = anyio.run(run, args)
    on, off = out["rows"]
    assert (on["affinity"], off["affinity"]) == ("on", "off")
    assert on["turns"] == off["turns"] == 9
    assert on["same_worker"] == 1.0, on["routed"]
    assert on["longest_prompt"] == 16 + 32 + 3 * (2 + 8)
