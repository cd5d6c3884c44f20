"""The receiving side of weight updates: open the version with the transport that staged it,
verify the digest, swap atomically, report.

Pull transports are one phase; a two-phase one (collective) acks `ready` before it enters the
broadcast, then `done`. A failure at any step leaves the old weights serving and answers with
an error Ack whose code says which step failed (`fetch_failed`, `digest_mismatch`,
`load_failed`, `no_group`, ...).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec

from rlfabric import tensors
from rlfabric.bus import AckFields, Bus, CommandContext, CommandFailed
from rlfabric.engines.errors import EngineError, WeightLoadError
from rlfabric.engines.payload import PackedWeights, payload
from rlfabric.engines.protocol import Engine, JoinsGroups
from rlfabric.schemas import (
    Adapter,
    DesiredState,
    ErrorCode,
    ErrorEvent,
    UpdateWeights,
    adapter_key,
    base_policy,
)
from rlfabric.telemetry import instruments, spans
from rlfabric.transports import (
    GroupSlot,
    Received,
    ReceiveJob,
    TransportError,
    Transports,
    WeightTransport,
    name_of,
)
from rlfabric.worker.kept import KeptVersions
from rlfabric.worker.peers import PeerSource, whole
from rlfabric.worker.policies import Policies, desired_policy
from rlfabric.worker.residency import Residency

log = logging.getLogger("rlfabric.worker.weights")


class WeightSync:
    def __init__(self, bus: Bus, engine: Engine, worker_id: str, *,
                 fetch_timeout: float = 120.0) -> None:
        self.bus = bus
        self.engine = engine
        self.worker_id = worker_id
        self.fetch_timeout = fetch_timeout
        self.transports = Transports(bus)
        self.groups = GroupSlot()
        #: the policies served: what results are stamped with, what the desired state is
        #: compared against
        self.policies = Policies()
        #: one load at a time: a command's, or one taking the desired state
        self.loading = anyio.Lock()
        #: why the desired state could not be loaded last ("" once it was)
        self.unloadable = ""
        #: the adapters held within the engine's limit: least recently used evicted, reloaded
        #: on demand
        self.residency = Residency(int(getattr(engine, "max_adapters", 0) or 0))
        #: the versions kept for a delta to apply to, given to workers that lack them
        self.kept = KeptVersions(worker_id)
        self.peers = PeerSource(bus, self.kept, worker_id)

    # ---- the desired state ----
    def in_line(self, state: DesiredState) -> bool:
        """Whether the base weights served are the desired state's."""
        want = desired_policy(state)
        return not want or want == self.policies.base

    async def load_current(self, state: DesiredState) -> None:
        """Serve the desired state's base policy, and its adapters' newest versions, if they
        can be pulled (at join, and whenever the worker finds itself off them)."""
        async with self.loading:
            cmd = state.locator
            if cmd is not None and not self.in_line(state) and \
                    base_policy(cmd.run, cmd.version, cmd.digest) == desired_policy(state):
                await self._join_load(cmd, f"weight version {cmd.version}")
            await self._load_adapters(state, "")

    async def load_job(self, job: str, state: DesiredState) -> None:
        """Serve the newest versions of job `job`'s adapters (`state`: its desired state)."""
        async with self.loading:
            await self._load_adapters(state, job)

    async def _load_adapters(self, state: DesiredState, job: str) -> None:
        for name, upd in state.adapters.items():
            upd = keyed(upd)
            key = upd.target.name if isinstance(upd.target, Adapter) else name
            newest = self.engine.adapter_versions().get(key, ())[-1:]
            if self.policies.adapter_run(key) != upd.run or newest != (upd.version,):
                await self._join_load(upd, f"adapter {key!r} v{upd.version}")

    async def _join_load(self, cmd: UpdateWeights, what: str) -> None:
        try:
            if not self._transport(cmd).lasting:  # live only during its push
                self.unloadable = f"{what} was pushed over {name_of(cmd.transport)}"
                log.info("%s: %s; waiting for the next push", self.worker_id, self.unloadable)
                return
            # the push's deadline bounded its sender's wait; a joiner loading it later is not
            cmd = msgspec.structs.replace(cmd, deadline=0.0)
            # a delta it holds no base for: the full version from the workers keeping it
            got = await self.peers.fetch(cmd, self.fetch_timeout) \
                if self.kept.lacks_base(cmd) else None
            await self._apply(cmd if got is None else whole(cmd), opened=got)
        except (CommandFailed, EngineError, TransportError) as exc:
            # e.g. the shm segment of a trainer that has exited: serve nothing of it, say so
            # (at INFO: a fleet outliving its trainer is expected), take the next push
            self.unloadable = (f"the fleet's {what} cannot be loaded ({exc.code}: {exc}"
                               + ("; its trainer has exited?" if name_of(cmd.transport) == "shm"
                                  else "") + ")")
            why = (f"{self.worker_id}: {self.unloadable}; it holds v{self.engine.version} and "
                   "waits for the next update")
            log.info("%s", why)
            await self.bus.emit(ErrorEvent(source=self.worker_id,
                                           code=ErrorCode.WEIGHTS_UNAVAILABLE, message=why,
                                           at=time.time()))
            return
        self.unloadable = ""
        log.info("%s: now serving the fleet's %s", self.worker_id, what)

    async def reload(self, upd: UpdateWeights) -> None:
        """Load an adapter's version `upd` (the desired state's newest) again: evicted, or
        never loaded here for want of room. `CommandFailed` if it cannot be."""
        cmd = keyed(upd)
        key = cmd.target.name if isinstance(cmd.target, Adapter) else ""
        while True:
            freed = self.residency.freed()
            async with self.loading:
                if self.engine.adapter_versions().get(key, ())[-1:] == (cmd.version,) and \
                        self.policies.adapter_run(key) == cmd.run:
                    return  # another request's reload brought it
                t0 = time.monotonic()
                try:
                    # the push's deadline bounded its sender's wait; a reload is not bound by it
                    await self._apply(msgspec.structs.replace(cmd, deadline=0.0))
                except CommandFailed as exc:
                    if exc.code != ErrorCode.ADAPTER_LIMIT:
                        raise
                else:
                    self.residency.reload_s.append(time.monotonic() - t0)
                    del self.residency.reload_s[:-1000]
                    self.residency.reloaded += 1
                    return
            await freed.wait()  # every adapter held serves a request: until one is done

    async def unload(self, key: str) -> bool:
        """Drop every version of adapter `key` (an `UnloadAdapter`): not reloaded again."""
        held = await self.engine.unload_adapter(key)
        self.policies.keep_adapters(self.engine.adapter_versions())
        self.residency.forget(key)
        return held

    async def _evict(self, key: str) -> bool:
        held = await self.engine.unload_adapter(key)
        self.policies.keep_adapters(self.engine.adapter_versions())
        log.debug("%s: adapter %r evicted for room (--max-adapters %d)", self.worker_id, key,
                  self.residency.limit)
        return held

    # ---- commands ----
    async def update(self, cmd: UpdateWeights, ctx: CommandContext) -> AckFields:
        if cmd.job and not isinstance(cmd.target, Adapter):
            raise CommandFailed(ErrorCode.POOL_ONLY, f"{self.worker_id}: job {cmd.job} sent "
                                f"base weights v{cmd.version}; base weights are the pool's: "
                                "push them from a client that names no job")
        cmd = keyed(cmd)
        live = not self._transport(cmd).pull  # a broadcast to a group
        engine = self.engine if isinstance(self.engine, JoinsGroups) else None
        if isinstance(cmd.target, Adapter) and live and engine is not None:
            raise CommandFailed(ErrorCode.UNSUPPORTED, f"{self.worker_id} ({self.engine.name}) "
                                "takes LoRA adapters over shm, filesystem or nats, not over its "
                                "engine's collective group")
        async with self.loading:
            if not live and not isinstance(cmd.target, Adapter) and \
                    base_policy(cmd.run, cmd.version, cmd.digest) == self.policies.base:
                # served already (taken from the desired state, or a push sent again)
                return AckFields(weight_version=self.engine.version)
            if live and engine is not None:
                await engine.receive_collective(cmd)
                self.policies.set_base(cmd.version, cmd.run, cmd.digest)
                return AckFields(weight_version=self.engine.version)
            t0, outcome = time.monotonic(), "error"
            try:
                acked = await self._apply(cmd, ready=ctx.ready)
                outcome = "ok"
                return acked
            finally:
                record_update(cmd, time.monotonic() - t0, outcome)

    # ---- any transport ----
    async def _apply(self, cmd: UpdateWeights,
                     ready: Callable[[], Awaitable[None]] | None = None,
                     opened: Received | None = None) -> AckFields:
        t = cmd.transport
        job = ReceiveJob(worker_id=self.worker_id, version=cmd.version, deadline=cmd.deadline,
                         fetch_timeout=self.fetch_timeout, ready=ready, groups=self.groups)
        async with contextlib.AsyncExitStack() as keep:
            got = opened if opened is not None else await self._open(cmd, job, keep)
            if got.pieces:  # on a GPU already: digested there
                with spans.span("verify digest"):
                    dg = await _device_digest(got.pieces)
                return await self._verified_load(cmd, dg, pieces=got.pieces)
            size = tensors.buffer_size(t.tensors)
            # a delta: the full version made here, in the bytes kept of its base
            async with self.kept.making(cmd, got.buffer, size) as made:
                view = memoryview(got.buffer)[:size] if made is None else memoryview(made)
                path = got.path if made is None else None
                if cmd.keep and made is None:  # kept past the transport's buffer: a copy
                    own = got.owned and len(got.buffer) == size
                    made = got.buffer if own else bytearray(view)
                device = getattr(self.engine, "weights_device", "cpu")
                pieces: tuple[tuple[int, Any], ...] = ()
                try:
                    if device.startswith("cuda"):  # to the GPU through pinned memory, digested
                        with spans.span("stage to device"):
                            flat, dg = await _to_device_in_thread(view, device)
                        pieces, view = ((0, flat),), memoryview(b"")
                    else:
                        with spans.span("verify digest"):
                            dg = await _digest_in_thread(view)
                    acked = await self._verified_load(cmd, dg, path=path, pieces=pieces,
                                                      view=view if not pieces else None)
                finally:
                    del view  # no view may outlive the buffer
            self.kept.loaded(cmd, made)
            return acked

    async def _verified_load(self, cmd: UpdateWeights, dg: str, *,
                             view: memoryview | None = None, path: str | None = None,
                             pieces: tuple[tuple[int, Any], ...] = ()) -> AckFields:
        """Load the payload if its digest `dg` is the command's; else `digest_mismatch` and
        the old weights kept."""
        if dg != cmd.digest:
            del view, pieces  # the raised error's frames must not keep the buffer alive
            raise CommandFailed(ErrorCode.DIGEST_MISMATCH, f"{self.worker_id}: v{cmd.version} "
                                f"payload digest {dg} != {cmd.digest}; old weights kept")
        layout = cmd.delta.tensors if cmd.delta is not None else cmd.transport.tensors
        with payload(view if view is not None else memoryview(b""), layout,
                     path=path, pieces=pieces) as weights, spans.span("load weights"):
            return await self._load(weights, cmd)

    def _transport(self, cmd: UpdateWeights) -> WeightTransport:
        """The transport that staged `cmd`'s version; `CommandFailed` if none here can."""
        try:
            return self.transports.for_locator(cmd.transport)
        except ValueError as exc:
            raise CommandFailed(ErrorCode.UNSUPPORTED, f"{self.worker_id} cannot open v"
                                f"{cmd.version}: {exc}") from exc

    async def _open(self, cmd: UpdateWeights, job: ReceiveJob,
                    keep: contextlib.AsyncExitStack) -> Received:
        """The version's bytes, held open by `keep`; any failure is a CommandFailed."""
        t = cmd.transport
        kind = name_of(t)
        transport = self._transport(cmd)
        with spans.span("fetch weights", attributes={"rlfabric.transport": kind}):
            try:
                return await keep.enter_async_context(transport.receive(t, job))
            except TransportError as exc:
                raise CommandFailed(exc.code, str(exc)) from exc
            except Exception as exc:
                raise CommandFailed(ErrorCode.FETCH_FAILED,
                                    f"{self.worker_id} could not fetch v{cmd.version} over "
                                    f"{kind}: {exc}") from exc

    async def _load(self, weights: PackedWeights, cmd: UpdateWeights) -> AckFields:
        if isinstance(cmd.target, Adapter):
            return await self._load_adapter(weights, cmd, cmd.target)
        why = ""
        try:
            await self.engine.load_weights(weights, cmd.version)
        except (WeightLoadError, ValueError, TypeError, RuntimeError) as exc:
            why = str(exc)
        if why:
            if self.engine.version != self.policies.base_version:
                # the engine restarted from its checkpoint (it kept no copy of what it served)
                self.policies.set_checkpoint(self.engine.weights_checksum(),
                                             self.engine.version)
            # NOTE: raised outside the except block on purpose: a chained exception would keep
            # the failed frames, and the tensors viewing a shared buffer in them, alive
            raise CommandFailed(ErrorCode.LOAD_FAILED,
                                f"{self.worker_id}: v{cmd.version} not loaded "
                                f"({why}); still serving v{self.engine.version}")
        self.policies.set_base(cmd.version, cmd.run, cmd.digest)
        if cmd.reset_prefix_cache:  # kept or not, no engine serves old blocks to new weights
            await self.engine.reset_prefix_cache()
        return AckFields(weight_version=self.engine.version)

    def _check_base(self, cmd: UpdateWeights, adapter: Adapter) -> None:
        if adapter.base and adapter.base != self.policies.base:
            raise CommandFailed(ErrorCode.BASE_MISMATCH, (
                f"{self.worker_id}: adapter {adapter.name!r} v{cmd.version} was trained on base "
                f"policy {adapter.base}, but this worker serves base policy "
                f"{self.policies.base or '(none)'}; push that base first "
                "(FabricClient.update_weights without adapter=), or start the workers from the "
                "adapter's base checkpoint"))

    async def _load_adapter(self, weights: PackedWeights, cmd: UpdateWeights,
                            adapter: Adapter) -> AckFields:
        """The ack carries the adapter's version and the checksum of its tensors. Versions
        are a run's own: those another run loaded under the same name are dropped first."""
        self._check_base(cmd, adapter)
        held = self.policies.adapter_run(adapter.name)
        if held is not None and held != cmd.run:
            await self.engine.unload_adapter(adapter.name)
            log.info("%s: adapter %r of run %s replaced by run %s's", self.worker_id,
                     adapter.name, held, cmd.run)
        if not await self.residency.make_room(adapter.name, self.engine.adapter_versions,
                                              self._evict):
            raise CommandFailed(ErrorCode.ADAPTER_LIMIT, (
                f"{self.worker_id}: adapter {adapter.name!r} v{cmd.version} not loaded: each "
                f"of the {self.residency.limit} adapters it holds (--max-adapters) serves a "
                "request now; push it again once one is done, or start workers with a larger "
                "--max-adapters"))
        why = ""
        try:
            checksum = await self.engine.load_adapter(weights, adapter, cmd.version)
        except (WeightLoadError, ValueError, TypeError, RuntimeError) as exc:
            why = str(exc)
        finally:
            self.policies.keep_adapters(self.engine.adapter_versions())
        if why:  # outside the except block: see `_load`
            raise CommandFailed(ErrorCode.LOAD_FAILED,
                                f"{self.worker_id}: adapter {adapter.name!r} v{cmd.version} not "
                                f"loaded ({why}); its earlier versions still serve")
        self.policies.set_adapter(adapter.name, cmd.version, cmd.run, cmd.digest)
        return AckFields(weight_version=cmd.version, weights_checksum=checksum,
                         detail={"adapter": adapter.name})


