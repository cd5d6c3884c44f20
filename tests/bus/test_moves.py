"""A sample a draining worker hands back unfinished (`RolloutResult.moved`) is not an answer:
the client sends it on from the tokens kept (`Awaited`), and its caller gets one result with
every token as first sampled; `restart` sends the prompt again; deltas of the continuation
land after the kept tokens. A worker that left without a word (`Awaited.lost`): its samples go
on from the tokens their deltas brought."""

from __future__ import annotations

import msgspec
import pytest
from helpers import req

from rlfabric.bus.rollouts.awaited import Awaited, Inbox
from rlfabric.schemas import RolloutRequest, RolloutResult, TokenDelta, TokenDeltas, codec_for
from rlfabric.schemas.codec import headers

pytestmark = pytest.mark.anyio


class _Msg:
    """What `Awaited` reads of a nats message."""

    def __init__(self, data: bytes, headers: dict[str, str]) -> None:
        self.data, self.headers, self.subject = data, headers, "results"


def _msg(payload: msgspec.Struct) -> _Msg:
    return _Msg(codec_for(type(payload)).encode(payload), headers())


def _result(r: RolloutRequest, ids: list[int], *, worker: str, moved: str = "",
            finish: str = "length", index: int = 0) -> RolloutResult:
    return RolloutResult(request_id=r.request_id, submission_id=r.submission_id,
                         sample_index=index, worker_id=worker, completion_token_ids=ids,
                         logprobs=[-0.5 - t / 100 for t in ids], finish_reason=finish,
                         moved=moved)


class _Fleet:
    """The plane's side of a move: what it sent on, under submission ids of its own."""

    def __init__(self) -> None:
        self.sent: list[RolloutRequest] = []

    def move(self, r: RolloutRequest) -> RolloutRequest:
        r = msgspec.structs.replace(r, submission_id=f"s{len(self.sent) + 1}")
        self.sent.append(r)
        return r


def _awaiting(r: RolloutRequest) -> tuple[Awaited, _Fleet, Inbox, Inbox]:
    fleet, out, deltas = _Fleet(), Inbox(), Inbox()
    a = Awaited(move=fleet.move)
    a.register([r], out, deltas)
    return a, fleet, out, deltas


def _items(box: Inbox) -> list:
    return list(box._items)


async def _take(a: Awaited, reply: RolloutResult) -> None:
    await a.on_result(_msg(reply))


async def test_a_moved_sample_goes_on_from_its_kept_tokens_and_is_answered_once() -> None:
    r = msgspec.structs.replace(req("r", max_tokens=10, n=2, seed=5), submission_id="s0",
                                stream=True)
    a, fleet, out, deltas = _awaiting(r)
    await _take(a, _result(r, [7, 8, 9], worker="w0", moved="w0", finish="abort", index=1))
    assert _items(out) == [] and len(a) == 2  # not an answer: sent on
    (cont,) = fleet.sent
    assert cont.prompt_token_ids.tolist() == [256, 5, 6, 7, 8, 9]
    assert (cont.sampling.n, cont.sampling.max_tokens) == (1, 7)
    # the continuation's deltas come after the kept tokens, as the sample's own
    await a.on_delta(_msg(TokenDeltas(worker_id="w1", deltas=[TokenDelta(
        request_id=cont.request_id, submission_id="s1", start=0, token_ids=[1, 2],
        logprobs=[-1.0, -1.0])])))
    (d,) = _items(deltas)
    assert (d.request_id, d.sample_index, d.start, d.submission_id) == ("r", 1, 3, "s0")
    await _take(a, _result(cont, [1, 2, 3, 4, 5, 6, 7], worker="w1"))
    await _take(a, _result(r, list(range(10)), worker="w1", index=0))
    got = {x.sample_index: x for x in _items(out)}
    assert sorted(got) == [0, 1] and len(a) == 0
    one = got[1]
    assert one.completion_token_ids.tolist() == [7, 8, 9, 1, 2, 3, 4, 5, 6, 7]
    # the kept tokens' logprobs are the first worker's, bit for bit
    assert one.logprobs.tolist()[:3] == _result(r, [7, 8, 9], worker="w0").logprobs.tolist()
    assert (one.request_id, one.submission_id, one.worker_id, one.moved) == ("r", "s0", "w1", "")


