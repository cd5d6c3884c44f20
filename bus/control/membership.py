"""Membership: workers register a `WorkerInfo` and beat; trainers watch the set.

Worker side, `Registration`: answers pings on `<prefix>.worker.<id>.ping`, puts its key in the
members bucket, beats on core NATS every `member_ttl / 4`, writes its key again when its state
changes and every `member_key_ttl / 3` (the key's TTL), and deletes it on a clean exit. The
beats of every worker on one connection go in one `Beats` message
(`<prefix>.events.beat.<id>`): liveness costs the server a core message per process and beat,
not a stored write per worker, so an idle fleet of thousands stays cheap.

Trainer side, `MembershipWatcher`: a KV watch folded into `MembershipSnapshot`s, and the beats.
The epoch moves on every join or leave it observes; beats and state updates do not move it. A
member unheard for `member_ttl` (no beat, no key write) is pinged: no ping responder (the
process is gone; a SIGKILLed worker's connection closes with it) is a leave at once, and its
key is deleted; a worker that is there but does not answer (a loaded host, a stopped process)
leaves only once unheard for another `member_ttl`. A slow key write is never a leave.

A broker restart is not a leave: a worker whose key expired stays a member while it answers
pings, and "no responders" counts as death only once the connection has been up for
`RECONNECT_SETTLE` seconds (peers need that long to come back). After a reconnect the watch is
re-opened and the member set re-read, instead of waiting for the old watch's consumer to be
found dead.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import socket
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import anyio
import msgspec
import nats.errors
import nats.js.errors
from anyio.abc import TaskGroup, TaskStatus
from nats.aio.msg import Msg

from rlfabric.bus.errors import TRANSIENT, DuplicateWorker, MembershipTimeout
from rlfabric.bus.session import Bus
from rlfabric.bus.subjects import check_token
from rlfabric.concurrency.ratelimit import RateLimited
from rlfabric.concurrency.sync import Signal, wait_any
from rlfabric.schemas import Beats, MembershipSnapshot, SchemaError, WorkerInfo, codec_for, encode

log = logging.getLogger("rlfabric.bus.control.membership")

#: seconds after a (re)connect during which a worker that does not answer may still be
#: reconnecting itself (its reconnect wait, 0.5 s by default, plus a margin)
RECONNECT_SETTLE = 2.0
#: seconds a new watch waits for keys the bucket listed that it has not delivered yet
INITIAL_SETTLE_S = 2.0
#: seconds after which `Registration.run` checks again that its worker id is free
RECHECK_AFTER_S = 5.0
#: seconds the first beat of an instant waits for the other workers of its connection
BEAT_GATHER_S = 0.01
_REWATCH: tuple[type[Exception], ...] = (*TRANSIENT, nats.js.errors.APIError)


def fingerprint(worker_ids: Iterable[str]) -> str:
    """A short digest of a member set: equal sets give equal fingerprints on every client."""
    joined = "\n".join(sorted(worker_ids)).encode()
    return hashlib.blake2b(joined, digest_size=8).hexdigest()


def new_worker_info(worker_id: str, *, engine: str, model: str, capacity: int = 1,
                    ranks: int = 1) -> WorkerInfo:
    check_token(worker_id, "worker id")
    t = time.time()
    return WorkerInfo(worker_id=worker_id, host=socket.gethostname(), pid=os.getpid(),
                      engine=engine, model=model, capacity=capacity, ranks=ranks,
                      started_at=t, heartbeat_at=t)


class _Beater:
    """The beats of one connection's workers: their timers keep one phase (a multiple of the
    interval), and the first to fire sends, `BEAT_GATHER_S` later, every id that fired with
    it."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.due: list[str] = []
        self.gathering = False

    async def beat(self, worker_id: str) -> None:
        self.due.append(worker_id)
        if self.gathering:
            return  # the first of this instant sends it
        self.gathering = True
        try:
            await anyio.sleep(BEAT_GATHER_S)
        finally:  # cancelled (its worker stopping): these beats are lost, the next go
            self.gathering = False
            ids, self.due = tuple(self.due), []
        if self.bus.nc.is_connected:
            with contextlib.suppress(nats.errors.Error):  # the next beat goes
                await self.bus.nc.publish(self.bus.subjects.beat(ids[0]),
                                          encode(Beats(worker_ids=ids)))


