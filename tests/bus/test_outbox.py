"""Pipelined JetStream publishes: `Outbox` coalescing, a combined message's dedupe id that
covers every item, and a PubAck that never comes (lost with a broker restart, or swallowed)
raised as an error to retry, never waited on forever."""

from __future__ import annotations

import time

import anyio
import nats.errors
import pytest

from rlfabric.bus import Bus, EmbeddedNats
from rlfabric.bus.errors import TRANSIENT
from rlfabric.bus.nats.outbox import Outbox, batch_id
from rlfabric.schemas import COUNT_HEADER, RolloutRequest, RolloutRequests, codec_for

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


def _requests_outbox(bus: Bus, max_items: int = 64) -> Outbox:
    """An outbox of rollout requests, combined as the trainer combines them."""
    return Outbox(bus, combine=lambda reqs: RolloutRequests(requests=reqs), max_items=max_items,
                  headers=lambda reqs: {COUNT_HEADER: str(len(reqs))} if len(reqs) > 1 else {})


async def _stored_batches(bus: Bus) -> list[list[str]]:
    """The request ids of each combined message in the request stream, in stream order."""
    s = bus.subjects
    info = await bus.js.stream_info(s.rollout_stream)
    many = codec_for(RolloutRequests)
    return [[r.request_id for r in many.decode(raw.data, raw.headers).requests]
            for raw in [await bus.js.get_msg(s.rollout_stream, seq)
                        for seq in range(info.state.first_seq, info.state.last_seq + 1)]]


async def test_a_burst_goes_out_in_few_messages_and_every_item_is_stored_once(
        nats_url, prefix) -> None:
    async with Bus.connect(nats_url, prefix=prefix) as bus:
        s = bus.subjects
        outbox = _requests_outbox(bus, max_items=16)
        reqs = [RolloutRequest(request_id=f"r{i}", prompt_token_ids=[1, i]) for i in range(100)]
        async with anyio.create_task_group() as tg:
            await tg.start(outbox.run)
            async with anyio.create_task_group() as senders:  # 100 concurrent callers
                for r in reqs:
                    senders.start_soon(outbox.send, s.rollout_request, [(r, r.request_id)])
            tg.cancel_scope.cancel()
        info = await bus.js.stream_info(s.rollout_stream)
        one, many = codec_for(RolloutRequest), codec_for(RolloutRequests)
        stored = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            raw = await bus.js.get_msg(s.rollout_stream, seq)
            if COUNT_HEADER in (raw.headers or {}):
                stored += many.decode(raw.data, raw.headers).requests
            else:
                stored.append(one.decode(raw.data, raw.headers))
    assert sorted(r.request_id for r in stored) == sorted(r.request_id for r in reqs)
    assert outbox.items == 100 and info.state.messages == outbox.messages
    assert 100 // 16 <= outbox.messages < 50  # coalesced, within max_items


async def test_a_message_that_starts_with_a_repeated_item_still_stores_its_new_ones(
        nats_url, prefix) -> None:
    """A redelivered request is served again: its result goes out again (a duplicate the
    stream may drop), combined with results of other requests that finished with it. Those
    must be stored: the combined message's id is not the first item's id and the count."""
    async with Bus.connect(nats_url, prefix=prefix) as bus:
        s = bus.subjects
        outbox = _requests_outbox(bus)
        a, b, c = (RolloutRequest(request_id=x, prompt_token_ids=[1]) for x in "abc")
        async with anyio.create_task_group() as tg:
            await tg.start(outbox.run)
            await outbox.send(s.rollout_request, [(a, "a"), (b, "b")])
            await outbox.send(s.rollout_request, [(a, "a"), (c, "c")])  # a again, c is new
            await outbox.send(s.rollout_request, [(a, "a"), (c, "c")])  # a retry: dropped
            tg.cancel_scope.cancel()
        stored = await _stored_batches(bus)
    assert stored == [["a", "b"], ["a", "c"]]
    assert batch_id(["a", "b"]) != batch_id(["a", "c"]) != batch_id(["c", "a"])
    assert batch_id(["a", "c"]).startswith("a+2.")


