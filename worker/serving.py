"""Serving admitted requests and storing their results, then acking their message.

Two ways to the engine, chosen by what it can do, never by whether tracing is on:
- an engine that serves many requests in one call (`ServesMany`: the null and torch engines)
  gets a message's requests together, one task per message (`_serve_many`);
- otherwise (vLLM) `2 x capacity` lanes take the requests one by one (`_lane`; no task per
  request; a lane holds its request while its results are stored, so the engine has room for
  another meanwhile).

Every result is persisted (PubAck) before its message is acked, so a worker that dies
mid-request loses nothing: the message is redelivered to another (and the client drops
results it already has). Results that finish together go out as one `RolloutReplies` per
client (`Outbox`; a decode batch's from the serving task at once). A message with a request
that must be served again (handed back, waiting for a weight version) is naked once all its
requests are answered. Tracing adds spans around the same calls: per request, `process`
(a child of the call that sent it), `<engine> generate` and a `send` per stored result.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import nats.errors
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from opentelemetry.trace import INVALID_SPAN, Span

from rlfabric.bus import Bus
from rlfabric.bus.errors import PayloadTooLarge
from rlfabric.bus.nats.outbox import Outbox
from rlfabric.engines.protocol import Engine, ServesMany
from rlfabric.schemas import RolloutReplies, RolloutRequest, RolloutResult
from rlfabric.telemetry import instruments, spans
from rlfabric.worker.admission import HAND_BACK, Admission
from rlfabric.worker.cancels import Cancels
from rlfabric.worker.credits import Credits
from rlfabric.worker.delivery import Delivery, result_id, traces
from rlfabric.worker.jobs import JobScopes
from rlfabric.worker.liveness import KeepAlive
from rlfabric.worker.policies import Policies
from rlfabric.worker.residency import Residency
from rlfabric.worker.streaming import DeltaSender

log = logging.getLogger("rlfabric.worker.rollouts")

#: what a lane takes: a delivery, one of its requests, and that request's trace context
Work = tuple[Delivery, RolloutRequest, dict[str, str] | None]
#: a message's admitted requests by id: the request and the subject its results go to
_Todo = dict[str, tuple[RolloutRequest, str]]


@dataclass(eq=False)
class _Many:
    """A message's requests in one `generate_many` call: per request id, its samples not yet
    stored (or never to come), its samples generated, and the first error that stopped one."""

    left: dict[str, int]
    posted: dict[str, int]
    #: a request's every sample stored (or never to come); True: all were generated
    request_done: Callable[[bool], None]
    generated: set[str] = field(default_factory=set)  # every sample generated
    errors: dict[str, BaseException] = field(default_factory=dict)
    settled: anyio.Event = field(default_factory=anyio.Event)

    def settle(self, rid: str, samples: int = 1) -> None:
        if rid not in self.left:  # an engine that yields a sample twice: nothing left
            return
        self.left[rid] -= samples
        if self.left[rid] == 0:
            del self.left[rid]
            self.request_done(rid in self.generated)
            if not self.left:
                self.settled.set()

    def stored(self, rids: Iterable[str], error: BaseException | None) -> None:
        """The outbox's answer for a result of each of `rids`: stored, or `error` stopped it."""
        for rid in rids:
            if error is not None:
                self.errors.setdefault(rid, error)
            self.settle(rid)


@dataclass(eq=False)
class _Progress:
    generated: bool = False  # every sample generated (counted in `Credits.storing`)


