"""The live path of commands keeps the guarantees of the log: every worker applies the same
gapless sequence exactly once, whatever reached it live and whatever it had to read back.
What goes on the wire per worker and command carries no headers (tracing off)."""

from __future__ import annotations

import random

import anyio
import pytest
from anyio.abc import TaskStatus

from rlfabric.bus import (
    Broadcaster,
    Bus,
    CommandReceiver,
    Limits,
    MembershipWatcher,
    QuorumNotReached,
    QuorumPolicy,
    Registration,
    new_cmd_id,
    new_worker_info,
)
from rlfabric.bus.control.receiver import CommandContext
from rlfabric.concurrency.sync import Signal
from rlfabric.schemas import (
    CMD_ID_HEADER,
    SCHEMA_HEADER,
    SCHEMA_MAJOR,
    SCHEMA_VERSION,
    Command,
    Describe,
    Pause,
    ResetPrefixCache,
    Resume,
    Sleep,
    Wake,
    encode,
    headers,
)

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


class Log:
    def __init__(self) -> None:
        self.applied: list[tuple[int, str]] = []
        self._news = Signal()

    async def handle(self, cmd: Command, ctx: CommandContext) -> None:
        self.applied.append((cmd.seq, cmd.cmd_id))
        self._news.fire()

    async def until(self, n: int) -> None:
        while len(self.applied) < n:
            await self._news.event().wait()


def mixed(rng: random.Random) -> Command:
    return rng.choice([
        lambda: Pause(cmd_id=new_cmd_id(), mode=rng.choice(["wait", "abort", "keep"])),
        lambda: Resume(cmd_id=new_cmd_id()),
        lambda: Describe(cmd_id=new_cmd_id()),
        lambda: ResetPrefixCache(cmd_id=new_cmd_id()),
        lambda: Sleep(cmd_id=new_cmd_id(), level=1),
        lambda: Wake(cmd_id=new_cmd_id()),
    ])()


async def test_two_senders_1000_commands_8_workers_same_gapless_sequence(nats_url, prefix):
    workers = [f"w{i}" for i in range(8)]
    logs = {w: Log() for w in workers}
    receivers: dict[str, CommandReceiver] = {}
    limits = Limits(member_ttl=5.0)
    async with Bus.connect(nats_url, prefix=prefix, limits=limits) as wbus, \
            Bus.connect(nats_url, prefix=prefix, limits=limits) as wbus2, \
            anyio.create_task_group() as wtg:
        for i, w in enumerate(workers):  # two worker connections, four workers each
            bus = wbus if i % 2 == 0 else wbus2
            receivers[w] = CommandReceiver(bus, w, logs[w].handle)
            await wtg.start(receivers[w].run)
            await wtg.start(Registration(bus, new_worker_info(w, engine="t", model="m")).run)
        sent: dict[str, list[int]] = {}

        async def sender(name: str, n: int, seed: int) -> None:
            rng = random.Random(seed)
            async with Bus.connect(nats_url, prefix=prefix, limits=limits) as bus, \
                    anyio.create_task_group() as tg:
                watcher = MembershipWatcher(bus)
                await tg.start(watcher.run)
                await watcher.wait_until(lambda s: len(s.members) == 8, timeout=20)
                bc = Broadcaster(bus, watcher)
                seqs = []
                for _ in range(n):
                    async with bc.open(mixed(rng)) as fo:
                        rep = await fo.wait("done", QuorumPolicy(timeout=30))
                        assert sorted(rep.ok) == workers, rep
                        seqs.append(fo.cmd.seq)
                sent[name] = seqs
                tg.cancel_scope.cancel()

        with anyio.fail_after(240):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender, "a", 500, 1)
                tg.start_soon(sender, "b", 500, 2)
        all_seqs = sorted(sent["a"] + sent["b"])
        assert len(all_seqs) == 1000 and len(set(all_seqs)) == 1000
        assert all_seqs == list(range(all_seqs[0], all_seqs[0] + 1000))  # gapless
        first = logs[workers[0]].applied
        assert [s for s, _ in first] == all_seqs  # in stream order, each once
        assert len({c for _, c in first}) == 1000
        for w in workers[1:]:
            assert logs[w].applied == first, w  # the very same sequence on every worker
        live = sum(r.applied_live for r in receivers.values())
        read = sum(r.caught_up for r in receivers.values())
        assert live + read == 8000
        print(f"8 workers x 1000 commands: {live} applied from the live copy, {read} read "
              "back from the stream (the two senders' copies overtaking each other)")
        wtg.cancel_scope.cancel()


