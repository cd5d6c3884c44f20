"""Jobs: training runs that share one pool of workers (one base model, one subject prefix).

A job is a name (one subject token; "" is the default job, what a client that names none
uses). Its requests carry it (`RolloutRequest.job`), its adapters are named within it (two
jobs may both call theirs `policy`), and its `Pause` / `Resume` / adapter `UpdateWeights` /
`UnloadAdapter` act on its requests and adapters only. Base weights, sleep, wake, collective
groups and shutdown are the pool's: a command for them names no job.

A worker holds every job's adapters in one engine, under a key that puts the job first
(`adapter_key`): `policy` of job `exp-a` is `exp-a:policy` there, in `WorkerInfo.adapters`
and in the policy names of its results. The default job's adapters keep their bare names, so
an adapter name may not hold the separator.
"""

from __future__ import annotations

import re

from rlfabric.schemas._base import Message

#: between a job and its adapter's name in the engine's key
SEPARATOR = ":"
#: keys of the state bucket holding each job's desired state (adapters, paused)
JOB_STATE_PREFIX = "job."
#: the state-bucket key of the pool's own job's share; a job's is `share.<job>` (`share_key`)
SHARE_KEY = "share"
#: the `pause_mode` of the desired state of a job its pool's operator ended
ENDED = "deleted"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def is_job(name: str) -> bool:
    """Whether `name` can name a job: one subject token (1-64 of A-Z a-z 0-9 _ -)."""
    return _NAME.fullmatch(name) is not None


def adapter_key(job: str, name: str) -> str:
    """The name job `job`'s adapter `name` has in an engine (the default job's: `name`)."""
    return f"{job}{SEPARATOR}{name}" if job and name else name


def job_of_key(key: str) -> str:
    """The job an engine's adapter key belongs to ("" for the default job's)."""
    return key.split(SEPARATOR, 1)[0] if SEPARATOR in key else ""


def job_state_key(job: str) -> str:
    """The state-bucket key of job `job`'s desired state."""
    return JOB_STATE_PREFIX + job


def share_key(job: str) -> str:
    """The state-bucket key of job `job`'s `JobShare`."""
    return f"{SHARE_KEY}.{job}" if job else SHARE_KEY


class JobShare(Message, frozen=True, kw_only=True):
    """What the pool's operator gives a job (`rlfabric job create|set`): its `weight` (workers
    share their tokens between the jobs with work in proportion to their weights) and its
    quota, `max_in_flight` requests in workers at most (0: none; a request past it waits in
    the queue, it is not refused). A job with no share has weight 1 and no quota."""

    weight: float = 1.0
    max_in_flight: int = 0
