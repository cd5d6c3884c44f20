"""CUDA IPC handles as plain values (`rlfabric.tensors.ipc`), checked against torch's own
`rebuild_cuda_tensor` and through msgpack, as vLLM's RPC carries them. Mapping a handle needs
CUDA: that runs in `tests/engines/test_gpu.py`."""

from __future__ import annotations

import inspect

import msgspec
import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from rlfabric.tensors.ipc import REBUILD_ARGS, plain_handle, rebuild_args

# what reduce_tensor hands out for a flat uint8 CUDA buffer of 4096 bytes on device 1
SHARED = (torch.Tensor, (4096,), (1,), 0, torch.storage.TypedStorage, torch.uint8, 1,
          b"\x01ipc-handle\x00", 8192, 512, False, b"/torch_123_456", 7, b"\x02event", True)


def test_the_fields_are_torchs_own_rebuild_parameters_in_order() -> None:
    assert tuple(inspect.signature(rebuild_cuda_tensor).parameters) == REBUILD_ARGS


def test_a_handle_survives_msgpack_and_maps_on_the_receivers_device() -> None:
    handle = plain_handle(SHARED)
    assert not any(isinstance(v, (type, torch.dtype)) for v in handle.values())
    carried = msgspec.msgpack.decode(msgspec.msgpack.encode(handle))
    assert carried["tensor_size"] == [4096]  # tuples come back as lists
    args = rebuild_args(carried, 0)
    assert args == (*SHARED[:6], 0, *SHARED[7:])  # the receiver's device, all else as sent


def test_arguments_of_another_shape_are_refused() -> None:
    with pytest.raises(ValueError, match="14 fields, not the 15"):
        plain_handle(SHARED[:-1])
