"""One sample being generated, and the result it becomes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlfabric.schemas import (
    FinishReason,
    PackedF32,
    PackedI32,
    RolloutRequest,
    RolloutResult,
    Timings,
    TokenDelta,
    TopLogprobs,
    VersionSpan,
)


@dataclass(eq=False)
class Sequence:
    request: RolloutRequest
    sample_index: int
    prompt: list[int]
    generator: torch.Generator
    sink: Any  # anyio MemoryObjectSendStream of the request's results
    stop_ids: frozenset[int]
    worker_id: str = ""
    cancelled: bool = False
    t_admitted: float = field(default_factory=time.monotonic)
    t_started: float = 0.0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_lps: list[list[float]] = field(default_factory=list)
    spans: list[list[int]] = field(default_factory=list)  # [version, start, end]
    finish: FinishReason | None = None
    #: hands the tokens sampled over (thread-safe: to the event loop), every `every` tokens:
    #: each step for a streamed request, now and then for others (what a worker that takes
    #: the sample over should this one die goes on from)
    emit: Callable[[TokenDelta], None] | None = None
    every: int = 1
    sent: int = 0  # tokens already emitted
    #: the adapter version it runs under (a `LoraWeights`), pinned at admission; None: base
    lora: Any = None

    def append(self, token: int, logprob: float, version: int) -> None:
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] += 1
        else:
            self.spans.append([version, len(self.tokens), len(self.tokens) + 1])
        self.tokens.append(token)
        self.logprobs.append(logprob)

    def emit_delta(self) -> None:
        """Hand the tokens sampled since the last delta to `emit` (decode thread)."""
        start, end = self.sent, len(self.tokens)
        if self.emit is None or end - start < self.every:
            return
        self.sent = end
        k = self.request.sampling.logprobs
        top = None
        if k > 0:
            top = TopLogprobs(k=k, ids=PackedI32([i for row in self.top_ids[start:] for i in row]),
                              logprobs=PackedF32([v for row in self.top_lps[start:] for v in row]))
        self.emit(TokenDelta(request_id=self.request.request_id, sample_index=self.sample_index,
                             start=start, token_ids=PackedI32(self.tokens[start:]),
                             logprobs=PackedF32(self.logprobs[start:]), version=self.spans[-1][0],
                             top_logprobs=top, finish=self.finish or ""))

    def result(self) -> RolloutResult:
        sp = self.request.sampling
        top = None
        if sp.logprobs > 0:
            flat_ids = [i for row in self.top_ids for i in row]
            flat_lps = [v for row in self.top_lps for v in row]
            top = TopLogprobs(k=sp.logprobs, ids=PackedI32(flat_ids),
                              logprobs=PackedF32(flat_lps))
        now = time.monotonic()
        started = self.t_started or now
        return RolloutResult(
            request_id=self.request.request_id,
            sample_index=self.sample_index,
            worker_id=self.worker_id,
            completion_token_ids=PackedI32(self.tokens),
            logprobs=PackedF32(self.logprobs),
            finish_reason=self.finish or "abort",
            version_spans=tuple(VersionSpan(version=v, start=s, end=e) for v, s, e in self.spans),
            top_logprobs=top,
            group_id=self.request.group_id,
            prompt_len=len(self.prompt),
            timings=Timings(queued_s=started - self.t_admitted, generate_s=now - started,
                            total_s=now - self.t_admitted),
        )
