"""Throwaway certificates for trying kvsvc's TLS: a CA, a server certificate and a client one.

::

    python -m kvsvc.tools.devcerts DIR [--san server localhost 127.0.0.1] \
        [--days 30] [--client-name NAME]

writes into ``DIR``::

    ca.crt ca.key           the CA (clients' --tls-ca, the server's --tls-client-ca)
    server.crt server.key   the server's --tls-cert / --tls-key, for every --san name
    client.crt client.key   a client's --tls-cert / --tls-key (mTLS)

Made with the ``openssl`` command line (1.1.1 or later), P-256 keys, no passphrase (keys
are written 0600). For tests, the demo (``kvsvc demo --tls``) and first steps with the
compose and Kubernetes examples; a real deployment takes its certificates from its own CA
(cert-manager, Vault, ...): the file layout is the same.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SANS = ("localhost", "127.0.0.1", "::1")
_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")


class DevCertsError(RuntimeError):
    """openssl is missing or failed; the message has its output."""


@dataclass(frozen=True, slots=True)
class DevCerts:
    """The files :func:`make_dev_certs` wrote."""

    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.directory / "server.crt"

    @property
    def server_key(self) -> Path:
        return self.directory / "server.key"

    @property
    def client_cert(self) -> Path:
        return self.directory / "client.crt"

    @property
    def client_key(self) -> Path:
        return self.directory / "client.key"


def find_openssl() -> str | None:
    """The ``openssl`` executable, or None."""
    return shutil.which("openssl")


def _run(openssl: str, *args: str, cwd: Path) -> None:
    result = subprocess.run(
        [openssl, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise DevCertsError(
            f"openssl {args[0]} failed ({result.returncode}): {result.stderr.strip()}"
        )


def _san_entry(name: str) -> str:
    try:
        return f"IP:{ipaddress.ip_address(name)}"
    except ValueError:
        return f"DNS:{name}"


def _issue(
    openssl: str,
    directory: Path,
    name: str,
    common_name: str,
    extensions: Sequence[str],
    days: int,
) -> None:
    """A key and a certificate ``name``.{key,crt} signed by the CA in ``directory``."""
    _run(
        openssl,
        "req",
        *_KEY,
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={common_name}",
        cwd=directory,
    )
    (directory / f"{name}.ext").write_text("\n".join(extensions) + "\n")
    _run(
        openssl,
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-set_serial",
        str(secrets.randbits(63)),
        "-days",
        str(days),
        "-sha256",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.crt",
        cwd=directory,
    )
    for leftover in (f"{name}.csr", f"{name}.ext"):
        (directory / leftover).unlink()
    os.chmod(directory / f"{name}.key", 0o600)


def make_dev_certs(
    directory: str | Path,
    sans: Sequence[str] = DEFAULT_SANS,
    *,
    days: int = 30,
    client_name: str = "kvsvc-client",
    openssl: str | None = None,
) -> DevCerts:
    """Write a fresh CA, a server certificate for ``sans`` and a client certificate.

    Args:
        directory: where (created if missing; existing files of these names are replaced).
        sans: the server's names: DNS names and IP addresses (what clients connect to).
        days: validity.
        client_name: the client certificate's common name.
        openssl: the executable (default: ``openssl`` on PATH).

    Raises:
        DevCertsError: no openssl, or it failed.
        ValueError: no names, or days < 1.
    """
    if not sans:
        raise ValueError("the server certificate needs at least one name (--san)")
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    exe = openssl or find_openssl()
    if exe is None:
        raise DevCertsError("openssl is not installed (Debian/Ubuntu: apt-get install openssl)")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _run(
        exe,
        "req",
        "-x509",
        *_KEY,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        str(days),
        "-sha256",
        "-subj",
        f"/CN=kvsvc dev CA {secrets.token_hex(4)}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=out,
    )
    os.chmod(out / "ca.key", 0o600)
    common = ["basicConstraints=critical,CA:FALSE", "keyUsage=critical,digitalSignature"]
    _issue(
        exe,
        out,
        "server",
        sans[0],
        [
            *common,
            "extendedKeyUsage=serverAuth",
            "subjectAltName=" + ",".join(map(_san_entry, sans)),
        ],
        days,
    )
    _issue(exe, out, "client", client_name, [*common, "extendedKeyUsage=clientAuth"], days)
    return DevCerts(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvsvc.tools.devcerts",
        description="Write a throwaway CA, server certificate and client certificate "
        "(not for production).",
    )
    parser.add_argument("directory", help="output directory")
    # extend + nargs: `--san a b` and `--san a --san b` alike (the docs wrote the first,
    # and only the second worked).
    parser.add_argument(
        "--san",
        action="extend",
        nargs="+",
        metavar="NAME|IP",
        help=f"the server's names (--san a b, or repeated; default {', '.join(DEFAULT_SANS)})",
    )
    parser.add_argument("--days", type=int, default=30, help="validity (default 30)")
    parser.add_argument("--client-name", default="kvsvc-client", help="client certificate CN")
    args = parser.parse_args(argv)
    try:
        certs = make_dev_certs(
            args.directory, args.san or DEFAULT_SANS, days=args.days, client_name=args.client_name
        )
    except ValueError as exc:
        parser.error(str(exc))
    except DevCertsError as exc:
        print(f"devcerts: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {certs.directory}/{{ca,server,client}}.{{crt,key}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
