"""Connecting to NATS: URLs, credentials, TLS and a reconnect policy in one options object."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import ssl
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import nats
import nats.errors
from nats.aio.client import Client as NATS

from rlfabric.bus.errors import NatsAuthFailed, NatsUnavailable
from rlfabric.concurrency.sync import Signal

log = logging.getLogger("rlfabric.bus")


@dataclass(kw_only=True, slots=True)
class ConnectOptions:
    """How to reach the bus.

    `servers`: one URL or several (a cluster). Authentication: `user`/`password`, `token`,
    `creds_file` (a NATS .creds file), or `nkey_seed_file`. TLS: `tls_ca` (CA bundle),
    `tls_cert`/`tls_key` (client certificate); a `tls://` URL or any TLS option turns it on.
    `connect_wait`: how long to keep trying before the first connection (then
    `NatsUnavailable`); after that, `max_reconnect_attempts` per server (-1 = forever), spaced
    by `reconnect_wait` seconds. `ping_interval` / `max_outstanding_pings`: a connection whose
    server leaves that many pings in a row unanswered is dropped and another server tried, so a
    link cut without a word (a partition) costs seconds, not nats-py's default four minutes.
    """

    servers: list[str] = field(default_factory=lambda: ["nats://127.0.0.1:4222"])
    name: str = "rlfabric"
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    nkey_seed_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_hostname: str | None = None
    connect_timeout: float = 2.0
    connect_wait: float = 5.0
    reconnect_wait: float = 0.5
    max_reconnect_attempts: int = -1
    pending_size: int = 64 * 1024 * 1024
    ping_interval: float = 2.0
    max_outstanding_pings: int = 3

    @classmethod
    def from_url(cls, url: str | list[str], **kw: Any) -> ConnectOptions:
        """Options for a URL (or comma-separated URLs / a list) and keyword overrides."""
        servers = url if isinstance(url, list) else [u.strip() for u in url.split(",") if u.strip()]
        return cls(servers=servers, **kw)

    def tls_context(self) -> ssl.SSLContext | None:
        wants_tls = any(s.startswith("tls://") for s in self.servers)
        if not (wants_tls or self.tls_ca or self.tls_cert):
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca)
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        _quiet_ssl_eof()
        return ctx


class _SslEofNoise(logging.Filter):
    """asyncio warns "returning true from eof_received() has no effect when using ssl" each
    time a TLS connection's peer closes (nats-py's protocol returns True there): nothing a user
    can act on, and a reconnecting client printed it a dozen times."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


def _quiet_ssl_eof() -> None:
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _SslEofNoise) for f in asyncio_log.filters):
        asyncio_log.addFilter(_SslEofNoise())


def _is_auth_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in text \
        or "authentication" in text


_VIOLATION = re.compile(r'Permissions Violation for (\w+) to "([^"]+)"', re.IGNORECASE)


async def _log_error(exc: Exception) -> None:
    log.debug("nats: %s", exc)


def _note_refusal(link: Link, exc: Exception) -> None:
    m = _VIOLATION.search(str(exc))
    if m is None:
        return
    kind, subject = m.group(1).lower(), m.group(2).lower()
    first = subject not in link.refused
    link.refused[subject] = (time.monotonic(), str(exc))
    link.refusals.fire()
    if first:
        log.error("nats: the server refused this client %s %s (its role's permissions); "
                  "connect with the key of a role that may (rlfabric nats --auth)",
                  "publishing to" if kind == "publish" else "subscribing to", subject)


class Link:
    """What a connection's holders need to know of its ups and downs: whether it is up, since
    when, and a `reconnected` signal. Server-side state bound to the old connection (pull
    requests, ephemeral consumers of a restarted server) is gone after a reconnect; whoever
    keeps such state re-creates it when `reconnected` fires instead of waiting for a timeout.
    """

    def __init__(self) -> None:
        self.up = False
        self.since = time.monotonic()  # of the current state
        self.reconnected = Signal()
        self.reconnects = 0
        #: called at once when the connection drops (before any reconnect)
        self.on_disconnect: list[Callable[[], None]] = []
        #: subjects (lowercased) the server refused this client, with when and its words
        self.refused: dict[str, tuple[float, str]] = {}
        self.refusals = Signal()
        #: PubAck futures of pipelined publishes (`Bus.publish_stored`): failed on a reconnect,
        #: since the PubAck of a publish sent on the old connection may never come
        self.pending_acks: set[asyncio.Future[Any]] = set()

    def refusal(self, subject: str, since: float = 0.0) -> str | None:
        """The server's words if it refused `subject` to this client at or after `since`
        (a `time.monotonic()`)."""
        got = self.refused.get(subject.lower())  # nats-py hands the server's words lowercased
        return got[1] if got and got[0] >= since else None

    def settled(self, seconds: float) -> bool:
        """Up, and if this is a reconnect, for at least `seconds`: long enough for peers that
        lost the same server to have reconnected too (their reconnect wait plus a margin)."""
        return self.up and (self.reconnects == 0 or time.monotonic() - self.since >= seconds)


class _ConnLog:
    """Connection-state logging that stays quiet until the first connection is up."""

    def __init__(self, servers: list[str], link: Link) -> None:
        self.up = False
        self.nc: NATS | None = None
        self.link = link
        self.servers = ", ".join(servers)

    async def disconnected(self) -> None:
        if self.link.up:
            self.link.up, self.link.since = False, time.monotonic()
        for fn in self.link.on_disconnect:
            fn()
        if self.up and self.nc is not None and not (self.nc.is_closed or self.nc.is_draining):
            log.warning("nats: lost the connection to %s; reconnecting", self.servers)

    async def reconnected(self) -> None:
        self.link.up, self.link.since = True, time.monotonic()
        self.link.reconnects += 1
        for fut in self.link.pending_acks:
            if not fut.done():
                fut.set_exception(nats.errors.ConnectionReconnectingError())
        self.link.reconnected.fire()
        if self.up:
            log.info("nats: reconnected to %s", self.servers)


