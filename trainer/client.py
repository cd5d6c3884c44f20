"""`FabricClient`: what trainer code holds. A facade over three parts, each with one concern:
the rollout data plane (`RolloutPlane`), the desired-state writer (`DesiredStateWriter`) and
the weight push / verify / collective path (`WeightUpdates`); control commands go out through
the bus's `Broadcaster` with this client's default `QuorumPolicy`.

    async with FabricClient.connect("nats://127.0.0.1:4222", prefix="rl") as fabric:
        rep = await fabric.pause(mode="wait")
        async for res in fabric.generate(requests):
            ...
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import msgspec
from anyio.streams.memory import MemoryObjectSendStream

from rlfabric.bus import (
    Broadcaster,
    Bus,
    ConnectOptions,
    Limits,
    MembershipWatcher,
    QuorumPolicy,
    new_cmd_id,
)
from rlfabric.bus.control.member_events import MemberEvents
from rlfabric.bus.nats.provision import cluster_size, ensure_consumer, provision_job
from rlfabric.bus.rollouts.affinity import Affinity
from rlfabric.bus.rollouts.plane import RolloutPlane, in_groups
from rlfabric.bus.subjects import check_token
from rlfabric.concurrency.sync import beside
from rlfabric.schemas import (
    COLLECTIVE_BACKENDS,
    PAUSE_MODES,
    Adapter,
    CollectiveBackend,
    Command,
    Describe,
    DesiredState,
    FanoutReport,
    JobShare,
    MembershipSnapshot,
    Pause,
    PauseMode,
    ResetPrefixCache,
    Resume,
    RolloutReply,
    RolloutRequest,
    RolloutResult,
    Shutdown,
    Sleep,
    Target,
    UnloadAdapter,
    Wake,
)
from rlfabric.schemas.jobs import ENDED, SEPARATOR
from rlfabric.telemetry import instruments, spans
from rlfabric.trainer.continuation import continue_aborted
from rlfabric.trainer.desired import DesiredStateWriter
from rlfabric.trainer.errors import PoolOnly
from rlfabric.trainer.policies import PushedPolicies, adapters_of
from rlfabric.trainer.share import ShareFollower

#: samples a request message holds at least when what is queued is spread over the workers
MIN_SPREAD = 8
#: requests a request message holds at most
MAX_BATCH = 64
#: a job's request message holds at most this part of a worker's capacity: a worker that
#: serves several jobs frees room for another's message as one of them ends
JOB_PARTS = 4

if TYPE_CHECKING:  # the weight path imports torch: loaded on the first weight call
    from rlfabric.trainer.updates import Verify, WeightUpdates
    from rlfabric.transports import Staged


class FabricClient:
    def __init__(self, bus: Bus, client_id: str, policy: QuorumPolicy, *,
                 run: str | None = None, job: str = "") -> None:
        self.bus = bus
        #: the job this client acts for ("": the default job; `rlfabric.schemas.jobs`)
        self.job = check_token(job, "job") if job else ""
        self.client_id = check_token(client_id, "client id")
        self.policy = policy
        #: the run this client's pushes belong to: with the version and the weights' digest it
        #: names each policy pushed, so two runs' version 3 never pass for one another
        self.run = check_token(run or uuid.uuid4().hex[:12], "run id")
        #: the policies pushed: results are checked against them (`PolicyMismatch`)
        self.pushed = PushedPolicies(self.run, self.job)
        self.watcher = MembershipWatcher(bus)
        self.broadcaster = Broadcaster(bus, self.watcher, self.client_id)
        self.desired = DesiredStateWriter(bus, job=self.job)
        #: the job's weight and quota, as the pool's operator set them
        self.share = ShareFollower(bus, self.job)
        #: routes `generate(..., session=)` turns to their session's worker
        self.affinity = Affinity(bus, self.watcher)
        self.rollouts = RolloutPlane(bus, self.client_id, max_batch=self._batch_limit,
                                     affinity=self.affinity, job=self.job)
        self._updates: WeightUpdates | None = None
        #: bytes the last `update_weights(..., delta=True)` staged (the delta's, or the
        #: full weights' where they went)
        self.last_push_bytes = 0

    def _batch_limit(self, queued: int, first: RolloutRequest) -> int:
        """Requests per persisted message (a message goes to one worker): what is queued
        spread over every worker (16 requests to 2 idle workers: 2 messages of 8, not one
        that leaves a worker idle), or this client's fair share per worker of all it has
        outstanding (queued here or being served) where that is larger, up to the most room a
        worker last reported (the 16 that a client with 64 outstanding over 4 workers queues
        as results come back go as one message, to a worker that freed the room, not as two
        that each cost a pull, a store and an ack). Not below `MIN_SPREAD` samples a message (4
        one-sample requests to 4 workers go as one: a batching engine serves the 4 sequences
        together), and at most an equal part of the smallest worker's capacity no larger than
        `MAX_BATCH` (capacity 32: 32; 100: 50, so two messages fill a worker and none leaves
        lanes that only a smaller one could use). A whole capacity's worth queued together
        goes as one message: an engine that batches statically runs it as one batch, not as
        two halves that stay a batch apart."""
        if (one := self.share.per_message) is not None:
            return one
        members = self.watcher.members.values()
        if not members:
            return 8
        n = len(members)
        room = max(m.capacity - m.in_flight for m in members)  # as last reported
        fair = min(-(-max(queued, self.rollouts.outstanding) // n), room)
        share = max(-(-queued // n), fair, -(-MIN_SPREAD // max(1, first.sampling.n)))
        cap = max(1, min(m.capacity for m in members))
        parts = -(-cap // MAX_BATCH)  # messages a full worker holds, each at most MAX_BATCH
        if self.job:  # a worker shares its room between jobs a message at a time
            parts = max(parts, JOB_PARTS)
        return max(1, min(share, -(-cap // parts)))

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, url: str | ConnectOptions, *, prefix: str = "rl",
                      client_id: str | None = None, policy: QuorumPolicy | None = None,
                      limits: Limits | None = None, run: str | None = None, job: str = ""
                      ) -> AsyncIterator[FabricClient]:
        """Connect, provision the pool's streams, start watching membership and listening for
        this client's results. `policy` is the default `QuorumPolicy` of control calls. `run`
        names this training run (default: a fresh id per client): the weights it pushes are
        that run's, and once it pushed, its requests are served by that run's weights only.

        `job`: the job this client acts for on a pool shared by several (`rlfabric.schemas.jobs`):
        its requests, adapters (named within the job), pause and resume are that job's and
        leave other jobs' requests serving; base weights, sleep, wake and collective groups
        are the pool's and refused (`PoolOnly`). "" (default): the pool's own client."""
        async with Bus.connect(url, prefix=prefix, limits=limits) as bus, \
                beside(cancel_at_exit=True) as tg:
            if job:  # its results' stream
                await provision_job(bus.js, bus.subjects, check_token(job, "job"), bus.limits,
                                    servers=cluster_size(getattr(bus.nc, "_server_info", {})))
            client = cls(bus, client_id or f"c{uuid.uuid4().hex[:12]}", policy or QuorumPolicy(),
                         run=run, job=job)
            await tg.start(client.watcher.run)
            await tg.start(MemberEvents(bus, client.watcher, client.client_id).run)
            await tg.start(client.share.run)
            await tg.start(client.rollouts.listen)
            await client.desired.load()
            try:
                yield client
            finally:
                if client._updates is not None:
                    await client._updates.close()

    @property
    def duplicates_dropped(self) -> int:
        """Results dropped because their (request, sample) had already been yielded."""
        return self.rollouts.duplicates_dropped

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

    async def pause(self, mode: PauseMode = "wait", *, policy: QuorumPolicy | None = None
                    ) -> FanoutReport:
        """Pause every worker. `wait`: acks once its in-flight requests finished. `abort`:
        in-flight samples end now and come back with `finish_reason="abort"` (continue them
        with `continue_aborted`). `keep`: in-flight samples freeze and resume after `resume()`,
        under the weights loaded by then. Queued requests wait in the stream either way.

        A job's client pauses its job's requests only (`rlfabric.worker.jobs`): `wait` acks
        once they finished, `abort` ends them now and samples them again after `resume()`
        (no partial results), `keep` holds new ones and lets those in flight run on (on the
        version each started under)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause(mode={mode!r}): use one of {', '.join(PAUSE_MODES)}")
        cmd = Pause(cmd_id=new_cmd_id(), mode=mode, job=self.job)
        with spans.span("pause", attributes={"rlfabric.pause.mode": mode}):
            async with self.desired.during(rollback=False, paused=True, pause_mode=mode):
                return await self.broadcast(cmd, policy)

    async def resume(self, *, policy: QuorumPolicy | None = None) -> FanoutReport:
        with spans.span("resume"):
            async with self.desired.during(rollback=False, paused=False, pause_mode=""):
                return await self.broadcast(Resume(cmd_id=new_cmd_id(), job=self.job), policy)

    async def describe(self, *, policy: QuorumPolicy | None = None) -> FanoutReport:
        return await self.broadcast(Describe(cmd_id=new_cmd_id()), policy)

    async def reset_prefix_cache(self, *, policy: QuorumPolicy | None = None) -> FanoutReport:
        self._pool_only("reset_prefix_cache()")
        return await self.broadcast(ResetPrefixCache(cmd_id=new_cmd_id()), policy)

    async def sleep(self, level: int = 1, *, policy: QuorumPolicy | None = None) -> FanoutReport:
        self._pool_only("sleep()")
        return await self.broadcast(Sleep(cmd_id=new_cmd_id(), level=level), policy)

    async def wake(self, tags: Iterable[str] = (), *, policy: QuorumPolicy | None = None
                   ) -> FanoutReport:
        self._pool_only("wake()")
        return await self.broadcast(Wake(cmd_id=new_cmd_id(), tags=tuple(tags)), policy)

    async def end_job(self, job: str, *, policy: QuorumPolicy | None = None) -> FanoutReport:
        """End job `job` on the pool (the pool's operator only): its requests, queued or
        running, are answered `job_deleted` from now on, its adapters dropped on every worker
        (and on every worker that joins later); other jobs serve on."""
        self._pool_only(f"end_job({job!r})")
        await self.bus.state.put(DesiredState(paused=True, pause_mode=ENDED),
                                 job=check_token(job, "job"))
        return await self.broadcast(Shutdown(cmd_id=new_cmd_id(), job=job), policy)

    async def drain(self, worker_id: str, *, move: bool = True,
                    policy: QuorumPolicy | None = None) -> FanoutReport:
        """Worker `worker_id` takes no more requests and leaves (the pool's operator only).
        `move`: its unfinished samples go back to their clients at once with the tokens
        sampled so far, and go on on other workers from there (`RolloutRequest.migration`);
        else it finishes them first. The other workers ack and serve on."""
        self._pool_only(f"drain({worker_id!r})")
        return await self.broadcast(Shutdown(cmd_id=new_cmd_id(), worker=worker_id, move=move),
                                    policy)

    async def set_share(self, job: str, share: JobShare) -> None:
        """Give job `job` ("" the pool's own) its weight and quota (the pool's operator
        only): workers share their tokens between the jobs with work in proportion to their
        weights (they read it within a second); its consumer holds no more than
        `max_in_flight` of its messages unacked from now on (its clients then send one request
        a message, within a second)."""
        self._pool_only(f"set_share({job!r})")
        if share.weight <= 0 or share.max_in_flight < 0:
            raise ValueError(f"job {job!r}: a weight must be > 0 and a quota >= 0 (0: none), "
                             f"not {share.weight} and {share.max_in_flight}")
        job = check_token(job, "job") if job else ""
        await self.bus.state.put_share(job, share)
        s = self.bus.subjects  # the job's consumer waits for an ack as the pool's does
        pool = await self.bus.js.consumer_info(s.rollout_stream, s.rollout_consumer)
        await ensure_consumer(self.bus.js, s, job, max_in_flight=share.max_in_flight,
                              ack_wait=pool.config.ack_wait or self.bus.limits.rollout_ack_wait)

    def _pool_only(self, what: str) -> None:
        if self.job:
            raise PoolOnly(f"{what}: this client acts for job {self.job!r}, and {what} acts "
                           "on the whole pool (every job's requests): call it from a client "
                           "connected without job=")

    # ---- weights ----
    @property
    def updates(self) -> WeightUpdates:
        if self._updates is None:
            from rlfabric.trainer.updates import WeightUpdates

            self._updates = WeightUpdates(self.broadcaster, self.watcher, self.desired,
                                          self.pushed)
        return self._updates

    async def stage_weights(self, version: int, weights: Any, transport: str = "shm", *,
                            mark_stable: bool = True, with_checksum: bool = True) -> Staged:
        """Pack `weights` (a module or state dict) for `transport` without sending anything.
        `push_weights()` sends it; `update_weights()` does both. `with_checksum` computes the
        checksum `verify="sender"` compares against."""
        return await self.updates.stage(version, weights, transport, mark_stable=mark_stable,
                                        with_checksum=with_checksum)

    async def update_weights(self, version: int, state_dict: Any = None, *, module: Any = None,
                             adapter: Adapter | None = None, transport: str = "shm",
                             target: Target | None = None, policy: QuorumPolicy | None = None,
                             verify: Verify = "sender", reset_prefix_cache: bool = True,
                             delta: bool = False) -> FanoutReport:
        """Make every worker serve `version` of these weights; returns once the quorum acked
        `done`. Each worker verifies the payload digest, swaps atomically (a failure keeps
        the old version and acks an error: `QuorumNotReached` names the worker and why) and
        reports its weights checksum. `verify="sender"` requires every checksum to equal the
        one of the state dict sent; `"workers"` only that they agree (use it when workers
        store weights in another dtype or layout); `WeightsMismatch` names the deviants.

        `adapter`: the state dict is version `version` of that LoRA adapter (its A and B
        matrices in PEFT's layout), loaded beside the versions workers hold; requests naming
        it (`RolloutRequest.adapter`) are served under it from then on. Its versions are this
        run's (`run`): a worker drops another run's versions of the same name first. Set
        `Adapter.base` to the base policy it was trained on: a worker serving another base
        refuses it (`base_mismatch`).

        A failed push is taken back (the fleet serves the previous version again; the error
        says where each worker is). `reset_prefix_cache=False` keeps engines' prefix caches:
        no engine serves a block computed under other weights either way (vLLM salts its
        cache per load), it only keeps memory warm.

        `delta=True` (filesystem, nats): where every worker acked the last version pushed this
        way, only what changed since goes (`rlfabric.trainer.deltas`); each worker makes the
        full version from the one it kept and verifies its digest as for any push. A worker
        that lacks it refuses, and the full weights go at once; so does a version whose delta
        would not pay. Over shm the weights go whole (a delta costs more than shm's one copy).
        `last_push_bytes` says what the push staged."""
        if adapter is not None:
            target = adapter
        if isinstance(target, Adapter) and SEPARATOR in target.name:
            raise ValueError(f"adapter name {target.name!r}: an adapter name may not hold "
                             f"{SEPARATOR!r} (it separates a job from its adapters' names)")
        if not isinstance(target, Adapter):
            self._pool_only(f"update_weights(version={version}) of base weights")
        weights = module if module is not None else state_dict
        if weights is None:
            raise TypeError("update_weights needs state_dict= or module=")
        t0, m = time.monotonic(), instruments.current
        with spans.span("update_weights", attributes={spans.WEIGHT_VERSION: version,
                                                      "rlfabric.transport": transport}):
            if delta:
                rep = await self._push_delta(version, weights, transport, target, policy,
                                             verify, reset_prefix_cache)
            else:
                rep = await self._push_full(version, weights, transport, target, policy,
                                            verify, reset_prefix_cache)
        kind = {"transport": transport, "delta": str(delta).lower()}
        m.push_size.record(self.last_push_bytes, kind)
        m.push_duration.record(time.monotonic() - t0, kind)
        return rep

    async def _push_full(self, version: int, weights: Any, transport: str,
                         target: Target | None, policy: QuorumPolicy | None, verify: Verify,
                         reset_prefix_cache: bool) -> FanoutReport:
        # nats: the chunks are sent while the command is out (workers read as they land)
        with spans.span("stage_weights"):
            staged = await self.updates.stage(version, weights, transport, mark_stable=True,
                                              with_checksum=verify == "sender",
                                              send_now=False)
        self.last_push_bytes = staged.nbytes
        return await self.push_weights(staged, target=target, policy=policy, verify=verify,
                                       reset_prefix_cache=reset_prefix_cache)

    async def _push_delta(self, version: int, weights: Any, transport: str,
                          target: Target | None, policy: QuorumPolicy | None, verify: Verify,
                          reset_prefix_cache: bool) -> FanoutReport:
        from rlfabric.trainer.updates import delta_refused

        key = target.name if isinstance(target, Adapter) else ""
        staged, packed = await self.updates.stage_delta(version, weights, transport, key=key,
                                                        with_checksum=verify == "sender")
        self.last_push_bytes = staged.nbytes
        try:
            rep = await self.push_weights(staged, target=target, policy=policy, verify=verify,
                                          reset_prefix_cache=reset_prefix_cache)
        except Exception as exc:
            if staged.delta is None or not delta_refused(exc):
                raise
            # some worker lost the base (restarted, say): everyone gets the full weights
            staged, packed = await self.updates.stage_delta(
                version, weights, transport, key=key, with_checksum=verify == "sender",
                full=True)
            self.last_push_bytes += staged.nbytes
            rep = await self.push_weights(staged, target=target, policy=policy, verify=verify,
                                          reset_prefix_cache=reset_prefix_cache)
        if packed is not None:
            self.updates.bases.keep(key, packed, set(rep.ok))
        return rep

    async def unload_adapter(self, name: str, *, policy: QuorumPolicy | None = None
                             ) -> FanoutReport:
        """Drop every version of adapter `name` on every worker (requests running under it
        finish; later ones fail `adapter_unknown`); joiners no longer load it."""
        rep = await self.broadcast(UnloadAdapter(cmd_id=new_cmd_id(), name=name, job=self.job),
                                   policy)
        await self.updates.forget_adapter(name)
        return rep

    async def push_weights(self, staged: Staged, *, target: Target | None = None,
                           policy: QuorumPolicy | None = None, verify: Verify = "sender",
                           reset_prefix_cache: bool = True) -> FanoutReport:
        """Send weights staged by `stage_weights` (see `update_weights`)."""
        if not isinstance(target, Adapter):
            self._pool_only("push_weights() of base weights")
        return await self.updates.push(staged, target=target, policy=policy or self.policy,
                                       verify=verify, reset_prefix_cache=reset_prefix_cache)

    async def init_transport(self, backend: CollectiveBackend = "gloo", *,
                             master_addr: str = "127.0.0.1", master_port: int | None = None,
                             timeout: float = 60.0, policy: QuorumPolicy | None = None
                             ) -> FanoutReport:
        """Form a fresh collective group: this client is rank 0, each worker gets the ranks
        of its TP x PP from the membership snapshot, a new `group_epoch` names it. Fails
        within `timeout` with `TransportInitFailed` naming the workers that did not join."""
        self._pool_only("init_transport()")
        if backend not in COLLECTIVE_BACKENDS:
            raise ValueError(f"init_transport(backend={backend!r}): use one of "
                             f"{', '.join(COLLECTIVE_BACKENDS)}")
        policy = policy or QuorumPolicy(required=self.policy.required, timeout=timeout,
                                        on_membership_change=self.policy.on_membership_change)
        return await self.updates.init_transport(backend, master_addr=master_addr,
                                                 master_port=master_port, timeout=timeout,
                                                 policy=policy)

    # ---- data plane ----
    async def submit(self, requests: Iterable[RolloutRequest],
                     sink: MemoryObjectSendStream[RolloutReply], *,
                     timeout: float | None = None) -> list[RolloutRequest]:
        """Publish requests to the workers' queue; their results go to `sink`. Returns the
        requests as sent (with this client's id and deadlines filled in). Results reach `sink`
        unchecked: `check_result` them before training on them."""
        return await self.rollouts.submit(map(self.pushed.own, requests), sink,
                                          timeout=timeout)

    def check_result(self, result: RolloutReply, adapter: str = "") -> None:
        """`PolicyMismatch` if `result` (of a request for `adapter`, "" for the base weights)
        holds tokens of a policy this client did not push (once it pushed for that target).
        Its tokens count in the staleness metric, as `generate`'s results do (those are
        checked already)."""
        if type(result) is RolloutResult:
            self.pushed.check(result, adapter)
            self._took(result, adapter, instruments.current.staleness.record)

    def _took(self, r: RolloutResult, adapter: str, stale: Callable[..., None]) -> None:
        """Count `r`'s tokens in the staleness metric, each by how many versions it is behind
        the last push of its policy."""
        state = self.desired.state
        cmd = state.adapters.get(adapter) if adapter else None
        last = cmd.version if cmd is not None else -1 if adapter else state.weight_version
        who = {spans.JOB: self.job} if self.job else None
        for sp in r.version_spans:
            stale(max(0, last - sp.version), who, sp.end - sp.start)

    async def _checked(self, requests: list[RolloutRequest],
                       replies: AsyncIterator[RolloutReply]) -> AsyncIterator[RolloutReply]:
        adapter = adapters_of(requests)
        check = self.pushed.check
        stale = instruments.current.staleness.record
        # closed with this one: a caller that stops early gives its requests up at once
        async with contextlib.aclosing(cast(AsyncGenerator[RolloutReply, None], replies)):
            async for r in replies:
                if type(r) is RolloutResult:
                    name = adapter.get(r.request_id, "")
                    check(r, name)
                    self._took(r, name, stale)
                yield r

    def generate(self, requests: Iterable[RolloutRequest], *, timeout: float | None = None,
                 session: str | None = None) -> AsyncIterator[RolloutReply]:
        """Submit `requests` and yield each sample's `RolloutResult` (or a `RolloutError`) as
        it arrives, exactly once per (request_id, sample_index), whichever worker served it
        and however often it was redelivered. `timeout` sets a deadline per request; samples
        still missing at their deadline are yielded as `RolloutError`s, code `deadline_exceeded`.
        `session`: the requests are the next turn of this agent session: they go to the
        worker that served its last turn while it lives and has room (its prefix is in that
        worker's cache), else to the least-loaded worker; the binding is shared by every
        client and gateway of the job (`rlfabric.bus.rollouts.affinity`).

        Policies: once this client pushed base weights (or an adapter), its requests for them
        are served by this run's weights only (`RolloutRequest.run`), and a result holding
        tokens of any policy it did not push raises `PolicyMismatch` naming the worker and
        both policies.
        """
        reqs = [self.pushed.own(r) for r in requests]
        return self._checked(reqs, self.rollouts.generate(reqs, timeout=timeout,
                                                          session=session))

    def generate_groups(self, requests: Iterable[RolloutRequest], *,
                        timeout: float | None = None) -> AsyncIterator[list[RolloutReply]]:
        """Like `generate`, but yield each request's n samples together, in sample order."""
        reqs = list(requests)
        return in_groups(reqs, self.generate(reqs, timeout=timeout))

    def continue_aborted(self, requests: Iterable[RolloutRequest],
                         results: Iterable[RolloutReply], *,
                         timeout: float | None = None) -> AsyncIterator[RolloutReply]:
        """Yield `results` with every sample an abort pause cut short continued from where it
        stopped and merged back into one result (its spans show every version involved)."""
        reqs = [self.pushed.own(r) for r in requests]
        return self._checked(reqs, continue_aborted(self.rollouts, reqs, results,
                                                    timeout=timeout))
