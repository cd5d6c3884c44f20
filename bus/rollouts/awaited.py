"""What a client awaits: each submitted request until every sample is answered, results and
token deltas handed to their caller exactly once, samples still missing at their deadline as
typed errors (`RolloutPlane` submits; this is the one place that knows what is outstanding).

A redelivered request can produce a result twice, and a reused request id is a new
submission: results are matched by (request_id, submission_id, sample_index) here.

A sample a draining worker hands over unfinished (`RolloutResult.moved`) is not an answer: its
continuation (`moves.continuation`, or its prompt again for `migration="restart"`) is sent and
awaited here, and its caller gets one result, the kept tokens merged with the rest. A sample
whose worker left without a word (`lost`) is handed over the same way, from the tokens its
deltas brought (`_Progress`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, cast

import msgspec
from nats.aio.msg import Msg

from rlfabric.bus.rollouts.moves import continuation, merge
from rlfabric.schemas import (
    ErrorCode,
    FinishReason,
    PackedF32,
    PackedI32,
    RolloutError,
    RolloutReplies,
    RolloutReply,
    RolloutRequest,
    RolloutResult,
    SchemaError,
    TokenDelta,
    TokenDeltas,
    VersionSpan,
    codec_for,
)
from rlfabric.schemas.validation import InvalidRequest
from rlfabric.telemetry import instruments

#: metric attributes of a result handed over, and of the trainer's queue depth
_OK = {"outcome": "ok"}
TRAINER = {"rlfabric.role": "trainer"}


def _in_flight(ids: list[str]) -> str:
    return (f"request_id {', '.join(map(repr, ids[:5]))} is already in flight from this "
            "client: ids must be unique among the requests awaiting results")


class Sink(Protocol):
    def send_nowait(self, item: RolloutReply, /) -> None: ...


class NoMembers:
    """Put in a waiting call's inbox when the job's last worker left (`RolloutPlane`)."""


NO_MEMBERS = NoMembers()
#: what a `generate` call's inbox holds: results, errors, token deltas when asked for, and
#: word that the job has no member left
Item = RolloutReply | TokenDelta | NoMembers


class Inbox:
    """Where one `generate` call's results land. Unlike a memory object stream, whose every
    `receive` yields to the event loop first, `get` returns what is there at once and waits
    (on a loop future made then: an `anyio.Event` wraps an `asyncio.Event` that makes one)
    only when nothing is: one task switch a result at most."""

    __slots__ = ("_error", "_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Item] = deque()
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def send_nowait(self, item: Item, /) -> None:
        self._items.append(item)
        self._wake()

    def stored(self, error: BaseException | None) -> None:
        """The call's requests are stored; or they could not be (`error`): `get` raises it."""
        if error is not None:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # cancelled with its waiting task: nobody to wake
                waiter.set_result(None)

    async def get(self) -> Item:
        while not self._items:
            if self._error is not None:
                raise self._error
            self._waiter = waiter = asyncio.get_running_loop().create_future()
            await waiter
        return self._items.popleft()


@dataclass(slots=True)
class _Progress:
    """A sample's tokens as its deltas brought them, in order from its first: what it goes on
    from should its worker leave. `broken`: a delta was lost, or another worker sent one (no
    longer extended)."""

    worker: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[VersionSpan] = field(default_factory=list)
    broken: bool = False
    #: how it ended, where its last delta said so ("": going on)
    finish: str = ""

    def add(self, delta: TokenDelta, worker: str) -> None:
        start, ids = delta.start, delta.token_ids.tolist()
        if worker != self.worker:  # two workers sampling one submission: neither is kept
            self.broken = True
        if self.broken or start + len(ids) <= len(self.tokens):
            return  # sent again: held already
        if start != len(self.tokens):
            self.broken = True
            return
        end = start + len(ids)
        self.finish = delta.finish
        self.tokens += ids
        self.logprobs += delta.logprobs.tolist()
        last = self.spans[-1] if self.spans else None
        if last is not None and (last.version, last.policy) == (delta.version, delta.policy):
            self.spans[-1] = msgspec.structs.replace(last, end=end)
        else:
            self.spans.append(VersionSpan(version=delta.version, start=start, end=end,
                                          policy=delta.policy, worker=self.worker))


