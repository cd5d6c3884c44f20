"""The base of every wire struct: frozen, keyword-only, and packed arrays coerced on build."""

from __future__ import annotations

from typing import Any

import msgspec

from rlfabric.schemas.arrays import PackedF32, PackedI32


class Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Base of rlfabric wire messages. Evolution rules live in docs/schema-evolution.md."""


def coerce_packed(struct: Any, **fields: type) -> None:
    """Turn lists / numpy / torch values of the named fields into their packed type in place."""
    for name, kind in fields.items():
        value = getattr(struct, name)
        if value is not None and not isinstance(value, kind):
            msgspec.structs.force_setattr(struct, name, kind(value))


__all__ = ["Message", "PackedF32", "PackedI32", "coerce_packed"]
