"""vLLM's own NCCL weight transfer, driven over the bus.

vLLM's trainer side (`NCCLTrainerWeightTransferEngine`) drives a weight update through any
object with four synchronous methods (its `VLLMWeightSyncClient` protocol: the HTTP client
posts to each server's routes). `BusWeightSyncClient` is that object for rlfabric: each call
becomes one quorum-acked command to every vLLM worker, so a worker that misses the update is
named in a `QuorumNotReached`, never skipped. vLLM keeps what it is good at: the rendezvous,
the packed NCCL broadcast and the layer-wise load inside its workers. `VllmNcclSync` wires
the two together:

    async with FabricClient.connect(url) as fabric:
        sync = VllmNcclSync(fabric, model)   # model: the trainer's torch module, on CUDA
        await sync.init()                    # every vLLM worker joins vLLM's NCCL group
        rep = await sync.send(version=7)     # rank 0 broadcasts; every worker acks v7

CUDA on both sides. Coded to vLLM's weight-transfer API (its module ships in the CPU build
too) and not run with NCCL on these machines: vLLM's CPU build answers `unsupported` at once,
which the tests check through this client.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from rlfabric.bus import QuorumPolicy, new_cmd_id
from rlfabric.concurrency.sync import beside
from rlfabric.schemas import (
    Collective,
    FanoutReport,
    InitTransport,
    TensorMeta,
    TensorStream,
    UpdateWeights,
)
from rlfabric.trainer.errors import TransportInitFailed

if TYPE_CHECKING:
    from rlfabric.trainer.client import FabricClient


class BusWeightSyncClient:
    """vLLM's `VLLMWeightSyncClient` over the bus. Made on the event loop; its methods are
    called from vLLM's threads. `rank_offsets` / `world_size`: rlfabric's handshake (vLLM's
    own init info assumes a single engine at rank offset 1)."""

    def __init__(self, fabric: FabricClient, *, rank_offsets: dict[str, int], world_size: int,
                 group_epoch: int, policy: QuorumPolicy) -> None:
        self.fabric = fabric
        self.rank_offsets = dict(rank_offsets)
        self.world_size = world_size
        self.group_epoch = group_epoch
        self.policy = policy
        self.version = -1  # the version `update_weights` sends; set before each round
        self.reports: list[FanoutReport] = []
        self.failed = anyio.Event()  # a command did not reach its quorum: `error` says why
        self.error: Exception | None = None
        self._token = anyio.lowlevel.current_token()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        wire = TensorStream(**{k: init_info[k] for k in
                           ("packed", "packed_buffer_size_bytes", "packed_num_buffers")
                           if k in init_info})
        self._send(InitTransport(
            cmd_id=new_cmd_id(), backend="nccl", group_epoch=self.group_epoch,
            master_addr=init_info["master_address"], master_port=init_info["master_port"],
            world_size=self.world_size, rank_offsets=self.rank_offsets, stream=wire))

    def start_weight_update(self) -> None:
        """Nothing on the bus: each worker starts its update inside `update_weights`'s
        command, so one command is applied once, whole, by each worker."""

    def update_weights(self, update_info: Any) -> None:
        if not isinstance(update_info, dict):
            raise TypeError("the bus client speaks vLLM's dense NCCL backend (one update "
                            f"info dict per round), not {type(update_info).__name__}")
        metas = tuple(TensorMeta(name=n, dtype=d, shape=tuple(s)) for n, d, s in
                      zip(update_info["names"], update_info["dtype_names"],
                          update_info["shapes"], strict=True))
        # NOTE: no digest: the bytes go from NCCL straight into vLLM's loader; what each
        # worker reports instead is vLLM's checksum of its own parameters
        self._send(UpdateWeights(
            cmd_id=new_cmd_id(), version=self.version, digest="",
            transport=Collective(group_epoch=self.group_epoch, tensors=metas)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Nothing on the bus: each worker finishes (and names the version) before it acks
        `update_weights`."""

    def _send(self, cmd: InitTransport | UpdateWeights) -> None:
        try:
            rep = anyio.from_thread.run(self.fabric.broadcast, cmd, self.policy,
                                        token=self._token)
        except Exception as exc:
            self.error = exc
            anyio.from_thread.run_sync(self.failed.set, token=self._token)
            raise
        self.reports.append(rep)


