"""`shm`: one POSIX shared-memory segment on this host, kept until the next version is in place
(late joiners on this host load it); workers map it read-in-place, no copy."""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from multiprocessing import resource_tracker, shared_memory
from typing import TYPE_CHECKING, Any

import anyio

from rlfabric import tensors
from rlfabric.schemas import ErrorCode, SharedMemory
from rlfabric.transports.protocol import (
    Received,
    ReceiveJob,
    Staged,
    StageJob,
    TransportError,
    room_for,
)

if TYPE_CHECKING:
    from rlfabric.bus import Bus

log = logging.getLogger("rlfabric.transports.shm")


#: where Linux keeps POSIX shared-memory segments
SHM_DIR = "/dev/shm"


def shm_file(name: str) -> str | None:
    """The file behind segment `name` on Linux (/dev/shm), else None."""
    path = f"{SHM_DIR}/{name}"
    return path if os.path.exists(path) else None


class SharedMemoryTransport:
    name = "shm"
    help = "a shared-memory segment on this host (trainer and workers on one machine)"
    locator = SharedMemory
    pull = True
    lasting = True

    def __init__(self, bus: Bus) -> None:
        del bus

    def close(self) -> None:
        pass

    async def stage(self, job: StageJob) -> Staged:
        name = f"rlf_{job.prefix}_{job.version}_{uuid.uuid4().hex[:8]}"
        _room(job.size)
        # the segment (and its clean-up should this process die) is SharedMemory's; the bytes
        # go in through its file where there is one (Linux): writing through the mapping
        # would fault in, and zero, every page first
        shm = shared_memory.SharedMemory(name=name, create=True, size=max(job.size, 1))
        as_file = shm_file(name)

        def fill() -> str:
            if as_file is not None:
                dg: str = tensors.pack_file(job.state, job.tensors, as_file, max(job.size, 1),
                                            create=False, sync=False)
                return dg
            # NOTE: the view is made and dropped inside the thread: an idle worker thread keeps
            # its last arguments, and a view of the segment held there would block its close()
            buf = shm.buf
            assert buf is not None  # a segment we created is mapped
            packed: str = tensors.pack_buffer(job.state, job.tensors, buf[:job.size])
            return packed

        try:
            dg = await anyio.to_thread.run_sync(fill)
        except BaseException as exc:
            shm.close()
            shm.unlink()
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise TransportError(ErrorCode.STORAGE_FULL, f"the shm transport ran out of "
                                     f"space in {SHM_DIR} ({exc})") from exc
            raise
        st = Staged(job.version, SharedMemory(name=name, tensors=job.tensors), dg,
                    job.expected_checksum, job.size)
        st.on_release(shm.close)
        st.on_release(shm.unlink)
        return st

    @contextlib.asynccontextmanager
    async def receive(self, locator: SharedMemory, job: ReceiveJob) -> AsyncIterator[Received]:
        with _open(locator.name) as buf:
            yield Received(buf, path=shm_file(locator.name))


def _room(size: int) -> None:
    if os.path.isdir(SHM_DIR):  # one statfs: what a segment of `size` bytes would not fit in
        room_for(size, SHM_DIR, "the shm transport")


@contextlib.contextmanager
def _open(name: str) -> Iterator[Any]:
    as_file = shm_file(name)
    if hasattr(mmap, "MAP_POPULATE") and as_file is not None:
        # mapped with every page in place at once, not a fault per 4 KiB page as it is read
        fd = os.open(as_file, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        buf = memoryview(mm)
        try:
            yield buf
        finally:
            try:
                buf.release()
                mm.close()
            except BufferError:  # a view still exists somewhere: unmapped when they go
                log.warning("shared memory %s still has views; it is unmapped when they go",
                            name)
        return
    shm = shared_memory.SharedMemory(name=name, create=False)
    # NOTE: Python < 3.13 registers opened segments with the resource tracker, which would
    # unlink the trainer's segment when this worker exits. The trainer owns it.
    with contextlib.suppress(Exception):
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # the name as registered (leading slash) is private
    try:
        yield shm.buf
    finally:
        try:
            shm.close()
        except BufferError:  # a view still exists somewhere: the mapping lingers until GC
            log.warning("shared memory %s still has views; it is unmapped when they go", name)
