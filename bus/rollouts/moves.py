"""A sample continued from where it stopped: an `abort` pause cut it short, or a draining
worker handed it over (`RolloutResult.moved`). `continuation()` makes the request that picks up
where it stopped; `merge()` joins the two parts into one result as if it had never stopped
(spans keep the versions that produced each part)."""

from __future__ import annotations

import msgspec

from rlfabric.schemas import RolloutRequest, RolloutResult


def continuation(request: RolloutRequest, partial: RolloutResult) -> RolloutRequest:
    """The request that continues `partial` (a sample of `request` ended by an abort)."""
    if partial.finish_reason != "abort":
        raise ValueError(f"{partial.request_id}/{partial.sample_index} finished with "
                         f"{partial.finish_reason!r}; only aborted samples are continued")
    done = len(partial.completion_token_ids)
    sp = request.sampling
    # nothing kept: the sample's own seed (as sample 0 of n=1), so it samples as it would have
    seed = None if sp.seed is None else sp.seed + partial.sample_index + (
        7919 * (done + 1) if done else 0)
    return msgspec.structs.replace(
        request,
        request_id=f"{request.request_id}~{partial.sample_index}~{done}",
        prompt_token_ids=[*request.prompt_token_ids.tolist(),
                          *partial.completion_token_ids.tolist()],
        sampling=msgspec.structs.replace(sp, n=1, max_tokens=max(1, sp.max_tokens - done),
                                         seed=seed),
        metadata={**request.metadata, "continues": request.request_id,
                  "sample_index": str(partial.sample_index), "offset": str(done)},
    )


def merge(partial: RolloutResult, rest: RolloutResult) -> RolloutResult:
    """`partial` followed by `rest` (the result of its `continuation`), as one sample."""
    off = len(partial.completion_token_ids)
    spans = list(partial.version_spans)
    for s in rest.version_spans:
        moved = msgspec.structs.replace(s, start=s.start + off, end=s.end + off)
        last = spans[-1] if spans else None
        if last is not None and last.end == moved.start and \
                (last.version, last.policy, last.worker) == (moved.version, moved.policy,
                                                             moved.worker):
            spans[-1] = msgspec.structs.replace(last, end=moved.end)
        else:
            spans.append(moved)
    return msgspec.structs.replace(
        rest,
        request_id=partial.request_id,
        sample_index=partial.sample_index,
        completion_token_ids=[*partial.completion_token_ids.tolist(),
                              *rest.completion_token_ids.tolist()],
        logprobs=[*partial.logprobs.tolist(), *rest.logprobs.tolist()],
        version_spans=tuple(spans),
        prompt_len=partial.prompt_len,
        top_logprobs=None,
    )
