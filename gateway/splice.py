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
                returned: Mapping[str, TurnChoice],
                cache: dict[tuple[bytes, bytes, str], str] | None) -> list[dict[str, Any]]:
    """`messages` with every assistant message the session returned rendered from its text."""
    out = []
    for m, d in zip(messages, digests, strict=True):
        choice = returned.get(d) if m["role"] == "assistant" else None
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
    opening = list(prefill)
    returned = fold.returned if fold is not None else {}
    msgs = _as_sampled(fmt, messages, digests, returned, texts)

    def render(part: Sequence[dict[str, Any]], gen: bool) -> str:
        return fmt.render(part, tools=tools, add_generation_prompt=gen, **template_kwargs)

    def fresh(reason: str, detail: str = "", branch: int = -1) -> Plan:
        text = render(msgs, True)
        ids = fmt.encode(text) + opening
        return Plan(prompt=ids, added=ids, text=text, reason=reason, detail=detail,
                    branch=branch)

    last = fold.last if fold is not None else None
    if fold is None or last is None:
        return fresh("new_session")
    before = last.message_digests
    k = len(before)
    if tuple(digests) == before and last.choices and \
            last.choices[0].prefill.tolist() == opening:
        return Plan(prompt=list(fold.prompt), added=[], text=prompt_text, resample=True,
                    branch=-1)
    if tuple(digests[:k]) != before:
        at = next((i for i, (a, b) in enumerate(zip(digests, before, strict=False)) if a != b),
                  min(len(digests), k))
        return fresh("messages_not_extended",
                     f"message {at} differs from the previous request's (of {k})")
    if len(digests) <= k or messages[k]["role"] != "assistant":
        return fresh("assistant_not_sampled", f"message {k} is not the assistant's reply "
                     "to the previous request")
    branch = next((i for i, c in enumerate(last.choices) if c.message_digest == digests[k]), -1)
    if branch < 0:
        return fresh("assistant_not_sampled", f"message {k} (assistant) is none of the "
                     f"{len(last.choices)} choices this session returned")
    for i in range(k + 1, len(messages)):  # a reply the agent wrote among the new messages
        if messages[i]["role"] == "assistant" and digests[i] not in returned:
            return fresh("assistant_not_sampled", f"message {i} (assistant) is none this "
                         "session returned", branch)
    choice = last.choices[branch]
    sampled = choice.completion_token_ids.tolist()
    opened = choice.prefill.tolist()
    before_opening = fold.prompt[:len(fold.prompt) - len(opened)]
    t0 = prompt_text if prompt_text is not None and not opened else fmt.decode(before_opening)
    c = fmt.decode(opened + sampled)
    t = render(msgs, True)
    if not t.startswith(t0):
        return fresh("template_rewrote_history", "the history up to the previous prompt "
                     "renders differently now", branch)
    if not t.startswith(c, len(t0)):
        return fresh("template_rewrote_history", f"message {k} (assistant) renders "
                     "differently from the text the model sampled", branch)
    rest = fmt.encode(t[len(t0) + len(c):])
    prompt = fold.prompt + sampled + rest
    if fmt.decode(prompt) != t:  # the whole turn against the template's full render
        return fresh("template_rewrote_history", "the spliced tokens do not decode to the "
                     "template's render", branch)
    return Plan(prompt=prompt + opening, added=rest + opening, text=t, branch=branch)
