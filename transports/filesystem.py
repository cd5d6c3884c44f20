"""`filesystem`: `<root>/<prefix>/v<version>/weights.bin`, fsynced, then a `STABLE` marker;
workers wait for the marker, so a checkpoint writer may finish after the command is sent.
Any host that mounts the directory can read it."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio

from rlfabric import tensors
from rlfabric.schemas import ErrorCode, Filesystem
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

#: the packed buffer's file name, and the marker written once it is whole
WEIGHTS_FILE = "weights.bin"
STABLE_MARKER = "STABLE"


class FilesystemTransport:
    name = "filesystem"
    help = "a file under a shared directory (any host that mounts it)"
    locator = Filesystem
    pull = True
    lasting = True
    #: where versions are written: `<root>/<prefix>/v<version>/`
    root = os.path.join(tempfile.gettempdir(), "rlfabric-weights")

    def __init__(self, bus: Bus) -> None:
        del bus

    def close(self) -> None:
        pass

    async def stage(self, job: StageJob) -> Staged:
        path = os.path.join(self.root, job.prefix, f"v{job.version}")

        def write() -> str:
            os.makedirs(path, exist_ok=True)
            room_for(job.size, path, "the filesystem transport")
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(path, STABLE_MARKER))
            dg: str = tensors.pack_file(job.state, job.tensors,
                                        os.path.join(path, WEIGHTS_FILE), job.size,
                                        create=True, sync=True)
            return dg

        try:
            dg = await anyio.to_thread.run_sync(write)
        except BaseException as exc:
            # part-way (no space left, ...): what was written goes, the next push has the room
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lambda: shutil.rmtree(path, ignore_errors=True))
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise TransportError(ErrorCode.STORAGE_FULL, f"the filesystem transport ran out "
                                     f"of space writing {path} ({exc})") from exc
            raise
        st = Staged(job.version, Filesystem(path=path, require_marker=True, tensors=job.tensors),
                    dg, job.expected_checksum, job.size)

        def stable() -> None:
            with open(os.path.join(path, STABLE_MARKER), "w") as f:
                f.write(dg)
                f.flush()
                os.fsync(f.fileno())

        st._stable = stable
        st.on_release(lambda: shutil.rmtree(path, ignore_errors=True))
        if job.mark_stable:
            st.mark_stable()
        return st

    @contextlib.asynccontextmanager
    async def receive(self, locator: Filesystem, job: ReceiveJob) -> AsyncIterator[Received]:
        path = os.path.join(locator.path, WEIGHTS_FILE)
        if locator.require_marker:
            marker = os.path.join(locator.path, STABLE_MARKER)
            wait = job.fetch_timeout
            if job.deadline:
                wait = max(0.0, min(wait, job.deadline - time.time()))
            with anyio.fail_after(wait):
                # a file appearing on a (possibly network) filesystem has no event to await
                while not await anyio.Path(marker).exists():  # noqa: ASYNC110
                    await anyio.sleep(0.05)
        yield Received(await anyio.to_thread.run_sync(_read_file, path), path=path)


def _read_file(path: str) -> bytearray:
    with open(path, "rb") as f:
        buf = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(buf)
    return buf
