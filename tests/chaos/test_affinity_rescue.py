"""A streamed turn of a session taken by its bound worker, which is SIGKILLed while it samples:
as the worker goes quiet the client finds it gone (`QuietWorkers`), the turn goes on on the
other worker from the tokens already streamed, its stream has no token twice or missing, and
the session's next turn goes to that worker."""

from __future__ import annotations

import signal
import time

import msgspec
import pytest
from helpers import generate_moving, req, streamed_as_answered

from rlfabric.schemas import RolloutResult

pytestmark = [pytest.mark.nats, pytest.mark.anyio, pytest.mark.timeout(180)]


async def test_a_taken_turn_goes_on_elsewhere_when_its_worker_is_killed_mid_sample(
        workers, client) -> None:
    procs = dict(zip(["r0", "r1"], workers(["r0", "r1"], "--model", "tinyqwen",
                                                       "--threads", "1"), strict=True))
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=60)
        first = [r async for r in fabric.generate([req("t1", max_tokens=4)], session="s")]
        bound = first[0].worker_id
        turn = msgspec.structs.replace(req("t2", max_tokens=300, temperature=0.0), stream=True)
        left_s = 0.0

        async def kill() -> None:
            nonlocal left_s
            assert fabric.affinity.taken["t2"] == bound  # offered to it, and taken
            procs[bound].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            await fabric.watcher.wait_until(lambda s: bound not in s.worker_ids, timeout=30)
            left_s = time.monotonic() - killed

        seen, replies = await generate_moving(
            fabric, [turn], lambda s: sum(len(d.token_ids) for d in s["t2"]) >= 64, kill,
            session="s", timeout=60)
        third = [r async for r in fabric.generate([req("t3", max_tokens=4)], session="s")]
        counts, dropped = dict(fabric.affinity.counts), fabric.duplicates_dropped
    other = ({"r0", "r1"} - {bound}).pop()
    print(f"\nworker killed mid-turn: seen gone {left_s:.2f} s later; {counts}")
    (res,) = replies["t2"]
    assert isinstance(res, RolloutResult), res
    spans = [(s.worker, s.start) for s in res.version_spans]
    assert [w for w, _ in spans] == [bound, other] and spans[1][1] >= 64, spans  # kept, not again
    assert streamed_as_answered(res, seen["t2"]) == list(range(len(res.completion_token_ids)))
    # gone once it went quiet, well before membership's own 5 s (member_ttl)
    assert left_s < 2.0 and counts["rescued"] == 1 and dropped == 0
    assert [r.worker_id for r in third] == [other]
