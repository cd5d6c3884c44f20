"""Whether a delivered request is served now: decoded, addressed to a usable client, not past
its deadline, for a version this worker holds, and accepted by the engine's own check. A
request that is not is answered with a typed `RolloutError` (and never reaches the engine),
or goes back to the stream to wait for its version (`Delivery.serve_again`)."""

from __future__ import annotations

import logging
import time

import msgspec
from nats.aio.msg import Msg

from rlfabric.bus import Bus, CommandFailed
from rlfabric.bus.errors import TRANSIENT, PayloadTooLarge
from rlfabric.concurrency.ratelimit import RateLimited
from rlfabric.engines.errors import EngineDied, RequestRejected
from rlfabric.engines.protocol import Engine
from rlfabric.schemas import (
    CLIENT_ID_HEADER,
    COUNT_HEADER,
    REQUEST_ID_HEADER,
    ErrorCode,
    ErrorEvent,
    MalformedMessage,
    RolloutError,
    RolloutRequest,
    RolloutRequests,
    UpdateWeights,
    adapter_key,
    codec_for,
    encode,
    run_of,
)
from rlfabric.schemas.jobs import SEPARATOR
from rlfabric.telemetry import instruments, spans
from rlfabric.worker.delivery import Delivery, result_id
from rlfabric.worker.jobs import JobScopes
from rlfabric.worker.policies import Policies, desired_policy
from rlfabric.worker.weights import WeightSync

log = logging.getLogger("rlfabric.worker.rollouts")
#: failures that are not the request's: it goes back to the stream for another try
HAND_BACK: tuple[type[Exception], ...] = (EngineDied, *TRANSIENT)


#: sampled tokens one request may ask for (n x max_tokens), unless told
#: (`rlfabric worker --max-request-tokens`): no client holds a worker without bound
MAX_REQUEST_TOKENS = 1 << 18


