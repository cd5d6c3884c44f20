"""Every exception rlfabric raises, in one place. All derive from `RLFabricError`."""

from rlfabric.bus.errors import (
    BusError,
    InvalidWorkerId,
    MembershipChanged,
    NatsServerError,
    NatsUnavailable,
    ProvisioningError,
    QuorumNotReached,
)
from rlfabric.bus.receiver import CommandFailed
from rlfabric.schemas.errors import (
    MalformedMessage,
    RLFabricError,
    SchemaError,
    UnknownSchemaVersion,
)

__all__ = [
    "BusError",
    "CommandFailed",
    "InvalidWorkerId",
    "MalformedMessage",
    "MembershipChanged",
    "NatsServerError",
    "NatsUnavailable",
    "ProvisioningError",
    "QuorumNotReached",
    "RLFabricError",
    "SchemaError",
    "UnknownSchemaVersion",
]
