"""`PubAcks`, the pipelined JetStream publish every stored message goes through: PubAcks
matched to their publishes, a stream's refusal raised at once as its `APIError` (never waited
out as a timeout), no stream raised as `NoStreamResponseError`, and a bounded number in flight
whose slots free however a publish ends."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import anyio
import nats
import nats.js.errors
import pytest
from nats.js.api import StorageType, StreamConfig

from rlfabric.bus import Bus
from rlfabric.bus.nats.puback import PubAcks

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

JS_MESSAGE_SIZE_EXCEEDED = 10054  # the stream's max_msg_size refuses the message


@contextlib.asynccontextmanager
async def _stream(nats_url: str, name: str, subject: str, **config: int
                  ) -> AsyncIterator[tuple[nats.NATS, nats.js.JetStreamContext]]:
    """A connection, and a memory stream on `subject` for as long as the block runs."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=name, subjects=[subject],
                                         storage=StorageType.MEMORY, **config))
        yield nc, js
        await js.delete_stream(name)
    finally:
        await nc.close()


async def test_pipelined_publishes_get_their_own_pubacks_and_a_duplicate_is_marked(
        nats_url, prefix) -> None:
    async with _stream(nats_url, f"{prefix}_S", f"{prefix}.s.>") as (nc, js):
        acks = PubAcks(nc)
        futs = [await acks.send(f"{prefix}.s.{i}", f"m{i}".encode(), {"Nats-Msg-Id": f"id{i}"})
                for i in range(50)]
        with anyio.fail_after(10):
            got = [await f for f in futs]
        assert [a.seq for a in got] == list(range(1, 51))
        assert {a.stream for a in got} == {f"{prefix}_S"}
        assert not any(a.duplicate for a in got)
        for seq in (7, 30):  # the stored message of each publish is the one its PubAck names
            assert (await js.get_msg(f"{prefix}_S", seq)).data == f"m{seq - 1}".encode()
        with anyio.fail_after(10):
            again = await (await acks.send(f"{prefix}.s.x", b"again", {"Nats-Msg-Id": "id3"}))
        assert (again.seq, again.duplicate) == (4, True)
        assert not acks._waiting  # every settled publish is forgotten


async def test_a_stream_refusal_raises_its_api_error_at_once(nats_url, prefix) -> None:
    async with _stream(nats_url, f"{prefix}_T", f"{prefix}.t", max_msg_size=16) as (nc, _):
        acks = PubAcks(nc)
        t0 = time.monotonic()
        with anyio.fail_after(2), pytest.raises(nats.js.errors.APIError) as err:
            await (await acks.send(f"{prefix}.t", b"x" * 100))
        assert err.value.err_code == JS_MESSAGE_SIZE_EXCEEDED
        assert time.monotonic() - t0 < 1.0
        with anyio.fail_after(2), pytest.raises(nats.js.errors.NoStreamResponseError):
            await (await acks.send(f"{prefix}.nobody.takes.this", b"x"))
        with anyio.fail_after(2):  # the connection and the reply subscription go on
            assert (await (await acks.send(f"{prefix}.t", b"small"))).seq == 1


async def test_persist_does_not_retry_a_refusal_until_its_deadline(nats_url, prefix) -> None:
    async with Bus.connect(nats_url, prefix=prefix) as bus:
        await bus.js.add_stream(StreamConfig(name=f"{prefix}_U", subjects=[f"{prefix}.u"],
                                             storage=StorageType.MEMORY, max_msg_size=16))
        t0 = time.monotonic()
        with pytest.raises(nats.js.errors.APIError) as err:
            await bus.persist(f"{prefix}.u", b"y" * 100, {"Nats-Msg-Id": "u1"},
                              until=time.time() + 30)
        assert err.value.err_code == JS_MESSAGE_SIZE_EXCEEDED
        assert time.monotonic() - t0 < 2.0
        await bus.js.delete_stream(f"{prefix}_U")


async def test_in_flight_publishes_are_bounded_and_a_cancelled_one_frees_its_slot(
        nats_url, prefix) -> None:
    async with _stream(nats_url, f"{prefix}_V", f"{prefix}.v") as (nc, _):
        acks = PubAcks(nc, max_pending=1)
        first = await acks.send(f"{prefix}.v", b"1")
        first.cancel()  # nobody awaits it: its slot is free at once
        with anyio.fail_after(5):
            second = await acks.send(f"{prefix}.v", b"2")
        # one in flight: a third send waits for the second's PubAck
        with anyio.fail_after(5):
            third = await acks.send(f"{prefix}.v", b"3")
            assert second.done() and (await second).seq == 2
            assert (await third).seq == 3
        assert not acks._waiting and not acks._slots.locked()
