"""Errors of the torch side (importable without torch)."""

from __future__ import annotations

from rlfabric.schemas import ErrorCode, RLFabricError


class CollectiveTimeout(RLFabricError, TimeoutError):
    """Raised when ranks did not join a collective group in time; `missing` lists them."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


class DeltaRefused(RLFabricError):
    """A weight delta that cannot be applied: against another base (`delta_base_missing`), or
    damaged (`digest_mismatch`). Nothing was changed; the full weights must be pushed."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
