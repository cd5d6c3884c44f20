"""Completions as the agent reads them: stop strings, tool calls, and a stream whose chunks
add up to exactly the non-streamed response."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("starlette", reason="the gateway extra is not installed")

from rlfabric.gateway.output import OutputRules, StreamText, finalize
from rlfabric.schemas import VersionSpan
from rlfabric.text import PARSERS, load_chat_format


@pytest.fixture(scope="module")
def fmt():
    return load_chat_format("tinyqwen")


def test_a_stop_string_ends_the_completion_at_the_token_that_completes_it(fmt):
    ids = fmt.encode("The answer is 42. Observation: done")
    rules = OutputRules(stops=("Observation:",))
    f = finalize(fmt, ids, [0.5] * len(ids), [VersionSpan(version=3, start=0, end=len(ids))],
                 "length", rules)
    assert f.content == "The answer is 42. " and f.finish_reason == "stop"
    assert fmt.decode(f.ids).endswith("Observation:") and len(f.ids) < len(ids)
    assert f.spans == [VersionSpan(version=3, start=0, end=len(f.ids))]


@pytest.mark.parametrize("seed", range(6))
def test_stream_chunks_add_up_to_the_completion(fmt, seed):
    rng = random.Random(seed)
    words = ["a", " b", "\n", " Observation", ":", " é", "中", " <tool_call>", "\n",
             '{"name": "f", "arguments": {}}', "</tool_call>", "  "]
    text = "".join(rng.choice(words) for _ in range(30))
    ids = fmt.encode(text)
    ids = [i if rng.random() > 0.1 else rng.randrange(151643) for i in ids]  # broken bytes
    rules = OutputRules(stops=("Observation:",) if seed % 2 else (),
                        parser=PARSERS["qwen"].parse if seed % 3 else None)
    whole = finalize(fmt, ids, [0.0] * len(ids), [], "length", rules)
    st = StreamText(fmt, rules)
    sent_text, sent_ids, at = "", [], 0
    while at < len(ids):
        step = rng.randint(1, 3)
        out = st.add(at, ids[at:at + step], [0.0] * len(ids[at:at + step]), None)
        at += step
        if out is not None:
            t, a, b = out
            sent_text += t
            sent_ids += st.ids[a:b]
    t, a, b = st.rest(whole)
    sent_text += t
    sent_ids += whole.ids[a:b]
    assert sent_text == (whole.content or "") and sent_ids == whole.ids
