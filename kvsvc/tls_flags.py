"""The TLS flags of the commands that are clients of a server (``worker``, ``ctl``, the health
check, ``demo``'s children), and of a listener's certificate (the agent's ``/metrics``).

One definition so every client spells them alike and falls back on the same environment
variables (see :mod:`kvsvc.tls`). Exit status convention for TLS: flags that do not go
together are bad usage (2); a file that is missing or wrong is the environment (1).

It sits below every package with commands (:mod:`kvsvc.commands`, the cluster's
``indexer`` and ``router`` in :mod:`kvsvc.cluster.commands`, :mod:`kvsvc.tools.healthcheck`)
so that none of them imports another to share it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from kvsvc.tls import (
    TLS_CA_ENV,
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    TLS_SERVER_NAME_ENV,
    ClientTls,
    ServerTls,
    TlsError,
    TlsFileError,
    client_tls,
)

# The agent's /metrics certificate from the environment: a container sets these once, and
# its health check (kvsvc.tools.healthcheck --agent-metrics HOST:PORT) then speaks HTTPS too.
METRICS_TLS_CERT_ENV = "KVSVC_METRICS_TLS_CERT"
METRICS_TLS_KEY_ENV = "KVSVC_METRICS_TLS_KEY"
METRICS_TLS_CLIENT_CA_ENV = "KVSVC_METRICS_TLS_CLIENT_CA"


def tls_exit_status(exc: TlsError) -> int:
    """1 for a TLS file that cannot be used (the environment), 2 for flags that clash."""
    return 1 if isinstance(exc, TlsFileError) else 2


def add_client_tls_flags(parser: Any) -> None:
    """``--tls-ca``, ``--tls-cert``, ``--tls-key``, ``--tls-server-name`` in their own group."""
    group = parser.add_argument_group(
        "TLS (to a server started with --tls-cert)",
        "A CA (or a client certificate) makes the connection TLS; a server with "
        "--tls-client-ca also needs --tls-cert and --tls-key. Each flag falls back on its "
        "environment variable; an empty value turns it off.",
    )
    group.add_argument(
        "--tls-ca", metavar="PEM", help=f"CA bundle that verifies the server (env {TLS_CA_ENV})"
    )
    group.add_argument(
        "--tls-cert", metavar="PEM", help=f"client certificate for mTLS (env {TLS_CERT_ENV})"
    )
    group.add_argument(
        "--tls-key", metavar="PEM", help=f"the client certificate's key (env {TLS_KEY_ENV})"
    )
    group.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="name the server's certificate must carry, when it is not the address's host "
        f"(env {TLS_SERVER_NAME_ENV})",
    )


def client_tls_from_args(args: argparse.Namespace) -> ClientTls | None:
    """The client TLS settings of the flags (environment fallbacks applied); None: plaintext.

    Raises:
        TlsError: a certificate without its key, or a server name without TLS.
    """
    return client_tls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)


def add_metrics_tls_flags(group: Any) -> None:
    """The agent's ``/metrics`` certificate: ``--metrics-tls-cert/-key/-client-ca``.

    A listener needs a server certificate for the name scrapers connect to; the client
    certificate an agent shows the kvsvc server is issued for client authentication (and
    names no host), so it is not reused here.
    """
    group.add_argument(
        "--metrics-tls-cert",
        metavar="PEM",
        help=f"serve /metrics over HTTPS with this certificate (env {METRICS_TLS_CERT_ENV})",
    )
    group.add_argument(
        "--metrics-tls-key",
        metavar="PEM",
        help=f"its private key, unencrypted (env {METRICS_TLS_KEY_ENV})",
    )
    group.add_argument(
        "--metrics-tls-client-ca",
        metavar="PEM",
        help="require scrapers' client certificates signed by this CA "
        f"(env {METRICS_TLS_CLIENT_CA_ENV})",
    )


def metrics_tls_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ServerTls | None:
    """The agent's ``/metrics`` certificate files (flags, then ``KVSVC_METRICS_TLS_*``; an
    empty value is off), or None for plain HTTP.

    Raises:
        TlsError: the certificate without the key (or the reverse), or a client CA alone.
    """
    env = os.environ if environ is None else environ

    def pick(value: str | None, variable: str) -> str | None:
        return (env.get(variable) if value is None else value) or None

    cert = pick(args.metrics_tls_cert, METRICS_TLS_CERT_ENV)
    key = pick(args.metrics_tls_key, METRICS_TLS_KEY_ENV)
    ca = pick(args.metrics_tls_client_ca, METRICS_TLS_CLIENT_CA_ENV)
    if (cert is None) != (key is None):
        raise TlsError(
            "--metrics-tls-key" if key is None else "--metrics-tls-cert",
            "--metrics-tls-cert and --metrics-tls-key go together",
        )
    if cert is None or key is None:
        if ca is not None:
            raise TlsError(
                "--metrics-tls-client-ca", "needs --metrics-tls-cert and --metrics-tls-key"
            )
        return None
    return ServerTls(cert, key, ca, setting="metrics_tls")
