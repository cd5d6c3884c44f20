"""`rlfabric gateway`: an OpenAI-compatible HTTP server beside a fleet."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import anyio

from rlfabric.bus import NatsUnavailable
from rlfabric.cli._common import (
    add_bus_options,
    add_telemetry_options,
    connect_options,
    limits_of,
    settle_heap,
    start_telemetry,
)
from rlfabric.concurrency.sync import beside
from rlfabric.gateway import config
from rlfabric.schemas import RLFabricError

_DESCRIPTION = """\
Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health) over the
job's workers: the gateway holds the tokenizer and chat template, workers stay token-in,
token-out. Agent sessions (path /sessions/{id}/v1/chat/completions or header X-Session-ID)
get prompts built from the exact tokens sampled before, so a trainer trains on what the model
sampled: GET /v1/sessions/{id}/trajectory returns the segments (token ids, loss mask, logprobs,
weight versions), and the same is readable off the bus. Responses carry token_ids and
weight_versions per choice, prompt_token_ids and session_id. Needs the gateway extra:
pip install 'rlfabric[gateway]'."""

_EPILOG = """\
example:
  rlfabric nats &
  rlfabric worker --model tinyqwen &
  rlfabric gateway --model tinyqwen --port 8000
  python -c "from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:8000/v1', \\
api_key='-'); print(c.chat.completions.create(model='tinyqwen', \\
messages=[{'role': 'user', 'content': 'hi'}], max_tokens=8))"
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gateway", help="serve the OpenAI API to agents, over the job's workers",
                       description=_DESCRIPTION, epilog=_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bus_options(p)
    p.add_argument("--model", required=True,
                   help="the model the workers serve: a built-in name with a tokenizer "
                   "(tinyqwen) or a local Hugging Face checkpoint dir (its tokenizer.json and "
                   "chat template are used)")
    g, o = config.defaults(config.GatewayConfig), config.defaults(config.ServeOptions)
    p.add_argument("--served-model-name", default=g["served_name"],
                   help="the name agents send as `model` (default: --model as given)")
    p.add_argument("--host", default=o["host"],
                   help="address to listen on (default %(default)s; 0.0.0.0 for other hosts)")
    p.add_argument("--port", type=int, default=o["port"], help="HTTP port (default %(default)s)")
    p.add_argument("--chat-template", default=None, metavar="FILE|NAME",
                   help="a Jinja chat template file, or a built-in one (chatml-tools, "
                   "chatml-think), instead of the model's own")
    p.add_argument("--tool-call-parser", default=g["tool_parser"],
                   choices=("qwen", "hermes", "tinychat"),
                   help="how tool calls are read from the model's output (qwen = hermes: "
                   "<tool_call>{json}</tool_call>; tinychat: the one token <tool_call> calls "
                   "the request's one tool; default %(default)s)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (repeatable; env "
                   "RLFABRIC_API_KEY); its tenant is 'default'")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="keys to accept, one per line: 'KEY' or 'TENANT KEY' (the tenant names "
                   "the key's requests in metrics, traces and session records)")
    p.add_argument("--tenants-are-jobs", action="store_true", help="a key's tenant is its "
                   "job: its requests, sessions and adapters are that job's (README: jobs)")
    p.add_argument("--max-body-bytes", type=int, default=o["max_body_bytes"],
                   help="larger request bodies get 413 (default %(default)s)")
    p.add_argument("--no-affinity", dest="affinity", action="store_false",
                   help="send every turn to the workers' shared queue instead of the worker "
                   "that served the session's last turn (whose cache holds its prefix)")
    p.add_argument("--max-model-len", type=int, default=g["max_model_len"],
                   help="context length in tokens (default: the model's own); a longer "
                   "prompt gets 413")
    _limit_options(p, g)
    p.add_argument("--request-timeout", type=float, default=g["request_timeout"],
                   help="seconds a request may wait for workers (a paused fleet) before it "
                   "gets 503 (default %(default)s)")
    p.add_argument("--session-idle-timeout", type=float, default=o["session_idle_timeout"],
                   help="seconds after which an idle session ends (its trajectory stays "
                   "readable; default %(default)s)")
    p.add_argument("--max-cached-sessions", type=int, default=o["max_cached_sessions"],
                   help="sessions held in memory: idle ones past it are dropped, least "
                   "recently used first (read back from the bus when they come again); a new "
                   "session when it is full of sessions in turns gets 503 session_limit "
                   "(default %(default)s)")
    p.add_argument("--max-session-bytes", type=int, default=o["max_session_bytes"],
                   help="about how many bytes of tokens the held sessions may take; past it "
                   "as past --max-cached-sessions (default %(default)s)")
    add_telemetry_options(p)
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no line per request on stderr (client, method, path, status, "
                   "milliseconds, session, tenant)")
    p.set_defaults(func=run)


