"""The worker extension vLLM mixes into its worker process (`worker_extension_cls`): what the
rlfabric engine reaches with `collective_rpc`.

Weights never travel through the RPC: the call carries a file path (a POSIX shared-memory
segment under /dev/shm, the filesystem transport's file, or the spill of a buffer received
over NATS) and the tensor layout, and this code maps the file and hands views of it to vLLM's
own in-place loader; or (`--weight-transfer ipc`) a CUDA IPC handle that vLLM's ipc backend
maps.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import torch

from rlfabric.schemas import TensorMeta
from rlfabric.tensors.packing import unpack


class RLFabricWorkerExtension:
    """Methods on vLLM's worker (`self` is the worker: `model_runner`, `reload_weights`)."""

    def rlfabric_load(self, path: str, tensors: Sequence[Any], version: int = -1) -> int:
        """Load every tensor of the packed buffer in `path` into the live model; returns the
        number of tensors loaded. Raises if vLLM's loader rejects any of them. `tensors` are
        `TensorMeta`s (the RPC hands them over as plain dicts)."""
        metas = msgspec.convert(list(tensors), list[TensorMeta], from_attributes=True)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # NOTE: a private mapping: writable views without a copy, and the file untouched
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        state: dict[str, torch.Tensor] = {}
        try:
            state = unpack(mapped, metas)
            worker: Any = self
            items = list(state.items())
            worker.reload_weights(weights_iterator=self.rlfabric_weights(items, version),
                                  is_checkpoint_format=True)
            _refresh_tied_head(worker)
            return len(state)
        finally:
            state.clear()  # no view may outlive the mapping
            try:
                mapped.close()
            except BufferError:  # a view survived in vLLM: unmapped when it goes
                pass

    def rlfabric_update_ipc(self, chunk: dict[str, Any]) -> int:
        """One chunk of a load through vLLM's ipc backend (`engines/vllm/ipc.py`), between
        vLLM's start_weight_update and finish_weight_update; returns the tensors loaded."""
        from rlfabric.engines.vllm.ipc import update_info

        worker: Any = self
        worker.update_weights(update_info(chunk))
        return len(chunk["names"])

    def rlfabric_weights(self, items: list[tuple[str, torch.Tensor]], version: int
                         ) -> Iterator[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs vLLM's loader reads for `version`, in order: a subclass
        may watch or interrupt the load here."""
        yield from items

    def rlfabric_ping(self) -> str:
        """Answers while the worker process is alive and serving RPCs."""
        return "ok"


def _refresh_tied_head(worker: Any) -> None:
    """CPU trap: with tied embeddings, `lm_head` keeps a pre-packed copy of the OLD weights
    after a reload; re-dispatching its CPU GEMM repacks it from the new embedding."""
    model = worker.model_runner.get_model()
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        return
    if model.lm_head.weight.device.type != "cpu":
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    with torch.inference_mode():
        dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)
