"""The weight transports by name: the trainer stages with the one a push names, a worker opens
a command's locator with the one that made it. Registering one (a class following
`WeightTransport`) makes it a `--transport` choice and an `update_weights(transport=...)`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlfabric.schemas import External
from rlfabric.transports.protocol import WeightTransport

if TYPE_CHECKING:
    from rlfabric.bus import Bus

Factory = Callable[["Bus"], WeightTransport]

_TRANSPORTS: dict[str, Factory] = {}


def register(cls: Factory) -> Factory:
    """Add a transport (usable as a class decorator); a second one with a name taken fails."""
    name: str = getattr(cls, "name", "")
    if not name:
        raise ValueError(f"{cls!r} has no `name`")
    if name in _TRANSPORTS and _TRANSPORTS[name] is not cls:
        raise ValueError(f"transport {name!r} is already registered")
    _TRANSPORTS[name] = cls
    return cls


def unregister(name: str) -> None:
    _TRANSPORTS.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered transports, in registration order."""
    return tuple(_TRANSPORTS)


def lookup(name: str) -> Factory:
    try:
        return _TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"transport={name!r}: use one of {', '.join(_TRANSPORTS)}") from None


def name_of(locator: Any) -> str:
    """The transport that made `locator`: its tag, or the name an `External` one carries."""
    if isinstance(locator, External):
        return locator.transport
    tag: str = locator.__struct_config__.tag or ""
    return tag


class Transports:
    """One instance of each transport a process uses, made on first use for its bus."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._made: dict[str, WeightTransport] = {}

    def get(self, name: str) -> WeightTransport:
        if name not in self._made:
            self._made[name] = lookup(name)(self.bus)
        return self._made[name]

    def for_locator(self, locator: Any) -> WeightTransport:
        return self.get(name_of(locator))

    def close(self) -> None:
        for t in self._made.values():
            t.close()
