"""Fleet state: membership, desired state, quorum reports, events.

- `WorkerInfo` is what each worker keeps under its key in the `<prefix>_members` KV bucket
  (written on change, TTL) and what it answers to a ping.
- `DesiredState` is the one key of the `<prefix>_state` bucket, written by the trainer.
- `MembershipSnapshot` and `FanoutReport` are what the trainer-side SDK returns.
- `ErrorEvent` / `StateEvent` go to `<prefix>.events.>` for operators and telemetry.
"""

from __future__ import annotations

import operator
from typing import Literal

from rlfabric.schemas._base import Message
from rlfabric.schemas.control import Ack, UpdateWeights
from rlfabric.schemas.jobs import JobShare

_WORKER_ID = operator.attrgetter("worker_id")

WorkerState = Literal["starting", "ready", "paused", "updating", "sleeping", "draining"]


class WorkerInfo(Message, frozen=True, kw_only=True):
    """One worker as the fleet sees it. `ranks` = TP x PP ranks it needs in a collective."""

    worker_id: str
    host: str
    pid: int
    engine: str
    model: str
    weight_version: int = -1
    state: WorkerState = "starting"
    capacity: int = 1
    in_flight: int = 0
    ranks: int = 1
    started_at: float = 0.0
    #: when the worker last wrote this key (at every state change, and every third of the
    #: key's TTL; its liveness is its beats, `rlfabric.bus.control.membership`)
    heartbeat_at: float = 0.0
    #: the weights checksum of the checkpoint the worker started from (see `CheckpointClaim`)
    checkpoint: str = ""
    #: LoRA adapters loaded: name -> the versions held (newest last)
    adapters: dict[str, tuple[int, ...]] = {}
    #: the base policy served (`rlfabric.schemas.policy`; "" before any)
    policy: str = ""
    #: why the worker takes no new requests although it is up ("" when it takes them): it is
    #: not on the fleet's desired policy, or cannot tell yet (cut off from the bus)
    behind: str = ""
    #: requests in flight by job (`rlfabric.schemas.jobs`; the default job's under "")
    jobs: dict[str, int] = {}
    #: the jobs whose requests it holds (their own pause; the pool's is `state`)
    paused_jobs: tuple[str, ...] = ()
    #: tokens it served in the last minute, by job (refreshed every few seconds at most)
    job_tokens: dict[str, int] = {}
    #: digests of the packed versions it keeps for a weight delta to apply to
    #: (`UpdateWeights.keep`), one per target; it gives them to peers (`PeerAsk`)
    kept: tuple[str, ...] = ()


class Beats(Message, frozen=True, kw_only=True):
    """The workers of one connection that are alive (core NATS, `<prefix>.events.beat.<id>`,
    every quarter of the job's `member_ttl`; sent without headers, read like a KV value)."""

    worker_ids: tuple[str, ...]


class CheckpointClaim(Message, frozen=True, kw_only=True):
    """Version 0 of a job that no trainer pushed weights to: the checkpoint the first worker
    to join loaded (key `checkpoint` of `<prefix>_state`, written once; once cleared by
    `rlfabric ctl reset-state`, the next worker to join claims again). A worker whose own
    checkpoint has another checksum does not serve it as version 0: mixing two models under
    one version is refused, and `rlfabric status` names the worker."""

    model: str
    checksum: str
    worker_id: str
    at: float = 0.0


class MembershipSnapshot(Message, frozen=True, kw_only=True):
    """The member set at one moment. `epoch` moves on every join/leave the observer saw;
    `fingerprint` is a digest of the sorted worker ids (equal sets, equal fingerprints)."""

    epoch: int
    fingerprint: str
    members: tuple[WorkerInfo, ...] = ()

    @property
    def worker_ids(self) -> tuple[str, ...]:
        return tuple(map(_WORKER_ID, self.members))


