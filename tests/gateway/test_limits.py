"""The gateway over its session bound: a new session is refused with 503 `session_limit`,
naming the bound, while the sessions in turns are served; once a turn ends the next session
is taken, no restart. Idle sessions make room on their own (read back when they come again)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import httpx
import pytest

from rlfabric.trainer import FabricClient

pytestmark = [pytest.mark.nats, pytest.mark.slow]
MODEL = "tinyqwen"


def _turn(c: Any, sid: str, text: str = "hi", **kw: Any) -> Any:
    return c.chat.completions.create(model=MODEL, max_tokens=4,
                                     messages=[{"role": "user", "content": text}],
                                     extra_headers={"X-Session-ID": sid}, **kw)


def _control(nats: str, prefix: str, op: str) -> None:
    async def go() -> None:
        async with FabricClient.connect(nats, prefix=prefix) as fabric:
            await (fabric.pause() if op == "pause" else fabric.resume())
    anyio.run(go)


def _wait_in_turns(base: str, n: int, timeout: float = 30.0) -> None:
    """Until the gateway has `n` sessions in turns (its /health says)."""
    deadline = time.monotonic() + timeout
    # a gateway's load has no event to wait on from outside: its /health is read until then
    while httpx.get(base.removesuffix("/v1") + "/health", timeout=5).json()[
            "sessions_in_turns"] != n:
        assert time.monotonic() < deadline, f"not {n} sessions in turns within {timeout}s"
        time.sleep(0.05)


def test_a_new_session_past_the_bound_gets_503_and_the_next_one_fits(new_fleet, client):
    f = new_fleet()
    f.workers(["w0"])
    base = f.gateway("--max-cached-sessions", "2")
    c = client(base)
    assert _turn(c, "idle").usage.completion_tokens == 4  # idle: dropped to make room
    _control(f.nats, f.prefix, "pause")
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(_turn, c, sid) for sid in ("s1", "s2")]
        _wait_in_turns(base, 2)
        t0 = time.monotonic()
        with pytest.raises(Exception) as refused:
            _turn(c, "s3")
        refused_s = time.monotonic() - t0
        _control(f.nats, f.prefix, "resume")
        done = [h.result(timeout=60) for h in held]
    after = _turn(c, "s3")
    again = _turn(c, "idle", "hi again")  # read back from the bus
    err = refused.value
    print(f"\nsession bound: 503 in {refused_s:.3f} s")
    assert getattr(err, "status_code", None) == 503 and refused_s < 5.0
    assert err.body["code"] == "session_limit" and "--max-cached-sessions 2" in err.body["message"]
    assert [d.usage.completion_tokens for d in done] == [4, 4]
    assert after.usage.completion_tokens == 4 and again.usage.completion_tokens == 4
