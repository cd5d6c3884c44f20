"""`rlfabric bench jobs --fair`: how a pool shares its workers between jobs.

Each part runs on an embedded NATS server and 2 workers (`--engines`: null, torch, sim), every
job a process of its own with a `FabricClient`:
- weights: 3 jobs of weights 1 : 1 : 2 (`--weights`), a job of weight w as w load processes
  (rounded), each keeping `--outstanding` requests of `--share-tokens` out for
  `--share-seconds`: each job's share of the tokens served against
  its weight's share, its p50 / p99 latency, and its requests queued mid-run (none: it was not
  saturating);
- starvation: a light job sending one request at a time, alone, then beside a heavy job's
  burst of `--burst` requests (half of `--share-seconds` each): the light job's p50 / p99
  latency alone and while the burst was served, and their ratio, beside the floor's ratio
  (`bench.share_floor`: the best this machine gives without rlfabric's scheduling);
- bursty (torch and sim: a null worker is not what limits a batch): two jobs that each alternate
  generating a batch (`--batch` requests) and training (a pause of `--train-ratio` times one
  worker's time for the batch), the second starting one pause later: tokens/s on the shared
  pool, and on a static split of the same 2 workers (each job its own pool of one worker),
  side by side;
- quota: a job at `--max-in-flight` beside a saturating one: the most of its requests its
  consumer ever held unacked (sampled every 5 ms) and its answers.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from rlfabric.bench._util import pct, table

#: the engines a part can run on: `sim` is the null engine asleep `--token-s` a max token per
#: request (a device that decodes whatever it admitted at once, without the CPU)
ENGINES = ("null", "torch", "sim")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--fair: fair share between jobs")
    g.add_argument("--fair", action="store_true",
                   help="run the fair-share parts instead (weights, starvation, bursty, quota)")
    g.add_argument("--engines", default="null,torch,sim",
                   help="null: the fabric alone; torch: a CPU model (the machine's cores are "
                   "what is shared); sim: the null engine taking --token-s per max token, "
                   "asleep, as a device would (default %(default)s)")
    g.add_argument("--token-s", type=float, default=0.01,
                   help="sim's seconds per max token of a request (default %(default)s)")
    g.add_argument("--parts", default="weights,starvation,bursty,quota",
                   help="(default %(default)s)")
    g.add_argument("--weights", default="1,1,2", help="the weights part's jobs' weights "
                   "(default %(default)s)")
    g.add_argument("--share-seconds", type=float, default=60.0,
                   help="the weights part's and the starvation part's length (default "
                   "%(default)s)")
    g.add_argument("--outstanding", type=int, default=512,
                   help="requests each job keeps out in the weights part: enough that each "
                   "job's queue never empties (default %(default)s)")
    g.add_argument("--share-tokens", type=int, default=32,
                   help="max tokens of every request (default %(default)s)")
    g.add_argument("--burst", type=int, default=10_000,
                   help="the heavy job's burst in the starvation part (default %(default)s)")
    g.add_argument("--batch", type=int, default=256,
                   help="requests a bursty job generates per step (default %(default)s)")
    g.add_argument("--steps", type=int, default=5,
                   help="steps of each bursty job (default %(default)s)")
    g.add_argument("--train-ratio", type=float, default=1.0,
                   help="a bursty job's training pause, as a part of the time one worker "
                   "takes to generate its batch (default %(default)s)")
    g.add_argument("--max-in-flight", type=int, default=8,
                   help="the quota part's quota (default %(default)s)")
    g.add_argument("--capacity", type=int, default=32,
                   help="each worker's --capacity (default %(default)s)")


def _req(name: str, i: int, max_tokens: int) -> Any:
    from rlfabric.schemas import PackedI32, RolloutRequest, SamplingParams

    return RolloutRequest(request_id=f"{name}-{i}", prompt_token_ids=PackedI32([256, 10 + i % 50]),
                          sampling=SamplingParams(max_tokens=max_tokens, seed=i))


class Served:
    """A job's answers: arrival time, latency and tokens of each."""

    def __init__(self) -> None:
        self.first = anyio.Event()  # set at the first answer
        self.at: list[float] = []
        self.latency: list[float] = []
        self.tokens: list[int] = []
        self.errors = 0

    def add(self, r: Any, sent: float) -> None:
        from rlfabric.schemas import RolloutResult

        if not isinstance(r, RolloutResult):
            self.errors += 1
            return
        now = time.time()  # compared across the loads' processes
        self.first.set()
        self.at.append(now)
        self.latency.append(now - sent)
        self.tokens.append(len(r.completion_token_ids))

    def merge(self, other: Served) -> None:
        self.at += other.at
        self.latency += other.latency
        self.tokens += other.tokens
        self.errors += other.errors

    def tokens_in(self, t0: float, t1: float) -> int:
        return sum(k for t, k in zip(self.at, self.tokens, strict=True) if t0 <= t < t1)