class VllmNcclSync:
    """Push a torch module's weights to every vLLM worker with vLLM's NCCL weight transfer
    (see the module docstring). `send` waits for every worker's `done` ack, so a returned
    report means each worker serves the version; any other outcome raises."""

    def __init__(self, fabric: FabricClient, module: Any, *, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, policy: QuorumPolicy | None = None,
                 packed: bool = True) -> None:
        self.fabric = fabric
        self.module = module
        self.master_addr = master_addr
        self.master_port = master_port
        self.policy = policy or fabric.policy
        self.packed = packed
        self.client: BusWeightSyncClient | None = None
        self._engine: Any = None

    async def init(self) -> FanoutReport:
        """Every member joins a fresh vLLM NCCL group; `TransportInitFailed` at once when a
        member is not a vLLM worker or this process has no CUDA device."""
        import torch
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        from rlfabric.trainer.updates import free_port, rank_offsets

        snap = self.fabric.watcher.snapshot()
        others = [f"{m.worker_id} ({m.engine})" for m in snap.members if m.engine != "vllm"]
        if others or not snap.members:
            raise TransportInitFailed(
                "vLLM's NCCL weight transfer reaches vLLM workers only; "
                + (f"not: {', '.join(others)}" if others else "there are no workers")
                + ": use FabricClient.update_weights over shm, filesystem or nats",
                missing_workers=tuple(m.split(" ")[0] for m in others), missing_ranks=(),
                group_epoch=0)
        if not torch.cuda.is_available():
            raise TransportInitFailed(
                "vLLM's NCCL weight transfer needs a CUDA device in the trainer process",
                missing_workers=(), missing_ranks=(0,), group_epoch=0)
        offsets, rank = rank_offsets(snap)
        epoch = self.fabric.desired.state.group_epoch + 1
        client = BusWeightSyncClient(self.fabric, rank_offsets=offsets, world_size=rank,
                                     group_epoch=epoch, policy=self.policy)
        info = NCCLTrainerInitInfo(master_address=self.master_addr,
                                   master_port=self.master_port or free_port(self.master_addr),
                                   world_size=rank, packed=self.packed)
        self._engine = await self._beside_failure(
            client, NCCLTrainerWeightTransferEngine.trainer_init, info, client=client,
            source=ModuleSource(self.module))
        self.client = client
        await self.fabric.desired.write(group_epoch=epoch)
        return client.reports[-1]

    async def send(self, version: int) -> FanoutReport:
        """Broadcast the module's weights as `version`; every worker acks once it serves it."""
        if self.client is None or self._engine is None:
            raise TransportInitFailed("VllmNcclSync.send before init()", missing_workers=(),
                                      missing_ranks=(), group_epoch=0)
        self.client.version = version
        await self._beside_failure(self.client, self._engine.send_weights)
        await self.fabric.desired.write(weight_version=version, locator=None)
        return self.client.reports[-1]

    @staticmethod
    async def _beside_failure(watched: BusWeightSyncClient, blocking: Any, *args: Any,
                              **kwargs: Any) -> Any:
        """Run vLLM's blocking trainer call in a thread; if a bus command fails first (a
        worker refused), raise that at once instead of waiting in NCCL for the missing rank
        (the thread is left to vLLM's own rendezvous timeout)."""
        result: list[Any] = []
        async with beside() as tg:
            async def call() -> None:
                result.append(await anyio.to_thread.run_sync(
                    functools.partial(blocking, *args, **kwargs), abandon_on_cancel=True))
                tg.cancel_scope.cancel()

            async def watch() -> None:
                await watched.failed.wait()
                assert watched.error is not None  # set with the event
                raise watched.error

            tg.start_soon(call)
            tg.start_soon(watch)
        return result[0]
