"""`rlfabric schema`: print the JSON Schema of every wire message."""

from __future__ import annotations

import argparse
import json

from rlfabric.schemas import MESSAGE_TYPES, json_schema


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schema", help="print the JSON Schema of every wire message",
                       description="Print one JSON document with the schema of every rlfabric "
                       "message (msgpack on the wire; packed arrays show as base64 strings).")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(MESSAGE_TYPES), indent=2, sort_keys=True))
    return 0
