"""A turn of a session taken by its bound worker, which is SIGKILLed while it samples: the
client puts the request in the shared queue as the worker leaves, the other worker answers it
once within the ack-wait, and the session's next turn goes to that worker."""

from __future__ import annotations

import signal
import time

import anyio
import pytest
from helpers import req

from rlfabric.schemas import RolloutResult

pytestmark = [pytest.mark.nats, pytest.mark.anyio, pytest.mark.timeout(180)]


async def test_a_taken_turn_survives_its_worker_killed_mid_sample(workers, client) -> None:
    procs = dict(zip(["r0", "r1"], workers(["r0", "r1"], "--model", "tinyqwen",
                                                       "--threads", "1"), strict=True))
    async with client() as fabric:
        await fabric.wait_for_workers(2, timeout=60)
        first = [r async for r in fabric.generate([req("t1", max_tokens=4)], session="s")]
        bound = first[0].worker_id
        got: list = []

        async def second_turn() -> None:
            got.extend([r async for r in fabric.generate([req("t2", max_tokens=300)],
                                                         session="s", timeout=60)])

        async with anyio.create_task_group() as tg:
            tg.start_soon(second_turn)
            with anyio.fail_after(10):  # the offer is internal: no event says it was taken
                while "t2" not in fabric.affinity.taken:  # noqa: ASYNC110
                    await anyio.sleep(0.005)
            assert fabric.affinity.taken["t2"] == bound
            procs[bound].send_signal(signal.SIGKILL)
            killed = time.monotonic()
        took = time.monotonic() - killed
        # when the other worker began it: what it spent on it is its own generating
        began = took - got[0].timings.total_s
        third = [r async for r in fabric.generate([req("t3", max_tokens=4)], session="s")]
        counts, dropped = dict(fabric.affinity.counts), fabric.duplicates_dropped
    other = ({"r0", "r1"} - {bound}).pop()
    print(f"\nworker killed mid-turn: begun by the other {began:.2f} s later, answered "
          f"{took:.2f} s later; {counts}")
    assert [(r.request_id, r.worker_id) for r in got] == [("t2", other)]
    assert isinstance(got[0], RolloutResult) and got[0].attempt == 1  # sampled once, by it
    assert began < 15.0 and counts["rescued"] == 1 and dropped == 0  # within the ack-wait
    assert [r.worker_id for r in third] == [other]
