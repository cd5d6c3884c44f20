"""The exact-token rule on its own (no bus, no engine): turns spliced from the sampled ids,
checked against the template, and a new segment with its reason wherever they cannot be."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

pytest.importorskip("starlette", reason="the gateway extra is not installed")

from rlfabric.gateway import conversation
from rlfabric.gateway.api import ChatMessage
from rlfabric.gateway.output import OutputRules, finalize
from rlfabric.gateway.splice import Plan, plan
from rlfabric.schemas import SessionFold, SessionTurn, TurnChoice
from rlfabric.text import PARSERS, load_chat_format

IM_END = 151645


class Session:
    """A session driven turn by turn with given 'sampled' ids, as the gateway drives it."""

    def __init__(self, template: str | None = None, **render: Any) -> None:
        self.fmt = load_chat_format("tinyqwen", template=template)
        self.fold = SessionFold()
        self.render = render
        self.plans: list[Plan] = []

    def turn(self, messages: list[dict[str, Any]], sampled: list[list[int]], *,
             parse: bool = False, prefill: str = "") -> list[Any]:
        conv = conversation.read([msgspec.convert(m, ChatMessage) for m in messages])
        opening = self.fmt.encode(prefill) if prefill else []
        p = plan(self.fmt, self.fold if self.fold.last else None, conv.messages, conv.digests,
                 prefill=opening, **self.render)
        self.plans.append(p)
        rules = OutputRules(parser=PARSERS["qwen"].parse if parse else None)
        finals = [finalize(self.fmt, opening + ids, [0.0] * (len(opening) + len(ids)), [],
                           "stop" if ids[-1:] == [IM_END] else "length", rules)
                  for ids in sampled]
        self.fold.apply(SessionTurn(
            session_id="s", turn=self.fold.turns, added=p.added, branch=p.branch,
            reason=p.reason, resample=p.resample, message_digests=conv.digests,
            choices=tuple(TurnChoice(completion_token_ids=ids, logprobs=[0.0] * len(ids),
                                     message_digest=f.digest, prefill=opening,
                                     finish_reason=f.finish_reason)
                          for ids, f in zip(sampled, finals, strict=True))))
        return finals


def _random(rng: random.Random, n: int, stop: bool = True) -> list[int]:
    return [rng.randrange(151643) for _ in range(n)] + ([IM_END] if stop else [])


def _reply(f: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": f.content}
    if f.calls:  # as an agent sends it back: its own JSON spacing, its own call ids
        msg["tool_calls"] = [{"id": f"call-{i}", "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments.replace(
                                  " ", "")}} for i, c in enumerate(f.calls)]
    return msg


def test_turns_splice_the_sampled_ids_and_stay_one_segment():
    rng = random.Random(5)
    s = Session()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    heads = []
    for t in range(6):
        ids = _random(rng, 9, stop=t % 2 == 0)  # ended by <|im_end|> or cut at max_tokens
        f = s.turn(msgs, [ids])[0]
        heads.append(s.plans[-1].prompt + ids)
        msgs = [*msgs, _reply(f), {"role": "user", "content": f"turn {t}"}]
    s.turn(msgs, [_random(rng, 3)])
    for head, p in zip(heads, s.plans[1:], strict=True):
        assert p.reason == "" and p.prompt[:len(head)] == head
        added = p.prompt[len(head):]
        # ChatML: the newline after a sampled <|im_end|>, or <|im_end|> and the newline
        assert added[:1] == [198] or added[:2] == [IM_END, 198]
    [seg] = s.fold.trajectory().segments
    # six turns of 9, three ended by <|im_end|>; the last of 3 and <|im_end|>
    assert seg.reason == "new_session" and sum(seg.loss_mask.tolist()) == 6 * 9 + 3 + 3 + 1


def test_a_tool_call_sent_back_in_the_agents_own_format_still_continues():
    fmt = load_chat_format("tinyqwen")
    s = Session()
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    call = [*fmt.encode(text), IM_END]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "2+3"}]
    f = s.turn(msgs, [call], parse=True)[0]
    assert f.finish_reason == "tool_calls" and f.content is None
    msgs += [_reply(f), {"role": "tool", "tool_call_id": "call-0", "content": "5"}]
    s.turn(msgs, [_random(random.Random(1), 4)])
    assert s.plans[1].reason == "" and s.plans[1].prompt[:len(s.plans[0].prompt) + len(call)] \
        == s.plans[0].prompt + call


def test_reasoning_the_template_drops_starts_a_segment():
    fmt = load_chat_format("tinyqwen", template="chatml-think")
    s = Session("chatml-think")
    thought = [*fmt.encode("<think>\nsecret\n</think>\n\nfour"), IM_END]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "2+2"}]
    f = s.turn(msgs, [thought])[0]
    msgs += [_reply(f), {"role": "user", "content": "and 3+3?"}]
    s.turn(msgs, [_random(random.Random(2), 3)])
    p = s.plans[1]
    assert p.reason == "template_rewrote_history" and "secret" not in fmt.decode(p.prompt)
    assert p.prompt == fmt.encode(fmt.render([msgs[0], {"role": "assistant",
                                                         "content": "four"}, msgs[2]]))
    first, second = s.fold.trajectory().segments
    assert first.token_ids.tolist() == s.plans[0].prompt + thought
    assert (first.reason, second.reason) == ("new_session", "template_rewrote_history")


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda m: [{"role": "user", "content": "hello?"}, *m[1:]], "messages_not_extended"),
    (lambda m: [m[0], {"role": "assistant", "content": "I said this"}, *m[2:]],
     "assistant_not_sampled"),
    (lambda m: [m[0], m[2]], "assistant_not_sampled"),
])
def test_a_history_the_session_did_not_produce_starts_a_segment(edit, reason):
    s = Session()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    f = s.turn(msgs, [_random(random.Random(3), 4)])[0]
    s.turn(edit([*msgs, _reply(f), {"role": "user", "content": "next"}]), [[1, IM_END]])
    assert s.plans[1].reason == reason
    assert [g.reason for g in s.fold.trajectory().segments] == ["new_session", reason]


def test_a_repeated_request_is_sampled_again_and_an_opening_spliced_exactly():
    s = Session()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "call add"}]
    opening = PARSERS["qwen"].prefill("add")
    fmt = s.fmt
    rest = [*fmt.encode('{"a": 1}}\n</tool_call>'), IM_END]
    s.turn(msgs, [[5, 6, IM_END]], parse=True, prefill=opening)
    f = s.turn(msgs, [rest], parse=True, prefill=opening)[0]  # a retry: sampled again
    assert s.plans[1].resample and s.plans[1].prompt == s.plans[0].prompt
    assert f.calls[0].name == "add" and f.calls[0].arguments == '{"a": 1}'
    msgs += [_reply(f), {"role": "tool", "tool_call_id": "call-0", "content": "1"}]
    s.turn(msgs, [[7, IM_END]])
    assert s.plans[2].reason == ""
    assert s.plans[2].prompt[:len(s.plans[1].prompt) + len(rest)] == s.plans[1].prompt + rest
    branch, live = s.fold.trajectory().segments
    assert branch.reason == "branch" and live.reason == "new_session"
    opened = len(fmt.encode(opening))
    assert live.loss_mask.tolist()[len(s.plans[1].prompt) - opened:len(s.plans[1].prompt)] \
        == [0] * opened  # the opening the gateway wrote is not the model's
