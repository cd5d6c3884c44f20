"""Workers as sources of the versions they keep (`UpdateWeights.keep`). A worker that joins, or
falls behind, while the fleet's desired version came as a delta (`update_weights(...,
delta=True)`) holds no base to apply it to; it takes the full version from the workers that
keep it instead of waiting for the trainer's next full push, so the trainer's bytes per version
do not grow with the workers that join.

Over core NATS: the joiner asks for each chunk of the packed version on
`<prefix>.peers.weights.<digest>` (a `PeerAsk`, `PEER_WINDOW` in flight); every worker keeping
that digest subscribes there in one queue group, so the chunks are spread over them, and
answers with the chunk's bytes read from its kept copy. A keeper whose copy changed meanwhile
(a delta is applied to it in place) refuses (header `PEER_REFUSED_HEADER`), and a chunk read as
it changed fails the joiner's digest check: a torn copy is refused, never served. Each keeper
advertises what it keeps (`WorkerInfo.kept`), so the trainer's next delta goes to the joiner
too.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import anyio
import msgspec
import nats.errors
from anyio.abc import TaskStatus
from nats.aio.msg import Msg

from rlfabric import tensors
from rlfabric.bus import Bus
from rlfabric.concurrency.sync import Signal, beside
from rlfabric.schemas import (
    SCHEMA_HEADER,
    SCHEMA_VERSION,
    ErrorCode,
    PeerAsk,
    SchemaError,
    UpdateWeights,
    codec_for,
)
from rlfabric.transports import Received, TransportError
from rlfabric.transports.nats import NATS_CHUNK, PAYLOAD_MARGIN
from rlfabric.worker.kept import KeptVersions

log = logging.getLogger("rlfabric.worker.peers")

#: the queue group of a digest's keepers
PEER_QUEUE = "peers"
#: set on a keeper's answer that carries no chunk: why
PEER_REFUSED_HEADER = "rlf-peer-refused"
PEER_WINDOW = 16  # chunks asked for at a time
PEER_CHUNK_S = 30.0  # a chunk not answered within this fails the fetch
_ASK = codec_for(PeerAsk)
_HEADERS = {SCHEMA_HEADER: SCHEMA_VERSION}


def whole(cmd: UpdateWeights) -> UpdateWeights:
    """A delta command as the full version it makes: its layout, no delta."""
    assert cmd.delta is not None
    t = msgspec.structs.replace(cmd.transport, tensors=cmd.delta.tensors)
    return msgspec.structs.replace(cmd, transport=t, delta=None)


class PeerSource:
    def __init__(self, bus: Bus, kept: KeptVersions, worker_id: str) -> None:
        self.bus = bus
        self.kept = kept
        self.worker_id = worker_id
        self._subs: dict[str, Any] = {}  # digest -> its queue subscription
        self._changed = Signal()
        kept.on_change = self._changed.fire

    def keeps(self) -> tuple[str, ...]:
        return tuple(sorted(d for d, _ in self.kept.held.values() if d))

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Subscribed to each digest kept, while it is kept."""
        task_status.started()
        try:
            while True:
                changed = self._changed.event()
                await self._follow()
                await changed.wait()
        finally:
            with anyio.CancelScope(shield=True):
                for sub in self._subs.values():
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                self._subs.clear()

    async def _follow(self) -> None:
        keeps = set(self.keeps())
        for digest in [d for d in self._subs if d not in keeps]:
            with contextlib.suppress(Exception):
                await self._subs.pop(digest).unsubscribe()
        for digest in keeps - set(self._subs):
            self._subs[digest] = await self.bus.nc.subscribe(
                self.bus.subjects.peer_weights(digest), queue=PEER_QUEUE, cb=self._answer)

    def _copy(self, digest: str) -> bytearray | None:
        for d, buf in self.kept.held.values():
            if d == digest:
                return buf
        return None

    async def _answer(self, msg: Msg) -> None:
        why = ""
        try:
            ask = _ASK.decode(msg.data, msg.headers, subject=msg.subject)
        except SchemaError as exc:
            ask, why = None, str(exc)
        chunk = b""
        if ask is not None:
            buf = self._copy(ask.digest)
            start = ask.index * ask.chunk_bytes
            if buf is None:
                why = f"{self.worker_id} no longer keeps {ask.digest}"
            elif ask.chunk_bytes <= 0 or not 0 <= start < len(buf):
                why = f"no chunk {ask.index} of {ask.chunk_bytes} bytes in {len(buf)}"
            else:  # a copy: the kept bytes may change once this returns
                chunk = bytes(memoryview(buf)[start:start + ask.chunk_bytes])
        with contextlib.suppress(Exception):  # the asker is gone: it asks again or gives up
            await self.bus.nc.publish(msg.reply, chunk,
                                      headers={PEER_REFUSED_HEADER: why} if why else None)

    async def fetch(self, cmd: UpdateWeights, timeout: float) -> Received | None:
        """The full version delta `cmd` makes, from the workers keeping it; None if none
        does. `TransportError` if one refused or stopped answering part-way."""
        assert cmd.delta is not None
        size = tensors.buffer_size(cmd.delta.tensors)
        limit = int(self.bus.nc.max_payload or 0)
        step = NATS_CHUNK if limit <= 0 else max(1024, min(NATS_CHUNK, limit - PAYLOAD_MARGIN))
        chunks = -(-size // step)
        subject = self.bus.subjects.peer_weights(cmd.digest)
        buf = await anyio.to_thread.run_sync(bytearray, size)

        async def one(i: int) -> None:
            ask = _ASK.encode(PeerAsk(worker_id=self.worker_id, digest=cmd.digest, index=i,
                                      chunk_bytes=step))
            m = await self.bus.nc.request(subject, ask, timeout=PEER_CHUNK_S, headers=_HEADERS)
            why = (m.headers or {}).get(PEER_REFUSED_HEADER)
            if why or len(m.data) != min(step, size - i * step):
                raise TransportError(ErrorCode.FETCH_FAILED, f"{self.worker_id}: chunk {i} of "
                                     f"v{cmd.version} from a peer: {why or 'short'}")
            buf[i * step:i * step + len(m.data)] = m.data

        window = anyio.Semaphore(PEER_WINDOW)

        async def held(i: int) -> None:
            async with window:
                await one(i)

        try:
            with anyio.fail_after(timeout):
                try:
                    await one(0)
                except nats.errors.NoRespondersError:
                    return None  # no worker keeps it
                async with beside() as tg:
                    for i in range(1, chunks):
                        tg.start_soon(held, i)
        except (nats.errors.Error, TimeoutError) as exc:
            raise TransportError(ErrorCode.FETCH_FAILED, (
                f"{self.worker_id}: v{cmd.version} from its peers failed part-way "
                f"({type(exc).__name__}: {exc})")) from exc
        log.info("%s: v%d (%.1f MiB) taken from the workers keeping it", self.worker_id,
                 cmd.version, size / 2**20)
        return Received(buf, owned=True)
