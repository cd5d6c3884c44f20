"""The sending side of weight updates: push staged weights, verify what every worker reports,
and form the collective group weights are broadcast over.

Pull transports (shm, filesystem, nats) are one broadcast: each worker fetches, verifies the
digest, swaps and acks `done` with its checksum; the desired state names the version while the
command is out, so a worker joining meanwhile loads it too. cuda_ipc is the same broadcast, but
its GPU buffers are freed as soon as the update is decided (joiners wait for the next push).
The collective transport is two-phase (`ready`, then rank 0 broadcasts, then `done`).

A push that fails is taken back: the desired state returns to the policy before it, and the
previous push of the same target (kept staged until the next one succeeds) is sent again, so
every worker that had applied the failed one goes back to it (a worker that misses that finds
itself off the desired state and goes back on its own: `rlfabric.worker.alignment`). The
error then says where every worker is. Where the previous push cannot be sent again (there was
none, or it went over a collective or cuda_ipc), the workers that applied the failed version
take no requests until the next push succeeds.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from typing import Any, Literal

import anyio
import msgspec
import torch

from rlfabric import tensors
from rlfabric.bus import (
    Broadcaster,
    Fanout,
    MembershipWatcher,
    QuorumNotReached,
    QuorumPolicy,
    new_cmd_id,
)
from rlfabric.concurrency.sync import beside
from rlfabric.schemas import (
    Adapter,
    Collective,
    CollectiveBackend,
    CudaIpc,
    DeltaOf,
    ErrorCode,
    FanoutReport,
    InitTransport,
    MembershipSnapshot,
    Target,
    UpdateWeights,
    base_policy,
)
from rlfabric.tensors import CollectiveGroup, CollectiveTimeout
from rlfabric.trainer.deltas import DeltaBases, Packed
from rlfabric.trainer.desired import DesiredStateWriter
from rlfabric.trainer.errors import TransportInitFailed, WeightsMismatch
from rlfabric.trainer.policies import PushedPolicies
from rlfabric.trainer.staging import WeightStager, as_state_dict
from rlfabric.transports import Staged, name_of

Verify = Literal["sender", "workers", "off"]
#: the transports `delta=True` takes (the device ones carry GPU buffers, not host bytes)
DELTA_TRANSPORTS = ("shm", "filesystem", "nats")
#: where a delta costs more than it saves, so `delta=True` sends the weights whole: a shm push
#: is one copy through the host's memory, less than encoding and applying a delta
#: (docs/benchmarks.md, `bench weights --delta`)
WHOLE_OVER = ("shm",)
#: seconds a failed push's taking back waits for the workers
TAKE_BACK_S = 30.0


class WeightUpdates:
    def __init__(self, broadcaster: Broadcaster, watcher: MembershipWatcher,
                 desired: DesiredStateWriter, pushed: PushedPolicies) -> None:
        self.broadcaster = broadcaster
        self.watcher = watcher
        self.desired = desired
        self.pushed = pushed
        self.stager = WeightStager(broadcaster.bus)
        #: what late joiners load, by adapter name ("": the base weights): kept until replaced
        self._current: dict[str, Staged] = {}
        #: the last push the fleet took, by adapter name: sent again to take a failed one back
        self._sent: dict[str, UpdateWeights] = {}
        #: what the next `stage_delta` of each target encodes against
        self.bases = DeltaBases()
        self._group: CollectiveGroup | None = None
        self._group_fingerprint = ""
        self._last_epoch = 0

    async def close(self) -> None:
        self.stager.close()
        for staged in self._current.values():
            await staged.release()
        if self._group is not None:
            self._group.close()

    async def stage(self, version: int, weights: Any, transport: str, *, mark_stable: bool,
                    with_checksum: bool, send_now: bool = True) -> Staged:
        return await self.stager.stage(version, as_state_dict(weights), transport,
                                       mark_stable=mark_stable, with_checksum=with_checksum,
                                       send_now=send_now)

    async def stage_delta(self, version: int, weights: Any, transport: str, *, key: str,
                          with_checksum: bool, full: bool = False
                          ) -> tuple[Staged, Packed | None]:
        """`weights` staged as a delta against the last version of target `key` pushed this
        way, where every member holds it and the delta pays; else (or `full`) whole, and
        workers are asked to keep it (`rlfabric.trainer.deltas`). Over `WHOLE_OVER` whole,
        nothing kept (None)."""
        if transport not in DELTA_TRANSPORTS:
            raise ValueError(f"update_weights(delta=True) goes over {', '.join(DELTA_TRANSPORTS)}"
                             f", not {transport!r}")
        state = as_state_dict(weights)
        if transport in WHOLE_OVER:
            self.bases.forget(key)  # the workers let go of theirs as they load this
            return await self.stager.stage(version, state, transport, mark_stable=True,
                                           with_checksum=with_checksum, send_now=False), None
        new = await self.bases.pack(key, version, state)
        kept = {w: info.kept for w, info in self.watcher.members.items()}
        base = None if full else self.bases.base_for(key, new, kept)
        body = await self.bases.encode(base, new) if base is not None else None
        if base is None or body is None:
            staged = await self.stager.stage(version, state, transport, mark_stable=True,
                                             with_checksum=with_checksum, send_now=False)
        else:
            expected = await anyio.to_thread.run_sync(tensors.checksum, state) \
                if with_checksum else ""
            blob = torch.frombuffer(bytearray(body), dtype=torch.uint8)
            staged = await self.stager.stage(version, {"delta": blob}, transport,
                                             mark_stable=True, with_checksum=False,
                                             send_now=False)
            staged.digest, staged.expected_checksum = new.digest, expected
            staged.delta = DeltaOf(base=base.digest, tensors=new.metas)
        staged.keep = True
        return staged, new

    async def push(self, staged: Staged, *, target: Target | None, policy: QuorumPolicy,
                   verify: Verify, reset_prefix_cache: bool = True) -> FanoutReport:
        deadline = time.time() + policy.timeout
        adapter = target.name if isinstance(target, Adapter) else ""
        run = self.pushed.run
        name = base_policy(run, staged.version, staged.digest)
        try:
            if isinstance(staged.transport, Collective):
                group = await self._fresh_group(policy)
                staged.transport = msgspec.structs.replace(staged.transport,
                                                           group_epoch=group.group_epoch)
                cmd = staged.command(new_cmd_id(), target=target, deadline=deadline, run=run,
                                     job=self.desired.job,
                                     reset_prefix_cache=reset_prefix_cache)
                rep = await self._push_collective(cmd, staged, group, policy)
                self._check(rep, staged, verify)
                if not adapter:
                    await self.desired.write(weight_version=staged.version, locator=None,
                                             policy=name)
            else:
                cmd = staged.command(new_cmd_id(), target=target, deadline=deadline, run=run,
                                     job=self.desired.job,
                                     reset_prefix_cache=reset_prefix_cache)
                # a worker joining during the update loads this version itself
                changes: dict[str, Any] = (
                    {"adapters": {**self.desired.state.adapters, adapter: cmd}} if adapter
                    else {"weight_version": staged.version, "locator": cmd, "policy": name})
                try:
                    async with self.desired.during(rollback=True, **changes):
                        rep = await self._broadcast_sending(cmd, staged, policy)
                        self._check(rep, staged, verify)
                except Exception as exc:
                    if cmd.delta is None or not delta_refused(exc):
                        with anyio.CancelScope(shield=True):
                            await self._take_back(adapter, cmd, exc)
                    raise
                if not staged.for_joiners:  # freed now: joiners wait for the next push
                    if not adapter:
                        await self.desired.write(weight_version=staged.version, locator=None,
                                                 policy=name)
                    await staged.release()
                    self._pushed(staged, target, cmd)
                    return rep
        except Exception:
            await staged.release()
            raise
        previous = self._current.get(adapter)
        if previous is not None and previous is not staged:
            await previous.release()  # the previous version is no longer anyone's to load
        self._current[adapter] = staged
        self._pushed(staged, target, cmd)
        return rep

    def _pushed(self, staged: Staged, target: Target | None, cmd: UpdateWeights) -> None:
        adapter = target if isinstance(target, Adapter) else None
        self.pushed.add(staged.version, staged.digest, adapter)
        name = adapter.name if adapter is not None else ""
        if isinstance(cmd.transport, Collective | CudaIpc) or not staged.for_joiners:
            self._sent.pop(name, None)
        else:
            self._sent[name] = cmd

    async def _take_back(self, adapter: str, failed: UpdateWeights, exc: Exception) -> None:
        """The push `failed` did not succeed: send the previous one again, so that the workers
        that applied `failed` go back to what the desired state names again; `exc`'s message
        then says where every worker is."""
        what = f"adapter {adapter!r} v{failed.version}" if adapter else f"v{failed.version}"
        failed_rep = getattr(exc, "report", None)
        if not isinstance(failed_rep, FanoutReport):
            failed_rep = None
        prev = self._sent.get(adapter)
        if prev is None:
            _amend(exc, f"{what} is not taken back (no earlier push of this client can be "
                   "sent again): workers that applied it take no requests until the next "
                   "push succeeds" + (f"; now {_where(failed_rep)}" if failed_rep else ""))
            return
        back = msgspec.structs.replace(prev, cmd_id=new_cmd_id(), seq=0, epoch=0,
                                       deadline=time.time() + TAKE_BACK_S)
        # every worker gets it (one that joined meanwhile loaded the failed version too);
        # the wait is for those known to have applied it, not for the missing
        applied = {w for w, a in (failed_rep.acks if failed_rep else {}).items()
                   if a.status == "ok" and a.weight_version == failed.version}
        whole = await self._whole(adapter, back) if back.delta is not None else None
        try:
            async with self.broadcaster.open(whole[0] if whole else back) as fo:
                rep = await fo.heard(applied, timeout=TAKE_BACK_S)
        except Exception as other:  # the bus itself: the workers find the desired state
            _amend(exc, f"taking {what} back failed too ({type(other).__name__}: {other}); "
                   "workers off the desired state go back to it on their own")
            return
        finally:
            if whole:
                await whole[1].release()
        _amend(exc, f"taken back to v{prev.version}" + (
            f": the fleet serves it again ({_where(rep)})" if applied else
            f" (none had applied v{failed.version}; now {_where(rep)})"))

    async def _whole(self, key: str, back: UpdateWeights
                     ) -> tuple[UpdateWeights, Staged] | None:
        """A delta push to send again, as its full version: the workers that applied the
        failed one hold no base for it (they keep what they load). The packed version kept to
        encode the next delta against is that version; None if it is not (nothing sent)."""
        packed = self.bases.packed(key)
        if packed is None or packed.digest != back.digest:
            return None
        staged = await self.stager.stage(back.version, tensors.unpack(packed.buf, packed.metas),
                                         name_of(back.transport), mark_stable=True,
                                         with_checksum=False)
        cmd = msgspec.structs.replace(staged.command(back.cmd_id, target=back.target,
                                                     deadline=back.deadline, run=back.run,
                                                     job=back.job,
                                                     reset_prefix_cache=back.reset_prefix_cache),
                                      keep=True)
        return cmd, staged

    async def forget_adapter(self, name: str) -> None:
        """After an unload: the adapter's staging is freed, joiners no longer load it."""
        staged = self._current.pop(name, None)
        if staged is not None:
            await staged.release()
        if name in self.desired.state.adapters:
            rest = {k: v for k, v in self.desired.state.adapters.items() if k != name}
            await self.desired.write(adapters=rest)

    async def _broadcast_sending(self, cmd: UpdateWeights, staged: Staged,
                                 policy: QuorumPolicy) -> FanoutReport:
        """The command, and beside it the chunks still unsent (workers read each one as it is
        stored); a failed send cancels the wait and is raised."""
        send, staged.unsent = staged.unsent, None
        if send is None:
            return await self.broadcaster.broadcast(cmd, policy)
        async with beside() as tg:
            tg.start_soon(send)
            return await self.broadcaster.broadcast(cmd, policy)

    def _check(self, rep: FanoutReport, staged: Staged, verify: Verify) -> None:
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
            return await _beside_rank0(fo, policy, group.broadcast, staged.flat)

    # ---- the collective group ----
    async def init_transport(self, backend: CollectiveBackend, *, master_addr: str,
                             master_port: int | None, timeout: float, policy: QuorumPolicy
                             ) -> FanoutReport:
        snap = self.watcher.snapshot()
        offsets, rank = rank_offsets(snap)
        # fresh after a failure too: an epoch is never reused
        epoch = max(self.desired.state.group_epoch, self._last_epoch) + 1
        self._last_epoch = epoch
        if self._group is not None:
            self._group.close()  # torn down, never reused
            self._group = None
        port = master_port or free_port(master_addr)
        group = CollectiveGroup(backend=backend, master_addr=master_addr, master_port=port,
                                rank=0, world_size=rank, group_epoch=epoch, timeout=timeout)
        await anyio.to_thread.run_sync(group.open_store)
        cmd = InitTransport(cmd_id=new_cmd_id(), backend=backend, group_epoch=epoch,
                            master_addr=master_addr, master_port=port, world_size=rank,
                            rank_offsets=offsets, deadline=time.time() + timeout)
        by_rank = {r: w for w, r in offsets.items()}
        refused = threading.Event()

        async def watch_refusals(fo: Fanout) -> None:
            await fo.failed("done")  # a worker that cannot join says so: stop waiting for it
            refused.set()

        async with self.broadcaster.open(cmd) as fo:
            try:
                async with beside(cancel_at_exit=True) as tg:
                    tg.start_soon(watch_refusals, fo)
                    await anyio.to_thread.run_sync(group.wait_joined, refused.is_set)
            except CollectiveTimeout as exc:
                group.close()
                rep = fo.report("done")
                # refused = answered with an error and never reached the store (a worker that
                # joined and then failed to connect is waiting on the missing, not refusing)
                refusers = [w for w in rep.failed if offsets.get(w) in exc.missing]
                if refusers:
                    why = "; ".join(f"{w} ({rep.acks[w].error_code}: "
                                    f"{rep.acks[w].error_message})" for w in refusers)
                    raise QuorumNotReached(
                        f"init_transport({backend}) epoch {epoch}: refused by {why}", rep
                    ) from exc
                workers = tuple(sorted({by_rank.get(r, f"rank{r}") for r in exc.missing}))
                raise TransportInitFailed(
                    f"init_transport({backend}) epoch {epoch}: {', '.join(workers)} did not "
                    f"join within {timeout}s (ranks {exc.missing}); others are released at "
                    "their deadline; check those workers, then init again",
                    missing_workers=workers, missing_ranks=tuple(exc.missing),
                    group_epoch=epoch) from exc
            rep = await _beside_rank0(fo, policy, group.connect)
        self._group, self._group_fingerprint = group, snap.fingerprint
        await self.desired.write(group_epoch=epoch)
        return rep

    async def _fresh_group(self, policy: QuorumPolicy) -> CollectiveGroup:
        """The current group, or a new one if there is none or membership moved since."""
        fp = self.watcher.snapshot().fingerprint
        if self._group is None or fp != self._group_fingerprint:
            backend: CollectiveBackend = "nccl" if self._group and \
                self._group.backend == "nccl" else "gloo"
            await self.init_transport(backend, master_addr="127.0.0.1", master_port=None,
                                      timeout=policy.timeout, policy=policy)
        assert self._group is not None  # init_transport set it or raised
        return self._group


