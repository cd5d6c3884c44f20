"""vLLM's side of a request: the sampling parameters of one sample, the deltas sent while it
is sampled, and the `RolloutResult` made of vLLM's output (tokens, raw logprobs, top-k
alternatives, per-token weight versions)."""

from __future__ import annotations

from typing import Any

from rlfabric.engines.protocol import PROGRESS_TOKENS, TokenSink
from rlfabric.schemas import (
    PackedF32,
    PackedI32,
    RolloutRequest,
    RolloutResult,
    Timings,
    TokenDelta,
    TopLogprobs,
    VersionSpan,
)

#: vLLM's version name before any update_weight_version call
INITIAL = "default"


def sampling_params(request: RolloutRequest, index: int, *, deltas: bool,
                    eos: frozenset[int]) -> Any:
    """vLLM's SamplingParams for sample `index` of `request`."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = request.sampling
    seed = None if sp.seed is None else (sp.seed + index) % (1 << 63)
    return SamplingParams(
        n=1, max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p,
        top_k=sp.top_k, seed=seed, logprobs=sp.logprobs,
        stop_token_ids=sorted(set(sp.stop_token_ids) | eos),
        # with deltas: the output so far every step (streamed) or every PROGRESS_TOKENS,
        # the new tokens sent as a delta
        output_kind=(RequestOutputKind.CUMULATIVE if deltas
                     else RequestOutputKind.FINAL_ONLY),
        stream_interval=None if request.stream else PROGRESS_TOKENS, detokenize=False)


def send_delta(request: RolloutRequest, index: int, out: Any, sent: int, version: int,
               on_tokens: TokenSink) -> int:
    """Send the tokens of cumulative output `out` past `sent`; returns how many are sent.
    `version` is the one loaded now (the result's spans are vLLM's own, per token)."""
    o = out.outputs[0]
    ids = list(o.token_ids[sent:])
    if not ids:
        return sent
    rows = (o.logprobs or [])[sent:]
    lps = [rows[i][t].logprob if i < len(rows) else 0.0 for i, t in enumerate(ids)]
    k = request.sampling.logprobs
    top = top_logprobs(rows, k) if k else None
    on_tokens(TokenDelta(request_id=request.request_id, sample_index=index, start=sent,
                         token_ids=PackedI32(ids), logprobs=PackedF32(lps),
                         version=version, top_logprobs=top,
                         finish=o.finish_reason if o.finish_reason in ("stop", "length")
                         else ""))
    return sent + len(ids)


def to_result(request: RolloutRequest, index: int, worker_id: str, final: Any,
              gen_s: float) -> RolloutResult:
    """The result of vLLM's last output `final` of a sample (None: it never started, an
    abort)."""
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
        spans = tuple(VersionSpan(version=version_of(s.version), start=s.start, end=s.end)
                      for s in (out.weight_versions or ()))
        top = top_logprobs(rows, k) if k else None
    return RolloutResult(
        request_id=request.request_id, sample_index=index, worker_id=worker_id,
        completion_token_ids=PackedI32(tokens), logprobs=PackedF32(lps),
        finish_reason=finish,  # type: ignore[arg-type]  # narrowed to stop|length|abort above
        version_spans=spans, top_logprobs=top, group_id=request.group_id,
        prompt_len=len(request.prompt_token_ids),
        timings=Timings(generate_s=gen_s, total_s=gen_s))


def top_logprobs(rows: list[Any], k: int) -> TopLogprobs:
    """The top-k alternatives of vLLM's logprob rows ({token id: Logprob}), row-major."""
    ids: list[int] = []
    vals: list[float] = []
    for row in rows:
        best = sorted((lp.rank, tid, lp.logprob) for tid, lp in row.items()
                      if lp.rank is not None and lp.rank <= k)[:k]
        ids += [tid for _, tid, _ in best]
        vals += [v for _, _, v in best]
    return TopLogprobs(k=k, ids=PackedI32(ids), logprobs=PackedF32(vals))


def version_of(name: str) -> int:
    """rlfabric's weight version of vLLM's version name."""
    return -1 if name == INITIAL else int(name)
