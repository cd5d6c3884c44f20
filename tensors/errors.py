"""Errors of the torch side (importable without torch)."""

from __future__ import annotations

from rlfabric.schemas import RLFabricError


class CollectiveTimeout(RLFabricError, TimeoutError):
    """Raised when ranks did not join a collective group in time; `missing` lists them."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing
