"""The floor rows of the benchmarks: the same message pattern done with nats-py directly (no
rlfabric), so a table shows what rlfabric adds on top of NATS itself.

Responder processes (the trainer side of each pattern lives in its benchmark module):

    python -m rlfabric.bench.floor control --nats URL --subject S --count N
        N core subscriptions on S.>; each answers every message with a few bytes published
        to the subject in the message's `ack-to` header.
    python -m rlfabric.bench.floor control --same-work ACKS --nats URL --subject S --count N
                                           [--first K]
        the same N subscriptions (worker ids s<K>, s<K+1>, ...) doing a command receiver's
        work with nats-py and msgspec alone (rlfabric's message types, none of its code): each
        takes the sequence from the subject's last token (`S.<op>.<seq>`) and ignores one it
        applied already, decodes the `Command`, remembers its sequence and id, builds its `Ack`
        (past its deadline an error), remembers it encoded (4,096 commands a responder, as
        `CommandReceiver`), publishes it to `ACKS<cmd_id>`, and sends the remembered acks
        again for a command id it saw before. No membership, catch-up or probes: a lower bound
        of what rlfabric's guarantees cost.
    python -m rlfabric.bench.floor rollout --nats URL --subject S [--engine torch --threads N]
                                           [--consumer NAME]
        pulls from the durable consumer `FLOOR` (or NAME) of the stream holding S (one
        standing pull request, renewed as it ends): every message is a batch of packed
        requests (msgspec); it answers with as many packed results, persisted with one
        JetStream publish to the subject in the `reply-to` header, then acks. The results
        echo the prompt (what the null engine does), or with `--engine` come from that engine
        in this process, the message's requests in one `generate_many` call (no rlfabric bus:
        the floor of a worker serving that engine).
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
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
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
REMEMBER = 4096  # commands a same-work control responder remembers (`CommandReceiver`'s)
REPLY_TO = "reply-to"


class FloorRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt: bytes  # int32 token ids
    max_tokens: int
    seed: int = 0  # the bench request's: the same tokens as every other row samples


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
    if args.same_work:
        return await _control_same_work(args, nc)
    subs = []
    for i in range(args.count):
        me = f"f{i}".encode()

        async def answer(msg: Msg, me: bytes = me) -> None:
            await nc.publish((msg.headers or {})[ACK_TO], me)

        subs.append(await nc.subscribe(f"{args.subject}.>", cb=answer))
    return subs


class _Remembered:
    """What one same-work responder keeps: the sequence it applies next, and its last
    `REMEMBER` commands (sequence -> id, id -> its encoded acks). Nothing here reads
    `seq_ids` (the floor answers no probes): it is kept for what keeping it costs a receiver."""

    __slots__ = ("me", "next_seq", "sent", "seq_ids")

    def __init__(self, me: str) -> None:
        self.me = me
        self.next_seq = 0
        self.seq_ids: OrderedDict[int, str] = OrderedDict()
        self.sent: OrderedDict[str, bytes] = OrderedDict()  # as `CommandReceiver`: one ack


async def _control_same_work(args: argparse.Namespace, nc: nats.NATS) -> list[Any]:
    from rlfabric.schemas import Ack, Command, ErrorCode

    dec = msgspec.msgpack.Decoder(Command)
    enc = msgspec.msgpack.Encoder()
    acks = args.same_work
    subs = []
    for i in range(args.count):
        st = _Remembered(f"s{args.first + i:03d}")

        async def answer(msg: Msg, st: _Remembered = st) -> None:
            seq = int(msg.subject.rpartition(".")[2])
            if seq < st.next_seq:
                return
            cmd = dec.decode(msg.data)
            st.next_seq = seq + 1
            cmd_id = cmd.cmd_id
            st.seq_ids[seq] = cmd_id
            if len(st.seq_ids) > REMEMBER:
                st.seq_ids.popitem(last=False)
            sent = st.sent.get(cmd_id)
            if sent is not None:  # stored twice: answered as the first time
                await nc.publish(acks + cmd_id, sent)
                return
            t0 = time.monotonic()
            late = cmd.deadline and time.time() > cmd.deadline
            ack = Ack(cmd_id=cmd_id, worker_id=st.me, status="error" if late else "ok",
                      error_code=ErrorCode.DEADLINE_EXCEEDED if late else "",
                      weight_version=-1, weights_checksum="sim--1",
                      elapsed_s=time.monotonic() - t0)
            data = enc.encode(ack)
            st.sent[cmd_id] = data
            if len(st.sent) > REMEMBER:
                st.sent.popitem(last=False)
            await nc.publish(acks + cmd_id, data)

        subs.append(await nc.subscribe(f"{args.subject}.>", cb=answer))
    return subs


async def _rollout(args: argparse.Namespace, nc: nats.NATS, tg: TaskGroup) -> list[Any]:
    """A pull consumer that answers each batch of requests into its reply stream (echoed, or
    generated by `--engine`), acking each batch once its results are stored."""
    if args.engine:
        serve = await _engine_server(args, tg)
    js = nc.jetstream(publish_async_max_pending=4096)
    dec = msgspec.msgpack.Decoder(list[FloorRequest])
    enc = msgspec.msgpack.Encoder()
    stream = await js.find_stream_name_by_subject(args.subject)
    # NOTE: one standing pull request, renewed as it ends, not `fetch`: nats-py's fetch
    # waits out its timeout for a full batch once the first message came, which stalls
    # lanes that wait for their results (a second at every start from idle)
    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{args.consumer}"
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

    async def answer(msg: Msg, reqs: list[FloorRequest]) -> None:
        results = await serve(reqs) if args.engine else [echo(r) for r in reqs]
        fut = await js.publish_async((msg.headers or {})[REPLY_TO], enc.encode(results))
        tg.start_soon(ack_once_stored, fut, msg)

    async def on_msg(msg: Msg) -> None:
        nonlocal left
        status = (msg.headers or {}).get("Status")
        if status is not None:
            if status != "100":  # the pull request ended (expired, ...): a new one
                await ask()
            return
        if args.engine:
            tg.start_soon(answer, msg, dec.decode(msg.data))
        else:
            await answer(msg, dec.decode(msg.data))
        left -= 1
        if left == 0:
            await ask()

    subs = [await nc.subscribe(inbox, cb=on_msg)]
    await ask()
    return subs


async def _engine_server(args: argparse.Namespace, tg: TaskGroup
                         ) -> Callable[[list[FloorRequest]], Awaitable[list[FloorResult]]]:
    """`args.engine` running in this process; returns what serves one message's requests
    through one `generate_many` call (each with its bench request's seed)."""
    from rlfabric.engines import make_engine, registry
    from rlfabric.engines.protocol import ServesMany
    from rlfabric.schemas import PackedI32, RolloutRequest, SamplingParams

    registry.prepare_process(args.engine, args.threads)
    engine = make_engine(args.engine, registry.kind(args.engine).default_model)
    if not isinstance(engine, ServesMany):
        raise SystemExit(f"floor: engine {args.engine!r} does not serve many requests in one "
                         "call (generate_many); the floor serves torch or null")
    await tg.start(engine.run)

    async def serve(reqs: list[FloorRequest]) -> list[FloorResult]:
        todo = [RolloutRequest(request_id=r.request_id, min_weight_version=-1,
                               prompt_token_ids=PackedI32(r.prompt),
                               sampling=SamplingParams(max_tokens=r.max_tokens, seed=r.seed))
                for r in reqs]
        out: list[FloorResult] = []
        async for burst in engine.generate_many(todo, worker_id="floor"):
            out.extend(FloorResult(request_id=res.request_id,
                                   tokens=res.completion_token_ids.tobytes(),
                                   logprobs=res.logprobs.tobytes()) for res in burst)
        return out
    return serve


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
    p.add_argument("--first", type=int, default=0,
                   help="control: the number of the first responder (their ids: s000, ...)")
    p.add_argument("--same-work", default="", metavar="ACKS",
                   help="control: do a command receiver's work (decode, order, remember, an "
                   "encoded Ack) and answer on ACKS<cmd_id>, as rlfabric's workers do")
    p.add_argument("--engine", default="", help="rollout: results from this engine (e.g. "
                   "torch; one that serves many requests in one call), not echoed")
    p.add_argument("--threads", type=int, default=1, help="torch threads of --engine")
    p.add_argument("--consumer", default="FLOOR", help="rollout: the durable consumer pulled "
                   "from (default %(default)s)")
    anyio.run(serve, p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
