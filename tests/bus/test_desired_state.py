"""Writing the job's desired state beside a call: stored by the time the call returns, and
nothing left behind by a call that fails; a joiner never starts from a state older than the
commands it skips."""

from __future__ import annotations

import time

import anyio
import pytest

from rlfabric.bus import Bus, QuorumPolicy, new_cmd_id
from rlfabric.bus.subjects import CHECKPOINT_KEY
from rlfabric.schemas import (
    CMD_ID_HEADER,
    STATE_MARK_HEADER,
    CheckpointClaim,
    DesiredState,
    Pause,
    encode,
)
from rlfabric.trainer import FabricClient

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


async def test_a_desired_state_write_is_stored_when_its_block_ends(nats_url, prefix):
    async with Bus.connect(nats_url, prefix=prefix) as bus:
        # the connection's first write: stored before the body (a refusal shows at once)
        async with bus.state.written(DesiredState(weight_version=1)):
            assert (await bus.state.read()).weight_version == 1
        # later ones: sent before the body, their PubAck awaited after it
        for version in (2, 3, 4):
            async with bus.state.written(DesiredState(weight_version=version)):
                pass
            assert (await bus.state.read()).weight_version == version
        assert not bus.link.pending_acks

        class Failed(Exception):
            pass

        with pytest.raises(Failed):
            async with bus.state.written(DesiredState(weight_version=5)):
                raise Failed
        assert not bus.link.pending_acks  # nothing waits on the abandoned PubAck
        await bus.state.put(DesiredState(weight_version=4))  # a writer's rollback
        assert (await bus.state.read()).weight_version == 4


async def test_a_command_names_the_state_write_sent_before_it(nats_url, prefix):
    # no worker and a policy that needs none: the call publishes and returns
    async with FabricClient.connect(nats_url, prefix=prefix,
                                    policy=QuorumPolicy(required=0)) as client:
        await client.pause()
        await client.resume()
        bus = client.bus
        stored = await bus.js.get_msg(bus.subjects.control_stream, seq=2)
        state = await bus.state.read()
        assert not state.paused and state.serial == 2  # resume's write, the second
        assert stored.headers[STATE_MARK_HEADER] == f"{state.writer}.2" == bus.state.mark


async def test_a_joiner_waits_for_a_state_write_stored_after_its_command(nats_url, prefix):
    # the server stores a state write and the command sent after it in no common order: here
    # the write is held back until the joiner has read the state once
    async with Bus.connect(nats_url, prefix=prefix) as trainer, \
            Bus.connect(nats_url, prefix=prefix) as joiner:
        await trainer.state.put(DesiredState(paused=False))  # write 1, stored
        held = trainer.state._prepared(DesiredState(paused=True))  # write 2, not sent yet
        cmd = Pause(cmd_id=new_cmd_id(), mode="wait")
        ack = await trainer.persist(trainer.subjects.control("pause"), encode(cmd),
                                    trainer.headers({CMD_ID_HEADER: cmd.cmd_id,
                                                     STATE_MARK_HEADER: trainer.state.mark}))
        # what the join read before: the state from before the command it will not apply
        assert not (await joiner.state.read()).paused

        reads = 0
        read_once = anyio.Event()
        plain = joiner.state.read

        async def counted() -> DesiredState:
            nonlocal reads
            state = await plain()
            reads += 1
            read_once.set()
            return state

        joiner.state.read = counted  # type: ignore[method-assign]
        got: list[DesiredState] = []
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                async def join() -> None:
                    got.append(await joiner.state.after(ack.seq))

                tg.start_soon(join)
                await read_once.wait()  # it read write 1 ...
                await trainer.persist(*held)  # ... and write 2 lands only now
        assert got[0].paused and got[0].serial == 2
        assert reads >= 2

        # a write that never lands: the joiner goes on after its wait, with what is there
        trainer.state._prepared(DesiredState(paused=False))  # write 3, never sent
        cmd = Pause(cmd_id=new_cmd_id(), mode="wait")
        ack = await trainer.persist(trainer.subjects.control("pause"), encode(cmd),
                                    trainer.headers({CMD_ID_HEADER: cmd.cmd_id,
                                                     STATE_MARK_HEADER: trainer.state.mark}))
        joiner.state.read = plain  # type: ignore[method-assign]
        t0 = time.monotonic()
        state = await joiner.state.after(ack.seq, wait=0.3)
        assert state.serial == 2 and time.monotonic() - t0 >= 0.3


async def test_a_checkpoint_claim_holds_until_cleared_and_a_cleared_or_unreadable_one_is_taken(
        nats_url, prefix):
    first, second, third = (CheckpointClaim(model="tiny", checksum=c, worker_id=c)
                            for c in ("c0", "c1", "c2"))
    async with Bus.connect(nats_url, prefix=prefix) as bus:
        assert await bus.state.claim_checkpoint(first) == first
        assert await bus.state.claim_checkpoint(second) == first
        # what `rlfabric ctl reset-state` does: a delete marker, not an empty key
        await bus.buckets.state.delete(CHECKPOINT_KEY)
        assert await bus.state.checkpoint_claim() is None
        assert await bus.state.claim_checkpoint(second) == second
        assert await bus.state.claim_checkpoint(first) == second
        await bus.buckets.state.put(CHECKPOINT_KEY, b"\xc1 garbage")
        assert await bus.state.claim_checkpoint(third) == third
        assert await bus.state.checkpoint_claim() == third
        assert await bus.state.claim_checkpoint(first) == third