async def test_post_calls_back_once_when_stored_or_failed_and_a_withdrawn_post_is_not_sent(
        nats_url, prefix) -> None:
    """`post` returns at once; its callback comes once for all its items, with None when all
    are stored or with the error that stopped them (even when they spread over several
    messages); items withdrawn before they went out are never sent."""
    async with Bus.connect(nats_url, prefix=prefix) as bus:
        s = bus.subjects
        outbox = _requests_outbox(bus, max_items=4)
        reqs = [RolloutRequest(request_id=f"r{i}", prompt_token_ids=[1, i]) for i in range(10)]
        called: dict[str, list[BaseException | None]] = {"ok": [], "gone": [], "bad": []}
        both = anyio.Event()

        def on(name: str):
            def done(error: BaseException | None) -> None:
                called[name].append(error)
                if called["ok"] and called["bad"]:
                    both.set()
            return done

        async with anyio.create_task_group() as tg:
            await tg.start(outbox.run)
            ok = outbox.post(s.rollout_request, [(r, r.request_id) for r in reqs],
                             on_done=on("ok"))
            gone = outbox.post(s.rollout_request, [(reqs[0], "gone")], on_done=on("gone"))
            outbox.withdraw(gone)  # before the outbox's task took it
            # no stream holds this subject: retried until `until`, then failed for good
            bad = outbox.post(f"{prefix}.nostream", [(r, f"b{r.request_id}") for r in reqs[:6]],
                              until=time.time() + 1.0, on_done=on("bad"))
            with anyio.fail_after(30):
                await both.wait()
            tg.cancel_scope.cancel()
        info = await bus.js.stream_info(s.rollout_stream)
        many = codec_for(RolloutRequests)
        stored: list[str] = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            raw = await bus.js.get_msg(s.rollout_stream, seq)
            stored += [r.request_id for r in many.decode(raw.data, raw.headers).requests]
    assert called["ok"] == [None] and ok.finished and ok.error is None
    assert stored == [r.request_id for r in reqs]  # in order, 4 + 4 + 2, and not "gone"
    assert called["gone"] == [] and not gone.finished
    assert len(called["bad"]) == 1 and isinstance(called["bad"][0], TRANSIENT)
    assert bad.error is called["bad"][0]


async def test_post_now_sends_a_burst_as_one_message_behind_what_is_queued(
        nats_url, prefix) -> None:
    """`post_now` sends the burst it is given from the caller's task as one message (its
    callback once, when stored); with items queued, it queues its own behind them."""
    async with Bus.connect(nats_url, prefix=prefix) as bus:
        s = bus.subjects
        outbox = _requests_outbox(bus)
        reqs = [RolloutRequest(request_id=f"r{i}", prompt_token_ids=[1, i]) for i in range(8)]
        called: list[BaseException | None] = []
        stored_all = anyio.Event()

        def done(error: BaseException | None) -> None:
            called.append(error)
            if len(called) == 2:
                stored_all.set()
        async with anyio.create_task_group() as tg:
            await tg.start(outbox.run)
            await outbox.post_now(s.rollout_request, [(r, r.request_id) for r in reqs[:3]],
                                  on_done=done)
            assert outbox.messages == 0 and not outbox._queue  # sent, its PubAck to come
            outbox.post(s.rollout_request, [(reqs[3], "r3")])
            await outbox.post_now(s.rollout_request, [(r, r.request_id) for r in reqs[4:]],
                                  on_done=done)
            with anyio.fail_after(30):
                await stored_all.wait()
            tg.cancel_scope.cancel()
        stored = await _stored_batches(bus)
    assert called == [None, None]
    assert stored == [["r0", "r1", "r2"], ["r3", "r4", "r5", "r6", "r7"]]


async def test_a_pub_ack_that_never_comes_is_a_transient_error(tmp_path) -> None:
    srv = EmbeddedNats(store_dir=str(tmp_path / "store"))
    await anyio.to_thread.run_sync(srv.start)
    try:
        async with Bus.connect(srv.url, prefix="pa") as bus:
            # a plain subscriber takes the publish and never answers: no PubAck, ever
            swallow = await bus.nc.subscribe("pa.swallowed")
            await bus.nc.flush()
            with pytest.raises(nats.errors.TimeoutError):
                await bus.publish_stored("pa.swallowed", b"x", timeout=0.5)
            # the PubAck of a publish sent before a reconnect is failed at the reconnect,
            # not at the timeout (nats-py would leave it pending, holding a pending slot)
            t0 = time.monotonic()
            raised: list[Exception] = []

            async def publish() -> None:
                try:
                    await bus.publish_stored("pa.swallowed", b"y", timeout=120)
                except Exception as exc:
                    raised.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(publish)
                await anyio.to_thread.run_sync(srv.kill)
                await anyio.to_thread.run_sync(srv.start)
            assert [type(e) for e in raised] == [nats.errors.ConnectionReconnectingError]
            assert time.monotonic() - t0 < 60
            assert not bus.link.pending_acks
            await swallow.unsubscribe()
            # and the connection stores again
            ack = await bus.publish_stored(bus.subjects.control("pause"), b"z")
            assert ack.seq >= 1
    finally:
        await anyio.to_thread.run_sync(srv.stop)
