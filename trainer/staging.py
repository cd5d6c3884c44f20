"""The sending side of weight updates: stage a state dict for a transport, then push it.

- `shm`: one POSIX shared-memory segment on this host, kept until the next version is in place
  (late joiners on this host load it).
- `filesystem`: `<root>/<prefix>/v<version>/weights.bin`, fsynced, then a `STABLE` marker;
  workers wait for the marker, so a checkpoint writer may finish after the command is sent.
- `nats`: 4 MiB chunks on `<prefix>.weights.<version>` in the weights stream (any host);
  older versions are purged once a newer one is in place. Staged by `update_weights`, the
  chunks are sent while the command is out: each worker's consumer reads a chunk as soon as
  it is stored, so publish and read overlap (the command carries the chunk count). The
  buffer they are packed in is kept once they are stored, and the next version of the same
  layout is packed into it: one buffer the size of the weights stays with the sender (until
  `close()`), and an update does not pay for faulting in a fresh one (256 MiB: about 130 ms
  here, 4x its packing).
- `collective`: a flat buffer broadcast from rank 0 over an initialised group (gloo on CPU,
  NCCL on CUDA), two-phase (`ready`, then `done`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any

import anyio
import torch

from rlfabric.bus import Bus
from rlfabric.bus.errors import TRANSIENT
from rlfabric.schemas import (
    TRANSPORTS,
    Base,
    Collective,
    Filesystem,
    Nats,
    SharedMemory,
    Target,
    TensorMeta,
    Transport,
    UpdateWeights,
)
from rlfabric.tensors.packing import (
    STABLE_MARKER,
    WEIGHTS_FILE,
    checksum,
    pack_digest,
    plan,
    pwrite_all,
    shm_file,
)

log = logging.getLogger("rlfabric.trainer.staging")

NATS_CHUNK = 4 * 1024 * 1024
NATS_WINDOW = 16  # chunks in flight: bounds the client's buffer, keeps the pipe full
NATS_RETRY_S = 60.0  # a chunk not stored after a reconnect is retried this long, then fails

Release = Callable[[], Awaitable[None] | None]


@dataclass(eq=False)
class Staged:
    """Weights ready to push. `cmd` lacks only its cmd_id; `release()` frees the staging."""

    version: int
    transport: Transport
    digest: str
    expected_checksum: str
    nbytes: int
    flat: torch.Tensor | None = None  # collective: the uint8 tensor rank 0 broadcasts
    #: nats staged with `send_now=False`: sends the chunks; `push` runs it beside the command
    unsent: Callable[[], Coroutine[Any, Any, None]] | None = None
    _release: list[Release] = field(default_factory=list)
    _stable: Callable[[], None] | None = None

    def command(self, cmd_id: str, *, target: Target | None = None,
                reset_prefix_cache: bool = True, deadline: float = 0.0) -> UpdateWeights:
        return UpdateWeights(cmd_id=cmd_id, version=self.version, transport=self.transport,
                             digest=self.digest, target=target or Base(),
                             reset_prefix_cache=reset_prefix_cache, deadline=deadline)

    def mark_stable(self) -> None:
        """Filesystem: write the STABLE marker (done by `stage` unless asked not to)."""
        if self._stable is not None:
            self._stable()
            self._stable = None

    async def release(self) -> None:
        """Free the staging (segment, files, stream chunks); idempotent. A failure to free is
        logged, never raised: the update it served is already decided."""
        todo, self._release = self._release, []
        for fn in todo:
            try:
                out = fn()
                if inspect.isawaitable(out):
                    await out
            except Exception as exc:
                log.warning("releasing staged v%d (%s) failed: %s", self.version,
                            type(self.transport).__name__, exc)


def _pack(state: Mapping[str, Any], metas: Any, buf: Any) -> str:
    """Pack `state` into `buf`, which must read zero where no tensor goes (a fresh buffer
    does), and return the buffer's digest (run in a worker thread)."""
    view = memoryview(buf).cast("B")

    def put(offset: int, piece: memoryview) -> None:
        view[offset:offset + len(piece)] = piece

    try:
        return pack_digest(state, metas, put)
    finally:
        view.release()


