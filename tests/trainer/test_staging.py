"""Staging for the `nats` transport on a real nats-server: the chunks in the weights stream are
the packed weights, and the next version of the same layout is packed into the buffer of the
last one (kept once its chunks are stored) with the same bytes and digest as a fresh buffer;
another layout gets a fresh buffer, whose padding reads zero."""

from __future__ import annotations

import pytest
import torch

from rlfabric.tensors.packing import digest, pack_into, plan
from rlfabric.trainer import FabricClient
from rlfabric.transports import Staged

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


def weights(seed: int, first: int, second: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(first, generator=g), "y": torch.randn(second, generator=g)}


def fresh_pack(state: dict[str, torch.Tensor]) -> bytes:
    metas, size = plan(state)
    buf = bytearray(size)
    pack_into(state, metas, buf)
    return bytes(buf)


async def stored_chunks(fabric: FabricClient, staged: Staged) -> bytes:
    t = staged.transport
    js = fabric.bus.js
    return b"".join([(await js.get_last_msg(t.stream, f"{t.subject}.{i}")).data
                     for i in range(t.chunks)])


async def test_next_version_of_a_layout_packs_into_the_last_buffer(client) -> None:
    # 10 and 100 floats: 40 + 24 padding, 400 + 48 padding. The other layout (100, then 10)
    # has the same size, 512 bytes, with its padding where the first one holds data
    v0, v1, other = weights(0, 10, 100), weights(1, 10, 100), weights(2, 100, 10)
    assert plan(other)[1] == plan(v1)[1] == 512 and plan(other)[0] != plan(v1)[0]
    async with client() as fabric:
        stager = fabric.updates.stager.transports.get("nats")
        s0 = await fabric.stage_weights(0, v0, "nats", with_checksum=False)
        assert stager._spare is not None
        kept = stager._spare[1]
        assert await stored_chunks(fabric, s0) == fresh_pack(v0)

        s1 = await fabric.stage_weights(1, v1, "nats", with_checksum=False)
        assert stager._spare is not None and stager._spare[1] is kept  # packed in place
        want = fresh_pack(v1)
        assert s1.digest == digest(want)
        assert await stored_chunks(fabric, s1) == want

        s2 = await fabric.stage_weights(2, other, "nats", with_checksum=False)
        assert stager._spare is not None and stager._spare[1] is not kept  # a fresh one
        want = fresh_pack(other)
        assert s2.digest == digest(want)
        assert await stored_chunks(fabric, s2) == want
        for s in (s0, s1, s2):
            await s.release()
    assert stager._spare is None  # the client's close gave the buffer back
