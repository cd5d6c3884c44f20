"""A worker SIGKILLed halfway through a rollout, again and again: the rollout goes on on the
other worker from the tokens already streamed (`migration="continue"`), against the same
rollout undisturbed and with `restart` (its prompt again, on the other worker).

Two torch workers (the built-in `tiny` model, one thread each); one greedy streamed rollout of
T tokens at a time. In each killed trial the worker serving it is SIGKILLed once half its
tokens have streamed, and a fresh worker takes its place before the next trial. Columns: trials
answered once, token positions streamed more than once (sampled again), answers whose streamed
tokens and logprobs are the answer's own, answers equal to the undisturbed one (greedy), the
largest |logprob - trainer forward pass| (the model at version 0, in this process), and the
time to the answer (median and worst of the trials) against undisturbed.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import statistics
import time
import uuid
from typing import Any

import anyio

from rlfabric.bench._util import children, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=20, help="kills (default %(default)s)")
    p.add_argument("--tokens", type=int, default=512, help="tokens a rollout (default "
                   "%(default)s)")
    p.add_argument("--undisturbed", type=int, default=5,
                   help="undisturbed rollouts timed as the baseline (default %(default)s)")


def _worker(url: str, prefix: str, wid: str) -> list[str]:
    return ["rlfabric", "worker", "--nats", url, "--prefix", prefix, "--worker-id", wid,
            "--engine", "torch", "--threads", "1"]


async def _trial(fabric: Any, req: Any, kill: Any | None, serving: dict[str, str]
                 ) -> dict[str, Any]:
    """One rollout; `kill(worker_id)` once half its tokens have streamed (`serving`: the
    worker whose deltas bring each request's tokens)."""
    from rlfabric.schemas import TokenDelta

    streamed: list[TokenDelta] = []
    answers: list[Any] = []
    t0 = time.monotonic()
    killed = False
    async for item in fabric.rollouts.generate([req], deltas=True, timeout=300):
        if isinstance(item, TokenDelta):
            streamed.append(item)
            if kill is not None and not killed and \
                    sum(len(d.token_ids) for d in streamed) >= req.sampling.max_tokens // 2:
                killed = True
                await kill(serving[req.request_id])
        else:
            answers.append(item)
    return {"seconds": time.monotonic() - t0, "streamed": streamed, "answers": answers}


async def _warm(fabric: Any, wid: str, prompt: list[int]) -> None:
    """Short rollouts until `wid` (just started) has served one: its first is slower."""
    from rlfabric.schemas import PackedI32, RolloutRequest, SamplingParams

    for k in range(100):
        reqs = [RolloutRequest(request_id=f"warm{k}.{i}", prompt_token_ids=PackedI32(prompt),
                               sampling=SamplingParams(max_tokens=16)) for i in range(4)]
        if wid in {r.worker_id async for r in fabric.generate(reqs, timeout=60)}:
            return


def _check(trial: dict[str, Any], prompt: list[int], model: Any, base: list[int] | None
           ) -> dict[str, Any]:
    import numpy as np
    import torch

    from rlfabric.schemas import RolloutResult

    answers, streamed = trial["answers"], trial["streamed"]
    res = answers[0] if len(answers) == 1 else None
    ok = isinstance(res, RolloutResult)
    positions = [d.start + k for d in streamed for k in range(len(d.token_ids))]
    out = {"once": ok, "again": len(positions) - len(set(positions)), "seconds": trial["seconds"],
           "as_streamed": False, "same": False, "parity": float("nan"), "workers": 0}
    if not isinstance(res, RolloutResult):
        return out
    ids, lps = res.completion_token_ids.tolist(), res.logprobs.tolist()
    by_pos = {d.start + k: (t, lp) for d in streamed
              for k, (t, lp) in enumerate(zip(d.token_ids.tolist(), d.logprobs.tolist(),
                                              strict=True))}
    out["as_streamed"] = sorted(by_pos) == list(range(len(ids))) and all(
        by_pos[i] == (ids[i], lps[i]) for i in range(len(ids)))
    out["same"] = base is None or ids == base
    out["workers"] = len({s.worker for s in res.version_spans})
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + ids])).logits.float(), -1)[0]
    idx = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(ids))
    trainer = logp[idx, torch.tensor(ids)].numpy()
    out["parity"] = float(np.max(np.abs(trainer - np.asarray(lps))))
    return out