async def test_a_sample_moved_twice_keeps_both_parts() -> None:
    r = msgspec.structs.replace(req("r", max_tokens=6), submission_id="s0")
    a, fleet, out, _ = _awaiting(r)
    await _take(a, _result(r, [1, 2], worker="w0", moved="w0", finish="abort"))
    await _take(a, _result(fleet.sent[0], [3], worker="w1", moved="w1", finish="abort"))
    second = fleet.sent[1]
    assert second.prompt_token_ids.tolist() == [256, 5, 6, 1, 2, 3]
    assert second.sampling.max_tokens == 3
    await _take(a, _result(second, [4, 5, 6], worker="w2"))
    (one,) = _items(out)
    assert one.completion_token_ids.tolist() == [1, 2, 3, 4, 5, 6] and one.worker_id == "w2"


async def test_restart_sends_the_prompt_again_and_a_full_sample_is_answered_as_it_is() -> None:
    r = msgspec.structs.replace(req("r", max_tokens=4), submission_id="s0", migration="restart")
    a, fleet, out, _ = _awaiting(r)
    await _take(a, _result(r, [1, 2], worker="w0", moved="w0", finish="abort"))
    (again,) = fleet.sent
    assert again.prompt_token_ids.tolist() == [256, 5, 6] and again.sampling.max_tokens == 4
    await _take(a, _result(again, [9, 9, 9, 9], worker="w1"))
    assert [x.completion_token_ids.tolist() for x in _items(out)] == [[9, 9, 9, 9]]
    # a sample handed back with all its tokens needs no continuation
    full = msgspec.structs.replace(req("f", max_tokens=2), submission_id="s9")
    a.register([full], out, None)
    await _take(a, _result(full, [5, 6], worker="w0", moved="w0", finish="abort"))
    assert len(fleet.sent) == 1 and _items(out)[-1].finish_reason == "length"


async def test_a_caller_that_gives_up_forgets_the_continuation_and_cancels_it_too() -> None:
    r = msgspec.structs.replace(req("r", max_tokens=8), submission_id="s0")
    a, fleet, out, _ = _awaiting(r)
    await _take(a, _result(r, [1], worker="w0", moved="w0", finish="abort"))
    assert a.unanswered([r]) == ["s0", "s1"]
    a.forget([r])
    assert len(a) == 0
    await _take(a, _result(fleet.sent[0], [2] * 7, worker="w1"))
    assert _items(out) == [] and a.duplicates_dropped == 1


def _delta(r: RolloutRequest, start: int, ids: list[int], index: int = 0,
           policy: str = "p/3") -> TokenDelta:
    return TokenDelta(request_id=r.request_id, submission_id=r.submission_id,
                      sample_index=index, start=start, token_ids=ids,
                      logprobs=[-0.5 - t / 100 for t in ids], version=3, policy=policy)


async def test_a_lost_workers_samples_go_on_from_the_tokens_their_deltas_brought() -> None:
    r = msgspec.structs.replace(req("r", max_tokens=10, n=3, seed=5), submission_id="s0")
    a, fleet, out, deltas = _awaiting(r)
    await a.on_delta(_msg(TokenDeltas(worker_id="w0", deltas=[
        _delta(r, 0, [1, 2]), _delta(r, 2, [3]), _delta(r, 0, [1, 2]),  # one sent again
        _delta(r, 0, [4], index=1), _delta(r, 2, [6], index=1)])))  # a gap after [4]
    assert _items(deltas) == []  # not streamed: progress only, never the caller's
    await _take(a, _result(r, [7] * 10, worker="w0", index=2))  # answered before it left
    assert a.lost(["r"]) == ([], ["s0"])
    c0, c1 = fleet.sent
    assert c0.prompt_token_ids.tolist() == [256, 5, 6, 1, 2, 3] and c0.sampling.max_tokens == 7
    assert c1.prompt_token_ids.tolist() == [256, 5, 6, 4] and c1.sampling.max_tokens == 9
    assert a.lost(["r"]) == ([], ["s0"]) and len(fleet.sent) == 2  # both on their way
    await _take(a, _result(c0, [8] * 7, worker="w1"))
    await _take(a, _result(c1, [9] * 9, worker="w1"))
    got = {x.sample_index: x for x in _items(out)}
    assert got[0].completion_token_ids.tolist() == [1, 2, 3] + [8] * 7
    assert got[1].completion_token_ids.tolist() == [4] + [9] * 9
    spans = got[0].version_spans
    assert [(s.start, s.end, s.worker, s.policy) for s in spans[:1]] == [(0, 3, "w0", "p/3")]
    assert len(a) == 0


