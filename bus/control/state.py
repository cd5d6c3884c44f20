"""The job's desired state and version-0 checkpoint claim in the state bucket: read, written
through a reconnect or a leader election, and ordered against the commands sent after a write
(each write's `rlf-state-mark`)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TypeVar

import anyio
import msgspec
import nats.js.errors
from nats.js import JetStreamContext

from rlfabric.bus.errors import (
    JS_WRONG_LAST_SEQUENCE,
    READ_FAILED,
    TRANSIENT,
    BusError,
    storage_refused,
)
from rlfabric.bus.nats.provision import Buckets
from rlfabric.bus.nats.publish import PUB_ACK_TIMEOUT, Publisher
from rlfabric.bus.subjects import CHECKPOINT_KEY, STATE_KEY
from rlfabric.concurrency import RateLimited
from rlfabric.schemas import (
    JOB_STATE_PREFIX,
    SHARE_KEY,
    STATE_MARK_HEADER,
    CheckpointClaim,
    DesiredState,
    JobShare,
    SchemaError,
    codec_for,
    encode,
    job_state_key,
    share_key,
)

#: seconds a desired-state write keeps retrying (a cluster's leader election takes 5-7 s)
STATE_WRITE_WITHIN = 15.0
#: seconds a joining worker waits, at most, for a desired-state write that lags behind the
#: last stored command (`StateStore.after`)
JOIN_STATE_WAIT_S = 2.0
log = logging.getLogger("rlfabric.bus")
_garbage = RateLimited(log)
S = TypeVar("S", DesiredState, CheckpointClaim, JobShare)


class StateStore:
    def __init__(self, pub: Publisher, js: JetStreamContext, buckets: Buckets | None) -> None:
        self.pub = pub
        self.js = js
        self.subjects = pub.subjects
        self._buckets = buckets
        #: this connection's writes: its id, its count, the last one sent (`<writer>.<serial>`,
        #: the `rlf-state-mark` of the commands sent after it)
        self._writer = uuid.uuid4().hex[:12]
        self._serials = itertools.count(1)
        self.mark: str | None = None

    async def _get(self, key: str, kind: type[S], what: str) -> S | None:
        return (await self._entry(key, kind, what))[0]

    async def _entry(self, key: str, kind: type[S], what: str) -> tuple[S | None, int]:
        """What `key` holds (None if nothing, a delete marker or unreadable) and the sequence
        of its last entry (0 if none)."""
        if self._buckets is None:
            return None, 0
        try:
            entry = await self._buckets.state.get(key)
        except nats.js.errors.KeyNotFoundError as exc:  # none, or a delete marker
            return None, (exc.entry.revision or 0) if exc.entry is not None else 0
        last = entry.revision or 0
        if not entry.value:
            return None, last
        try:
            out: S = codec_for(kind).decode(entry.value, check_version=False)
        except SchemaError as exc:
            # read as "nothing yet" so every process still starts; the next write replaces
            # it, `rlfabric ctl reset-state` repairs it by hand
            _garbage.warning("the %s (%s bucket) is unreadable, read as empty (%s); repair it "
                             "with `rlfabric ctl reset-state`", what,
                             self.subjects.state_bucket, exc)
            return None, last
        return out, last

    async def read(self, job: str = "") -> DesiredState:
        """The pool's desired state, or job `job`'s (its adapters and pause; `schemas.jobs`)."""
        if job:
            return await self._get(job_state_key(job), DesiredState,
                                   f"job {job}'s desired state") or DesiredState()
        return await self._get(STATE_KEY, DesiredState, "desired state") or DesiredState()

    async def jobs(self) -> dict[str, DesiredState]:
        """Every job's desired state, by job (a job whose state was deleted is left out)."""
        if self._buckets is None:
            return {}
        try:
            keys = await self._buckets.state.keys()  # a few: the pool's, one per job
        except nats.js.errors.NoKeysError:
            return {}
        out = {}
        for key in (k for k in keys if k.startswith(JOB_STATE_PREFIX)):
            job = key[len(JOB_STATE_PREFIX):]
            state = await self._get(key, DesiredState, f"job {job}'s desired state")
            if state is not None:
                out[job] = state
        return out

    async def shares(self) -> tuple[dict[str, JobShare], set[str]]:
        """Each job's share as the operator set it (`JobShare`), and every job the bucket
        names (by a share or a desired state)."""
        if self._buckets is None:
            return {}, set()
        try:
            keys = await self._buckets.state.keys()
        except nats.js.errors.NoKeysError:
            return {}, set()
        named, out = set(), {}
        for key in keys:
            if key.startswith(JOB_STATE_PREFIX):
                named.add(key[len(JOB_STATE_PREFIX):])
            elif key == SHARE_KEY or key.startswith(SHARE_KEY + "."):
                job = key[len(SHARE_KEY) + 1:]
                share = await self._get(key, JobShare, f"job {job or '(pool)'}'s share")
                if share is not None:
                    named.add(job)
                    out[job] = share
        return out, named

    async def share(self, job: str) -> JobShare:
        """Job `job`'s share (weight 1, no quota if none was set)."""
        return await self._get(share_key(job), JobShare, f"job {job}'s share") or JobShare()

    async def put_share(self, job: str, share: JobShare) -> None:
        """Set job `job`'s share (the pool's operator's: a job's key may not)."""
        if self._buckets is None:
            raise BusError("the pool's state bucket is not bound: connect with provisioning")
        await self._buckets.state.put(share_key(job), encode(share))

    async def delete_job(self, job: str) -> None:
        """Forget job `job`'s desired state (a joiner no longer loads its adapters)."""
        if self._buckets is not None:
            await self._buckets.state.delete(job_state_key(job))

    async def after(self, seq: int, *, wait: float = JOIN_STATE_WAIT_S) -> DesiredState:
        """The desired state, no older than the write named by the command stored at `seq` in
        the control stream (its `rlf-state-mark`). A sender sends that write before the
        command, but the state bucket and the control stream store what they get in no common
        order, so the write can land after the command. Waits for it at most `wait` seconds,
        then goes on with what is there (logged). A state written by another connection is
        taken as it is: two writers' writes have no order to compare."""
        state = await self.read()
        mark = await self._mark_at(seq) if seq > 0 else None
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
            state = await self.read()
        return state

    async def _mark_at(self, seq: int) -> str | None:
        try:
            raw = await self.js.get_msg(self.subjects.control_stream, seq=seq)
        except READ_FAILED as exc:
            log.debug("command seq %d not read (%s): its state write is not waited for", seq,
                      exc)
            return None
        return (raw.headers or {}).get(STATE_MARK_HEADER)

    async def put(self, state: DesiredState, *, within: float = STATE_WRITE_WITHIN,
                  job: str = "") -> None:
        """Write the desired state (the pool's, or job `job`'s), retried through a reconnect
        or a cluster's leader election for up to `within` seconds (a KV put is a publish to
        the bucket's stream)."""
        await self._put(*self._prepared(state, job), within=within)

    @contextlib.asynccontextmanager
    async def written(self, state: DesiredState, *, within: float = STATE_WRITE_WITHIN,
                      job: str = "") -> AsyncIterator[None]:
        """Write the job's desired state while the body runs: sent on entry, and once the
        body is done its PubAck awaited (missing: sent again as `put` does, for up to
        `within` seconds). A body that raises leaves the write unconfirmed (it may be
        stored). No task runs beside the body: a pipelined publish is all it costs."""
        subject, data, hdrs = self._prepared(state, job)
        fut = None
        first = not self.pub.refusals.cleared(subject)
        if first:  # not written through this connection yet: stored first, a refusal looked for
            await self._put(subject, data, hdrs, within=within)
        elif self.pub.nc.is_connected:
            with contextlib.suppress(*TRANSIENT):
                fut = await self.pub.send_stored(subject, data, hdrs)
        try:
            yield
        except BaseException:
            if fut is not None:  # nobody awaits its PubAck: its pending slot is freed now
                fut.cancel()
                self.pub.link.pending_acks.discard(fut)
            raise
        if first:
            return  # stored above
        if fut is not None:
            with contextlib.suppress(*TRANSIENT):
                await self.pub.pub_ack(fut, timeout=PUB_ACK_TIMEOUT)
                return
        # no PubAck (a reconnect, a leader election): a stored one is dropped as a duplicate
        await self._put(subject, data, hdrs, within=within)

    def _prepared(self, state: DesiredState, job: str = "") -> tuple[str, bytes, dict[str, str]]:
        serial = next(self._serials)
        state = msgspec.structs.replace(state, writer=self._writer, serial=serial)
        key = job_state_key(job) if job else STATE_KEY
        if not job:  # commands are ordered against the pool's state only
            self.mark = f"{self._writer}.{serial}"
        return (f"$KV.{self.subjects.state_bucket}.{key}", encode(state),
                {"Nats-Msg-Id": f"state-{self._writer}.{serial}"})

    async def _put(self, subject: str, data: bytes, hdrs: dict[str, str], *,
                   within: float) -> None:
        bucket = self.subjects.state_bucket
        try:
            await self.pub.persist(subject, data, hdrs, until=time.time() + within)
        except TRANSIENT as exc:
            if storage_refused(exc):
                raise BusError(f"the job's desired state was not stored: JetStream has no room "
                               f"({exc}); free or raise the server's JetStream store") from exc
            raise BusError(
                f"the job's desired state was not stored within {within}s (bucket {bucket}: "
                f"{type(exc).__name__}: {exc}); on a NATS cluster a node may be down while "
                "its streams elect new leaders, which takes seconds: retry the call") from exc

    async def checkpoint_claim(self) -> CheckpointClaim | None:
        """The job's version-0 checkpoint, if a worker claimed one (`CheckpointClaim`)."""
        return await self._get(CHECKPOINT_KEY, CheckpointClaim, "checkpoint claim")

    async def claim_checkpoint(self, claim: CheckpointClaim) -> CheckpointClaim:
        """Make `claim` the job's version-0 checkpoint unless one is already claimed; returns
        the claim that holds (this one, or the first). A claim cleared (`rlfabric ctl
        reset-state`) or unreadable is claimed over."""
        subject = f"$KV.{self.subjects.state_bucket}.{CHECKPOINT_KEY}"
        until = time.time() + STATE_WRITE_WITHIN
        expect, delay = 0, 0.005
        while True:
            try:
                await self.pub.persist(subject, encode(claim),
                                       {"Nats-Expected-Last-Subject-Sequence": str(expect)},
                                       until=until)
                return claim
            except nats.js.errors.APIError as exc:
                if exc.err_code not in JS_WRONG_LAST_SEQUENCE:
                    raise
            held, last = await self._entry(CHECKPOINT_KEY, CheckpointClaim, "checkpoint claim")
            if held is not None:
                return held
            if last != expect:  # a delete marker or garbage to write over
                expect = last
                continue
            # on a cluster (10164) the winner may not be applied yet, so nothing was read; or
            # its write failed after all: the claim is tried again
            if time.time() >= until:
                raise BusError(
                    f"the version-0 checkpoint claim (bucket {self.subjects.state_bucket}) "
                    f"was lost to another writer whose claim could not be read within "
                    f"{STATE_WRITE_WITHIN:g}s; retry, or clear it with `rlfabric ctl "
                    "reset-state`")
            await anyio.sleep(delay)  # no event says that the winner's write was applied
            delay = min(2 * delay, 0.1)
