"""The connection helper: auth options, and a clear error when nobody answers."""

from __future__ import annotations

import time

import pytest

from rlfabric.bus import ConnectOptions, EmbeddedNats, NatsAuthFailed, NatsUnavailable, connect
from rlfabric.bus.nats.cluster import free_ports

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


async def test_no_server_gives_a_clear_error_within_the_wait() -> None:
    url = f"nats://127.0.0.1:{free_ports(1)[0]}"
    t0 = time.monotonic()
    with pytest.raises(NatsUnavailable, match=r"no NATS server answered at .*rlfabric nats"):
        await connect(ConnectOptions.from_url(url, connect_wait=0.6, reconnect_wait=0.2))
    assert time.monotonic() - t0 < 5


async def test_url_list_skips_a_dead_server(nats_url: str) -> None:
    dead = f"nats://127.0.0.1:{free_ports(1)[0]}"
    nc = await connect(ConnectOptions(servers=[dead, nats_url], connect_wait=3))
    try:
        assert nc.is_connected
        assert nc.options["max_reconnect_attempts"] == -1  # the user's policy after connecting
    finally:
        await nc.close()


async def test_token_auth() -> None:
    async with EmbeddedNats(extra_config='authorization { token: "s3cret" }') as srv:
        nc = await connect(ConnectOptions.from_url(srv.url, token="s3cret", connect_wait=2))
        assert nc.is_connected
        await nc.close()
        for token in ("wrong", None):  # a wrong token, and none at all
            with pytest.raises(NatsAuthFailed, match=r"authentication failed.*Authorization"):
                await connect(ConnectOptions.from_url(srv.url, token=token, connect_wait=0.5))


async def test_user_password_auth() -> None:
    cfg = 'authorization { user: "trainer", password: "pw" }'
    async with EmbeddedNats(extra_config=cfg) as srv:
        nc = await connect(ConnectOptions.from_url(srv.url, user="trainer", password="pw"))
        assert nc.is_connected
        await nc.close()
        with pytest.raises(NatsAuthFailed, match="authentication failed"):
            await connect(ConnectOptions.from_url(srv.url, user="trainer", password="no",
                                                  connect_wait=0.5))


def test_comma_separated_urls() -> None:
    opts = ConnectOptions.from_url("nats://a:1, nats://b:2")
    assert opts.servers == ["nats://a:1", "nats://b:2"]
    assert opts.tls_context() is None
    assert ConnectOptions.from_url("tls://a:1").tls_context() is not None
