"""The torch engine on a CUDA device (`pytest -m gpu`; skipped where there is none, as on CI's
machines): sleep gives the card back, wake restores it, and sampling after wake is what it was
before sleep."""

from __future__ import annotations

import pytest
import torch
from helpers import req

from rlfabric.engines import make_engine, running
from rlfabric.schemas import RolloutResult

pytestmark = [
    pytest.mark.gpu, pytest.mark.anyio,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device here: run `pytest -m gpu` on a GPU machine "
                              "(../shared/gpu/README.md)"),
]


async def sample(engine, rid: str) -> list[int]:
    (res,) = [r async for r in engine.generate(req(rid, [256, 5, 6], max_tokens=32, seed=3))]
    assert isinstance(res, RolloutResult)
    return res.completion_token_ids.tolist()


async def test_sleep_level_1_frees_the_cards_memory_and_wake_restores_it() -> None:
    async with running(make_engine("torch", "small64", device="cuda")) as engine:
        before = await sample(engine, "before")
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        await engine.sleep(1)
        asleep = torch.cuda.memory_reserved()
        await engine.wake()
        after = await sample(engine, "after")
        woken = torch.cuda.memory_reserved()
    assert reserved > 0 and asleep <= 0.1 * reserved, (reserved, asleep)
    assert woken >= 0.9 * reserved, (reserved, woken)
    assert after == before
