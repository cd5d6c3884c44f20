"""The model side of the torch engine: the module and its weights, and the decode loop that
runs one batch in a worker thread (the forward passes release the GIL, so heartbeats and
pings go on).

Between two decode steps the thread checks for an abort, parks while frozen by a `keep`
pause, and takes the step lock that `load` also takes, so new weights land between steps,
never inside one; the first step after they land recomputes the KV cache under them.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from rlfabric.engines.protocol import WeightLoadError
from rlfabric.engines.torch.lora import LoraBank
from rlfabric.engines.torch.residency import Residency
from rlfabric.engines.torch.sampling import sample
from rlfabric.engines.torch.sequence import Sequence
from rlfabric.tensors.checksums import checksum
from rlfabric.tensors.models import build_model
from rlfabric.text.ends import end_token_ids


class RunnerState(enum.Enum):
    IDLE = "idle"  # no batch
    RUNNING = "running"  # inside a decode step, or between two
    PARKED = "parked"  # frozen between two steps by a keep pause


class ModelRunner:
    def __init__(self, model: str, *, device: torch.device, dtype: torch.dtype | None,
                 max_adapters: int = 4, adapter_versions: int = 2) -> None:
        self.model = model
        self.device = device
        self.module = build_model(model, dtype=dtype, device=device)
        cfg = self.module.config
        self.vocab_size: int = cfg.vocab_size
        self.context_len: int = cfg.max_position_embeddings
        eos = cfg.eos_token_id
        self.eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if os.path.isdir(model):  # a checkpoint: every end token its files name
            self.eos_ids |= end_token_ids(model)
        self.pad_id: int = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.params: dict[str, torch.Tensor] = dict(self.module.state_dict())
        self.residency = Residency(self.module, device)
        self.lora = LoraBank(self.module, max_adapters=max_adapters, keep=adapter_versions)
        self.version = -1
        self._step_lock = threading.Lock()
        self._cv = threading.Condition()
        self._state = RunnerState.IDLE
        self._may_run = True
        self._abort = False
        # NOTE: transformers 5.24 renamed the KV cache's argument and output field from
        # `past_key_values` to `cache` (the old name warns, and goes in 5.40)
        self._cache_kw = ("cache" if "cache" in inspect.signature(self.module.forward).parameters
                          else "past_key_values")

    # ---- what the event loop asks of the thread ----
    def set_state(self, state: RunnerState) -> None:
        with self._cv:
            self._state = state
            self._cv.notify_all()

    def freeze(self) -> None:
        """Park the batch at its next step boundary (keep pause)."""
        with self._cv:
            self._may_run = False

    def thaw(self) -> None:
        with self._cv:
            self._may_run = True
            self._cv.notify_all()

    def set_abort(self, on: bool) -> None:
        """While on, the running batch stops at its next step boundary (abort pause)."""
        with self._cv:
            self._abort = on
            if on:
                self._may_run = True
            self._cv.notify_all()

    def wait_not_running(self) -> None:
        """Block until the thread is parked or idle (run in a worker thread)."""
        with self._cv:
            self._cv.wait_for(lambda: self._state != RunnerState.RUNNING, timeout=600)

    def wait_idle(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._state == RunnerState.IDLE, timeout=600)

    # ---- weights ----
    def checked(self, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """`state` as tensors, once every name, shape and dtype fits; else `WeightLoadError`."""
        spec = self.residency.spec
        missing = sorted(set(spec) - set(state))
        extra = sorted(set(state) - set(spec))
        if missing or extra:
            raise WeightLoadError(
                f"state dict does not match model {self.model!r}: missing {missing[:5]}"
                f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                f"{'...' if len(extra) > 5 else ''}")
        out = {}
        for name, (shape, dtype) in spec.items():
            t = torch.as_tensor(state[name])
            if tuple(t.shape) != shape:
                raise WeightLoadError(f"{name}: shape {tuple(t.shape)} != model's {shape}")
            if not t.dtype.is_floating_point and dtype.is_floating_point:
                raise WeightLoadError(f"{name}: dtype {t.dtype} cannot replace {dtype}")
            out[name] = t
        return out

    def load(self, new: dict[str, torch.Tensor], version: int) -> None:
        with self._step_lock, torch.no_grad():
            if self.residency.dropped:  # a level-2 sleep dropped them: room again first
                self.residency.materialize()
                self.params = dict(self.module.state_dict())
            for name, t in new.items():
                self.params[name].copy_(t)
            self.version = version
        # NOTE: the idle worker thread keeps its last arguments; emptied, they pin no buffer
        new.clear()

    def checksum(self) -> str:
        with self._step_lock:
            return "" if self.residency.dropped else checksum(self.params)

    def sleep(self, level: int) -> None:
        """Free the device (`Residency`); called with no batch running."""
        with self._step_lock, torch.no_grad():
            self.params = {}  # detached views of the weights: they would keep the device copies
            self.residency.sleep(level)
            self.params = dict(self.module.state_dict())

    def wake(self) -> None:
        with self._step_lock, torch.no_grad():
            self.residency.wake()
            self.params = dict(self.module.state_dict())

    # ---- the decode loop (worker thread) ----
    def run_batch(self, batch: list[Sequence]) -> None:
        self.set_state(RunnerState.RUNNING)
        try:
            with torch.inference_mode():
                self._decode(batch)
        finally:
            for seq in batch:
                if seq.finish is None:
                    seq.finish = "abort"
            self.set_state(RunnerState.IDLE)

    def _boundary(self) -> bool:
        """Between two steps: False if the batch must stop (abort); parks while frozen."""
        with self._cv:
            if not self._may_run and not self._abort:
                self._state = RunnerState.PARKED
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._may_run or self._abort)
                self._state = RunnerState.RUNNING
            return not self._abort

    def _forward(self, rows: list[Sequence], ids: torch.Tensor, mask: torch.Tensor,
                 pos: torch.Tensor, cache: DynamicCache) -> tuple[Any, DynamicCache]:
        """One forward pass over `cache` (an empty one: prefill), each row under its
        sequence's adapter (if any); the output and the cache."""
        adapters = [s.lora for s in rows]
        with self.lora.rows(adapters) if any(a is not None for a in adapters) \
                else contextlib.nullcontext():
            out = self.module(input_ids=ids, attention_mask=mask, position_ids=pos,
                              use_cache=True, **{self._cache_kw: cache})
        return out, out[self._cache_kw]

    def _decode(self, batch: list[Sequence]) -> None:
        """Prefill, then one step per token: sample, postprocess (append, emit, finish),
        schedule (drop finished rows), run the next forward pass."""
        step = self._prefill(batch)
        while step.rows:
            if not self._boundary():
                return
            keep, nxt = self._postprocess(step, self._sample(step))
            if not keep:
                return
            self._schedule(step, keep)
            self._run(step, nxt)

    def _prefill(self, batch: list[Sequence]) -> _Step:
        t0 = time.monotonic()
        for s in batch:
            s.t_started = t0
        width = max(len(s.prompt) for s in batch)
        ids = torch.tensor([[self.pad_id] * (width - len(s.prompt)) + s.prompt for s in batch],
                           device=self.device)
        mask = torch.tensor([[0] * (width - len(s.prompt)) + [1] * len(s.prompt) for s in batch],
                            device=self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with self._step_lock:
            out, cache = self._forward(batch, ids, mask, pos, DynamicCache())
            version = self.version
        return _Step(rows=list(batch), width=width, mask=mask, pos=pos, cache=cache, out=out,
                     version=version)

    def _sample(self, step: _Step) -> _Sampled:
        logits = step.out.logits[:, -1, :]
        logp = torch.log_softmax(logits.float(), dim=-1)
        toks = sample(logits, [s.request.sampling for s in step.rows],
                      [s.generator for s in step.rows])
        taken = logp.gather(1, toks[:, None])[:, 0].tolist()
        k_max = max(s.request.sampling.logprobs for s in step.rows)
        top = torch.topk(logp, k_max) if k_max else None
        return _Sampled(tokens=toks.tolist(), taken=taken,
                        top_ids=top.indices.tolist() if top is not None else [],
                        top_lps=top.values.tolist() if top is not None else [])

    def _postprocess(self, step: _Step, got: _Sampled) -> tuple[list[int], list[int]]:
        """Each row's token appended (and streamed); the rows that go on, and their tokens."""
        keep, nxt = [], []
        for r, (seq, tok) in enumerate(zip(step.rows, got.tokens, strict=True)):
            if seq.cancelled:
                seq.finish = "abort"
                continue
            # an adapter's sequence is versioned by its adapter (pinned at admission)
            seq.append(tok, got.taken[r], step.version if seq.lora is None else seq.lora.version)
            k = seq.request.sampling.logprobs
            if k:
                seq.top_ids.append(got.top_ids[r][:k])
                seq.top_lps.append(got.top_lps[r][:k])
            if tok in seq.stop_ids:
                seq.finish = "stop"
            elif (len(seq.tokens) >= seq.request.sampling.max_tokens
                  or len(seq.prompt) + len(seq.tokens) >= self.context_len):
                seq.finish = "length"
            else:
                keep.append(r)
                nxt.append(tok)
            if seq.emit is not None:
                seq.emit_delta()
        return keep, nxt

    def _schedule(self, step: _Step, keep: list[int]) -> None:
        """Narrow the batch (cache, mask, positions) to the rows that go on; one more slot."""
        if len(keep) < len(step.rows):
            idx = torch.tensor(keep, device=self.device)
            step.cache.batch_select_indices(idx)
            step.mask, step.pos = step.mask[idx], step.pos[idx]
            step.rows = [step.rows[r] for r in keep]
        step.mask = torch.cat([step.mask, torch.ones_like(step.mask[:, :1])], dim=1)
        step.pos = step.pos[:, -1:] + 1

    def _run(self, step: _Step, nxt: list[int]) -> None:
        with self._step_lock:
            if self.version != step.version:
                # new weights landed between two steps (a keep pause and an update): the
                # cache holds keys and values of the old ones; recompute it, never reuse it
                full = torch.tensor([[self.pad_id] * (step.width - len(s.prompt)) + s.prompt
                                     + s.tokens for s in step.rows], device=self.device)
                step.out, step.cache = self._forward(
                    step.rows, full, step.mask, (step.mask.cumsum(-1) - 1).clamp(min=0),
                    DynamicCache())
            else:
                step.out, step.cache = self._forward(
                    step.rows, torch.tensor(nxt, device=self.device)[:, None], step.mask,
                    step.pos, step.cache)
            step.version = self.version


@dataclass
class _Step:
    """A batch between two decode steps: its rows, attention mask, positions, KV cache, the
    last forward pass's output, and the weight version that computed them."""

    rows: list[Sequence]
    width: int
    mask: torch.Tensor
    pos: torch.Tensor
    cache: DynamicCache
    out: Any
    version: int


@dataclass
class _Sampled:
    """One step's sampled token per row, its logprob, and the top-k where asked for."""

    tokens: list[int]
    taken: list[float]
    top_ids: list[list[int]] = field(default_factory=list)
    top_lps: list[list[float]] = field(default_factory=list)