async def test_a_worker_that_misses_live_copies_catches_up_in_order(fabric):
    a, b = Log(), Log()
    async with fabric() as (bus, watcher, bc, tg):
        ra = CommandReceiver(bus, "wa", a.handle)
        rb = CommandReceiver(bus, "wb", b.handle, poll=0.5)
        await tg.start(ra.run)
        await tg.start(rb.run)
        await tg.start(Registration(bus, new_worker_info("wa", engine="t", model="m")).run)
        await watcher.wait_until(lambda s: s.worker_ids == ("wa",), timeout=10)
        await rb.live_sub.unsubscribe()  # its core subscription cut: no more live copies
        cmds = [Pause(cmd_id=new_cmd_id()) if i % 2 == 0 else Resume(cmd_id=new_cmd_id())
                for i in range(20)]
        for cmd in cmds:
            rep = await bc.broadcast(cmd, QuorumPolicy(timeout=10))
            # wb is no member, but its poll may read a command back before wa's ack lands
            assert "wa" in rep.ok and set(rep.ok) <= {"wa", "wb"}, rep
        assert rb.applied_live == 0  # nothing reached it live (its poll may have begun reading)
        with anyio.fail_after(10):  # its poll reads them back
            await b.until(20)
        assert b.applied == a.applied  # same commands, same seqs, same order
        assert [c for _, c in b.applied] == [c.cmd_id for c in cmds]
        assert rb.caught_up == 20 and rb.applied_live == 0


async def test_no_stream_reads_while_live_copies_flow_and_a_stored_only_command_still_lands(
        fabric):
    """While live copies arrive in order the poll reads nothing from the stream (they show any
    gap themselves); a command stored without a live copy once they stop is read by the next
    quiet poll."""
    log = Log()
    async with fabric() as (bus, watcher, bc, tg):
        r = CommandReceiver(bus, "w1", log.handle, poll=0.5)  # wakes every 0.25-0.75 s
        await tg.start(r.run)
        await tg.start(Registration(bus, new_worker_info("w1", engine="t", model="m")).run)
        await watcher.wait_until(lambda s: s.worker_ids == ("w1",), timeout=10)
        await bc.broadcast(Pause(cmd_id=new_cmd_id()), QuorumPolicy(timeout=10))
        # counted from here: a poll that lands between the first command's store and its live
        # copy (the first poll may come as it goes) applies that one from the stream
        reads, live, caught = r.stream_reads, r.applied_live, r.caught_up
        sent = 0
        with anyio.fail_after(20):
            t_end = anyio.current_time() + 3.0  # four polls' worth, at least
            while anyio.current_time() < t_end:
                await bc.broadcast(Resume(cmd_id=new_cmd_id()), QuorumPolicy(timeout=10))
                sent += 1
                await anyio.sleep(0.02)
        assert r.applied_live - live == sent and r.stream_reads == reads, (
            sent, r.stream_reads - reads)
        stored = Pause(cmd_id=new_cmd_id())  # as another tool would store one: no live copy
        seq = (await bus.js.publish(bus.subjects.control("pause"), encode(stored),
                                    headers=headers({CMD_ID_HEADER: stored.cmd_id}))).seq
        with anyio.fail_after(5):  # within two polls (1.5 s at most)
            await log.until(sent + 2)
        assert log.applied[-1] == (seq, stored.cmd_id) and r.caught_up - caught == 1


async def test_a_lost_live_copy_is_read_back_when_the_sender_probes(fabric):
    """No poll for a long while: the sender's probe (a ping carrying the seq) is what tells
    the worker to read the command from the stream."""
    log = Log()
    async with fabric() as (bus, watcher, bc, tg):
        r = CommandReceiver(bus, "w1", log.handle, poll=3600)
        await tg.start(r.run)
        await tg.start(Registration(bus, new_worker_info("w1", engine="t", model="m")).run)
        await watcher.wait_until(lambda s: s.worker_ids == ("w1",), timeout=10)
        await r.live_sub.unsubscribe()
        with anyio.fail_after(5):
            rep = await bc.broadcast(Pause(cmd_id=new_cmd_id()),
                                     QuorumPolicy(timeout=5, probe_interval=0.1))
        assert rep.ok == ("w1",) and r.caught_up == 1 and r.applied_live == 0
        assert rep.elapsed_s < 2.0



async def test_a_long_handler_keeps_later_commands_in_order_and_ends_with_the_worker(fabric):
    """While a long handler runs, later commands wait (in order, whatever the probe asks), and
    stopping the worker cancels the handler before its receiver returns."""
    applied: list[str] = []
    ended: list[str] = []
    started, release = anyio.Event(), anyio.Event()

    async def handle(cmd: Command, ctx: CommandContext) -> None:
        applied.append(type(cmd).__name__)
        if isinstance(cmd, Sleep):
            started.set()
            try:
                await release.wait()
            finally:
                ended.append("released" if release.is_set() else "cancelled")

    async with fabric() as (bus, watcher, bc, tg):
        r = CommandReceiver(bus, "w1", handle)
        scope = anyio.CancelScope()
        stopped = anyio.Event()

        async def run_receiver(*, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                               ) -> None:
            with scope:
                await r.run(task_status=task_status)
            stopped.set()

        await tg.start(run_receiver)
        await tg.start(Registration(bus, new_worker_info("w1", engine="t", model="m")).run)
        await watcher.wait_until(lambda s: s.worker_ids == ("w1",), timeout=10)
        await bc.broadcast(Pause(cmd_id=new_cmd_id()), QuorumPolicy(timeout=10))
        async with bc.open(Sleep(cmd_id=new_cmd_id(), level=1)) as long_one:
            with anyio.fail_after(10):
                await started.wait()
            async with bc.open(Resume(cmd_id=new_cmd_id())) as after:
                with pytest.raises(QuorumNotReached):  # behind the long one: not applied yet
                    await after.wait("done", QuorumPolicy(timeout=0.5, probe_interval=0.1))
                assert applied == ["Pause", "Sleep"]
                release.set()
                assert (await long_one.wait("done", QuorumPolicy(timeout=10))).ok == ("w1",)
                assert (await after.wait("done", QuorumPolicy(timeout=10))).ok == ("w1",)
        assert applied == ["Pause", "Sleep", "Resume"] and ended == ["released"]
        assert r.applied_live + r.caught_up == 3

        # stopped while a handler runs in the callback: it is cancelled, then run() returns
        started, release = anyio.Event(), anyio.Event()
        async with bc.open(Sleep(cmd_id=new_cmd_id(), level=1)):
            with anyio.fail_after(10):
                await started.wait()
            scope.cancel()
            with anyio.fail_after(10):
                await stopped.wait()
        assert ended == ["released", "cancelled"]


