"""A broker killed mid-session and started again (same port, same store): a turn sent while it
is down is served once it is back, and the session stays exact and one segment."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from rlfabric.bus import EmbeddedNats

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "tinyqwen"


def test_a_turn_sent_while_the_broker_is_down_is_served_and_stays_exact(new_fleet, client,
                                                                       extra, tmp_path):
    srv = EmbeddedNats(store_dir=str(tmp_path / "store")).start()
    try:
        fleet = new_fleet(srv.url)
        fleet.workers(["k0"])
        base = fleet.gateway()
        c = client(base)
        sid = "through-a-restart"
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "before"}]

        def turn(seed: int) -> Any:
            return c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                             seed=seed, extra_headers={"X-Session-ID": sid})

        turns = [turn(0)]
        with ThreadPoolExecutor(1) as pool:
            srv.kill()
            msgs = [*msgs, turns[-1].choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "during"}]
            pending = pool.submit(turn, 1)  # the gateway holds it until the bus is back
            time.sleep(1.0)  # the outage (the turn reaches the gateway meanwhile)
            srv.start()
            turns.append(pending.result(timeout=120))
        msgs = [*msgs, turns[-1].choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "after"}]
        turns.append(turn(2))
        for before, after in itertools.pairwise(turns):
            head = extra(before, "prompt_token_ids") + extra(before.choices[0], "token_ids")
            assert extra(after, "prompt_token_ids")[:len(head)] == head
        got = httpx.get(f"{base}/sessions/{sid}/trajectory", timeout=30).json()
        assert got["turns"] == 3 and [s["reason"] for s in got["segments"]] == ["new_session"]
        seg = got["segments"][0]
        sampled = sum(len(extra(t.choices[0], "token_ids")) for t in turns)
        assert sum(seg["loss_mask"]) == sampled
    finally:
        srv.stop()
