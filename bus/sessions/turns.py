"""One turn of a session in flight, across every gateway replica of a job.

A turn claims its session before anything is sampled: a key (`turn.<session key>`) created in
the job's affinity bucket, which the server creates only if it is absent, so of two turns of
one session on any gateways exactly one gets it; the other is refused at once. The claim is
deleted when the turn ends. It names when it lapses (`until`): a claim left by a gateway that
died is taken over once that time has passed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec
import nats.errors
import nats.js.errors

from rlfabric.bus.rollouts.affinity import affinity_key
from rlfabric.bus.session import Bus

log = logging.getLogger("rlfabric.bus")


class _Held(msgspec.Struct, frozen=True):
    by: str
    until: float


@dataclass(frozen=True)
class Claim:
    key: str
    revision: int


@dataclass(frozen=True)
class Taken:
    """The session's turn in flight: who holds it, and until when at most."""

    by: str
    until: float


class TurnClaims:
    def __init__(self, bus: Bus) -> None:
        self.kv = bus.buckets.affinity
        self._enc = msgspec.json.Encoder()
        self._dec = msgspec.json.Decoder(_Held)

    async def claim(self, session_id: str, *, by: str, hold_for: float) -> Claim | Taken:
        """The session's turn for `by`, or who holds it."""
        if self.kv is None:  # a job provisioned before the bucket: no claim to take
            return Claim("", 0)
        key = "turn." + affinity_key(session_id)
        value = self._enc.encode(_Held(by=by, until=time.time() + hold_for))
        try:
            return Claim(key, await self.kv.create(key, value))
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        try:
            entry = await self.kv.get(key)
        except nats.js.errors.KeyNotFoundError:  # released meanwhile: one more try
            try:
                return Claim(key, await self.kv.create(key, value))
            except nats.js.errors.KeyWrongLastSequenceError:
                return Taken(by="another turn", until=time.time() + hold_for)
        try:
            held = self._dec.decode(entry.value or b"")
        except msgspec.DecodeError:  # unreadable: lapsed
            held = _Held(by="", until=0.0)
        if held.until > time.time():
            return Taken(by=held.by, until=held.until)
        try:  # lapsed: its gateway died mid-turn
            return Claim(key, await self.kv.update(key, value, last=entry.revision))
        except nats.js.errors.KeyWrongLastSequenceError:
            return Taken(by="another turn", until=time.time() + hold_for)

    async def release(self, claim: Claim) -> None:
        """Delete the claim (failures are logged: it lapses at its `until`)."""
        if self.kv is None or not claim.key:
            return
        try:
            await self.kv.delete(claim.key, last=claim.revision)
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("releasing the turn claim %s failed (%s); it lapses at its deadline",
                        claim.key, exc)
