"""The weights a vLLM engine serves, and every way a version gets into vLLM: a verified payload
read from a file by the worker extension (`load_weights`), the same payload on this process's
GPU through vLLM's ipc backend, or vLLM's own NCCL weight transfer from a trainer
(`init_transport`, `receive_collective`). Each load is frozen between two decode steps, so the
version stamped on every token is exact; one that fails inside vLLM restarts the engine from
what it served.

The weights checksum is the checksum of the payload this engine loaded for the version it
serves (vLLM repacks and fuses weights on load, so the live parameters cannot be hashed as
sent): with `verify="sender"` the trainer still learns that each worker applied exactly the
bytes it sent. Before any load, it is the checksum of the checkpoint's own tensors.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio

from rlfabric.engines.errors import EngineError, Unsupported, WeightLoadError
from rlfabric.engines.payload import PackedWeights
from rlfabric.engines.vllm import checkpoint
from rlfabric.engines.vllm.options import on_cpu
from rlfabric.schemas import Collective, ErrorCode, InitTransport, TensorMeta, UpdateWeights

if TYPE_CHECKING:
    from rlfabric.engines.vllm.engine import VllmEngine

log = logging.getLogger("rlfabric.engines.vllm")

NO_COLLECTIVE_CPU = (
    "collective weight updates to a vLLM worker go through vLLM's NCCL weight-transfer engine, "
    "which needs CUDA; this is vLLM's CPU build: use the shm, filesystem or nats transport")
NOT_STREAMED = (
    "this group speaks rlfabric's packed-buffer broadcast (FabricClient.init_transport); a "
    "vLLM worker joins only groups that stream tensors into vLLM's own loader (its NCCL weight "
    "transfer): push to it with rlfabric.integrations.vllm_sync.VllmNcclSync, or use the shm, "
    "filesystem or nats transport")
IPC_NOT_NCCL = (
    "this vLLM worker runs vLLM's ipc weight transfer (--weight-transfer ipc), for a trainer "
    "on its host's GPUs: push to it with cuda_ipc, shm, filesystem or nats, or restart it with "
    "--weight-transfer nccl to join VllmNcclSync's group (rlfabric.integrations.vllm_sync)")


class VllmLoads:
    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        self.version = -1
        #: moves with every weight load of any kind: requests are salted with it, so no
        #: prefix block computed under other weights is ever hit (`cache_salt`)
        self.serial = 0
        self.checksum = ""
        self.current_file: str | None = None  # our copy of the payload being served
        self.current_layout: tuple[TensorMeta, ...] = ()
        #: what a restart serves when no copy of a loaded version is kept (NCCL, ipc)
        self.checkpoint_as, self.checkpoint_checksum = -1, ""
        self.nccl_epoch = 0  # the vLLM NCCL weight-transfer group joined (0: none)
        self.ipc = engine.options.weight_transfer == "ipc"

    async def from_checkpoint(self) -> None:
        """Before any load: the checksum of the checkpoint's own tensors."""
        self.checksum = await anyio.to_thread.run_sync(checkpoint.checksum, self.engine.model)
        self.checkpoint_checksum = self.checksum

    async def load_weights(self, weights: PackedWeights, version: int) -> None:
        self.check_layout(weights)
        if self.ipc and weights.pieces:
            await self._load_over_ipc(weights, version)
            return
        from rlfabric.tensors.checksums import checksum

        state = weights.state()
        try:
            new_checksum = await anyio.to_thread.run_sync(checksum, state)
        finally:
            state.clear()
        keep = await anyio.to_thread.run_sync(_copy_to_spill, weights.file(), version)

        async def load() -> None:
            await self.engine.llm.collective_rpc("rlfabric_load", kwargs={
                "path": keep, "tensors": weights.tensors, "version": version})
            await self.engine.llm.update_weight_version(str(version))

        def failed(exc: Exception) -> Exception:
            return WeightLoadError(f"vLLM rejected v{version} partway ({exc}); the engine was "
                                   f"restarted and serves v{self.version} again")
        await self._load(load, version, keep=keep, layout=weights.tensors, failed=failed,
                         why=f"v{version} failed inside vLLM's loader")
        self.checksum = new_checksum

    async def _load_over_ipc(self, weights: PackedWeights, version: int) -> None:
        """The verified payload, on this process's GPU, into vLLM through its ipc backend:
        device to device, nothing kept on disk (a restart serves the checkpoint)."""
        import torch

        from rlfabric.engines.vllm import ipc
        from rlfabric.tensors.checksums import checksum

        state = weights.state()
        llm = self.engine.llm

        def take(chunk: dict[str, Any]) -> None:  # from ipc.send's thread
            anyio.from_thread.run(functools.partial(
                llm.collective_rpc, "rlfabric_update_ipc", kwargs={"chunk": chunk}))

        async def load() -> None:
            await llm.start_weight_update()
            await anyio.to_thread.run_sync(ipc.send, state, take)
            await llm.finish_weight_update(weight_version=str(version))

        def failed(exc: Exception) -> Exception:
            return WeightLoadError(f"vLLM's ipc backend did not take v{version} ({exc}); the "
                                   f"engine was restarted and serves v{self.version}")
        try:
            new_checksum = await anyio.to_thread.run_sync(checksum, state)
            await self._load(load, version, keep=None, layout=weights.tensors, failed=failed,
                             why=f"v{version} failed inside vLLM's ipc backend")
        finally:
            state.clear()
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        self.checksum = new_checksum

    async def _load(self, load: Callable[[], Awaitable[None]], version: int, *,
                    keep: str | None, layout: tuple[TensorMeta, ...] | list[TensorMeta],
                    failed: Callable[[Exception], Exception], why: str) -> None:
        """Every kind of load runs this: frozen between two decode steps while the weights
        and their version name change together, so every token's version is exact (a
        command's own pause stays as it is); on failure the engine is restarted from what it
        served (`recover`) and `failed(exc)` raised; on success `keep` (the copy on disk a
        restart reloads from, None: none) replaces the last one."""
        e = self.engine
        frozen_here = e.paused is None
        if frozen_here:
            await e.llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await load()
        except Exception as exc:
            if keep is not None:
                with contextlib.suppress(OSError):
                    os.remove(keep)
            await self.recover(f"{why} ({exc})")
            raise failed(exc) from None
        finally:
            if frozen_here and e.llm is not None and e.paused is None:
                await e.llm.resume_generation()
        self.drop_file()
        self.current_file, self.current_layout = keep, tuple(layout)
        self.version = version
        self.serial += 1

    def drop_file(self) -> None:
        if self.current_file:
            with contextlib.suppress(OSError):
                os.remove(self.current_file)

    def check_layout(self, weights: PackedWeights) -> None:
        """What can be checked before vLLM's loader touches the model: names and shapes
        against the checkpoint's own tensors (a half-applied load needs a restart)."""
        bad = []
        shapes = self.engine.shapes
        for m in weights.tensors:
            want = shapes.get(m.name)
            if want is None:
                bad.append(f"{m.name} (not in the checkpoint)")
            elif tuple(m.shape) != want:
                bad.append(f"{m.name} (shape {tuple(m.shape)} != {want})")
        missing = sorted(set(shapes) - {m.name for m in weights.tensors})
        if bad or missing:
            raise WeightLoadError(f"payload does not fit {self.engine.model}: "
                                  f"{', '.join(bad[:5])}"
                                  f"{'; missing ' + ', '.join(missing[:5]) if missing else ''}")

    async def recover(self, why: str) -> None:
        """A load failed inside vLLM: the model may be half-written. Restart the engine from
        its checkpoint and reload the version it served, before anything is served again."""
        log.error("%s; restarting the vLLM engine and reloading v%d", why, self.version)
        e = self.engine
        async with e.restarting:
            await e.stop()
            await e.start()
            if self.current_file is not None:
                await e.llm.collective_rpc("rlfabric_load", kwargs={
                    "path": self.current_file, "tensors": self.current_layout,
                    "version": self.version})
            else:  # no copy of the version served (NCCL, ipc): the checkpoint again
                self.version, self.checksum = self.checkpoint_as, self.checkpoint_checksum
            self.serial += 1
            if self.version >= 0:
                await e.llm.update_weight_version(str(self.version))
            for held in e.lora.every():
                await e.llm.add_lora(held.request)
            if e.paused is not None:
                await e.llm.pause_generation(mode=e.paused, clear_cache=True)

    # NOTE: the two methods below are the CUDA path, coded to vLLM's weight-transfer API;
    # the same module ships in the CPU build, where NCCL cannot run, so they refuse there
    async def init_transport(self, cmd: InitTransport, rank_offset: int) -> None:
        if cmd.stream is None:
            raise Unsupported(NOT_STREAMED)
        if on_cpu():
            raise Unsupported(NO_COLLECTIVE_CPU)
        if self.ipc:
            raise Unsupported(IPC_NOT_NCCL)
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        # NOTE: one rlfabric worker = one vLLM engine; vLLM adds dp_rank * TP * PP +
        # local_rank to this offset for each of its own ranks (membership `ranks`)
        info = {"master_address": cmd.master_addr, "master_port": cmd.master_port,
                "rank_offset": rank_offset,
                "world_size": cmd.world_size, "packed": cmd.stream.packed,
                "packed_buffer_size_bytes": cmd.stream.packed_buffer_size_bytes,
                "packed_num_buffers": cmd.stream.packed_num_buffers}
        self.nccl_epoch = 0
        try:
            await self.engine.llm.init_weight_transfer_engine(
                WeightTransferInitRequest(init_info=info))
        except Exception as exc:
            raise EngineError(f"vLLM could not join NCCL group epoch {cmd.group_epoch}: "
                              f"{type(exc).__name__}: {exc}",
                              code=ErrorCode.GROUP_JOIN_FAILED) from exc
        self.nccl_epoch = cmd.group_epoch

    async def receive_collective(self, cmd: UpdateWeights) -> None:
        if on_cpu():
            raise Unsupported(NO_COLLECTIVE_CPU)
        t = cmd.transport
        assert isinstance(t, Collective)  # the worker hands only collective updates here
        if t.group_epoch != self.nccl_epoch or not self.nccl_epoch:
            raise EngineError(f"this vLLM engine is in NCCL group epoch "
                              f"{self.nccl_epoch or None}, not {t.group_epoch}: "
                              "init_transport first", code=ErrorCode.NO_GROUP)
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        info = {"names": [m.name for m in t.tensors],
                "dtype_names": [m.dtype for m in t.tensors],
                "shapes": [list(m.shape) for m in t.tensors]}
        llm = self.engine.llm

        async def load() -> None:
            await llm.start_weight_update()
            await llm.update_weights(WeightTransferUpdateRequest(update_info=info))
            await llm.finish_weight_update(weight_version=str(cmd.version))

        def failed(exc: Exception) -> Exception:
            self.nccl_epoch = 0  # a broken group is stale
            # the received weights are gone with the group: a restart serves the last
            # version this engine holds a copy of (or the checkpoint), and says which
            return EngineError(f"vLLM did not take v{cmd.version} over NCCL "
                               f"({type(exc).__name__}: {exc}); the engine was restarted "
                               f"and serves v{self.version}", code=ErrorCode.BROADCAST_FAILED)
        # nothing on disk holds this version (keep=None)
        await self._load(load, cmd.version, keep=None, layout=(), failed=failed,
                         why=f"v{cmd.version} over NCCL failed inside vLLM")
        # NOTE: no payload bytes pass through rlfabric on this path, so the checksum is what
        # vLLM computes over its own (fused) parameters: equal across vLLM workers serving
        # the same weights (verify="workers"), not comparable with the sender's
        sums = await self.engine.llm.compute_weight_checksums()
        self.checksum = "vllm:" + _digest_of(sums)


def _copy_to_spill(path: str, version: int) -> str:
    """Our own copy of a payload (the trainer frees its staging once the next version is in
    place): what a restarted engine reloads."""
    import shutil
    import tempfile

    from rlfabric.engines.payload import SPILL_DIR

    fd, keep = tempfile.mkstemp(prefix=f"rlf_vllm_v{version}_", dir=SPILL_DIR)
    os.close(fd)
    shutil.copyfile(path, keep)
    return keep


def _digest_of(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