def _limit_options(p: argparse.ArgumentParser, g: dict[str, Any]) -> None:
    """What one request may ask for."""
    p.add_argument("--default-max-tokens", type=int, default=g["default_max_tokens"],
                   metavar="N", help="what a request without max_tokens may sample (at most "
                   "what the context leaves; default %(default)s). A max_tokens larger than "
                   "the context leaves gets 400, as OpenAI's API and vLLM answer")
    p.add_argument("--max-request-tokens", type=int, default=g["max_request_tokens"],
                   metavar="N", help="n x max_tokens one request may ask for; past it 400 "
                   "request_too_large, before anything is sampled (default %(default)s)")
    p.add_argument("--max-n", type=int, default=g["max_n"],
                   help="samples one request may ask for (n; default %(default)s)")


def _keys(args: argparse.Namespace) -> dict[str, str]:
    keys = {k: "default" for k in args.api_key}
    if not keys and (env := os.environ.get("RLFABRIC_API_KEY")):
        keys[env] = "default"
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                parts = line.split()
                if not parts or parts[0].startswith("#"):
                    continue
                if len(parts) > 2:
                    raise ValueError(f"{args.api_key_file}:{n}: write 'KEY' or 'TENANT KEY'")
                tenant, key = (parts[0], parts[1]) if len(parts) == 2 else ("default", parts[0])
                keys[key] = tenant
    return keys


async def _serve(args: argparse.Namespace) -> None:
    from rlfabric.gateway.config import GatewayConfig, ServeOptions
    from rlfabric.gateway.server import serve

    config = GatewayConfig(model=args.model, served_name=args.served_model_name,
                           tool_parser=args.tool_call_parser,
                           request_timeout=args.request_timeout,
                           max_model_len=args.max_model_len, affinity=args.affinity,
                           default_max_tokens=args.default_max_tokens,
                           max_request_tokens=args.max_request_tokens, max_n=args.max_n,
                           tenant_jobs=args.tenants_are_jobs)
    opts = ServeOptions(host=args.host, port=args.port, api_keys=_keys(args),
                        max_body_bytes=args.max_body_bytes,
                        session_idle_timeout=args.session_idle_timeout,
                        max_cached_sessions=args.max_cached_sessions,
                        max_session_bytes=args.max_session_bytes,
                        chat_template=args.chat_template)
    async with beside() as tg:  # a failure to start raised as itself
        port = await tg.start(lambda task_status: serve(
            connect_options(args, "rlfabric-gateway"), config, opts, prefix=args.prefix,
            handle_signals=True, limits=limits_of(args), task_status=task_status))
        settle_heap()
        keys = "bearer key required" if opts.api_keys else "no key required"
        print(f"rlfabric gateway: serving {config.name} at http://{args.host}:{port}/v1 "
              f"({keys}; job {args.prefix!r} on {args.nats})", flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print("rlfabric gateway: needs the gateway extra: pip install 'rlfabric[gateway]'",
              file=sys.stderr)
        return 2
    if args.access_log:
        logging.getLogger("rlfabric.gateway.access").setLevel(logging.INFO)
    telemetry = start_telemetry(args, "gateway", prometheus=True)  # served on /metrics
    try:
        anyio.run(_serve, args, backend_options={"use_uvloop": True})
    except NatsUnavailable as exc:
        print(f"rlfabric gateway: {exc}", file=sys.stderr)
        return 2
    except (RLFabricError, ValueError, OSError) as exc:
        print(f"rlfabric gateway: {exc}", file=sys.stderr)
        return 2
    finally:
        telemetry.shutdown()
    return 0
