"""One turn of a session at a time, on any gateway of the job: a turn claims its session
before anything is sampled (`rlfabric.bus.sessions.turns`), or is refused at once with 409
`session_conflict`; its claim is released when the turn ends, however it ends."""

from __future__ import annotations

import anyio

from rlfabric.bus import Bus
from rlfabric.bus.sessions.turns import Claim, TurnClaims
from rlfabric.gateway.config import GatewayConfig
from rlfabric.gateway.errors import APIError
from rlfabric.gateway.sessions import PENDING, Session, SessionStore
from rlfabric.schemas import ErrorCode

#: seconds a claim outlives the longest a turn may wait for its result (`--request-timeout`)
MARGIN = 30.0


class SessionTurns:
    def __init__(self, bus: Bus, store: SessionStore, config: GatewayConfig) -> None:
        self.claims = TurnClaims(bus)
        self.store = store
        self.config = config

    async def claim(self, session_id: str) -> None:
        """The session's turn for this request, or 409 at once."""
        s = self.store.entry(session_id)
        if s.claim is None:
            s.claim = PENDING  # taken before the await: a second turn here is refused at once
            try:
                got = await self.claims.claim(session_id, by=self.config.gateway_id or "a gateway",
                                              hold_for=self.config.request_timeout + MARGIN)
            except BaseException:
                s.claim = None
                raise
            if isinstance(got, Claim):
                s.claim = got
                return
            s.claim = None
            by = f"on {got.by}"
        else:
            by = "on this gateway"
        raise APIError(409, f"session {session_id!r} has a turn in flight ({by}); send its next "
                       "turn once that turn's response came back", param="X-Session-ID",
                       code=ErrorCode.SESSION_CONFLICT)

    async def end(self, s: Session | None) -> None:
        """The turn of `s` ended (also when cancelled): the store told, its claim released."""
        if s is None:
            return
        if s.active:
            self.store.done(s)
        claim, s.claim = s.claim, None
        if isinstance(claim, Claim):
            with anyio.CancelScope(shield=True):
                await self.claims.release(claim)
