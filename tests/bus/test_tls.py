"""TLS on a real nats-server: the certificates `write_tls` makes serve, a client holding the CA
(and, where the server requires one, a client certificate) connects, and a plaintext client, a
client that does not trust the server, and one whose certificate another CA signed are each
refused with an error that says which and what to pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfabric.bus import Bus, EmbeddedNats, NatsUnavailable
from rlfabric.bus.connect import ConnectOptions
from rlfabric.bus.tls import write_tls

pytestmark = [pytest.mark.nats, pytest.mark.anyio]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    return write_tls(d / "job", hosts=["127.0.0.1", "localhost"]), \
        write_tls(d / "other", hosts=["127.0.0.1"])


def test_existing_certificates_are_kept(certs, tmp_path) -> None:
    ours, _ = certs
    before = Path(ours.server_cert).read_bytes()
    again = write_tls(Path(ours.ca).parent, hosts=["127.0.0.1"])
    assert Path(again.server_cert).read_bytes() == before
    assert Path(ours.client_key).stat().st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="at least one host"):
        write_tls(tmp_path / "none", hosts=[])


async def _connect(url: str, **tls: str) -> None:
    opts = ConnectOptions.from_url(url, connect_wait=1, connect_timeout=1, **tls)
    async with Bus.connect(opts, prefix="tlsjob") as bus:
        await bus.js.account_info()  # a JetStream round trip over TLS


async def test_tls_serves_the_ca_holder_and_refuses_a_plaintext_or_untrusting_client(
        certs) -> None:
    ours, other = certs
    async with EmbeddedNats(extra_config=ours.config()) as srv:
        tls_url = srv.url.replace("nats://", "tls://")
        await _connect(tls_url, tls_ca=ours.ca)
        with pytest.raises(NatsUnavailable, match="requires TLS, and this client asked for none"):
            await _connect(srv.url)
        with pytest.raises(NatsUnavailable, match="a certificate this client does not trust"):
            await _connect(tls_url, tls_ca=other.ca)


async def test_verify_requires_a_client_certificate_the_ca_signed(certs) -> None:
    ours, other = certs
    async with EmbeddedNats(extra_config=ours.config(verify=True)) as srv:
        url = srv.url.replace("nats://", "tls://")
        await _connect(url, tls_ca=ours.ca, tls_cert=ours.client_cert, tls_key=ours.client_key)
        for given in ({}, {"tls_cert": other.client_cert, "tls_key": other.client_key}):
            with pytest.raises(NatsUnavailable, match=r"refused this client's TLS.*--tls-cert"):
                await _connect(url, tls_ca=ours.ca, **given)
