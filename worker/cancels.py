"""Requests their clients gave up on (`RolloutCancel`): one being sampled stops at the
engine's next step, one pulled later is skipped; neither is answered, and its message is acked
as if it had been (nobody waits for it)."""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator

import anyio
from nats.aio.msg import Msg

from rlfabric.bus.subjects import Subjects
from rlfabric.schemas import RolloutCancel, RolloutRequest, SchemaError, codec_for

log = logging.getLogger(__name__)

#: cancelled submissions remembered, for requests still queued when their cancel came
REMEMBER = 65_536


class Watch:
    """The requests one cancel scope samples for: cancelled once every one of them is."""

    def __init__(self, scope: anyio.CancelScope, keys: set[str]) -> None:
        self.scope = scope
        self.keys = keys
        self.left = set(keys)
        #: the scope was cancelled because its clients gave up (not an abort pause)
        self.by_client = False

    def cancel(self, key: str) -> None:
        self.left.discard(key)
        if not self.left and not self.by_client:
            self.by_client = True
            self.scope.cancel()


class Cancels:
    def __init__(self, subjects: Subjects) -> None:
        self.subjects = subjects
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._watched: dict[str, Watch] = {}
        self._codec = codec_for(RolloutCancel)

    @staticmethod
    def _key(job: str, submission_id: str) -> str:
        return f"{job}/{submission_id}"

    def gone(self, req: RolloutRequest) -> bool:
        """Whether `req`'s client gave up on it already."""
        return bool(req.submission_id) and self._key(req.job, req.submission_id) in self._gone

    @contextlib.contextmanager
    def watch(self, reqs: list[RolloutRequest], scope: anyio.CancelScope) -> Iterator[Watch]:
        """While the block runs, `scope` is cancelled once the clients gave up on all `reqs`
        (`Watch.by_client` then says so)."""
        w = Watch(scope, {self._key(r.job, r.submission_id) for r in reqs if r.submission_id})
        if len(w.keys) < len(reqs):  # one without a submission id cannot be cancelled
            w.left.add("")
        for k in w.keys:
            self._watched[k] = w
        for k in w.keys & self._gone.keys():  # given up while it was being admitted
            w.cancel(k)
        try:
            yield w
        finally:
            for k in w.keys:
                if self._watched.get(k) is w:
                    del self._watched[k]

    async def on_cancel(self, msg: Msg) -> None:
        try:
            cancel = self._codec.decode(msg.data, msg.headers, subject=msg.subject)
        except SchemaError as exc:
            log.debug("a cancel that is not one on %s: %s", msg.subject, exc)
            return
        job = self.subjects.job_of_cancel(msg.subject)
        for sid in cancel.submission_ids:
            key = self._key(job, sid)
            self._gone[key] = None
            w = self._watched.get(key)
            if w is not None:
                w.cancel(key)
        while len(self._gone) > REMEMBER:
            self._gone.popitem(last=False)