class Admission:
    def __init__(self, bus: Bus, engine: Engine, worker_id: str, policies: Policies, *,
                 max_request_tokens: int = MAX_REQUEST_TOKENS,
                 jobs: JobScopes | None = None, weights: WeightSync | None = None) -> None:
        self.bus = bus
        #: loads an evicted adapter again for a request that names it (`Residency`)
        self.weights = weights
        #: a paused job's requests go back to the stream
        self.jobs = jobs or JobScopes()
        self.engine = engine
        self.worker_id = worker_id
        self.policies = policies
        self.max_request_tokens = max_request_tokens
        #: (client id, the job whose subject its request came on) -> its results' subject
        self._result_subjects: dict[tuple[str, str], str] = {}
        self._codec = codec_for(RolloutRequest)
        self._pool_subject = bus.subjects.rollout_request
        self._batch_codec = codec_for(RolloutRequests)
        self._flood = RateLimited(log)

    def decode(self, msg: Msg) -> list[RolloutRequest]:
        """The requests a message holds (`SchemaError` if it holds none); a job's adapter
        named by its key in the engine (`adapter_key`)."""
        if COUNT_HEADER in (msg.headers or {}):
            batch: RolloutRequests = self._batch_codec.decode(msg.data, msg.headers,
                                                              subject=msg.subject)
            if not batch.requests:
                raise MalformedMessage(f"an empty request batch on {msg.subject!r}")
            reqs = batch.requests
        else:
            reqs = [self._codec.decode(msg.data, msg.headers, subject=msg.subject)]
        if reqs[0].job:
            reqs = [_keyed(r) for r in reqs]
        return reqs

    def scope_of(self, msg: Msg) -> str:
        """The job whose subject `msg` came on ("": the pool's): its results and deltas go
        back on that job's subjects, where its client listens."""
        subject = msg.subject
        return "" if subject == self._pool_subject else self.bus.subjects.job_of_request(subject)

    async def admit(self, d: Delivery, req: RolloutRequest) -> str | None:
        """The subject `req`'s results go to, if it is to be served now; None once it was
        answered with an error or is to come back later."""
        msg = d.msg
        scope = self.scope_of(msg)
        subject = self._result_subjects.get((req.client_id, scope))
        if subject is None:
            try:
                subject = self.bus.subjects.rollout_result(req.client_id, scope)
            except ValueError:
                await self.reply_error(msg, req, ErrorCode.BAD_REQUEST, "request has no usable "
                                       f"client_id ({req.client_id!r})")
                return None
            self._result_subjects[req.client_id, scope] = subject
        if scope and req.job != scope:  # another job's, sent with this job's credentials
            await self.reply_error(msg, req, ErrorCode.BAD_REQUEST,
                                   f"request {req.request_id} names job {req.job or '(none)'!r} "
                                   f"but came on job {scope}'s subject: a job's client sends "
                                   "its own job's requests only")
            return None
        if req.job and req.job in self.jobs.ended:
            await self.reply_error(msg, req, ErrorCode.JOB_DELETED,
                                   f"request {req.request_id}: job {req.job} was deleted by the "
                                   "pool's operator (rlfabric job delete); its requests are not "
                                   "served")
            return None
        if req.job and self.jobs.held(req.job):  # back until its job resumes
            tries = d.msg.metadata.num_delivered or 1
            d.serve_again(min(1.0, 0.25 * 2 ** min(tries - 1, 2)))
            return None
        if req.deadline and time.time() > req.deadline:  # nobody waits for it: out of the queue
            await self.reply_error(msg, req, ErrorCode.DEADLINE_EXCEEDED,
                                   f"request {req.request_id} expired before a worker took it")
            return None
        asked = req.sampling.n * req.sampling.max_tokens
        if asked > self.max_request_tokens:
            await self.reply_error(msg, req, ErrorCode.REQUEST_TOO_LARGE,
                                   f"request {req.request_id} asks for n x max_tokens = "
                                   f"{req.sampling.n} x {req.sampling.max_tokens} = {asked} "
                                   f"tokens; {self.worker_id} serves at most "
                                   f"{self.max_request_tokens} per request "
                                   "(rlfabric worker --max-request-tokens): split it")
            return None
        if not await self._version_ready(d, req):
            return None
        try:
            self.engine.check(req)
        except RequestRejected as exc:
            await self.reply_error(msg, req, exc.code, str(exc))
            return None
        return subject

    async def _version_ready(self, d: Delivery, req: RolloutRequest) -> bool:
        """Whether this worker holds a version `req` may be served under (its adapter's, if
        it names one; of its run, if it names one); if not, it was answered or goes back
        (`_not_yet`)."""
        if not req.adapter:
            if req.run and run_of(self.policies.base) != req.run:
                desired = await self.bus.state.read()
                await self._other_run(d, req, run_of(desired_policy(desired)),
                                      run_of(self.policies.base), "base weights")
                return False
            if req.min_weight_version <= self.engine.version:
                return True
            desired = await self.bus.state.read()
            await self._not_yet(d, req, desired.weight_version, "weight version")
            return False
        held = self.engine.adapter_versions().get(req.adapter, ())
        held_run = self.policies.adapter_run(req.adapter)
        want = max(req.min_weight_version, req.adapter_version)
        if held and (not req.run or held_run == req.run) and want <= max(held):
            self._pin(d, req.adapter)
            return True  # an evicted version asked for: the engine's check says so
        name = req.adapter.split(SEPARATOR, 1)[-1]  # within its job
        upd = (await self.bus.state.read(req.job)).adapters.get(name)
        if upd is None:
            await self.reply_error(d.msg, req, ErrorCode.ADAPTER_UNKNOWN,
                                   f"request {req.request_id} names adapter {req.adapter!r}, "
                                   "which no update loaded on this fleet (or one unloaded): "
                                   "push it with FabricClient.update_weights(adapter=...)")
            return False
        if not held and self.weights is not None and self.weights.residency.limit and \
                (not req.run or upd.run == req.run) and want <= upd.version:
            return await self._reload(d, req, upd)
        if req.run and held_run != req.run:
            await self._other_run(d, req, upd.run, held_run or "", f"adapter {req.adapter!r}")
            return False
        await self._not_yet(d, req, upd.version, f"adapter {req.adapter!r} version")
        return False

    def _pin(self, d: Delivery, key: str) -> None:
        if self.weights is not None:
            self.weights.residency.pin(key)
            d.pins.append(key)

    async def _reload(self, d: Delivery, req: RolloutRequest, upd: UpdateWeights) -> bool:
        """The request's adapter was evicted (or never loaded here for want of room): load its
        newest version again, then serve the request."""
        assert self.weights is not None
        try:
            await self.weights.reload(upd)
        except CommandFailed as exc:
            await self.reply_error(d.msg, req, exc.code,
                                   f"request {req.request_id}: adapter {req.adapter!r} "
                                   f"v{upd.version} could not be loaded again on "
                                   f"{self.worker_id}: {exc}", retryable=True)
            return False
        self._pin(d, req.adapter)
        return True

    async def _other_run(self, d: Delivery, req: RolloutRequest, desired: str, held: str,
                         what: str) -> None:
        """A request for run `req.run`'s weights, which this worker does not hold (`held`
        does). If the fleet's desired state is that run's, this worker is behind: the
        request goes back to wait as for a newer version. Otherwise no update of that run is
        on its way: a request without a deadline fails now."""
        if desired != req.run and not req.deadline:
            await self.reply_error(
                d.msg, req, ErrorCode.VERSION_UNAVAILABLE,
                f"request {req.request_id} is for run {req.run}'s {what}, but {self.worker_id} "
                f"serves run {held or '(none)'}'s and the fleet's desired state is run "
                f"{desired or '(none)'}'s: push run {req.run}'s weights first, or give the "
                "request a deadline to wait for them", retryable=True)
            return
        tries = d.msg.metadata.num_delivered or 1
        d.serve_again(min(1.0, 0.25 * 2 ** min(tries - 1, 2)))

    async def _not_yet(self, d: Delivery, req: RolloutRequest, desired: int, what: str
                       ) -> None:
        """A request for a version newer than ours. If the fleet's desired version is that
        new (an update is on its way, or this worker is behind), it goes back to the stream
        for a while, backing off, so the requests behind it are served meanwhile. If no
        update to it was ever sent, a request without a deadline fails now (nothing would
        ever serve it); one with a deadline waits for it until then."""
        want = max(req.min_weight_version, req.adapter_version)
        if desired < want and not req.deadline:
            await self.reply_error(
                d.msg, req, ErrorCode.VERSION_UNAVAILABLE,
                f"request {req.request_id} needs {what} >= {want}, but the fleet's desired "
                f"version is {desired} and no update to {want} was sent: push it first, lower "
                "min_weight_version, or give the request a deadline to wait for it",
                retryable=True)
            return
        tries = d.msg.metadata.num_delivered or 1
        d.serve_again(min(1.0, 0.25 * 2 ** min(tries - 1, 2)))

    async def failed(self, d: Delivery, req: RolloutRequest, exc: BaseException) -> None:
        """`req` raised `exc`. Not the request's fault (the engine died, the bus hiccuped): its
        message goes back to the stream for another try. Otherwise it is answered with the
        error's code."""
        if isinstance(exc, HAND_BACK):
            log.debug("request %s handed back: %r", req.request_id, exc)
            d.serve_again(0.25)
            return
        code, retryable = code_of(exc)
        if code == ErrorCode.ENGINE_ERROR:
            log.error("request %s failed", req.request_id, exc_info=exc)
        await self.reply_error(d.msg, req, code, f"{type(exc).__name__}: {exc}",
                               retryable=retryable)

    async def reply_error(self, msg: Msg, req: RolloutRequest | None, code: str, message: str,
                          *, retryable: bool = False) -> None:
        hdrs = msg.headers or {}
        client_id = req.client_id if req else hdrs.get(CLIENT_ID_HEADER, "")
        request_id = req.request_id if req else hdrs.get(REQUEST_ID_HEADER, "")
        # one log line per kind and interval with a count, not one per request; every one
        # an event
        self._flood.warning(f"%s answered a request with {code}: %s", self.worker_id, message)
        instruments.current.errors.add(1, {"code": code, spans.WORKER_ID: self.worker_id})
        await self.bus.emit(ErrorEvent(source=self.worker_id, code=code, message=message,
                                       subject=msg.subject, at=time.time()))
        if not client_id or not request_id:
            return
        err = RolloutError(request_id=request_id, worker_id=self.worker_id, code=code,
                           message=message, group_id=req.group_id if req else "",
                           retryable=retryable,
                           submission_id=req.submission_id if req else "")
        try:
            await self.bus.persist(self.bus.subjects.rollout_result(client_id, self.scope_of(msg)),
                                   encode(err),
                                   self.bus.headers({
                                       "Nats-Msg-Id": result_id(req, "error", request_id)}),
                                   until=time.time() + 30.0)
        except Exception as exc:
            log.warning("could not answer %s with %s: %s", request_id, code, exc)


def _keyed(req: RolloutRequest) -> RolloutRequest:
    if not req.adapter or SEPARATOR in req.adapter:  # none, or refused by validation
        return req
    return msgspec.structs.replace(req, adapter=adapter_key(req.job, req.adapter))


def code_of(exc: BaseException) -> tuple[str, bool]:
    """The `RolloutError` code a request's failure is answered with, and whether resending
    it can help."""
    if isinstance(exc, PayloadTooLarge):
        return ErrorCode.PAYLOAD_TOO_LARGE, False
    if isinstance(exc, RequestRejected):
        return exc.code, False
    return ErrorCode.ENGINE_ERROR, True
