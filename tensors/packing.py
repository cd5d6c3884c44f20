"""The packed weight format both sides agree on: every tensor's bytes at a 64-byte aligned
offset of one flat buffer, described by `TensorMeta`s; a `digest` of the buffer travels in
`UpdateWeights`. (The `checksum` of loaded parameters each `Ack` carries is
`rlfabric.tensors.checksums`', computed on the parameters' own device.)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import xxhash

from rlfabric.schemas.control import TensorMeta

ALIGN = 64
#: bytes packed and digested at a time: the digest reads a piece while it is still in cache
PIECE = 1 << 20


def dtype_of(name: str) -> torch.dtype:
    """`"torch.bfloat16"` (or `"bfloat16"`) -> `torch.bfloat16`."""
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dt


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan(state: Mapping[str, Any]) -> tuple[tuple[TensorMeta, ...], int]:
    """Offsets of every tensor of `state` in the flat buffer, and the buffer's size."""
    metas, offset = [], 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        metas.append(TensorMeta(name=name, dtype=str(t.dtype), shape=tuple(t.shape),
                                offset=offset, nbytes=nbytes))
        offset += _aligned(nbytes)
    return tuple(metas), offset


def buffer_size(metas: Iterable[TensorMeta]) -> int:
    """The size `plan` gave the buffer these metas describe (what the digest covers)."""
    return max((m.offset + _aligned(m.nbytes) for m in metas), default=0)


def pack_into(state: Mapping[str, Any], metas: Iterable[TensorMeta], buf: Any) -> None:
    """Copy each tensor's bytes to its offset in `buf` (a writable buffer of the planned size)."""
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    for m in metas:
        if not m.nbytes:
            continue
        src = state[m.name].detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        flat[m.offset:m.offset + m.nbytes].copy_(src)


def pack_digest(state: Mapping[str, Any], metas: Iterable[TensorMeta],
                write: Callable[[int, memoryview], object]) -> str:
    """Hand every tensor's bytes to `write(offset, piece)`, `PIECE` bytes at a time, and return
    the `digest` of the buffer `pack_into` would fill (the zero padding between tensors
    included, so `write` may skip it: a fresh buffer or file reads as zeros there). Each piece
    is read from main memory once, for the copy and the digest together."""
    h = xxhash.xxh3_128()
    pos = 0
    ordered = sorted(metas, key=lambda m: m.offset)
    for m in ordered:
        if m.offset > pos:
            h.update(bytes(m.offset - pos))
        pos = m.offset + m.nbytes
        if not m.nbytes:
            continue
        src = state[m.name].detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        whole = memoryview(src)
        for a in range(0, m.nbytes, PIECE):
            piece = whole[a:a + PIECE]
            write(m.offset + a, piece)
            h.update(piece)
    end = buffer_size(ordered)
    if end > pos:
        h.update(bytes(end - pos))
    return h.hexdigest()


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """`os.pwrite` until every byte is written."""
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def pack_buffer(state: Mapping[str, Any], metas: Iterable[TensorMeta], buf: Any) -> str:
    """Pack `state` into `buf`, which must read zero where no tensor goes (a fresh buffer
    does), and return the buffer's digest."""
    view = memoryview(buf).cast("B")

    def put(offset: int, piece: memoryview) -> None:
        view[offset:offset + len(piece)] = piece

    try:
        return pack_digest(state, metas, put)
    finally:
        view.release()


def pack_file(state: Mapping[str, Any], metas: Iterable[TensorMeta], path: str, size: int, *,
              create: bool, sync: bool) -> str:
    """Pack `state` into the file at `path` (`size` bytes) with `pwrite` and return the digest:
    no page of a mapping is faulted in and nothing is zeroed first."""
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


def unpack(buf: Any, metas: Iterable[TensorMeta]) -> dict[str, Any]:
    """Tensors viewing `buf` (a writable buffer): no copy."""
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    out = {}
    for m in metas:
        raw = flat[m.offset:m.offset + m.nbytes]
        out[m.name] = raw.view(dtype_of(m.dtype)).reshape(m.shape)
    return out


def unpack_pieces(pieces: Iterable[tuple[int, Any]], metas: Iterable[TensorMeta]
                  ) -> dict[str, Any]:
    """Tensors viewing `pieces` (`(offset, flat uint8 tensor)` covering the packed layout,
    on any device): no copy."""
    spans = sorted(pieces, key=lambda p: p[0])
    out = {}
    for m in metas:
        for start, raw in spans:
            if start <= m.offset and m.offset + m.nbytes <= start + raw.numel():
                at = m.offset - start
                out[m.name] = raw[at:at + m.nbytes].view(dtype_of(m.dtype)).reshape(m.shape)
                break
        else:
            raise ValueError(f"{m.name}: bytes [{m.offset}, {m.offset + m.nbytes}) are in no "
                             "piece of the payload")
    return out


def digest(buf: Any) -> str:
    """The digest carried by `UpdateWeights`: XXH3-128 of the packed buffer (an integrity
    check against corruption and partial payloads, much faster than a cryptographic hash)."""
    return xxhash.xxh3_128_hexdigest(memoryview(buf))
