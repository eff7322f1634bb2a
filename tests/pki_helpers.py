"""Test PKI made on the fly with `cryptography` (no key in the repo): a CA, server and client
certificates, a rogue CA, and a bearer-token file."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, issuer_key, issuer_name, *, ca: bool = False, san=None, key=None):
    key = key or ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name or _name(subject))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def _write(path, key, cert):
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path.with_suffix(".pem")), str(path.with_suffix(".key"))


def make_pki(root: Path, token: str) -> dict:
    """A CA, a server certificate for 127.0.0.1/localhost, a client certificate, a rogue CA's client
    and a tokens file accepting `token`, written under `root`; paths by role."""
    ca_key, ca_cert = _issue("steerspec-test-ca", None, None, ca=True)
    rogue_key, rogue_cert = _issue("rogue-ca", None, None, ca=True)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    out = {"ca": _write(root / "ca", ca_key, ca_cert)[0]}
    out["server"] = _write(root / "server", *_issue("server", ca_key, ca_cert.subject, san=san))
    out["client"] = _write(root / "client", *_issue("alice", ca_key, ca_cert.subject))
    out["rogue"] = _write(root / "rogue", *_issue("mallory", rogue_key, rogue_cert.subject))
    (root / "tokens").write_text(f"# accepted tokens\n{token}\nanother-token\n")
    out["tokens"] = str(root / "tokens")
    return out