async def test_a_lost_sample_with_no_tokens_starts_on_its_own_seed_and_restart_is_queued(
        ) -> None:
    r = msgspec.structs.replace(req("r", max_tokens=4, n=2, seed=5), submission_id="s0")
    a, fleet, _, _ = _awaiting(r)
    assert a.lost(["r"]) == ([], ["s0"])
    assert [(c.prompt_token_ids.tolist(), c.sampling.seed) for c in fleet.sent] == [
        ([256, 5, 6], 5), ([256, 5, 6], 6)]  # as samples 0 and 1 of the original would
    q = msgspec.structs.replace(req("q", max_tokens=4), submission_id="s9",
                                migration="restart")
    a.register([q], Inbox(), None)
    assert a.lost(["q", "gone"]) == (["q"], [])


async def test_a_lost_sample_whose_last_delta_ended_it_is_answered_as_it_ended() -> None:
    r = msgspec.structs.replace(req("r", max_tokens=10), submission_id="s0")
    a, fleet, out, _ = _awaiting(r)
    ended = msgspec.structs.replace(_delta(r, 0, [1, 2, 260]), finish="stop")
    await a.on_delta(_msg(TokenDeltas(worker_id="w0", deltas=[ended])))
    assert a.lost(["r"]) == ([], ["s0"])
    (one,) = _items(out)
    assert fleet.sent == [] and len(a) == 0  # nothing went on past its end
    assert (one.completion_token_ids.tolist(), one.finish_reason, one.moved) == (
        [1, 2, 260], "stop", "")


async def test_a_second_workers_deltas_are_never_spliced_and_a_moved_samples_late_ones_dropped(
        ) -> None:
    r = msgspec.structs.replace(req("r", max_tokens=10), submission_id="s0", stream=True)
    a, fleet, _, deltas = _awaiting(r)
    await a.on_delta(_msg(TokenDeltas(worker_id="w0", deltas=[_delta(r, 0, [1, 2])])))
    # the same submission sampled by w1 too (delivered again): its tokens are not w0's
    await a.on_delta(_msg(TokenDeltas(worker_id="w1", deltas=[_delta(r, 0, [5]),
                                                               _delta(r, 2, [6])])))
    assert a.lost(["r"]) == ([], ["s0"])
    (cont,) = fleet.sent
    assert cont.prompt_token_ids.tolist() == [256, 5, 6, 1, 2]  # w0's part only
    n = len(_items(deltas))
    # w0 back from a partition: its late deltas of the sample sent on reach nobody
    await a.on_delta(_msg(TokenDeltas(worker_id="w0", deltas=[_delta(r, 2, [3])])))
    assert len(_items(deltas)) == n


async def test_a_sample_sent_on_is_answered_by_its_continuation_not_a_late_first_run() -> None:
    r = msgspec.structs.replace(req("r", max_tokens=4), submission_id="s0")
    a, fleet, out, _ = _awaiting(r)
    await a.on_delta(_msg(TokenDeltas(worker_id="w0", deltas=[_delta(r, 0, [1, 2])])))
    assert a.lost(["r"]) == ([], ["s0"])
    # w0 was cut off, not dead: it missed the cancel and answers after all
    await _take(a, _result(r, [1, 2, 7, 7], worker="w0"))
    assert _items(out) == [] and a.duplicates_dropped == 1
    await _take(a, _result(fleet.sent[0], [3, 4], worker="w1"))
    (one,) = _items(out)
    assert one.completion_token_ids.tolist() == [1, 2, 3, 4] and one.worker_id == "w1"
    assert len(a) == 0
