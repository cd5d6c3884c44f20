"""Inference engines and the worker runtime that puts one on the bus."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio

from rlfabric.engines.protocol import Engine, EngineDied, RequestRejected, WeightLoadError
from rlfabric.schemas import PauseMode

#: what `--engine` takes: the reference engine, vLLM, and an echo engine for benchmarks
ENGINES: tuple[str, ...] = ("torch", "vllm", "null")


def make_engine(kind: str, model: str, **kwargs: Any) -> Engine:
    """An engine by name (one of `ENGINES`); `kwargs` go to its constructor."""
    if kind == "torch":
        from rlfabric.engines.torch import TorchEngine

        return TorchEngine(model, **kwargs)
    if kind == "vllm":
        from rlfabric.engines.vllm import VllmEngine

        return VllmEngine(checkpoint_dir(model), **kwargs)
    if kind == "null":
        from rlfabric.engines.null import NullEngine

        return NullEngine(model, **kwargs)
    raise ValueError(f"unknown engine {kind!r}: use one of {', '.join(ENGINES)}")


def checkpoint_dir(model: str) -> str:
    """A built-in spec name becomes a checkpoint written once under the user's cache (engines
    that load from a directory, such as vLLM, need one); a path stays as it is."""
    import os

    from rlfabric.schemas.models import BUILTIN

    if model not in BUILTIN or os.path.isdir(model):
        return model
    from rlfabric.tensors.models import write_checkpoint
    from rlfabric.text.builtin import cache_dir

    return write_checkpoint(model, cache_dir("checkpoints", model))


@contextlib.asynccontextmanager
async def running(engine: Engine) -> AsyncIterator[Engine]:
    """Run `engine` in-process for the body of the `async with` (no bus: benchmarks, tools)."""
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        yield engine
        tg.cancel_scope.cancel()


__all__ = ["ENGINES", "Engine", "EngineDied", "PauseMode", "RequestRejected", "WeightLoadError",
           "checkpoint_dir", "make_engine", "running"]