def delta_refused(exc: Exception) -> bool:
    """Whether a push failed only because workers lack the base its delta applies to (the full
    weights are pushed then, instead of taking it back)."""
    rep = getattr(exc, "report", None)
    if not isinstance(rep, FanoutReport) or rep.missing:
        return False
    errors = [a for a in rep.acks.values() if a.status == "error"]
    return bool(errors) and all(a.error_code == ErrorCode.DELTA_BASE_MISSING for a in errors)


def _where(rep: FanoutReport) -> str:
    """Where each worker of `rep` is: the version it acked (and the error, if one)."""
    parts = [f"{w} v{rep.acks[w].weight_version}" for w in sorted(rep.ok)]
    parts += [f"{w} v{rep.acks[w].weight_version} ({rep.acks[w].error_code})"
              for w in sorted(rep.failed)]
    parts += [f"{w} no answer" for w in sorted(rep.missing)]
    return ", ".join(parts) or "no worker answered"


def _amend(exc: Exception, what: str) -> None:
    """Add `what` to the message of `exc` (raised on to the caller as it is)."""
    exc.args = (f"{exc.args[0] if exc.args else exc}; {what}", *exc.args[1:])


def rank_offsets(snap: MembershipSnapshot) -> tuple[dict[str, int], int]:
    """Rank 0 is the trainer; each worker's first rank follows the ranks (TP x PP) of the
    workers before it. Returns the offsets and the group's world size."""
    offsets, rank = {}, 1
    for m in snap.members:
        offsets[m.worker_id] = rank
        rank += max(1, m.ranks)
    return offsets, rank


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


async def _beside_rank0(fo: Fanout, policy: QuorumPolicy, blocking: Any, *args: Any
                        ) -> FanoutReport:
    """Run rank 0's side of a collective step (`blocking(*args)`, in a thread) while waiting
    for the workers' `done` acks; either's failure is raised as itself."""
    async with beside() as tg:
        tg.start_soon(anyio.to_thread.run_sync, blocking, *args)
        return await fo.wait("done", policy)
