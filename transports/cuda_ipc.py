"""`cuda_ipc`: the trainer packs the state dict into CUDA buffers (buckets) on its GPU and
exports their IPC handles; each worker on the same host maps them, copies into its parameters
and acks. The bytes never pass through host memory, and the digest is computed on the device.

The buckets live until the update is decided (acked by the quorum, or failed), then the trainer
frees them: a worker that joins later waits for the next push, and a worker that died holding a
mapping keeps nothing of the trainer's alive (the trainer gives back its own count of torch's
IPC reference counter, and the driver drops a dead process's mappings).
"""

from __future__ import annotations

import contextlib
import functools
import socket
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from rlfabric.schemas import CudaIpc, CudaIpcBucket, ErrorCode, TensorMeta
from rlfabric.transports.protocol import (
    Received,
    ReceiveJob,
    Staged,
    StageJob,
    TransportError,
)

if TYPE_CHECKING:
    import torch

    from rlfabric.bus import Bus

#: the largest bucket: a push of a bigger state dict is cut at tensor boundaries
BUCKET_BYTES = 1 << 30


@functools.cache
def boot_id() -> str:
    """This machine's boot id (one per running kernel: processes in containers on one host
    share it), else its hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def buckets(metas: tuple[TensorMeta, ...], size: int, limit: int) -> list[tuple[int, int]]:
    """Byte ranges `[start, end)` covering `[0, size)`, cut only where a tensor starts, each at
    most `limit` bytes unless one tensor alone is larger."""
    cuts, start = [], 0
    for m in sorted(metas, key=lambda m: m.offset):
        if m.offset > start and m.offset + m.nbytes - start > limit:
            cuts.append((start, m.offset))
            start = m.offset
    if size > start or not cuts:
        cuts.append((start, size))
    return cuts


def cuda_device(state: Mapping[str, Any]) -> torch.device:
    """The CUDA device the state dict lies on; `TransportError` if it is not on one."""
    devices = {t.device for t in state.values()}
    cuda = [d for d in devices if d.type == "cuda"]
    if len(cuda) != 1 or len(devices) != 1:
        found = ", ".join(sorted(str(d) for d in devices)) or "no tensors"
        raise TransportError(ErrorCode.UNSUPPORTED,
                             f"cuda_ipc stages a state dict on one CUDA device; this one is on "
                             f"{found}: move it to the GPU, or push with shm, filesystem or "
                             "nats")
    dev: torch.device = cuda[0]
    return dev


class CudaIpcTransport:
    name = "cuda_ipc"
    help = ("CUDA IPC handles to the trainer's GPU buffers (trainer and CUDA workers on one "
            "host; no copy through host memory)")
    locator = CudaIpc
    pull = True
    lasting = False

    def __init__(self, bus: Bus) -> None:
        del bus
        self.bucket_bytes = BUCKET_BYTES

    def close(self) -> None:
        pass

    async def stage(self, job: StageJob) -> Staged:
        import torch

        from rlfabric.tensors.checksums import as_bytes, device_digest

        dev = cuda_device(job.state)
        ranges = buckets(job.tensors, job.size, self.bucket_bytes)
        bufs: list[torch.Tensor] = []
        with torch.cuda.device(dev), torch.no_grad():
            for start, end in ranges:
                # zeros: the padding between tensors is part of the digest
                buf = torch.zeros(max(end - start, 1), dtype=torch.uint8, device=dev)
                for m in job.tensors:
                    if m.nbytes and start <= m.offset < end:
                        at = m.offset - start
                        buf[at:at + m.nbytes].copy_(as_bytes(job.state[m.name]))
                bufs.append(buf)
            pieces = [(start, buf[:end - start]) for (start, end), buf in zip(ranges, bufs,
                                                                             strict=True)]
            dg = device_digest(pieces)
            uuid = str(torch.cuda.get_device_properties(dev).uuid)
            shared = [_share(start, buf, end - start, uuid)
                      for (start, end), buf in zip(ranges, bufs, strict=True)]
        del pieces
        locator = CudaIpc(host=socket.gethostname(), boot_id=boot_id(),
                          buckets=tuple(shared), tensors=job.tensors)
        st = Staged(job.version, locator, dg, job.expected_checksum, job.size,
                    for_joiners=False)

        def free() -> None:
            for b in shared:  # the trainer's own count: a dead mapper cannot hold them
                torch.storage.TypedStorage._release_ipc_counter(  # type: ignore[no-untyped-call]  # torch leaves it untyped
                    b.ref_counter, b.ref_counter_offset, device=dev)
            bufs.clear()
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]  # torch leaves it untyped

        st.on_release(free)
        return st

    @contextlib.asynccontextmanager
    async def receive(self, locator: CudaIpc, job: ReceiveJob) -> AsyncIterator[Received]:
        if locator.boot_id != boot_id():
            raise TransportError(ErrorCode.UNSUPPORTED,
                                 f"{job.worker_id} runs on {socket.gethostname()}, not on the "
                                 f"trainer's host {locator.host}: cuda_ipc maps GPU memory on "
                                 "one host; push to this worker with nats or filesystem")
        import torch

        if not torch.cuda.is_available():
            raise TransportError(ErrorCode.UNSUPPORTED,
                                 f"{job.worker_id} sees no CUDA device: cuda_ipc maps the "
                                 "trainer's GPU memory; push to it with shm, filesystem or nats")
        pieces = [(b.offset, _open(b, job.worker_id)) for b in locator.buckets]
        try:
            yield Received(None, pieces=tuple(pieces))
        finally:
            pieces.clear()  # unmapped once the engine let go of its views


def _share(offset: int, buf: torch.Tensor, nbytes: int, uuid: str) -> CudaIpcBucket:
    share = buf.untyped_storage()._share_cuda_  # what torch's reduce_tensor sends
    (_device, handle, storage_bytes, storage_offset, ref_counter, ref_counter_offset,
     event, event_sync) = share()  # type: ignore[no-untyped-call]  # torch leaves it untyped
    return CudaIpcBucket(offset=offset, nbytes=nbytes, device_uuid=uuid, handle=handle,
                         storage_bytes=storage_bytes, storage_offset=storage_offset,
                         ref_counter=ref_counter, ref_counter_offset=ref_counter_offset,
                         event=event or b"", event_sync=bool(event_sync))


def _local_index(uuid: str) -> int | None:
    import torch

    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None


def _open(b: CudaIpcBucket, worker_id: str) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from rlfabric.tensors.ipc import rebuild_args

    index = _local_index(b.device_uuid)
    if index is None:
        raise TransportError(ErrorCode.UNSUPPORTED,
                             f"{worker_id} cannot see the trainer's GPU {b.device_uuid} "
                             "(CUDA_VISIBLE_DEVICES?): cuda_ipc maps memory of that GPU")
    handle = {"tensor_size": (b.nbytes,), "tensor_stride": (1,), "tensor_offset": 0,
              "storage_handle": b.handle, "storage_size_bytes": b.storage_bytes,
              "storage_offset_bytes": b.storage_offset, "requires_grad": False,
              "ref_counter_handle": b.ref_counter, "ref_counter_offset": b.ref_counter_offset,
              "event_handle": b.event or None, "event_sync_required": b.event_sync}
    t: torch.Tensor = rebuild_cuda_tensor(*rebuild_args(handle, index))  # type: ignore[no-untyped-call]  # torch leaves it untyped
    return t