_beaters: weakref.WeakKeyDictionary[Bus, _Beater] = weakref.WeakKeyDictionary()


class Registration:
    """A worker's presence on the bus. Run with `await tg.start(reg.run)`: started means the
    ping responder is live and the key is written."""

    def __init__(self, bus: Bus, info: WorkerInfo, *, heartbeat: float | None = None) -> None:
        self.bus = bus
        self.info = info
        # NOTE: from the bucket as the server has it, not our Limits: another process may
        # have created it.
        self.heartbeat = heartbeat or max(0.05, bus.buckets.member_ttl / 4)
        self.key_refresh = max(self.heartbeat, bus.buckets.member_key_ttl / 3)
        self._beater = _beaters.setdefault(bus, _Beater(bus))
        #: called before each write to bring live fields (in-flight, version) up to date
        self.refresh: Callable[[WorkerInfo], WorkerInfo] | None = None
        #: told why when the key could not be written (the bus may have moved on without us)
        self.on_unwritten: Callable[[str], None] | None = None
        self._checked_at = -math.inf  # when refuse_if_taken() last found the id free
        self._write_at = math.inf  # when the key is written again if nothing changes
        self._written: WorkerInfo | None = None  # what the key holds

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def update(self, **changes: Any) -> WorkerInfo:
        """Change fields of this worker's info; written at the next heartbeat or `flush()`."""
        self.info = msgspec.structs.replace(self.info, **changes)
        return self.info

    async def flush(self) -> None:
        info = self.refresh(self.info) if self.refresh else self.info
        self.info = msgspec.structs.replace(info, heartbeat_at=time.time())
        await self.bus.buckets.members.put(self.worker_id, encode(self.info))
        self._written = self.info
        self._write_at = time.monotonic() + self.key_refresh

    def changed(self) -> bool:
        """Whether the info differs from what the key holds (a write that failed or timed
        out, a change no one flushed)."""
        info = self.refresh(self.info) if self.refresh else self.info
        written = self._written
        return written is None or msgspec.structs.replace(
            info, heartbeat_at=written.heartbeat_at) != written

    async def _beat(self) -> None:
        """A beat every `heartbeat` s; the key written again with it when the info changed
        since it was last written, every `key_refresh` s, and after a reconnect (a restarted
        server may have lost or expired it)."""
        link, nc, every = self.bus.link, self.bus.nc, self.heartbeat
        while True:
            reconnects = link.reconnects
            await link.reconnected.wait(every - time.monotonic() % every)
            if not nc.is_connected:
                continue  # nothing to send to; the reconnect wakes us
            await self._beater.beat(self.worker_id)
            if (link.reconnects == reconnects and time.monotonic() < self._write_at
                    and not self.changed()):
                continue
            try:
                with anyio.fail_after(max(1.0, 2 * self.heartbeat)):
                    await self.flush()
            except Exception as exc:  # the server went meanwhile: the next beat retries
                why = str(exc) or type(exc).__name__
                log.warning("membership key of %s not written: %s", self.worker_id, why)
                if self.on_unwritten is not None:
                    self.on_unwritten(f"its membership key could not be written ({why})")

    async def _on_ping(self, msg: Msg) -> None:
        info = self.refresh(self.info) if self.refresh else self.info
        await msg.respond(encode(info))

    async def refuse_if_taken(self) -> None:
        """Worker ids are unique while alive: a live holder answers pings on the id's subject
        (a stale key of a dead one is simply overwritten). Call it before this worker's
        `CommandReceiver` subscribes to the same subject: that one answers only a sender's
        probe, so a plain ping would wait out its 1 s timeout instead of hearing "no
        responders"."""
        try:
            msg = await self.bus.nc.request(self.bus.subjects.ping(self.worker_id), b"",
                                            timeout=1.0)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            self._checked_at = time.monotonic()
            return
        try:
            other = codec_for(WorkerInfo).decode(msg.data, check_version=False)
            who = f"pid {other.pid} on {other.host}, {other.engine} engine"
        except SchemaError:
            who = "a process whose answer is unreadable"
        raise DuplicateWorker(f"worker id {self.worker_id!r} is in use in job "
                              f"{self.bus.subjects.prefix!r} by a live worker ({who}): pick "
                              "another --worker-id, or stop that worker first")

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        # checked again unless just checked: a worker whose engine took long to start may have
        # a twin by now (the check then waits its 1 s out behind our own receiver's ping
        # subscription, but a live twin answers at once)
        if time.monotonic() - self._checked_at > RECHECK_AFTER_S:
            await self.refuse_if_taken()
        sub = await self.bus.nc.subscribe(self.bus.subjects.ping(self.worker_id), cb=self._on_ping)
        try:
            await self.bus.nc.flush(timeout=5)  # the responder is live on the server
            await self.flush()
            task_status.started()
            await self._beat()
        finally:
            with anyio.CancelScope(shield=True):
                await sub.unsubscribe()
                try:
                    with anyio.fail_after(5):
                        await self.bus.buckets.members.delete(self.worker_id)
                except Exception as exc:
                    log.warning("could not delete membership key of %s (%s: %s); watchers see "
                                "it leave once it is unheard for member_ttl", self.worker_id,
                                type(exc).__name__, exc)


