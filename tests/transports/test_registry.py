"""A new transport is one class and one registration: registered from this test (no other
module touched), it is a `--transport` choice of `rlfabric up`, a trainer stages with it by
name, a worker opens its locator, verifies the digest and serves the version, and a later
version releases what it staged."""

from __future__ import annotations

import contextlib
import io
import uuid
from collections.abc import AsyncIterator

import anyio
import pytest
from helpers import perturbed

from rlfabric import tensors, transports
from rlfabric.bus import Bus
from rlfabric.cli import main
from rlfabric.engines.torch import TorchEngine
from rlfabric.schemas import External, RolloutRequest, RolloutResult, SamplingParams
from rlfabric.transports import Received, ReceiveJob, Staged, StageJob
from rlfabric.worker import Worker

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

#: what the throwaway transport "holds": packed buffers by key, in this process
HELD: dict[str, bytearray] = {}


class InboxTransport:
    name = "inbox"
    help = "this test's throwaway transport (buffers in a dict of the test process)"
    locator = External
    pull = True
    lasting = True

    def __init__(self, bus: Bus) -> None:
        del bus

    def close(self) -> None:
        pass

    async def stage(self, job: StageJob) -> Staged:
        buf = bytearray(job.size)
        dg = tensors.pack_buffer(job.state, job.tensors, buf)
        key = uuid.uuid4().hex
        HELD[key] = buf
        st = Staged(job.version, External(transport=self.name, params={"key": key},
                                          tensors=job.tensors), dg, job.expected_checksum,
                    job.size)
        st.on_release(lambda: HELD.pop(key, None))
        return st

    @contextlib.asynccontextmanager
    async def receive(self, locator: External, job: ReceiveJob) -> AsyncIterator[Received]:
        yield Received(bytearray(HELD[locator.params["key"]]))


@pytest.fixture
def inbox():
    transports.register(InboxTransport)
    yield InboxTransport
    transports.unregister("inbox")
    HELD.clear()


def test_a_registered_transport_is_a_transport_choice(inbox) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["up", "--help"])
    assert "{shm,filesystem,nats,collective,cuda_ipc,inbox}" in out.getvalue()


async def test_a_registered_transport_carries_a_version_to_a_worker(inbox, nats_url, prefix,
                                                                    client) -> None:
    engine = TorchEngine("tiny")
    v1, v2 = perturbed(1).state_dict(), perturbed(2).state_dict()
    async with Bus.connect(nats_url, prefix=prefix) as bus, anyio.create_task_group() as tg:
        await tg.start(Worker(bus, engine, "in-0", capacity=4).run)
        async with client() as fabric:
            await fabric.wait_for_workers(1, timeout=30)
            rep = await fabric.update_weights(1, state_dict=v1, transport="inbox")
            assert rep.ok == ("in-0",) and len(HELD) == 1
            assert rep.acks["in-0"].weights_checksum == tensors.checksum(v1)
            req = RolloutRequest(request_id="r1", prompt_token_ids=[5, 6], min_weight_version=1,
                                 sampling=SamplingParams(max_tokens=3, seed=0))
            [res] = [r async for r in fabric.generate([req], timeout=30)]
            assert isinstance(res, RolloutResult)
            assert [s.version for s in res.version_spans] == [1]
            (key1,) = HELD
            await fabric.update_weights(2, state_dict=v2, transport="inbox")
            assert key1 not in HELD and len(HELD) == 1  # v1's staging was released
            assert engine.version == 2
        tg.cancel_scope.cancel()


def test_an_unknown_transport_names_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="transport='nope': use one of shm, filesystem, nats, "
                                         "collective"):
        transports.lookup("nope")
