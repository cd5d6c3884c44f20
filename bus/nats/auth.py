"""Per-role access for one job: an nkey per role and a nats-server `authorization` block
whose subject permissions let each role do its part and nothing else.

    setup = write_auth("/etc/rlfabric/job1", prefix="rl")   # DIR/<role>.nk, DIR/auth.conf
    EmbeddedNats(extra_config=setup.config)                  # or include auth.conf yourself

Roles:
- `trainer`: the job's operator: control commands, the desired state (`<prefix>_state`),
  weights, rollout requests and results, membership repair, JetStream management.
- `worker`: creates the job's streams if it comes first, pulls rollout requests, receives the
  live copies of commands (`<prefix>.live.>`) and reads the control stream by sequence,
  publishes results, acks, events and membership keys, answers pings, reads weights and the
  desired state. Never publishes `<prefix>.control.*` or `<prefix>.live.*`, never writes
  `<prefix>_state`, never updates, purges or deletes a stream or the workers' consumer.
- `gateway` (`rlfabric gateway`): submits rollout requests and reads their results and token
  deltas, keeps agent sessions (`<prefix>.session.>`), reads membership and the desired state.
  Never publishes a command, never writes membership or the desired state.
- `observer` (`rlfabric status`): reads stream and consumer info, both buckets and events;
  publishes nothing but read-only JetStream API requests.

A job (`rlfabric.schemas.jobs`; `rlfabric job create NAME --auth DIR`) gets a key of its own,
`DIR/jobs/<job>.nk`, whose permissions (`job_permissions`) hold it to its own subjects: it sends
requests on `<prefix>.rollout.request.<job>` only, reads its own results (its own stream) and
token deltas only, sends commands on `<prefix>.control.job.<job>.*` only (a worker applies
there a pause, resume, adapter push or unload naming that job, nothing else), writes its own
desired state (`job.<job>` in `<prefix>_state`) only. It cannot pause the pool, push base
weights, read another job's results or the gateway's sessions, or send as another job. It
pushes adapters over shm or filesystem (the nats transport purges the shared weights stream,
which no job may).

All workers share the worker key, so the server cannot tell one worker's membership key from
another's; give each worker a user of its own (the same permissions
with its id in place of the wildcards) where that matters.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import nkeys

from rlfabric.bus.subjects import CHECKPOINT_KEY, STATE_KEY, Subjects, check_token
from rlfabric.schemas import job_state_key

ROLES: tuple[str, ...] = ("trainer", "worker", "gateway", "observer")
#: the folder of the key directory holding each job's key (`<job>.nk`)
JOBS = "jobs"
#: where `rlfabric nats --auth DIR` writes its server's pid (for a config reload)
PID_FILE = "nats.pid"



@dataclass(frozen=True, slots=True)
class Permissions:
    publish_allow: tuple[str, ...]
    subscribe_allow: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    allow_responses: bool = False

    def as_config(self) -> dict[str, object]:
        publish: dict[str, object] = {"allow": list(self.publish_allow)}
        if self.publish_deny:
            publish["deny"] = list(self.publish_deny)
        out: dict[str, object] = {"publish": publish,
                                  "subscribe": {"allow": list(self.subscribe_allow)}}
        if self.allow_responses:
            out["allow_responses"] = True
        return out


def permissions(role: str, s: Subjects) -> Permissions:
    """What `role` may publish and subscribe to in job `s.prefix`."""
    by_role = {"trainer": _trainer, "worker": _worker, "gateway": _gateway,
               "observer": _observer}
    if role not in by_role:
        raise ValueError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
    return by_role[role](s)


_API = "$JS.API"


def _streams(s: Subjects) -> tuple[str, ...]:
    return (s.rollout_stream, s.results_stream, s.control_stream, s.weights_stream,
            s.sessions_stream, s.events_stream, f"KV_{s.members_bucket}", f"KV_{s.state_bucket}",
            f"KV_{s.affinity_bucket}")


def _read(s: Subjects) -> list[str]:
    """What every role may ask of JetStream: stream and consumer info, bucket reads and
    watches."""
    buckets = (f"KV_{s.members_bucket}", f"KV_{s.state_bucket}", f"KV_{s.affinity_bucket}")
    return [
        f"{_API}.INFO", f"{_API}.STREAM.NAMES",
        *(f"{_API}.STREAM.INFO.{x}" for x in _streams(s)),
        *(f"{_API}.CONSUMER.INFO.{x}.>" for x in _streams(s)),
        f"{_API}.CONSUMER.LIST.{s.rollout_stream}", f"{_API}.CONSUMER.NAMES.{s.rollout_stream}",
        *(f"{_API}.DIRECT.GET.{b}.>" for b in buckets),
        *(f"{_API}.DIRECT.GET.{b}" for b in buckets),
        *(f"{_API}.STREAM.MSG.GET.{b}" for b in buckets),
        # ordered consumers: bucket watches and key listings, the events read back
        *(f"{_API}.CONSUMER.CREATE.{b}{t}" for b in (*buckets, s.events_stream)
          for t in ("", ".>")),
        "$JS.FC.>",
    ]


def _trainer(s: Subjects) -> Permissions:
    return Permissions(
        publish_allow=(f"{s.prefix}.>", f"{_API}.>", f"$KV.{s.members_bucket}.>",
                       f"$KV.{s.state_bucket}.>", f"$KV.{s.affinity_bucket}.>", "$JS.ACK.>",
                       "$JS.FC.>", "_INBOX.>"),
        subscribe_allow=(f"{s.prefix}.>", "_INBOX.>"),
    )


def _worker(s: Subjects) -> Permissions:
    p, api = s.prefix, _API
    ctl, roll, w = s.control_stream, s.rollout_stream, s.weights_stream
    return Permissions(
        publish_allow=(
            *_read(s),
            *(f"{api}.STREAM.CREATE.{x}" for x in _streams(s)),  # whoever comes first
            f"{api}.STREAM.MSG.GET.{ctl}",  # a gap in the live commands, from the log
            # the pool's consumer and each job's (`Subjects.consumer_of`), quota as set
            f"{api}.CONSUMER.CREATE.{roll}.*", f"{api}.CONSUMER.CREATE.{roll}.*.>",
            f"{api}.CONSUMER.DURABLE.CREATE.{roll}.*",
            f"{api}.CONSUMER.MSG.NEXT.{roll}.*",
            f"{api}.CONSUMER.CREATE.{w}", f"{api}.CONSUMER.CREATE.{w}.>",
            f"$JS.ACK.{roll}.>",
            f"{p}.rollout.result.>", f"{p}.ack.>", f"{p}.events.>",
            f"{p}.stream.>",  # token deltas of streamed requests
            f"{p}.worker.*.ping",  # a new worker asks whether its id is taken
            f"{p}.rollout.request",  # an offered request it hands back goes to the queue
            f"$KV.{s.members_bucket}.>",
            f"$KV.{s.state_bucket}.{CHECKPOINT_KEY}",  # version 0 with no trainer
        ),
        publish_deny=(f"{p}.control.>", f"{p}.live.>",
                      f"$KV.{s.state_bucket}.{STATE_KEY}",
                      f"{api}.STREAM.UPDATE.>", f"{api}.STREAM.DELETE.>",
                      f"{api}.STREAM.PURGE.>", f"{api}.STREAM.MSG.DELETE.>",
                      f"{api}.CONSUMER.DELETE.{roll}.>"),
        subscribe_allow=("_INBOX.>", f"{p}.worker.*.ping", f"{p}.worker.*.offer",
                         f"{p}.live.>", *s.rollout_cancels_all),
        allow_responses=True,  # ping answers
    )


def _gateway(s: Subjects) -> Permissions:
    p, api = s.prefix, _API
    roll, res, ses = s.rollout_stream, s.results_stream, s.sessions_stream
    return Permissions(
        publish_allow=(
            *_read(s),
            *(f"{api}.STREAM.CREATE.{x}" for x in _streams(s)),  # whoever comes first
            f"{api}.CONSUMER.CREATE.{roll}.{s.rollout_consumer}.>",
            f"{api}.CONSUMER.DURABLE.CREATE.{roll}.{s.rollout_consumer}",
            f"{api}.CONSUMER.CREATE.{res}", f"{api}.CONSUMER.CREATE.{res}.>",
            f"{api}.DIRECT.GET.{ses}", f"{api}.DIRECT.GET.{ses}.>",
            f"{p}.rollout.request", f"{p}.session.>", f"{p}.events.>",
            *s.rollout_cancels_all,  # a turn whose agent hung up
            f"{p}.worker.*.offer", f"$KV.{s.affinity_bucket}.>",  # session affinity
        ),
        publish_deny=(f"{p}.control.>", f"{p}.live.>", f"$KV.{s.state_bucket}.>",
                      f"$KV.{s.members_bucket}.>", f"{api}.STREAM.UPDATE.>",
                      f"{api}.STREAM.DELETE.>", f"{api}.STREAM.PURGE.>",
                      f"{api}.STREAM.MSG.DELETE.>", f"{api}.CONSUMER.DELETE.{roll}.>"),
        # sessions: the records other gateways append (this one's copy goes stale)
        subscribe_allow=("_INBOX.>", f"{p}.stream.>", f"{p}.events.>", f"{p}.session.>"),
    )


def job_permissions(job: str, s: Subjects) -> Permissions:
    """What job `job`'s key may publish and subscribe to on pool `s.prefix`."""
    p, api, res = s.prefix, _API, s.results_stream_of(check_token(job, "job"))
    return Permissions(
        publish_allow=(
            *_read(s),
            f"{api}.STREAM.CREATE.{res}", f"{api}.STREAM.INFO.{res}",  # its results' stream
            f"{api}.CONSUMER.CREATE.{res}", f"{api}.CONSUMER.CREATE.{res}.>",
            f"{api}.CONSUMER.INFO.{res}.>", f"{api}.CONSUMER.DELETE.{res}.>",
            s.rollout_request_of(job), s.rollout_cancel(job),
            f"{p}.control.job.{job}.>", f"{p}.live.job.{job}.>",
            f"$KV.{s.state_bucket}.{job_state_key(job)}",
            f"{p}.worker.*.ping",  # a quorum's probe of a silent worker
            f"{p}.events.command.*", f"{p}.events.member.*",  # what its client saw, kept
            "$JS.FC.>", "_INBOX.>",
        ),
        subscribe_allow=("_INBOX.>", f"{p}.ack.*", f"{p}.stream.{job}.>", f"{p}.events.>"),
    )


