"""The root of rlfabric's exception hierarchy and the errors of the wire layer.

Every exception rlfabric raises derives from `RLFabricError`; `rlfabric.errors` re-exports the
whole hierarchy in one place.
"""

from __future__ import annotations


class RLFabricError(Exception):
    """Base class of every error rlfabric raises."""


class SchemaError(RLFabricError):
    """Raised when bytes on the wire cannot be read as the expected rlfabric message."""

    def __init__(self, message: str, *, subject: str = "", type_name: str = "") -> None:
        super().__init__(message)
        self.subject = subject
        self.type_name = type_name


class MalformedMessage(SchemaError):
    """Raised when a payload is not valid msgpack or does not match the message's fields."""


class UnknownSchemaVersion(SchemaError):
    """Raised when a message declares a major `rlf-schema` version this build cannot read."""

    def __init__(self, message: str, *, version: str, subject: str = "", type_name: str = ""):
        super().__init__(message, subject=subject, type_name=type_name)
        self.version = version