def record_update(cmd: UpdateWeights, seconds: float, outcome: str) -> None:
    """A weight update's bytes (what the transport carried: a delta's own) and seconds."""
    m = instruments.current
    kind = {"transport": name_of(cmd.transport), "outcome": outcome}
    m.update_size.record(tensors.buffer_size(cmd.transport.tensors), kind)
    m.update_duration.record(seconds, kind)


def keyed(cmd: UpdateWeights) -> UpdateWeights:
    """`cmd` with its job's adapter named by its key in the engine (`adapter_key`)."""
    t = cmd.target
    if not cmd.job or not isinstance(t, Adapter):
        return cmd
    return msgspec.structs.replace(
        cmd, target=msgspec.structs.replace(t, name=adapter_key(cmd.job, t.name)))


async def _digest_in_thread(view: memoryview) -> str:
    # NOTE: an idle anyio worker thread keeps the arguments of its last call alive; a view of
    # a shared-memory segment held there would keep the segment mapped after close().
    box = [view]
    return await anyio.to_thread.run_sync(lambda: tensors.digest(box.pop()))


async def _to_device_in_thread(view: memoryview, device: str) -> tuple[Any, str]:
    box = [view]  # see `_digest_in_thread`
    del view

    def run() -> tuple[Any, str]:
        from rlfabric.tensors.staging import to_device

        return to_device(box.pop(), device)

    return await anyio.to_thread.run_sync(run)


async def _device_digest(pieces: tuple[tuple[int, Any], ...]) -> str:
    return await anyio.to_thread.run_sync(tensors.device_digest, pieces)
