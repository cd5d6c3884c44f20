"""The HTTP way, for comparison: one engine behind a plain aiohttp server, as RL stacks run
inference servers today. POST /generate with a JSON request (token ids as lists, as vLLM's
/inference/v1/generate takes them); JSON results back.

    python -m rlfabric.bench.http_server --engine null --port 8100
"""

from __future__ import annotations

import argparse
import json

import anyio
from aiohttp import web

from rlfabric.engines import make_engine, registry, running
from rlfabric.schemas import RolloutRequest, SamplingParams


def result_json(res) -> dict:
    return {"request_id": res.request_id, "sample_index": res.sample_index,
            "token_ids": res.completion_token_ids.tolist(), "logprobs": res.logprobs.tolist(),
            "finish_reason": res.finish_reason,
            "weight_versions": [[s.version, s.start, s.end] for s in res.version_spans]}


async def serve(engine_kind: str, model: str, port: int) -> None:
    async with running(make_engine(engine_kind, model)) as engine:
        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            req = RolloutRequest(request_id=body["request_id"],
                                 prompt_token_ids=body["prompt_token_ids"],
                                 min_weight_version=-1,
                                 sampling=SamplingParams(**body.get("sampling", {})))
            out = [result_json(r) async for r in engine.generate(req, worker_id="http")]
            return web.Response(text=json.dumps(out), content_type="application/json")

        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        print(f"http server ready on {port}", flush=True)
        try:
            await anyio.sleep_forever()
        finally:
            await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", default="null")
    p.add_argument("--model", default="tiny")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    registry.prepare_process(a.engine, a.threads)
    try:
        anyio.run(serve, a.engine, a.model, a.port)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
