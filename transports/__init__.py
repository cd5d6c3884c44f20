"""Weight transports: one module per transport holds both ends (`stage` on the trainer,
`receive` on the worker), selected by name through the registry. Built in: shared memory,
filesystem, nats (JetStream chunks), collective (a gloo or NCCL broadcast) and cuda_ipc (GPU
buffers mapped by workers on the trainer's host).

Importing this package costs no torch; a transport loads it when it first packs or unpacks.
"""

from rlfabric.transports import collective, cuda_ipc, filesystem, nats, shm
from rlfabric.transports.protocol import (
    GroupSlot,
    Received,
    ReceiveJob,
    Staged,
    StageJob,
    TransportError,
    WeightTransport,
)
from rlfabric.transports.registry import Transports, lookup, name_of, names, register, unregister

for _builtin in (shm.SharedMemoryTransport, filesystem.FilesystemTransport,
                 nats.NatsTransport, collective.CollectiveTransport,
                 cuda_ipc.CudaIpcTransport):
    register(_builtin)

__all__ = [
    "GroupSlot",
    "ReceiveJob",
    "Received",
    "StageJob",
    "Staged",
    "TransportError",
    "Transports",
    "WeightTransport",
    "lookup",
    "name_of",
    "names",
    "register",
    "unregister",
]
