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
from rlfabric.engines.protocol import RequestRejected, WeightLoadError
from rlfabric.schemas.errors import (
    MalformedMessage,
    RLFabricError,
    SchemaError,
    UnknownSchemaVersion,
)
from rlfabric.trainer.errors import TransportInitFailed, WeightsMismatch

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
    "RequestRejected",
    "SchemaError",
    "TransportInitFailed",
    "UnknownSchemaVersion",
    "WeightLoadError",
    "WeightsMismatch",
]
