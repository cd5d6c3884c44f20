"""Pipelined JetStream publishes: each carries the reply subject `<inbox>.<n>` of one standing
subscription, and the stream's answer (its PubAck, or its error) resolves that publish's
future.

Why not nats-py's `publish_async` (checked against nats-py 2.16): an error answer (a stream
that refuses the message: wrong last sequence, maximum bytes) never reaches its future, since
`APIError.from_error` raises out of the reply callback instead of returning the error, so the
publisher waits out its timeout where it must fail at once; and it does more work per publish
(a semaphore through `asyncio.wait_for`, a token from `os.urandom`, the answer read with `json`
and a walk over the dataclass's fields).
"""

from __future__ import annotations

import asyncio
import functools
import itertools

import msgspec
import nats.js.errors
from nats.aio.client import NO_RESPONDERS_STATUS
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import Header, PubAck

#: publishes awaiting their PubAck at most; one more waits for a slot (as nats-py's default)
MAX_PENDING = 256


class _Error(msgspec.Struct):
    code: int = 0
    err_code: int | None = None
    description: str | None = None


class _Answer(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool | None = None
    domain: str | None = None
    error: _Error | None = None


_answer = msgspec.json.Decoder(_Answer)


class PubAcks:
    """`await send(...)` publishes and returns the future of its PubAck; the future fails
    with nats-py's errors (`NoStreamResponseError` when no stream takes the subject, an
    `APIError` subclass when the stream refuses the message). Cancel a future nobody will
    await: its slot is freed."""

    def __init__(self, nc: NATS, max_pending: int = MAX_PENDING) -> None:
        self.nc = nc
        self._prefix = ""
        self._sub: Subscription | None = None
        self._starting = asyncio.Lock()
        self._waiting: dict[str, asyncio.Future[PubAck]] = {}
        self._slots = asyncio.Semaphore(max_pending)
        self._tokens = map(str, itertools.count())

    async def _start(self) -> None:
        async with self._starting:
            if self._sub is None:
                prefix = f"{self.nc.new_inbox()}."
                # re-made by nats-py on every reconnect, before anything pending is re-sent
                self._sub = await self.nc.subscribe(f"{prefix}*", cb=self._on_answer)
                self._prefix = prefix

    async def send(self, subject: str, data: bytes | memoryview,
                   headers: dict[str, str] | None = None) -> asyncio.Future[PubAck]:
        if self._sub is None:
            await self._start()
        await self._slots.acquire()
        token = next(self._tokens)
        fut: asyncio.Future[PubAck] = asyncio.get_running_loop().create_future()
        self._waiting[token] = fut
        fut.add_done_callback(functools.partial(self._settled, token))
        try:
            await self.nc.publish(subject, data,  # type: ignore[arg-type]  # any buffer goes; a view spares a copy
                                  reply=self._prefix + token, headers=headers)
        except BaseException:
            fut.cancel()
            raise
        return fut

    def _settled(self, token: str, _: asyncio.Future[PubAck]) -> None:
        self._waiting.pop(token, None)
        self._slots.release()

    async def _on_answer(self, msg: Msg) -> None:
        fut = self._waiting.get(msg.subject[len(self._prefix):])
        if fut is None or fut.done():  # timed out, cancelled, or failed by a reconnect
            return
        if msg.headers and msg.headers.get(Header.STATUS) == NO_RESPONDERS_STATUS:
            fut.set_exception(nats.js.errors.NoStreamResponseError())
            return
        try:
            ans = _answer.decode(msg.data)
        except (msgspec.DecodeError, ValueError) as exc:
            fut.set_exception(nats.js.errors.APIError(
                description=f"unreadable PubAck {bytes(msg.data[:200])!r}: {exc}"))
            return
        if ans.error is not None:
            try:  # nats-py's mapping of an error's code to its exception class (it raises)
                nats.js.errors.APIError.from_error(msgspec.structs.asdict(ans.error))
            except nats.js.errors.APIError as err:
                fut.set_exception(err)
            return
        fut.set_result(PubAck(stream=ans.stream, seq=ans.seq, domain=ans.domain,
                              duplicate=ans.duplicate))
