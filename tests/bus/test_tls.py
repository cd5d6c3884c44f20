"""TLS on a real nats-server: the certificates `write_tls` makes serve, a client holding the CA
(and, where the server requires one, a client certificate) connects, and a plaintext client, a
client that does not trust the server, and one whose certificate another CA signed are each
refused with an error that says which and what to pass; a cluster's nodes route to each other
over mutual TLS."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
from pathlib import Path

import pytest

from rlfabric.bus import Bus, EmbeddedCluster, EmbeddedNats, NatsUnavailable
from rlfabric.bus.nats.connect import ConnectOptions
from rlfabric.bus.nats.tls import TlsSetup, write_tls

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


async def test_a_clusters_nodes_route_to_each_other_over_mutual_tls(certs, tmp_path) -> None:
    ours, _ = certs
    async with EmbeddedCluster(3, extra_config=ours.config(),
                               route_tls=ours.route_config()) as cluster:
        # started: every node knows the metadata leader and all 3 nodes, over its routes
        for route in cluster.routes:
            host, _, port = route.rpartition(":")
            assert _route_info(host, int(port), ours, cert=True)["tls_verify"] is True
            with pytest.raises(ssl.SSLError, match="CERTIFICATE_REQUIRED"):
                _route_info(host, int(port), ours, cert=False)
            with socket.create_connection((host, int(port)), timeout=2) as plain, \
                    pytest.raises(TimeoutError):
                plain.recv(1)  # a plaintext peer is told nothing
        await _connect(",".join(u.replace("nats://", "tls://") for u in cluster.urls),
                       tls_ca=ours.ca)
    # a server certificate made for server use only cannot serve routes: said at once
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from rlfabric.bus.nats.tls import _cert, _write

    old = tmp_path / "old"
    shutil.copytree(Path(ours.ca).parent, old)
    key = ec.generate_private_key(ec.SECP256R1())
    _write(str(old / "server-cert.pem"),
           _cert("127.0.0.1", key, key, usage=[ExtendedKeyUsageOID.SERVER_AUTH]))
    kept = TlsSetup(*(str(old / Path(p).name) for p in (
        ours.ca, ours.server_cert, ours.server_key, ours.client_cert, ours.client_key)))
    with pytest.raises(ValueError, match=r"made for server use only.*remove the files"):
        kept.route_config()


def _route_info(host: str, port: int, tls: TlsSetup, *, cert: bool) -> dict:
    """The INFO a node's route listener sends a peer that holds the CA (and, with `cert`, the
    nodes' certificate), after the TLS handshake."""
    ctx = ssl.create_default_context(cafile=tls.ca)
    if cert:
        ctx.load_cert_chain(tls.server_cert, tls.server_key)
    with socket.create_connection((host, port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as sock:
        line = sock.makefile("rb").readline()
    assert line.startswith(b"INFO "), line[:100]
    return dict(json.loads(line[5:]))
