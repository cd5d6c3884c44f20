"""The packed weight format: what `pack_digest` writes and digests is what `pack_into` and
`digest` make, whichever way the bytes go out."""

from __future__ import annotations

import os

import torch

from rlfabric.tensors.packing import PIECE, digest, pack_digest, pack_into, plan, pwrite_all, unpack


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "odd": torch.randn(3, 5, generator=g),  # 60 bytes: padding follows
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0),
        "big": torch.randn(PIECE // 4 * 2 + 3, generator=g),  # more than two pieces
        "strided": torch.randn(8, 6, generator=g).t(),  # not contiguous
        "last": torch.arange(5, dtype=torch.int32),  # the buffer ends with padding
    }


def test_pack_digest_into_a_buffer_matches_pack_into_and_digest() -> None:
    state = _state()
    metas, size = plan(state)
    want = bytearray(size)
    pack_into(state, metas, want)
    got = bytearray(size)
    view = memoryview(got)

    def put(offset: int, piece: memoryview) -> None:
        view[offset:offset + len(piece)] = piece

    assert pack_digest(state, metas, put) == digest(want)
    assert got == want
    back = unpack(got, metas)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_pack_digest_into_a_file_leaves_the_padding_as_holes_that_read_zero(tmp_path) -> None:
    state = _state()
    metas, size = plan(state)
    want = bytearray(size)
    pack_into(state, metas, want)
    path = tmp_path / "weights.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        os.ftruncate(fd, size)
        dg = pack_digest(state, metas, lambda off, piece: pwrite_all(fd, piece, off))
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(want)
    assert dg == digest(want)
    changed = dict(state, bf16=state["bf16"] + 1)
    assert pack_digest(changed, metas, lambda off, piece: None) != dg
