"""A verified weight payload as the worker hands it to an engine: the packed buffer (in host
memory, or on a GPU as `pieces`), its tensor layout, and (for engines that load in another
process, such as vLLM) a file holding the same bytes, so no tensor is pickled across a process
boundary."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from rlfabric.schemas import TensorMeta

#: where a received buffer is spilled when an engine asks for a file: memory, not disk
SPILL_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class PackedWeights:
    def __init__(self, view: memoryview, tensors: tuple[TensorMeta, ...], *,
                 path: str | None = None, pieces: tuple[tuple[int, Any], ...] = ()) -> None:
        self.view = view
        self.tensors = tensors
        #: the packed bytes on a device, `(offset, flat uint8 tensor)`, instead of `view`
        self.pieces = pieces
        self._path = path
        self._spilled: str | None = None

    @property
    def device(self) -> str:
        """Where `state()`'s tensors are: "cpu", or the GPU holding the pieces."""
        return str(self.pieces[0][1].device) if self.pieces else "cpu"

    def state(self) -> dict[str, Any]:
        """Tensors viewing the buffer (no copy); they must not outlive the payload."""
        from rlfabric.tensors.packing import unpack, unpack_pieces

        if self.pieces:
            return unpack_pieces(self.pieces, self.tensors)
        return unpack(self.view, self.tensors)

    def file(self) -> str:
        """A file holding the packed bytes: the transport's own (a shm segment, the
        filesystem transport's file) or, for a buffer received in memory, a spill under
        /dev/shm that `close()` removes."""
        if self._path is not None:
            return self._path
        if self._spilled is None:
            fd, path = tempfile.mkstemp(prefix="rlf_payload_", dir=SPILL_DIR)
            with os.fdopen(fd, "wb") as f:
                if self.pieces:  # device bytes: to the file through host memory
                    for offset, raw in self.pieces:
                        f.seek(offset)
                        f.write(raw.cpu().numpy().data)
                else:
                    f.write(self.view)
            self._spilled = path
        return self._spilled

    def close(self) -> None:
        """Drop the view (a mapped segment can only be closed once no view is left) and any
        spill."""
        self.view = memoryview(b"")
        self.pieces = ()
        if self._spilled is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._spilled)
            self._spilled = None


@contextlib.contextmanager
def payload(view: memoryview, tensors: tuple[TensorMeta, ...], *,
            path: str | None = None, pieces: tuple[tuple[int, Any], ...] = ()
            ) -> Iterator[PackedWeights]:
    p = PackedWeights(view, tensors, path=path, pieces=pieces)
    try:
        yield p
    finally:
        p.close()