class _Fleet:
    """Two torch workers of one job; a killed one's place is taken by a fresh one."""

    def __init__(self, url: str, stack: contextlib.AsyncExitStack) -> None:
        self.url, self.stack = url, stack
        self.prefix = f"kl{uuid.uuid4().hex[:8]}"
        self.procs: dict[str, Any] = {}
        #: request id -> the worker whose deltas bring its tokens
        self.serving: dict[str, str] = {}
        self._names = (f"k{i}" for i in range(10_000))

    async def start(self) -> str:
        wid = next(self._names)
        (self.procs[wid],) = await self.stack.enter_async_context(
            children([_worker(self.url, self.prefix, wid)], ready="ready"))
        return wid

    async def kill(self, wid: str) -> None:
        self.procs.pop(wid).send_signal(signal.SIGKILL)

    async def follow(self, fabric: Any) -> None:
        """Learn which worker serves each request from its deltas (`TokenDeltas.worker_id`)."""
        from rlfabric.schemas import TokenDeltas, codec_for

        codec = codec_for(TokenDeltas)

        async def on_deltas(msg: Any) -> None:
            batch = codec.decode(msg.data, msg.headers)
            self.serving.update((d.request_id, batch.worker_id) for d in batch.deltas)

        await fabric.bus.nc.subscribe(fabric.bus.subjects.token_stream(fabric.client_id),
                                      cb=on_deltas)

    async def replace(self, fabric: Any, prompt: list[int]) -> None:
        """A fresh worker in the killed one's place, warm, before the next trial."""
        wid = await self.start()
        await fabric.watcher.wait_until(lambda s: set(s.worker_ids) == set(self.procs),
                                        timeout=120)
        await _warm(fabric, wid, prompt)


async def run(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from rlfabric.schemas import PackedI32, RolloutRequest, SamplingParams
    from rlfabric.tensors.models import build_model
    from rlfabric.trainer import FabricClient

    model = build_model("tiny")
    prompt = [256, 7]
    ids = (f"r{i}" for i in range(10_000))
    rows: list[dict[str, Any]] = []
    base: list[int] | None = None
    async with contextlib.AsyncExitStack() as stack:
        fleet = _Fleet(url, stack)
        for _ in range(2):
            await fleet.start()
        fabric = await stack.enter_async_context(FabricClient.connect(url, prefix=fleet.prefix))
        await fabric.wait_for_workers(2, timeout=120)
        await fleet.follow(fabric)
        for mode, n in (("undisturbed", args.undisturbed), ("killed", args.trials),
                        ("killed, restart", max(1, args.trials // 4))):
            checks = []
            for _ in range(n):
                req = RolloutRequest(
                    request_id=next(ids), prompt_token_ids=PackedI32(prompt), stream=True,
                    migration="restart" if "restart" in mode else "continue",
                    sampling=SamplingParams(max_tokens=args.tokens, temperature=0.0))
                trial = await _trial(fabric, req, None if mode == "undisturbed" else fleet.kill,
                                     fleet.serving)
                checks.append(_check(trial, prompt, model, base))
                if base is None and checks[-1]["once"]:
                    base = trial["answers"][0].completion_token_ids.tolist()
                if mode != "undisturbed":
                    await fleet.replace(fabric, prompt)
            rows.append(_row(mode, checks))
    first = rows[0]["p50"]
    for r in rows:
        r["ratio"], r["worst"] = r["p50"] / first, r["max"] / first
    return rows


def _row(mode: str, checks: list[dict[str, Any]]) -> dict[str, Any]:
    secs = [c["seconds"] for c in checks]
    return {"mode": mode, "trials": len(checks), "once": sum(c["once"] for c in checks),
            "again": sum(c["again"] for c in checks),
            "as_streamed": sum(c["as_streamed"] for c in checks),
            "same": sum(c["same"] for c in checks),
            "moved": sum(c["workers"] > 1 for c in checks),
            "parity": max(c["parity"] for c in checks),
            "p50": statistics.median(secs), "max": max(secs)}


def main(args: argparse.Namespace) -> int:
    from rlfabric.bus import EmbeddedNats

    async def go() -> list[dict[str, Any]]:
        async with EmbeddedNats() as nats:
            return await run(nats.url, args)

    rows = anyio.run(go)
    print(f"one greedy streamed rollout of {args.tokens} tokens at a time, 2 torch workers "
          "(tiny); the serving worker SIGKILLed at half its tokens")
    print(table(rows, [("mode", "run", ""), ("trials", "trials", ""),
                       ("once", "answered once", ""), ("moved", "two workers", ""),
                       ("again", "tokens sampled again", ""),
                       ("as_streamed", "as streamed", ""), ("same", "same as undisturbed", ""),
                       ("parity", "max |lp - trainer|", ".1e"), ("p50", "p50 s", ".2f"),
                       ("max", "max s", ".2f"), ("ratio", "p50 x undisturbed", ".2f"),
                       ("worst", "max x undisturbed", ".2f")]))
    return 0
