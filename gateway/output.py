"""What a sampled completion becomes for the agent: its text (the end-of-turn token and any stop
string cut off), its tool calls, its finish reason, and the ids the trajectory keeps; and the
same, incrementally, for a streamed completion, so that a stream's chunks add up to exactly what
the non-streamed response holds (text and `token_ids`).

Stop strings are matched on the text: the completion ends with the token that completes the
first one (vLLM's rule); tokens sampled after it are not kept. Text streams only up to a point
that cannot change: not a trailing partial character, not a tail that may begin a stop string,
not from the opening of a tool call on (the calls come whole, in the last chunk).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rlfabric.gateway.conversation import assistant_digest
from rlfabric.schemas import VersionSpan
from rlfabric.text import ChatFormat, ParsedCall

_PARTIAL = "\ufffd"
Parser = Callable[[str], tuple[str | None, list[ParsedCall]]]


@dataclass(frozen=True, slots=True)
class OutputRules:
    """How one request's completions are read."""

    stops: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()
    #: tool calls are parsed with it (None: `tool_choice` none, or no tools)
    parser: Parser | None = None
    #: where the parser's calls begin in the text (held back while streaming)
    call_open: str = "<tool_call>"
    #: the request's one tool: what a call that names none calls (a one-token call format)
    only_tool: str = ""


@dataclass(slots=True)
class Final:
    ids: list[int]
    logprobs: list[float]
    spans: list[VersionSpan]
    finish_reason: str
    content: str | None
    calls: list[ParsedCall]
    #: the text the model wrote (the template renders this where the agent sends the message
    #: back: what the model saw, whatever the agent's copy looks like)
    raw: str
    digest: str
    #: per kept token: its top-k alternatives [(id, logprob), ...] (empty without logprobs)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    worker_id: str = ""  # the worker that sampled it


def _visible(fmt: ChatFormat, ids: Sequence[int], rules: OutputRules) -> str:
    """The text of `ids`, without a final end-of-turn token."""
    if ids and (ids[-1] in rules.stop_ids or ids[-1] in fmt.stop_token_ids):
        return fmt.decode(ids[:-1])
    return fmt.decode(ids)


def _first_stop(text: str, stops: Sequence[str]) -> int:
    hits = [i for s in stops if s and (i := text.find(s)) >= 0]
    return min(hits) if hits else -1


def _stop_cut(fmt: ChatFormat, ids: list[int], stops: Sequence[str]) -> int:
    """The fewest leading tokens whose text holds a stop string (len(ids)+1 if none does)."""
    if _first_stop(fmt.decode(ids), stops) < 0:
        return len(ids) + 1
    lo, hi = 1, len(ids)
    while lo < hi:  # the text of a longer prefix holds whatever a shorter one does
        mid = (lo + hi) // 2
        if _first_stop(fmt.decode(ids[:mid]), stops) >= 0:
            hi = mid
        else:
            lo = mid + 1
    return lo


def finalize(fmt: ChatFormat, ids: list[int], logprobs: list[float], spans: Sequence[VersionSpan],
             finish: str, rules: OutputRules,
             top: list[list[tuple[int, float]]] | None = None) -> Final:
    """What a completion of `ids` (with `finish`: stop, length, abort) is for the agent."""
    reason = finish
    if rules.stops:
        cut = _stop_cut(fmt, ids, rules.stops)
        if cut <= len(ids):
            ids, logprobs, reason = ids[:cut], logprobs[:cut], "stop"
            if top:
                top = top[:cut]
    raw = _visible(fmt, ids, rules)
    text = raw
    if rules.stops and (at := _first_stop(text, rules.stops)) >= 0:
        text = text[:at]
    content: str | None = text
    calls: list[ParsedCall] = []
    if rules.parser is not None:
        content, calls = rules.parser(text)
        if any(not c.name for c in calls):  # the one tool offered, or no call at all
            calls = ([ParsedCall(name=rules.only_tool, arguments=c.arguments) for c in calls]
                     if rules.only_tool else [])
            content = content if calls else (text or None)
        if calls:
            reason = "tool_calls"
    n = len(ids)
    clipped = clip(spans, n)
    digest = assistant_digest(content, [(c.name, json.loads(c.arguments)) for c in calls])
    return Final(ids=ids, logprobs=logprobs, spans=clipped, finish_reason=reason,
                 content=content, calls=calls, raw=raw, digest=digest, top=top or [])


