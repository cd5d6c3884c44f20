"""The receiving side of weight updates: fetch, verify the digest, swap atomically, report.

Pull transports (shared memory, filesystem, nats) are one phase. The collective transport is
two: the worker acks `ready` once its receive buffer exists and it is about to enter the
broadcast, then `done`. A failure at any step leaves the old weights serving and answers with
an error Ack whose code says which step failed (`fetch_failed`, `digest_mismatch`,
`load_failed`, `no_group`, ...).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import anyio
import torch
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from rlfabric.bus import AckFields, Bus, CommandContext, CommandFailed
from rlfabric.engines.payload import PackedWeights, payload
from rlfabric.engines.protocol import Engine, WeightLoadError
from rlfabric.schemas import (
    Collective,
    DesiredState,
    ErrorCode,
    ErrorEvent,
    Filesystem,
    InitTransport,
    Lora,
    Nats,
    SharedMemory,
    UpdateWeights,
)
from rlfabric.telemetry import spans
from rlfabric.tensors import (
    STABLE_MARKER,
    WEIGHTS_FILE,
    CollectiveGroup,
    buffer_size,
    digest,
    shm_file,
)

log = logging.getLogger("rlfabric.worker.weights")


class WeightSync:
    def __init__(self, bus: Bus, engine: Engine, worker_id: str, *,
                 fetch_timeout: float = 120.0) -> None:
        self.bus = bus
        self.engine = engine
        self.worker_id = worker_id
        self.fetch_timeout = fetch_timeout
        self.group: CollectiveGroup | None = None

    # ---- join ----
    async def load_current(self, state: DesiredState) -> None:
        """At join: serve the fleet's current version if it can be pulled."""
        cmd = state.locator
        if cmd is None or cmd.version <= self.engine.version:
            return
        if isinstance(cmd.transport, Collective):
            log.info("%s: v%d was pushed over a collective group; waiting for the next push",
                     self.worker_id, cmd.version)
            return
        try:
            await self._apply(cmd)
        except CommandFailed as exc:
            # e.g. the shm segment of a trainer that died: join anyway, on the weights we
            # have, say so, and take the next push (requests for v<N> wait for it)
            why = (f"{self.worker_id} cannot load the fleet's weight version {cmd.version} "
                   f"({exc.code}: {exc}); it joins on v{self.engine.version} and waits for "
                   "the next update")
            log.error("%s", why)
            await self.bus.emit(ErrorEvent(source=self.worker_id,
                                           code=ErrorCode.WEIGHTS_UNAVAILABLE, message=why,
                                           at=time.time()))
            return
        log.info("%s: joined on weight version %d", self.worker_id, cmd.version)

    # ---- commands ----
    async def update(self, cmd: UpdateWeights, ctx: CommandContext) -> AckFields:
        if isinstance(cmd.target, Lora):
            raise CommandFailed(ErrorCode.UNSUPPORTED, f"LoRA targets are not supported by the "
                                f"{self.engine.name} engine")
        if isinstance(cmd.transport, Collective):
            if self.engine.owns_collective:
                await self.engine.receive_collective(cmd)
                return AckFields(weight_version=self.engine.version)
            return await self._collective(cmd, ctx)
        return await self._apply(cmd)

    async def init_transport(self, cmd: InitTransport, ctx: CommandContext) -> AckFields:
        if self.worker_id not in cmd.rank_offsets:
            raise CommandFailed(ErrorCode.NOT_IN_GROUP,
                                f"{self.worker_id} has no rank in group epoch "
                                f"{cmd.group_epoch}")
        if self.engine.owns_collective:
            await self.engine.init_transport(cmd, cmd.rank_offsets[self.worker_id])
            return AckFields(detail={"rank": str(cmd.rank_offsets[self.worker_id]),
                                     "group_epoch": str(cmd.group_epoch)})
        if cmd.vllm is not None:
            raise CommandFailed(ErrorCode.UNSUPPORTED,
                                f"group epoch {cmd.group_epoch} speaks vLLM's "
                                f"NCCL weight-transfer protocol, which only vLLM workers "
                                f"join; {self.worker_id} runs the {self.engine.name} engine: "
                                "push to it with FabricClient.init_transport/update_weights")
        if self.group is not None:
            self.group.close()  # an old group is torn down, never reused
            self.group = None
        remaining = cmd.deadline - time.time() if cmd.deadline else 60.0
        group = CollectiveGroup(backend=cmd.backend, master_addr=cmd.master_addr,
                                master_port=cmd.master_port,
                                rank=cmd.rank_offsets[self.worker_id],
                                world_size=cmd.world_size, group_epoch=cmd.group_epoch,
                                timeout=max(1.0, remaining))
        try:
            await anyio.to_thread.run_sync(group.open_store)
            await ctx.ready()
            await anyio.to_thread.run_sync(group.connect)
        except Exception as exc:
            raise CommandFailed(ErrorCode.GROUP_JOIN_FAILED,
                                f"{self.worker_id} could not join group "
                                f"epoch {cmd.group_epoch}: {exc}") from exc
        self.group = group
        return AckFields(detail={"rank": str(group.rank), "group_epoch": str(cmd.group_epoch)})

    # ---- pull transports ----
    async def _apply(self, cmd: UpdateWeights) -> AckFields:
        t = cmd.transport
        metas = t.tensors
        path: str | None = None  # a file with the same bytes, for engines loading elsewhere
        with contextlib.ExitStack() as keep:
            with spans.span("fetch weights", attributes={
                    "rlfabric.transport": t.__struct_config__.tag or ""}):
                try:
                    if isinstance(t, SharedMemory):
                        buf = keep.enter_context(_open_shm(t.name))
                        path = shm_file(t.name)
                    elif isinstance(t, Filesystem):
                        buf = await self._read_fs(t, cmd.deadline)
                        path = os.path.join(t.path, WEIGHTS_FILE)
                    elif isinstance(t, Nats):
                        buf = await self._read_nats(t, cmd.version, buffer_size(metas))
                    else:
                        raise CommandFailed(ErrorCode.UNSUPPORTED,
                                            f"transport {type(t).__name__} is not supported here")
                except CommandFailed:
                    raise
                except Exception as exc:
                    raise CommandFailed(ErrorCode.FETCH_FAILED,
                                        f"{self.worker_id} could not fetch v"
                                        f"{cmd.version} over {type(t).__name__}: {exc}") from exc
            view = memoryview(buf)[:buffer_size(metas)]
            with spans.span("verify digest"):
                got = await _digest_in_thread(view)
            if got != cmd.digest:
                del view
                raise CommandFailed(ErrorCode.DIGEST_MISMATCH, f"{self.worker_id}: v{cmd.version} "
                                    f"payload digest {got} != {cmd.digest}; old weights kept")
            try:
                with payload(view, metas, path=path) as weights, spans.span("load weights"):
                    await self._load(weights, cmd)
            finally:
                del view  # no view may outlive the buffer
        return AckFields(weight_version=self.engine.version)

    async def _load(self, weights: PackedWeights, cmd: UpdateWeights) -> None:
        why = ""
        try:
            await self.engine.load_weights(weights, cmd.version)
        except (WeightLoadError, ValueError, TypeError, RuntimeError) as exc:
            why = str(exc)
        if why:
            # NOTE: raised outside the except block on purpose: a chained exception would keep
            # the failed frames, and the tensors viewing a shared buffer in them, alive
            raise CommandFailed(ErrorCode.LOAD_FAILED,
                                f"{self.worker_id}: v{cmd.version} not loaded "
                                f"({why}); still serving v{self.engine.version}")
        if cmd.reset_prefix_cache:
            await self.engine.reset_prefix_cache()

    async def _read_fs(self, t: Filesystem, deadline: float) -> bytearray:
        path = os.path.join(t.path, WEIGHTS_FILE)
        if t.require_marker:
            marker = os.path.join(t.path, STABLE_MARKER)
            wait = self.fetch_timeout
            if deadline:
                wait = max(0.0, min(wait, deadline - time.time()))
            with anyio.fail_after(wait):
                # a file appearing on a (possibly network) filesystem has no event to await
                while not await anyio.Path(marker).exists():  # noqa: ASYNC110
                    await anyio.sleep(0.05)
        return await anyio.to_thread.run_sync(_read_file, path)

    async def _read_nats(self, t: Nats, version: int, size: int) -> bytearray:
        """Every chunk of this version from the weights stream, into one buffer (an ordered
        push consumer: flow-controlled by the server, no pull round trips)."""
        # zeroed in a thread: on the event loop, a 14 GB buffer would stall heartbeats and
        # pings for seconds (256 MiB: about 130 ms here)
        buf = await anyio.to_thread.run_sync(bytearray, size)
        seen = bytearray(t.chunks)  # by chunk index: a chunk the sender stored twice counts once
        got = 0
        done = anyio.Event()

        async def on_chunk(m: Msg) -> None:
            nonlocal got
            try:
                i = int(m.subject.rsplit(".", 1)[1])
            except ValueError:  # not a chunk of ours
                return
            if not 0 <= i < t.chunks or seen[i]:
                return
            off = i * t.chunk_bytes
            buf[off:off + len(m.data)] = m.data
            seen[i] = 1
            got += 1
            if got >= t.chunks:
                done.set()

        # an ordered consumer re-creates itself from the last chunk it got after two missed
        # idle heartbeats: a broker restart mid-read costs about a second, not the timeout
        sub = await self.bus.js.subscribe(f"{t.subject}.>", stream=t.stream, cb=on_chunk,
                                          ordered_consumer=True, idle_heartbeat=0.5,
                                          deliver_policy=DeliverPolicy.ALL)
        try:
            with anyio.fail_after(self.fetch_timeout):
                await done.wait()
        finally:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        return buf

    # ---- collective ----
    async def _collective(self, cmd: UpdateWeights, ctx: CommandContext) -> AckFields:
        t = cmd.transport
        assert isinstance(t, Collective)
        group = self.group
        if group is None or group.group_epoch != t.group_epoch:
            have = group.group_epoch if group else None
            raise CommandFailed(ErrorCode.NO_GROUP,
                                f"{self.worker_id} is in group epoch {have}, not "
                                f"{t.group_epoch}: init_transport first")
        flat = torch.empty(buffer_size(t.tensors), dtype=torch.uint8)
        await ctx.ready()
        try:
            await anyio.to_thread.run_sync(group.broadcast, flat)
        except Exception as exc:
            self.group = None  # a broken group is stale
            raise CommandFailed(ErrorCode.BROADCAST_FAILED, f"{self.worker_id}: broadcast of "
                                f"v{cmd.version} failed: {exc}") from exc
        buf = flat.numpy().data
        got = await _digest_in_thread(buf)
        if got != cmd.digest:
            raise CommandFailed(ErrorCode.DIGEST_MISMATCH, f"{self.worker_id}: v{cmd.version} "
                                f"broadcast digest {got} != {cmd.digest}; old weights kept")
        with payload(memoryview(buf), t.tensors) as weights:
            await self._load(weights, cmd)
        return AckFields(weight_version=self.engine.version)