class MembershipWatcher:
    """The member set as it changes. Run with `await tg.start(w.run)`: started means the
    initial member set has been read."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.members: dict[str, WorkerInfo] = {}
        self.epoch = 0
        self._heard: dict[str, float] = {}  # member -> when it last beat or wrote its key
        self._checking: set[str] = set()  # members being pinged (`_verify_gone`)
        self._silent: set[str] = set()  # left unheard, not gone: a beat readmits them
        self._changed = Signal()
        self._joins_leaves: set[Signal] = set()
        self._codec = codec_for(WorkerInfo)
        self._beats_codec = codec_for(Beats)
        self._flood = RateLimited(log)
        # the member ids in order and their fingerprint, kept from one join or leave to the
        # next: a broadcast takes a snapshot, and sorting a large fleet's ids each time costs
        self._order: tuple[tuple[str, ...], str] | None = None

    def snapshot(self) -> MembershipSnapshot:
        if self._order is None:
            ids = tuple(sorted(self.members))
            self._order = (ids, fingerprint(ids))
        ids, digest = self._order
        members = self.members
        return MembershipSnapshot(epoch=self.epoch, fingerprint=digest,
                                  members=tuple(map(members.__getitem__, ids)))

    def changed(self) -> anyio.Event:
        """An event set at the next join, leave or member update (take it before checking the
        state); only joins and leaves move the epoch."""
        return self._changed.event()

    def _set_changed(self) -> None:
        self.epoch += 1
        self._order = None
        self._changed.fire()
        for sig in tuple(self._joins_leaves):
            sig.fire()

    @contextlib.contextmanager
    def firing_on_join_or_leave(self, signal: Signal) -> Iterator[None]:
        """Fire `signal` at every join or leave while the block runs (a waiter then waits on
        one event, not two)."""
        self._joins_leaves.add(signal)
        try:
            yield
        finally:
            self._joins_leaves.discard(signal)

    async def wait_until(self, predicate: Callable[[MembershipSnapshot], bool], *,
                         timeout: float) -> MembershipSnapshot:
        """Wait for a snapshot that satisfies `predicate` (e.g. `lambda s: len(s.members) >= 8`,
        or every member on weight version 3); re-checked at every join, leave and heartbeat.
        `MembershipTimeout` (a `TimeoutError`) after `timeout` seconds, naming who is there."""
        with anyio.move_on_after(timeout):
            while True:
                changed = self._changed.event()
                snap = self.snapshot()
                if predicate(snap):
                    return snap
                await changed.wait()
        raise MembershipTimeout(
            f"membership did not reach the awaited state within {timeout}s; members now: "
            f"{list(self.snapshot().worker_ids)}"
        )

    async def mark_dead(self, worker_id: str) -> None:
        """A ping found `worker_id` gone: drop it now and delete its key so every watcher sees
        the leave at once rather than at TTL expiry. A worker only cut off writes its key
        again as it reconnects, and rejoins."""
        if self.members.pop(worker_id, None) is not None:
            self._heard.pop(worker_id, None)
            self._set_changed()
        try:
            await self.bus.buckets.members.delete(worker_id)
        except Exception as exc:
            log.warning("could not delete membership key of dead %s (%s: %s); other watchers "
                        "see it leave once it is unheard for member_ttl", worker_id,
                        type(exc).__name__, exc)

    def _apply(self, key: str, op: str | None, value: bytes | None) -> None:
        if op is None and value:
            try:
                info = self._codec.decode(value, check_version=False)
            except SchemaError as exc:
                self._flood.warning("ignoring unreadable membership entry %r: %s", key, exc)
                return
            if info.worker_id != key:  # not written by that worker's Registration
                self._flood.warning("ignoring membership entry %r: it describes worker %r",
                                    key, info.worker_id)
                return
            joined = key not in self.members
            self.members[key] = info
            self._heard[key] = time.monotonic()
            self._silent.discard(key)
            if joined:
                self._set_changed()
            else:  # a heartbeat or state update: waiters re-check, the epoch stays
                self._changed.fire()
        elif self.members.pop(key, None) is not None:
            self._heard.pop(key, None)
            self._set_changed()

    async def _keys_now(self) -> set[str]:
        """The members bucket's keys as listed now; none if the listing fails (the watch's own
        end mark then stands)."""
        try:
            return set(await self.bus.fleet.member_keys())
        except _REWATCH as exc:
            log.debug("could not list the members bucket's keys: %s", exc)
            return set()

    def _unheard(self, key: str) -> float:
        """Seconds `key` has not been heard from while this watcher could hear it (a member
        is not unheard while our own connection is down)."""
        link = self.bus.link
        if not link.up:
            return 0.0
        return time.monotonic() - max(self._heard.get(key, -math.inf), link.since)

    async def _verify_gone(self, key: str) -> None:
        """`key` is unheard for `member_ttl` (or its key expired, or a new watch does not
        list it): ping it until it answers or beats (it stays), its connection is gone (it
        left: its key is deleted) or it is unheard for twice `member_ttl` (it left; it comes
        back at its next beat)."""
        if key in self._checking:
            return
        self._checking.add(key)
        link, ttl = self.bus.link, self.bus.buckets.member_ttl
        try:
            while key in self.members and self._unheard(key) >= ttl:
                try:
                    answer = await self.bus.fleet.ping(key, timeout=1.0)
                except nats.errors.Error as exc:  # our connection in a reconnect: ask again
                    log.debug("ping of %s not sent: %s", key, exc)
                    await anyio.sleep(0.25)
                    continue
                if answer == "alive":
                    self._heard[key] = time.monotonic()
                    return
                if answer == "dead" and link.settled(RECONNECT_SETTLE):
                    log.info("member %s left: unheard and its connection is gone", key)
                    await self.mark_dead(key)
                    return
                if answer == "silent" and self._unheard(key) >= 2 * ttl:
                    self.members.pop(key, None)
                    self._heard.pop(key, None)
                    self._silent.add(key)
                    log.info("member %s left: unheard for %.1f s and it does not answer", key,
                             2 * ttl)
                    self._set_changed()
                    return
                if answer == "dead":  # "no responders" just after a reconnect: ask again
                    await anyio.sleep(0.25)
        finally:
            self._checking.discard(key)

    async def suspect(self, key: str) -> None:
        """A client saw member `key` go quiet mid-work: ping it now, not at `member_ttl`. Gone
        (no responders) is a leave at once, as in `_verify_gone`; any other answer leaves it
        to the usual timeouts."""
        if key not in self.members or key in self._checking:
            return
        self._checking.add(key)
        try:
            answer = await self.bus.fleet.ping(key, timeout=1.0)
        except nats.errors.Error:
            return
        finally:
            self._checking.discard(key)
        if answer == "alive":
            self._heard[key] = time.monotonic()
        elif answer == "dead" and self.bus.link.settled(RECONNECT_SETTLE):
            log.info("member %s left: it went quiet mid-work and its connection is gone", key)
            await self.mark_dead(key)

    def _on_beat(self, msg: Msg, tg: TaskGroup) -> None:
        try:
            ids = self._beats_codec.decode(msg.data, check_version=False).worker_ids
        except SchemaError as exc:
            self._flood.warning("ignoring an unreadable beat on %s: %s", msg.subject, exc)
            return
        now = time.monotonic()
        for key in ids:
            if key in self.members:
                self._heard[key] = now
            elif key in self._silent:  # back: its key tells what it is
                self._silent.discard(key)
                tg.start_soon(self._readmit, key)

    async def _readmit(self, key: str) -> None:
        try:
            entry = await self.bus.buckets.members.get(key)
        except Exception as exc:  # expired, or the bus busy: its next key write readmits it
            log.debug("member %s beats again; its key is not read (%s)", key, exc)
            return
        if key not in self.members:
            self._apply(key, None, entry.value)

    async def _sweep(self) -> None:
        """Ping the members unheard for `member_ttl`."""
        ttl = self.bus.buckets.member_ttl
        async with anyio.create_task_group() as tg:
            while True:
                await anyio.sleep(ttl / 4)
                for key in [k for k in self.members if self._unheard(k) >= ttl]:
                    if key not in self._checking:
                        tg.start_soon(self._verify_gone, key)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        link = self.bus.link
        started = False
        async with anyio.create_task_group() as tg, self._beats(tg):
            tg.start_soon(self._sweep)
            while True:
                reconnects = link.reconnects
                try:
                    watcher = await self.bus.buckets.members.watch(">")
                except _REWATCH as exc:
                    if not started:
                        raise
                    log.debug("membership watch not re-opened yet: %s", exc)
                    await wait_any(link.reconnected.event(), timeout=0.5)
                    continue
                def ready() -> None:
                    nonlocal started
                    if not started:
                        started = True
                        task_status.started()

                try:
                    await self._follow(watcher, tg, reconnects, ready)
                finally:
                    with anyio.CancelScope(shield=True):
                        try:
                            with anyio.fail_after(5):
                                await watcher.stop()
                        except Exception:
                            pass

    @contextlib.asynccontextmanager
    async def _beats(self, tg: TaskGroup) -> AsyncIterator[None]:
        async def on_beat(msg: Msg) -> None:
            self._on_beat(msg, tg)

        sub = await self.bus.nc.subscribe(self.bus.subjects.beats, cb=on_beat)
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _follow(self, watcher: Any, tg: TaskGroup, reconnects: int,
                      started: Callable[[], None]) -> None:
        """Fold one watch's entries in until the connection is re-established. Its initial
        values are the whole member set: a member we hold that it does not list left while we
        were away (verified by ping, as an expiry).

        nats-py marks the end of the initial values too early when entries are still on their
        way (most often while members heartbeat; nats.py #842). So at that mark the bucket's
        keys are listed, and the initial values count as in once the watch has delivered each
        of them, or after `INITIAL_SETTLE_S` (a key whose marker the server dropped since)."""
        link = self.bus.link
        listed: set[str] | None = set()  # keys of the initial values; None once they are in
        delivered: set[str] = set()  # every key the watch delivered, deleted ones included
        awaited: set[str] | None = None  # the bucket's keys at the end mark, once listed
        settle_by = math.inf
        while link.reconnects == reconnects:
            if listed is not None and awaited is not None and (
                    awaited <= delivered or anyio.current_time() >= settle_by):
                for key in set(self.members) - listed:
                    tg.start_soon(self._verify_gone, key)
                listed = None
                started()
            try:
                entry = await watcher.updates(
                    timeout=0.05 if listed is not None and awaited is not None else 0.5)
            except TimeoutError:
                continue
            if entry is None:  # the watch's mark: the initial values are in
                if listed is not None and awaited is None:
                    awaited = await self._keys_now()
                    settle_by = anyio.current_time() + INITIAL_SETTLE_S
                continue
            if listed is not None:
                delivered.add(entry.key)
                if entry.operation is None and entry.value:
                    listed.add(entry.key)
            if entry.operation == "PURGE":  # the key's TTL: a member still beating stays
                if entry.key in self.members:
                    tg.start_soon(self._verify_gone, entry.key)
                continue
            self._apply(entry.key, entry.operation, entry.value)
