"""`Bus`: one NATS connection with JetStream, the job's subjects and its KV buckets.

    async with Bus.connect("nats://127.0.0.1:4222", prefix="rl") as bus:
        ...

Entering provisions the streams and buckets (idempotent) unless `provision_streams=False`;
leaving drains the connection. The bus runs no tasks of its own: whoever starts a watcher,
receiver or registration runs it in a task group of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Literal, TypeVar

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import NotFoundError
from opentelemetry import propagate, trace

from rlfabric.bus.connect import ConnectOptions, Link, connect
from rlfabric.bus.errors import (
    JS_WRONG_LAST_SEQUENCE,
    READ_FAILED,
    TRANSIENT,
    BusError,
    PermissionDenied,
)
from rlfabric.bus.provision import Buckets, Limits, bind_buckets, cluster_size, provision
from rlfabric.bus.puback import PubAcks
from rlfabric.bus.subjects import CHECKPOINT_KEY, STATE_KEY, Subjects
from rlfabric.concurrency.ratelimit import RateLimited
from rlfabric.concurrency.sync import beside, wait_any
from rlfabric.schemas import (
    STATE_MARK_HEADER,
    CheckpointClaim,
    DesiredState,
    ErrorEvent,
    SchemaError,
    StateEvent,
    WorkerInfo,
    codec_for,
    encode,
)
from rlfabric.schemas import headers as schema_headers
from rlfabric.telemetry import spans

T = TypeVar("T")
PingResult = Literal["alive", "dead", "silent"]
#: seconds a desired-state write keeps retrying (a cluster's leader election takes 5-7 s)
STATE_WRITE_WITHIN = 15.0
#: seconds a joining worker waits, at most, for a desired-state write that lags behind the
#: last stored command (`Bus.desired_state_after`)
JOIN_STATE_WAIT_S = 2.0
#: seconds a pipelined JetStream publish waits for its PubAck before it counts as lost
PUB_ACK_TIMEOUT = 5.0
log = logging.getLogger("rlfabric.bus")
_garbage = RateLimited(log)
_retrying = RateLimited(log)


class Bus:
    def __init__(self, nc: NATS, js: JetStreamContext, subjects: Subjects,
                 buckets: Buckets | None, limits: Limits, link: Link | None = None) -> None:
        self.nc = nc
        self.js = js
        self.subjects = subjects
        self.limits = limits
        self._buckets = buckets
        #: the connection's ups and downs (`link.reconnected` fires after each reconnect)
        self.link = link or Link()
        self._pubacks = PubAcks(nc)
        self._cleared: set[str] = set()  # subjects a publish to went through
        #: this connection's desired-state writes: its id, its count, the last one sent
        #: (`<writer>.<serial>`, the `rlf-state-mark` of the commands sent after it)
        self._writer = uuid.uuid4().hex[:12]
        self._serials = itertools.count(1)
        self.state_mark: str | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, opts: ConnectOptions | str, *, prefix: str = "rl",
                      limits: Limits | None = None, provision_streams: bool = True,
                      ) -> AsyncIterator[Bus]:
        subjects = Subjects(prefix)
        limits = limits or Limits()
        link = Link()
        nc = await connect(opts, link=link)
        try:
            js = nc.jetstream(timeout=10.0)
            if provision_streams:
                # NOTE: nats-py keeps the server's INFO private; `connect_urls` in it is the
                # one place that says how many servers the cluster has
                buckets: Buckets | None = await provision(
                    js, subjects, limits, servers=cluster_size(getattr(nc, "_server_info", {})))
            else:
                buckets = await bind_buckets(js, subjects)
            yield cls(nc, js, subjects, buckets, limits, link)
        finally:
            with anyio.CancelScope(shield=True):
                await _close(nc)

    @property
    def buckets(self) -> Buckets:
        if self._buckets is None:
            raise BusError(
                f"the job's KV buckets ({self.subjects.members_bucket}, "
                f"{self.subjects.state_bucket}) do not exist on this server: no worker or "
                "trainer of this --prefix has started yet"
            )
        return self._buckets

    # ---- publishing ----
    def headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """`rlf-schema`, the current trace context (`traceparent`, when a span is active), and
        `extra`."""
        out = schema_headers(extra)
        # no tracer, no span: the context lookup is skipped (it costs more than the rest)
        if spans.enabled() and trace.get_current_span().get_span_context().is_valid:
            propagate.inject(out)
        return out

    async def publish(self, subject: str, msg: Any, *, extra: Mapping[str, str] | None = None,
                      ) -> None:
        """Core-NATS publish of an rlfabric message (buffered; no round trip)."""
        await self.nc.publish(subject, encode(msg), headers=self.headers(extra))

    async def persist(self, subject: str, data: bytes, headers: dict[str, str], *,
                      until: float | None = None, attempt_timeout: float = 5.0,
                      on_retry: Callable[[Exception], None] | None = None,
                      cleared_as: str | None = None) -> PubAck:
        """A JetStream publish that rides through a reconnect or a broker restart: a
        transient failure (no connection, no PubAck in `attempt_timeout`, JetStream not up
        yet) is retried, at once after a reconnect, else backing off up to 1 s, until
        `until` (a `time.time()`; None: until it is stored). Give the message a
        `Nats-Msg-Id` header: a retry of one that was stored but whose PubAck was lost is
        then dropped by the stream as a duplicate (`PubAck.duplicate`). `on_retry` is called
        with each transient error before its retry. `cleared_as`: the permission `subject`
        falls under, if subjects under it are many (see `refused_or`)."""
        delay = 0.05
        last: Exception = nats.errors.ConnectionReconnectingError()
        while True:
            reconnected = self.link.reconnected.event()
            if self.nc.is_closed:
                raise nats.errors.ConnectionClosedError
            if self.nc.is_connected:
                try:
                    # a pipelined publish awaited at once, not nats-py's `js.publish` (a
                    # request and `asyncio.wait_for`): 165 us of CPU a publish here where that
                    # took 181 (medians of 20 interleaved blocks); and a reconnect fails it at
                    # once (`Link.pending_acks`) where a request waited out its timeout
                    return await self.refused_or(subject, lambda: self.publish_stored(
                        subject, data, headers, timeout=attempt_timeout), cleared_as=cleared_as)
                except TRANSIENT as exc:
                    last = exc
                    if on_retry is not None:
                        on_retry(exc)
                    _retrying.warning("publish to %s did not reach JetStream (%s: %s); "
                                      "retrying until it does", subject, type(exc).__name__,
                                      exc)
            if until is not None and time.time() >= until:
                raise last
            await wait_any(reconnected, timeout=delay)
            delay = min(2 * delay, 1.0)

    async def publish_stored(self, subject: str, data: bytes | memoryview,
                             headers: dict[str, str] | None = None, *,
                             timeout: float = PUB_ACK_TIMEOUT) -> PubAck:
        """A JetStream publish that others may be in flight beside (pipelined); returns its
        PubAck. A reconnect before the PubAck came (it may be lost with the old connection)
        or none within `timeout` raises a `TRANSIENT` error: retry with the same
        `Nats-Msg-Id` (`persist`) and a stored one is dropped as a duplicate. A stream that
        refuses the message raises its `APIError` at once."""
        return await self._pub_ack(await self._send_stored(subject, data, headers), timeout)

    async def _send_stored(self, subject: str, data: bytes | memoryview,
                           headers: dict[str, str] | None) -> asyncio.Future[PubAck]:
        """Send a JetStream publish; its PubAck comes on the returned future (`PubAcks`;
        failed by a reconnect: see `Link.pending_acks`). Await it with `_pub_ack`, or cancel
        it and discard it from `Link.pending_acks`."""
        fut = await self._pubacks.send(subject, data, headers)
        self.link.pending_acks.add(fut)
        return fut

    async def _pub_ack(self, fut: asyncio.Future[PubAck], timeout: float) -> PubAck:
        if fut.done():  # come already (a write sent before what the caller awaited first)
            self.link.pending_acks.discard(fut)
            return fut.result()
        # no PubAck in `timeout`: a loop timer fails `fut` (its pending slot is freed; a late
        # PubAck is dropped), not a cancel scope (one more per publish)
        timer = asyncio.get_running_loop().call_later(timeout, _time_out, fut)
        try:
            return await fut
        finally:
            timer.cancel()
            self.link.pending_acks.discard(fut)

    async def refused_or(self, subject: str, call: Callable[[], Awaitable[T]], *,
                         cleared_as: str | None = None) -> T:
        """`await call()`, unless the server refuses this client `subject` meanwhile (a
        permissions violation comes back as an asynchronous error, and the call would wait
        for its timeout): then `PermissionDenied` at once. Once a call to `subject` went
        through, later calls run bare (permissions hold for the connection's life) and a
        refusal is looked for only when one fails. `cleared_as` names what went through
        instead of `subject` (a wildcard the role's permission names, for subjects that are
        each used once, such as one per session)."""
        since = time.monotonic()
        key = cleared_as or subject
        if key in self._cleared:
            try:
                return await call()
            except TRANSIENT:
                if (why := self.link.refusal(subject, since)) is not None:
                    raise self._denied(subject, why) from None
                raise

        async def watch() -> None:
            while True:
                refusals = self.link.refusals.event()
                why = self.link.refusal(subject, since)
                if why is not None:
                    raise self._denied(subject, why)
                await refusals.wait()

        async with beside(cancel_at_exit=True) as tg:
            tg.start_soon(watch)
            out = await call()
        if len(self._cleared) < 1024:
            self._cleared.add(key)
        return out

    async def stored_later(self, subject: str, data: bytes, headers: dict[str, str], *,
                           cleared_as: str | None = None) -> Callable[[], Awaitable[PubAck]]:
        """A JetStream publish sent now, stored for sure later: the returned call awaits its
        PubAck and, if none comes (a reconnect, a timeout), stores it as `persist` does (give
        it a `Nats-Msg-Id`). A refusal by the stream raises from the call. For a write whose
        caller has other work to do meanwhile."""
        fut = None
        key = cleared_as or subject
        if self.nc.is_connected and key in self._cleared:
            with contextlib.suppress(*TRANSIENT):
                fut = await self._send_stored(subject, data, headers)

        async def stored() -> PubAck:
            if fut is not None:
                try:
                    return await self._pub_ack(fut, PUB_ACK_TIMEOUT)
                except TRANSIENT:
                    pass  # sent again below; a stored copy is dropped as a duplicate
            return await self.persist(subject, data, headers, cleared_as=cleared_as)
        return stored

    @staticmethod
    def _denied(subject: str, why: str) -> PermissionDenied:
        return PermissionDenied(f"the NATS server refused this client publishing to "
                                f"{subject!r} ({why}): its role may not; use the key of a "
                                "role that may (rlfabric nats --auth)", subject=subject)

    async def emit(self, event: ErrorEvent | StateEvent) -> None:
        kind = "error" if isinstance(event, ErrorEvent) else "state"
        await self.publish(self.subjects.events(kind, event.source), event)

    # ---- liveness ----
    async def ping(self, worker_id: str, timeout: float = 0.5, payload: bytes = b"",
                   ) -> PingResult:
        """`alive` if the worker answered, `dead` if nobody subscribes to its ping subject
        (the process is gone: known in one round trip), `silent` if it did not answer in time.
        `payload`: a sender's probe puts the control seq it waits for (see `CommandReceiver`)."""
        try:
            await self.nc.request(self.subjects.ping(worker_id), payload, timeout=timeout)
        except nats.errors.NoRespondersError:
            return "dead"
        except nats.errors.TimeoutError:
            return "silent"
        return "alive"

    # ---- membership and desired state, read once ----
    async def member_keys(self) -> list[str]:
        """The members bucket's keys, sorted, from its stream's subject list (one request).
        A key that was deleted or expired is listed while its marker is held.

        nats-py's `KeyValue.keys()` is not used: its watch can report the end of the listing
        while entries are still on their way, most often while members heartbeat, and then
        misses keys (nats.py #842)."""
        if self._buckets is None:
            return []
        bucket = self.subjects.members_bucket
        pre = f"$KV.{bucket}."
        listed = await self.js.stream_info(f"KV_{bucket}", subjects_filter=f"{pre}>")
        return sorted(subject[len(pre):] for subject in listed.state.subjects or {})

    async def members(self) -> dict[str, WorkerInfo]:
        """The current members as stored in the KV bucket (one read, no watch)."""
        if self._buckets is None:
            return {}
        kv = self._buckets.members
        codec = codec_for(WorkerInfo)
        out: dict[str, WorkerInfo] = {}
        for key in await self.member_keys():
            try:
                entry = await kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                continue
            if not entry.value:  # an expired key can read back as an empty value
                continue
            try:
                info = codec.decode(entry.value, check_version=False)
            except SchemaError as exc:  # skipped, said, repairable: `rlfabric ctl drop-member`
                _garbage.warning("membership key %r is unreadable, skipped (%s); remove it "
                                 "with `rlfabric ctl drop-member %s`", key, exc, key)
                continue
            if info.worker_id != key:
                _garbage.warning("membership key %r describes worker %r, skipped; remove it "
                                 "with `rlfabric ctl drop-member %s`", key, info.worker_id, key)
                continue
            out[key] = info
        return out

    async def desired_state(self) -> DesiredState:
        if self._buckets is None:
            return DesiredState()
        try:
            entry = await self.buckets.state.get(STATE_KEY)
        except nats.js.errors.KeyNotFoundError:
            return DesiredState()
        if not entry.value:
            return DesiredState()
        try:
            state: DesiredState = codec_for(DesiredState).decode(entry.value,
                                                                check_version=False)
        except SchemaError as exc:
            # read as "nothing desired yet" so every process still starts; the trainer's next
            # write replaces it, `rlfabric ctl reset-state` repairs it by hand
            _garbage.warning("the desired state (%s bucket) is unreadable, read as empty "
                             "(%s); repair it with `rlfabric ctl reset-state`",
                             self.subjects.state_bucket, exc)
            return DesiredState()
        return state

    async def desired_state_after(self, seq: int, *,
                                  wait: float = JOIN_STATE_WAIT_S) -> DesiredState:
        """The desired state, no older than the write named by the command stored at `seq` in
        the control stream (its `rlf-state-mark`). A sender sends that write before the
        command, but the state bucket and the control stream store what they get in no common
        order, so the write can land after the command. Waits for it at most `wait` seconds,
        then goes on with what is there (logged). A state written by another connection is
        taken as it is: two writers' writes have no order to compare."""
        state = await self.desired_state()
        mark = await self._state_mark_at(seq) if seq > 0 else None
        writer, _, serial = (mark or "").rpartition(".")
        if not writer or not serial.isdecimal():
            return state
        want = int(serial)
        deadline = time.monotonic() + wait
        delay = 0.005
        while state.writer == writer and state.serial < want:
            if time.monotonic() >= deadline:
                log.warning("the desired state is still write %d of %s, older than write %d "
                            "that command seq %d was sent after; starting from it after %.1fs",
                            state.serial, writer, want, seq, wait)
                break
            await anyio.sleep(delay)  # no event says that another stream stored something
            delay = min(2 * delay, 0.1)
            state = await self.desired_state()
        return state

    async def _state_mark_at(self, seq: int) -> str | None:
        try:
            raw = await self.js.get_msg(self.subjects.control_stream, seq=seq)
        except READ_FAILED as exc:
            log.debug("command seq %d not read (%s): its state write is not waited for", seq,
                      exc)
            return None
        return (raw.headers or {}).get(STATE_MARK_HEADER)

    async def put_desired_state(self, state: DesiredState, *,
                                within: float = STATE_WRITE_WITHIN) -> None:
        """Write the job's desired state, retried through a reconnect or a cluster's leader
        election for up to `within` seconds (a KV put is a publish to the bucket's stream)."""
        await self._put_state(*self._state_put(state), within=within)

    @contextlib.asynccontextmanager
    async def desired_state_written(self, state: DesiredState, *,
                                    within: float = STATE_WRITE_WITHIN) -> AsyncIterator[None]:
        """Write the job's desired state while the body runs: sent on entry, and once the
        body is done its PubAck awaited (missing: sent again as `put_desired_state` does, for
        up to `within` seconds). A body that raises leaves the write unconfirmed (it may be
        stored). No task runs beside the body: a pipelined publish is all it costs."""
        subject, data, hdrs = self._state_put(state)
        fut = None
        first = subject not in self._cleared
        if first:  # not written through this connection yet: stored first, a refusal looked for
            await self._put_state(subject, data, hdrs, within=within)
        elif self.nc.is_connected:
            with contextlib.suppress(*TRANSIENT):
                fut = await self._send_stored(subject, data, hdrs)
        try:
            yield
        except BaseException:
            if fut is not None:  # nobody awaits its PubAck: its pending slot is freed now
                fut.cancel()
                self.link.pending_acks.discard(fut)
            raise
        if first:
            return  # stored above
        if fut is not None:
            with contextlib.suppress(*TRANSIENT):
                await self._pub_ack(fut, timeout=PUB_ACK_TIMEOUT)
                return
        # no PubAck (a reconnect, a leader election): a stored one is dropped as a duplicate
        await self._put_state(subject, data, hdrs, within=within)

    def _state_put(self, state: DesiredState) -> tuple[str, bytes, dict[str, str]]:
        serial = next(self._serials)
        state = msgspec.structs.replace(state, writer=self._writer, serial=serial)
        self.state_mark = f"{self._writer}.{serial}"
        return (f"$KV.{self.subjects.state_bucket}.{STATE_KEY}", encode(state),
                {"Nats-Msg-Id": f"state-{self._writer}.{serial}"})

    async def _put_state(self, subject: str, data: bytes, hdrs: dict[str, str], *,
                         within: float) -> None:
        bucket = self.subjects.state_bucket
        try:
            await self.persist(subject, data, hdrs, until=time.time() + within)
        except TRANSIENT as exc:
            raise BusError(
                f"the job's desired state was not stored within {within}s (bucket {bucket}: "
                f"{type(exc).__name__}: {exc}); on a NATS cluster a node may be down while "
                "its streams elect new leaders, which takes seconds: retry the call") from exc

    async def checkpoint_claim(self) -> CheckpointClaim | None:
        """The job's version-0 checkpoint, if a worker claimed one (`CheckpointClaim`)."""
        if self._buckets is None:
            return None
        try:
            entry = await self._buckets.state.get(CHECKPOINT_KEY)
        except nats.js.errors.KeyNotFoundError:
            return None
        if not entry.value:
            return None
        try:
            claim: CheckpointClaim = codec_for(CheckpointClaim).decode(entry.value,
                                                                      check_version=False)
        except SchemaError as exc:
            _garbage.warning("the checkpoint claim (%s bucket) is unreadable (%s); repair it "
                             "with `rlfabric ctl reset-state`", self.subjects.state_bucket, exc)
            return None
        return claim

    async def claim_checkpoint(self, claim: CheckpointClaim) -> CheckpointClaim:
        """Make `claim` the job's version-0 checkpoint unless one is already claimed; returns
        the claim that holds (this one, or the first)."""
        subject = f"$KV.{self.subjects.state_bucket}.{CHECKPOINT_KEY}"
        try:
            await self.persist(subject, encode(claim),
                               {"Nats-Expected-Last-Subject-Sequence": "0"},
                               until=time.time() + STATE_WRITE_WITHIN)
            return claim
        except nats.js.errors.APIError as exc:
            if exc.err_code != JS_WRONG_LAST_SEQUENCE:
                raise
        held = await self.checkpoint_claim()
        return held if held is not None else claim

    async def stream_depths(self) -> dict[str, int | None]:
        """Messages held per stream (None if the stream does not exist), and the rollout
        requests not yet delivered to any worker."""
        s = self.subjects
        out: dict[str, int | None] = {}
        for name in (s.rollout_stream, s.results_stream, s.control_stream, s.weights_stream,
                     s.sessions_stream):
            try:
                out[name] = (await self.js.stream_info(name)).state.messages
            except NotFoundError:
                out[name] = None
        try:
            ci = await self.js.consumer_info(s.rollout_stream, s.rollout_consumer)
            out["rollout_pending"] = ci.num_pending
            out["rollout_in_flight"] = ci.num_ack_pending
        except NotFoundError:
            pass
        return out


async def _close(nc: NATS) -> None:
    """Drain, or close if draining fails. A connection already lost (the broker or its node
    gone) is no error here: a process stopping then must not die of it, nor hide behind it
    the error it is stopping for."""
    if nc.is_closed:
        return
    try:
        with anyio.fail_after(5):
            await nc.drain()
    except Exception:
        try:
            await nc.close()
        except (OSError, nats.errors.Error) as exc:
            log.info("closing a connection already lost (%s: %s): what it still held for the "
                     "server is dropped", type(exc).__name__, exc)


def _time_out(fut: asyncio.Future[PubAck]) -> None:
    if not fut.done():
        fut.set_exception(nats.errors.TimeoutError())