async def _one_at_a_time(c: Any, name: str, until: float, max_tokens: int,
                         served: Served, ids: Any) -> None:
    while time.time() < until:
        sent = time.time()
        async for r in c.generate([_req(name, next(ids), max_tokens)], timeout=300):
            served.add(r, sent)


async def _batches(c: Any, name: str, until: float, size: int, max_tokens: int,
                   served: Served, ids: Any) -> None:
    while time.time() < until:
        sent = time.time()
        async for r in c.generate([_req(name, next(ids), max_tokens) for _ in range(size)],
                                  timeout=600):
            served.add(r, sent)


async def _keep_out(c: Any, name: str, until: float, n: int, max_tokens: int,
                    served: Served) -> None:
    """About `n` requests of `c`'s job out until `until`, in batches of 16 (a trainer's)."""
    ids = itertools.count()
    async with anyio.create_task_group() as tg:
        for _ in range(max(1, n // 16)):
            tg.start_soon(_batches, c, name, until, min(16, n), max_tokens, served, ids)


def _fleet(args: argparse.Namespace, engine: str, workers: int, logs: Path) -> Any:
    from rlfabric.launch.local import LocalFleet

    extra: tuple[str, ...] = ("--capacity", str(args.capacity), "--threads", "1")
    if engine == "sim":
        engine, extra = "null", (*extra, "--token-s", str(args.token_s))
    return LocalFleet("tiny", workers=workers, logs=logs, engine=engine,
                      prefix=f"s{uuid.uuid4().hex[:8]}", extra=extra)


async def _with_jobs(url: str, prefix: str, jobs: list[str], workers: int,
                     body: Callable[[Any, dict[str, Any]], Awaitable[Any]]) -> Any:
    from contextlib import AsyncExitStack

    from rlfabric.trainer import FabricClient

    async with AsyncExitStack() as stack:
        op = await stack.enter_async_context(FabricClient.connect(url, prefix=prefix))
        await op.wait_for_workers(workers, timeout=120)
        clients = {j: await stack.enter_async_context(
            FabricClient.connect(url, prefix=prefix, job=j)) for j in jobs}
        for c in clients.values():  # each job's consumer is made and pulled from
            async for _ in c.generate([_req("warm", 0, 1)], timeout=60):
                pass
        return await body(op, clients)


async def _loads(url: str, prefix: str, specs: list[list[str]]) -> list[Served]:
    """Each spec's load as a process of its own (a job is its own trainer: its client's
    results never wait behind another job's in one event loop), all at once; their answers."""
    import json
    import sys

    out: list[Served] = [Served() for _ in specs]

    async def one(i: int, spec: list[str]) -> None:
        done = await anyio.run_process(
            [sys.executable, "-m", "rlfabric.bench.share", "--nats", url, "--prefix", prefix,
             *spec], check=False)
        if done.returncode != 0:
            raise RuntimeError(f"load {spec} failed: {done.stderr.decode()[-2000:]}")
        got = json.loads(done.stdout.decode().splitlines()[-1])
        out[i].at, out[i].latency, out[i].tokens = got["at"], got["latency"], got["tokens"]
        out[i].errors = got["errors"]

    async with anyio.create_task_group() as tg:
        for i, spec in enumerate(specs):
            tg.start_soon(one, i, spec)
    return out


async def weights(args: argparse.Namespace, engine: str, url: str, prefix: str
                  ) -> list[dict[str, Any]]:
    from rlfabric.schemas import JobShare

    ws = [float(w) for w in args.weights.split(",")]
    names = [f"w{i}" for i in range(len(ws))]

    async def body(op: Any, clients: dict[str, Any]) -> list[dict[str, Any]]:
        for n, w in zip(names, ws, strict=True):
            await op.set_share(n, JobShare(weight=w))
        t0 = time.time() + 5  # the loads connected and warm, the workers read the shares
        until = t0 + args.share_seconds
        queued: dict[str, int] = {}
        async with anyio.create_task_group() as tg:
            async def run() -> None:
                # a job of weight w: w load processes (a trainer's ranks), so that each job's
                # client keeps its queue full on a machine whose cores its load shares
                of = [n for n, w in zip(names, ws, strict=True) for _ in range(max(1, round(w)))]
                got = await _loads(url, prefix, [
                    ["keep", n, "--start", str(t0), "--until", str(until), "--n",
                     str(args.outstanding), "--max-tokens", str(args.share_tokens)]
                    for n in of])
                for n, g in zip(of, got, strict=True):
                    served.setdefault(n, Served()).merge(g)
            served: dict[str, Served] = {}
            tg.start_soon(run)
            await anyio.sleep(t0 - time.time() + args.share_seconds / 2)
            s = op.bus.subjects
            for n in names:  # saturated: each job has requests waiting in the server
                queued[n] = (await op.bus.js.consumer_info(s.rollout_stream,
                                                           s.consumer_of(n))).num_pending
        # the window every job saturated: from a tenth in, to the end of sending
        lo, hi = t0 + args.share_seconds / 10, until
        tokens = {n: served[n].tokens_in(lo, hi) for n in names}
        total = sum(tokens.values()) or 1
        return [{"engine": engine, "job": n, "weight": w, "weight_share": w / sum(ws),
                 "token_share": tokens[n] / total,
                 "off": tokens[n] / total / (w / sum(ws)) - 1,
                 "tokens_s": tokens[n] / (hi - lo),
                 "p50_ms": pct(served[n].latency, 0.5) * 1e3,
                 "p99_ms": pct(served[n].latency, 0.99) * 1e3, "errors": served[n].errors,
                 "queued": queued[n]}
                for n, w in zip(names, ws, strict=True)]

    return await _with_jobs(url, prefix, names, 2, body)


async def starvation(args: argparse.Namespace, engine: str, url: str, prefix: str
                     ) -> dict[str, Any]:
    async def body(op: Any, clients: dict[str, Any]) -> dict[str, Any]:
        half = args.share_seconds / 2
        t0 = time.time() + 5
        alone, = await _loads(url, prefix, [["one", "light", "--start", str(t0), "--until",
                                             str(t0 + half), "--max-tokens",
                                             str(args.share_tokens)]])
        t1 = time.time() + 5
        # the light job starts a second after the burst: its queue is full by then
        beside, burst = await _loads(url, prefix, [
            ["one", "light", "--start", str(t1 + 1), "--until", str(t1 + 1 + half),
             "--max-tokens", str(args.share_tokens)],
            ["burst", "heavy", "--start", str(t1), "--n", str(args.burst), "--max-tokens",
             str(args.share_tokens)]])
        end = max(burst.at, default=t1)  # beside the burst: answered before its last one
        during = [lat for at, lat in zip(beside.at, beside.latency, strict=True) if at <= end]
        return {"engine": engine, "burst": args.burst, "burst_s": end - t1,
                "alone_p50_ms": pct(alone.latency, 0.5) * 1e3,
                "alone_p99_ms": pct(alone.latency, 0.99) * 1e3,
                "beside_p50_ms": pct(during, 0.5) * 1e3,
                "beside_p99_ms": pct(during, 0.99) * 1e3,
                "ratio_p99": pct(during, 0.99) / pct(alone.latency, 0.99),
                "light_n": len(during), "errors": alone.errors + beside.errors + burst.errors}

    return await _with_jobs(url, prefix, ["light", "heavy"], 2, body)


def _starvation_part(args: argparse.Namespace, engine: str, url: str, prefix: str) -> bool:
    """Runs and prints the starvation part; whether it met its target."""
    row = anyio.run(starvation, args, engine, url, prefix)
    row["floor_ratio_p99"] = _starvation_floor(args, engine)
    print(f"\nstarvation ({engine}): a light job, one request at a time, alone and beside a "
          f"burst of {args.burst}")
    print(table([row], [("alone_p50_ms", "alone p50 ms", ".1f"),
                        ("alone_p99_ms", "alone p99 ms", ".1f"),
                        ("beside_p50_ms", "beside p50 ms", ".1f"),
                        ("beside_p99_ms", "beside p99 ms", ".1f"),
                        ("ratio_p99", "p99 ratio", ".2f"),
                        ("floor_ratio_p99", "floor's p99 ratio", ".2f"),
                        ("light_n", "light requests", ""), ("burst_s", "burst s", ".1f"),
                        ("errors", "errors", "")]))
    return bool(row["ratio_p99"] <= 1.5 and not row["errors"])


def _starvation_floor(args: argparse.Namespace, engine: str) -> float:
    """The p99 ratio at best here without rlfabric (`bench.share_floor`); sim's is 1: its
    requests take no CPU."""
    from rlfabric.bench import share_floor

    if engine == "null":
        got = anyio.run(share_floor.null_floor, args.capacity, args.burst, args.share_tokens,
                        args.share_seconds / 2)
        print(f"\nfloor (null): nats-py, a consumer and 2 processes per job: light p99 alone "
              f"{got['alone_p99_ms']:.1f} ms, beside the burst {got['beside_p99_ms']:.1f} ms "
              f"({got['light_n']} requests in its {got['burst_s']:.1f} s)")
    elif engine == "torch":
        got = anyio.run(share_floor.torch_floor, args.capacity, args.share_tokens)
        print(f"\nfloor (torch): the engine alone: one request {got['one_ms']:.1f} ms, a batch "
              f"of {args.capacity} {got['full_ms']:.1f} ms ({got['ratio']:.2f}x); a request "
              f"that comes mid-batch: up to {got['ratio_p99']:.2f}x")
    else:
        return 1.0
    return float(got["ratio_p99"])


async def bursty(args: argparse.Namespace, engine: str, shared: tuple[str, str],
                 split: list[tuple[str, str]]) -> dict[str, Any]:
    """Tokens/s of two alternating jobs on the shared pool and on a static split."""
    async def gen_time(op: Any, clients: dict[str, Any]) -> float:
        t0 = time.monotonic()
        async for _ in clients["b0"].generate([_req("probe", i, args.share_tokens)
                                               for i in range(args.batch)], timeout=600):
            pass
        return time.monotonic() - t0

    # the training pause: a part of one worker's time for a batch
    train_s = args.train_ratio * await _with_jobs(*split[0], ["b0"], 1, gen_time)

    def spec(job: str, start: float) -> list[str]:
        return ["bursty", job, "--start", str(start), "--n", str(args.batch), "--steps",
                str(args.steps), "--train-s", str(train_s), "--max-tokens",
                str(args.share_tokens)]

    async def on_shared(op: Any, clients: dict[str, Any]) -> list[Served]:
        t0 = time.time() + 5
        return await _loads(*shared, [spec("b0", t0), spec("b1", t0 + train_s)])

    got = await _with_jobs(*shared, ["b0", "b1"], 2, on_shared)
    t0 = time.time() + 5
    async with anyio.create_task_group() as tg:
        split_got: list[Served] = [Served(), Served()]

        async def half(i: int, start: float) -> None:
            split_got[i] = (await _loads(*split[i], [spec(f"b{i}", start)]))[0]
        tg.start_soon(half, 0, t0)
        tg.start_soon(half, 1, t0 + train_s)

    def rate(served: list[Served]) -> tuple[float, float]:
        """Tokens/s from the first request sent to the last answer."""
        first = min(a - lat for s in served for a, lat in zip(s.at, s.latency, strict=True))
        last = max(a for s in served for a in s.at)
        return sum(sum(s.tokens) for s in served) / (last - first), last - first

    def gen_s(served: list[Served]) -> float:
        """A step's generation: from its batch sent to its last answer, on average."""
        steps: dict[tuple[int, float], float] = {}
        for i, s in enumerate(served):
            for a, lat in zip(s.at, s.latency, strict=True):
                key = (i, round(a - lat, 3))
                steps[key] = max(steps.get(key, 0.0), lat)
        return sum(steps.values()) / max(1, len(steps))

    shared_rate, shared_s = rate(got)
    split_rate, split_s = rate(split_got)
    return {"engine": engine, "train_s": train_s, "shared_tokens_s": shared_rate,
            "split_tokens_s": split_rate, "ratio": shared_rate / split_rate,
            "shared_s": shared_s, "split_s": split_s, "shared_gen_s": gen_s(got),
            "split_gen_s": gen_s(split_got), "errors": sum(s.errors for s in got + split_got)}


async def quota(args: argparse.Namespace, engine: str, url: str, prefix: str
                ) -> dict[str, Any]:
    from rlfabric.schemas import JobShare

    async def body(op: Any, clients: dict[str, Any]) -> dict[str, Any]:
        await op.set_share("q", JobShare(max_in_flight=args.max_in_flight))
        await clients["q"].share.refresh()
        s = op.bus.subjects
        held: list[int] = []
        served, other = Served(), Served()
        n = 25 * args.max_in_flight
        async with anyio.create_task_group() as tg:
            tg.start_soon(_keep_out, clients["free"], "f", time.time() + 10,
                          args.outstanding, args.share_tokens, other)

            async def ask() -> None:
                reqs = [_req("q", i, args.share_tokens) for i in range(n)]
                sent = time.monotonic()
                async for r in clients["q"].generate(reqs, timeout=600):
                    served.add(r, sent)
            tg.start_soon(ask)
            while len(served.at) + served.errors < n:
                info = await op.bus.js.consumer_info(s.rollout_stream, s.consumer_of("q"))
                held.append(info.num_ack_pending)
                await anyio.sleep(0.005)
        return {"engine": engine, "max_in_flight": args.max_in_flight, "requests": n,
                "answered": len(served.at), "errors": served.errors, "samples": len(held),
                "most_held": max(held, default=0)}

    return await _with_jobs(url, prefix, ["q", "free"], 2, body)


def main(args: argparse.Namespace) -> int:
    out = Path(args.out or tempfile.mkdtemp(prefix="rlf-bench-share-"))
    parts = set(args.parts.split(","))
    ok = True
    for engine in args.engines.split(","):
        logs = out / engine
        if parts & {"weights", "starvation", "quota"}:
            with _fleet(args, engine, 2, logs / "shared") as f:
                if "weights" in parts:
                    rows = anyio.run(weights, args, engine, f.url, f.prefix)
                    print(f"\nweights ({engine}, 2 workers, {args.share_seconds:.0f} s):")
                    print(table(rows, [("job", "job", ""), ("weight", "weight", "g"),
                                       ("weight_share", "weight share", ".3f"),
                                       ("token_share", "token share", ".3f"),
                                       ("off", "off by", "+.1%"),
                                       ("tokens_s", "tokens/s", ".0f"),
                                       ("p50_ms", "p50 ms", ".1f"), ("p99_ms", "p99 ms", ".1f"),
                                       ("queued", "queued mid-run", ""),
                                       ("errors", "errors", "")]))
                    ok &= all(abs(r["off"]) <= 0.1 and not r["errors"] for r in rows)
                if "starvation" in parts:
                    ok &= _starvation_part(args, engine, f.url, f.prefix)
                if "quota" in parts:
                    row = anyio.run(quota, args, engine, f.url, f.prefix)
                    print(f"\nquota ({engine}):")
                    print(table([row], [("max_in_flight", "--max-in-flight", ""),
                                        ("requests", "requests", ""),
                                        ("answered", "answered", ""), ("errors", "errors", ""),
                                        ("samples", "samples", ""),
                                        ("most_held", "most held at once", "")]))
                    ok &= row["most_held"] <= args.max_in_flight and \
                        row["answered"] == row["requests"]
        if "bursty" in parts and engine != "null":
            with _fleet(args, engine, 2, logs / "bursty") as f, \
                    _fleet(args, engine, 1, logs / "split0") as s0, \
                    _fleet(args, engine, 1, logs / "split1") as s1:
                row = anyio.run(bursty, args, engine, (f.url, f.prefix),
                                [(s0.url, s0.prefix), (s1.url, s1.prefix)])
            print(f"\nbursty ({engine}): two jobs alternating {args.batch}-request batches and "
                  "training; shared pool of 2 workers vs 1 worker each")
            print(table([row], [("train_s", "train s/step", ".2f"),
                                ("shared_tokens_s", "shared tokens/s", ".0f"),
                                ("split_tokens_s", "split tokens/s", ".0f"),
                                ("ratio", "shared / split", ".2f"),
                                ("shared_gen_s", "shared gen s/step", ".2f"),
                                ("split_gen_s", "split gen s/step", ".2f"),
                                ("shared_s", "shared s", ".1f"), ("split_s", "split s", ".1f")]))
            ok &= row["ratio"] >= 1.3
    return 0 if ok else 1


async def _bursty_job(c: Any, name: str, steps: int, batch: int, max_tokens: int,
                      train_s: float, served: Served) -> None:
    """`steps` rounds of: generate a batch, then train (the pool idles for this job)."""
    for k in range(steps):
        reqs = [_req(f"{name}{k}", i, max_tokens) for i in range(batch)]
        sent = time.time()
        async for r in c.generate(reqs, timeout=600):
            served.add(r, sent)
        await anyio.sleep(train_s)  # the trainer's step


async def _load(a: argparse.Namespace) -> Served:
    """One job's load (`python -m rlfabric.bench.share MODE JOB ...`), from `--start` (epoch
    seconds)."""
    from rlfabric.trainer import FabricClient

    served = Served()
    async with FabricClient.connect(a.nats, prefix=a.prefix, job=a.job) as c:
        await c.wait_for_workers(1, timeout=120)
        async for _ in c.generate([_req("warm", 0, 1)], timeout=120):
            pass  # its consumer made and pulled from
        await anyio.sleep(max(0.0, a.start - time.time()))
        if a.mode == "keep":
            await _keep_out(c, a.job, a.until, a.n, a.max_tokens, served)
        elif a.mode == "one":
            await _one_at_a_time(c, a.job, a.until, a.max_tokens, served, itertools.count())
        elif a.mode == "burst":
            sent = time.time()
            async for r in c.generate([_req(a.job, i, a.max_tokens) for i in range(a.n)],
                                      timeout=3600):
                served.add(r, sent)
        else:
            await _bursty_job(c, a.job, a.steps, a.n, a.max_tokens, a.train_s, served)
    return served


if __name__ == "__main__":
    import json

    lp = argparse.ArgumentParser(description="one job's load for `rlfabric bench jobs --fair`")
    lp.add_argument("--nats", required=True)
    lp.add_argument("--prefix", required=True)
    lp.add_argument("mode", choices=["keep", "one", "burst", "bursty"])
    lp.add_argument("job")
    lp.add_argument("--start", type=float, default=0.0)
    lp.add_argument("--until", type=float, default=0.0)
    lp.add_argument("--n", type=int, default=1)
    lp.add_argument("--max-tokens", type=int, default=32)
    lp.add_argument("--steps", type=int, default=1)
    lp.add_argument("--train-s", type=float, default=0.0)
    got = anyio.run(_load, lp.parse_args())
    print(json.dumps({"at": got.at, "latency": got.latency, "tokens": got.tokens,
                      "errors": got.errors}))
