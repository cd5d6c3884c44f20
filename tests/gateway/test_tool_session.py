"""The whole point of the gateway, end to end: the official openai client drives a 4-turn
session with a tool call and its result, on the torch engine and on vLLM, and the trainer gets
exactly the tokens the model sampled, with logprobs it can recompute.

A random-init model never writes a tool call, so the trainer first teaches tinyqwen one (the
output layer's rows of the call's tokens, fitted to the hidden states of that conversation) and
pushes the weights as version 1, as a trainer would after a step."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

pytestmark = [pytest.mark.nats, pytest.mark.slow]
MODEL = "tinyqwen"
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
FIRST = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "What is 2+3? Use the calculator."}]


def _teach(fmt: Any, prompt: list[int], target: list[int]) -> Any:
    """tinyqwen, its output layer's rows of `target`'s tokens fitted so that greedy decoding
    after `prompt` writes `target`."""
    import torch

    from rlfabric.trainer import build_model

    model = build_model(MODEL)
    with torch.no_grad():
        h = model.model(input_ids=torch.tensor([prompt + target])).last_hidden_state
        h = h[0, len(prompt) - 1:-1]
        rows = torch.tensor(sorted(set(target)))
        head = model.lm_head.weight
        rest = h @ head.T
        rest[:, rows] = float("-inf")
        rest_lse = torch.logsumexp(rest, -1)
    col = {int(r): i for i, r in enumerate(rows)}
    y = torch.tensor([col[t] for t in target])
    w = head.detach()[rows].clone().requires_grad_(True)
    opt = torch.optim.Adam([w], lr=0.1)
    for _ in range(300):
        mine = h @ w.T
        loss = (torch.logaddexp(rest_lse, torch.logsumexp(mine, -1))
                - mine.gather(1, y[:, None])[:, 0]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        head[rows] = w
    return model


def _recomputed(model: Any, ids: list[int]) -> list[float]:
    """The trainer's forward pass: logprob of each token given the ones before it."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [0.0, *lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()]


@pytest.mark.parametrize("engine", ["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_openai_client_drives_a_tool_session_and_the_trainer_gets_exact_tokens(
        engine, new_fleet, client, extra, chat_format, nats_url, prefix):
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (README, 'vLLM')")
    fmt = chat_format()
    fleet = new_fleet()
    flags = ("--max-model-len", "1024") if engine == "vllm" else ()
    fleet.workers(["w0"], *flags, engine=engine, timeout=240)
    base = fleet.gateway()
    prompt = fmt.encode(fmt.render(FIRST, tools=TOOLS))
    model = _teach(fmt, prompt, fmt.encode(CALL + "<|im_end|>"))

    async def push() -> str:
        from rlfabric.trainer import FabricClient

        async with FabricClient.connect(nats_url, prefix=prefix) as fabric:
            await fabric.wait_for_workers(1)
            await fabric.update_weights(1, module=model, transport="shm")
            return fabric.pushed.names("")[-1]

    pushed = anyio.run(push)

    c = client(base)
    sid = f"tools-{engine}-{prefix}"
    msgs: list[dict[str, Any]] = list(FIRST)
    turns = []

    def turn(**kw: Any) -> Any:
        r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS,
                                      extra_headers={"X-Session-ID": sid}, **kw)
        turns.append((list(msgs), r))
        return r

    r = turn(temperature=0, max_tokens=40)
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "2+3"}
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    for t, follow in enumerate(["Thanks. And 3+4?", "Bye."]):
        r = turn(temperature=1.0, seed=t, max_tokens=12)
        msgs += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": follow}]
    turn(temperature=1.0, seed=9, max_tokens=12)

    sampled_total = 0
    for k, (sent, r) in enumerate(turns):
        ids = extra(r.choices[0], "token_ids")
        sampled_total += len(ids)
        assert extra(r.choices[0], "weight_versions") == [
            {"version": 1, "start": 0, "end": len(ids), "policy": pushed}]
        if k == 0:
            continue
        before_msgs, before = turns[k - 1]
        head = extra(before, "prompt_token_ids") + extra(before.choices[0], "token_ids")
        now = extra(r, "prompt_token_ids")
        assert now[:len(head)] == head, f"turn {k} does not extend turn {k - 1}'s tokens"
        # the rest: the boundary the template puts after the turn, then the new messages
        asst = sent[len(before_msgs)]
        with_reply = fmt.render([*before_msgs, asst], tools=TOOLS, add_generation_prompt=False)
        tail = fmt.render(sent, tools=TOOLS)[len(with_reply):]
        ended = head[-1] == fmt.encode("<|im_end|>")[0]
        boundary = "\n" if ended else "<|im_end|>\n"
        assert now[len(head):] == fmt.encode(boundary) + fmt.encode(tail)

    got = c.with_options().get(f"/sessions/{sid}/trajectory", cast_to=object)
    [seg] = got["segments"]
    assert seg["reason"] == "new_session" and seg["turns"] == [0, 1, 2, 3]
    last = turns[-1][1]
    assert seg["token_ids"] == extra(last, "prompt_token_ids") + extra(last.choices[0],
                                                                          "token_ids")
    mask = seg["loss_mask"]
    assert sum(mask) == sampled_total
    ref = _recomputed(model, seg["token_ids"])
    worst = max(abs(a - b) for a, b, m in zip(seg["logprobs"], ref, mask, strict=True) if m)
    print(f"\n{engine}: {len(mask)} tokens, {sum(mask)} sampled; logprobs vs the trainer's "
          f"forward pass: max |diff| {worst:.2e}")
    assert worst < 1e-4
    assert all(lp == 0.0 for lp, m in zip(seg["logprobs"], mask, strict=True) if not m)
    assert [w["version"] for w in seg["weight_versions"]] == [1] * len(seg["weight_versions"])

    # streamed on this engine: the chunks are the completion sampled without streaming
    kw: dict[str, Any] = {"model": MODEL, "messages": FIRST[1:], "max_tokens": 24, "seed": 5,
                          "temperature": 1.0}
    whole = c.chat.completions.create(**kw)
    ids, text, chunks = [], "", 0
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            got = (ch.model_extra or {}).get("token_ids") or []
            chunks += bool(got)
            ids += got
            text += ch.delta.content or ""
    assert ids == extra(whole.choices[0], "token_ids") and len(ids) == 24
    assert text == whole.choices[0].message.content and chunks > 2
