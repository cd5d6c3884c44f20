"""The testcontainers broker: the bus on a `NatsContainer` (JetStream on), as the suite runs
on it when a docker engine answers. Skipped, with the reason, where none does."""

from __future__ import annotations

import pytest

from rlfabric.bus import Bus
from rlfabric.schemas import Command, Pause, codec_for, encode

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


async def test_the_bus_stores_and_reads_back_a_command_on_a_nats_container(
        container_nats_url: str, prefix: str) -> None:
    async with Bus.connect(container_nats_url, prefix=prefix) as bus:
        s = bus.subjects
        cmd = Pause(cmd_id="c1", mode="keep")
        ack = await bus.publish_stored(s.control("pause"), encode(cmd), bus.headers())
        assert ack.seq >= 1
        raw = await bus.js.get_msg(s.control_stream, ack.seq)
        assert codec_for(Command).decode(raw.data, raw.headers) == cmd
        live = await bus.nc.subscribe(s.live("pause"))
        await bus.nc.publish(s.live("pause"), b"live")
        assert (await live.next_msg(timeout=5)).data == b"live"
