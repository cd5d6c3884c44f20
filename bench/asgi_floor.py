"""The floors of the gateway's own cost, on its stack (Starlette on uvicorn, uvloop, msgspec
JSON), no bus and no model; each answers a chat request with a fixed chat-sized response:
- `POST /v1/chat/completions`: the body read as JSON, nothing else (HTTP alone);
- `POST /template/v1/chat/completions`: the messages rendered with the model's chat template
  and tokenized, as any chat server must before it can ask an engine (HTTP + text).

    python -m rlfabric.bench.asgi_floor --port 8100 [--model tinyqwen]
"""

from __future__ import annotations

import argparse
import socket

import anyio
import msgspec

RESPONSE = msgspec.json.encode({
    "id": "chatcmpl-floor", "object": "chat.completion", "created": 0, "model": "tinyqwen",
    "choices": [{"index": 0, "finish_reason": "length", "token_ids": [1, 2],
                 "message": {"role": "assistant", "content": "floor"}}],
    "prompt_token_ids": list(range(160)),
    "usage": {"prompt_tokens": 160, "completion_tokens": 2, "total_tokens": 162}})


async def serve(port: int, model: str) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from rlfabric.text import load_chat_format

    fmt = load_chat_format(model)

    async def chat(request: Request) -> Response:
        msgspec.json.decode(await request.body())
        return Response(RESPONSE, media_type="application/json")

    async def templated(request: Request) -> Response:
        body = msgspec.json.decode(await request.body())
        fmt.encode(fmt.render(body["messages"], tools=body.get("tools")))
        return Response(RESPONSE, media_type="application/json")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/template/v1/chat/completions", templated,
                                  methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           lifespan="off"))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)  # connections queue from here on: the line below may be acted on at once
    print(f"serving on {port}", flush=True)
    await server.serve(sockets=[sock])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="tinyqwen", help="whose chat template and tokenizer")
    a = p.parse_args()
    anyio.run(serve, a.port, a.model, backend_options={"use_uvloop": True})


if __name__ == "__main__":
    main()
