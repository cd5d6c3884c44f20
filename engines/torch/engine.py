"""The torch reference engine: a Hugging Face causal LM with batched KV-cache decoding.

`TorchEngine` is the `Engine` the worker drives; the `Scheduler` picks batches, the
`ModelRunner` decodes them in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncGenerator, AsyncIterator

import anyio
import torch
from anyio.abc import TaskStatus

from rlfabric.engines.payload import PackedWeights
from rlfabric.engines.protocol import (
    PROGRESS_TOKENS,
    RequestRejected,
    TokenSink,
    adapter_held,
    checked,
)
from rlfabric.engines.registry import ADAPTER_VERSIONS, MAX_ADAPTERS, MAX_BATCH
from rlfabric.engines.torch.model_runner import ModelRunner, RunnerState
from rlfabric.engines.torch.scheduler import Scheduler
from rlfabric.engines.torch.sequence import Sequence
from rlfabric.schemas import (
    Adapter,
    ErrorCode,
    PauseMode,
    RolloutRequest,
    RolloutResult,
    TokenDelta,
)


class TorchEngine:
    name = "torch"

    def __init__(self, model: str = "tiny", *, device: str | None = None,
                 dtype: torch.dtype | None = None, max_batch: int = MAX_BATCH,
                 max_adapters: int = MAX_ADAPTERS, adapter_versions: int = ADAPTER_VERSIONS,
                 ) -> None:
        self.model = model
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.runner = ModelRunner(model, device=self.device, dtype=dtype,
                                  max_adapters=max_adapters, adapter_versions=adapter_versions)
        self.scheduler = Scheduler(max_batch)
        self._sleeping = 0
        self._wants_weights = False

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._schedule)
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                # NOTE: abort before the scheduler is cancelled: a batch in its worker thread
                # cannot be cancelled, only stopped at its next step boundary
                with anyio.CancelScope(shield=True):
                    await self.pause("abort")

    async def _schedule(self) -> None:
        while True:
            batch = self.scheduler.next_batch()
            if batch is None:
                await self.scheduler.wakeup.event().wait()
                continue
            # NOTE: marked running before the first await, so a pause that runs next sees it
            self.runner.set_state(RunnerState.RUNNING)
            try:
                await anyio.to_thread.run_sync(self.runner.run_batch, batch)
            finally:
                self.scheduler.finished(batch)

    @property
    def weights_device(self) -> str:
        return str(self.device)

    @property
    def version(self) -> int:
        return self.runner.version

    async def serve_checkpoint_as(self, version: int) -> None:
        self.runner.version = version

    # ---- requests ----
    def check(self, request: RolloutRequest) -> None:
        checked(request)
        ids = request.prompt_token_ids.numpy()
        vocab, context = self.runner.vocab_size, self.runner.context_len
        hi = int(ids.max())
        if hi >= vocab:
            raise RequestRejected(
                ErrorCode.BAD_REQUEST,
                f"prompt token id {hi} is outside the vocabulary [0, {vocab}) of "
                f"model {self.model!r}")
        if len(ids) >= context:
            raise RequestRejected(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt of {len(ids)} tokens leaves no room in the context of "
                f"{context} tokens of model {self.model!r}")
        if request.adapter:
            adapter_held(request, self.runner.lora.versions())

    async def generate(self, request: RolloutRequest, *, worker_id: str = "",
                       on_tokens: TokenSink | None = None) -> AsyncIterator[RolloutResult]:
        self.check(request)
        # closed with this generator, not when collected: its samples are cancelled at once
        async with contextlib.aclosing(self.generate_many(
                [request], worker_id=worker_id, on_tokens=on_tokens)) as many:
            async for burst in many:
                for res in burst:
                    yield res

    async def generate_many(self, requests: list[RolloutRequest], *, worker_id: str = "",
                            on_tokens: TokenSink | None = None,
                            ) -> AsyncGenerator[list[RolloutResult], None]:
        total = sum(r.sampling.n for r in requests)
        send, recv = anyio.create_memory_object_stream[RolloutResult](total)
        emit = None
        if on_tokens is not None:  # deltas are made in the decode thread, handed to the loop
            loop = asyncio.get_running_loop()
            sink = on_tokens

            def emit(delta: TokenDelta) -> None:
                loop.call_soon_threadsafe(sink, delta)
        seqs = []
        for request in requests:
            sp = request.sampling
            base_seed = sp.seed if sp.seed is not None else random.getrandbits(62)
            prompt = request.prompt_token_ids.tolist()
            stops = frozenset(sp.stop_token_ids) | self.runner.eos_ids
            lora = None
            if request.adapter:  # checked at admission; unloaded since: refused, never base
                adapter_held(request, self.runner.lora.versions())
                lora = self.runner.lora.pick(request.adapter, request.adapter_version)
            for i in range(sp.n):
                gen = torch.Generator(device=self.device).manual_seed(base_seed + i)
                seqs.append(Sequence(request=request, sample_index=i, prompt=prompt,
                                     generator=gen, sink=send, stop_ids=stops,
                                     worker_id=worker_id, lora=lora,
                                     emit=emit,
                                     every=1 if request.stream else PROGRESS_TOKENS))
        self.scheduler.admit(seqs)
        try:
            async with recv:
                left = total
                while left:
                    # a batch's results are there at once (the scheduler delivers them
                    # together): taken without yielding once the first is
                    try:
                        burst = [recv.receive_nowait()]
                    except anyio.WouldBlock:
                        burst = [await recv.receive()]
                    with contextlib.suppress(anyio.WouldBlock):
                        while True:
                            burst.append(recv.receive_nowait())
                    left -= len(burst)
                    yield burst
        finally:
            for s in seqs:
                s.cancelled = True
            send.close()

    # ---- control ----
    async def pause(self, mode: PauseMode) -> None:
        self.scheduler.paused = mode
        if mode == "keep":
            self.runner.freeze()
            await anyio.to_thread.run_sync(self.runner.wait_not_running)
            return
        if mode == "abort":
            self.runner.set_abort(True)
            await anyio.to_thread.run_sync(self.runner.wait_idle)
            self.scheduler.abort_pending()
            self.runner.set_abort(False)
            return
        # wait: drain what was admitted
        self.runner.thaw()
        while self.scheduler.busy:
            await self.scheduler.progress.event().wait()

    async def resume(self) -> None:
        if self.runner.residency.dropped:
            return  # no weights to run on: held until `load_weights` brings them
        self.scheduler.paused = None
        self.runner.thaw()
        self.scheduler.release_held()

    async def load_weights(self, weights: PackedWeights, version: int) -> None:
        state = weights.state()
        try:
            new = self.runner.checked(state)
            await anyio.to_thread.run_sync(self.runner.load, new, version)
        finally:
            state.clear()
        if self._wants_weights:  # woken from a level-2 sleep: this load is what it waited for
            self._wants_weights = False
            await self.resume()

    def weights_checksum(self) -> str:
        return self.runner.checksum()

    # ---- adapters ----
    async def load_adapter(self, weights: PackedWeights, adapter: Adapter, version: int) -> str:
        state = weights.state()
        try:
            p = next(iter(self.runner.params.values()))
            held = self.runner.lora.prepare(adapter, state, version, self.device, p.dtype)
        finally:
            state.clear()
        self.runner.lora.add(held)
        return held.checksum

    async def unload_adapter(self, name: str) -> bool:
        return self.runner.lora.remove(name)

    def adapter_versions(self) -> dict[str, tuple[int, ...]]:
        return self.runner.lora.versions()

    @property
    def max_adapters(self) -> int:
        return self.runner.lora.max_adapters

    async def sleep(self, level: int) -> None:
        await self.pause("abort")
        await anyio.to_thread.run_sync(self.runner.sleep, level)
        self._sleeping = level

    async def wake(self, tags: tuple[str, ...] = ()) -> None:
        if self._sleeping:
            await anyio.to_thread.run_sync(self.runner.wake)
        self._sleeping = 0
        self._wants_weights = self.runner.residency.dropped
        if self._wants_weights:  # no weights yet: what arrives is held for the next load
            self.scheduler.paused = "keep"
        await self.resume()

    async def reset_prefix_cache(self) -> None:
        return None  # no cross-request prefix cache: every batch prefills from scratch

    def describe(self) -> dict[str, str]:
        params = self.runner.params
        p = next(iter(params.values()))
        s = self.scheduler
        return {
            "engine": self.name, "model": self.model, "version": str(self.version),
            "device": str(self.device), "dtype": str(p.dtype),
            "params": str(sum(t.numel() for t in params.values())),
            "paused": s.paused or "", "sleeping": str(self._sleeping),
            "pending": str(len(s.pending) + len(s.held)), "running": str(len(s.running)),
        }



