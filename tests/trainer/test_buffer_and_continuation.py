"""RolloutBuffer staleness and the continuation of aborted samples (pure functions)."""

from __future__ import annotations

import pytest

from rlfabric.schemas import RolloutRequest, RolloutResult, SamplingParams, VersionSpan
from rlfabric.trainer import continuation, merge
from rlfabric.trainer.buffer import RolloutBuffer


def res(rid: str, spans: list[tuple[int, int, int]], toks: list[int], reason: str = "length"
        ) -> RolloutResult:
    return RolloutResult(request_id=rid, worker_id="w", completion_token_ids=toks,
                         logprobs=[-float(t) for t in toks], finish_reason=reason,
                         version_spans=tuple(VersionSpan(version=v, start=a, end=b)
                                             for v, a, b in spans))


def test_buffer_drops_samples_older_than_max_staleness() -> None:
    buf = RolloutBuffer(max_staleness=1)
    buf.add([res("a", [(5, 0, 2)], [1, 2]), res("b", [(4, 0, 1), (5, 1, 2)], [1, 2]),
             res("c", [(3, 0, 2)], [1, 2])])
    kept = buf.take(current_version=5)
    assert [r.request_id for r in kept] == ["a", "b"] and buf.dropped == 1 and len(buf) == 0
    flag = RolloutBuffer(max_staleness=0, stale="flag")
    flag.add([res("c", [(3, 0, 2)], [1, 2])])
    assert len(flag.take(5)) == 1 and flag.flagged == 1
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutBuffer(max_staleness=-1)


def test_continuation_and_merge_rebuild_one_sample() -> None:
    req = RolloutRequest(request_id="r", prompt_token_ids=[256, 1],
                         sampling=SamplingParams(max_tokens=10, n=4, seed=3))
    part = res("r", [(0, 0, 3)], [7, 8, 9], reason="abort")
    part = RolloutResult(**{**{f: getattr(part, f) for f in part.__struct_fields__},
                            "sample_index": 2})
    cont = continuation(req, part)
    assert cont.prompt_token_ids.tolist() == [256, 1, 7, 8, 9]
    assert cont.sampling.max_tokens == 7 and cont.sampling.n == 1
    assert cont.request_id != req.request_id and cont.metadata["continues"] == "r"
    rest = res(cont.request_id, [(0, 0, 2), (1, 2, 7)], [1, 2, 3, 4, 5, 6, 7])
    m = merge(part, rest)
    assert m.request_id == "r" and m.sample_index == 2
    assert m.completion_token_ids.tolist() == [7, 8, 9, 1, 2, 3, 4, 5, 6, 7]
    assert [(s.version, s.start, s.end) for s in m.version_spans] == [(0, 0, 5), (1, 5, 10)]
    with pytest.raises(ValueError, match="only aborted"):
        continuation(req, rest)
