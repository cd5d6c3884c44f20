"""The bus: NATS connection, embedded server, subjects, streams/KV, membership, quorum."""

from rlfabric.bus.control.acks import AckFields
from rlfabric.bus.control.membership import (
    MembershipWatcher,
    Registration,
    fingerprint,
    new_worker_info,
)
from rlfabric.bus.control.quorum import Broadcaster, Fanout, QuorumPolicy, new_cmd_id
from rlfabric.bus.control.receiver import CommandContext, CommandReceiver
from rlfabric.bus.control.view import fleet_view
from rlfabric.bus.errors import (
    BusError,
    CommandFailed,
    DuplicateWorker,
    InvalidName,
    MembershipChanged,
    MembershipTimeout,
    NatsAuthFailed,
    NatsServerError,
    NatsUnavailable,
    PayloadTooLarge,
    PermissionDenied,
    ProvisioningError,
    QuorumNotReached,
    StorageFull,
)
from rlfabric.bus.nats.cluster import EmbeddedCluster
from rlfabric.bus.nats.connect import ConnectOptions, connect
from rlfabric.bus.nats.provision import Limits, provision
from rlfabric.bus.nats.server import EmbeddedNats, find_nats_server
from rlfabric.bus.session import Bus
from rlfabric.bus.subjects import Subjects

__all__ = [
    "AckFields",
    "Broadcaster",
    "Bus",
    "BusError",
    "CommandContext",
    "CommandFailed",
    "CommandReceiver",
    "ConnectOptions",
    "DuplicateWorker",
    "EmbeddedCluster",
    "EmbeddedNats",
    "Fanout",
    "InvalidName",
    "Limits",
    "MembershipChanged",
    "MembershipTimeout",
    "MembershipWatcher",
    "NatsAuthFailed",
    "NatsServerError",
    "NatsUnavailable",
    "PayloadTooLarge",
    "PermissionDenied",
    "ProvisioningError",
    "QuorumNotReached",
    "QuorumPolicy",
    "Registration",
    "StorageFull",
    "Subjects",
    "connect",
    "find_nats_server",
    "fingerprint",
    "fleet_view",
    "new_cmd_id",
    "new_worker_info",
    "provision",
]