def _start_hint(servers: list[str]) -> str:
    """The command that starts a server where the first URL points (loopback: its port)."""
    url = urllib.parse.urlsplit(servers[0] if servers else "")
    port = url.port or 4222
    tls = " --tls" if url.scheme == "tls" else ""
    if url.hostname in ("127.0.0.1", "localhost", "::1", None):
        return f"`rlfabric nats --port {port}{tls}`"
    return f"`rlfabric nats --host 0.0.0.0 --port {port}{tls}` on {url.hostname}"


def _not_connected(opts: ConnectOptions, exc: Exception, seen: list[Exception]
                   ) -> NatsAuthFailed | NatsUnavailable:
    """What a failed first connect means to the user: refused credentials, TLS that does not
    match, or no server."""
    where = ", ".join(opts.servers)
    if (tls := next((e for e in reversed([*seen, exc]) if isinstance(e, ssl.SSLError)), None)):
        return NatsUnavailable(_tls_refusal(opts, where, tls))
    if isinstance(exc, (nats.errors.NoServersError, OSError, TimeoutError)):
        refusal = next((e for e in reversed(seen) if _is_auth_error(e)), None)
        if refusal is not None:
            return NatsAuthFailed(
                f"NATS at {where} refused this client: authentication failed (the server "
                f"said: {refusal}); check --nkey / --creds / --token / --user, e.g. the role "
                "seed `rlfabric nats --auth DIR` wrote")
        return NatsUnavailable(
            f"no NATS server answered at {where} within {opts.connect_wait}s "
            f"({type(exc).__name__}: {str(exc) or 'no servers available'}); start one with "
            f"{_start_hint(opts.servers)} or pass the right --nats URL")
    if _is_auth_error(exc):  # auth and TLS failures
        return NatsAuthFailed(f"NATS at {where} refused this client: authentication failed "
                              f"({exc})")
    return NatsUnavailable(f"NATS at {where} refused the connection: {exc}; check the "
                           "credentials / TLS options")


def _tls_refusal(opts: ConnectOptions, where: str, exc: ssl.SSLError) -> str:
    said = f"{type(exc).__name__}: {exc}"
    if opts.tls_context() is None:
        return (f"NATS at {where} requires TLS, and this client asked for none ({said}): "
                "connect to tls://HOST:PORT with --tls-ca, the CA that signed the server's "
                "certificate (DIR/ca.pem of `rlfabric nats --tls DIR`)")
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"NATS at {where} presented a certificate this client does not trust ({said}): "
                "pass --tls-ca with the CA that signed it (DIR/ca.pem of `rlfabric nats --tls "
                "DIR`), and reach the server at a name its certificate holds (--tls-host)")
    return (f"NATS at {where} refused this client's TLS ({said}): it requires a client "
            "certificate its CA signed; pass --tls-cert and --tls-key (DIR/client-cert.pem and "
            "client-key.pem of `rlfabric nats --tls DIR --tls-verify`)")


async def connect(opts: ConnectOptions | str, *, link: Link | None = None) -> NATS:
    """Open a NATS connection, or raise `NatsUnavailable` naming the URLs tried. `link` (if
    given) follows the connection's state from then on."""
    if isinstance(opts, str):
        opts = ConnectOptions.from_url(opts)
    link = link or Link()
    conn_log = _ConnLog(opts.servers, link)
    seen: list[Exception] = []  # what the servers said while we tried (auth errors, ...)

    async def on_error(exc: Exception) -> None:
        seen.append(exc)
        _note_refusal(link, exc)
        await _log_error(exc)

    attempts = max(1, math.ceil(opts.connect_wait / max(opts.reconnect_wait, 0.01)))
    try:
        # bounded: after a failed TLS handshake nats-py (2.16) can wait forever for the
        # socket to close
        with anyio.fail_after(opts.connect_wait + 2 * opts.connect_timeout + 1):
            nc = await _nats_connect(opts, attempts, on_error, conn_log)
    except (nats.errors.NoServersError, OSError, TimeoutError, nats.errors.Error) as exc:
        raise _not_connected(opts, exc, seen) from exc
    # NOTE: the initial-connect budget above reuses nats-py's reconnect counter; from here on
    # the user's reconnect policy applies.
    nc.options["max_reconnect_attempts"] = opts.max_reconnect_attempts
    conn_log.up, conn_log.nc = True, nc
    link.up, link.since = True, time.monotonic()
    return nc


async def _nats_connect(opts: ConnectOptions, attempts: int,
                        on_error: Callable[[Exception], Awaitable[None]],
                        conn_log: _ConnLog) -> NATS:
    return await nats.connect(
        servers=opts.servers,
        name=opts.name,
        user=opts.user,
        password=opts.password,
        token=opts.token,
        user_credentials=opts.creds_file,
        nkeys_seed=opts.nkey_seed_file,
        tls=opts.tls_context(),
        tls_hostname=opts.tls_hostname,
        connect_timeout=opts.connect_timeout,
        reconnect_time_wait=opts.reconnect_wait,
        max_reconnect_attempts=attempts,
        allow_reconnect=True,
        pending_size=opts.pending_size,
        ping_interval=opts.ping_interval,
        max_outstanding_pings=opts.max_outstanding_pings,
        error_cb=on_error,
        disconnected_cb=conn_log.disconnected,
        reconnected_cb=conn_log.reconnected,
    )