@dataclass(slots=True)
class StreamText:
    """One streamed choice: tokens as they come, the text and tokens sent so far."""

    fmt: ChatFormat
    rules: OutputRules
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    sent_text: str = ""
    sent_ids: int = 0
    broken: bool = False  # a delta was lost: the rest comes from the result
    #: a stop string or a tool call began (or the gateway opened one: a forced call): the rest
    #: comes from the result
    held: bool = False
    #: the text of the first `base` tokens, which end on a whole character (decoding goes on
    #: from there: a stream costs a decode of its new tokens, not of all of them each time)
    base: int = 0
    base_text: str = ""

    def _text(self) -> str:
        tail = self.ids[self.base:]
        end = tail[-1:] and (tail[-1] in self.rules.stop_ids
                             or tail[-1] in self.fmt.stop_token_ids)
        text = self.base_text + self.fmt.decode(tail[:-1] if end else tail)
        if not end and not text.endswith(_PARTIAL):
            self.base, self.base_text = len(self.ids), text
        return text

    def add(self, start: int, ids: Sequence[int], logprobs: Sequence[float],
            top: list[list[tuple[int, float]]] | None) -> tuple[str, int, int] | None:
        """Take a delta; returns (new text, first token, end token) safe to send now."""
        if self.broken or start != len(self.ids):
            self.broken = True
            return None
        self.ids += ids
        self.logprobs += logprobs
        if top:
            self.top += top
        if self.held:
            return None
        text = self._text()
        safe = len(text)
        if text.endswith(_PARTIAL):
            safe = len(text.rstrip(_PARTIAL))
        if self.rules.stops:
            if _first_stop(text, self.rules.stops) >= 0:
                self.held = True
                return None
            safe = min(safe, _safe_before_stop(text, self.rules.stops))
        if self.rules.parser is not None:
            at = text.find(self.rules.call_open)
            if at >= 0:
                self.held = True
                safe = min(safe, len(text[:at].rstrip()))
            else:  # may yet be followed by a call: trailing space is cut from content then
                safe = min(safe, len(text.rstrip()),
                           _safe_before_stop(text, (self.rules.call_open,)))
        new = text[len(self.sent_text):safe] if safe > len(self.sent_text) else ""
        if not text.startswith(self.sent_text):
            self.broken = True
            return None
        first = self.sent_ids
        if safe == len(text) and not text.endswith(_PARTIAL):
            self.sent_ids = len(self.ids)
        self.sent_text += new
        return new, first, self.sent_ids

    def rest(self, final: Final) -> tuple[str, int, int]:
        """What is left to send once the result came: (text, first token, end token)."""
        content = final.content or ""
        text = content[len(self.sent_text):] if content.startswith(self.sent_text) else ""
        first = min(self.sent_ids, len(final.ids))
        return text, first, len(final.ids)


def _safe_before_stop(text: str, stops: Sequence[str]) -> int:
    """Where `text` may be cut and sent: before a tail that could begin a stop string."""
    cut = len(text)
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


def logprob_rows(fmt: ChatFormat, ids: Sequence[int], lps: Sequence[float],
                 top: Sequence[Sequence[tuple[int, float]]]) -> list[Any]:
    """OpenAI's `logprobs.content` entries for `ids`."""
    from rlfabric.gateway.api import TokenLogprob, TopLogprob

    out = []
    for i, (t, lp) in enumerate(zip(ids, lps, strict=True)):
        alts = [TopLogprob(token=fmt.decode([a]), logprob=v, bytes=list(fmt.token_bytes(a)))
                for a, v in (top[i] if i < len(top) else ())]
        out.append(TokenLogprob(token=fmt.decode([t]), logprob=lp,
                                bytes=list(fmt.token_bytes(t)), top_logprobs=alts))
    return out


def clip(spans: Sequence[VersionSpan], n: int) -> list[VersionSpan]:
    """`spans` cut to the first `n` tokens."""
    return [msgspec.structs.replace(s, end=min(s.end, n)) for s in spans if s.start < n]
