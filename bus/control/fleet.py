"""Reads of the fleet, once (no watch): who is a member, whether a worker answers, how deep the
job's streams are. `rlfabric status`, the membership watcher and quorum waits use them."""

from __future__ import annotations

import logging
from typing import Literal

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from rlfabric.bus.nats.provision import Buckets
from rlfabric.bus.subjects import Subjects
from rlfabric.concurrency import RateLimited
from rlfabric.schemas import SchemaError, WorkerInfo, codec_for

PingResult = Literal["alive", "dead", "silent"]
log = logging.getLogger("rlfabric.bus")
_garbage = RateLimited(log)


class FleetReads:
    def __init__(self, nc: NATS, js: JetStreamContext, subjects: Subjects,
                 buckets: Buckets | None) -> None:
        self.nc = nc
        self.js = js
        self.subjects = subjects
        self._buckets = buckets

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
        """The current members as stored in the KV bucket."""
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

    async def delete_job(self) -> list[str]:
        """Delete every stream and bucket of the job (and the storage JetStream set aside for
        them); the names of those that existed."""
        s = self.subjects
        gone: list[str] = []
        for name in (s.rollout_stream, s.results_stream, s.control_stream, s.weights_stream,
                     s.sessions_stream, s.events_stream, f"KV_{s.members_bucket}",
                     f"KV_{s.state_bucket}", f"KV_{s.affinity_bucket}"):
            try:
                await self.js.delete_stream(name)
            except NotFoundError:
                continue
            gone.append(name)
        return gone

    async def stream_depths(self) -> dict[str, int | None]:
        """Messages held per stream (None if the stream does not exist), and the rollout
        requests not yet delivered to any worker (every job's)."""
        s = self.subjects
        out: dict[str, int | None] = {}
        for name in (s.rollout_stream, s.results_stream, s.control_stream, s.weights_stream,
                     s.sessions_stream, s.events_stream):
            try:
                out[name] = (await self.js.stream_info(name)).state.messages
            except NotFoundError:
                out[name] = None
        try:  # the pool's consumer and each job's
            cis = await self.js.consumers_info(s.rollout_stream)
            out["rollout_pending"] = sum(ci.num_pending or 0 for ci in cis)
            out["rollout_in_flight"] = sum(ci.num_ack_pending or 0 for ci in cis)
        except NotFoundError:
            pass
        return out