def _observer(s: Subjects) -> Permissions:
    return Permissions(publish_allow=tuple(_read(s)),
                       subscribe_allow=("_INBOX.>", f"{s.prefix}.events.>"))


@dataclass(slots=True)
class AuthSetup:
    """What `write_auth` wrote: each role's seed file and public key, and the server config
    text (also written as `auth.conf` beside the seeds)."""

    directory: Path
    seed_files: dict[str, Path] = field(default_factory=dict)
    public_keys: dict[str, str] = field(default_factory=dict)
    config: str = ""


def write_auth(directory: str | os.PathLike[str], *, prefix: str = "rl") -> AuthSetup:
    """Write `DIR/<role>.nk` (a user nkey seed, mode 0600; an existing one is kept, so a
    restarted server keeps its clients) and `DIR/auth.conf` for pool `prefix`, with a user for
    every job whose key is in `DIR/jobs` (`add_job`)."""
    s = Subjects(prefix)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    setup = AuthSetup(directory=d)
    users = []
    who = [(role, d / f"{role}.nk", permissions(role, s)) for role in ROLES]
    who += [(f"job {path.stem}", path, job_permissions(path.stem, s))
            for path in sorted((d / JOBS).glob("*.nk"))]
    for name, path, perms in who:
        public = _public_key(path)
        setup.seed_files[name], setup.public_keys[name] = path, public
        text = json.dumps(perms.as_config(), indent=2)
        users.append(f"    # {name}\n    {{ nkey: {json.dumps(public)}, permissions: "
                     + text.replace("\n", "\n    ") + " }")
    setup.config = ("# rlfabric job " + json.dumps(prefix) + ": one nkey per role "
                    "(rlfabric nats --auth)\nauthorization {\n  users = [\n"
                    + ",\n".join(users) + "\n  ]\n}\n")
    (d / "auth.conf").write_text(setup.config)
    return setup