class Wire:
    """Every message on one subject pattern, as sent: subject and headers."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str] | None]] = []
        self._news = Signal()

    async def cb(self, msg) -> None:
        self.seen.append((msg.subject, msg.headers))
        self._news.fire()

    async def until(self, n: int) -> None:
        with anyio.fail_after(10):
            while len(self.seen) < n:
                await self._news.event().wait()


async def test_live_copies_and_acks_carry_no_headers_their_seq_and_major_in_the_subject(
        fabric):
    log = Log()
    async with fabric() as (bus, watcher, bc, tg):
        s = bus.subjects
        live, acks = Wire(), Wire()
        await bus.nc.subscribe(s.live_all, cb=live.cb)
        await bus.nc.subscribe(s.ack_all, cb=acks.cb)
        # NOTE: no poll: one landing between the command's store and its live copy (0.5-1.5 s
        # after start, about when the broadcast goes) applies it from the stream instead
        r = CommandReceiver(bus, "w1", log.handle, poll=3600)
        await tg.start(r.run)
        await tg.start(Registration(bus, new_worker_info("w1", engine="t", model="m")).run)
        await watcher.wait_until(lambda snap: snap.worker_ids == ("w1",), timeout=10)
        rep = await bc.broadcast(Pause(cmd_id=new_cmd_id()), QuorumPolicy(timeout=10))
        assert rep.ok == ("w1",) and r.applied_live == 1
        await live.until(1)
        await acks.until(1)
        [(subject, hdrs)] = live.seen
        assert s.live_parts(subject) == (s.live("pause"), SCHEMA_MAJOR, log.applied[0][0])
        assert subject == f"{s.prefix}.live.pause.{SCHEMA_MAJOR}.{log.applied[0][0]}"
        assert hdrs is None
        assert acks.seen == [(s.ack(rep.cmd_id), None)]


async def test_a_live_copy_not_readable_here_is_not_acted_on_the_stored_command_is(fabric):
    """A live copy of another schema major, or one that does not decode, is passed over for
    the stored command (whose headers say what it is): a valid one is applied from the
    stream, once; a bad one is rejected with an error ack that carries `rlf-schema`."""
    log = Log()
    async with fabric() as (bus, _watcher, _bc, tg):
        s = bus.subjects
        acks = Wire()
        await bus.nc.subscribe(s.ack_all, cb=acks.cb)
        r = CommandReceiver(bus, "w1", log.handle, poll=3600)  # only a live copy moves it
        await tg.start(r.run)

        async def store(data: bytes, cmd_id: str) -> int:
            ack = await bus.js.publish(s.control("pause"), data,
                                       headers=headers({CMD_ID_HEADER: cmd_id}))
            return ack.seq

        good = Pause(cmd_id=new_cmd_id())
        seq = await store(encode(good), good.cmd_id)
        await bus.nc.publish(s.live_copy("pause", seq), b"\xc1 not msgpack")
        await acks.until(1)
        assert log.applied == [(seq, good.cmd_id)]
        assert r.applied_live == 0 and r.caught_up == 1

        other = Resume(cmd_id=new_cmd_id())
        seq = await store(encode(other), other.cmd_id)
        await bus.nc.publish(f"{s.live('resume')}.{SCHEMA_MAJOR + 1}.{seq}", encode(other))
        await acks.until(2)
        assert log.applied[1] == (seq, other.cmd_id)
        assert r.applied_live == 0 and r.caught_up == 2

        seq = await store(b"\xc1 not msgpack", "garbage1")
        await bus.nc.publish(s.live_copy("pause", seq), b"\xc1 not msgpack")
        await acks.until(3)
        assert len(log.applied) == 2 and r.rejected == 1 and r.next_seq == seq + 1
        assert [subj for subj, _ in acks.seen] == [s.ack(good.cmd_id), s.ack(other.cmd_id),
                                                   s.ack("garbage1")]
        assert acks.seen[0][1] is None and acks.seen[1][1] is None  # applied: no headers
        assert acks.seen[2][1] == {SCHEMA_HEADER: SCHEMA_VERSION}  # a rejection: the major
