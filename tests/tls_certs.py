"""Private CAs and server certificates for the TLS tests, made with the openssl command line.

Each CA is its own trust root, so a certificate signed by one is refused by a client that
trusts only another: the case of an engine whose certificate the configured CA did not sign.
Server certificates name 127.0.0.1 in subjectAltName (hostname checks stay on everywhere).
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

HAVE_OPENSSL = shutil.which("openssl") is not None


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> Path:
    """``<name>.pem`` (the CA certificate, the file ``engine.ca_file`` names) and its key."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-days", "2", "-subj", f"/CN=narwhal test CA {name}", cwd=d)
    return d / f"{name}.pem"


def make_server_cert(d: Path, ca: Path, name: str) -> tuple[Path, Path]:
    """``(<name>.pem, <name>.key)``: a certificate for 127.0.0.1 signed by ``ca``."""
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", "/CN=127.0.0.1", cwd=d)
    (d / f"{name}.ext").write_text("subjectAltName = IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca), "-CAkey", str(ca.with_suffix(".key")),
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """What a fake engine serves https with (as ``narwhal fake-engine --tls-cert/--tls-key``)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


def good_and_rogue(d: Path) -> dict[str, Path]:
    """Certificates for TLS tests under ``d``: CA ``a`` signs ``good``; CA ``b`` signs ``rogue``
    (a server that shows a valid chain, just not one the router trusts)."""
    ca_a, ca_b = make_ca(d, "ca-a"), make_ca(d, "ca-b")
    good, good_key = make_server_cert(d, ca_a, "good")
    rogue, rogue_key = make_server_cert(d, ca_b, "rogue")
    return {"ca_a": ca_a, "ca_b": ca_b, "good": good, "good_key": good_key, "rogue": rogue, "rogue_key": rogue_key}
