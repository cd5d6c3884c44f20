"""`FabricClient`: what trainer code holds. Rollouts on the data plane, quorum-acked commands
on the control plane.

    async with FabricClient.connect("nats://127.0.0.1:4222", prefix="rl") as fabric:
        rep = await fabric.pause(mode="wait")
        async for res in fabric.generate(requests):
            ...
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import anyio
import msgspec
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from rlfabric.bus import (
    Broadcaster,
    Bus,
    ConnectOptions,
    Limits,
    MembershipWatcher,
    QuorumPolicy,
    new_cmd_id,
)
from rlfabric.bus.subjects import check_token
from rlfabric.schemas import (
    Command,
    Describe,
    FanoutReport,
    MembershipSnapshot,
    Pause,
    ResetPrefixCache,
    Resume,
    RolloutError,
    RolloutReply,
    RolloutRequest,
    SchemaError,
    Sleep,
    Wake,
    codec_for,
    encode,
)

CLIENT_ID_HEADER = "rlf-client-id"
REQUEST_ID_HEADER = "rlf-request-id"


@dataclass(eq=False)
class _Waiting:
    """One submitted request: which samples arrived, and where its results go."""

    request: RolloutRequest
    sink: MemoryObjectSendStream[RolloutReply]
    got: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.got) >= self.request.sampling.n


class FabricClient:
    def __init__(self, bus: Bus, client_id: str, policy: QuorumPolicy) -> None:
        self.bus = bus
        self.client_id = check_token(client_id, "client id")
        self.policy = policy
        self.watcher = MembershipWatcher(bus)
        self.broadcaster = Broadcaster(bus, self.watcher)
        self._waiting: dict[str, _Waiting] = {}
        self._codec = codec_for(RolloutReply)
        self.duplicates_dropped = 0

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, url: str | ConnectOptions, *, prefix: str = "rl",
                      client_id: str | None = None, policy: QuorumPolicy | None = None,
                      limits: Limits | None = None) -> AsyncIterator[FabricClient]:
        """Connect, provision the job's streams, start watching membership and listening for
        this client's results. `policy` is the default `QuorumPolicy` of control calls."""
        async with Bus.connect(url, prefix=prefix, limits=limits) as bus:
            client = cls(bus, client_id or f"c{uuid.uuid4().hex[:12]}", policy or QuorumPolicy())
            await bus.tg.start(client.watcher.run)
            await bus.tg.start(client._listen)
            yield client

    # ---- membership ----
    async def snapshot(self) -> MembershipSnapshot:
        return self.watcher.snapshot()

    async def wait_for_workers(self, n: int, timeout: float = 60.0) -> MembershipSnapshot:
        """Wait until at least `n` workers are members."""
        return await self.watcher.wait_until(lambda s: len(s.members) >= n, timeout=timeout)

    # ---- control ----
    async def broadcast(self, cmd: Command, policy: QuorumPolicy | None = None) -> FanoutReport:
        """Send any command to every worker and wait for its quorum."""
        return await self.broadcaster.broadcast(cmd, policy or self.policy)

    async def pause(self, mode: str = "wait", *, policy: QuorumPolicy | None = None
                    ) -> FanoutReport:
        return await self.broadcast(Pause(cmd_id=new_cmd_id(), mode=mode), policy)  # type: ignore[arg-type]

    async def resume(self, *, policy: QuorumPolicy | None = None) -> FanoutReport:
        return await self.broadcast(Resume(cmd_id=new_cmd_id()), policy)

    async def describe(self, *, policy: QuorumPolicy | None = None) -> FanoutReport:
        return await self.broadcast(Describe(cmd_id=new_cmd_id()), policy)

    async def reset_prefix_cache(self, *, policy: QuorumPolicy | None = None) -> FanoutReport:
        return await self.broadcast(ResetPrefixCache(cmd_id=new_cmd_id()), policy)

    async def sleep(self, level: int = 1, *, policy: QuorumPolicy | None = None) -> FanoutReport:
        return await self.broadcast(Sleep(cmd_id=new_cmd_id(), level=level), policy)

    async def wake(self, tags: Iterable[str] = (), *, policy: QuorumPolicy | None = None
                   ) -> FanoutReport:
        return await self.broadcast(Wake(cmd_id=new_cmd_id(), tags=tuple(tags)), policy)

    # ---- data plane ----
    async def _listen(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        sub = await self.bus.js.subscribe(
            self.bus.subjects.rollout_result(self.client_id), cb=self._on_result,
            ordered_consumer=True, deliver_policy=DeliverPolicy.NEW)
        try:
            task_status.started()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await sub.unsubscribe()

    async def _on_result(self, msg: Msg) -> None:
        try:
            reply = self._codec.decode(msg.data, msg.headers, subject=msg.subject)
        except SchemaError:
            return
        w = self._waiting.get(reply.request_id)
        if w is None:  # late duplicate of a finished request, or not ours any more
            self.duplicates_dropped += 1
            return
        if isinstance(reply, RolloutError) and reply.sample_index is None:
            # an error for the whole request: one per sample still missing
            replies: list[RolloutReply] = [
                msgspec.structs.replace(reply, sample_index=i)
                for i in range(w.request.sampling.n) if i not in w.got]
        else:
            replies = [reply]
        fresh = [r for r in replies if (r.sample_index or 0) not in w.got]
        if not fresh:
            self.duplicates_dropped += 1
            return
        for r in fresh:
            w.got.add(r.sample_index or 0)
            w.sink.send_nowait(r)
        if w.complete:
            self._forget(reply.request_id)

    def _forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def _prepare(self, req: RolloutRequest, timeout: float | None) -> RolloutRequest:
        changes: dict[str, object] = {"client_id": self.client_id}
        if timeout is not None and not req.deadline:
            changes["deadline"] = time.time() + timeout
        return msgspec.structs.replace(req, **changes)

    async def submit(self, requests: Iterable[RolloutRequest],
                     sink: MemoryObjectSendStream[RolloutReply], *,
                     timeout: float | None = None) -> list[RolloutRequest]:
        """Publish requests to the workers' queue; their results go to `sink`. Returns the
        requests as sent (with this client's id and deadlines filled in)."""
        s = self.bus.subjects
        sent = []
        futures = []
        for req in requests:
            req = self._prepare(req, timeout)
            if req.request_id in self._waiting:
                raise ValueError(f"request_id {req.request_id!r} is already in flight")
            self._waiting[req.request_id] = _Waiting(req, sink)
            hdrs = self.bus.headers({
                "Nats-Msg-Id": f"{self.client_id}/{req.request_id}",
                CLIENT_ID_HEADER: self.client_id, REQUEST_ID_HEADER: req.request_id,
            })
            futures.append(await self.bus.js.publish_async(s.rollout_request, encode(req),
                                                           headers=hdrs))
            sent.append(req)
        for fut in futures:
            await fut  # every request persisted in the stream
        return sent

    async def generate(self, requests: Iterable[RolloutRequest], *,
                       timeout: float | None = None) -> AsyncIterator[RolloutReply]:
        """Submit `requests` and yield each sample's `RolloutResult` (or a `RolloutError`) as
        it arrives, exactly once per (request_id, sample_index), whichever worker served it
        and however often it was redelivered. `timeout` sets a deadline per request; samples
        still missing at their deadline are yielded as `RolloutError(code="deadline_exceeded")`.
        """
        reqs = list(requests)
        total = sum(r.sampling.n for r in reqs)
        send, recv = anyio.create_memory_object_stream[RolloutReply](max(total, 1))
        sent = await self.submit(reqs, send, timeout=timeout)
        ids = [r.request_id for r in sent]
        yielded = 0
        try:
            async with recv:
                while yielded < total:
                    wait = self._next_deadline(ids)
                    reply = None
                    with anyio.move_on_after(wait if wait is not None else float("inf")):
                        reply = await recv.receive()
                    if reply is None:
                        for err in self._expire(ids):
                            yielded += 1
                            yield err
                        continue
                    yielded += 1
                    yield reply
        finally:
            for rid in ids:
                self._forget(rid)
            send.close()

    async def generate_groups(self, requests: Iterable[RolloutRequest], *,
                              timeout: float | None = None
                              ) -> AsyncIterator[list[RolloutReply]]:
        """Like `generate`, but yield each request's n samples together, in sample order."""
        reqs = list(requests)
        n_of = {r.request_id: r.sampling.n for r in reqs}
        groups: dict[str, list[RolloutReply]] = {}
        async for reply in self.generate(reqs, timeout=timeout):
            g = groups.setdefault(reply.request_id, [])
            g.append(reply)
            if len(g) == n_of[reply.request_id]:
                del groups[reply.request_id]
                yield sorted(g, key=lambda r: r.sample_index or 0)

    def _next_deadline(self, ids: list[str]) -> float | None:
        deadlines = [w.request.deadline for rid in ids
                     if (w := self._waiting.get(rid)) and w.request.deadline]
        return max(0.0, min(deadlines) - time.time()) if deadlines else None

    def _expire(self, ids: list[str]) -> list[RolloutError]:
        out = []
        now = time.time()
        for rid in ids:
            w = self._waiting.get(rid)
            if w is None or not w.request.deadline or w.request.deadline > now:
                continue
            for i in range(w.request.sampling.n):
                if i not in w.got:
                    out.append(RolloutError(
                        request_id=rid, worker_id="", code="deadline_exceeded", sample_index=i,
                        group_id=w.request.group_id, retryable=True,
                        message=f"no result for sample {i} of {rid} by its deadline"))
            self._forget(rid)
        return out

