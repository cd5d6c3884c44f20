"""Packed little-endian int32 / float32 arrays: how token ids and logprobs travel.

A list of Python numbers costs far more to encode and decode than the same values as packed
bytes (docs/benchmarks.md). `PackedI32` / `PackedF32` hold the bytes, behave
like read-only sequences, and hand out numpy views without copying (`.numpy()`,
`np.asarray(x)`; `torch.from_numpy(x.numpy().copy())` when a writable tensor is needed).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator
from typing import Any, ClassVar, Self

import numpy as np

#: the `array` module packs in the machine's byte order (the wire is little-endian), and
#: its "i" and "f" are 4 bytes wide wherever CPython runs; where not, numpy packs every list
_SWAP = sys.byteorder != "little"
_ARRAY_FITS = array("i").itemsize == 4 and array("f").itemsize == 4


class _Packed:
    __slots__ = ("_buf",)
    _buf: bytes
    dtype: ClassVar[np.dtype[Any]]
    #: the `array` typecode of the same width, for lists (an engine's tokens and logprobs)
    _code: ClassVar[str]

    def __init__(self, values: Any = b"") -> None:
        if type(values) is not bytes and isinstance(values, (bytes, bytearray, memoryview)):
            values = bytes(values)
        if type(values) is bytes:  # the common case: off the wire, or packed by an engine
            if len(values) % self.dtype.itemsize:
                raise ValueError(
                    f"{type(self).__name__}: {len(values)} bytes is not a whole number of "
                    f"{self.dtype.itemsize}-byte elements"
                )
            self._buf = values
            return
        if isinstance(values, _Packed):
            if values.dtype != self.dtype:
                raise TypeError(
                    f"cannot reinterpret {type(values).__name__} as {type(self).__name__}"
                )
            self._buf = values._buf
            return
        if isinstance(values, np.ndarray) and values.dtype == self.dtype and values.ndim == 1:
            self._buf = values.tobytes()  # the common case: already the wire type
            return
        if (type(values) is list or type(values) is tuple) and _ARRAY_FITS:
            # `array` is cheaper than numpy's checked conversion for short lists; what it
            # refuses (a float or an out-of-range value for int32, a nested list) goes on to
            # numpy below, which says what is wrong
            try:
                packed = array(self._code, values)
            except (TypeError, OverflowError):
                pass
            else:
                if _SWAP:
                    packed.byteswap()
                self._buf = packed.tobytes()
                return
        arr = np.asarray(values)
        if arr.ndim > 1:
            raise ValueError(f"{type(self).__name__} takes a 1-d sequence, got shape {arr.shape}")
        if arr.size and self.dtype.kind == "i" and arr.dtype.kind not in "iub":
            raise TypeError(f"{type(self).__name__} takes integers, got dtype {arr.dtype}")
        if arr.size and self.dtype.kind == "i":
            info = np.iinfo(np.int32)
            if int(arr.min()) < info.min or int(arr.max()) > info.max:
                raise ValueError(f"{type(self).__name__}: a value is outside int32")
        self._buf = np.ascontiguousarray(arr, dtype=self.dtype).tobytes()

    @classmethod
    def from_wire(cls, buf: bytes) -> Self:
        """The array whose packed bytes are `buf` (what a decoder read), without the
        conversions of the constructor."""
        if len(buf) % cls.dtype.itemsize:
            raise ValueError(f"{cls.__name__}: {len(buf)} bytes is not a whole number of "
                             f"{cls.dtype.itemsize}-byte elements")
        out = cls.__new__(cls)
        out._buf = buf
        return out

    def numpy(self) -> np.ndarray[Any, np.dtype[Any]]:
        """A read-only numpy view over the packed bytes (no copy)."""
        return np.frombuffer(self._buf, dtype=self.dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, np.dtype[Any]]:
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype)

    def tobytes(self) -> bytes:
        return self._buf

    def tolist(self) -> list[Any]:
        out: list[Any] = self.numpy().tolist()
        return out

    def __len__(self) -> int:
        return len(self._buf) // self.dtype.itemsize

    def __iter__(self) -> Iterator[Any]:
        return iter(self.tolist())

    def __getitem__(self, i: Any) -> Any:
        item = self.numpy()[i]
        return item.item() if isinstance(item, np.generic) else type(self)(item)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Packed):
            return self.dtype == other.dtype and self._buf == other._buf
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.dtype.str, self._buf))

    def __repr__(self) -> str:
        vals = self.tolist()
        shown = vals if len(vals) <= 8 else [*vals[:8], "..."]
        return f"{type(self).__name__}({shown}, n={len(vals)})"


class PackedI32(_Packed):
    """Little-endian int32 values (token ids)."""

    __slots__ = ()
    dtype = np.dtype("<i4")
    _code = "i"


class PackedF32(_Packed):
    """Little-endian float32 values (logprobs)."""

    __slots__ = ()
    dtype = np.dtype("<f4")
    _code = "f"


PACKED_TYPES: tuple[type[_Packed], ...] = (PackedI32, PackedF32)
