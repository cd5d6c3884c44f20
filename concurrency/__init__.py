"""Concurrency helpers over anyio that every layer uses (`Signal`, `wait_any`, `beside`) and
rate-limited log lines; nothing here knows the bus, an engine or a tensor."""

from rlfabric.concurrency.ratelimit import RateLimited
from rlfabric.concurrency.sync import Signal, beside, wait_any

__all__ = ["RateLimited", "Signal", "beside", "wait_any"]
