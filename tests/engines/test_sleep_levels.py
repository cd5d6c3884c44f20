"""The torch engine's sleep levels (here on the CPU; on a GPU in `test_gpu.py`): level 2 drops
the weights, a woken engine holds what arrives until a load brings them, then serves exactly
what it served before with those weights; level 1 keeps them."""

from __future__ import annotations

import anyio
import pytest
from helpers import packed, req

from rlfabric.engines import make_engine, running
from rlfabric.schemas import RolloutResult

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def greedy(engine, rid: str) -> list[int]:
    (res,) = [r async for r in engine.generate(req(rid, max_tokens=12, temperature=0.0))]
    assert isinstance(res, RolloutResult)
    return res.completion_token_ids.tolist()


async def test_level_2_drops_the_weights_and_the_next_load_brings_them() -> None:
    async with running(make_engine("torch", "tiny", device="cpu")) as engine:
        await engine.serve_checkpoint_as(0)
        state = {k: v.clone() for k, v in engine.runner.params.items()}
        checksum = engine.weights_checksum()
        before = await greedy(engine, "before")
        held = sum(t.numel() for t in engine.runner.params.values())

        await engine.sleep(2)
        assert sum(t.numel() for t in engine.runner.params.values()) == 0 < held
        assert engine.weights_checksum() == ""
        await engine.wake()
        got: list[list[int]] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_into, engine, got)
            with anyio.fail_after(10):  # admitted, and held: nothing runs without weights
                while not engine.scheduler.held:
                    await anyio.wait_all_tasks_blocked()
            assert not got and not engine.scheduler.running
            with packed(state) as weights:
                await engine.load_weights(weights, 1)
        assert engine.version == 1 and engine.weights_checksum() == checksum
        assert got == [before]


async def _into(engine, got: list[list[int]]) -> None:
    got.append(await greedy(engine, "after"))


async def test_level_1_keeps_the_weights_and_serves_after_wake() -> None:
    async with running(make_engine("torch", "tiny", device="cpu")) as engine:
        before = await greedy(engine, "before")
        checksum = engine.weights_checksum()
        await engine.sleep(1)
        await engine.wake()
        assert engine.weights_checksum() == checksum
        assert await greedy(engine, "after") == before
