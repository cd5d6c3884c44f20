"""The null engine: echoes the prompt back as the completion, instantly, logprob 0 for every
token. It takes the model out of a measurement, leaving the fabric's own costs. With
`token_s`, a request takes that many seconds per max token, asleep: a device that decodes
every admitted request at once, at a fixed speed, without the CPU (scheduling benchmarks on
machines without one)."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
from anyio.abc import TaskStatus

from rlfabric.engines.payload import PackedWeights
from rlfabric.engines.protocol import (
    PauseMode,
    TokenSink,
    adapter_held,
    checked,
)
from rlfabric.engines.registry import ADAPTER_VERSIONS
from rlfabric.schemas import (
    Adapter,
    PackedF32,
    PackedI32,
    RolloutRequest,
    RolloutResult,
    TokenDelta,
    VersionSpan,
)


class NullEngine:
    name = "null"
    weights_device = "cpu"

    def __init__(self, model: str = "none", *, vocab_size: int = 1 << 20,
                 adapter_versions: int = ADAPTER_VERSIONS, token_s: float = 0.0) -> None:
        self.model = model
        self.token_s = token_s
        self.vocab_size = vocab_size
        self._keep = adapter_versions
        self._adapters: dict[str, tuple[int, ...]] = {}
        self._version = -1
        self._state: dict[str, Any] = {}
        self._resumed = anyio.Event()
        self._resumed.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await anyio.sleep_forever()

    @property
    def version(self) -> int:
        return self._version

    async def serve_checkpoint_as(self, version: int) -> None:
        self._version = version

    def check(self, request: RolloutRequest) -> None:
        checked(request)
        if request.adapter:
            adapter_held(request, self.adapter_versions())

    async def generate(self, request: RolloutRequest, *, worker_id: str = "",
                       on_tokens: TokenSink | None = None) -> AsyncIterator[RolloutResult]:
        self.check(request)
        await self._resumed.wait()
        if self.token_s:
            await anyio.sleep(self.token_s * request.sampling.max_tokens)
        for res in self._echo(request, worker_id, on_tokens):
            yield res

    async def generate_many(self, requests: list[RolloutRequest], *, worker_id: str = "",
                            on_tokens: TokenSink | None = None,
                            ) -> AsyncGenerator[list[RolloutResult], None]:
        if not self._resumed.is_set():
            await self._resumed.wait()
        if self.token_s:
            await anyio.sleep(self.token_s * max(r.sampling.max_tokens for r in requests))
        yield [res for request in requests for res in self._echo(request, worker_id, on_tokens)]

    def _echo(self, request: RolloutRequest, worker_id: str,
              on_tokens: TokenSink | None) -> list[RolloutResult]:
        # bytes, not numpy: the null engine measures the fabric, so its own share stays small
        ids = PackedI32(request.prompt_token_ids.tobytes()[: 4 * request.sampling.max_tokens])
        zeros = PackedF32(bytes(4 * len(ids)))  # float32 0.0 is four zero bytes
        version_spans = (VersionSpan(version=self._version, start=0, end=len(ids)),)
        if on_tokens is not None and request.stream:
            for i in range(request.sampling.n):
                on_tokens(TokenDelta(request_id=request.request_id, sample_index=i, start=0,
                                     token_ids=ids, logprobs=zeros, version=self._version,
                                     finish="length"))
        return [RolloutResult(
            request_id=request.request_id, sample_index=i, worker_id=worker_id,
            completion_token_ids=ids, logprobs=zeros, finish_reason="length",
            version_spans=version_spans, group_id=request.group_id,
            prompt_len=len(request.prompt_token_ids)) for i in range(request.sampling.n)]

    async def pause(self, mode: PauseMode) -> None:
        # wait / abort: what is in flight finishes at once anyway; keep: it freezes
        if mode == "keep" and self._resumed.is_set():  # paused twice: one event
            self._resumed = anyio.Event()

    async def resume(self) -> None:
        self._resumed.set()

    async def load_weights(self, weights: PackedWeights, version: int) -> None:
        # names, dtypes and shapes only: holding tensors would pin the sender's buffer
        self._state = {m.name: (m.dtype, tuple(m.shape)) for m in weights.tensors}
        self._version = version

    def weights_checksum(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for k in sorted(self._state):
            h.update(f"{k}|{self._state[k]}".encode())
        return h.hexdigest()

    # adapters are held by name and version only (prompts are echoed whatever serves them)
    async def load_adapter(self, weights: PackedWeights, adapter: Adapter, version: int) -> str:
        held = [v for v in self._adapters.get(adapter.name, ()) if v != version]
        self._adapters[adapter.name] = tuple(sorted([*held, version]))[-self._keep:]
        h = hashlib.blake2b(digest_size=16)
        for m in sorted(weights.tensors, key=lambda m: m.name):
            h.update(f"{m.name}|{m.dtype}|{tuple(m.shape)}".encode())
        return h.hexdigest()

    async def unload_adapter(self, name: str) -> bool:
        return self._adapters.pop(name, None) is not None

    def adapter_versions(self) -> dict[str, tuple[int, ...]]:
        return dict(self._adapters)

    @property
    def max_adapters(self) -> int:
        return 0

    async def sleep(self, level: int) -> None:
        await self.pause("abort")

    async def wake(self, tags: tuple[str, ...] = ()) -> None:
        await self.resume()

    async def reset_prefix_cache(self) -> None:
        return None

    def describe(self) -> dict[str, str]:
        return {"engine": self.name, "model": self.model, "version": str(self._version)}