@dataclass(eq=False, slots=True)
class _Waiting:
    """One submitted request: which samples arrived, and where its results go."""

    request: RolloutRequest
    sink: Sink
    got: set[int] = field(default_factory=set)  # complete at `request.sampling.n`
    #: where this request's token deltas go (None: dropped)
    deltas: Inbox | None = None
    #: a continuation: the request it continues, that one's sample index, the tokens kept
    of: tuple[_Waiting, int, RolloutResult] | None = None
    #: the continuations of this request's samples still awaited (request ids)
    conts: list[str] = field(default_factory=list)
    #: by sample index: the tokens sampled so far, as their deltas came
    progress: dict[int, _Progress] = field(default_factory=dict)
    #: the samples sent on (their continuations answer them): late deltas and results of
    #: their first run dropped
    moved: set[int] = field(default_factory=set)


class Awaited:
    def __init__(self, answered: Callable[[str], None] | None = None,
                 taken: Callable[[str, str], None] | None = None,
                 move: Callable[[RolloutRequest], RolloutRequest] | None = None) -> None:
        #: told each request id that is awaited no more (answered, or given up)
        self._answered = answered
        #: told (request id, worker id) when a worker says it took an awaited request
        self._taken = taken
        #: sends a handed-over sample's continuation, and returns it as sent (None: a moved
        #: sample is answered as it came)
        self._move = move
        #: told the worker of each token-delta message (`QuietWorkers`)
        self.on_worker: Callable[[str], None] | None = None
        self.duplicates_dropped = 0
        self._waiting: dict[str, _Waiting] = {}
        self._codec = codec_for(RolloutReply | RolloutReplies)
        self._delta_codec = codec_for(TokenDeltas)

    def __len__(self) -> int:
        return len(self._waiting)

    def request(self, request_id: str) -> RolloutRequest | None:
        w = self._waiting.get(request_id)
        return None if w is None else w.request

    def register(self, prepared: list[RolloutRequest], sink: Sink,
                 deltas: Inbox | None) -> None:
        """Await `prepared` (`InvalidRequest` if an id repeats or is awaited already)."""
        waiting = self._waiting
        if len(prepared) == 1:  # one call, one request: the agent lanes' case
            clash = prepared[0].request_id in waiting
        else:
            ids = [r.request_id for r in prepared]
            clash = len(set(ids)) != len(ids) or any(rid in waiting for rid in ids)
        if clash:
            ids = [r.request_id for r in prepared]
            raise InvalidRequest(_in_flight(
                sorted({rid for rid in ids if ids.count(rid) > 1 or rid in waiting})))
        for req in prepared:
            waiting[req.request_id] = _Waiting(req, sink, deltas=deltas)
        instruments.current.queue_depth.set(len(waiting), TRAINER)

    def fail(self, ids: Iterable[str], code: str, message: str) -> list[RolloutError]:
        """An error for each sample of `ids` still awaited; those are awaited no more."""
        out = []
        for rid in ids:
            w = self._pop(rid)
            if w is None:
                continue
            for i in range(w.request.sampling.n):
                if i not in w.got:
                    out.append(RolloutError(
                        request_id=rid, worker_id="", code=code, sample_index=i,
                        group_id=w.request.group_id, retryable=True,
                        submission_id=w.request.submission_id, message=message))
            if self._answered is not None:
                self._answered(rid)
        return out

    def unanswered(self, prepared: Iterable[RolloutRequest]) -> list[str]:
        """The submission ids of `prepared` still awaited (a sample of theirs has not come),
        and of their continuations."""
        out = []
        for r in prepared:
            w = self._waiting.get(r.request_id)
            if w is not None and w.request.submission_id == r.submission_id:
                out.append(r.submission_id)
                out += [c.request.submission_id for rid in w.conts
                        if (c := self._waiting.get(rid)) is not None]
        return out

    def forget(self, prepared: Iterable[RolloutRequest]) -> None:
        for r in prepared:
            self._pop(r.request_id)
            if self._answered is not None:
                self._answered(r.request_id)  # taken ones: their results are not awaited

    def _pop(self, request_id: str) -> _Waiting | None:
        """Await `request_id` no more, nor its continuations."""
        w = self._waiting.pop(request_id, None)
        if w is not None:
            for rid in w.conts:
                self._waiting.pop(rid, None)
                if self._answered is not None:
                    self._answered(rid)
        return w

    async def on_result(self, msg: Msg) -> None:
        try:
            reply = self._codec.decode(msg.data, msg.headers, subject=msg.subject)
        except SchemaError:
            return
        waiting = len(self._waiting)
        if isinstance(reply, RolloutReplies):
            ok = 0
            for one in reply.replies:
                ok += self._take(one)
        else:
            ok = self._take(reply)
        # counted a message at a time, not a result at a time
        if ok:
            instruments.current.results.add(ok, _OK)
        if len(self._waiting) != waiting:
            instruments.current.queue_depth.set(len(self._waiting), TRAINER)

    async def on_delta(self, msg: Msg) -> None:
        try:
            batch = self._delta_codec.decode(msg.data, msg.headers, subject=msg.subject)
        except SchemaError:
            return
        if self.on_worker is not None and batch.deltas:
            self.on_worker(batch.worker_id)
        waiting = self._waiting
        if batch.taken and self._taken is not None:
            for rid, sid in batch.taken.items():
                w = waiting.get(rid)
                if w is not None and w.request.submission_id == sid and \
                        len(w.got) < w.request.sampling.n:
                    self._taken(rid, batch.worker_id)
        for delta in batch.deltas:
            w = waiting.get(delta.request_id)
            if w is None or delta.submission_id != w.request.submission_id:
                continue
            if delta.sample_index in w.moved:  # e.g. a worker back from a partition
                continue
            p = w.progress.get(delta.sample_index)
            if p is None:
                p = w.progress[delta.sample_index] = _Progress(batch.worker_id)
            p.add(delta, batch.worker_id)
            if not w.request.stream:  # progress only: the caller asked for no deltas
                continue
            if w.of is not None:  # a continuation's tokens: its sample's, after those kept
                w, i, kept = w.of
                delta = msgspec.structs.replace(
                    delta, request_id=w.request.request_id, sample_index=i,
                    submission_id=w.request.submission_id,
                    start=delta.start + len(kept.completion_token_ids))
            if w.deltas is not None and delta.sample_index not in w.got:
                w.deltas.send_nowait(delta)

    def _take(self, reply: RolloutReply) -> int:
        """Hand `reply` to its caller; 1 if it was a result (0: an error, or dropped)."""
        w = self._waiting.get(reply.request_id)
        if w is None or reply.submission_id != w.request.submission_id:
            # a late duplicate of a finished request, or an earlier submission of a reused id
            self.duplicates_dropped += 1
            return 0
        if w.of is not None:
            return self._take_continued(w, reply)
        got = w.got
        ok = 0
        if isinstance(reply, RolloutResult):  # one sample's answer: the common case
            # sent on: its continuation answers it (a first run's late result is not the one
            # whose tokens went on streaming)
            if reply.sample_index in got or reply.sample_index in w.moved:
                self.duplicates_dropped += 1
                return 0
            if reply.moved and self._move is not None:
                return self._moved(w, reply)
            got.add(reply.sample_index)
            w.sink.send_nowait(reply)
            ok = 1
        elif not self._take_errors(w, reply):
            self.duplicates_dropped += 1
            return 0
        if len(got) >= w.request.sampling.n:
            del self._waiting[reply.request_id]
            if self._answered is not None:
                self._answered(reply.request_id)
        return ok

    def holders(self) -> set[str]:
        """The workers whose deltas brought samples still going on (not ended, not sent on)."""
        return {p.worker for w in self._waiting.values() for i, p in w.progress.items()
                if not p.finish and i not in w.got and i not in w.moved}

    def lost(self, request_ids: list[str]) -> tuple[list[str], list[str]]:
        """Requests whose worker left before answering: each sample still missing is sent on
        from the tokens its deltas brought (`migration="continue"`). Returns the ids to queue
        again as they are (`restart`), and the submission ids sent on (for a copy the stream
        delivers again to be skipped)."""
        if self._move is None:
            return request_ids, []
        again, moved = [], []
        for rid in request_ids:
            w = self._waiting.get(rid)
            if w is None:
                continue
            req = w.request
            if req.migration != "continue":
                again.append(rid)
                continue
            moved.append(req.submission_id)
            for i in range(req.sampling.n):
                if i in w.got or i in w.moved:
                    continue
                p = w.progress.get(i) or _Progress("")
                # one that ended before its result came is answered as it ended
                self._take(RolloutResult(
                    request_id=rid, sample_index=i, worker_id=p.worker,
                    completion_token_ids=PackedI32(p.tokens), logprobs=PackedF32(p.logprobs),
                    finish_reason=cast(FinishReason, p.finish or "abort"),
                    version_spans=tuple(p.spans), group_id=req.group_id,
                    prompt_len=len(req.prompt_token_ids), submission_id=req.submission_id,
                    moved="" if p.finish else p.worker or "a worker that left"))
        return again, moved

    def _moved(self, w: _Waiting, kept: RolloutResult) -> int:
        """Sample `kept.sample_index` of `w` was handed over unfinished: sent again to go on
        from `kept` (or from its prompt: `restart`); answered when that ends."""
        assert self._move is not None
        req, i = w.request, kept.sample_index
        if self._answered is not None:  # its worker let it go: not to be put back when it leaves
            self._answered(req.request_id)
        if len(kept.completion_token_ids) >= req.sampling.max_tokens:  # nothing left to sample
            return self._take(msgspec.structs.replace(kept, finish_reason="length", moved=""))
        if req.migration == "restart":
            kept = msgspec.structs.replace(kept, completion_token_ids=[], logprobs=[],
                                           version_spans=(), top_logprobs=None)
        try:
            cont = self._move(continuation(req, kept))
        except Exception as exc:  # e.g. the client is closing: the sample fails, typed
            return self._take(RolloutError(
                request_id=req.request_id, worker_id=kept.worker_id, code=ErrorCode.NOT_MOVED,
                sample_index=i, group_id=req.group_id, retryable=True,
                submission_id=req.submission_id,
                message=f"sample {i} of {req.request_id} was handed back by {kept.moved}, "
                        f"which is leaving, and could not be sent on: {exc}"))
        self._waiting[cont.request_id] = _Waiting(cont, w.sink, deltas=w.deltas,
                                                  of=(w, i, kept))
        w.conts.append(cont.request_id)
        w.moved.add(i)
        return 0

    def _take_continued(self, c: _Waiting, reply: RolloutReply) -> int:
        """The reply to continuation `c`: the sample it continues answered, as one."""
        assert c.of is not None
        w, i, kept = c.of
        del self._waiting[c.request.request_id]
        if c.request.request_id in w.conts:
            w.conts.remove(c.request.request_id)
        if self._answered is not None:
            self._answered(c.request.request_id)
        if self._waiting.get(w.request.request_id) is not w or i in w.got:
            self.duplicates_dropped += 1  # its sample was answered or given up meanwhile
            return 0
        ids = {"request_id": w.request.request_id, "sample_index": i,
               "submission_id": w.request.submission_id}
        w.moved.discard(i)  # answered by this, or sent on again
        if isinstance(reply, RolloutError):
            return self._take(msgspec.structs.replace(reply, **ids))
        whole = msgspec.structs.replace(merge(kept, reply), **ids)
        if reply.moved and self._move is not None:  # handed over again
            return self._moved(w, whole)
        return self._take(whole)

    def _take_errors(self, w: _Waiting, reply: RolloutError) -> bool:
        """Hand over an error (one per sample still missing if it is for the whole request);
        False if every sample it answers was answered already."""
        if reply.sample_index is None:
            replies = [msgspec.structs.replace(reply, sample_index=i)
                       for i in range(w.request.sampling.n) if i not in w.got]
        else:
            replies = [reply] if reply.sample_index not in w.got else []
        results = instruments.current.results
        for r in replies:
            w.got.add(r.sample_index or 0)
            w.sink.send_nowait(r)
            results.add(1, {"outcome": r.code})
        return bool(replies)

    def next_deadline(self, ids: list[str]) -> float | None:
        """Seconds until the first deadline of `ids` still awaited (None: none has one)."""
        deadlines = [w.request.deadline for rid in ids
                     if (w := self._waiting.get(rid)) and w.request.deadline]
        return max(0.0, min(deadlines) - time.time()) if deadlines else None

    def expire(self, ids: list[str]) -> list[RolloutError]:
        """An error for each sample of `ids` past its deadline; those are awaited no more."""
        out = []
        now = time.time()
        for rid in ids:
            w = self._waiting.get(rid)
            if w is None or not w.request.deadline or w.request.deadline > now:
                continue
            for i in range(w.request.sampling.n):
                if i not in w.got:
                    out.append(RolloutError(
                        request_id=rid, worker_id="", code=ErrorCode.DEADLINE_EXCEEDED,
                        sample_index=i,
                        group_id=w.request.group_id, retryable=True,
                        submission_id=w.request.submission_id,
                        message=f"no result for sample {i} of {rid} by its deadline"))
            self._pop(rid)
        return out
