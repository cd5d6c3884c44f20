"""The torch reference engine: a Hugging Face causal LM with batched KV-cache decoding.

A scheduler task takes admitted sequences in batches and runs each batch in a worker thread
(the forward passes release the GIL, so heartbeats and pings go on). Between two decode steps
the thread checks for an abort, parks while frozen by a `keep` pause, and takes the step lock
that `load_weights` also takes, so new weights land between steps, never inside one.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import torch
from transformers import DynamicCache

from rlfabric.bus.sync import Signal
from rlfabric.engines.protocol import PauseMode, RequestRejected, WeightLoadError
from rlfabric.engines.sampling import sample
from rlfabric.engines.sequence import Sequence
from rlfabric.schemas import RolloutRequest, RolloutResult
from rlfabric.schemas.models import build_model
from rlfabric.schemas.weights import checksum


class TorchEngine:
    name = "torch"

    def __init__(self, model: str = "tiny", *, device: str | None = None,
                 dtype: torch.dtype | None = None, max_batch: int = 64) -> None:
        self.model = model
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.module = build_model(model, dtype=dtype, device=self.device)
        cfg = self.module.config
        self.vocab_size: int = cfg.vocab_size
        self.context_len: int = cfg.max_position_embeddings
        eos = cfg.eos_token_id
        self.eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.pad_id: int = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.max_batch = max_batch
        self._version = -1
        self._params = dict(self.module.state_dict())
        self._pending: list[Sequence] = []
        self._held: list[Sequence] = []
        self._running: list[Sequence] = []
        self._paused: PauseMode | None = None
        self._sleeping = 0
        self._wakeup = Signal()  # new sequences, or a resume
        self._progress = Signal()  # a batch ended
        self._step_lock = threading.Lock()
        self._cv = threading.Condition()
        self._thread_state = "idle"  # idle | running | parked
        self._may_run = True
        self._abort = False
        self._tg: anyio.abc.TaskGroup | None = None
        self.worker_id = ""

    # ---- lifecycle ----
    async def __aenter__(self) -> TorchEngine:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._schedule)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._tg is not None
        await self.pause("abort")
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)

    @property
    def version(self) -> int:
        return self._version

    # ---- requests ----
    def check(self, request: RolloutRequest) -> None:
        sp = request.sampling
        ids = request.prompt_token_ids.numpy()
        if len(ids) == 0:
            raise RequestRejected("bad_request", "prompt_token_ids is empty")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise RequestRejected(
                "bad_request",
                f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size}) of "
                f"model {self.model!r}")
        if len(ids) >= self.context_len:
            raise RequestRejected(
                "prompt_too_long",
                f"prompt of {len(ids)} tokens leaves no room in the context of "
                f"{self.context_len} tokens of model {self.model!r}")
        if sp.max_tokens <= 0:
            raise RequestRejected("bad_request", f"max_tokens={sp.max_tokens}: must be >= 1")
        if sp.n < 1:
            raise RequestRejected("bad_request", f"n={sp.n}: must be >= 1")
        if sp.temperature < 0 or not (0.0 < sp.top_p <= 1.0) or sp.top_k < 0:
            raise RequestRejected(
                "bad_request",
                f"sampling out of range (temperature={sp.temperature}, top_p={sp.top_p}, "
                f"top_k={sp.top_k}): need temperature >= 0, 0 < top_p <= 1, top_k >= 0")
        if not 0 <= sp.logprobs <= self.vocab_size:
            raise RequestRejected("bad_request", f"logprobs={sp.logprobs}: must be in "
                                  f"[0, {self.vocab_size}]")

    async def generate(self, request: RolloutRequest, *,
                       worker_id: str = "") -> AsyncIterator[RolloutResult]:
        self.check(request)
        sp = request.sampling
        base_seed = sp.seed if sp.seed is not None else random.getrandbits(62)
        send, recv = anyio.create_memory_object_stream[RolloutResult](sp.n)
        prompt = request.prompt_token_ids.tolist()
        stops = frozenset(sp.stop_token_ids) | self.eos_ids
        seqs = []
        for i in range(sp.n):
            gen = torch.Generator(device=self.device).manual_seed(base_seed + i)
            seqs.append(Sequence(request=request, sample_index=i, prompt=prompt, generator=gen,
                                 sink=send, stop_ids=stops, worker_id=worker_id))
        if self._paused == "abort":  # like vLLM: an abort pause ends what arrives, too
            for seq in seqs:
                seq.finish = "abort"
                self._deliver(seq)
        elif self._paused == "keep":  # held, starts after resume
            self._held.extend(seqs)
        else:  # running, or draining for a wait pause: admitted now
            self._pending.extend(seqs)
            self._wakeup.fire()
        try:
            async with recv:
                for _ in range(sp.n):
                    yield await recv.receive()
        finally:
            for s in seqs:
                s.cancelled = True
            send.close()

    # ---- control ----
    async def pause(self, mode: PauseMode) -> None:
        self._paused = mode
        if mode == "keep":
            with self._cv:
                self._may_run = False
            await anyio.to_thread.run_sync(self._wait_thread_not_running)
            return
        if mode == "abort":
            with self._cv:
                self._abort = True
                self._may_run = True
                self._cv.notify_all()
            await anyio.to_thread.run_sync(self._wait_thread_idle)
            for seq in self._pending:
                seq.finish = "abort"
                self._deliver(seq)
            self._pending.clear()
            with self._cv:
                self._abort = False
            return
        # wait: drain what was admitted
        with self._cv:
            self._may_run = True
            self._cv.notify_all()
        while self._pending or self._running:
            await self._progress.event().wait()

    async def resume(self) -> None:
        self._paused = None
        with self._cv:
            self._may_run = True
            self._cv.notify_all()
        self._pending.extend(self._held)
        self._held.clear()
        self._wakeup.fire()

    async def load_weights(self, state: Mapping[str, Any], version: int) -> None:
        new = self._checked(state)
        await anyio.to_thread.run_sync(self._copy_in, new, version)

    def weights_checksum(self) -> str:
        with self._step_lock:
            return checksum(self._params)

    def state_dict(self) -> Mapping[str, Any]:
        return self._params

    async def init_transport(self, **kwargs: Any) -> None:
        raise WeightLoadError("the collective transport is set up by the worker runtime")

    async def sleep(self, level: int) -> None:
        await self.pause("abort")
        self._sleeping = level
        if self.device.type == "cuda":
            self.module.to("cpu")
            torch.cuda.empty_cache()

    async def wake(self, tags: tuple[str, ...] = ()) -> None:
        if self._sleeping and self.device.type == "cuda":
            self.module.to(self.device)
        self._sleeping = 0
        self._params = dict(self.module.state_dict())
        await self.resume()

    async def reset_prefix_cache(self) -> None:
        return None  # no cross-request prefix cache: every batch prefills from scratch

    def describe(self) -> dict[str, str]:
        p = next(iter(self._params.values()))
        return {
            "engine": self.name, "model": self.model, "version": str(self._version),
            "device": str(self.device), "dtype": str(p.dtype),
            "params": str(sum(t.numel() for t in self._params.values())),
            "paused": self._paused or "", "sleeping": str(self._sleeping),
            "pending": str(len(self._pending) + len(self._held)),
            "running": str(len(self._running)),
        }

    # ---- internals ----
    def _deliver(self, seq: Sequence) -> None:
        if seq.cancelled:
            return
        try:
            seq.sink.send_nowait(seq.result(seq.worker_id))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

    async def _schedule(self) -> None:
        while True:
            self._pending = [s for s in self._pending if not s.cancelled]
            if not self._pending or self._paused in ("keep", "abort"):
                await self._wakeup.event().wait()
                continue
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            self._running = batch
            # NOTE: marked running before the first await, so a pause that runs next sees it
            self._set_state("running")
            try:
                await anyio.to_thread.run_sync(self._run_batch, batch)
            finally:
                self._running = []
                for seq in batch:
                    self._deliver(seq)
                self._progress.fire()

    def _wait_thread_not_running(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._thread_state != "running", timeout=600)

    def _wait_thread_idle(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._thread_state == "idle", timeout=600)

    def _set_state(self, state: str) -> None:
        with self._cv:
            self._thread_state = state
            self._cv.notify_all()

    def _boundary(self) -> bool:
        """Between two steps: False if the batch must stop (abort); parks while frozen."""
        with self._cv:
            if not self._may_run and not self._abort:
                self._thread_state = "parked"
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._may_run or self._abort)
                self._thread_state = "running"
            return not self._abort

    def _checked(self, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        missing = sorted(set(self._params) - set(state))
        extra = sorted(set(state) - set(self._params))
        if missing or extra:
            raise WeightLoadError(
                f"state dict does not match model {self.model!r}: missing {missing[:5]}"
                f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                f"{'...' if len(extra) > 5 else ''}")
        out = {}
        for name, ref in self._params.items():
            t = torch.as_tensor(state[name])
            if tuple(t.shape) != tuple(ref.shape):
                raise WeightLoadError(f"{name}: shape {tuple(t.shape)} != model's "
                                      f"{tuple(ref.shape)}")
            if not t.dtype.is_floating_point and ref.dtype.is_floating_point:
                raise WeightLoadError(f"{name}: dtype {t.dtype} cannot replace {ref.dtype}")
            out[name] = t
        return out

    def _copy_in(self, new: dict[str, torch.Tensor], version: int) -> None:
        with self._step_lock, torch.no_grad():
            for name, t in new.items():
                self._params[name].copy_(t)
            self._version = version
        # NOTE: the idle worker thread keeps its last arguments; emptied, they pin no buffer
        new.clear()

    def _run_batch(self, batch: list[Sequence]) -> None:
        self._set_state("running")
        try:
            with torch.inference_mode():
                self._decode(batch)
        finally:
            for seq in batch:
                if seq.finish is None:
                    seq.finish = "abort"
            self._set_state("idle")

    def _decode(self, batch: list[Sequence]) -> None:
        dev = self.device
        t0 = time.monotonic()
        for s in batch:
            s.t_started = t0
        width = max(len(s.prompt) for s in batch)
        ids = torch.tensor([[self.pad_id] * (width - len(s.prompt)) + s.prompt for s in batch],
                           device=dev)
        mask = torch.tensor([[0] * (width - len(s.prompt)) + [1] * len(s.prompt) for s in batch],
                            device=dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        rows = list(batch)
        with self._step_lock:
            out = self.module(input_ids=ids, attention_mask=mask, position_ids=pos,
                              past_key_values=DynamicCache(), use_cache=True)
            version = self._version
        while rows:
            if not self._boundary():
                return
            logits = out.logits[:, -1, :]
            logp = torch.log_softmax(logits.float(), dim=-1)
            keep, nxt = [], []
            for r, seq in enumerate(rows):
                if seq.cancelled:
                    seq.finish = "abort"
                    continue
                tok = sample(logits[r], seq.request.sampling, seq.generator)
                seq.append(tok, float(logp[r, tok]), version)
                k = seq.request.sampling.logprobs
                if k:
                    top = torch.topk(logp[r], k)
                    seq.top_ids.append(top.indices.tolist())
                    seq.top_lps.append(top.values.tolist())
                if tok in seq.stop_ids:
                    seq.finish = "stop"
                elif (len(seq.tokens) >= seq.request.sampling.max_tokens
                      or len(seq.prompt) + len(seq.tokens) >= self.context_len):
                    seq.finish = "length"
                else:
                    keep.append(r)
                    nxt.append(tok)
            if not keep:
                return
            if len(keep) < len(rows):
                idx = torch.tensor(keep, device=dev)
                out.past_key_values.batch_select_indices(idx)
                mask, pos = mask[idx], pos[idx]
                rows = [rows[r] for r in keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
            with self._step_lock:
                out = self.module(input_ids=torch.tensor(nxt, device=dev)[:, None],
                                  attention_mask=mask, position_ids=pos,
                                  past_key_values=out.past_key_values, use_cache=True)
                version = self._version
