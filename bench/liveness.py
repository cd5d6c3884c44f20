"""What an idle fleet costs the server, per worker, and what that makes at 10,000 and 100,000.

Measures the nats-server's CPU (Linux: its CPU clock) per operation an idle worker sends, each at a
steady rate from its own connection, as a fleet of single-worker processes would send them:
- `beat`: a core-NATS `Beats` message of one worker id, delivered to one watcher;
- `key write`: a members-bucket `put` of a `WorkerInfo` (what every worker sends every
  `member_key_ttl / 3`, and what every heartbeat was before beats);
- `command poll`: the control-stream read a worker's idle poll makes, finding nothing.
Then the arithmetic: per N workers, messages/s and bytes/s of each kind at the default
intervals (a beat every `member_ttl / 4`, a key write every `member_key_ttl / 3`, a poll every
`poll_max` at the most), and the server CPU they take (% of one core), beside the same for
the former design (a key write every `member_ttl / 4` and a poll every second).

    rlfabric bench liveness [--rate 2000] [--seconds 4] [--sizes 1000,10000,100000] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import nats
import nats.js.errors

from rlfabric.bench._util import cpu_seconds, table
from rlfabric.bus import EmbeddedNats, Limits
from rlfabric.bus.control.membership import new_worker_info
from rlfabric.bus.control.receiver import POLL_MAX
from rlfabric.bus.nats.provision import provision
from rlfabric.bus.subjects import Subjects
from rlfabric.schemas import Beats, encode

POLL_BEFORE = 1.0  # a worker's command poll before polls backed off to `POLL_MAX`


async def _paced(op: Callable[[int], Awaitable[None]], rate: float, seconds: float) -> int:
    """`op(i)` at `rate` a second for `seconds`; the count sent."""
    n = int(rate * seconds)
    t0 = time.perf_counter()
    for i in range(n):
        await op(i)
        ahead = t0 + (i + 1) / rate - time.perf_counter()
        if ahead > 0:
            await anyio.sleep(ahead)
    return n


async def _per_op(pid: int, op: Callable[[int], Awaitable[None]], rate: float,
                  seconds: float) -> float:
    """Server CPU microseconds per `op`."""
    cpu0 = cpu_seconds([pid])
    n = await _paced(op, rate, seconds)
    await anyio.sleep(0.2)  # what the server still had queued
    return (cpu_seconds([pid]) - cpu0) / n * 1e6


async def measure(rate: float, seconds: float) -> dict[str, dict[str, float]]:
    s = Subjects("live")
    info = encode(new_worker_info("w00000", engine="vllm", model="/ckpt/model", capacity=64))
    beat = encode(Beats(worker_ids=("w00000",)))
    async with EmbeddedNats() as srv:
        pid = srv.pid or 0
        sender = await nats.connect(srv.url, name="liveness-sender")
        watcher = await nats.connect(srv.url, name="liveness-watcher")
        try:
            js = sender.jetstream()
            buckets = await provision(js, s, Limits())
            await watcher.subscribe(s.beats, cb=_drop)
            await watcher.flush()

            async def one_beat(i: int) -> None:
                await sender.publish(s.beat("w00000"), beat)

            async def key_write(i: int) -> None:
                await buckets.members.put(f"w{i % 1000:05d}", info)

            async def poll(i: int) -> None:
                try:
                    await js.get_msg(s.control_stream, seq=1_000_000, subject=s.control_all,
                                     next=True)
                except nats.js.errors.NotFoundError:
                    pass

            out = {}
            for name, op, size in (("beat", one_beat, len(beat)), ("key write", key_write,
                                                                   len(info)),
                                   ("command poll", poll, 0)):
                await _paced(op, rate, 0.5)  # warm
                out[name] = {"server_us": await _per_op(pid, op, rate, seconds),
                             "bytes": float(size)}
            return out
        finally:
            await sender.close()
            await watcher.close()


async def _drop(msg: Any) -> None:
    return None


def arithmetic(costs: dict[str, dict[str, float]], sizes: list[int]) -> list[dict[str, Any]]:
    lim = Limits()
    rates = {  # per worker, a second
        "now": {"beat": 4 / lim.member_ttl, "key write": 3 / lim.member_key_ttl,
                "command poll": 1 / POLL_MAX},
        "before": {"beat": 0.0, "key write": 4 / lim.member_ttl,
                   "command poll": 1 / POLL_BEFORE},
    }
    rows = []
    for n in sizes:
        for design, per in rates.items():
            msgs = {k: n * r for k, r in per.items()}
            cpu = sum(msgs[k] * costs[k]["server_us"] for k in msgs) / 1e6 * 100
            rows.append({"workers": n, "design": design,
                         "beats_s": msgs["beat"], "key_writes_s": msgs["key write"],
                         "polls_s": msgs["command poll"],
                         "bytes_s": sum(msgs[k] * costs[k]["bytes"] for k in msgs),
                         "server_pct": cpu})
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=2000.0,
                   help="operations a second while one kind is measured")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--sizes", default="1000,10000,100000")
    p.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    costs = anyio.run(measure, args.rate, args.seconds)
    rows = arithmetic(costs, [int(x) for x in args.sizes.split(",")])
    if args.json:
        print(json.dumps({"per_op": costs, "rows": rows}, indent=2))
        return 0
    print(table([{"op": k, **v} for k, v in costs.items()],
                [("op", "operation", ""), ("server_us", "server CPU us", ".1f"),
                 ("bytes", "payload bytes", ".0f")]))
    print("\nan idle fleet, one worker a process (server CPU in % of one core):")
    print(table(rows, [("workers", "workers", ""), ("design", "design", ""),
                       ("beats_s", "beats/s", ".0f"), ("key_writes_s", "key writes/s", ".0f"),
                       ("polls_s", "polls/s", ".0f"), ("bytes_s", "payload B/s", ".0f"),
                       ("server_pct", "server %", ".1f")]))
    return 0
