"""Weight deltas: a packed buffer (`rlfabric.tensors.packing`) sent as what differs from a base
version's. Each tensor's span that changed is the XOR of its bit patterns with the base's,
compressed with zstd; an unchanged span is not sent (docs/decisions.md: XOR against the changed
elements and their indices, zstd against lz4). Applied to the same base, a delta gives the new
buffer bit for bit; the caller checks its digest as it checks any push's.

    delta = encode(base, new, metas, base_digest=digest(base))   # None: a full push pays more
    new = apply(base, delta, base_digest=digest(base))

The body is `MAGIC`, the `WeightDelta` header's length (8 bytes, little-endian), the header
(msgpack), then each piece's compressed bytes in header order.
"""

from __future__ import annotations

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


def encode(base: Buffer, new: Buffer, metas: Iterable[TensorMeta], *, base_digest: str,
           level: int = LEVEL, pays_below: float = PAYS_BELOW) -> bytes | None:
    """`new` as a delta against `base` (both packed with `metas`' layout); None if it would
    be `pays_below` of the full buffer or more."""
    metas = tuple(metas)
    size = buffer_size(metas)
    if len(memoryview(base)) < size or len(memoryview(new)) < size:
        raise ValueError(f"base and new must hold the {size} bytes their layout describes")
    zc = zstandard.ZstdCompressor(level=level)
    pieces, body, total = [], [], 0
    for m in metas:
        offset, nbytes = _span(m)
        if not nbytes:
            continue
        a, b = _words(base, offset, nbytes), _words(new, offset, nbytes)
        if np.array_equal(a, b):
            continue
        packed = zc.compress(np.bitwise_xor(a, b).data)
        total += len(packed)
        if total >= pays_below * size:
            return None
        pieces.append(DeltaPiece(offset=offset, nbytes=nbytes, length=len(packed)))
        body.append(packed)
    header = msgspec.msgpack.encode(WeightDelta(base=base_digest, size=size,
                                                pieces=tuple(pieces)))
    return b"".join([MAGIC, len(header).to_bytes(8, "little"), header, *body])


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


def apply(base: Buffer, delta: Buffer, *, base_digest: str) -> bytearray:
    """The buffer `delta` makes from `base` (whose digest is `base_digest`). `DeltaRefused`:
    `delta_base_missing` if the delta is against another base, `digest_mismatch` if a piece is
    damaged; the base is left as it was."""
    head, at = header(delta)
    if head.base != base_digest:
        raise DeltaRefused(ErrorCode.DELTA_BASE_MISSING,
                           f"the delta applies to the base with digest {head.base}; the base "
                           f"held has digest {base_digest}: push the full weights")
    if len(memoryview(base)) < head.size:
        raise DeltaRefused(ErrorCode.DELTA_BASE_MISSING,
                           f"the delta makes {head.size} bytes; the base held has "
                           f"{len(memoryview(base))}")
    out = bytearray(memoryview(base)[:head.size])
    view = memoryview(delta)
    zd = zstandard.ZstdDecompressor()
    for p in head.pieces:
        if p.offset + p.nbytes > head.size or at + p.length > len(view):
            raise DeltaRefused(ErrorCode.DIGEST_MISMATCH,
                               f"the delta's piece at offset {p.offset} lies outside it")
        try:
            xor = zd.decompress(view[at:at + p.length], max_output_size=p.nbytes)
        except zstandard.ZstdError as exc:
            raise DeltaRefused(ErrorCode.DIGEST_MISMATCH,
                               f"the delta's piece at offset {p.offset} is damaged: {exc}"
                               ) from None
        if len(xor) != p.nbytes:
            raise DeltaRefused(ErrorCode.DIGEST_MISMATCH,
                               f"the delta's piece at offset {p.offset} holds {len(xor)} bytes, "
                               f"not {p.nbytes}")
        words = _words(out, p.offset, p.nbytes)
        np.bitwise_xor(words, np.frombuffer(xor, dtype=np.uint64), out=words)
        at += p.length
    return out
