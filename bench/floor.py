"""The floor rows of the benchmarks: the same message pattern done with nats-py directly (no
rlfabric), so a table shows what rlfabric adds on top of NATS itself.

Responder processes (the trainer side of each pattern lives in its benchmark module):

    python -m rlfabric.bench.floor control --nats URL --subject S --count N
        N core subscriptions on S.>; each answers every message with a few bytes published
        to the subject in the message's `ack-to` header.
    python -m rlfabric.bench.floor rollout --nats URL --subject S
        pulls from the durable consumer `FLOOR` of the stream holding S (one standing pull
        request, renewed as it ends): every message is a batch of packed requests (msgspec);
        it answers with as many packed results, persisted with one JetStream publish to the
        subject in the `reply-to` header, then acks.
    python -m rlfabric.bench.floor weights --nats URL --subject S
        answers a request on S (JSON: stream, subject, chunks, chunk_bytes, size) once it has
        read every chunk of that subject from the stream (an ordered push consumer) into one
        buffer ("done"; after `READ_WAIT_S` without them all, how many came).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from typing import Any

import anyio
import msgspec
import nats
from anyio.abc import TaskGroup
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

ACK_TO = "ack-to"
PULL_BATCH = 1024  # messages one pull request of the rollout responder asks for
PUBACK_WAIT_S = 10.0  # the rollout responder's wait for a result's PubAck
READ_WAIT_S = 600.0  # the weights responder's wait for every chunk of one job
REPLY_TO = "reply-to"


class FloorRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt: bytes  # int32 token ids
    max_tokens: int


class FloorResult(msgspec.Struct, array_like=True):
    request_id: str
    tokens: bytes  # int32 token ids
    logprobs: bytes  # float32


def echo(req: FloorRequest) -> FloorResult:
    """What the null engine does: the prompt's tokens back, cycled to `max_tokens`, with
    zero logprobs."""
    need = 4 * req.max_tokens
    toks = (req.prompt * (need // max(1, len(req.prompt)) + 1))[:need]
    return FloorResult(request_id=req.request_id, tokens=toks, logprobs=bytes(need))


async def serve(args: argparse.Namespace) -> None:
    nc = await nats.connect(args.nats, name="rlfabric-floor", pending_size=64 * 1024 * 1024)
    try:
        async with anyio.create_task_group() as tg:  # the rollout responder's ack tasks
            await _serve(args, nc, tg)
            tg.cancel_scope.cancel()
    finally:
        await nc.close()


async def _serve(args: argparse.Namespace, nc: nats.NATS, tg: TaskGroup) -> None:
    serve_pattern = {"control": _control, "rollout": _rollout, "weights": _weights}
    subs = await serve_pattern[args.pattern](args, nc, tg)
    await nc.flush()
    print(f"floor: {args.pattern} ready", flush=True)
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            break
    for sub in subs:
        await sub.unsubscribe()


async def _control(args: argparse.Namespace, nc: nats.NATS, tg: TaskGroup) -> list[Any]:
    """`count` responders that each answer every command on its ack subject."""
    subs = []
    for i in range(args.count):
        me = f"f{i}".encode()

        async def answer(msg: Msg, me: bytes = me) -> None:
            await nc.publish((msg.headers or {})[ACK_TO], me)

        subs.append(await nc.subscribe(f"{args.subject}.>", cb=answer))
    return subs


async def _rollout(args: argparse.Namespace, nc: nats.NATS, tg: TaskGroup) -> list[Any]:
    """A pull consumer that echoes each batch of requests into its reply stream, acking each
    batch once its results are stored."""
    js = nc.jetstream(publish_async_max_pending=4096)
    dec = msgspec.msgpack.Decoder(list[FloorRequest])
    enc = msgspec.msgpack.Encoder()
    stream = await js.find_stream_name_by_subject(args.subject)
    # NOTE: one standing pull request, renewed as it ends, not `fetch`: nats-py's fetch
    # waits out its timeout for a full batch once the first message came, which stalls
    # lanes that wait for their results (a second at every start from idle)
    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.FLOOR"
    inbox = nc.new_inbox()
    left = 0

    async def ask() -> None:
        nonlocal left
        left = PULL_BATCH
        await nc.publish(next_subject, json.dumps(
            {"batch": PULL_BATCH, "expires": int(5e9)}).encode(), reply=inbox)

    async def ack_once_stored(fut: asyncio.Future, msg: Msg) -> None:
        # persisted before the request is acked; no PubAck in time: not acked, the
        # server delivers the request again after its ack wait
        with anyio.move_on_after(PUBACK_WAIT_S):
            await fut
            await msg.ack()

    async def on_msg(msg: Msg) -> None:
        nonlocal left
        status = (msg.headers or {}).get("Status")
        if status is not None:
            if status != "100":  # the pull request ended (expired, ...): a new one
                await ask()
            return
        results = [echo(r) for r in dec.decode(msg.data)]
        fut = await js.publish_async((msg.headers or {})[REPLY_TO], enc.encode(results))
        tg.start_soon(ack_once_stored, fut, msg)
        left -= 1
        if left == 0:
            await ask()

    subs = [await nc.subscribe(inbox, cb=on_msg)]
    await ask()
    return subs


async def _weights(args: argparse.Namespace, nc: nats.NATS, tg: TaskGroup) -> list[Any]:
    """For each job on the subject: read every chunk it names from the weights stream into one
    buffer, then answer."""
    js = nc.jetstream()

    async def read(msg: Msg) -> None:
        job = json.loads(msg.data)
        buf = bytearray(job["size"])
        got = 0
        done = anyio.Event()

        async def chunk(m: Msg) -> None:
            nonlocal got
            off = int(m.subject.rsplit(".", 1)[1]) * job["chunk_bytes"]
            buf[off:off + len(m.data)] = m.data
            got += 1
            if got >= job["chunks"]:
                done.set()

        sub = await js.subscribe(f"{job['subject']}.>", stream=job["stream"], cb=chunk,
                                 ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
        try:
            with anyio.move_on_after(READ_WAIT_S):
                await done.wait()
        finally:
            await sub.unsubscribe()
        await msg.respond(b"done" if done.is_set() else
                          f"read {got} of {job['chunks']} chunks in {READ_WAIT_S:.0f}s"
                          .encode())

    return [await nc.subscribe(args.subject, cb=read)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlfabric.bench.floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pattern", choices=("control", "rollout", "weights"))
    p.add_argument("--nats", required=True)
    p.add_argument("--subject", required=True)
    p.add_argument("--count", type=int, default=1, help="responders (control)")
    anyio.run(serve, p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
