"""The `cuda_ipc` transport where CUDA cannot serve it: refused at once, with the reason and
what to use instead, on both ends (the trainer's state dict in host memory; a worker on another
host, or with no CUDA device), and the worker goes on serving. Its GPU path runs in
`tests/engines/test_gpu.py`."""

from __future__ import annotations

import itertools

import anyio
import pytest
import torch
from helpers import collect, req

from rlfabric.bus import Bus, QuorumNotReached, QuorumPolicy
from rlfabric.engines.torch import TorchEngine
from rlfabric.schemas import CudaIpc, CudaIpcBucket, RolloutResult, TensorMeta
from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient
from rlfabric.transports import Staged, TransportError
from rlfabric.transports.cuda_ipc import boot_id, buckets
from rlfabric.worker import Worker

pytestmark = [pytest.mark.nats, pytest.mark.anyio, pytest.mark.timeout(120)]


def meta(offset: int, nbytes: int) -> TensorMeta:
    return TensorMeta(name=f"t{offset}", dtype="torch.uint8", shape=(nbytes,), offset=offset,
                      nbytes=nbytes)


def test_buckets_are_cut_where_a_tensor_starts_and_cover_the_buffer() -> None:
    metas = (meta(0, 100), meta(128, 300), meta(448, 50), meta(512, 2000))
    assert buckets(metas, 2560, 1 << 20) == [(0, 2560)]
    got = buckets(metas, 2560, 450)
    assert got == [(0, 448), (448, 512), (512, 2560)]  # the 2000-byte tensor alone is larger
    assert got[0][0] == 0 and got[-1][1] == 2560
    assert all(a[1] == b[0] for a, b in itertools.pairwise(got))


def bogus(host_boot_id: str) -> Staged:
    """A push naming one 64-byte CUDA bucket (never mapped: the worker refuses first)."""
    bucket = CudaIpcBucket(offset=0, nbytes=64, device_uuid="GPU-none", handle=b"h",
                           storage_bytes=64, storage_offset=0, ref_counter=b"r",
                           ref_counter_offset=0)
    loc = CudaIpc(host="elsewhere", boot_id=host_boot_id, buckets=(bucket,),
                  tensors=(meta(0, 64),))
    return Staged(1, loc, "0" * 16, "", 64, for_joiners=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a host "
                    "without CUDA")
async def test_without_cuda_both_ends_refuse_at_once_and_the_worker_keeps_serving(
        nats_url: str, prefix: str) -> None:
    async with Bus.connect(nats_url, prefix=prefix) as bus, anyio.create_task_group() as tg:
        await tg.start(Worker(bus, TorchEngine("tiny", device="cpu"), "c0", capacity=4).run)
        async with FabricClient.connect(nats_url, prefix=prefix) as fabric:
            await fabric.wait_for_workers(1, timeout=30)
            with anyio.fail_after(5), pytest.raises(TransportError) as refused:
                await fabric.update_weights(1, build_model("tiny"), transport="cuda_ipc")
            assert refused.value.code == "unsupported"
            assert "on cpu" in str(refused.value) and "shm" in str(refused.value)
            policy = QuorumPolicy(required="all", timeout=10)
            for where, says in ((boot_id() + "-other", "not on the trainer's host elsewhere"),
                                (boot_id(), "sees no CUDA device")):
                with anyio.fail_after(5), pytest.raises(QuorumNotReached) as missed:
                    await fabric.push_weights(bogus(where), policy=policy, verify="off")
                ack = missed.value.report.acks["c0"]
                assert ack.error_code == "unsupported", ack
                assert says in ack.error_message and "push to" in ack.error_message
                assert ack.weight_version == 0  # still on its checkpoint (v0)
            (out,) = await collect(fabric, [req("after", max_tokens=4)], timeout=30)
            assert isinstance(out, RolloutResult) and 0 < len(out.completion_token_ids) <= 4
        tg.cancel_scope.cancel()
