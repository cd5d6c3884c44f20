"""The gateway beside vLLM's own OpenAI server: the same chat requests to each, one table.

Rows, each on the same checkpoint (`tinyqwen`: its real 151,936-row output layer is most of
what a decode step costs on a CPU), the same prompts and completion lengths, streamed:
- `vllm serve`: vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`);
- `vllm serve, logprobs`: the same with `logprobs: true`, the per-token logprobs that every
  gateway response carries (the trainer needs them; the engine computes a log-softmax over the
  vocabulary for them);
- `gateway + N workers`: `rlfabric gateway` before N `rlfabric worker --engine vllm`;
all with the model in vLLM's engine-core process beside its front end
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as rlfabric's workers run it), fp32, eager, the same
`--max-num-seqs` and KV cache. Columns: requests/s, that over each vLLM row, time to first
token p50, turn latency p50/p99, completion tokens/s, the CPU per turn of every process of the
row (servers, engine cores, workers, gateway, nats-server; not the load generator) and of the
gateway alone. On a machine with few cores the rows compete for the same CPU: total CPU per
turn is what bounds throughput there.

Then the gateway's own cost: agent sessions at concurrency 1 (every turn a new user message,
`--cost-tokens` completion tokens), each turn through the gateway and then its prompt tokens
with its seed straight through `FabricClient.generate` on the same worker, the prefix cache
reset before each, so both do the same engine work: turn p50 of each, and the median of the
per-turn differences. Beside it, two floors on the same stack (Starlette on uvicorn,
`rlfabric.bench.asgi_floor`), the same request body posted to each, p50: a route that only
reads the body (HTTP), and one that also renders the chat template and tokenizes the messages,
as any chat server must (HTTP + text).

    rlfabric bench gateway [--workers 1,2] [--requests 128] [--concurrency 16]
                           [--max-tokens 64] [--engine vllm|torch] [--json]

`--engine torch` runs the rlfabric rows on the torch engine and leaves vLLM's server out (a
quick run where vLLM is not installed); `--engine null` on the echo engine, which takes the
model's time out of the gateway's cost (turns do the same work to the token).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio

from rlfabric.bench._util import children, cpu_seconds, descendants, environ, pct, table
from rlfabric.bus import EmbeddedNats
from rlfabric.bus.nats.cluster import free_ports
from rlfabric.engines import registry
from rlfabric.schemas import PackedI32, RolloutRequest, RolloutResult, SamplingParams
from rlfabric.trainer import FabricClient

MODEL = "tinyqwen"
#: vLLM's engine as rlfabric's workers run it, for both rows
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "KMP_BLOCKTIME": "0", "OMP_WAIT_POLICY": "PASSIVE"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="1,2", help="gateway rows: workers behind it")
    p.add_argument("--requests", type=int, default=128, help="requests per row")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=64, help="completion length")
    p.add_argument("--engine", default="vllm", choices=registry.names())
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--sessions", type=int, default=8, help="cost block: sessions")
    p.add_argument("--turns", type=int, default=8, help="cost block: turns per session")
    p.add_argument("--cost-tokens", type=int, default=2,
                   help="cost block: completion tokens per turn")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Request {i}: write a short story about a robot "
                                        f"named R{i} who learns to paint."}]


async def _stream(session: Any, base: str, body: dict[str, Any]) -> tuple[float, float, int]:
    """One streamed chat request: (seconds to the first content, seconds in all, tokens)."""
    t0 = time.perf_counter()
    first = float("nan")
    tokens = 0
    async with session.post(f"{base}/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{base}: {resp.status} {await resp.text()}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for ch in chunk.get("choices", ()):
                if ch["delta"].get("content") and first != first:
                    first = time.perf_counter() - t0
    return first, time.perf_counter() - t0, tokens


async def _load(base: str, n: int, conc: int, max_tokens: int, *, logprobs: bool = False,
                pids: list[int] | None = None, gateway: int | None = None) -> dict[str, Any]:
    """`n` streamed requests, `conc` at a time: throughput, latencies, and the CPU per request
    of `pids` and their descendants, and of the `gateway` process."""
    import aiohttp

    it = iter(range(n))
    ttft: list[float] = []
    lat: list[float] = []
    tokens = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc * 2)) as s:
        async def lane() -> None:
            nonlocal tokens
            for i in it:
                body = {"model": MODEL, "messages": _prompt(i), "max_tokens": max_tokens,
                        "seed": i, "temperature": 1.0, "stream": True,
                        "stream_options": {"include_usage": True}}
                if logprobs:
                    body["logprobs"] = True
                first, total, got = await _stream(s, base, body)
                ttft.append(first)
                lat.append(total)
                tokens += got

        # warm-up (vLLM compiles its logprob ranking on the first request that asks for them)
        await _stream(s, base, {"model": MODEL, "messages": _prompt(-1), "max_tokens": 4,
                                "stream": True, **({"logprobs": True} if logprobs else {})})
        tree = descendants(pids or [])
        gw = [gateway] if gateway else []
        cpu0, gw0 = cpu_seconds(tree), cpu_seconds(gw)
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(conc):
                tg.start_soon(lane)
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(tree) - cpu0 if tree else float("nan")
        gw_cpu = cpu_seconds(gw) - gw0 if gw else float("nan")
    return {"requests_s": n / wall, "ttft_p50_ms": 1e3 * pct(ttft, 0.5),
            "all_cpu_ms": 1e3 * cpu / n, "cpu_ms": 1e3 * gw_cpu / n,
            "p50_ms": 1e3 * pct(lat, 0.5), "p99_ms": 1e3 * pct(lat, 0.99),
            "tokens_s": tokens / wall, "tokens": tokens, "wall_s": wall}


def _worker_cmd(url: str, prefix: str, i: int, args: argparse.Namespace) -> list[str]:
    extra = (["--engine", "vllm", "--max-model-len", str(args.max_model_len), "--kv-cache-gib",
              str(args.kv_cache_gib), "--threads-bind", "nobind"]
             if args.engine == "vllm" else ["--engine", args.engine])
    return ["rlfabric", "worker", "--nats", url, "--prefix", prefix, "--model", MODEL,
            "--worker-id", f"w{i}", "--capacity", "64", "--max-batch", "64", *extra]


@contextlib.asynccontextmanager
async def _gateway_fleet(url: str, prefix: str, workers: int, args: argparse.Namespace
                         ) -> AsyncIterator[tuple[str, int, list[int]]]:
    """N workers and a gateway on job `prefix`: (base URL, the gateway's pid, the workers')."""
    [port] = free_ports(1)
    async with children([_worker_cmd(url, prefix, i, args) for i in range(workers)],
                        ready="ready (", timeout=300) as ws, \
            children([["rlfabric", "gateway", "--nats", url, "--prefix", prefix, "--model",
                       MODEL, "--port", str(port)]], ready="rlfabric gateway: serving",
                       timeout=120) as [gw]:
        yield f"http://127.0.0.1:{port}/v1", gw.pid, [w.pid for w in ws]


@contextlib.asynccontextmanager
async def _vllm_server(args: argparse.Namespace) -> AsyncIterator[tuple[str, int]]:
    from rlfabric.engines import checkpoint_dir

    [port] = free_ports(1)
    cmd = ["vllm.entrypoints.openai.api_server", "--model", checkpoint_dir(MODEL),
           "--served-model-name", MODEL, "--port", str(port), "--dtype", "float32",
           "--max-model-len", str(args.max_model_len), "--enforce-eager", "--max-num-seqs",
           "64", "--disable-log-stats"]
    env = {**ENV, "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(args.kv_cache_gib)))}
    with environ(env):  # the child inherits them
        async with children([cmd], ready="Application startup complete", timeout=300) as [p]:
            yield f"http://127.0.0.1:{port}/v1", p.pid


async def _cost(url: str, prefix: str, base: str, gw_pid: int, floor: str,
                args: argparse.Namespace) -> dict[str, Any]:
    """Session turns through the gateway, each followed by its prompt tokens through
    FabricClient; the gateway's CPU is counted over its turns only."""
    import aiohttp

    via: list[float] = []
    direct: list[float] = []
    http: list[float] = []
    text: list[float] = []
    gw_cpu = 0.0
    n_tokens = args.cost_tokens
    async with aiohttp.ClientSession() as s, \
            FabricClient.connect(url, prefix=prefix) as fabric:
        for k in range(args.sessions):
            msgs: list[dict[str, Any]] = _prompt(k)
            sid = f"cost-{k}-{time.time_ns()}"
            for t in range(args.turns):
                seed = 1000 * k + t
                body = {"model": MODEL, "messages": msgs, "max_tokens": n_tokens,
                        "seed": seed, "temperature": 1.0}
                await fabric.reset_prefix_cache()
                cpu0 = cpu_seconds([gw_pid])
                t0 = time.perf_counter()
                async with s.post(f"{base}/chat/completions", json=body,
                                  headers={"X-Session-ID": sid}) as resp:
                    out = await resp.json()
                via.append(time.perf_counter() - t0)
                gw_cpu += cpu_seconds([gw_pid]) - cpu0
                if resp.status != 200:
                    raise RuntimeError(f"gateway turn failed: {out}")
                ids = out["prompt_token_ids"]
                req = RolloutRequest(request_id=f"d{k}.{t}", prompt_token_ids=PackedI32(ids),
                                     sampling=SamplingParams(max_tokens=n_tokens, seed=seed,
                                                             stop_token_ids=(151645,)))
                await fabric.reset_prefix_cache()
                t0 = time.perf_counter()
                async for res in fabric.generate([req], timeout=120):
                    assert isinstance(res, RolloutResult), res
                    assert res.completion_token_ids.tolist() == \
                        out["choices"][0]["token_ids"], "not the same engine work"
                direct.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                async with s.post(f"{floor}/v1/chat/completions", json=body) as resp:
                    await resp.read()
                http.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                async with s.post(f"{floor}/template/v1/chat/completions", json=body) as resp:
                    await resp.read()
                text.append(time.perf_counter() - t0)
                msgs = [*msgs, out["choices"][0]["message"],
                        {"role": "user", "content": f"And then, part {t + 2}?"}]
    diffs = [a - b for a, b in zip(via, direct, strict=True)]
    return {"turns": len(via), "gateway_p50_ms": 1e3 * pct(via, 0.5),
            "direct_p50_ms": 1e3 * pct(direct, 0.5),
            "added_p50_ms": 1e3 * statistics.median(diffs),
            "http_floor_p50_ms": 1e3 * pct(http, 0.5),
            "text_floor_p50_ms": 1e3 * pct(text, 0.5),
            "gateway_cpu_ms_per_turn": 1e3 * gw_cpu / len(via),
            "prompt_tokens_last": len(ids)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    cost: dict[str, Any] = {}
    if args.engine == "vllm":
        async with _vllm_server(args) as (base, pid):
            for lp in (False, True):
                row = await _load(base, args.requests, args.concurrency, args.max_tokens,
                                  logprobs=lp, pids=[pid])
                rows.append({"path": "vllm serve, logprobs" if lp else "vllm serve", **row})
    async with EmbeddedNats() as nats:
        with environ(ENV):
            for n in [int(x) for x in args.workers.split(",") if x]:
                prefix = f"benchgw{n}"
                async with _gateway_fleet(nats.url, prefix, n, args) as (base, pid, ws):
                    row = await _load(base, args.requests, args.concurrency, args.max_tokens,
                                      pids=[pid, *ws, *([nats.pid] if nats.pid else [])],
                                      gateway=pid)
                    rows.append({"path": f"gateway + {n} worker{'s' if n > 1 else ''}", **row})
                    if n == 1:
                        [port] = free_ports(1)
                        async with children([["rlfabric.bench.asgi_floor", "--port",
                                              str(port)]], ready="serving", timeout=60):
                            cost = await _cost(nats.url, prefix, base, pid,
                                               f"http://127.0.0.1:{port}", args)
    ref, ref_lp = ((rows[0]["requests_s"], rows[1]["requests_s"]) if args.engine == "vllm"
                   else (float("nan"), float("nan")))
    for r in rows:
        r["x_vllm"] = r["requests_s"] / ref
        r["x_vllm_logprobs"] = r["requests_s"] / ref_lp
    return {"engine": args.engine, "requests": args.requests, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "rows": rows, "cost": cost}


def main(args: argparse.Namespace) -> int:
    out = anyio.run(run, args)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['requests']} chat requests x {out['max_tokens']} tokens, streamed, "
          f"{out['concurrency']} at a time ({args.engine} engine, model {MODEL})")
    print(table(out["rows"], [("path", "path", ""), ("requests_s", "req/s", ".2f"),
                              ("x_vllm", "x vllm", ".2f"),
                              ("x_vllm_logprobs", "x vllm lp", ".2f"),
                              ("ttft_p50_ms", "ttft p50 ms", ".1f"),
                              ("p50_ms", "p50 ms", ".1f"), ("p99_ms", "p99 ms", ".1f"),
                              ("tokens_s", "tok/s", ".0f"),
                              ("all_cpu_ms", "cpu ms/turn", ".1f"),
                              ("cpu_ms", "gw cpu ms/turn", ".2f")]))
    c = out["cost"]
    if c:
        print(f"\ngateway's own cost, {c['turns']} session turns at concurrency 1 "
              f"({args.cost_tokens} tokens each, last prompt {c['prompt_tokens_last']} "
              f"tokens): turn p50 {c['gateway_p50_ms']:.2f} ms through the gateway, "
              f"{c['direct_p50_ms']:.2f} ms through FabricClient.generate on the same tokens; "
              f"median per-turn difference {c['added_p50_ms']:+.2f} ms; floors on uvicorn + "
              f"Starlette, the same body: HTTP {c['http_floor_p50_ms']:.2f} ms p50, HTTP + "
              f"chat template + tokenizer {c['text_floor_p50_ms']:.2f} ms p50; gateway CPU "
              f"{c['gateway_cpu_ms_per_turn']:.2f} ms per turn")
    return 0
