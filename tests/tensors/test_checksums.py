"""Digests computed on the tensors' device (`rlfabric.tensors.checksums`): the sum the module
defines, computed by torch in pieces, equals the same sum computed word by word with Python
integers; pieces of one buffer add up to the whole; any changed byte changes it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from rlfabric.tensors.checksums import BLOCK, checksum, device_digest
from rlfabric.tensors.models import build_model

M64 = (1 << 64) - 1


def mixed(i: int) -> int:
    """The module's `_mix`, in Python integers (wrapping at 64 bits, arithmetic shifts)."""
    def s(x: int) -> int:
        x &= M64
        return x - (1 << 64) if x >> 63 else x

    z = s(i * 0x9E3779B97F4A7C15 + 0x94D049BB133111EB)
    z = s((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9)
    z = s((z ^ (z >> 27)) * 0x94D049BB133111EB)
    return ((z ^ (z >> 31)) | 1) & M64


def reference(data: bytes) -> str:
    data += bytes(-len(data) % 8)
    words = np.frombuffer(data, dtype="<u8").tolist()
    total = 0
    for i, w in enumerate(words):
        blk, k = divmod(i, BLOCK)
        total += w * mixed(k) * mixed(blk + 0xD6E8FEB86659FD93)
    return f"{total & M64:016x}"


def rand_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [0, 3, 8, 61, 1000])
def test_the_digest_is_the_defined_sum(n: int) -> None:
    x = rand_bytes(n, n)
    assert device_digest([(0, x)]) == reference(x.numpy().tobytes())


def test_across_blocks_and_in_pieces_it_is_the_same_sum() -> None:
    x = rand_bytes(BLOCK * 8 + 4096 + 5, 1)  # one whole block, a partial one, a partial word
    whole = device_digest([(0, x)])
    # the word-by-word reference over 131 k words is slow in Python: its last 600 words only
    # differ from this one's, so the pieces are checked against the whole instead
    cuts = [0, 8 * 1000, 8 * (BLOCK - 3), 8 * (BLOCK + 7), x.numel()]
    pieces = [(a, x[a:b]) for a, b in itertools.pairwise(cuts)]
    assert device_digest(pieces) == whole
    assert device_digest(reversed(pieces)) == whole
    tail = x[-600:].clone()
    assert device_digest([(0, tail)]) == reference(tail.numpy().tobytes())


def test_any_changed_byte_or_a_moved_word_changes_it() -> None:
    x = rand_bytes(BLOCK * 8 * 2 + 40, 2)
    base = device_digest([(0, x)])
    for at in (0, 7, 8 * BLOCK - 1, 8 * BLOCK, x.numel() - 1):
        y = x.clone()
        y[at] ^= 1
        assert device_digest([(0, y)]) != base, at
    swapped = x.clone()
    swapped[:8], swapped[8:16] = x[8:16].clone(), x[:8].clone()
    assert device_digest([(0, swapped)]) != base


def test_the_checksum_names_each_tensors_name_dtype_shape_and_bytes() -> None:
    state = dict(build_model("tiny").state_dict())
    base = checksum(state)
    assert len(base) == 32 and checksum({k: v.clone() for k, v in state.items()}) == base
    name = next(iter(state))
    t = state[name]
    assert checksum({**state, name: t.reshape(-1)}) != base
    assert checksum({**state, name: t.to(torch.float64)}) != base
    assert checksum({**state, name: t + 1e-3}) != base
    assert checksum({("x" + k if k == name else k): v for k, v in state.items()}) != base
