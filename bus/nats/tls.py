"""TLS for a job's server: a CA of its own, a server certificate and a client certificate it
signed, and the nats-server `tls` block that serves them.

    setup = write_tls("/etc/rlfabric/tls", hosts=["127.0.0.1", "nats.internal"])
    EmbeddedNats(extra_config=setup.config(verify=True))   # client certificates required

DIR holds `ca.pem` (give it to every client: `--tls-ca`), `server-cert.pem`/`server-key.pem`
(the server's, for the `hosts` given: IP addresses and DNS names; a cluster's nodes also
present it to each other, `route_config`) and `client-cert.pem`/
`client-key.pem` (`--tls-cert`/`--tls-key`, when the server requires client certificates).
Files already there are kept: a restarted server serves the same certificates, and the
clients holding them keep connecting. Keys are written owner-only. TLS combines with the
per-role nkeys of `rlfabric.bus.nats.auth`: TLS says who the server is (and, with `verify`, that
the client holds a certificate the CA signed), the nkey which role the client plays.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: how long the certificates `write_tls` makes are valid
VALID_DAYS = 825


@dataclass(frozen=True, slots=True)
class TlsSetup:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def config(self, *, verify: bool = False) -> str:
        """The nats-server `tls` block; `verify`: refuse a client without a certificate the
        CA signed."""
        return (f'tls {{\n  cert_file: "{self.server_cert}"\n  key_file: "{self.server_key}"\n'
                f'  ca_file: "{self.ca}"\n  verify: {str(verify).lower()}\n  timeout: 5\n}}\n')

    def route_config(self) -> str:
        """The `tls` block of a cluster's routes (inside `cluster {}`): each node presents the
        server certificate and takes only a peer whose certificate the CA signed. Raises
        ValueError for a server certificate made before routes used it (no client use)."""
        from cryptography import x509
        from cryptography.x509.oid import ExtendedKeyUsageOID

        cert = x509.load_pem_x509_certificate(Path(self.server_cert).read_bytes())
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        if ExtendedKeyUsageOID.CLIENT_AUTH not in usage:
            raise ValueError(f"{self.server_cert} was made for server use only, so the nodes "
                             "of a cluster cannot present it to each other: remove the files in "
                             f"{Path(self.ca).parent} and start again (new ones are written)")
        return self.config(verify=True)


def write_tls(directory: str | os.PathLike[str], *, hosts: list[str]) -> TlsSetup:
    """Make (or keep) the CA, server and client certificates in `directory`; the server's is
    valid for `hosts`. Raises ValueError for an empty host list."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    if not hosts:
        raise ValueError("write_tls needs at least one host (an IP address or a DNS name) the "
                         "server is reached at")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = TlsSetup(*(str((d / n).resolve()) for n in (
        "ca.pem", "server-cert.pem", "server-key.pem", "client-cert.pem", "client-key.pem")))
    if all(Path(p).is_file() for p in (out.ca, out.server_cert, out.server_key,
                                       out.client_cert, out.client_key)):
        return out
    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    _write(out.ca, _cert("rlfabric CA", ca_key, ca_key))
    # a cluster's nodes present the server certificate to each other: both uses
    _write(out.server_cert, _cert(hosts[0], server_key, ca_key,
                                  usage=[ExtendedKeyUsageOID.SERVER_AUTH,
                                         ExtendedKeyUsageOID.CLIENT_AUTH],
                                  sans=[_san(h) for h in hosts]))
    _write(out.client_cert, _cert("rlfabric client", client_key, ca_key,
                                  usage=[ExtendedKeyUsageOID.CLIENT_AUTH]))
    _write(out.server_key, server_key)
    _write(out.client_key, client_key)
    return out


def _name(cn: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "rlfabric"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key: Any, ca_key: Any, *, usage: list[Any] | None = None,
          sans: list[Any] | None = None) -> Any:
    """A certificate for `key`, signed by `ca_key` (the CA's own when `key` is `ca_key`)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    ca = key is ca_key
    now = dt.datetime.now(dt.UTC)
    b = (x509.CertificateBuilder().subject_name(_name(subject))
         .issuer_name(_name("rlfabric CA")).public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5))
         .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    if usage:
        b = b.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(ca_key, hashes.SHA256())


def _write(path: str, obj: Any) -> None:
    """A certificate, or a private key (owner-only), as PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    if isinstance(obj, x509.Certificate):
        Path(path).write_bytes(obj.public_bytes(serialization.Encoding.PEM))
        return
    data = obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _san(host: str) -> Any:
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
