"""Tokenizers and chat templates: the text side of a model, for the gateway (workers stay
token-in/token-out) and for checkpoints of built-in models that carry a real tokenizer."""

from rlfabric.text.chat import ChatFormat, ChatFormatError, load_chat_format
from rlfabric.text.tools import PARSERS, ParsedCall, ToolFormat, parse_qwen

__all__ = ["PARSERS", "ChatFormat", "ChatFormatError", "ParsedCall", "ToolFormat",
           "load_chat_format", "parse_qwen"]
