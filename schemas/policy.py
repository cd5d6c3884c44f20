"""Policy identity: the name of the weights that produced a token, unique across runs.

Version numbers are counters within a run: two runs both have a version 3. A policy is named by
the run that pushed it, its version there and the digest of its weights; an adapter's policy
also by its name and by the base policy it runs on. Workers stamp every `VersionSpan` with the
policy that produced its tokens; whatever trains on a result compares those names with what it
pushed (`rlfabric.trainer.policies`).

A name is short text, readable in an error message:

    base:     <run>/<version>/<digest>            e.g. 3f9a0c1e/12/9e107d9d372bb682
    adapter:  <run>/<name>/<version>/<digest>@<base policy>

A worker that serves the checkpoint it started from (no push) names it with the run
`checkpoint` and the checkpoint's weights checksum.
"""

from __future__ import annotations

#: the run of the weights a worker started from (no trainer pushed them)
CHECKPOINT = "checkpoint"
#: characters of a digest kept in a policy name (64 bits: a check against a wrong payload
#: within one run and version, which the run and version already tell apart)
DIGEST_CHARS = 16


def base_policy(run: str, version: int, digest: str) -> str:
    """The name of base weights `digest` pushed by `run` as `version`."""
    return f"{run or CHECKPOINT}/{version}/{_short(digest)}"


def checkpoint_policy(checksum: str, version: int = 0) -> str:
    """The name of a checkpoint served as `version` without a push (by its weights checksum)."""
    return base_policy(CHECKPOINT, version, checksum)


def adapter_policy(run: str, name: str, version: int, digest: str, base: str) -> str:
    """The name of adapter `name`'s `version` (tensors `digest`), pushed by `run`, served on
    the base policy `base`."""
    return f"{run}/{name}/{version}/{_short(digest)}@{base}"


def run_of(policy: str) -> str:
    """The run a policy name belongs to ("" for an empty name)."""
    return policy.split("/", 1)[0] if policy else ""


def _short(digest: str) -> str:
    return digest.rsplit(":", 1)[-1][:DIGEST_CHARS]