class Serving:
    def __init__(self, bus: Bus, engine: Engine, worker_id: str, *, credits: Credits,
                 admission: Admission, deltas: DeltaSender, alive: KeepAlive,
                 policies: Policies, jobs: JobScopes, residency: Residency) -> None:
        self.bus = bus
        #: requests their clients gave up on: stopped, or skipped
        self.cancels = Cancels(bus.subjects)
        #: the adapters admitted requests hold resident, released once generated
        self.residency = residency
        #: a job's abort pause cancels its requests' generation (they go back to the stream)
        self.jobs = jobs
        #: names each result's version spans by the policy behind them
        self.policies = policies
        self.engine = engine
        self.worker_id = worker_id
        self.credits = credits
        self.admission = admission
        self.deltas = deltas
        self.alive = alive
        #: results go out through it, coalesced per client (`outbox.messages`, `.items`)
        self.outbox = Outbox(bus, combine=lambda replies: RolloutReplies(replies=replies))
        self.served = 0
        #: leaving with `move`: samples the engine's abort ends go back to their clients,
        #: marked to be continued elsewhere
        self.moving = False
        self._many: ServesMany | None = engine if isinstance(engine, ServesMany) else None
        self._tg: TaskGroup | None = None
        self._send: MemoryObjectSendStream[Work] | None = None

    async def start(self, tg: TaskGroup) -> MemoryObjectSendStream[Work]:
        """Start the outbox and the lanes in `tg`. Closing what this returns ends the lanes
        once they finished what they hold."""
        self._tg = tg
        await tg.start(self.outbox.run)
        # a message may hold several requests: the lanes' queue takes whatever came
        send, recv = anyio.create_memory_object_stream[Work](math.inf)
        for _ in range(2 * self.credits.capacity):
            tg.start_soon(self._lane, recv.clone())
        recv.close()
        self._send = send
        return send

    def dispatch(self, d: Delivery, reqs: list[RolloutRequest]) -> None:
        """A taken message's requests to the engine: in one call, or to the lanes."""
        assert self._tg is not None and self._send is not None
        # a message naming several adapters on an engine that holds few: one request at a
        # time, so that none waits for room another of the same message holds
        if self._many is not None and len({r.request_id for r in reqs}) == len(reqs) and \
                (not self.residency.limit or len({r.adapter for r in reqs}) == 1):
            self._tg.start_soon(self._serve_many, d, reqs)
            return
        for req, ctx in zip(reqs, traces(d.msg.headers, len(reqs)), strict=True):
            self._send.send_nowait((d, req, ctx))

    async def finish(self, d: Delivery) -> None:
        """Every request of the message answered: ack it; or, if one must be served again
        (handed back, waiting for a version), nak it: the client drops what it already has.
        A part of a split message: once the message's last part is done."""
        whole = d.part_done()
        if whole is None:
            return
        d = whole
        self.alive.remove(d)
        try:
            if d.back is None:
                await d.msg.ack()
            else:
                await d.msg.nak(delay=d.back)
        except nats.errors.Error as exc:  # redelivered after ack_wait; duplicates dropped
            log.debug("message not acked (%s): redelivered", exc)

    def _span_attributes(self, req: RolloutRequest) -> dict[str, Any]:
        return {spans.CONSUMER_GROUP: self.bus.subjects.rollout_consumer,
                spans.WORKER_ID: self.worker_id, spans.WEIGHT_VERSION: self.engine.version,
                "rlfabric.request.id": req.request_id, "rlfabric.client.id": req.client_id,
                "rlfabric.samples": req.sampling.n}

    # ---- one request at a time ----
    async def _lane(self, recv: MemoryObjectReceiveStream[Work]) -> None:
        async with recv:
            async for d, req, ctx in recv:
                progress = _Progress()
                try:
                    # attributes made only for a span that records them
                    with spans.consumer_span(d.msg.subject, ctx, message_id=req.request_id,
                                             attributes=self._span_attributes(req)
                                             if spans.enabled() else None):
                        await self._serve_one(d, req, progress)
                except anyio.get_cancelled_exc_class():
                    await _hand_back_now(d)
                    raise
                except Exception as exc:  # never let one request take the worker down
                    await self.admission.failed(d, req, exc)
                finally:
                    self.credits.done(progress.generated)
                    if req.adapter in d.pins:
                        d.pins.remove(req.adapter)
                        self.residency.unpin(req.adapter)
                d.left -= 1
                if d.left == 0:
                    await self.finish(d)

    async def _serve_one(self, d: Delivery, req: RolloutRequest, progress: _Progress) -> None:
        if self.cancels.gone(req):
            return
        subject = await self.admission.admit(d, req)
        if subject is None:
            return
        attempt = d.msg.metadata.num_delivered or 1
        # past its deadline + a margin nobody waits for a result: stop retrying the publish
        until = req.deadline + 10.0 if req.deadline else None
        tokens = instruments.current.tokens
        left = req.sampling.n
        with spans.span(f"{self.engine.name} generate", attributes={
                spans.WORKER_ID: self.worker_id, "rlfabric.engine": self.engine.name}) as gen, \
                self.jobs.serving(req.job) as scope, self.cancels.watch([req], scope) as gave_up:
            async for res in self.engine.generate(
                    req, worker_id=self.worker_id,
                    on_tokens=self.deltas.sink({req.request_id: req},
                                               self.admission.scope_of(d.msg))):
                left -= 1
                if left == 0:
                    progress.generated = True
                    self.jobs.generated(scope)
                    self.credits.generated()
                res = msgspec.structs.replace(res, attempt=attempt,
                                              submission_id=req.submission_id,
                                              version_spans=self.policies.stamp(req, res),
                                              moved=self._moved(res))
                n = len(res.completion_token_ids)
                tokens.add(n, {spans.WORKER_ID: self.worker_id, spans.JOB: req.job})
                self.jobs.tokens.add(req.job, n)
                if gen.is_recording():
                    gen.add_event("sample", {"index": res.sample_index, "tokens": n,
                                             "finish_reason": res.finish_reason})
                # persisted (PubAck), coalesced with what finished meanwhile, before the
                # request's message is acked
                rid = result_id(req, res.sample_index)
                with spans.producer_span(subject, message_id=rid), \
                        anyio.CancelScope(shield=True):  # stored whole, an abort or not
                    await self.outbox.send(subject, [(res, rid)], until=until)
        if gave_up.by_client:  # nobody waits for the rest
            return
        if scope.cancelled_caught:  # its job's abort pause: sampled again once it resumes
            d.serve_again(0.25)
            return
        self.served += 1

    def _moved(self, res: RolloutResult) -> str:
        """This worker's id on a sample its leaving cut short (`RolloutResult.moved`)."""
        return self.worker_id if self.moving and res.finish_reason == "abort" else ""

    # ---- a message's requests in one call ----
    async def _serve_many(self, d: Delivery, reqs: list[RolloutRequest]) -> None:
        """A message's requests through one `generate_many` call; each burst of results is
        stored as it comes (no wait), and the message is acked (or naked, see `finish`) once
        all are."""
        todo: _Todo = {}
        try:
            for req in reqs:
                try:
                    subject = None if self.cancels.gone(req) else \
                        await self.admission.admit(d, req)
                except Exception as exc:  # never let one request take the worker down
                    await self.admission.failed(d, req, exc)
                    subject = None
                if subject is None:
                    self.credits.done()
                else:
                    todo[req.request_id] = (req, subject)
            if todo:
                await self._generate_many(d, todo)
        except anyio.get_cancelled_exc_class():
            await _hand_back_now(d)
            raise
        finally:
            for key in d.pins:
                self.residency.unpin(key)
            d.pins.clear()
        await self.finish(d)

    async def _generate_many(self, d: Delivery, todo: _Todo) -> None:
        many = _Many(left={rid: req.sampling.n for rid, (req, _) in todo.items()},
                     posted=dict.fromkeys(todo, 0), request_done=self.credits.done)
        traced = self._start_spans(d, todo)
        failed = await self._post_many(d, todo, many, traced)
        # samples that will not come (generation ended early) settle now
        for rid, (req, _) in todo.items():
            if many.posted[rid] < req.sampling.n:
                if failed is not None:
                    many.errors.setdefault(rid, failed)
                many.settle(rid, req.sampling.n - many.posted[rid])
        if many.left:
            await many.settled.wait()
        self.served += sum(1 for rid, (req, _) in todo.items()
                           if many.posted[rid] == req.sampling.n and rid not in many.errors)
        for rid, err in many.errors.items():
            await self.admission.failed(d, todo[rid][0], err)
        for rid, (process, gen) in traced.items():
            spans.end(gen, many.errors.get(rid))
            spans.end(process, many.errors.get(rid))

    def _start_spans(self, d: Delivery, todo: _Todo) -> dict[str, tuple[Span, Span]]:
        """Each request's `process` and `<engine> generate` spans (none while tracing is off)."""
        if not spans.enabled():
            return {}
        out = {}
        for (rid, (req, _)), ctx in zip(todo.items(), traces(d.msg.headers, len(todo)),
                                        strict=True):
            process = spans.start_consumer(d.msg.subject, ctx, message_id=rid,
                                           attributes=self._span_attributes(req))
            out[rid] = (process, spans.start(f"{self.engine.name} generate", parent=process,
                                             attributes={spans.WORKER_ID: self.worker_id,
                                                         "rlfabric.engine": self.engine.name}))
        return out

    async def _post_many(self, d: Delivery, todo: _Todo, many: _Many,
                         traced: dict[str, tuple[Span, Span]]) -> Exception | None:
        """Generate the message's requests in one call, posting each result as it comes; the
        error that stopped generation, if it was the requests' (else handed back)."""
        assert self._many is not None
        attempt = d.msg.metadata.num_delivered or 1
        tokens = instruments.current.tokens
        stamp = self.policies.stamp
        job = next(iter(todo.values()))[0].job  # a message is one client's: one job's
        who = {spans.WORKER_ID: self.worker_id, spans.JOB: job}
        with self.jobs.serving(job, len(todo)) as scope, \
                self.cancels.watch([req for req, _ in todo.values()], scope) as gave_up:
            try:
                results = self._many.generate_many(
                    [req for req, _ in todo.values()], worker_id=self.worker_id,
                    on_tokens=self.deltas.sink({rid: req for rid, (req, _) in todo.items()},
                                               self.admission.scope_of(d.msg)))
                async with contextlib.aclosing(results):
                    async for burst in results:
                        by_subject: dict[str, list[tuple[RolloutResult, RolloutRequest]]] = {}
                        n_tokens, generated = 0, []
                        for res in burst:
                            req, subject = todo[res.request_id]
                            res = msgspec.structs.replace(res, attempt=attempt,
                                                          submission_id=req.submission_id,
                                                          version_spans=stamp(req, res),
                                                          moved=self._moved(res))
                            n_tokens += len(res.completion_token_ids)
                            many.posted[req.request_id] += 1
                            if many.posted[req.request_id] == req.sampling.n:
                                generated.append(req.request_id)
                            by_subject.setdefault(subject, []).append((res, req))
                        tokens.add(n_tokens, who)  # a burst at a time, as the engine gave them
                        self.jobs.tokens.add(job, n_tokens)
                        if generated:  # marked and counted together (`_Many.settle` pairs them)
                            many.generated.update(generated)
                            self.jobs.generated(scope, len(generated))
                            self.credits.generated(len(generated))
                        # what was generated is stored whole, an abort or not
                        with anyio.CancelScope(shield=True):
                            for subject, done in by_subject.items():
                                parent = traced.get(done[0][1].request_id)
                                await self._store_burst(subject, done, many,
                                                        parent[1] if parent else None)
            except HAND_BACK as exc:  # not the requests' fault: the message goes back
                log.debug("%d requests handed back: %r", len(todo), exc)
                d.serve_again(0.25)
            except Exception as exc:  # never let one message take the worker down
                return exc
        if scope.cancelled_caught and not gave_up.by_client:  # its job's abort pause:
            d.serve_again(0.25)  # sampled again once it resumes
        return None

    async def _store_burst(self, subject: str, done: list[tuple[RolloutResult, RolloutRequest]],
                           many: _Many, parent: Span | None) -> None:
        """Results that finished together, for one client: sent now as one message (each
        sample settled in `many` once stored); a sample too large for a message is answered
        alone, the rest sent without it."""
        items = [(res, result_id(req, res.sample_index)) for res, req in done]
        deadlines = [req.deadline for _, req in done]
        # past its deadline + a margin nobody waits for a result: stop retrying
        until = None if not all(deadlines) else max(deadlines) + 10.0
        rids = [res.request_id for res, _ in done]
        sent = spans.start_producer(subject, parent=parent) if parent else INVALID_SPAN

        def stored(error: BaseException | None) -> None:
            many.stored(rids, error)
            spans.end(sent, error)
        try:
            with spans.within(sent):
                await self.outbox.post_now(subject, items, until=until, on_done=stored)
        except PayloadTooLarge:  # one by one: only the oversized samples are answered
            spans.end(sent)
            for (res, req), item in zip(done, items, strict=True):
                one = (res.request_id,)
                try:
                    self.outbox.post(subject, [item], until=req.deadline + 10.0
                                     if req.deadline else None,
                                     on_done=functools.partial(many.stored, one))
                except PayloadTooLarge as exc:
                    many.stored(one, exc)


async def _hand_back_now(d: Delivery) -> None:
    """Stopped (an engine died, a drain ran out of grace): the message goes back to the
    stream now rather than at ack_wait."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(2):
        await d.msg.nak()
