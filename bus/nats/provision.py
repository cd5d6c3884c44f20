"""Idempotent creation of the streams and KV buckets of a job (DESIGN section 3).

Every process calls `provision()` at start; the first creates, the rest find what exists and
keep its settings (retention, storage, TTLs: the first process of a job decides). Only a
stream listening on the wrong subjects is repaired; one that cannot be raises
`ProvisioningError` naming it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

import anyio
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, NotFoundError
from nats.js.kv import KeyValue

from rlfabric.bus.errors import (
    JS_CONSUMER_ALREADY_EXISTS,
    JS_CONSUMER_NAME_IN_USE,
    JS_NO_SUITABLE_PEERS,
    JS_STREAM_NAME_IN_USE,
    TRANSIENT,
    ProvisioningError,
    storage_refused,
)
from rlfabric.bus.subjects import Subjects

T = TypeVar("T")
HOUR = 3600.0
MIB = 1024 * 1024
#: seconds provisioning waits for a cluster to place a stream's copies: a cluster that just
#: formed routes and elected its metadata leader may not know every JetStream peer yet
PLACEMENT_WITHIN = 20.0
log = logging.getLogger("rlfabric.bus")


@dataclass(kw_only=True, slots=True)
class Limits:
    """Retention knobs. `member_ttl`: seconds a worker may go unheard (it beats on core NATS
    every quarter of it) before a watcher pings it: one whose connection is gone then counts
    as left at once, one that does not answer after another `member_ttl`.
    `member_key_ttl`: seconds a worker's key lives in the members bucket unless written again
    (at every change of its state, and every third of it). The first process to create a job
    fixes both for every process of it.

    Every stream and bucket has a byte cap, which JetStream sets aside for it when it is
    created (the `*_max_bytes`, about 1 GiB a job in all, plus the weights stream's): a full
    one refuses its own writes and never takes the room of another, so a weights push that
    does not fit can fail, never a heartbeat, a command or a result. A server refuses to
    create a job whose caps do not fit in what it has left to set aside (`ProvisioningError`
    says which)."""

    member_ttl: float = 5.0
    member_key_ttl: float = 60.0
    control_max_age: float = 24 * HOUR
    #: commands (small); the oldest go first past it
    control_max_bytes: int = 64 * MIB
    results_max_age: float = 24 * HOUR
    #: results not yet read stay until it is full; the oldest go first past it
    results_max_bytes: int = 512 * MIB
    #: requests queued for workers; a submit past it is refused (`storage_full`)
    rollout_max_bytes: int = 128 * MIB
    members_max_bytes: int = 64 * MIB
    state_max_bytes: int = 64 * MIB
    sessions_max_bytes: int = 256 * MIB
    #: the fleet's events (`rlfabric events`): the oldest go first past either
    events_max_age: float = 7 * 24 * HOUR
    events_max_bytes: int = 16 * MIB
    weights_max_age: float = 2 * HOUR
    #: the weights stream's cap. None: set aside as a push needs it (the versions it holds and
    #: the one pushed), starting from WEIGHTS_START; a push JetStream cannot set that aside for
    #: is refused before it is sent. A number: fixed; a push past it is refused
    weights_max_bytes: int | None = None
    #: how long agent sessions' records (and so their trajectories) stay readable
    sessions_max_age: float = 24 * HOUR
    #: how long a session stays bound to the worker of its last turn without a turn
    affinity_ttl: float = HOUR
    affinity_max_bytes: int = 16 * MIB
    duplicate_window: float = 120.0
    #: seconds a fetched rollout request stays with its worker without an ack or in-progress
    #: signal; after it (a crashed worker) the request goes to another worker
    rollout_ack_wait: float = 15.0
    #: where the nats weight transport keeps chunks: "file" (any model size) or "memory"
    #: (faster; the server must hold one model version in RAM)
    weights_storage: str = "file"
    #: copies of every stream and bucket in a cluster; None: min(3, servers in the cluster),
    #: 1 on a single server (`cluster_size`)
    replicas: int | None = None

    @classmethod
    def for_store(cls, budget: int) -> Limits:
        """Caps for a job on a store of `budget` bytes (`--store-budget`): half of it split
        across the streams and buckets as the defaults split theirs (1 MiB at least each), the
        other half left for the weights stream, which sets aside what each push needs."""
        d = cls()
        total = sum(getattr(d, n) for n in _CAPS)
        caps = {n: max(MIB, getattr(d, n) * (budget // 2) // total) for n in _CAPS}
        if sum(caps.values()) > budget:
            raise ValueError(f"a store budget of {budget / MIB:.0f} MiB is too small for a job: "
                             f"give it at least {2 * len(_CAPS)} MiB")
        return cls(**caps)


#: the caps `Limits.for_store` splits a budget across
_CAPS = ("control_max_bytes", "results_max_bytes", "rollout_max_bytes", "members_max_bytes",
         "state_max_bytes", "sessions_max_bytes", "affinity_max_bytes", "events_max_bytes")


@dataclass(slots=True)
class Buckets:
    members: KeyValue
    state: KeyValue
    #: the job's `Limits.member_ttl` and `member_key_ttl` as the first process to create the
    #: members bucket chose them (read back from the server)
    member_ttl: float
    member_key_ttl: float
    #: session -> worker bindings (None: a job provisioned before it, read by a read-only tool)
    affinity: KeyValue | None = None


def cluster_size(server_info: dict[str, object]) -> int:
    """Servers in the cluster the client is connected to (1: not clustered), from the
    server's INFO (`connect_urls` lists every node's client URL)."""
    if not server_info.get("cluster"):
        return 1
    urls = server_info.get("connect_urls")
    return max(1, len(set(urls))) if isinstance(urls, list) else 1


def replicas_for(lim: Limits, servers: int) -> int:
    return lim.replicas if lim.replicas is not None else max(1, min(3, servers))


#: the weights stream's first cap where `Limits.weights_max_bytes` leaves it to pushes
WEIGHTS_START = 16 * MIB


def stream_configs(s: Subjects, lim: Limits, replicas: int = 1) -> list[StreamConfig]:
    return [
        StreamConfig(
            name=s.rollout_stream,
            subjects=[s.rollout_request, f"{s.rollout_request}.*"],  # the pool's, each job's
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=lim.duplicate_window,
            max_bytes=lim.rollout_max_bytes,
            discard=DiscardPolicy.NEW,  # a queued request is never dropped for a newer one
            num_replicas=replicas,
        ),
        StreamConfig(
            name=s.results_stream,
            subjects=[s.rollout_results_all],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=lim.results_max_age,
            max_bytes=lim.results_max_bytes,
            discard=DiscardPolicy.OLD,
            num_replicas=replicas,
        ),
        StreamConfig(
            name=s.control_stream,
            subjects=[s.control_all],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=lim.control_max_age,
            max_bytes=lim.control_max_bytes,
            discard=DiscardPolicy.OLD,
            duplicate_window=lim.duplicate_window,
            num_replicas=replicas,
        ),
        StreamConfig(
            name=s.sessions_stream,
            subjects=[s.sessions_all],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=lim.sessions_max_age,
            max_bytes=lim.sessions_max_bytes,
            discard=DiscardPolicy.OLD,
            duplicate_window=lim.duplicate_window,
            # a gateway reads a session's records by subject, one direct get each
            allow_direct=True,
            num_replicas=replicas,
        ),
        _events_stream(s, lim, replicas),
        StreamConfig(
            name=s.weights_stream,
            subjects=[s.weights_all],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.MEMORY if lim.weights_storage == "memory" else StorageType.FILE,
            max_age=lim.weights_max_age,
            max_bytes=lim.weights_max_bytes or WEIGHTS_START,
            # a push past the cap fails; it never drops the chunks of the version in use
            discard=DiscardPolicy.NEW,
            num_replicas=replicas,
        ),
    ]


def _events_stream(s: Subjects, lim: Limits, replicas: int) -> StreamConfig:
    return StreamConfig(
        name=s.events_stream,
        subjects=s.events_kept,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=lim.events_max_age,
        max_bytes=lim.events_max_bytes,
        discard=DiscardPolicy.OLD,  # capped: the oldest events go first
        duplicate_window=lim.duplicate_window,  # a member event several clients send: once
        num_replicas=replicas,
    )


async def _ensure_stream(js: JetStreamContext, cfg: StreamConfig) -> None:
    """Create the stream, or leave an existing one as its creator configured it (limits,
    storage: the first process of a job decides), repairing only its subjects, which routing
    depends on."""
    assert cfg.name is not None  # stream_configs names every stream
    try:
        info = await js.stream_info(cfg.name)
    except NotFoundError:
        try:
            await _set_aside(f"stream {cfg.name}", cfg.max_bytes, js.add_stream(cfg))
            return
        except BadRequestError as exc:
            if exc.err_code != JS_STREAM_NAME_IN_USE:
                raise
            info = await js.stream_info(cfg.name)  # created concurrently by another process
    if sorted(info.config.subjects or []) == sorted(cfg.subjects or []):
        return
    try:
        await js.update_stream(replace(info.config, subjects=cfg.subjects))
    except APIError as exc:
        raise ProvisioningError(
            f"stream {cfg.name} listens on {info.config.subjects}, not {cfg.subjects}, and "
            f"cannot be changed ({exc.description}); delete it or use another --prefix"
        ) from exc


async def _set_aside(what: str, max_bytes: int | None, create: Awaitable[T]) -> T:
    """`create`, its refusal for want of room said as what to do."""
    try:
        return await create
    except APIError as exc:
        if not storage_refused(exc):
            raise
        raise ProvisioningError(
            f"JetStream cannot set aside {(max_bytes or 0) / MIB:.0f} MiB for {what} "
            f"({exc.description}): the streams already on the server have its store set "
            "aside. Delete finished jobs (`rlfabric ctl --prefix P delete-job`), raise the "
            "server's max_file_store (or the account's max_storage), or lower the caps in "
            "Limits (*_max_bytes)") from exc


async def _ensure_bucket(js: JetStreamContext, cfg: KeyValueConfig) -> KeyValue:
    """The bucket as the job has it, else created as `cfg` says: a process joining a job takes
    the job's settings, and asks the store for nothing (a job sized for a small store is
    joined by processes started with the defaults)."""
    try:
        return await js.key_value(cfg.bucket)
    except NotFoundError:
        pass
    try:
        return await _set_aside(f"KV bucket {cfg.bucket}", cfg.max_bytes,
                                js.create_key_value(cfg))
    except BadRequestError as exc:
        if exc.err_code != JS_STREAM_NAME_IN_USE:  # a bucket is a stream underneath
            raise
        try:
            return await js.key_value(cfg.bucket)
        except NotFoundError as exc:
            raise ProvisioningError(f"KV bucket {cfg.bucket} could not be created") from exc


#: a consumer's `max_ack_pending` where its job has no quota
NO_QUOTA = 100_000


async def ensure_consumer(js: JetStreamContext, s: Subjects, job: str = "", *,
                          ack_wait: float, max_in_flight: int = 0) -> None:
    """Job `job`'s durable consumer (`Subjects.consumer_of`), which every worker pulls that
    job's requests from: created, or set to take only that job's subject and to hold at most
    `max_in_flight` messages unacked (0: no quota). An existing one keeps its `ack_wait`."""
    name, subject = s.consumer_of(job), s.rollout_request_of(job)
    pending = max_in_flight or NO_QUOTA
    try:
        info = await js.consumer_info(s.rollout_stream, name)
        if info.config.filter_subject == subject and info.config.max_ack_pending == pending:
            return
        # made before each job had a consumer (it took every job's), or the quota changed
        await js.add_consumer(s.rollout_stream, replace(
            info.config, filter_subject=subject, max_ack_pending=pending))
        return
    except NotFoundError:
        pass
    try:
        await js.add_consumer(s.rollout_stream, ConsumerConfig(
            durable_name=name, ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait, max_ack_pending=pending, max_waiting=4096,
            filter_subject=subject))
    except BadRequestError as exc:
        if exc.err_code not in (JS_CONSUMER_NAME_IN_USE, JS_CONSUMER_ALREADY_EXISTS):
            raise  # anything else than "created concurrently by another process"


async def bind_buckets(js: JetStreamContext, s: Subjects) -> Buckets | None:
    """The job's buckets if they exist, without creating anything (for read-only tools)."""
    try:
        members = await js.key_value(s.members_bucket)
        ttl, key_ttl = await _member_ttls(members, Limits())
        return Buckets(members=members, state=await js.key_value(s.state_bucket),
                       member_ttl=ttl, member_key_ttl=key_ttl)
    except NotFoundError:
        return None


