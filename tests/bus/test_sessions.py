"""Appends to the session log are conditional on the session's last sequence and, for their
writer, idempotent: an append sent again after its PubAck was lost (a broker restart) returns
the copy its first try stored, and anything else at that place is a `SessionConflict`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import msgspec
import nats.errors
import pytest
from nats.js.api import PubAck

from rlfabric.bus import Bus, EmbeddedNats
from rlfabric.bus.sessions.log import SessionConflict, SessionLog
from rlfabric.schemas import PackedI32, SessionTurn

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


async def test_an_append_whose_puback_was_lost_in_a_broker_restart_returns_its_stored_copy(
        tmp_path: Path, prefix: str) -> None:
    srv = EmbeddedNats(store_dir=str(tmp_path / "store")).start()
    try:
        async with Bus.connect(srv.url, prefix=prefix) as bus:
            log = SessionLog(bus, writer="g0")
            turn = SessionTurn(session_id="s0", turn=0, added=PackedI32([1, 2]))
            acks: list[PubAck] = []
            real_ack = bus.pub_ack

            async def lost_in_a_restart(fut: asyncio.Future[PubAck], timeout: float) -> PubAck:
                # stored for sure, then the broker restarts before the caller reads the ack
                bus.pub_ack = real_ack  # type: ignore[method-assign]
                acks.append(await real_ack(fut, timeout))
                await anyio.to_thread.run_sync(srv.kill)
                await anyio.to_thread.run_sync(srv.start)
                raise nats.errors.TimeoutError

            bus.pub_ack = lost_in_a_restart  # type: ignore[method-assign]
            with anyio.fail_after(60):
                sent = await log.send(turn, expect_last=0)
                seq = await sent()  # sent again through the reconnect: meets its first copy
            assert [a.seq for a in acks] == [seq]
            assert [(s, list(r.added)) for s, r in await log.read("s0")] == [(seq, [1, 2])]

            # at that place, any other append is refused: another writer's, or other content
            with pytest.raises(SessionConflict):
                await SessionLog(bus, writer="g1").append(turn, expect_last=0)
            with pytest.raises(SessionConflict):
                await log.append(msgspec.structs.replace(turn, added=PackedI32([3])),
                                 expect_last=0)
            assert [s for s, _ in await log.read("s0")] == [seq]
    finally:
        srv.stop()
