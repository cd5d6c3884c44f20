"""`Signal`: its timed wait wakes on a fire or runs out, and leaves nothing behind."""

from __future__ import annotations

import anyio
import pytest

from rlfabric.concurrency.sync import Signal

pytestmark = pytest.mark.anyio


async def test_a_timed_wait_returns_true_on_a_fire_and_false_when_it_runs_out() -> None:
    sig = Signal()
    got: list[bool] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            async def waiter() -> None:
                got.append(await sig.wait(60))

            for _ in range(3):
                tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            sig.fire()
        t0 = anyio.current_time()
        assert await sig.wait(0.05) is False
        assert anyio.current_time() - t0 >= 0.04
    assert got == [True, True, True]
    assert not sig._timed  # every wait took its future back


async def test_a_timed_wait_cancelled_leaves_no_waiter() -> None:
    sig = Signal()
    with anyio.move_on_after(0.05):
        await sig.wait(60)
    assert not sig._timed
    sig.fire()  # nothing left to wake
