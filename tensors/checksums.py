"""Digests computed on the device that holds the bytes: integer arithmetic in torch, so the
same bytes give the same digest on the CPU and on a CUDA device, and weights on a GPU are
checked without a device->host pass.

The digest of a byte string read as little-endian 64-bit words `w_i` (zero-padded to a whole
word) is `sum_i w_i * W[i mod B] * M[i div B] mod 2**64`, with `W` and `M` fixed odd
pseudo-random words and `B` words per block. Sums of products wrap the same way in any order,
so pieces of one buffer (the buckets of a `cuda_ipc` push) digest separately and add up to the
digest of the whole; a changed word changes the sum (every weight is odd).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import xxhash

#: words per block: one block's product stays in cache on a CPU
BLOCK = 1 << 17
#: blocks per kernel on a CUDA device: fewer launches
CUDA_GROUP = 64
_M64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


_C1, _C2, _C3 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                      0x94D049BB133111EB))
_BLOCK_SEED = _signed(0xD6E8FEB86659FD93)
_weights: dict[torch.device, torch.Tensor] = {}


def _mix(z: torch.Tensor) -> torch.Tensor:
    """Odd pseudo-random int64 words from indices (splitmix64's finaliser, with arithmetic
    shifts, which every device computes alike)."""
    z = z * _C1 + _C3
    z = (z ^ (z >> 30)) * _C2
    z = (z ^ (z >> 27)) * _C3
    return (z ^ (z >> 31)) | 1


def _block_weights(device: torch.device) -> torch.Tensor:
    w = _weights.get(device)
    if w is None:
        w = _weights[device] = _mix(torch.arange(BLOCK, dtype=torch.int64, device=device))
    return w


def _block_mult(first: int, count: int, device: torch.device) -> torch.Tensor:
    idx = torch.arange(first, first + count, dtype=torch.int64, device=device)
    return _mix(idx + _BLOCK_SEED)


def _words(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A flat uint8 tensor as int64 words, and its last partial word (zero-padded) if any."""
    whole = raw.numel() // 8 * 8
    head = raw[:whole]
    if head.numel() and head.data_ptr() % 8:  # a view at an odd offset: its own copy
        head = head.clone()
    words = head.view(torch.int64)
    if whole == raw.numel():
        return words, None
    rest = raw[whole:].to(torch.int64)
    shifts = torch.arange(rest.numel(), dtype=torch.int64, device=raw.device) * 8
    return words, (rest << shifts).sum().reshape(1)


def piece_sum(raw: torch.Tensor, word_offset: int = 0) -> torch.Tensor:
    """The digest's sum over the flat uint8 tensor `raw`, whose first byte is word
    `word_offset` of the buffer: an int64 scalar on `raw`'s device (no sync)."""
    dev = raw.device
    words, partial = _words(raw.reshape(-1))
    w = _block_weights(dev)
    total = torch.zeros((), dtype=torch.int64, device=dev)
    pos, n = 0, words.numel()
    if partial is not None:  # the zero-padded last word, at index n
        blk, k = divmod(word_offset + n, BLOCK)
        total += (partial[0] * w[k]) * _block_mult(blk, 1, dev)[0]
    group = CUDA_GROUP if dev.type == "cuda" else 1
    while pos < n:
        g = word_offset + pos  # the global index of this word
        blk, k = divmod(g, BLOCK)
        if k or n - pos < BLOCK:  # a partial block (the first or the last)
            take = min(BLOCK - k, n - pos)
            part = (words[pos:pos + take] * w[k:k + take]).sum()
            total += part * _block_mult(blk, 1, dev)[0]
            pos += take
            continue
        nb = min(group, (n - pos) // BLOCK)
        rows = words[pos:pos + nb * BLOCK].view(nb, BLOCK)
        total += ((rows * w).sum(1) * _block_mult(blk, nb, dev)).sum()
        pos += nb * BLOCK
    return total


def _hex(x: int) -> str:
    return f"{x & _M64:016x}"


def device_digest(pieces: Iterable[tuple[int, torch.Tensor]]) -> str:
    """The digest of a buffer given as `(byte_offset, flat uint8 tensor)` pieces (offsets
    multiples of 8): one device->host transfer of 8 bytes per device."""
    sums = [piece_sum(raw, off // 8) for off, raw in pieces]
    total = 0
    for s in sums:
        total += int(s.item())
    return _hex(total)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as a flat uint8 tensor on its own device (a view where it can be)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def checksum(state: Mapping[str, Any]) -> str:
    """A digest of named parameters (name, dtype, shape, bytes), name-sorted, computed where
    they are: what a worker reports after a load, and what the sender expects from the state
    dict it sent. Each tensor's bytes digest on its own device; one small transfer per device
    collects the sums."""
    names = sorted(state)
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, name in enumerate(names):
        t = state[name]
        by_device.setdefault(t.device, []).append((i, piece_sum(as_bytes(t))))
    sums = [0] * len(names)
    for got in by_device.values():
        values = torch.stack([s for _, s in got]).cpu().tolist()
        for (i, _), v in zip(got, values, strict=True):
            sums[i] = v
    h = xxhash.xxh3_128()
    for name, v in zip(names, sums, strict=True):
        t = state[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{_hex(v)}|".encode())
    return h.hexdigest()
