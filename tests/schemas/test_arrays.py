"""`PackedI32` / `PackedF32` built from a list (how engines hand over tokens and logprobs) hold
exactly the little-endian bytes numpy writes, and refuse what numpy's conversion refuses, with
the same error."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlfabric.schemas import PackedF32, PackedI32

I32 = st.integers(-(2**31), 2**31 - 1)


@given(st.lists(I32, max_size=300))
def test_int_lists_pack_as_little_endian_int32(ids: list[int]) -> None:
    packed = PackedI32(ids)
    assert packed.tobytes() == struct.pack(f"<{len(ids)}i", *ids)
    assert packed.tobytes() == PackedI32(np.array(ids, dtype="<i4")).tobytes()
    assert PackedI32(tuple(ids)).tobytes() == packed.tobytes()
    assert packed.tolist() == ids


@given(st.lists(st.floats(width=32) | st.integers(-(2**24), 2**24) | st.booleans(),
                max_size=300))
def test_number_lists_pack_as_numpy_writes_float32(values: list[float]) -> None:
    expected = np.asarray(values, dtype=np.float64).astype("<f4").tobytes()
    assert PackedF32(values).tobytes() == expected


def test_float32_overflow_is_inf_as_in_numpy() -> None:
    with np.errstate(over="ignore"):
        expected = np.asarray([1e300, -1e300]).astype("<f4").tobytes()
    assert PackedF32([1e300, -1e300]).tobytes() == expected


@pytest.mark.parametrize("values, error, message", [
    ([1, 2**31], ValueError, "PackedI32: a value is outside int32"),
    ([-(2**31) - 1], ValueError, "PackedI32: a value is outside int32"),
    ([1, 2.5], TypeError, "PackedI32 takes integers, got dtype float64"),
    ([[1, 2], [3, 4]], ValueError, "PackedI32 takes a 1-d sequence, got shape (2, 2)"),
])
def test_what_int32_cannot_hold_is_refused_as_before(values: list, error: type,
                                                     message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        PackedI32(values)
    with pytest.raises(error, match=re.escape(message)):
        PackedI32(np.asarray(values))  # the numpy path says the same
