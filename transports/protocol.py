"""The weight-transport interface: both ends of one way to move a packed buffer from the trainer
to the workers, in one module per transport.

A transport moves bytes and knows nothing of what they hold: the buffer is a state dict packed
by `rlfabric.tensors.packing` (full weights or a LoRA adapter alike), its layout travels in the
locator's `tensors`, and the command's `target` says what a worker does with it. The trainer
stages a version (`stage`), the command carries the returned locator, and each worker opens it
(`receive`), verifies the digest and hands the buffer to its engine.
"""

from __future__ import annotations

import inspect
import logging
import shutil
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rlfabric.schemas import (
    Base,
    DeltaOf,
    ErrorCode,
    RLFabricError,
    Target,
    TensorMeta,
    Transport,
    UpdateWeights,
)

if TYPE_CHECKING:
    from rlfabric.tensors import CollectiveGroup

log = logging.getLogger("rlfabric.transports")

Release = Callable[[], Awaitable[None] | None]


class TransportError(RLFabricError):
    """A transport could not stage or deliver a version; `code` says which step failed."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def room_for(size: int, folder: str, what: str) -> None:
    """`TransportError` (`storage_full`) at once unless `folder`'s filesystem has `size` bytes
    free: a push refused before anything is written, naming the numbers."""
    free = shutil.disk_usage(folder).free
    if size > free:
        mib = 1024 * 1024
        raise TransportError(ErrorCode.STORAGE_FULL,
                             f"{what}: this push needs {size / mib:.1f} MiB and {folder} has "
                             f"{free / mib:.1f} MiB free; free space there, or use another "
                             "transport")


@dataclass(frozen=True)
class StageJob:
    """One version to stage: the state dict, its packed layout and size, and the fleet's
    subject prefix (which names segments, directories and subjects)."""

    version: int
    state: Mapping[str, Any]
    tensors: tuple[TensorMeta, ...]
    size: int
    prefix: str
    expected_checksum: str = ""
    #: filesystem: write the STABLE marker now (else the caller's `Staged.mark_stable()`)
    mark_stable: bool = True
    #: nats: send the chunks now (else `Staged.unsent` sends them beside the command)
    send_now: bool = True
    group_epoch: int = 0


@dataclass
class GroupSlot:
    """The collective group a worker has joined (set by init_transport, cleared when broken)."""

    group: CollectiveGroup | None = None


@dataclass(frozen=True)
class ReceiveJob:
    """What a worker knows while it opens a version: who it is, how long it may wait, and, for
    two-phase transports, how to say `ready` and which group it is in."""

    worker_id: str
    version: int
    deadline: float = 0.0
    fetch_timeout: float = 120.0
    ready: Callable[[], Awaitable[None]] | None = None
    groups: GroupSlot = field(default_factory=GroupSlot)


@dataclass(frozen=True)
class Received:
    """An opened version: a buffer holding the packed bytes, and a file with the same bytes
    where the transport has one (engines that load in another process read it); or, from a
    device transport, `pieces`: `(offset, flat uint8 tensor)` covering the packed layout on a
    GPU (digested there with `rlfabric.tensors.checksums.device_digest`)."""

    buffer: Any
    path: str | None = None
    pieces: tuple[tuple[int, Any], ...] = ()
    #: the buffer is this worker's own (not a mapping, not the transport's): kept as it is
    owned: bool = False


@dataclass(eq=False)
class Staged:
    """A version ready to push. `command()` makes its UpdateWeights; `release()` frees it."""

    version: int
    transport: Transport
    digest: str
    expected_checksum: str
    nbytes: int
    flat: Any = None  # collective: the uint8 tensor rank 0 broadcasts
    #: nats staged with `send_now=False`: sends the chunks; `push` runs it beside the command
    unsent: Callable[[], Coroutine[Any, Any, None]] | None = None
    #: kept until the next version, for workers that join meantime; False (cuda_ipc): freed
    #: once the push is decided, and joiners wait for the next push
    for_joiners: bool = True
    #: set: the staged bytes are a delta against that base (`digest` names what it makes)
    delta: DeltaOf | None = None
    #: workers keep this version's packed bytes for a delta to come (`UpdateWeights.keep`)
    keep: bool = False
    _release: list[Release] = field(default_factory=list)
    _stable: Callable[[], None] | None = None

    def command(self, cmd_id: str, *, target: Target | None = None,
                reset_prefix_cache: bool = True, deadline: float = 0.0,
                run: str = "", job: str = "") -> UpdateWeights:
        return UpdateWeights(cmd_id=cmd_id, version=self.version, transport=self.transport,
                             digest=self.digest, target=target or Base(),
                             reset_prefix_cache=reset_prefix_cache, deadline=deadline, run=run,
                             job=job, delta=self.delta, keep=self.keep)

    def on_release(self, fn: Release) -> None:
        self._release.append(fn)

    def freed(self) -> None:
        """The transport freed the staging itself: `release()` has nothing left to do."""
        self._release.clear()

    def mark_stable(self) -> None:
        """Filesystem: write the STABLE marker (done by `stage` unless asked not to)."""
        if self._stable is not None:
            self._stable()
            self._stable = None

    async def release(self) -> None:
        """Free the staging (segment, files, stream chunks); idempotent. A failure to free is
        logged, never raised: the update it served is already decided."""
        todo, self._release = self._release, []
        for fn in todo:
            try:
                out = fn()
                if inspect.isawaitable(out):
                    await out
            except Exception as exc:
                log.warning("releasing staged v%d (%s) failed: %s", self.version,
                            type(self.transport).__name__, exc)


class WeightTransport(Protocol):
    """Both ends of one transport. One instance per `Bus` on each side (made by the registry
    with `cls(bus)`), so a transport may keep state between versions (the nats sender keeps
    its packing buffer)."""

    @property
    def name(self) -> str:
        """What `update_weights(transport=...)`, `--transport` and the registry call it."""
        ...

    @property
    def help(self) -> str:
        """One line for `--help`."""
        ...

    @property
    def locator(self) -> type:
        """Its locator, a member of `rlfabric.schemas.Transport` (`External` for transports
        registered outside rlfabric)."""
        ...

    @property
    def pull(self) -> bool:
        """True: each worker fetches the version itself, so a worker joining later loads it
        from the desired state. False: delivered live to the workers present, two-phase
        (`ready`, then `done`), over a group formed by init_transport."""
        ...

    @property
    def lasting(self) -> bool:
        """True: the locator opens for as long as the trainer keeps the version staged, so a
        worker that joins later loads it from the desired state. False: only while its push is
        out (a collective's broadcast, cuda_ipc's GPU buffers): joiners wait for the next
        push."""
        ...

    async def stage(self, job: StageJob) -> Staged:
        """(trainer) Pack `job.state` where workers can read it; return the locator, the
        packed buffer's digest, and how to free it. Raises `TransportError` if it cannot."""
        ...

    def receive(self, locator: Any, job: ReceiveJob) -> AbstractAsyncContextManager[Received]:
        """(worker) Open the version `locator` names; the buffer stays valid until the context
        exits, then everything the worker mapped or read is let go. Raises `TransportError`
        (or any error, reported as `fetch_failed`) if the bytes cannot be had."""
        ...

    def close(self) -> None:
        """Free what the transport keeps between versions."""
        ...
