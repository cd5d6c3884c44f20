"""The model side of the torch engine: the module and its weights, and the decode loop that
runs one batch in a worker thread (the forward passes release the GIL, so heartbeats and
pings go on).

Between two decode steps the thread checks for an abort, parks while frozen by a `keep`
pause, and takes the step lock that `load` also takes, so new weights land between steps,
never inside one; the first step after they land recomputes the KV cache under them.
"""

from __future__ import annotations

import enum
import inspect
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
from transformers import DynamicCache

from rlfabric.engines.protocol import WeightLoadError
from rlfabric.engines.torch.sampling import sample
from rlfabric.engines.torch.sequence import Sequence
from rlfabric.tensors.models import build_model
from rlfabric.tensors.packing import checksum


class RunnerState(enum.Enum):
    IDLE = "idle"  # no batch
    RUNNING = "running"  # inside a decode step, or between two
    PARKED = "parked"  # frozen between two steps by a keep pause


class ModelRunner:
    def __init__(self, model: str, *, device: torch.device, dtype: torch.dtype | None) -> None:
        self.model = model
        self.device = device
        self.module = build_model(model, dtype=dtype, device=device)
        cfg = self.module.config
        self.vocab_size: int = cfg.vocab_size
        self.context_len: int = cfg.max_position_embeddings
        eos = cfg.eos_token_id
        self.eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.pad_id: int = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.params: dict[str, torch.Tensor] = dict(self.module.state_dict())
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
        missing = sorted(set(self.params) - set(state))
        extra = sorted(set(state) - set(self.params))
        if missing or extra:
            raise WeightLoadError(
                f"state dict does not match model {self.model!r}: missing {missing[:5]}"
                f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                f"{'...' if len(extra) > 5 else ''}")
        out = {}
        for name, ref in self.params.items():
            t = torch.as_tensor(state[name])
            if tuple(t.shape) != tuple(ref.shape):
                raise WeightLoadError(f"{name}: shape {tuple(t.shape)} != model's "
                                      f"{tuple(ref.shape)}")
            if not t.dtype.is_floating_point and ref.dtype.is_floating_point:
                raise WeightLoadError(f"{name}: dtype {t.dtype} cannot replace {ref.dtype}")
            out[name] = t
        return out

    def load(self, new: dict[str, torch.Tensor], version: int) -> None:
        with self._step_lock, torch.no_grad():
            for name, t in new.items():
                self.params[name].copy_(t)
            self.version = version
        # NOTE: the idle worker thread keeps its last arguments; emptied, they pin no buffer
        new.clear()

    def checksum(self) -> str:
        with self._step_lock:
            return checksum(self.params)

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

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                 cache: DynamicCache) -> tuple[Any, DynamicCache]:
        """One forward pass over `cache` (an empty one: prefill); the output and the cache."""
        out = self.module(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                          **{self._cache_kw: cache})
        return out, out[self._cache_kw]

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
            out, cache = self._forward(ids, mask, pos, DynamicCache())
            version = self.version
        while rows:
            if not self._boundary():
                return
            logits = out.logits[:, -1, :]
            logp = torch.log_softmax(logits.float(), dim=-1)
            toks = sample(logits, [s.request.sampling for s in rows], [s.generator for s in rows])
            taken = logp.gather(1, toks[:, None])[:, 0].tolist()
            k_max = max(s.request.sampling.logprobs for s in rows)
            top = torch.topk(logp, k_max) if k_max else None
            top_ids = top.indices.tolist() if top is not None else []
            top_lps = top.values.tolist() if top is not None else []
            keep, nxt = [], []
            for r, (seq, tok) in enumerate(zip(rows, toks.tolist(), strict=True)):
                if seq.cancelled:
                    seq.finish = "abort"
                    continue
                seq.append(tok, taken[r], version)
                k = seq.request.sampling.logprobs
                if k:
                    seq.top_ids.append(top_ids[r][:k])
                    seq.top_lps.append(top_lps[r][:k])
                if seq.emit is not None:
                    seq.emit_delta()
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
                cache.batch_select_indices(idx)
                mask, pos = mask[idx], pos[idx]
                rows = [rows[r] for r in keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
            with self._step_lock:
                if self.version != version:
                    # new weights landed between two steps (a keep pause and an update): the
                    # cache holds keys and values of the old ones; recompute it, never reuse it
                    full = torch.tensor([[self.pad_id] * (width - len(s.prompt)) + s.prompt
                                         + s.tokens for s in rows], device=dev)
                    out, cache = self._forward(full, mask, (mask.cumsum(-1) - 1).clamp(min=0),
                                               DynamicCache())
                else:
                    out, cache = self._forward(torch.tensor(nxt, device=dev)[:, None], mask,
                                               pos, cache)
                version = self.version