def add_job(directory: str | os.PathLike[str], job: str, *, prefix: str = "rl") -> AuthSetup:
    """Give job `job` a key (`DIR/jobs/<job>.nk`, kept if it exists) and write `DIR/auth.conf`
    again with it; a running server takes it on a config reload (`rlfabric job create`)."""
    jobs = Path(directory) / JOBS
    jobs.mkdir(parents=True, exist_ok=True)
    os.chmod(jobs, 0o700)
    _public_key(jobs / f"{check_token(job, 'job')}.nk")
    return write_auth(directory, prefix=prefix)


def remove_job(directory: str | os.PathLike[str], job: str, *, prefix: str = "rl") -> AuthSetup:
    """Drop job `job`'s key and write `DIR/auth.conf` again without it."""
    (Path(directory) / JOBS / f"{check_token(job, 'job')}.nk").unlink(missing_ok=True)
    return write_auth(directory, prefix=prefix)


def job_keys(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """The jobs with a key in `DIR/jobs`, and their seed files."""
    return {p.stem: p for p in sorted((Path(directory) / JOBS).glob("*.nk"))}


def _public_key(path: Path) -> str:
    """The public key of the user seed at `path`, written first (mode 0600) if absent."""
    if path.exists():
        seed = path.read_bytes().strip()
    else:
        seed = nkeys.encode_seed(os.urandom(32),  # type: ignore[no-untyped-call]  # untyped lib
                                 nkeys.PREFIX_BYTE_USER)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(seed + b"\n")
    pair = nkeys.from_seed(seed)  # type: ignore[no-untyped-call]  # untyped lib
    return str(pair.public_key.decode())


def reload_server(directory: str | os.PathLike[str]) -> int | None:
    """Have the server `rlfabric nats --auth DIR` runs read its config again (SIGHUP): the
    pid it serves under, or None if none runs (its pid file is absent or stale)."""
    path = Path(directory) / PID_FILE
    try:
        pid = int(path.read_text().strip())
        os.kill(pid, signal.SIGHUP)
    except (OSError, ValueError):
        return None
    return pid