def _unplaced(exc: Exception) -> bool:
    """A create the cluster could not place yet: too few JetStream peers known (a node still
    joining, or down), or no metadata leader for the moment."""
    if isinstance(exc, BadRequestError):
        return exc.err_code == JS_NO_SUITABLE_PEERS
    return isinstance(exc, TRANSIENT)


async def _placed(what: str, replicas: int, create: Callable[[], Awaitable[T]], *,
                  within: float) -> T:
    """`create()`, retried while the cluster cannot place `replicas` copies yet, for up to
    `within` seconds. One copy (a single server) is not retried: its errors say what is
    wrong at once."""
    if replicas == 1:
        return await create()
    deadline = time.monotonic() + within
    delay = 0.1
    while True:
        try:
            return await create()
        except Exception as exc:  # anything but a placement error is re-raised below
            if not _unplaced(exc):
                raise
            if time.monotonic() + delay > deadline:
                raise ProvisioningError(
                    f"{what} could not be created with {replicas} copies within {within:.0f}s "
                    f"({type(exc).__name__}: {exc}): the cluster has fewer JetStream servers "
                    "up than copies asked for. Start the missing nodes, or set "
                    "Limits(replicas=...) to the servers there are") from exc
            log.info("%s: the cluster cannot place %d copies yet (%s); retrying",
                     what, replicas, exc)
        await anyio.sleep(delay)  # nothing to await: the server says nothing when a peer joins
        delay = min(1.0, delay * 2)