def _read_file(path: str) -> bytearray:
    with open(path, "rb") as f:
        buf = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(buf)
    return buf


async def _digest_in_thread(view: memoryview) -> str:
    # NOTE: an idle anyio worker thread keeps the arguments of its last call alive; a view of
    # a shared-memory segment held there would keep the segment mapped after close().
    box = [view]
    return await anyio.to_thread.run_sync(lambda: digest(box.pop()))


@contextlib.contextmanager
def _open_shm(name: str) -> Any:
    as_file = shm_file(name)
    if hasattr(mmap, "MAP_POPULATE") and as_file is not None:
        # mapped with every page in place at once, not a fault per 4 KiB page as it is read
        fd = os.open(as_file, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        buf = memoryview(mm)
        try:
            yield buf
        finally:
            try:
                buf.release()
                mm.close()
            except BufferError:  # a view still exists somewhere: unmapped when they go
                log.warning("shared memory %s still has views; it is unmapped when they go",
                            name)
        return
    shm = shared_memory.SharedMemory(name=name, create=False)
    # NOTE: Python < 3.13 registers opened segments with the resource tracker, which would
    # unlink the trainer's segment when this worker exits. The trainer owns it.
    with contextlib.suppress(Exception):
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # the name as registered (leading slash) is private
    try:
        yield shm.buf
    finally:
        try:
            shm.close()
        except BufferError:  # a view still exists somewhere: the mapping lingers until GC
            log.warning("shared memory %s still has views; it is unmapped when they go", name)
