"""Mutual TLS on every gRPC channel between a controller, its workers and a shared cluster's
manager: who may speak to a worker at all, before the token is even read.

A cluster has its own certificate authority. `make(directory)` creates one and signs one
member certificate with it, then throws the authority's key away (nothing can mint another
member afterwards); the directory holds

    ca.pem     the authority's certificate: the only issuer a member trusts
    cert.pem   the member certificate (EC P-256, valid for client and server use)
    key.pem    its private key (0600)

and every member of the cluster (controller, workers, manager, jobs) is given the same
directory. A server asks for the client's certificate and refuses a handshake without one
signed by the cluster's authority; a client refuses a server whose certificate is not. The
member certificate names one DNS name, SERVER_NAME, which clients check in place of the
address they dialled (`grpc.ssl_target_name_override`): workers come and go on addresses
nobody knows when the certificate is made, and what makes a member is the authority's
signature, not its address. Certificates a user makes with their own tools work if they name
SERVER_NAME and carry both extended key usages.

The token and the session secret then cross the network only inside TLS. What stays in the
clear is the data plane between hosts (docs/security.md, "Encrypted").
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path

SERVER_NAME = "mpmd-cluster"
TLS_DIR = "tls"  # a shared cluster's certificates, inside its directory (`mpmd cluster up`)
FILES = ("ca.pem", "cert.pem", "key.pem")
VALID_DAYS = 3650  # a cluster's authority outlives any run; rotate by making a new directory


@dataclasses.dataclass(frozen=True)
class Tls:
    """The PEM bytes of a cluster's authority and of this member's certificate and key."""

    ca: bytes
    cert: bytes
    key: bytes
    directory: str = ""  # where they were read from (what a launcher hands its workers)

    def server_credentials(self):
        import grpc

        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def cluster_tls(tls, key: str = "tls", given_only: str | None = None) -> Tls | None:
    """A launcher's `tls=` argument as a Tls: True makes a new authority (in memory), a
    directory is loaded, False or None is the clear; ValueError naming `key` otherwise.
    `given_only`: for a cluster whose certificates come from elsewhere, the ValueError that
    refuses True (why a new authority cannot serve, and what to give instead)."""
    if tls is True:
        if given_only:
            raise ValueError(given_only)
        return authority()
    if tls is False or tls is None:
        return None
    if isinstance(tls, Tls):
        return tls
    if isinstance(tls, (str, os.PathLike)) and str(tls):
        return load(tls, key)
    raise ValueError(f"{key} must be True (a new authority), False (in the clear) or a directory, got {tls!r}")


def load(directory: str | os.PathLike, key: str = "cluster.tls") -> Tls:
    """The Tls of `directory` (ca.pem, cert.pem, key.pem); ValueError naming `key` and the
    missing or unreadable file, or a key file others may read."""
    d = Path(directory)
    parts = {}
    for name in FILES:
        path = d / name
        try:
            parts[name] = path.read_bytes()
        except OSError as e:
            raise ValueError(
                f"{key}: cannot read {path}: {e.strerror or e}; the directory needs {', '.join(FILES)} "
                f"(`mpmd cluster certs DIR` makes them)"
            ) from None
        if b"-----BEGIN " not in parts[name]:
            raise ValueError(f"{key}: {path} is not a PEM file")
    mode = (d / "key.pem").stat().st_mode & 0o077
    if mode:
        raise ValueError(
            f"{key}: {d / 'key.pem'} may be read by others (mode {mode:03o} beyond the owner): chmod 600 it"
        )
    return Tls(parts["ca.pem"], parts["cert.pem"], parts["key.pem"], str(d))


def make(directory: str | os.PathLike, name: str = "mpmd") -> Tls:
    """A new authority and member certificate written into `directory` (made 0700 if new;
    existing files of these names are refused, never overwritten); its Tls."""
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    there = [n for n in FILES if (d / n).exists()]
    if there:
        raise ValueError(f"{d} already holds {', '.join(there)}: give an empty directory (nothing there is replaced)")
    made = authority(name)
    for n, data in zip(FILES, (made.ca, made.cert, made.key)):
        # O_EXCL: a file that appeared since the check above is not replaced either.
        fd = os.open(d / n, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if n == "key.pem" else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return dataclasses.replace(made, directory=str(d))


def authority(name: str = "mpmd") -> Tls:
    """A new authority and one member certificate, in memory (what LocalCluster hands its
    workers on their stdin; nothing on disk)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} cluster authority")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} cluster member")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return Tls(
        ca.public_bytes(pem),
        cert.public_bytes(pem),
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


def to_line(tls: Tls) -> str:
    """`tls` as one line of text (what a launcher writes on a worker's stdin after the token)."""
    return json.dumps({"ca": tls.ca.decode(), "cert": tls.cert.decode(), "key": tls.key.decode()})


def from_line(line: str) -> Tls:
    """The Tls of a to_line line; ValueError if it is not one."""
    try:
        d = json.loads(line)
        return Tls(d["ca"].encode(), d["cert"].encode(), d["key"].encode())
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError("the line after the token is not the cluster's certificates (to_line)") from None


# What a client sets so the member certificate's one name is checked, whatever address it dialled.
CHANNEL_OPTIONS = (("grpc.ssl_target_name_override", SERVER_NAME),)
