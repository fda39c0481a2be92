"""`pagedserve.client.Client` credentials without a cluster: the plaintext-key warning and the
loopback check behind it (the cluster tests prove the key and certificates reach the router)."""

from __future__ import annotations

import logging

import pytest
from support.certs import make_certs

from pagedserve.client import Client, is_loopback

KEY = "secret-key-0123456789abcdef"


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:50051", True), ("localhost:50051", True), ("[::1]:50051", True),
        ("dns:///localhost:50051", True), ("unix:/tmp/router.sock", True), ("localhost", True),
        ("10.0.0.7:50051", False), ("router.example:50051", False), ("[2001:db8::1]:1", False),
        ("dns:///router:50051", False),
    ],
)  # fmt: skip
def test_loopback_addresses_are_told_from_remote_ones(address, loopback):
    assert is_loopback(address) is loopback


def warnings_of(caplog, address: str, **kwargs) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedserve.client"), Client(address, **kwargs):
        pass
    return [record.getMessage() for record in caplog.records]


def test_an_api_key_over_plaintext_off_loopback_warns_without_the_key(caplog, tmp_path):
    (message,) = warnings_of(caplog, "10.0.0.7:50051", api_key=KEY)
    assert "without TLS" in message and "10.0.0.7:50051" in message and KEY not in message
    assert warnings_of(caplog, "127.0.0.1:50051", api_key=KEY) == []
    assert warnings_of(caplog, "10.0.0.7:50051") == []  # no key, nothing to leak
    ca = str(make_certs(tmp_path).ca)
    assert warnings_of(caplog, "10.0.0.7:50051", api_key=KEY, tls_ca=ca) == []


def test_a_client_certificate_needs_its_key(tmp_path):
    certs = make_certs(tmp_path)
    with pytest.raises(ValueError, match="--tls-client-cert and --tls-client-key"):
        Client("127.0.0.1:1", tls_ca=str(certs.ca), tls_client_cert=str(certs.client.cert))