class DesiredState(Message, frozen=True, kw_only=True):
    """What the trainer wants the fleet to be: the weight version to serve and how to fetch it
    (`locator`, the last `UpdateWeights`), whether it is paused, the collective group epoch."""

    weight_version: int = -1
    locator: UpdateWeights | None = None
    #: the base policy to serve (`rlfabric.schemas.policy`): a worker on another takes no new
    #: requests until it holds this one ("": none pushed; the checkpoint serves)
    policy: str = ""
    #: LoRA adapters: name -> the update of its newest version (what a joiner loads)
    adapters: dict[str, UpdateWeights] = {}
    paused: bool = False
    pause_mode: str = ""
    group_epoch: int = 0
    updated_at: float = 0.0
    #: the connection that wrote it (a random id per `Bus`) and its count of state writes: a
    #: command names the last write sent before it (header `rlf-state-mark`), so a joiner can
    #: tell a state that lags behind a stored command (two streams keep no common order)
    writer: str = ""
    serial: int = 0


class FleetView(Message, frozen=True, kw_only=True):
    """The fleet at one moment as an operator reads it (`rlfabric.bus.fleet_view`): the one
    model `rlfabric status`, `rlfabric ctl` and `up`'s live view render. `streams`: messages
    each of the job's streams holds (None: absent)."""

    prefix: str
    members: tuple[WorkerInfo, ...] = ()
    desired: DesiredState = DesiredState()
    checkpoint: CheckpointClaim | None = None
    streams: dict[str, int | None] = {}
    at: float = 0.0
    #: each job's desired state (its adapters and pause; `rlfabric.schemas.jobs`), by job
    jobs: dict[str, DesiredState] = {}
    #: each job's weight and quota as its operator set them (a job not named: weight 1)
    shares: dict[str, JobShare] = {}
    #: the last commands sent to the fleet and their outcomes, oldest first (events stream)
    commands: tuple[CommandEvent, ...] = ()

    @property
    def pushed(self) -> bool:
        """Whether a trainer pushed weights to this job (else it serves its checkpoint)."""
        return self.desired.weight_version >= 0 or bool(self.desired.policy)

    @property
    def serving(self) -> int:
        """The version the fleet is to serve: the desired one, or 0 for the checkpoint a
        worker claimed with no push (-1: neither yet)."""
        if self.pushed:
            return self.desired.weight_version
        return 0 if self.checkpoint is not None else -1


class FanoutReport(Message, frozen=True, kw_only=True):
    """The outcome of one broadcast: worker ids that acked ok, acked an error, or never acked
    (`missing`; those a ping found gone are also listed in `dead`). `acks` holds every ack
    received by worker id."""

    cmd_id: str
    op: str
    ok: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    dead: tuple[str, ...] = ()
    acks: dict[str, Ack] = {}
    epoch: int = 0
    elapsed_s: float = 0.0
    phase: str = "done"


class ErrorEvent(Message, tag_field="kind", tag="error", frozen=True, kw_only=True):
    """Something a process could not handle, e.g. a malformed command (code `malformed`)."""

    source: str
    code: str
    message: str
    subject: str = ""
    cmd_id: str = ""
    at: float = 0.0


class StateEvent(Message, tag_field="kind", tag="state", frozen=True, kw_only=True):
    """A worker changed state (joined, paused, updated, left)."""

    source: str
    state: str
    weight_version: int = -1
    at: float = 0.0


class CommandEvent(Message, tag_field="kind", tag="command", frozen=True, kw_only=True):
    """A command's outcome, sent by the client that sent it once its wait for acks ended:
    who acked it, who refused it (worker -> error code) and who never answered, and the
    seconds from its publish to that end."""

    source: str
    cmd_id: str
    op: str
    #: the weight version it pushed (-1: not a push)
    version: int = -1
    ok: tuple[str, ...] = ()
    failed: dict[str, str] = {}
    missing: tuple[str, ...] = ()
    seconds: float = 0.0
    at: float = 0.0


class MemberEvent(Message, tag_field="kind", tag="member", frozen=True, kw_only=True):
    """A worker joined or left, as a client's membership watcher saw it (`why`: how a leave
    was found). Every watcher sends it; the events stream keeps one copy
    (`Nats-Msg-Id` = change, worker id and its start)."""

    source: str
    worker_id: str
    change: Literal["joined", "left"]
    engine: str = ""
    why: str = ""
    at: float = 0.0


#: what the events stream keeps (`<prefix>.events.<kind>.<source>`; beats are not kept)
Event = ErrorEvent | StateEvent | CommandEvent | MemberEvent
