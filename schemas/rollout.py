"""Data-plane messages: trainer -> workers (`RolloutRequest`), workers -> trainer (results).

Who sends what:
- the trainer's `FabricClient` publishes `RolloutRequest` to `<prefix>.rollout.request`;
- a worker answers each sample with `RolloutResult`, or the whole request with
  `RolloutError`, on `<prefix>.rollout.result.<client_id>`;
- for a request with `stream` set, the worker also sends `TokenDelta`s while it samples,
  those it has at once for one client as one `TokenDeltas`, on core NATS
  `<prefix>.stream.<client_id>` (a preview: the persisted result is the record).
Both sides batch: several requests submitted together travel as one `RolloutRequests` (header
`rlf-count`), and the replies a worker finished together for one client as one
`RolloutReplies`.
"""

from __future__ import annotations

from typing import Literal

from rlfabric.schemas._base import Message, PackedF32, PackedI32, coerce_packed

FinishReason = Literal["stop", "length", "abort", "error"]


class SamplingParams(Message, frozen=True, kw_only=True):
    """How to sample. `top_k=0` and `top_p=1.0` mean off; `logprobs` is the top-k count
    returned per token beside the sampled token's own logprob (0 = sampled token only)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1
    logprobs: int = 0


class RolloutRequest(Message, frozen=True, kw_only=True):
    """One prompt to complete `sampling.n` times. `deadline` is unix time in seconds (0 = none);
    a worker never serves weights older than `min_weight_version`. `submission_id` is minted
    by the client at each submit (a reused `request_id` is a new request: results of an older
    submission never answer it); results carry it back. `stream`: send `TokenDelta`s of every
    sample while it is sampled. `adapter` names a LoRA adapter (empty: the base model); then
    `min_weight_version` bounds the adapter's version, and `adapter_version` (if >= 0) asks for
    exactly that version, which must still be loaded (else `version_unavailable`). `run`
    (if set) is the run whose weights may serve it (its base, or the adapter's versions): a
    worker holding another run's waits for this run's push, as for a newer version. `job`
    is the job it belongs to ("": the default job): its adapter is named within that job, and
    that job's pause holds it. `migration`: what the client does with a sample a draining worker
    hands back unfinished (`RolloutResult.moved`): `continue` it on another worker from the
    tokens already sampled (they are kept as they were), or `restart` it from its prompt."""

    request_id: str
    prompt_token_ids: PackedI32
    sampling: SamplingParams = SamplingParams()
    client_id: str = ""
    submission_id: str = ""
    group_id: str = ""
    min_weight_version: int = 0
    deadline: float = 0.0
    metadata: dict[str, str] = {}
    stream: bool = False
    adapter: str = ""
    adapter_version: int = -1
    run: str = ""
    job: str = ""
    migration: Literal["continue", "restart"] = "continue"

    def __post_init__(self) -> None:
        if type(self.prompt_token_ids) is not PackedI32:  # a list, numpy or torch given
            coerce_packed(self, prompt_token_ids=PackedI32)


class VersionSpan(Message, frozen=True, kw_only=True):
    """Completion tokens `[start, end)` were produced by weight version `version` (of the
    request's adapter, if it names one; the base weights then serve as they are), whose full
    name is `policy` (`rlfabric.schemas.policy`: run, version, digest; set by the worker), on
    worker `worker` (a sample that moved has a span per worker)."""

    version: int
    start: int
    end: int
    policy: str = ""
    worker: str = ""


class TopLogprobs(Message, frozen=True, kw_only=True):
    """Top-k alternatives per completion token, row-major: `ids[t*k:(t+1)*k]`."""

    k: int
    ids: PackedI32
    logprobs: PackedF32

    def __post_init__(self) -> None:
        coerce_packed(self, ids=PackedI32, logprobs=PackedF32)


class Timings(Message, frozen=True, kw_only=True):
    """Seconds: waiting in the stream, generating, and in total as the worker saw it."""

    queued_s: float = 0.0
    generate_s: float = 0.0
    total_s: float = 0.0


class RolloutResult(Message, tag_field="kind", tag="result", frozen=True, kw_only=True):
    """One sample of one request. `logprobs[i]` is the logprob of `completion_token_ids[i]`
    under the weights of the span that covers `i`. `moved`: the worker of that id was drained
    mid-sample and hands over what it sampled (finish `abort`); the client continues it
    elsewhere (`RolloutRequest.migration`) and answers its caller once, with every token."""

    request_id: str
    sample_index: int = 0
    worker_id: str
    completion_token_ids: PackedI32
    logprobs: PackedF32
    finish_reason: FinishReason
    version_spans: tuple[VersionSpan, ...] = ()
    top_logprobs: TopLogprobs | None = None
    group_id: str = ""
    prompt_len: int = 0
    timings: Timings = Timings()
    #: delivery attempt of the request that produced it (> 1: redelivered after a worker
    #: died, timed out or handed it back)
    attempt: int = 1
    submission_id: str = ""
    moved: str = ""

    def __post_init__(self) -> None:
        if type(self.completion_token_ids) is not PackedI32 or \
                type(self.logprobs) is not PackedF32:  # a list, numpy or torch given
            coerce_packed(self, completion_token_ids=PackedI32, logprobs=PackedF32)


class RolloutError(Message, tag_field="kind", tag="error", frozen=True, kw_only=True):
    """A request a worker could not serve. `code` is stable (e.g. `bad_request`,
    `prompt_too_long`, `deadline_exceeded`, `engine_error`); `retryable` says whether
    resubmitting the same request can succeed."""

    request_id: str
    worker_id: str
    code: str
    message: str
    sample_index: int | None = None
    group_id: str = ""
    retryable: bool = False
    submission_id: str = ""


RolloutReply = RolloutResult | RolloutError


class TokenDelta(Message, frozen=True, kw_only=True):
    """Tokens of one sample just sampled, sent on core NATS while it generates (each step of
    a request with `stream` set; every 32 tokens or so of another, where its engine can):
    completion tokens `[start, start + len(token_ids))`, their logprobs, the weight version
    and the policy (`rlfabric.schemas.policy`) that produced them. Core NATS may drop one: a
    receiver that sees a gap in `start` waits for the persisted `RolloutResult`, which holds
    every token."""

    request_id: str
    submission_id: str = ""
    sample_index: int = 0
    start: int
    token_ids: PackedI32
    logprobs: PackedF32
    version: int = -1
    top_logprobs: TopLogprobs | None = None
    policy: str = ""
    #: set on a sample's last delta where the engine knows it is the last ("stop", "length")
    finish: str = ""

    def __post_init__(self) -> None:
        coerce_packed(self, token_ids=PackedI32, logprobs=PackedF32)


class TokenDeltas(Message, frozen=True, kw_only=True):
    """The deltas worker `worker_id` had for one client at once (one decode step of many
    requests), in one core message: what `<prefix>.stream.<client_id>` carries. `taken`:
    requests it just took from the shared queue (request id -> submission id), sent without
    deltas: should that worker leave before answering them, the client sends them on at once
    (from the tokens their deltas brought) instead of waiting for the stream's ack wait."""

    deltas: list[TokenDelta]
    taken: dict[str, str] = {}
    worker_id: str = ""


class RolloutRequests(Message, frozen=True, kw_only=True):
    """Several requests in one persisted message: a `generate` call's batch, or requests
    submitted together by concurrent calls. Redelivered as a whole; the client drops what it
    already has."""

    requests: list[RolloutRequest]


class RolloutCancel(Message, frozen=True, kw_only=True):
    """A client gave up on requests it sent (the `generate` call that sent them ended before
    their answers came; a gateway's client hung up): a worker sampling one stops, one that
    pulls one later skips it, and neither is answered. Core NATS on
    `Subjects.rollout_cancel(job)`, heard by every worker (one that misses it samples the
    request to its end, as if no cancel had been sent)."""

    client_id: str
    submission_ids: list[str]


class RolloutReplies(Message, tag_field="kind", tag="replies", frozen=True, kw_only=True):
    """The replies a worker finished together for one client, in one persisted message."""

    replies: list[RolloutResult | RolloutError]
