"""The same-work control floor (`floor.py control --same-work`) does a receiver's work: acks
per responder id, in order, each command once, a duplicate answered with the remembered ack,
a late one refused."""

from __future__ import annotations

import time

import anyio
import msgspec
import nats
import pytest

from rlfabric.schemas import Ack, ErrorCode, Pause, Resume

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


async def test_same_work_responders_ack_in_order_once_and_refuse_late(nats_url, prefix,
                                                                       spawn) -> None:
    spawn("control", "--nats", nats_url, "--subject", f"{prefix}.live", "--count", "2",
          "--first", "5", "--same-work", f"{prefix}.ack.", module="rlfabric.bench.floor"
          ).wait_for("floor: control ready")
    nc = await nats.connect(nats_url)
    send, got = anyio.create_memory_object_stream[tuple[str, bytes]](100)
    try:
        async def on_ack(m: nats.aio.msg.Msg) -> None:
            send.send_nowait((m.subject.rpartition(".")[2], m.data))

        await nc.subscribe(f"{prefix}.ack.*", cb=on_ack)
        await nc.flush()
        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Ack)

        async def command(seq: int, cmd: Pause | Resume) -> dict[str, tuple[Ack, bytes]]:
            await nc.publish(f"{prefix}.live.{type(cmd).__name__.lower()}.{seq}",
                             enc.encode(cmd))
            out = {}
            with anyio.fail_after(10):
                for _ in range(2):
                    cmd_id, data = await got.receive()
                    ack = dec.decode(data)
                    assert cmd_id == ack.cmd_id == cmd.cmd_id, (cmd_id, ack)
                    out[ack.worker_id] = (ack, data)
            return out

        soon = time.time() + 30
        first = await command(1, Pause(cmd_id="a1", deadline=soon))
        assert sorted(first) == ["s005", "s006"]
        assert all(a.status == "ok" and a.weights_checksum == "sim--1"
                   for a, _ in first.values())
        # seq 1 again is ignored: the next acks are seq 2's
        await nc.publish(f"{prefix}.live.pause.1", enc.encode(Pause(cmd_id="b1", deadline=soon)))
        again = await command(2, Pause(cmd_id="a1", deadline=soon))  # stored twice: a1 again
        assert {w: d for w, (_, d) in again.items()} == {w: d for w, (_, d) in first.items()}
        late = await command(3, Resume(cmd_id="c1", deadline=time.time() - 1))
        assert {a.error_code for a, _ in late.values()} == {ErrorCode.DEADLINE_EXCEEDED}
    finally:
        await nc.close()
        send.close()
        got.close()
