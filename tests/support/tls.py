"""TLS material and a mutual-TLS front for the Schema Registry tests.

``make_pki`` writes a throwaway CA and, signed by it, a server certificate for 127.0.0.1 and a
client certificate (PEM, keys unencrypted). ``MutualTlsFront`` is a TLS listener that requires
a client certificate signed by that CA and relays the bytes to a plain-HTTP upstream (the real
registry): Apicurio's Quarkus build fixes client-certificate authentication off at build time,
so this is how the tests see a client certificate accepted or refused.
"""

from __future__ import annotations

import datetime
import ipaddress
import select
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(key, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _certificate(subject: str, key, issuer_name, issuer_key, *, ca: bool = False, server: bool = False):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
    if not ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("rollout-reassembler test CA")
    ca_cert = _certificate("rollout-reassembler test CA", ca_key, ca_name, ca_key, ca=True)
    files = {}
    for role in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate("127.0.0.1" if role == "server" else "stage", key, ca_name, ca_key,
                            server=role == "server")
        (directory / f"{role}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[role] = (directory / f"{role}.crt", _write_key(key, directory / f"{role}.key"))
    ca = directory / "ca.crt"
    ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return Pki(ca, *files["server"], *files["client"])


class MutualTlsFront:
    """``https://127.0.0.1:<port>`` requiring a client certificate signed by ``pki.ca``; each
    accepted connection is relayed to ``127.0.0.1:<upstream_port>``. ``refused`` counts the
    handshakes it refused."""

    def __init__(self, pki: Pki, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca))
        self.context.load_cert_chain(str(pki.server_cert), str(pki.server_key))
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.refused = 0
        self.accepted = 0
        self._closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def url(self, path: str = "") -> str:
        return f"https://127.0.0.1:{self.port}{path}"

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(raw,), daemon=True).start()

    def _handle(self, raw: socket.socket) -> None:
        raw.settimeout(30)
        try:
            client = self.context.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            self.refused += 1
            raw.close()
            return
        self.accepted += 1
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30)
        try:   # one thread per connection: an SSL socket must not be read and written concurrently
            while True:
                ready = [client] if client.pending() else select.select([client, upstream], [], [], 30)[0]
                if not ready:
                    return
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    (upstream if sock is client else client).sendall(data)
        except OSError:
            pass
        finally:
            client.close()
            upstream.close()

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
