"""The receiving side: ordered, idempotent by cmd_id, and unbreakable by bad payloads."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from rlfabric.bus import AckFields, CommandFailed, CommandReceiver, QuorumPolicy, new_cmd_id
from rlfabric.schemas import (
    CMD_ID_HEADER,
    Ack,
    ErrorEvent,
    Pause,
    Resume,
    RolloutResult,
    Sleep,
    codec_for,
    encode,
    headers,
    op_of,
)

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


class Recorder:
    def __init__(self) -> None:
        self.ran: list[tuple[int, str, str]] = []

    async def handle(self, cmd, ctx) -> AckFields:
        self.ran.append((cmd.seq, type(cmd).__name__, cmd.cmd_id))
        if isinstance(cmd, Sleep) and cmd.level > 2:
            raise CommandFailed("bad_level", f"sleep level {cmd.level} does not exist")
        return AckFields(weight_version=7, weights_checksum="abc", detail={"seen": cmd.cmd_id})


class Inbox(list):
    """Decoded messages of one subscription, and a way to await a condition on them."""

    def __init__(self) -> None:
        super().__init__()
        self._news = anyio.Event()

    async def until(self, cond, timeout: float = 5.0) -> None:
        with anyio.fail_after(timeout):
            while not cond():
                news = self._news
                await news.wait()

    def push(self, item) -> None:
        self.append(item)
        self._news.set()
        self._news = anyio.Event()


async def _collect(bus, subject: str, decode_as) -> Inbox:
    codec = codec_for(decode_as)
    inbox = Inbox()

    async def cb(msg) -> None:
        # the ack of a command the worker decoded goes without headers (tracing off)
        bare_ack = decode_as is Ack and msg.headers is None
        inbox.push(codec.decode(msg.data, msg.headers, check_version=not bare_ack))

    await bus.nc.subscribe(subject, cb=cb)
    return inbox


async def test_command_delivered_twice_runs_once_and_acks_the_same(fabric) -> None:
    rec = Recorder()
    async with fabric() as (bus, _watcher, _bc, tg):
        r = CommandReceiver(bus, "w1", rec.handle)
        await tg.start(r.run)
        cmd = Pause(cmd_id=new_cmd_id(), mode="wait")
        acks = await _collect(bus, bus.subjects.ack(cmd.cmd_id), Ack)
        hdrs = headers({CMD_ID_HEADER: cmd.cmd_id})
        # the same command twice in the stream (e.g. a sender retrying past the dedupe window)
        for attempt in range(2):
            await bus.js.publish(bus.subjects.control("pause"), encode(cmd),
                                 headers={**hdrs, "Nats-Msg-Id": f"{cmd.cmd_id}-{attempt}"})
        await acks.until(lambda: len(acks) == 2)
        assert [c for _, _, c in rec.ran] == [cmd.cmd_id]  # executed once
        assert acks[0] == acks[1]  # the second delivery got the very same Ack
        assert acks[0].status == "ok" and acks[0].weight_version == 7
        assert acks[0].detail == {"seen": cmd.cmd_id}
        assert r.handled == 1


async def test_a_two_phase_command_delivered_twice_gets_both_acks_again(fabric) -> None:
    """The acks a command produced are remembered in order (`ready`, then `done`) and sent
    again, both, when it is delivered again; the handler runs once. Beyond `remember`
    commands the oldest are forgotten: memory stays bounded."""
    ran: list[str] = []

    async def two_phase(cmd, ctx) -> None:
        ran.append(cmd.cmd_id)
        await ctx.ready()

    async with fabric() as (bus, _watcher, _bc, tg):
        r = CommandReceiver(bus, "w1", two_phase, remember=2)
        await tg.start(r.run)
        cmds = [Pause(cmd_id=new_cmd_id(), mode="wait") for _ in range(3)]
        acks = await _collect(bus, bus.subjects.ack(cmds[1].cmd_id), Ack)
        hdrs = headers({CMD_ID_HEADER: cmds[1].cmd_id})
        for attempt in range(2):
            await bus.js.publish(bus.subjects.control("pause"), encode(cmds[1]),
                                 headers={**hdrs, "Nats-Msg-Id": f"{cmds[1].cmd_id}-{attempt}"})
        await acks.until(lambda: len(acks) == 4)
        assert ran == [cmds[1].cmd_id]
        assert [a.phase for a in acks] == ["ready", "done", "ready", "done"]
        assert acks[:2] == acks[2:]
        # two more commands: the first one applied is forgotten, and runs again if stored again
        for c in (cmds[0], cmds[2], cmds[1]):
            await bus.js.publish(bus.subjects.control("pause"), encode(c),
                                 headers=headers({CMD_ID_HEADER: c.cmd_id}))
        await acks.until(lambda: len(acks) == 6)
        assert ran == [cmds[1].cmd_id, cmds[0].cmd_id, cmds[2].cmd_id, cmds[1].cmd_id]


async def test_commands_apply_in_seq_order(fabric) -> None:
    rec = Recorder()
    async with fabric() as (bus, watcher, bc, tg):
        r = CommandReceiver(bus, "w1", rec.handle)
        await tg.start(r.run)
        from rlfabric.bus import Registration, new_worker_info

        await tg.start(Registration(bus, new_worker_info("w1", engine="t", model="m")).run)
        await watcher.wait_until(lambda s: s.worker_ids == ("w1",), timeout=10)
        reps = []
        for cmd in [Pause(cmd_id=new_cmd_id()), Resume(cmd_id=new_cmd_id()),
                    Pause(cmd_id=new_cmd_id(), mode="keep"), Resume(cmd_id=new_cmd_id())]:
            reps.append(await bc.broadcast(cmd, QuorumPolicy(timeout=10)))
        seqs = [s for s, _, _ in rec.ran]
        assert seqs == sorted(seqs) and len(set(seqs)) == 4
        assert [n for _, n, _ in rec.ran] == ["Pause", "Resume", "Pause", "Resume"]
        assert r.applied_seq == seqs[-1]
        # a handler's typed failure is an error Ack, and the loop goes on
        from rlfabric.bus import QuorumNotReached

        with pytest.raises(QuorumNotReached, match=r"w1 \(bad_level: sleep level 9"):
            await bc.broadcast(Sleep(cmd_id=new_cmd_id(), level=9), QuorumPolicy(timeout=10))
        rep = await bc.broadcast(Resume(cmd_id=new_cmd_id()), QuorumPolicy(timeout=10))
        assert rep.ok == ("w1",)


async def test_malformed_commands_give_typed_errors_then_a_valid_one_runs(fabric) -> None:
    rec = Recorder()
    async with fabric() as (bus, _watcher, _bc, tg):
        r = CommandReceiver(bus, "w1", rec.handle)
        await tg.start(r.run)
        events = await _collect(bus, bus.subjects.events("error", "w1"), ErrorEvent)
        acks = await _collect(bus, f"{bus.subjects.prefix}.ack.*", Ack)
        subj = bus.subjects.control("pause")
        # 1. garbage bytes, with the sender's cmd-id header
        await bus.js.publish(subj, b"\xc1\xff not msgpack",
                             headers=headers({CMD_ID_HEADER: "garbage1"}))
        # 2. a well-formed rlfabric message of the wrong type
        wrong = RolloutResult(request_id="r", worker_id="x", completion_token_ids=[1],
                              logprobs=[0.0], finish_reason="stop")
        await bus.js.publish(subj, encode(wrong), headers=headers({CMD_ID_HEADER: "wrong1"}))
        # 3. a command from a future major schema version
        await bus.js.publish(subj, encode(Pause(cmd_id="future1")),
                             headers={"rlf-schema": "2.0", CMD_ID_HEADER: "future1"})
        # 4. valid msgpack, a pause with a field of the wrong type
        bad_field = msgspec.msgpack.encode({"op": "pause", "cmd_id": "typed1", "mode": 5})
        await bus.js.publish(subj, bad_field, headers=headers({CMD_ID_HEADER: "typed1"}))
        # 5. a well-formed pause whose cmd_id cannot name an ack subject (found by the fuzz
        # test: the worker died sending the ack)
        await bus.js.publish(subj, encode(Pause(cmd_id="\xcc\xfc\x18 a.b")),
                             headers=headers({CMD_ID_HEADER: "badid1"}))
        # 6. then a valid command
        good = Pause(cmd_id=new_cmd_id())
        await bus.js.publish(subj, encode(good), headers=headers({CMD_ID_HEADER: good.cmd_id}))
        await events.until(lambda: len(events) == 5)
        await acks.until(lambda: any(a.cmd_id == good.cmd_id for a in acks))
        assert [e.code for e in events] == ["malformed", "malformed", "unknown_schema_version",
                                            "malformed", "malformed"]
        assert [e.cmd_id for e in events] == ["garbage1", "wrong1", "future1", "typed1",
                                              "badid1"]
        assert "cmd_id" in events[4].message
        assert all(e.source == "w1" and e.subject == subj for e in events)
        assert "2.0" in events[2].message
        assert "mode" in events[3].message  # says where
        by_id = {a.cmd_id: a for a in acks}
        assert by_id["garbage1"].status == "error" and by_id["garbage1"].error_code == "malformed"
        assert by_id["future1"].error_code == "unknown_schema_version"
        assert by_id["badid1"].error_code == "malformed"
        assert by_id[good.cmd_id].status == "ok"
        assert [c for _, _, c in rec.ran] == [good.cmd_id]  # only the valid one ran
        assert r.rejected == 5
        # all six were read from the log (none had a live copy) and passed over, in order
        info = await bus.js.stream_info(bus.subjects.control_stream)
        assert r.next_seq == info.state.last_seq + 1
        assert r.caught_up == 6 and r.applied_live == 0


async def test_expired_command_is_refused_not_run(fabric) -> None:
    rec = Recorder()
    async with fabric() as (bus, _watcher, _bc, tg):
        r = CommandReceiver(bus, "w1", rec.handle)
        await tg.start(r.run)
        cmd = Pause(cmd_id=new_cmd_id(), deadline=1.0)  # 1970
        acks = await _collect(bus, bus.subjects.ack(cmd.cmd_id), Ack)
        await bus.js.publish(bus.subjects.control("pause"), encode(cmd),
                             headers=headers({CMD_ID_HEADER: cmd.cmd_id}))
        await acks.until(lambda: len(acks) == 1)
        assert acks[0].error_code == "deadline_exceeded"
        assert rec.ran == []


async def test_a_handler_that_raises_is_answered_with_its_error_and_the_next_runs(
        fabric) -> None:
    async def flaky(cmd, ctx) -> None:
        if isinstance(cmd, Pause):
            raise RuntimeError("engine fell over")

    async with fabric() as (bus, _watcher, _bc, tg):
        r = CommandReceiver(bus, "w1", flaky)
        await tg.start(r.run)
        cmds = [Pause(cmd_id=new_cmd_id()), Resume(cmd_id=new_cmd_id())]
        acks = await _collect(bus, bus.subjects.ack_all, Ack)
        for cmd in cmds:
            await bus.js.publish(bus.subjects.control(op_of(cmd)), encode(cmd),
                                 headers=headers({CMD_ID_HEADER: cmd.cmd_id}))
        await acks.until(lambda: len(acks) == 2)
        assert [(a.cmd_id, a.status, a.error_code) for a in acks] == [
            (cmds[0].cmd_id, "error", "handler_error"), (cmds[1].cmd_id, "ok", "")]
        assert acks[0].error_message == "RuntimeError: engine fell over"
        assert r.handled == 2 and r.applied_seq == r.next_seq - 1


async def test_a_handler_running_from_its_live_copy_has_ended_when_the_receiver_stops(
        fabric) -> None:
    """A live copy in order is applied in its subscription's callback (no hop to the loop);
    stopping the receiver cancels that handler and returns only once it has unwound."""
    started, unwound = anyio.Event(), []

    async def stuck(cmd, ctx) -> AckFields:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:  # a cleanup that takes a while (an engine's abort, say)
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.2)
            unwound.append(cmd.cmd_id)
        return AckFields()

    async with fabric() as (bus, _watcher, bc, _tg):
        r = CommandReceiver(bus, "w1", stuck)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as inner:
                await inner.start(r.run)
                cmd = await bc._publish(Pause(cmd_id=new_cmd_id()))  # stored, then live
                with anyio.fail_after(10):
                    await started.wait()
                assert (r.applied_live, r.caught_up) == (1, 0)  # from its live copy
                scope.cancel()
        assert unwound == [cmd.cmd_id]  # not still unwinding after the worker went on
