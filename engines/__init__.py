"""Inference engines (by name: `registry`, the built-in ones in `kinds`) and the worker runtime
that puts one on the bus."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio

from rlfabric.engines import kinds  # noqa: F401  (registers torch, vllm, null)
from rlfabric.engines.errors import (
    EngineDied,
    EngineError,
    RequestRejected,
    Unsupported,
    WeightLoadError,
)
from rlfabric.engines.protocol import Engine
from rlfabric.engines.registry import EngineKind, make_engine, register
from rlfabric.schemas import PauseMode


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


__all__ = ["Engine", "EngineDied", "EngineError", "EngineKind", "PauseMode", "RequestRejected",
           "Unsupported", "WeightLoadError", "checkpoint_dir", "make_engine", "register",
           "running"]
