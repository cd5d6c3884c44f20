"""Abandoned work stops: a `generate` call that ends before its answers came tells the workers
(`RolloutCancel`); the request being sampled stops, one still queued is never sampled, and
neither is answered or delivered again."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest
from helpers import req

from rlfabric.schemas import RolloutResult

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


async def _detail(fabric, worker: str) -> dict[str, str]:
    rep = await fabric.describe()
    return dict(rep.acks[worker].detail)


async def _until(fabric, worker: str, ok: Callable[[dict[str, str]], bool],
                 timeout: float) -> dict[str, str]:
    """The worker's `describe` detail once `ok` holds (polled; `timeout` at most)."""
    with anyio.fail_after(timeout):
        while not ok(d := await _detail(fabric, worker)):  # noqa: ASYNC110 (another process)
            await anyio.sleep(0.05)
    return d


async def test_a_generate_closed_while_its_request_samples_stops_the_sampling(
        client, workers) -> None:
    """A request that takes 50 s on the worker (the null engine at 50 ms a token): the call
    given up once the worker holds it, the worker is free within seconds and served none."""
    workers(["c0"], "--token-s", "0.05", engine="null")
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=60)
        before = await _detail(fabric, "c0")
        async with anyio.create_task_group() as tg:
            async def ask() -> None:
                async for r in fabric.generate([req("long", max_tokens=1000)]):
                    raise AssertionError(f"answered: {r}")
            tg.start_soon(ask)
            await _until(fabric, "c0", lambda d: d["in_flight"] == "1", 30)
            tg.cancel_scope.cancel()
        after = await _until(fabric, "c0", lambda d: d["in_flight"] == "0", 10)
        assert after["served"] == before["served"]
        assert fabric.rollouts.outstanding == 0


async def test_a_request_given_up_while_queued_is_never_sampled(client, workers, prefix) -> None:
    """Given up while the worker was paused (still in the stream): skipped when pulled after
    the resume, acked, not delivered again; the next request is served."""
    workers(["c1"], engine="null")
    async with client() as fabric:
        await fabric.wait_for_workers(1, timeout=60)
        before = await _detail(fabric, "c1")
        assert (await fabric.pause("keep")).ok == ("c1",)
        with anyio.move_on_after(0.5):
            async for r in fabric.generate([req("queued", max_tokens=4)]):
                raise AssertionError(f"answered while paused: {r}")
        assert (await fabric.resume()).ok == ("c1",)
        got = [r async for r in fabric.generate([req("next", max_tokens=4)], timeout=60)]
        assert [type(r) for r in got] == [RolloutResult]
        s = fabric.bus.subjects
        with anyio.fail_after(30):
            while (info := await fabric.bus.js.consumer_info(  # noqa: ASYNC110 (the server's)
                    s.rollout_stream, s.rollout_consumer)).num_ack_pending or info.num_pending:
                await anyio.sleep(0.05)
        after = await _detail(fabric, "c1")
        assert int(after["served"]) == int(before["served"]) + 1  # "next" only
