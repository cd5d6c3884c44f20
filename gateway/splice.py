"""The exact-token rule: the prompt of a session's next turn is the previous prompt, the tokens
the model sampled (exactly), then only the tokens of what is new.

Nothing already tokenized is tokenized again. What is new comes from the chat template itself
(render, then the difference), so the rule holds for any template, not per model family:

    t0 = decode(previous prompt)                  what the model saw
    c  = decode(sampled ids)                      what it wrote
    t  = render(history + [its message] + new)    the template's text of the whole request
    t  = t0 + c + rest                            rest: what the template puts after the turn
                                                  (ChatML: the newline after <|im_end|>), then
                                                  the new messages and the generation prompt
    prompt = previous prompt + sampled ids + encode(rest)

An assistant message the session returned is rendered from the text the model wrote (whatever
the agent's copy looks like: re-serialized tool-call arguments, a missing field). Then the
result is checked against a full render at every turn: `decode(prompt) == t2`. Where any of it
does not hold (the agent edited the history, the message after it is not one the session
returned, the template renders the history differently from what the model saw), the turn
starts a new segment from a full render, with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlfabric.schemas import SessionFold, TurnChoice
from rlfabric.text import ChatFormat


@dataclass(frozen=True, slots=True)
class Plan:
    prompt: list[int]
    #: the tokens after what the session had: all of `prompt` for a new segment
    added: list[int]
    #: the template's full render (what `prompt` decodes to, before any prefill)
    text: str | None
    reason: str = ""
    detail: str = ""
    branch: int = -1
    #: the previous request again: its prompt, sampled again
    resample: bool = False


def raw_text(fmt: ChatFormat, choice: TurnChoice,
             cache: dict[tuple[bytes, bytes, str], str] | None = None) -> str:
    """The text of the assistant turn of `choice` (what the gateway wrote to open it, then
    what the model sampled), its end-of-turn token left out."""
    key = (choice.prefill.tobytes(), choice.completion_token_ids.tobytes(),
           choice.finish_reason)
    if cache is not None and (hit := cache.get(key)) is not None:
        return hit
    ids = choice.prefill.tolist() + choice.completion_token_ids.tolist()
    if choice.finish_reason in ("stop", "tool_calls") and ids and ids[-1] in fmt.stop_token_ids:
        ids = ids[:-1]
    text = fmt.decode(ids)
    if cache is not None:
        cache[key] = text
    return text


def _as_sampled(fmt: ChatFormat, messages: Sequence[dict[str, Any]], digests: Sequence[str],
                fold: SessionFold | None,
                cache: dict[tuple[bytes, bytes, str], str] | None) -> list[dict[str, Any]]:
    """`messages` with every assistant message the session returned rendered from its text:
    the text of the turn at that position (an agent may send two equal messages, such as a
    tool call it repeated, each from its own turn)."""
    out = []
    for i, (m, d) in enumerate(zip(messages, digests, strict=True)):
        choice = fold.choice_at(i, d) if fold is not None and m["role"] == "assistant" \
            else None
        out.append(m if choice is None else {"role": "assistant",
                                             "content": raw_text(fmt, choice, cache)})
    return out


def plan(fmt: ChatFormat, fold: SessionFold | None, messages: Sequence[dict[str, Any]],
         digests: Sequence[str], *, tools: Sequence[Mapping[str, Any]] | None = None,
         prompt_text: str | None = None, prefill: Sequence[int] = (),
         texts: dict[tuple[bytes, bytes, str], str] | None = None,
         **template_kwargs: Any) -> Plan:
    """The prompt of a request with `messages` in the session folded as `fold` (None: a new
    session). `prompt_text`, if known, is `decode(fold.prompt)`. `prefill` opens the assistant
    turn after the generation prompt (not sampled). `texts` caches the text of returned
    choices (`raw_text`)."""
    returned = fold.returned if fold is not None else {}
    r = _Render(fmt, _as_sampled(fmt, messages, digests, fold, texts), tools,
                template_kwargs, list(prefill))
    last = fold.last if fold is not None else None
    if fold is None or last is None:
        return r.fresh("new_session")
    if tuple(digests) == last.message_digests and last.choices and \
            last.choices[0].prefill.tolist() == r.opening:
        return Plan(prompt=list(fold.prompt), added=[], text=prompt_text, resample=True,
                    branch=-1)
    branch, why = _branch(messages, digests, last, returned)
    if why:
        return r.fresh(why[0], why[1], branch)
    return _splice(r, fold, last.choices[branch], prompt_text, branch)


class _Render:
    """The conversation as the template renders it (with its tools and options), and the
    tokens that open the assistant turn."""

    def __init__(self, fmt: ChatFormat, msgs: list[dict[str, Any]],
                 tools: Sequence[Mapping[str, Any]] | None, kwargs: dict[str, Any],
                 opening: list[int]) -> None:
        self.fmt, self.msgs, self.tools, self.kwargs = fmt, msgs, tools, kwargs
        self.opening = opening

    def text(self) -> str:
        return self.fmt.render(self.msgs, tools=self.tools, add_generation_prompt=True,
                               **self.kwargs)

    def fresh(self, reason: str, detail: str = "", branch: int = -1) -> Plan:
        """A new segment: the whole conversation tokenized from its render."""
        text = self.text()
        ids = self.fmt.encode(text) + self.opening
        return Plan(prompt=ids, added=ids, text=text, reason=reason, detail=detail,
                    branch=branch)


def _branch(messages: Sequence[dict[str, Any]], digests: Sequence[str], last: Any,
            returned: Mapping[str, TurnChoice]) -> tuple[int, tuple[str, str] | None]:
    """Which of the previous turn's choices the messages extend, or why they extend none:
    (branch, None) or (branch or -1, (reason, detail))."""
    before = last.message_digests
    k = len(before)
    if tuple(digests[:k]) != before:
        at = next((i for i, (a, b) in enumerate(zip(digests, before, strict=False)) if a != b),
                  min(len(digests), k))
        return -1, ("messages_not_extended",
                    f"message {at} differs from the previous request's (of {k})")
    if len(digests) <= k or messages[k]["role"] != "assistant":
        return -1, ("assistant_not_sampled", f"message {k} is not the assistant's reply to "
                    "the previous request")
    branch = next((i for i, c in enumerate(last.choices) if c.message_digest == digests[k]), -1)
    if branch < 0:
        return -1, ("assistant_not_sampled", f"message {k} (assistant) is none of the "
                    f"{len(last.choices)} choices this session returned")
    for i in range(k + 1, len(messages)):  # a reply the agent wrote among the new messages
        if messages[i]["role"] == "assistant" and digests[i] not in returned:
            return branch, ("assistant_not_sampled", f"message {i} (assistant) is none this "
                            "session returned")
    return branch, None


def _splice(r: _Render, fold: SessionFold, choice: TurnChoice, prompt_text: str | None,
            branch: int) -> Plan:
    """The previous prompt + the sampled ids + the tokens of the render after them, checked
    against the full render."""
    fmt, k = r.fmt, len(fold.last.message_digests) if fold.last is not None else 0
    sampled = choice.completion_token_ids.tolist()
    opened = choice.prefill.tolist()
    before_opening = fold.prompt[:len(fold.prompt) - len(opened)]
    t0 = prompt_text if prompt_text is not None and not opened else fmt.decode(before_opening)
    c = fmt.decode(opened + sampled)
    t = r.text()
    if not t.startswith(t0):
        return r.fresh("template_rewrote_history", "the history up to the previous prompt "
                       "renders differently now", branch)
    if not t.startswith(c, len(t0)):
        return r.fresh("template_rewrote_history", f"message {k} (assistant) renders "
                       "differently from the text the model sampled", branch)
    rest = fmt.encode(t[len(t0) + len(c):])
    prompt = fold.prompt + sampled + rest
    if fmt.decode(prompt) != t:  # the whole turn against the template's full render
        return r.fresh("template_rewrote_history", "the spliced tokens do not decode to the "
                       "template's render", branch)
    return Plan(prompt=prompt + r.opening, added=rest + r.opening, text=t, branch=branch)
