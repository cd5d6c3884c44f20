"""CUDA IPC handles of flat uint8 buffers as plain values (bytes, ints, bools): what a typed
message or vLLM's msgpack RPC can carry. torch's own sharing (`reduce_tensor`) hands out
rebuild arguments that hold three Python objects (the tensor and storage classes, the dtype),
which only pickle would carry."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: the parameters of `torch.multiprocessing.reductions.rebuild_cuda_tensor`, in order
REBUILD_ARGS = ("tensor_cls", "tensor_size", "tensor_stride", "tensor_offset", "storage_cls",
                "dtype", "storage_device", "storage_handle", "storage_size_bytes",
                "storage_offset_bytes", "requires_grad", "ref_counter_handle",
                "ref_counter_offset", "event_handle", "event_sync_required")
#: the Python objects among them: fixed for a flat uint8 buffer, so never sent
_OBJECTS = ("tensor_cls", "storage_cls", "dtype")


def plain_handle(args: Sequence[Any]) -> dict[str, Any]:
    """`reduce_tensor(buffer)[1]` of a flat uint8 CUDA buffer, without its Python objects."""
    if len(args) != len(REBUILD_ARGS):
        raise ValueError(f"torch's CUDA rebuild arguments have {len(args)} fields, not the "
                         f"{len(REBUILD_ARGS)} of rebuild_cuda_tensor this code knows")
    return {k: v for k, v in zip(REBUILD_ARGS, args, strict=True) if k not in _OBJECTS}


def rebuild_args(handle: Mapping[str, Any], device_index: int) -> tuple[Any, ...]:
    """What `rebuild_cuda_tensor` takes to map `handle` (a `plain_handle`) as a flat uint8
    tensor on this process's CUDA device `device_index`."""
    import torch

    full = {**handle, "tensor_cls": torch.Tensor, "storage_cls": torch.storage.TypedStorage,
            "dtype": torch.uint8, "storage_device": device_index,
            "tensor_size": tuple(handle["tensor_size"]),
            "tensor_stride": tuple(handle["tensor_stride"])}
    return tuple(full[k] for k in REBUILD_ARGS)
