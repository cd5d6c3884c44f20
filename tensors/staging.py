"""A host payload to a GPU in one pass: the bytes go through two pinned buffers in turn, each
piece digested while it is still in cache from the copy, while the other buffer's copy to the
device runs on a side stream. The result is the packed layout on the device, and the digest of
the host bytes, so no second pass reads them to verify.
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash

#: bytes per pinned buffer (two of them): large enough to keep the copy engine busy
CHUNK = 64 << 20
#: bytes copied and digested at a time
PIECE = 1 << 20


def to_device(view: Any, device: torch.device | str, *, chunk: int = CHUNK
              ) -> tuple[torch.Tensor, str]:
    """`view` (a host buffer) as a flat uint8 tensor on CUDA `device`, and the XXH3-128
    digest of its bytes (`rlfabric.tensors.packing.digest`)."""
    src = memoryview(view).cast("B")
    n = len(src)
    out = torch.empty(max(n, 1), dtype=torch.uint8, device=device)[:n]
    h = xxhash.xxh3_128()
    pinned = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    spans = [memoryview(p.numpy()).cast("B") for p in pinned]  # type: ignore[arg-type]  # an ndarray is a buffer
    done: list[torch.cuda.Event | None] = [None, None]
    stream = torch.cuda.Stream(device=device)
    try:
        for i, a in enumerate(range(0, n, chunk)):
            b, k = min(a + chunk, n), i % 2
            ev = done[k]
            if ev is not None:
                ev.synchronize()  # this buffer's last copy to the device has been read
            dst = spans[k]
            for p in range(a, b, PIECE):
                q = min(p + PIECE, b)
                dst[p - a:q - a] = src[p:q]
                h.update(dst[p - a:q - a])
            with torch.cuda.stream(stream):
                out[a:b].copy_(pinned[k][:b - a], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                done[k] = ev
        stream.synchronize()
    finally:
        for s in spans:
            s.release()
        src.release()
    return out, h.hexdigest()
