"""`nats`: the packed buffer in chunks of up to 4 MiB (smaller where the server's `max_payload`
is: a stock server takes 1 MiB) on `<prefix>.weights.<version>.<i>` in the weights stream, so
any host can pull it; older versions are purged once a newer one is in place.

Staged by `update_weights`, the chunks are sent while the command is out: each worker's
consumer reads a chunk as soon as it is stored, so publish and read overlap (the command
carries the chunk count). The buffer they are packed in is kept once they are stored and the
next version of the same layout is packed into it: one buffer the size of the weights stays
with the sender (until `close()`), and an update does not pay for faulting in a fresh one.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from nats.js.errors import APIError

from rlfabric import tensors
from rlfabric.bus.errors import TRANSIENT, BusError, storage_refused
from rlfabric.schemas import ErrorCode, Nats, TensorMeta
from rlfabric.transports.protocol import Received, ReceiveJob, Staged, StageJob, TransportError

if TYPE_CHECKING:
    from rlfabric.bus import Bus

NATS_CHUNK = 4 * 1024 * 1024
#: the subject token (after the version's) of the marker a sender stores when it gives up
ABORT = "abort"
#: room left in a message for what the server counts beside the chunk (subject, reply)
PAYLOAD_MARGIN = 4096
NATS_WINDOW = 16  # chunks in flight: bounds the client's buffer, keeps the pipe full
#: bytes JetStream stores beside a chunk's payload (its subject, sequence, timestamp, hash)
CHUNK_OVERHEAD = 256
MIB = 1024 * 1024
#: what creating a chunk consumer may meet while the weights stream elects a leader
_SUBSCRIBE_RETRIED: tuple[type[Exception], ...] = (*TRANSIENT, APIError)
NATS_RETRY_S = 60.0  # a chunk not stored after a reconnect is retried this long, then fails


class NatsTransport:
    name = "nats"
    help = "chunks in a JetStream stream (any host that reaches the server)"
    locator = Nats
    pull = True
    lasting = True

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        #: the last buffer whose chunks are all stored, and the layout packed in it
        self._spare: tuple[tuple[TensorMeta, ...], bytearray] | None = None

    def close(self) -> None:
        """Drop the kept buffer (the memory goes back at once, not with the client)."""
        self._spare = None

    async def _pack(self, state: Mapping[str, Any], metas: tuple[TensorMeta, ...],
                    size: int) -> tuple[bytearray, str]:
        """Pack into the spare buffer if it holds this very layout (its padding still reads
        zero, as `pack_buffer` needs), else into a fresh one, made in the packing thread:
        zeroing it there leaves the event loop free. The spare is taken either way: two
        stagings never share one."""
        spare, self._spare = self._spare, None
        # NOTE: handed over in a box the thread empties: an idle worker thread keeps the
        # arguments of its last call, which would pin a buffer the next layout replaced
        box = [spare[1] if spare is not None and spare[0] == metas else None]

        def fill() -> tuple[bytearray, str]:
            buf = box.pop()
            if buf is None:
                buf = bytearray(size)
            return buf, tensors.pack_buffer(state, metas, buf)

        return await anyio.to_thread.run_sync(fill)

    async def stage(self, job: StageJob) -> Staged:
        s = self.bus.subjects
        # its own subject: another push of the same version number (another run's or job's,
        # or an adapter's beside the base) never purges these chunks
        subject = s.weights(job.version, uuid.uuid4().hex[:12])
        chunk = self.chunk_bytes()
        chunks = -(-job.size // chunk)
        try:
            await self._purge(subject)  # a re-send starts clean
            await self._make_room(job.size + chunks * CHUNK_OVERHEAD, job.size)
        except TRANSIENT as exc:
            raise BusError(
                f"v{job.version} not sent: the weights stream {s.weights_stream} did not answer "
                f"({type(exc).__name__}: {exc}). On a NATS cluster, a stream whose leader was "
                "lost (a node down or cut off) answers again once it has elected another, in "
                "seconds: retry the push") from exc
        buf, dg = await self._pack(job.state, job.tensors, job.size)

        async def send() -> None:
            try:
                await self._send(subject, memoryview(buf), chunks, chunk)
            except Exception as exc:
                await self._abandon(subject, exc)
                # purged already; the abort marker stays for workers that read it late (the
                # next push of this version starts clean, the stream's max age drops it)
                st.freed()
                if storage_refused(exc):
                    raise TransportError(ErrorCode.STORAGE_FULL, _full(exc, job.size, chunk,
                                                                       chunks)) from exc
                raise
            self._spare = (job.tensors, buf)  # every chunk stored: the next version packs here

        st = Staged(job.version, Nats(stream=s.weights_stream, subject=subject, chunks=chunks,
                                      chunk_bytes=chunk, tensors=job.tensors),
                    dg, job.expected_checksum, job.size)
        st.on_release(lambda: self._purge(subject))
        if job.send_now:
            await send()
        else:
            st.unsent = send
        return st

    async def _make_room(self, need: int, size: int) -> None:
        """Refuse at once a push the weights stream cannot hold beside the versions it holds,
        before anything is packed or sent; where `Limits.weights_max_bytes` leaves the cap to
        pushes, first ask JetStream to set aside what it needs."""
        js = self.bus.js
        info = await js.stream_info(self.bus.subjects.weights_stream)
        cap, held = info.config.max_bytes or -1, info.state.bytes
        if cap <= 0 or held + need <= cap:  # uncapped: a job provisioned before caps
            return
        fixed = self.bus.limits.weights_max_bytes is not None
        want = -(-(held + need) // MIB) * MIB
        why = f"its cap is {cap / MIB:.1f} MiB (Limits.weights_max_bytes)"
        if not fixed:
            try:
                await js.update_stream(replace(info.config, max_bytes=want))
                return
            except APIError as exc:
                if not storage_refused(exc):
                    raise
                why = (f"JetStream cannot set aside {want / MIB:.1f} MiB for it "
                       f"({exc.description}{await self._account()})")
        raise TransportError(ErrorCode.STORAGE_FULL, (
            f"the weights stream has no room for this push: {size / MIB:.1f} MiB beside the "
            f"{held / MIB:.1f} MiB it holds (the version in use); {why}. Nothing was sent. "
            "Raise the server's JetStream store (max_file_store or max_memory_store, or the "
            "account's max_storage), delete finished jobs (`rlfabric ctl --prefix P "
            "delete-job`), push fewer bytes (an adapter), or use the shm or filesystem "
            "transport"))

    async def _account(self) -> str:
        """The account's JetStream limits, where it has any, for an error message."""
        try:
            acct = await self.bus.js.account_info()
        except Exception:  # only for the message
            return ""
        lim = acct.limits.max_storage
        return "" if lim < 0 else (
            f"; the account stores {acct.storage / MIB:.1f} of {lim / MIB:.1f} MiB")

    def chunk_bytes(self) -> int:
        """The chunk size: 4 MiB, or less if the server announces a smaller `max_payload`."""
        limit = int(self.bus.nc.max_payload or 0)
        return NATS_CHUNK if limit <= 0 else max(1024, min(NATS_CHUNK, limit - PAYLOAD_MARGIN))

    async def _abandon(self, subject: str, exc: BaseException) -> None:
        """A push that failed part-way: its chunks go (the next push has the room it had
        before), and workers reading them are told why (`<subject>.abort`) instead of waiting
        out their timeout."""
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await self._purge(subject)
            await self.bus.publish_stored(f"{subject}.{ABORT}",
                                          f"{type(exc).__name__}: {exc}".encode()[:4096])

    async def _purge(self, subject: str) -> None:
        await self.bus.js.purge_stream(self.bus.subjects.weights_stream, subject=f"{subject}.>")

    async def _send(self, subject: str, view: memoryview, chunks: int, size: int) -> None:
        """Every chunk (`size` bytes, the last one shorter), NATS_WINDOW in flight at a time.
        After a chunk fails no more are sent, and those in flight are waited for, not
        cancelled: the server may store one after a clean-up that did not wait for its
        answer."""
        failed: list[Exception] = []

        async def one(i: int) -> None:
            # NOTE: no headers: nats-py copies the payload to prepend them. A reconnect or a
            # lost PubAck: sent again (a chunk stored twice is read once: workers count chunk
            # indices, not messages)
            chunk = view[i * size:(i + 1) * size]
            try:
                try:
                    await self.bus.publish_stored(f"{subject}.{i}", chunk)
                except TRANSIENT as exc:
                    if failed or storage_refused(exc):
                        raise
                    await self.bus.persist(f"{subject}.{i}", bytes(chunk), {},
                                           until=time.time() + NATS_RETRY_S)
            except Exception as exc:
                failed.append(exc)
            finally:
                window.release()

        window = anyio.Semaphore(NATS_WINDOW)
        async with anyio.create_task_group() as tg:
            for i in range(chunks):
                await window.acquire()
                if failed:
                    break
                tg.start_soon(one, i)
        if failed:
            raise failed[0]

    @contextlib.asynccontextmanager
    async def receive(self, locator: Nats, job: ReceiveJob) -> AsyncIterator[Received]:
        wait = job.fetch_timeout
        if job.deadline:  # past the command's deadline nobody waits for this version
            wait = max(0.0, min(wait, job.deadline - time.time()))
        yield Received(await self._read(locator, wait), owned=True)

    async def _read(self, t: Nats, timeout: float) -> bytearray:
        """Every chunk of the version into one buffer (an ordered push consumer:
        flow-controlled by the server, no pull round trips)."""
        # zeroed in a thread: on the event loop, a large buffer would stall heartbeats
        buf = await anyio.to_thread.run_sync(bytearray, tensors.buffer_size(t.tensors))
        seen = bytearray(t.chunks)  # by chunk index: a chunk the sender stored twice counts once
        got = 0
        aborted = ""
        done = anyio.Event()

        async def on_chunk(m: Msg) -> None:
            nonlocal got, aborted
            last = m.subject.rsplit(".", 1)[1]
            if last == ABORT:  # the sender gave up: no more chunks come
                aborted = m.data.decode(errors="replace")
                done.set()
                return
            try:
                i = int(last)
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
        sub = None
        try:
            with anyio.fail_after(timeout):
                sub = await self._subscribe(t, on_chunk)
                await done.wait()
        finally:
            if sub is not None:
                with anyio.CancelScope(shield=True):
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
        if aborted:
            raise TransportError(ErrorCode.FETCH_FAILED, f"the sender abandoned this version "
                                 f"after {got} of {t.chunks} chunks ({aborted})")
        return buf


    async def _subscribe(self, t: Nats, on_chunk: Any) -> Any:
        """The ordered consumer of a version's chunks, its creation retried until it is made
        (the caller bounds the wait): the weights stream may be electing a leader (a node of
        a cluster cut off or gone), which answers nothing, or 503, for a few seconds."""
        delay = 0.1
        while True:
            try:
                return await self.bus.js.subscribe(f"{t.subject}.>", stream=t.stream,
                                                   cb=on_chunk, ordered_consumer=True,
                                                   idle_heartbeat=0.5,
                                                   deliver_policy=DeliverPolicy.ALL)
            except _SUBSCRIBE_RETRIED as exc:
                if isinstance(exc, APIError) and exc.code == 400:  # a request it will refuse
                    raise
                await anyio.sleep(delay)
                delay = min(2 * delay, 1.0)


def _full(exc: BaseException, size: int, chunk: int, chunks: int) -> str:
    return (f"JetStream has no room for this push ({exc}): {size / MIB:.1f} MiB in {chunks} "
            f"chunks of {chunk / MIB:.1f} MiB; what was stored of it is removed. Raise the "
            "server's JetStream store (max_file_store, or the account's max_storage), push "
            "fewer bytes (an adapter), or use the shm or filesystem transport")
