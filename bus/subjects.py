"""Names on the bus, all derived from one pool prefix (default `rl`; DESIGN section 3).

Two pools on one NATS server use two prefixes and never see each other's traffic. Within a
pool, what a job's client sends and receives (`rlfabric.schemas.jobs`) travels on subjects that
name the job, so that the server's permissions can hold each job to its own (`job_permissions`
in `rlfabric.bus.nats.auth`): its requests (`rollout_request_of`), results and token deltas (the
`job` argument), and its commands (`control`, `live`: `<prefix>.control.job.<job>.<op>`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rlfabric.bus.errors import InvalidName
from rlfabric.schemas import SCHEMA_MAJOR

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: keys of the `<prefix>_state` bucket: the trainer's desired state, and version 0 of a job no
#: trainer pushed weights to (`CheckpointClaim`, written once by the first worker)
STATE_KEY = "desired"
CHECKPOINT_KEY = "checkpoint"


def is_token(value: str) -> bool:
    """Whether `value` can be one NATS subject token and a JetStream name: 1-64 characters
    from A-Z a-z 0-9 _ - (the whole string: a `match` ending in `$` let a trailing newline
    through)."""
    return _TOKEN.fullmatch(value) is not None


def check_token(value: str, what: str) -> str:
    """Return `value` if it can be one NATS subject token and a JetStream name; else raise."""
    if not is_token(value):
        raise InvalidName(
            f"{what} {value!r} is not usable on the bus: use 1-64 characters from "
            "A-Z a-z 0-9 _ - (no dots, spaces or wildcards)"
        )
    return value


@dataclass(frozen=True, slots=True)
class Subjects:
    prefix: str = "rl"

    def __post_init__(self) -> None:
        check_token(self.prefix, "subject prefix")

    # ---- streams, consumers, buckets ----
    @property
    def _upper(self) -> str:
        return self.prefix.upper().replace("-", "_")

    @property
    def rollout_stream(self) -> str:
        return f"{self._upper}_ROLLOUT"

    @property
    def results_stream(self) -> str:
        return f"{self._upper}_RESULTS"

    def results_stream_of(self, job: str) -> str:
        """Job `job`'s results: a stream of its own, which only it (and the pool's trainer)
        may read under per-job credentials."""
        return f"{self._upper}_RESULTS_{check_token(job, 'job')}" if job else \
            self.results_stream

    @property
    def control_stream(self) -> str:
        return f"{self._upper}_CONTROL"

    @property
    def weights_stream(self) -> str:
        return f"{self._upper}_WEIGHTS"

    @property
    def sessions_stream(self) -> str:
        return f"{self._upper}_SESSIONS"

    @property
    def events_stream(self) -> str:
        """The fleet's events, kept (capped): joins, leaves, state changes, commands' outcomes,
        errors (`rlfabric events`)."""
        return f"{self._upper}_EVENTS"

    @property
    def events_kept(self) -> list[str]:
        """The event subjects the events stream keeps: every kind but beats."""
        return [self.events(kind, "*") for kind in ("state", "error", "command", "member")]

    @property
    def rollout_consumer(self) -> str:
        """The one durable consumer every worker pulls from: the workers' queue group."""
        return f"{self._upper}_WORKERS"

    def consumer_of(self, job: str) -> str:
        """The durable consumer job `job`'s requests are pulled from (the pool's: the
        workers' queue group); one per job, so that each worker chooses between the jobs with
        work (`rlfabric.worker.fair`) rather than taking one queue's order."""
        return f"{self.rollout_consumer}_{check_token(job, 'job')}" if job else \
            self.rollout_consumer

    @property
    def members_bucket(self) -> str:
        return f"{self.prefix}_members"

    @property
    def state_bucket(self) -> str:
        return f"{self.prefix}_state"

    @property
    def affinity_bucket(self) -> str:
        """session key -> the worker that served its last turn"""
        return f"{self.prefix}_affinity"

    # ---- subjects ----
    @property
    def rollout_request(self) -> str:
        return f"{self.prefix}.rollout.request"

    def rollout_request_of(self, job: str) -> str:
        """Where job `job`'s client sends its requests (the pool's own subject for "")."""
        return f"{self.rollout_request}.{check_token(job, 'job')}" if job else \
            self.rollout_request

    def job_of_request(self, subject: str) -> str:
        """The job whose subject a request came on ("" for the pool's own)."""
        return subject[len(self.rollout_request) + 1:] if subject != self.rollout_request \
            else ""

    def rollout_cancel(self, job: str = "") -> str:
        """Where job `job`'s clients say which of their requests they gave up on
        (`RolloutCancel`); every worker listens (`rollout_cancels_all`)."""
        base = f"{self.prefix}.rollout.cancel"
        return f"{base}.{check_token(job, 'job')}" if job else base

    @property
    def rollout_cancels_all(self) -> tuple[str, str]:
        """The pool's own cancel subject and every job's."""
        return self.rollout_cancel(), f"{self.rollout_cancel()}.>"

    def job_of_cancel(self, subject: str) -> str:
        """The job whose subject a cancel came on ("" for the pool's own)."""
        return subject[len(self.rollout_cancel()) + 1:]

    def rollout_result(self, client_id: str, job: str = "") -> str:
        scope = f"{check_token(job, 'job')}." if job else ""
        return f"{self.prefix}.rollout.result.{scope}{check_token(client_id, 'client id')}"

    @property
    def rollout_results_all(self) -> str:
        """The pool's own clients' results (a job's are `rollout_results_of(job)`)."""
        return f"{self.prefix}.rollout.result.*"

    def rollout_results_of(self, job: str) -> str:
        return f"{self.prefix}.rollout.result.{check_token(job, 'job')}.*" if job else \
            self.rollout_results_all

    def token_stream(self, client_id: str, job: str = "") -> str:
        """Core NATS: the token deltas of a client's streamed requests (`TokenDelta`)."""
        scope = f"{check_token(job, 'job')}." if job else ""
        return f"{self.prefix}.stream.{scope}{check_token(client_id, 'client id')}"

    @property
    def token_streams_all(self) -> str:
        return f"{self.prefix}.stream.>"

    def session(self, key: str) -> str:
        """A session's records (`SessionTurn`, `SessionEnd`); `key` from `session_key`."""
        return f"{self.prefix}.session.{check_token(key, 'session key')}"

    @property
    def sessions_all(self) -> str:
        return f"{self.prefix}.session.>"

    def control(self, op: str, job: str = "") -> str:
        return f"{self.prefix}.control.{_job_part(job)}{op}"

    @property
    def control_all(self) -> str:
        return f"{self.prefix}.control.>"

    def live(self, op: str, job: str = "") -> str:
        """Core NATS: where the copies of persisted `op` commands go straight to every worker
        (what spans name). Each copy's subject adds the schema major it is written in and
        its control-stream sequence (`live_copy`): read from the subject's tokens, no header
        to parse per worker and command."""
        return f"{self.prefix}.live.{_job_part(job)}{op}"

    def live_copy(self, op: str, seq: int, job: str = "") -> str:
        return f"{self.live(op, job)}.{SCHEMA_MAJOR}.{int(seq)}"

    @staticmethod
    def job_of_command(subject: str) -> str | None:
        """The job a command's subject (`control` or `live`, without a live copy's tail)
        names, or None for the pool's."""
        parts = subject.split(".")
        return parts[3] if len(parts) == 5 and parts[2] == "job" else None

    @staticmethod
    def live_parts(subject: str) -> tuple[str, int, int] | None:
        """`(live(op), schema major, seq)` of a `live_copy` subject; None if it is not one."""
        head, _, seq = subject.rpartition(".")
        live, _, major = head.rpartition(".")
        if not (live and major.isdecimal() and seq.isdecimal()):
            return None
        return live, int(major), int(seq)

    @property
    def live_all(self) -> str:
        return f"{self.prefix}.live.>"

    def ack(self, cmd_id: str) -> str:
        return self.ack_prefix + check_token(cmd_id, "command id")

    @property
    def ack_prefix(self) -> str:
        """`ack(cmd_id)` is this + cmd_id (for a hot path whose cmd_id passed `is_token`)."""
        return f"{self.prefix}.ack."

    @property
    def ack_all(self) -> str:
        return f"{self.prefix}.ack.*"

    def ping(self, worker_id: str) -> str:
        return f"{self.prefix}.worker.{check_token(worker_id, 'worker id')}.ping"

    def offer(self, worker_id: str) -> str:
        """Core NATS: a request offered to one worker (session affinity); it answers whether
        it took it."""
        return f"{self.prefix}.worker.{check_token(worker_id, 'worker id')}.offer"

    def weights(self, version: int, tag: str = "") -> str:
        """Where a push of `version` over the nats transport stores its chunks; `tag` tells
        pushes of one version number apart (two runs, two jobs, or base and adapter)."""
        return f"{self.prefix}.weights.{int(version)}" + (
            f".{check_token(tag, 'weights tag')}" if tag else "")

    def peer_weights(self, digest: str) -> str:
        """Core NATS, a `PeerAsk`: the workers keeping the packed version `digest` answer it,
        one of them (queue group `peers`) with a `PeerOffer`."""
        return f"{self.prefix}.peers.weights.{check_token(digest, 'digest')}"

    @property
    def weights_all(self) -> str:
        return f"{self.prefix}.weights.>"

    def beat(self, worker_id: str) -> str:
        """Core NATS, a `Beats` message: the workers of one connection are alive (every
        quarter of `member_ttl`); named after the first of them."""
        return f"{self.prefix}.events.beat.{check_token(worker_id, 'worker id')}"

    @property
    def beats(self) -> str:
        return f"{self.prefix}.events.beat.*"

    def events(self, kind: str, source: str) -> str:
        """Core NATS, an `Event` of `kind` sent by `source` (kept by the events stream)."""
        return f"{self.prefix}.events.{kind}.{source}"

    @property
    def events_all(self) -> str:
        return f"{self.prefix}.events.>"


def _job_part(job: str) -> str:
    return f"job.{check_token(job, 'job')}." if job else ""
