"""Weight updates sent as deltas (`update_weights(..., delta=True)`): the trainer keeps the
packed bytes of the last version each target (base weights, or an adapter) was pushed as, on
the host, and sends the next one as its delta against them (`rlfabric.tensors.delta`) where
every member acked that version; otherwise, or where the delta would not pay, the full
weights. Every push of this kind asks workers to keep what they load (`UpdateWeights.keep`),
so the next delta has its base on both sides. A worker that no longer holds the base refuses
the delta (`delta_base_missing`) and the client pushes the full weights at once.

Memory: two packed copies of each target on the trainer's host (the last version, and the one
before it, packed into again) and a tensor's scratch per encoding thread; one packed copy on
each worker that keeps it (a delta is applied to it in place).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

import anyio

from rlfabric import tensors
from rlfabric.schemas import TensorMeta
from rlfabric.tensors import delta

#: threads a delta is encoded on (numpy and zstd let go of the GIL)
ENCODE_THREADS = min(4, os.cpu_count() or 1)


@dataclass(frozen=True)
class Packed:
    """A version packed on the host: its layout, bytes and digest."""

    version: int
    metas: tuple[TensorMeta, ...]
    buf: bytearray
    digest: str


@dataclass(frozen=True)
class _Base:
    packed: Packed
    #: the workers that acked it: each keeps it
    holders: frozenset[str]


class DeltaBases:
    """The last version pushed of each target ("" the base weights, else the adapter's name),
    and who holds it."""

    def __init__(self) -> None:
        self._bases: dict[str, _Base] = {}
        # the bytes of a replaced base, packed into again (no new buffer to fault in each
        # push), and a buffer for one tensor's XOR
        self._spare: dict[str, bytearray] = {}
        self._scratch: list[bytearray] = []

    @property
    def nbytes(self) -> int:
        """Host memory the kept versions and their spares take."""
        return sum(len(b.packed.buf) for b in self._bases.values()) + \
            sum(map(len, self._spare.values())) + sum(map(len, self._scratch))

    async def pack(self, key: str, version: int, state: Mapping[str, Any]) -> Packed:
        spare = self._spare.pop(key, None)

        def run() -> Packed:
            metas, size = tensors.plan(state)
            buf = spare if spare is not None and len(spare) == size else bytearray(size)
            tensors.pack_into(state, metas, buf)
            return Packed(version, metas, buf, tensors.digest(buf))

        return await anyio.to_thread.run_sync(run)

    def base_for(self, key: str, new: Packed, members: Mapping[str, Sequence[str]]
                 ) -> Packed | None:
        """The version `new` may go as a delta against: the last one pushed of `key`, of the
        same layout, held by every member now (`members`: each one's `WorkerInfo.kept`; one
        that took the version from a peer says so there)."""
        base = self._bases.get(key)
        if base is None or base.packed.metas != new.metas or not members:
            return None
        digest = base.packed.digest
        if any(w not in base.holders and digest not in kept for w, kept in members.items()):
            return None
        return base.packed

    async def encode(self, base: Packed, new: Packed) -> bytes | None:
        def run() -> bytes | None:
            largest = max((m.nbytes for m in new.metas), default=0) + 64
            if any(len(s) < largest for s in self._scratch):
                self._scratch.clear()
            return delta.encode(base.buf, new.buf, new.metas, base_digest=base.digest,
                                scratch=self._scratch, threads=ENCODE_THREADS)

        return await anyio.to_thread.run_sync(run)

    def packed(self, key: str) -> Packed | None:
        """The last version of `key` pushed this way (what the next delta is against)."""
        base = self._bases.get(key)
        return base.packed if base is not None else None

    def keep(self, key: str, packed: Packed, holders: Set[str]) -> None:
        old = self._bases.get(key)
        self._bases[key] = _Base(packed, frozenset(holders))
        if old is not None and old.packed.buf is not packed.buf:
            self._spare[key] = old.packed.buf

    def forget(self, key: str) -> None:
        self._bases.pop(key, None)
        self._spare.pop(key, None)
