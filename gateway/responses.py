"""A gateway turn (one request on its way) and the OpenAI shapes its results become: each
sample read as the turn's rules say (`final_of`), the chat response, and the helpers the
streamed and completion responses share."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlfabric.gateway.api import (
    ChatChoice,
    ChatCompletion,
    ChoiceLogprobs,
    FunctionOut,
    MessageOut,
    ToolCallOut,
    Usage,
    WeightVersion,
)
from rlfabric.gateway.errors import WORKER_ERRORS, APIError
from rlfabric.gateway.output import Final, OutputRules, clip, finalize, logprob_rows
from rlfabric.gateway.sessions import Session
from rlfabric.gateway.splice import Plan
from rlfabric.schemas import (
    RolloutError,
    RolloutReply,
    RolloutRequest,
    RolloutResult,
    TopLogprobs,
    VersionSpan,
)
from rlfabric.text import ChatFormat


@dataclass(slots=True)
class Turn:
    """One request on its way: its session, prompt plan and how its output is read."""

    session: Session
    plan: Plan
    request: RolloutRequest
    rules: OutputRules
    digests: tuple[str, ...]
    prefill: list[int]
    tenant: str
    model: str
    planned_on: int = 0  # the session's `changes` when planned
    #: the session whose worker the turn goes to (None: a one-turn request, any worker)
    affinity: str | None = None
    started: float = field(default_factory=time.monotonic)


def final_of(fmt: ChatFormat, turn: Turn, res: RolloutResult) -> Final:
    """A sample's result read as the turn's rules say (text, tool calls, stops)."""
    f = _finalize(fmt, turn, res)
    f.worker_id = res.worker_id
    return f


def _finalize(fmt: ChatFormat, turn: Turn, res: RolloutResult) -> Final:
    top = top_rows(res.top_logprobs)
    ids = res.completion_token_ids.tolist()
    if turn.prefill:  # the text is the opening the gateway wrote, then the sample
        f = finalize(fmt, turn.prefill + ids, [0.0] * len(turn.prefill)
                     + res.logprobs.tolist(), [], res.finish_reason, turn.rules)
        kept = ids[:max(0, len(f.ids) - len(turn.prefill))]
        n = len(kept)
        f.ids, f.logprobs = kept, res.logprobs.tolist()[:n]
        f.spans = clip(res.version_spans, n)
        f.top = top[:n]
        return f
    return finalize(fmt, ids, res.logprobs.tolist(), res.version_spans,
                    res.finish_reason, turn.rules, top)


def message(f: Final) -> MessageOut:
    calls = [ToolCallOut(id=f"call_{uuid.uuid4().hex[:24]}",
                         function=FunctionOut(name=c.name, arguments=c.arguments))
             for c in f.calls]
    return MessageOut(content=f.content if (f.content or not calls) else None,
                      tool_calls=calls or None)


def chat_response(fmt: ChatFormat, turn: Turn, finals: Sequence[Final], *,
                  logprobs: bool) -> ChatCompletion:
    choices = [ChatChoice(
        index=i, message=message(f), finish_reason=f.finish_reason,
        token_ids=f.ids, weight_versions=versions(f.spans), worker_id=f.worker_id,
        logprobs=ChoiceLogprobs(content=logprob_rows(fmt, f.ids, f.logprobs, f.top))
        if logprobs else None) for i, f in enumerate(finals)]
    done = sum(len(f.ids) for f in finals)
    n_prompt = len(turn.plan.prompt)
    return ChatCompletion(
        id=f"chatcmpl-{turn.request.request_id[3:]}", created=int(time.time()),
        model=turn.model, choices=choices,
        usage=Usage(prompt_tokens=n_prompt, completion_tokens=done,
                    total_tokens=n_prompt + done),
        prompt_token_ids=turn.plan.prompt, session_id=turn.session.session_id)


def result_of(reply: RolloutReply) -> RolloutResult:
    """A result, or the worker's error as the agent's."""
    if isinstance(reply, RolloutError):
        status, code = WORKER_ERRORS.get(reply.code, (502, reply.code))
        raise APIError(status, f"the rollout failed ({reply.code}): {reply.message}",
                       code=code)
    return reply


def top_rows(t: TopLogprobs | None) -> list[list[tuple[int, float]]]:
    """Per token, its top-k alternatives as (id, logprob) pairs."""
    if t is None or not t.k:
        return []
    ids, lps = t.ids.tolist(), t.logprobs.tolist()
    return [list(zip(ids[i:i + t.k], lps[i:i + t.k], strict=True))
            for i in range(0, len(ids), t.k)]


def versions(spans: Sequence[VersionSpan]) -> list[WeightVersion]:
    return [WeightVersion(version=s.version, start=s.start, end=s.end, policy=s.policy)
            for s in spans]
