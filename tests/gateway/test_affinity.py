"""Session affinity through the gateway, driven by the official openai client: the turns of a
session land on the worker that served its first turn, whichever of two gateway processes
serves each turn; the bound worker SIGKILLed, the next turn goes to the other at once and the
session's tokens stay exact."""

from __future__ import annotations

import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.nats, pytest.mark.slow]
MODEL = "tinyqwen"


def _turn(c: Any, sid: str, messages: list[dict[str, Any]]) -> Any:
    return c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                     extra_headers={"X-Session-ID": sid})


def _session(clients: list[Any], sid: str, turns: int, extra: Any) -> list[str]:
    """`turns` turns of one session, turn t through gateway t % 2; each turn's worker."""
    messages: list[dict[str, Any]] = []
    served = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"step {t} of {sid}"})
        r = _turn(clients[t % len(clients)], sid, messages)
        served.append(extra(r.choices[0], "worker_id"))
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
    return served


def test_turns_stick_to_their_worker_across_two_gateways(new_fleet, client, extra):
    f = new_fleet()
    f.workers(["a0", "a1"])
    clients = [client(f.gateway()), client(f.gateway())]
    with ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda i: _session(clients, f"s{i}", 5, extra), range(8)))
    later = [w == run[0] for run in runs for w in run[1:]]
    share = sum(later) / len(later)
    print(f"\naffinity: {sum(later)}/{len(later)} later turns on their session's worker; "
          f"first turns: {dict(Counter(run[0] for run in runs))}")
    assert share >= 0.95
    assert {run[0] for run in runs} == {"a0", "a1"}  # new sessions spread by load


def test_the_bound_worker_killed_the_next_turn_goes_to_the_other_tokens_exact(
        new_fleet, client, extra):
    f = new_fleet()
    procs = dict(zip(["k0", "k1"], f.workers(["k0", "k1"]), strict=True))
    base = f.gateway()
    c = client(base)
    messages = [{"role": "user", "content": "first"}]
    first = _turn(c, "kill", messages)
    bound = extra(first.choices[0], "worker_id")
    procs[bound].send_signal(signal.SIGKILL)
    procs[bound].wait(timeout=10)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "second"}]
    t0 = time.monotonic()
    second = _turn(c, "kill", messages)
    took = time.monotonic() - t0
    traj = httpx.get(f"{base}/sessions/kill/trajectory", timeout=30).json()
    print(f"\nbound worker killed: the next turn served by the other in {took:.2f} s")
    other = ({"k0", "k1"} - {bound}).pop()
    assert extra(second.choices[0], "worker_id") == other and took < 15.0  # the ack-wait
    head = extra(first, "prompt_token_ids") + extra(first.choices[0], "token_ids")
    assert extra(second, "prompt_token_ids")[:len(head)] == head  # exact tokens, extended
    assert len(traj["segments"]) == 1 and traj["turns"] == 2