def _pack_file(state: Mapping[str, Any], metas: Any, path: str, size: int, *,
               create: bool, sync: bool) -> str:
    """Pack `state` into the file at `path` (`size` bytes) with `pwrite` and return the digest:
    no page of a mapping is faulted in and nothing is zeroed first (run in a worker thread)."""
    flags = os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if create else 0)
    fd = os.open(path, flags, 0o666)  # as open(path, "wb"): the umask decides
    try:
        os.ftruncate(fd, size)
        dg = pack_digest(state, metas, lambda offset, piece: pwrite_all(fd, piece, offset))
        if sync:
            os.fsync(fd)
        return dg
    finally:
        os.close(fd)


def as_state_dict(weights: Any) -> dict[str, Any]:
    """A state dict from a module or a mapping of tensors."""
    if hasattr(weights, "state_dict") and callable(weights.state_dict):
        weights = weights.state_dict()
    if not isinstance(weights, Mapping):
        raise TypeError(f"update_weights takes a torch module or a state dict, got "
                        f"{type(weights).__name__}")
    return dict(weights)


class WeightStager:
    def __init__(self, bus: Bus, *, fs_root: str | None = None) -> None:
        self.bus = bus
        self.fs_root = fs_root or os.path.join(tempfile.gettempdir(), "rlfabric-weights")
        #: the last `nats` buffer whose chunks are all stored, and the layout packed in it
        self._spare: tuple[tuple[TensorMeta, ...], bytearray] | None = None

    def close(self) -> None:
        """Drop the kept `nats` buffer (the memory goes back at once, not with the client)."""
        self._spare = None

    async def _pack_nats(self, state: Mapping[str, Any], metas: tuple[TensorMeta, ...],
                         size: int) -> tuple[bytearray, str]:
        """Pack into the spare buffer if it holds this very layout (its padding still reads
        zero, as `_pack` needs), else into a fresh one, made in the packing thread: zeroing
        it there leaves the event loop free (a 14 GB buffer takes seconds). The spare is
        taken either way: two stagings never share one."""
        spare, self._spare = self._spare, None
        # NOTE: handed over in a box the thread empties: an idle worker thread keeps the
        # arguments of its last call, which would pin a buffer the next layout replaced
        box = [spare[1] if spare is not None and spare[0] == metas else None]

        def fill() -> tuple[bytearray, str]:
            buf = box.pop()
            if buf is None:
                buf = bytearray(size)
            return buf, _pack(state, metas, buf)

        return await anyio.to_thread.run_sync(fill)

    async def stage(self, version: int, state: Mapping[str, Any], transport: str, *,
                    mark_stable: bool = True, group_epoch: int = 0,
                    with_checksum: bool = True, send_now: bool = True) -> Staged:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}: use one of {', '.join(TRANSPORTS)} "
                             "(cuda_ipc needs a GPU build and is not available here)")
        metas, size = plan(state)
        expected = await anyio.to_thread.run_sync(checksum, state) if with_checksum else ""
        if transport == "shm":
            return await self._stage_shm(version, state, metas, size, expected)
        if transport == "filesystem":
            st = await self._stage_fs(version, state, metas, size, expected)
            if mark_stable:
                st.mark_stable()
            return st
        if transport == "nats":
            return await self._stage_nats(version, state, metas, size, expected, send_now)
        return await self._stage_collective(version, state, metas, size, expected, group_epoch)

    async def _stage_shm(self, version: int, state: Mapping[str, Any], metas: Any, size: int,
                         expected: str) -> Staged:
        name = f"rlf_{self.bus.subjects.prefix}_{version}_{uuid.uuid4().hex[:8]}"
        # the segment (and its clean-up should this process die) is SharedMemory's; the bytes
        # go in through its file where there is one (Linux): writing through the mapping
        # would fault in, and zero, every page first
        shm = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
        as_file = shm_file(name)

        def fill() -> str:
            if as_file is not None:
                return _pack_file(state, metas, as_file, max(size, 1), create=False, sync=False)
            # NOTE: the view is made and dropped inside the thread: an idle worker thread keeps
            # its last arguments, and a view of the segment held there would block its close()
            buf = shm.buf
            assert buf is not None  # a segment we created is mapped
            return _pack(state, metas, buf[:size])

        try:
            dg = await anyio.to_thread.run_sync(fill)
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        st = Staged(version, SharedMemory(name=name, tensors=metas), dg, expected, size)
        st._release += [shm.close, shm.unlink]
        return st

    async def _stage_fs(self, version: int, state: Mapping[str, Any], metas: Any, size: int,
                        expected: str) -> Staged:
        path = os.path.join(self.fs_root, self.bus.subjects.prefix, f"v{version}")

        def write() -> str:
            os.makedirs(path, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(path, STABLE_MARKER))
            return _pack_file(state, metas, os.path.join(path, WEIGHTS_FILE), size,
                              create=True, sync=True)

        dg = await anyio.to_thread.run_sync(write)
        st = Staged(version, Filesystem(path=path, require_marker=True, tensors=metas), dg,
                    expected, size)

        def stable() -> None:
            with open(os.path.join(path, STABLE_MARKER), "w") as f:
                f.write(dg)
                f.flush()
                os.fsync(f.fileno())

        st._stable = stable
        st._release.append(lambda: shutil.rmtree(path, ignore_errors=True))
        return st

    async def _stage_nats(self, version: int, state: Mapping[str, Any], metas: Any, size: int,
                          expected: str, send_now: bool) -> Staged:
        s = self.bus.subjects
        buf, dg = await self._pack_nats(state, metas, size)
        subject = s.weights(version)
        js = self.bus.js
        await js.purge_stream(s.weights_stream, subject=f"{subject}.>")  # a re-send starts clean

        async def send() -> None:
            view = memoryview(buf)

            async def one(i: int) -> None:
                # NOTE: no headers: nats-py copies the payload to prepend them (half the
                # speed). A reconnect or a lost PubAck: sent again (a chunk stored twice is
                # read once: workers count chunk indices, not messages)
                chunk = view[i * NATS_CHUNK:(i + 1) * NATS_CHUNK]
                try:
                    await self.bus.publish_stored(f"{subject}.{i}", chunk)
                except TRANSIENT:
                    await self.bus.persist(f"{subject}.{i}", bytes(chunk), {},
                                           until=time.time() + NATS_RETRY_S)

            # NATS_WINDOW chunks in flight at a time
            async with anyio.create_task_group() as tg:
                window = anyio.Semaphore(NATS_WINDOW)
                for i in range(chunks):
                    await window.acquire()

                    async def go(i: int = i) -> None:
                        try:
                            await one(i)
                        finally:
                            window.release()

                    tg.start_soon(go)
            self._spare = (metas, buf)  # every chunk stored: the next version packs here

        async def purge() -> None:
            await js.purge_stream(s.weights_stream, subject=f"{subject}.>")

        chunks = -(-size // NATS_CHUNK)
        st = Staged(version, Nats(stream=s.weights_stream, subject=subject, chunks=chunks,
                                  chunk_bytes=NATS_CHUNK, tensors=metas), dg, expected, size)
        st._release.append(purge)
        if send_now:
            await send()
        else:
            st.unsent = send
        return st

    async def _stage_collective(self, version: int, state: Mapping[str, Any], metas: Any,
                                size: int, expected: str, group_epoch: int) -> Staged:
        flat = torch.empty(size, dtype=torch.uint8)
        dg = await anyio.to_thread.run_sync(_pack, state, metas, flat.numpy().data)
        return Staged(version, Collective(group_epoch=group_epoch, tensors=metas), dg, expected,
                      size, flat=flat)