async def provision(js: JetStreamContext, s: Subjects, lim: Limits | None = None, *,
                    servers: int = 1, within: float = PLACEMENT_WITHIN) -> Buckets:
    """Create (or find) every stream and bucket of the job, with `replicas_for(lim, servers)`
    copies each; return the two KV buckets. On a cluster still forming (a node not yet a
    JetStream peer) each create is retried for up to `within` seconds, then raises
    `ProvisioningError`."""
    lim = lim or Limits()
    replicas = replicas_for(lim, servers)
    for cfg in stream_configs(s, lim, replicas):
        await _placed(f"stream {cfg.name}", replicas, partial(_ensure_stream, js, cfg),
                      within=within)
    await _placed(f"consumer {s.rollout_consumer}", replicas,
                  lambda: ensure_consumer(js, s, ack_wait=lim.rollout_ack_wait), within=within)
    members = await _placed(f"KV bucket {s.members_bucket}", replicas, lambda: _ensure_bucket(
        js,
        KeyValueConfig(
            bucket=s.members_bucket,
            description=f"{_MEMBER_TTL}{lim.member_ttl:g}",
            history=1,
            ttl=lim.member_key_ttl,
            # A delete marker on expiry, so watchers see a silent worker leave.
            limit_marker_ttl=max(1.0, lim.member_ttl),
            max_bytes=lim.members_max_bytes,
            storage=StorageType.FILE,
            replicas=replicas,
        ),
    ), within=within)
    state = await _placed(f"KV bucket {s.state_bucket}", replicas, lambda: _ensure_bucket(
        js, KeyValueConfig(bucket=s.state_bucket, history=16, storage=StorageType.FILE,
                           max_bytes=lim.state_max_bytes, replicas=replicas)
    ), within=within)
    affinity = await _placed(f"KV bucket {s.affinity_bucket}", replicas, lambda: _ensure_bucket(
        js, KeyValueConfig(bucket=s.affinity_bucket, history=1, ttl=lim.affinity_ttl,
                           max_bytes=lim.affinity_max_bytes, storage=StorageType.FILE,
                           replicas=replicas)
    ), within=within)
    ttl, key_ttl = await _member_ttls(members, lim)
    return Buckets(members=members, state=state,
                   member_ttl=ttl, member_key_ttl=key_ttl, affinity=affinity)


