"""Writing the job's desired state beside a call: stored by the time the call returns, and
nothing left behind by a call that fails."""

from __future__ import annotations

import pytest

from rlfabric.bus import Bus
from rlfabric.schemas import DesiredState

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


async def test_a_desired_state_write_is_stored_when_its_block_ends(nats_url, prefix):
    async with Bus.connect(nats_url, prefix=prefix) as bus:
        # the connection's first write: stored before the body (a refusal shows at once)
        async with bus.desired_state_written(DesiredState(weight_version=1)):
            assert (await bus.desired_state()).weight_version == 1
        # later ones: sent before the body, their PubAck awaited after it
        for version in (2, 3, 4):
            async with bus.desired_state_written(DesiredState(weight_version=version)):
                pass
            assert (await bus.desired_state()).weight_version == version
        assert not bus.link.pending_acks

        class Failed(Exception):
            pass

        with pytest.raises(Failed):
            async with bus.desired_state_written(DesiredState(weight_version=5)):
                raise Failed
        assert not bus.link.pending_acks  # nothing waits on the abandoned PubAck
        await bus.put_desired_state(DesiredState(weight_version=4))  # a writer's rollback
        assert (await bus.desired_state()).weight_version == 4
