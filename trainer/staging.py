"""The sending side of weight updates: stage a state dict with the transport a push names (see
`rlfabric.transports` for what each one does), then `WeightUpdates` pushes it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio

from rlfabric import tensors
from rlfabric.bus import Bus
from rlfabric.transports import Staged, StageJob, Transports


def as_state_dict(weights: Any) -> dict[str, Any]:
    """A state dict from a module or a mapping of tensors."""
    if hasattr(weights, "state_dict") and callable(weights.state_dict):
        weights = weights.state_dict()
    if not isinstance(weights, Mapping):
        raise TypeError(f"update_weights takes a torch module or a state dict, got "
                        f"{type(weights).__name__}")
    return dict(weights)


class WeightStager:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.transports = Transports(bus)

    def close(self) -> None:
        """Free what transports keep between versions (the nats packing buffer)."""
        self.transports.close()

    async def stage(self, version: int, state: Mapping[str, Any], transport: str, *,
                    mark_stable: bool = True, group_epoch: int = 0,
                    with_checksum: bool = True, send_now: bool = True) -> Staged:
        sender = self.transports.get(transport)  # an unknown name names the registered ones
        metas, size = tensors.plan(state)
        expected = await anyio.to_thread.run_sync(tensors.checksum, state) if with_checksum \
            else ""
        return await sender.stage(StageJob(
            version=version, state=state, tensors=metas, size=size,
            prefix=self.bus.subjects.prefix, expected_checksum=expected,
            mark_stable=mark_stable, send_now=send_now, group_epoch=group_epoch))
