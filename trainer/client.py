"""`FabricClient`: what trainer code holds. Rollouts on the data plane, quorum-acked commands
on the control plane.

    async with FabricClient.connect("nats://127.0.0.1:4222", prefix="rl") as fabric:
        rep = await fabric.pause(mode="wait")
        async for res in fabric.generate(requests):
            ...
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

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
    Fanout,
    Limits,
    MembershipWatcher,
    QuorumPolicy,
    new_cmd_id,
)
from rlfabric.bus.collective import CollectiveGroup, CollectiveTimeout
from rlfabric.bus.subjects import check_token
from rlfabric.schemas import (
    CLIENT_ID_HEADER,
    REQUEST_ID_HEADER,
    Collective,
    Command,
    Describe,
    DesiredState,
    FanoutReport,
    InitTransport,
    MembershipSnapshot,
    Pause,
    ResetPrefixCache,
    Resume,
    RolloutError,
    RolloutReply,
    RolloutRequest,
    RolloutResult,
    SchemaError,
    Sleep,
    Target,
    UpdateWeights,
    Wake,
    codec_for,
    encode,
)
from rlfabric.trainer.continuation import continuation, merge
from rlfabric.trainer.errors import TransportInitFailed, WeightsMismatch
from rlfabric.trainer.weights import Staged, WeightStager, as_state_dict


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
        self.stager = WeightStager(bus)
        self._current: Staged | None = None
        self._group: CollectiveGroup | None = None
        self._group_fingerprint = ""
        self._last_epoch = 0
        #: what this client last asked of the fleet (it is the job's one writer of rl_state)
        self._desired = DesiredState()

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
            client._desired = await bus.desired_state()
            try:
                yield client
            finally:
                if client._current is not None:
                    client._current.release()
                if client._group is not None:
                    client._group.close()

    # ---- membership ----
    async def snapshot(self) -> MembershipSnapshot:
        return self.watcher.snapshot()

    async def wait_for_workers(self, n: int, timeout: float = 60.0) -> MembershipSnapshot:
        """Wait until at least `n` workers are members."""
        return await self.watcher.wait_until(lambda s: len(s.members) >= n, timeout=timeout)

    # ---- control ----
    async def broadcast(self, cmd: Command, policy: QuorumPolicy | None = None) -> FanoutReport:
        """Send any command to every worker and wait for its quorum. A command without a
        deadline gets the policy's timeout as one: a worker that receives it later (after a
        reconnect, say) refuses it instead of acting on a request nobody waits for."""
        policy = policy or self.policy
        if not cmd.deadline:
            cmd = msgspec.structs.replace(cmd, deadline=time.time() + policy.timeout)
        return await self.broadcaster.broadcast(cmd, policy)

    async def pause(self, mode: str = "wait", *, policy: QuorumPolicy | None = None
                    ) -> FanoutReport:
        """Pause every worker. `wait`: acks once its in-flight requests finished. `abort`:
        in-flight samples end now and come back with `finish_reason="abort"` (continue them
        with `continue_aborted`). `keep`: in-flight samples freeze and resume after `resume()`,
        under the weights loaded by then. Queued requests wait in the stream either way."""
        if mode not in ("wait", "abort", "keep"):
            raise ValueError(f"pause(mode={mode!r}): use 'wait', 'abort' or 'keep'")
        cmd = Pause(cmd_id=new_cmd_id(), mode=mode)  # type: ignore[arg-type]
        return await self._broadcast_desiring(cmd, policy, paused=True, pause_mode=mode)

    async def resume(self, *, policy: QuorumPolicy | None = None) -> FanoutReport:
        return await self._broadcast_desiring(Resume(cmd_id=new_cmd_id()), policy,
                                              paused=False, pause_mode="")

    async def _broadcast_desiring(self, cmd: Command, policy: QuorumPolicy | None, *,
                                  revert_on_failure: bool = False, **desired: Any
                                  ) -> FanoutReport:
        """Broadcast `cmd` while recording the desired state it stands for in the state
        bucket, concurrently: a worker joining meanwhile starts from the new state (e.g.
        paused), and no round trip is added to the call."""
        before = self._desired
        self._desired = msgspec.structs.replace(before, updated_at=time.time(), **desired)
        outcome: FanoutReport | Exception
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.bus.put_desired_state, self._desired)
            try:
                outcome = await self.broadcast(cmd, policy)
            except Exception as exc:  # re-raised below, not as an exception group
                outcome = exc
        if isinstance(outcome, Exception):
            if revert_on_failure:
                self._desired = before
                await self.bus.put_desired_state(before)
            raise outcome
        return outcome

    async def _desire(self, **changes: Any) -> None:
        self._desired = msgspec.structs.replace(self._desired, updated_at=time.time(), **changes)
        await self.bus.put_desired_state(self._desired)

    # ---- weights ----
    async def stage_weights(self, version: int, weights: Any, transport: str = "shm", *,
                            mark_stable: bool = True, with_checksum: bool = True) -> Staged:
        """Pack `weights` (a module or state dict) for `transport` without sending anything.
        `push_weights()` sends it; `update_weights()` does both. `with_checksum` computes the
        checksum `verify="sender"` compares against."""
        return await self.stager.stage(version, as_state_dict(weights), transport,
                                       mark_stable=mark_stable, with_checksum=with_checksum)

    async def update_weights(self, version: int, state_dict: Any = None, *, module: Any = None,
                             transport: str = "shm", target: Target | None = None,
                             policy: QuorumPolicy | None = None,
                             verify: Literal["sender", "workers", "off"] = "sender",
                             ) -> FanoutReport:
        """Make every worker serve `version` of these weights; returns once the quorum acked
        `done`. Each worker verifies the payload digest, swaps atomically (a failure keeps
        the old version and acks an error: `QuorumNotReached` names the worker and why) and
        reports its weights checksum. `verify="sender"` requires every checksum to equal the
        one of the state dict sent; `"workers"` only that they agree (use it when workers
        store weights in another dtype or layout); `WeightsMismatch` names the deviants."""
        weights = module if module is not None else state_dict
        if weights is None:
            raise TypeError("update_weights needs state_dict= or module=")
        staged = await self.stage_weights(version, weights, transport,
                                          with_checksum=verify == "sender")
        return await self.push_weights(staged, target=target, policy=policy, verify=verify)

    async def push_weights(self, staged: Staged, *, target: Target | None = None,
                           policy: QuorumPolicy | None = None,
                           verify: Literal["sender", "workers", "off"] = "sender"
                           ) -> FanoutReport:
        policy = policy or self.policy
        deadline = time.time() + policy.timeout
        previous = self._desired
        if isinstance(staged.transport, Collective):
            group = await self._fresh_group(policy)
            staged.transport = msgspec.structs.replace(staged.transport,
                                                       group_epoch=group.group_epoch)
            cmd = staged.command(new_cmd_id(), target=target, deadline=deadline)
            rep = await self._push_collective(cmd, staged, group, policy)
        else:
            cmd = staged.command(new_cmd_id(), target=target, deadline=deadline)
            try:
                # a worker joining during the update loads this version itself
                rep = await self._broadcast_desiring(cmd, policy, revert_on_failure=True,
                                                     weight_version=staged.version, locator=cmd)
            except Exception:
                staged.release()
                raise
        try:
            self._check(rep, staged, verify)
        except WeightsMismatch:
            # NOTE: the broadcast already recorded this version as desired: take it back
            self._desired = previous
            await self.bus.put_desired_state(previous)
            staged.release()
            raise
        if isinstance(staged.transport, Collective):
            await self._desire(weight_version=staged.version, locator=None)
        if self._current is not None and self._current is not staged:
            self._current.release()  # the previous version is no longer anyone's to load
        self._current = staged
        return rep

    def _check(self, rep: FanoutReport, staged: Staged, verify: str) -> None:
        if verify == "off":
            return
        sums = {w: rep.acks[w].weights_checksum for w in rep.ok}
        if verify == "sender":
            expected = staged.expected_checksum
        else:
            expected = Counter(sums.values()).most_common(1)[0][0] if sums else ""
        versions = {w: rep.acks[w].weight_version for w in rep.ok}
        bad = {w: c for w, c in sums.items() if c != expected or versions[w] != staged.version}
        if bad:
            detail = ", ".join(f"{w} (v{versions[w]}, checksum {c})"
                               for w, c in sorted(bad.items()))
            raise WeightsMismatch(
                f"update to v{staged.version}: {len(bad)} of {len(sums)} workers do not serve "
                f"what was sent (expected checksum {expected}): {detail}",
                checksums=sums, expected=expected, report=rep)

    async def _push_collective(self, cmd: UpdateWeights, staged: Staged,
                               group: CollectiveGroup, policy: QuorumPolicy) -> FanoutReport:
        async with self.broadcaster.open(cmd) as fo:
            await fo.wait("ready", policy)
            return await _alongside_done(fo, policy, group.broadcast, staged.flat)

    # ---- collective transport ----
    async def init_transport(self, backend: str = "gloo", *, master_addr: str = "127.0.0.1",
                             master_port: int | None = None, timeout: float = 60.0,
                             policy: QuorumPolicy | None = None) -> FanoutReport:
        """Form a fresh collective group: this client is rank 0, each worker gets the ranks
        of its TP x PP from the membership snapshot, a new `group_epoch` names it. Fails
        within `timeout` with `TransportInitFailed` naming the workers that did not join."""
        snap = self.watcher.snapshot()
        offsets, rank = {}, 1
        for m in snap.members:
            offsets[m.worker_id] = rank
            rank += max(1, m.ranks)
        epoch = max(self._desired.group_epoch, self._last_epoch) + 1  # fresh after a failure
        self._last_epoch = epoch
        if self._group is not None:
            self._group.close()  # torn down, never reused
            self._group = None
        port = master_port or _free_port(master_addr)
        group = CollectiveGroup(backend=backend, master_addr=master_addr, master_port=port,
                                rank=0, world_size=rank, group_epoch=epoch, timeout=timeout)
        await anyio.to_thread.run_sync(group.open_store)
        cmd = InitTransport(cmd_id=new_cmd_id(), backend=backend, group_epoch=epoch,  # type: ignore[arg-type]
                            master_addr=master_addr, master_port=port, world_size=rank,
                            rank_offsets=offsets, deadline=time.time() + timeout)
        policy = policy or QuorumPolicy(required=self.policy.required, timeout=timeout,
                                        on_membership_change=self.policy.on_membership_change)
        by_rank = {r: w for w, r in offsets.items()}
        async with self.broadcaster.open(cmd) as fo:
            try:
                await anyio.to_thread.run_sync(group.wait_joined)
            except CollectiveTimeout as exc:
                group.close()
                workers = tuple(sorted({by_rank.get(r, f"rank{r}") for r in exc.missing}))
                raise TransportInitFailed(
                    f"init_transport({backend}) epoch {epoch}: {', '.join(workers)} did not "
                    f"join within {timeout}s (ranks {exc.missing}); others are released at "
                    "their deadline; check those workers, then init again",
                    missing_workers=workers, missing_ranks=tuple(exc.missing),
                    group_epoch=epoch) from exc
            rep = await _alongside_done(fo, policy, group.connect)
        self._group, self._group_fingerprint = group, snap.fingerprint
        await self._desire(group_epoch=epoch)
        return rep

    async def _fresh_group(self, policy: QuorumPolicy) -> CollectiveGroup:
        """The current group, or a new one if there is none or membership moved since."""
        fp = self.watcher.snapshot().fingerprint
        if self._group is None or fp != self._group_fingerprint:
            backend = self._group.backend if self._group else "gloo"
            await self.init_transport(backend, timeout=policy.timeout)
        assert self._group is not None
        return self._group

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

    async def continue_aborted(self, requests: Iterable[RolloutRequest],
                               results: Iterable[RolloutReply], *,
                               timeout: float | None = None) -> AsyncIterator[RolloutReply]:
        """Yield `results` with every sample an abort pause cut short continued from where it
        stopped and merged back into one result (its spans show every version involved)."""
        by_id = {r.request_id: r for r in requests}
        partials: dict[str, RolloutResult] = {}
        for res in results:
            if isinstance(res, RolloutResult) and res.finish_reason == "abort":
                partials[continuation(by_id[res.request_id], res).request_id] = res
            else:
                yield res
        conts = [continuation(by_id[p.request_id], p) for p in partials.values()]
        async for rest in self.generate(conts, timeout=timeout):
            part = partials[rest.request_id]
            if isinstance(rest, RolloutResult):
                yield merge(part, rest)
            else:
                yield msgspec.structs.replace(rest, request_id=part.request_id,
                                              sample_index=part.sample_index)

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


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def _alongside_done(fo: Fanout, policy: QuorumPolicy, blocking: Any, *args: Any
                          ) -> FanoutReport:
    """Run rank 0's side of a collective step (`blocking(*args)`, in a thread) while waiting
    for the workers' `done` acks; either's failure is raised as itself, not as a group."""
    outcome: dict[str, Any] = {}

    async def rank0() -> None:
        try:
            await anyio.to_thread.run_sync(blocking, *args)
        except Exception as exc:
            outcome.setdefault("error", exc)

    async def done() -> None:
        try:
            outcome["report"] = await fo.wait("done", policy)
        except Exception as exc:
            outcome.setdefault("error", exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(rank0)
        tg.start_soon(done)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["report"]
