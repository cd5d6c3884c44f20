"""Inference engines and the worker runtime that puts one on the bus."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio

from rlfabric.engines.protocol import Engine, RequestRejected, WeightLoadError
from rlfabric.schemas import PauseMode

#: what `--engine` takes: the reference engine, and an echo engine for benchmarks
ENGINES: tuple[str, ...] = ("torch", "null")


def make_engine(kind: str, model: str, **kwargs: Any) -> Engine:
    """An engine by name (one of `ENGINES`); `kwargs` go to its constructor."""
    if kind == "torch":
        from rlfabric.engines.torch import TorchEngine

        return TorchEngine(model, **kwargs)
    if kind == "null":
        from rlfabric.engines.null import NullEngine

        return NullEngine(model, **kwargs)
    raise ValueError(f"unknown engine {kind!r}: use one of {', '.join(ENGINES)}")


@contextlib.asynccontextmanager
async def running(engine: Engine) -> AsyncIterator[Engine]:
    """Run `engine` in-process for the body of the `async with` (no bus: benchmarks, tools)."""
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        yield engine
        tg.cancel_scope.cancel()


__all__ = ["ENGINES", "Engine", "PauseMode", "RequestRejected", "WeightLoadError",
           "make_engine", "running"]