async def provision_job(js: JetStreamContext, s: Subjects, job: str, lim: Limits | None = None,
                        *, servers: int = 1, within: float = PLACEMENT_WITHIN) -> None:
    """Create (or find) job `job`'s own stream: its clients' results (`results_stream_of`),
    with the pool's results limits."""
    lim = lim or Limits()
    replicas = replicas_for(lim, servers)
    cfg = next(c for c in stream_configs(s, lim, replicas) if c.name == s.results_stream)
    cfg = replace(cfg, name=s.results_stream_of(job), subjects=[s.rollout_results_of(job)])
    await _placed(f"stream {cfg.name}", replicas, partial(_ensure_stream, js, cfg),
                  within=within)


#: the members bucket's description: the job's `member_ttl` follows it
_MEMBER_TTL = "rlfabric members; member_ttl="


async def _member_ttls(kv: KeyValue, lim: Limits) -> tuple[float, float]:
    """The job's member TTLs as its creator set them (a bucket from before `member_key_ttl`
    has only its TTL: `lim.member_ttl` for the rest)."""
    status = await kv.status()
    note = status.stream_info.config.description or ""
    try:
        member_ttl = float(note.removeprefix(_MEMBER_TTL)) if note.startswith(_MEMBER_TTL) \
            else lim.member_ttl
    except ValueError:
        member_ttl = lim.member_ttl
    return member_ttl, float(status.ttl) if status.ttl else lim.member_key_ttl
