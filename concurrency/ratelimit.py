"""Log lines for things that can arrive by the thousand (garbage payloads, refused commands):
the first of a kind is logged, the rest of that kind within `interval` seconds are counted,
and the next line of that kind says how many were left out.

    _garbage = RateLimited(logging.getLogger("rlfabric.bus"), interval=10.0)
    _garbage.warning("unreadable command on %s: %s", subject, exc)
"""

from __future__ import annotations

import logging
import time
from typing import Any


class RateLimited:
    def __init__(self, logger: logging.Logger, *, interval: float = 10.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, float] = {}  # kind (the format string) -> when last logged
        self._left_out: dict[str, int] = {}

    def warning(self, msg: str, *args: Any) -> bool:
        return self.log(logging.WARNING, msg, *args)

    def error(self, msg: str, *args: Any) -> bool:
        return self.log(logging.ERROR, msg, *args)

    def log(self, level: int, msg: str, *args: Any) -> bool:
        """True if the line was written (callers send their matching event only then)."""
        now = time.monotonic()
        if now - self._last.get(msg, -self.interval) < self.interval:
            self._left_out[msg] = self._left_out.get(msg, 0) + 1
            return False
        self._last[msg] = now
        n = self._left_out.pop(msg, 0)
        if n:
            msg = f"{msg} (and {n} more like this in the last {self.interval:g} s)"
        self.logger.log(level, msg, *args)
        return True

    @property
    def left_out(self) -> int:
        """Lines counted and not written yet (for tests and reports)."""
        return sum(self._left_out.values())
