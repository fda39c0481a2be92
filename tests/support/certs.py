"""Certificates made at test time: a cluster CA, a server certificate for 127.0.0.1/localhost, a
client certificate it signed, and a rogue CA's client certificate (never trusted)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pagedserve.grpcutil import ClientTLS, ServerTLS


@dataclass(frozen=True, slots=True)
class Pem:
    cert: Path
    key: Path


@dataclass(frozen=True, slots=True)
class Certs:
    ca: Path
    server: Pem
    client: Pem
    rogue_client: Pem  # signed by a CA the cluster does not trust

    def server_tls(self, *, mtls: bool = True) -> ServerTLS:
        return ServerTLS(
            self.server.cert.read_bytes(),
            self.server.key.read_bytes(),
            self.ca.read_bytes() if mtls else None,
        )

    def client_tls(self, which: str = "client") -> ClientTLS:
        """`which`: "client" (trusted cert), "rogue" (untrusted cert), "none" (no cert)."""
        pem = {"client": self.client, "rogue": self.rogue_client, "none": None}[which]
        if pem is None:
            return ClientTLS(self.ca.read_bytes())
        return ClientTLS(self.ca.read_bytes(), pem.cert.read_bytes(), pem.key.read_bytes())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(subject: str, key, issuer: str, issuer_key, *, ca: bool, usage=None, san=None):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if san is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, name: str, cert, key) -> Pem:
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return Pem(cert_path, key_path)


def make_certs(directory: Path) -> Certs:
    def new_key():
        return ec.generate_private_key(ec.SECP256R1())

    ca_key, rogue_key = new_key(), new_key()
    ca = _issue("pagedserve-test-ca", ca_key, "pagedserve-test-ca", ca_key, ca=True)
    rogue = _issue("rogue-ca", rogue_key, "rogue-ca", rogue_key, ca=True)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server_key, client_key, rogue_client_key = new_key(), new_key(), new_key()
    server = _issue("pagedserve", server_key, "pagedserve-test-ca", ca_key, ca=False,
                    usage=ExtendedKeyUsageOID.SERVER_AUTH, san=san)  # fmt: skip
    client = _issue("pagedserve-client", client_key, "pagedserve-test-ca", ca_key, ca=False,
                    usage=ExtendedKeyUsageOID.CLIENT_AUTH)  # fmt: skip
    rogue_client = _issue("intruder", rogue_client_key, "rogue-ca", rogue_key, ca=False,
                          usage=ExtendedKeyUsageOID.CLIENT_AUTH)  # fmt: skip
    ca_path = directory / "ca.crt"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "rogue-ca.crt").write_bytes(rogue.public_bytes(serialization.Encoding.PEM))
    return Certs(
        ca=ca_path,
        server=_write(directory, "server", server, server_key),
        client=_write(directory, "client", client, client_key),
        rogue_client=_write(directory, "rogue-client", rogue_client, rogue_client_key),
    )
