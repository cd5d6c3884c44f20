"""EmbeddedNats: real nats-server processes, side by side, cleaned up, failing loudly."""

from __future__ import annotations

import os
import socket

import anyio
import pytest

from rlfabric.bus import ConnectOptions, EmbeddedNats, NatsServerError, connect

pytestmark = pytest.mark.nats


async def _roundtrip(url: str) -> bytes:
    nc = await connect(ConnectOptions.from_url(url, connect_wait=2))
    try:
        sub = await nc.subscribe("probe")
        await nc.publish("probe", b"hello")
        msg = await sub.next_msg(timeout=2)
        return msg.data
    finally:
        await nc.close()


@pytest.mark.anyio
async def test_two_servers_at_once_and_stop_removes_store() -> None:
    async with EmbeddedNats() as a, EmbeddedNats() as b:
        assert a.port != b.port
        assert a.store_dir != b.store_dir
        assert await _roundtrip(a.url) == b"hello"
        assert await _roundtrip(b.url) == b"hello"
        a_store = a.store_dir
        assert a_store is not None and os.path.isdir(os.path.dirname(a_store))
        a.stop()
        assert not os.path.exists(a_store)
        assert not os.path.exists(os.path.dirname(a_store))
        assert await _roundtrip(b.url) == b"hello"  # the other one is untouched


def test_broken_config_raises_with_the_servers_fatal_line() -> None:
    srv = EmbeddedNats(extra_config="this_block_is_broken {\n", ready_timeout=5)
    with pytest.raises(NatsServerError) as ei:
        srv.start()
    assert any("Parse error" in line for line in ei.value.fatal_lines), ei.value.fatal_lines
    assert "Parse error" in str(ei.value)
    assert srv.pid is None


def test_port_in_use_raises_with_the_servers_fatal_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(NatsServerError, match="address already in use") as ei:
            EmbeddedNats(port=port, ready_timeout=5).start()
    assert ei.value.fatal_lines


def test_max_payload_is_8_mib() -> None:
    async def main(url: str) -> int:
        nc = await connect(url)
        try:
            return nc.max_payload
        finally:
            await nc.close()

    with EmbeddedNats() as srv:
        assert anyio.run(main, srv.url) == 8 * 1024 * 1024


def test_given_store_dir_is_kept(tmp_path) -> None:
    store = tmp_path / "js"
    with EmbeddedNats(store_dir=str(store)) as srv:
        assert srv.store_dir == str(store)
    assert store.is_dir()


@pytest.mark.anyio
async def test_leaving_a_bus_whose_server_died_with_data_unsent_raises_nothing() -> None:
    """A worker stopped while its broker is gone (SIGTERM during an outage, or the broker
    stopped first) exits cleanly: closing a lost connection with data still buffered for it
    is no error, and cannot hide the error a process may be stopping for."""
    from rlfabric.bus import Bus

    srv = EmbeddedNats().start()
    try:
        async with Bus.connect(ConnectOptions.from_url(srv.url, connect_wait=2)) as bus:
            await bus.nc.flush(timeout=2)
            await anyio.to_thread.run_sync(srv.kill)
            with anyio.fail_after(10):
                # the read loop finds the socket closed; nothing fires an event for that
                while bus.nc.is_connected:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            await bus.nc.publish("lost", b"x" * 1024)  # buffered for the next server
            assert bus.nc.pending_data_size > 0
        assert bus.nc.is_closed
    finally:
        srv.stop()
