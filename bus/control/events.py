"""The fleet's events read back from the events stream (`Subjects.events_stream`, capped):
what `rlfabric events` prints and the read model's recent commands come from."""

from __future__ import annotations

import contextlib
import datetime as dt
import math
from collections.abc import AsyncIterator
from typing import Any

import anyio
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from rlfabric.bus.errors import BusError
from rlfabric.bus.session import Bus
from rlfabric.schemas import Event, SchemaError, codec_for

_EVENT = codec_for(Event)
#: seconds without an event after which a read that does not follow is caught up
IDLE_S = 2.0


class NoEvents(BusError):
    """The job keeps no events stream: created before there was one, or not at all."""


async def read_events(bus: Bus, *, since: float | None = None, kind: str = "",
                      follow: bool = False, idle: float = IDLE_S
                      ) -> AsyncIterator[tuple[int, Event]]:
    """`(stream sequence, event)` from `since` (a unix time; None: the oldest kept), of one
    `kind` ("": all), in the order they were stored; with `follow`, then each as it comes,
    until the caller stops; without, until the last one stored, or until none came for `idle`
    seconds. An event this version cannot read is skipped. `NoEvents` if the job has no
    events stream."""
    stream = bus.subjects.events_stream
    try:
        last = (await bus.js.stream_info(stream)).state.last_seq
    except NotFoundError:
        raise NoEvents(f"job {bus.subjects.prefix!r} has no events stream ({stream}): no "
                       "client or worker that keeps events has joined it yet") from None
    send, recv = anyio.create_memory_object_stream[tuple[int, Any]](math.inf)
    start = ConsumerConfig(deliver_policy=DeliverPolicy.ALL) if since is None else \
        ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=_utc(since))

    async def on_event(msg: Any) -> None:
        seq = msg.metadata.sequence.stream
        try:
            event = _EVENT.decode(msg.data, msg.headers)
        except SchemaError:
            event = None
        with contextlib.suppress(anyio.ClosedResourceError):  # read to the end already
            send.send_nowait((seq, event))
        if not follow and (seq >= last or msg.metadata.num_pending == 0):
            send.close()

    sub = await bus.js.subscribe(bus.subjects.events(kind or "*", "*"), stream=stream,
                                 cb=on_event, ordered_consumer=True, idle_heartbeat=1.0,
                                 config=start)
    try:
        if not follow:
            info = await sub.consumer_info()
            delivered = info.delivered.stream_seq if info.delivered else 0
            if not last or (info.num_pending == 0 and not delivered):
                send.close()  # nothing at or after `since`
        async with recv:
            while True:
                got: tuple[int, Any] | None = None
                with anyio.move_on_after(math.inf if follow else idle):
                    try:
                        got = await recv.receive()
                    except anyio.EndOfStream:
                        return
                if got is None:
                    return  # caught up: nothing more came
                if got[1] is not None:
                    yield got
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await sub.unsubscribe()


def _utc(at: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(at, dt.UTC)
