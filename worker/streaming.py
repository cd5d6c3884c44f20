"""Token deltas, sent on core NATS (`<prefix>.stream.<client_id>`) while they are sampled, in
order, by one sender task: what is queued for one client when it runs goes as one `TokenDeltas`
(a decode step of every streamed request, not one message each). A streamed request's every
step; another's every `PROGRESS_TOKENS` or so, where its engine hands them over: should this
worker die, its client sends the sample on from them. Each delta names its policy, the batch
this worker. A delta lost to a reconnect is not sent again (the stored result holds every
token)."""

from __future__ import annotations

import logging
from collections import deque

import msgspec
import nats.errors

from rlfabric.bus import Bus
from rlfabric.concurrency.sync import Signal
from rlfabric.engines.protocol import TokenSink
from rlfabric.schemas import RolloutRequest, TokenDelta, TokenDeltas, encode, headers
from rlfabric.worker.policies import Policies

log = logging.getLogger("rlfabric.worker.rollouts")


class DeltaSender:
    def __init__(self, bus: Bus, worker_id: str, policies: Policies) -> None:
        self.bus = bus
        self.policies = policies
        self._deltas: deque[tuple[str, TokenDelta]] = deque()  # (subject, delta)
        #: requests taken from the queue, to tell their clients: subject -> request -> submission
        self._taken: dict[str, dict[str, str]] = {}
        self._worker_id = worker_id
        self._ready = Signal()
        self._headers = headers()

    def took(self, reqs: list[RolloutRequest], scope: str = "") -> None:
        """Tell the clients of `reqs` (taken from the shared queue; `scope`: the job whose
        subject they came on) that this worker holds them: should it leave before answering,
        they queue them again at once."""
        subjects = self.bus.subjects
        for req in reqs:
            if req.client_id:
                try:
                    subject = subjects.token_stream(req.client_id, scope)
                except ValueError:  # answered as a bad request by admission
                    continue
                self._taken.setdefault(subject, {})[req.request_id] = req.submission_id
        self._ready.fire()

    def sink(self, reqs: dict[str, RolloutRequest], scope: str = "") -> TokenSink:
        """What the engine hands the deltas of `reqs` (by request id; `scope`: the job whose
        subject they came on) to."""
        subjects = self.bus.subjects
        name = self.policies.name

        def on_tokens(delta: TokenDelta) -> None:
            req = reqs.get(delta.request_id)
            if req is None or not req.client_id:
                return
            delta = msgspec.structs.replace(delta, submission_id=req.submission_id,
                                            policy=name(req, delta.version))
            self._deltas.append((subjects.token_stream(req.client_id, scope), delta))
            self._ready.fire()
        return on_tokens

    async def run(self) -> None:
        """Publish the queued deltas, in order, one message per client (core NATS: buffered,
        no round trip)."""
        while True:
            ready = self._ready.event()
            taken, self._taken = self._taken, {}
            for subject, ids in taken.items():
                try:
                    await self.bus.nc.publish(subject, encode(TokenDeltas(
                        deltas=[], taken=ids, worker_id=self._worker_id)),
                        headers=self._headers)
                except nats.errors.Error as exc:  # the stream's ack wait still redelivers
                    log.debug("taken requests not told to %s: %s", subject, exc)
            by_subject: dict[str, list[TokenDelta]] = {}
            while self._deltas:
                subject, delta = self._deltas.popleft()
                by_subject.setdefault(subject, []).append(delta)
            for subject, deltas in by_subject.items():
                try:
                    await self.bus.nc.publish(subject, encode(TokenDeltas(
                        deltas=deltas, worker_id=self._worker_id)), headers=self._headers)
                except nats.errors.Error as exc:  # the result still carries every token
                    log.debug("token deltas to %s not sent: %s", subject, exc)
            await ready.wait()
