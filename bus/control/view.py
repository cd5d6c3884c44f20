"""The fleet as an operator reads it, in one place (`FleetView`): members, the desired state,
the checkpoint a fleet with no push serves, the streams' depths. `rlfabric status`,
`rlfabric ctl` and `up`'s live view render it, so what they print agrees."""

from __future__ import annotations

import time

from rlfabric.bus.session import Bus
from rlfabric.schemas import FleetView


async def fleet_view(bus: Bus, *, streams: bool = True) -> FleetView:
    """Read the fleet once (read-only: creates nothing)."""
    members = await bus.fleet.members()
    shares, _ = await bus.state.shares()
    return FleetView(
        prefix=bus.subjects.prefix,
        members=tuple(members[w] for w in sorted(members)),
        desired=await bus.state.read(), checkpoint=await bus.state.checkpoint_claim(),
        streams=await bus.fleet.stream_depths() if streams else {}, at=time.time(),
        jobs=await bus.state.jobs(), shares=shares)
