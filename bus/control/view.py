"""The fleet as an operator reads it, in one place (`FleetView`): members, the desired state,
the checkpoint a fleet with no push serves, the streams' depths, the last commands and who
acked them. `rlfabric status`, `rlfabric ctl`, `up`'s live view and `rlfabric dashboard`
render it, so what they print agrees."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Mapping

from rlfabric.bus.control.events import NoEvents, read_events
from rlfabric.bus.session import Bus
from rlfabric.schemas import CommandEvent, FleetView, WorkerInfo

log = logging.getLogger("rlfabric.bus")


async def fleet_view(bus: Bus, *, streams: bool = True, commands: int = 10,
                     members: Mapping[str, WorkerInfo] | None = None) -> FleetView:
    """Read the fleet once (read-only: creates nothing); `commands`: how many of the last
    hour's commands to read back; `members`: a watcher's, instead of reading the bucket."""
    members = dict(members) if members is not None else await bus.fleet.members()
    shares, _ = await bus.state.shares()
    return FleetView(
        prefix=bus.subjects.prefix,
        members=tuple(members[w] for w in sorted(members)),
        desired=await bus.state.read(), checkpoint=await bus.state.checkpoint_claim(),
        streams=await bus.fleet.stream_depths() if streams else {}, at=time.time(),
        jobs=await bus.state.jobs(), shares=shares,
        commands=await recent_commands(bus, commands) if commands else ())


async def recent_commands(bus: Bus, n: int, within: float = 3600.0) -> tuple[CommandEvent, ...]:
    """The last `n` commands of the last `within` seconds, oldest first (none where the job
    keeps no events)."""
    out: collections.deque[CommandEvent] = collections.deque(maxlen=n)
    try:
        async for _, event in read_events(bus, since=time.time() - within, kind="command"):
            if isinstance(event, CommandEvent):
                out.append(event)
    except NoEvents:
        pass
    except Exception as exc:  # the rest of the view still reads: say what is missing
        log.warning("the last commands could not be read from %s (%s: %s); shown without "
                    "them", bus.subjects.events_stream, type(exc).__name__, exc)
    return tuple(out)
