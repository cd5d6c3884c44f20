"""The chaos suite: 10,000 rollouts through real torch workers on a real nats-server while
workers are SIGKILLed (and replaced) and the broker is SIGKILLed and restarted with its
store. Counted, not sampled: every request gets exactly one reply and it is a result (0 lost,
0 duplicated), each answer's spans cover its tokens once (0 duplicated or dropped within it,
a sample sent on from a killed worker's tokens too), and at the end no worker holds work and
the queue is empty (0 wedged).

The events are driven by progress (the k-th at k/9 of the results), so they land while work
is in flight however fast this machine is. Counts are printed (run with -s).
"""

from __future__ import annotations

import itertools
import signal
import subprocess
import time
from collections import Counter

import anyio
import pytest

from rlfabric.bus import EmbeddedNats, QuorumPolicy
from rlfabric.schemas import RolloutError, RolloutRequest, RolloutResult, SamplingParams
from rlfabric.tensors.models import build_model
from rlfabric.trainer import FabricClient

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.anyio, pytest.mark.timeout(600)]

TOTAL = 10_000
EVENTS = ("kill", "kill", "broker", "kill", "kill", "broker", "kill", "kill")  # 6 + 2


def tokens(i: int) -> int:
    return 96 if i % 20 == 0 else 8


def covered_once(res: RolloutResult, max_tokens: int) -> bool:
    """Whether `res`'s spans cover each of its tokens once, in order, with a logprob each."""
    n, at = len(res.completion_token_ids), 0
    for sp in res.version_spans:
        if sp.start != at or sp.end <= sp.start:
            return False
        at = sp.end
    return at == n <= max_tokens and len(res.logprobs) == n


async def test_chaos_10000_rollouts_6_worker_kills_2_broker_restarts(
        spawn, tmp_path, prefix) -> None:
    srv = EmbeddedNats(store_dir=str(tmp_path / "store"))
    await anyio.to_thread.run_sync(srv.start)
    names = (f"k{i}" for i in itertools.count())
    live: dict[str, subprocess.Popen[str]] = {}

    def start_worker() -> None:
        wid = next(names)
        live[wid] = spawn("worker", "--nats", srv.url, "--prefix", prefix, "--worker-id", wid,
                          "--engine", "torch", "--threads", "1", "--capacity", "16",
                          module="rlfabric")

    counts: Counter[str] = Counter()
    replies: Counter[str] = Counter()
    redelivered = 0
    try:
        for _ in range(3):
            start_worker()
        async with FabricClient.connect(srv.url, prefix=prefix,
                                        policy=QuorumPolicy(timeout=60)) as fabric:
            await fabric.wait_for_workers(3, timeout=90)
            await fabric.update_weights(0, module=build_model("tiny"), transport="nats",
                                        verify="off")
            # one in 20 long enough to send deltas (every 32 tokens): a kill sends it on
            reqs = [RolloutRequest(request_id=f"q{i}", prompt_token_ids=[256, 7, i % 200],
                                   sampling=SamplingParams(max_tokens=tokens(i), seed=i))
                    for i in range(TOTAL)]
            progress = anyio.Event()
            t0 = time.monotonic()

            async def consume() -> None:
                nonlocal redelivered
                async for res in fabric.generate(reqs, timeout=540):
                    replies[res.request_id] += 1
                    if isinstance(res, RolloutResult):
                        counts["results"] += 1
                        redelivered += res.attempt > 1
                        # 0 tokens duplicated or dropped within an answer: its spans (the
                        # workers and versions of each part, a moved one's too) cover it once
                        if not covered_once(res, tokens(int(res.request_id[1:]))):
                            counts["tokens amiss"] += 1
                        counts["sent on"] += len({sp.worker for sp in res.version_spans}) > 1
                    elif isinstance(res, RolloutError):
                        counts[f"error:{res.code}"] += 1
                    progress.set()

            async def chaos() -> None:
                nonlocal progress
                for k, event in enumerate(EVENTS, start=1):
                    while len(replies) < k * TOTAL // (len(EVENTS) + 1):
                        progress = anyio.Event()
                        await progress.wait()
                    if event == "kill":
                        wid = sorted(live)[0]
                        proc = live.pop(wid)
                        proc.send_signal(signal.SIGKILL)
                        counts["worker kills"] += 1
                        start_worker()  # a replacement joins mid-run
                    else:
                        await anyio.to_thread.run_sync(srv.kill)
                        await anyio.sleep(2.0)
                        await anyio.to_thread.run_sync(srv.start)
                        counts["broker restarts"] += 1

            async with anyio.create_task_group() as tg:
                tg.start_soon(chaos)
                await consume()
            elapsed = time.monotonic() - t0
            # 0 wedged: the live workers (the replacements included) hold nothing, serve, and
            # the queue is empty; the killed ones have left the membership (their keys expired
            # and they do not answer), so the describe() below addresses exactly the live ones
            await fabric.wait_for_workers(3, timeout=90)
            await fabric.watcher.wait_until(lambda s: set(s.worker_ids) == set(live), timeout=90)
            after = [r async for r in fabric.generate(
                [RolloutRequest(request_id=f"after{i}", prompt_token_ids=[256, 1],
                                sampling=SamplingParams(max_tokens=4)) for i in range(30)],
                timeout=60)]
            # requests a killed worker had served but not acked come back after ack_wait and
            # are served again (their results dropped as duplicates): let them finish
            s = fabric.bus.subjects
            with anyio.fail_after(90):
                # nothing to await but the server's counters
                while True:
                    ci = await fabric.bus.js.consumer_info(s.rollout_stream,
                                                           s.rollout_consumer)
                    if ci.num_pending == 0 and ci.num_ack_pending == 0:
                        break
                    await anyio.sleep(0.5)
            rep = await fabric.describe()
            dropped = fabric.duplicates_dropped
    finally:
        await anyio.to_thread.run_sync(srv.stop)

    lost = TOTAL - len(replies)
    duplicated = sum(n - 1 for n in replies.values() if n > 1)
    wedged = sorted(w for w, a in rep.acks.items() if a.detail.get("in_flight") != "0")
    print(f"\nchaos: {TOTAL} rollouts in {elapsed:.1f} s, {counts['worker kills']} worker kills, "
          f"{counts['broker restarts']} broker restarts")
    print(f"  results {counts['results']}, errors "
          f"{sum(v for k, v in counts.items() if k.startswith('error:'))}, lost {lost}, "
          f"duplicated {duplicated}, wedged {len(wedged)}; served on a later delivery (a worker "
          f"died or the broker went) {redelivered}, duplicates dropped by the client {dropped}; "
          f"sent on from a killed worker's tokens {counts['sent on']}, with tokens amiss "
          f"{counts['tokens amiss']}")
    print("  live workers afterwards (in flight, served): "
          + ", ".join(f"{w} ({a.detail.get('in_flight')}, {a.detail.get('served')})"
                      for w, a in sorted(rep.acks.items())))
    assert counts["worker kills"] == 6 and counts["broker restarts"] == 2
    assert lost == 0 and duplicated == 0 and counts["tokens amiss"] == 0, counts
    assert counts["results"] == TOTAL, counts
    assert not wedged and set(rep.ok) == set(live), (rep.ok, rep.missing)
    assert all(isinstance(r, RolloutResult) for r in after) and len(after) == 30
    assert ci.num_pending == 0 and ci.num_ack_pending == 0
