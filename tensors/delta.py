"""Weight deltas: a packed buffer (`rlfabric.tensors.packing`) sent as what differs from a base
version's. Each tensor's span that changed is the XOR of its bit patterns with the base's,
compressed with zstd; an unchanged span is not sent (docs/decisions.md: XOR against the changed
elements and their indices, zstd against lz4). Applied to the same base, a delta gives the new
buffer bit for bit; the caller checks its digest as it checks any push's.

    delta = encode(base, new, metas, base_digest=digest(base))   # None: a full push pays more
    new = apply(base, delta, base_digest=digest(base))             # or in_place=True, revert()

The body is `MAGIC`, the `WeightDelta` header's length (8 bytes, little-endian), the header
(msgpack), then each piece's compressed bytes in header order.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np
import zstandard

from rlfabric.schemas import DeltaPiece, ErrorCode, TensorMeta, WeightDelta
from rlfabric.tensors.errors import DeltaRefused
from rlfabric.tensors.packing import buffer_size

MAGIC = b"RLFD1"
#: a delta larger than this share of the full buffer is not worth its encoding: push the full
PAYS_BELOW = 0.5
#: zstd's level: level 1 compresses the XOR of two steps' weights as small as level 3, faster
LEVEL = 1
_ALIGN = 64  # packing's: every span starts and is padded to a multiple of it
#: bytes, bytearray, memoryview, mmap: anything exporting the buffer protocol
Buffer = Any


def _span(m: TensorMeta) -> tuple[int, int]:
    return m.offset, (m.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def _words(buf: Buffer, offset: int, nbytes: int) -> np.ndarray:
    # 8-byte words: spans are 64-byte aligned and padded, so whole words
    return np.frombuffer(buf, dtype=np.uint64, count=nbytes // 8, offset=offset)


def scratch_for(metas: Iterable[TensorMeta]) -> bytearray:
    """A buffer for the largest span of `metas`: `encode` and `apply` reuse it instead of
    allocating (and faulting in) a new one per tensor."""
    return bytearray(max((_span(m)[1] for m in metas), default=0))


def encode(base: Buffer, new: Buffer, metas: Iterable[TensorMeta], *, base_digest: str,
           level: int = LEVEL, pays_below: float = PAYS_BELOW,
           scratch: list[bytearray] | None = None, threads: int = 1) -> bytes | None:
    """`new` as a delta against `base` (both packed with `metas`' layout); None if it would
    be `pays_below` of the full buffer or more. `threads` encode tensors side by side (numpy
    and zstd let go of the GIL); `scratch` holds a buffer per thread (`scratch_for`), reused
    from one call to the next, else made here."""
    metas = tuple(metas)
    size = buffer_size(metas)
    metas = tuple(m for m in metas if m.nbytes)
    if len(memoryview(base)) < size or len(memoryview(new)) < size:
        raise ValueError(f"base and new must hold the {size} bytes their layout describes")
    threads = max(1, min(threads, len(metas)))
    scratch = scratch if scratch is not None else []
    while len(scratch) < threads:
        scratch.append(scratch_for(metas))

    def run(k: int) -> list[tuple[DeltaPiece, bytes]]:
        zc, tmp, out = zstandard.ZstdCompressor(level=level), scratch[k], []
        for m in metas[k::threads]:
            offset, nbytes = _span(m)
            a, b = _words(base, offset, nbytes), _words(new, offset, nbytes)
            if not np.array_equal(a, b):
                packed = zc.compress(np.bitwise_xor(a, b, out=_words(tmp, 0, nbytes)).data)
                out.append((DeltaPiece(offset=offset, nbytes=nbytes, length=len(packed)),
                            packed))
        return out

    if threads == 1:
        done = run(0)
    else:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            done = [x for part in pool.map(run, range(threads)) for x in part]
    done.sort(key=lambda piece: piece[0].offset)
    if sum(p.length for p, _ in done) >= pays_below * size:
        return None
    header = msgspec.msgpack.encode(WeightDelta(base=base_digest, size=size,
                                                pieces=tuple(p for p, _ in done)))
    return b"".join([MAGIC, len(header).to_bytes(8, "little"), header,
                     *(body for _, body in done)])


def header(delta: Buffer) -> tuple[WeightDelta, int]:
    """The delta's header and where its body starts; `DeltaRefused` (`digest_mismatch`) if it
    is no delta."""
    view = memoryview(delta)
    if bytes(view[:len(MAGIC)]) != MAGIC or len(view) < len(MAGIC) + 8:
        raise DeltaRefused(ErrorCode.DIGEST_MISMATCH, "not a weight delta (its first bytes are "
                           "not rlfabric's delta mark)")
    n = int.from_bytes(view[len(MAGIC):len(MAGIC) + 8], "little")
    start = len(MAGIC) + 8
    try:
        head = msgspec.msgpack.decode(view[start:start + n], type=WeightDelta)
    except msgspec.DecodeError as exc:
        raise DeltaRefused(ErrorCode.DIGEST_MISMATCH, f"the delta's header is unreadable: {exc}"
                           ) from None
    return head, start + n


def apply(base: Buffer, delta: Buffer, *, base_digest: str, in_place: bool = False,
          scratch: bytearray | None = None) -> bytearray:
    """The buffer `delta` makes from `base` (whose digest is `base_digest`): a new one, or
    `base` itself changed (`in_place`, a bytearray; `revert` undoes it). `DeltaRefused`:
    `delta_base_missing` if the delta is against another base, `digest_mismatch` if a piece is
    damaged; the base is then as it was."""
    head, at = header(delta)
    if head.base != base_digest:
        raise DeltaRefused(ErrorCode.DELTA_BASE_MISSING,
                           f"the delta applies to the base with digest {head.base}; the base "
                           f"held has digest {base_digest}: push the full weights")
    if len(memoryview(base)) < head.size:
        raise DeltaRefused(ErrorCode.DELTA_BASE_MISSING,
                           f"the delta makes {head.size} bytes; the base held has "
                           f"{len(memoryview(base))}")
    if in_place and not isinstance(base, bytearray):
        raise TypeError("apply(in_place=True) changes a bytearray")
    out = base if in_place else bytearray(memoryview(base)[:head.size])
    _xor_in(out, head, memoryview(delta), at, scratch)
    return out


def revert(buf: bytearray, delta: Buffer, *, scratch: bytearray | None = None) -> None:
    """Undo `apply(buf, delta, in_place=True)` (the XOR again gives the base back)."""
    head, at = header(delta)
    _xor_in(buf, head, memoryview(delta), at, scratch)


def _xor_in(out: bytearray, head: WeightDelta, view: memoryview, at: int,
            scratch: bytearray | None) -> None:
    """XOR each piece into `out`; a damaged one undoes those before it, then raises."""
    if scratch is None or len(scratch) < max((p.nbytes for p in head.pieces), default=0):
        scratch = bytearray(max((p.nbytes for p in head.pieces), default=0))
    zd = zstandard.ZstdDecompressor()
    starts = []
    for p in head.pieces:  # every piece in bounds before any is applied
        if p.offset + p.nbytes > len(out) or at + p.length > len(view) or p.nbytes % 8:
            raise DeltaRefused(ErrorCode.DIGEST_MISMATCH,
                               f"the delta's piece at offset {p.offset} lies outside it")
        starts.append(at)
        at += p.length
    for i, (p, start) in enumerate(zip(head.pieces, starts, strict=True)):
        try:
            xor = _decompressed(zd, view, start, p, scratch)
        except DeltaRefused:
            for q, s in zip(head.pieces[:i], starts, strict=False):
                _xor_piece(out, q, _decompressed(zd, view, s, q, scratch))
            raise
        _xor_piece(out, p, xor)


def _xor_piece(out: bytearray, p: DeltaPiece, xor: np.ndarray) -> None:
    words = _words(out, p.offset, p.nbytes)
    np.bitwise_xor(words, xor, out=words)


def _decompressed(zd: Any, view: memoryview, start: int, p: DeltaPiece, scratch: bytearray
                  ) -> np.ndarray:
    """Piece `p`'s XOR words, decompressed into `scratch`; `DeltaRefused` if damaged."""
    dst = memoryview(scratch)[:p.nbytes]
    got = 0
    try:
        with zd.stream_reader(view[start:start + p.length]) as reader:
            while got < p.nbytes:
                n = reader.readinto(dst[got:])
                if not n:
                    break
                got += n
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise DeltaRefused(ErrorCode.DIGEST_MISMATCH,
                           f"the delta's piece at offset {p.offset} is damaged: {exc}") from None
    if got != p.nbytes or extra:
        raise DeltaRefused(ErrorCode.DIGEST_MISMATCH,
                           f"the delta's piece at offset {p.offset} holds "
                           f"{'more than ' if extra else ''}{got} bytes, not {p.nbytes}")
    return _words(scratch, 0, p.nbytes)
