"""TLS for kvsvc: the listeners' certificates (gRPC and ``/metrics``) and the clients' trust.

**Listeners** (:class:`ServerTls`, :class:`ServerTlsSource`): one certificate and key per
process serve its gRPC port and its ``/metrics`` endpoint; a client CA turns on mTLS (every
client must present a certificate that CA signed, on both listeners). The files are read and
checked before anything listens (PEM, an unencrypted key that matches the certificate), so a
wrong path or a mismatched pair is one clear error at start rather than a failed handshake
per client. They are re-read when they change on disk (a renewed Kubernetes Secret, a
cert-manager rotation): each new connection's handshake looks at their modification times
(three ``stat`` calls) and takes the new pair once it loads; a half-written or mismatched
update is logged and the previous pair kept.

**Clients** (:class:`ClientTls`, :func:`client_tls`): a CA bundle to verify the server and,
for mTLS, a client certificate and key. Every kvsvc client (the typed client, ``kvsvc
worker``, ``kvsvc ctl``, the health check, the vLLM integration) resolves them the same way:
an explicit value wins, an unset one falls back to ``KVSVC_TLS_CA``, ``KVSVC_TLS_CERT``,
``KVSVC_TLS_KEY`` and ``KVSVC_TLS_SERVER_NAME``, and an empty string means "off" even when
the variable is set. TLS is on as soon as a CA or a client certificate is given; without a
CA the system's roots verify the server.

Only grpc and the standard library: the engine client imports this without torch.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

log = logging.getLogger("kvsvc.tls")

TLS_CA_ENV = "KVSVC_TLS_CA"
TLS_CERT_ENV = "KVSVC_TLS_CERT"
TLS_KEY_ENV = "KVSVC_TLS_KEY"
TLS_SERVER_NAME_ENV = "KVSVC_TLS_SERVER_NAME"

_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
_PRIVATE_KEY = b"PRIVATE KEY-----"


class TlsError(ValueError):
    """TLS settings that do not go together (a certificate without its key, ...).

    ``setting`` names the flag or field to change; the message starts with it.
    """

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting
        self.message = message


class TlsFileError(TlsError):
    """A TLS file cannot be used: missing, unreadable, not PEM, encrypted, or a key that
    does not match its certificate. The message names the setting and the path."""


def read_pem(path: str, setting: str, *, key: bool = False) -> bytes:
    """The bytes of PEM file ``path``, checked to hold a certificate (or a private key).

    Args:
        path: the file.
        setting: the flag or field that named it (for the message).
        key: expect an unencrypted private key instead of certificates.

    Raises:
        TlsFileError: naming ``setting`` and ``path``.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TlsFileError(setting, f"cannot read {path}: {exc.strerror or exc}") from None
    if key:
        if b"ENCRYPTED" in data:
            # gRPC core cannot decrypt a key, and nothing here may prompt for a passphrase.
            raise TlsFileError(
                setting,
                f"{path} is an encrypted private key; give an unencrypted one "
                "(openssl pkey -in KEY -out KEY.plain) and protect the file instead",
            )
        if _PRIVATE_KEY not in data:
            raise TlsFileError(setting, f"{path} holds no PEM private key")
    elif _CERTIFICATE not in data:
        raise TlsFileError(setting, f"{path} holds no PEM certificate")
    return data


def _no_passphrase() -> str:
    raise TlsFileError("tls_key", "the private key needs a passphrase")


def _load_pair(context: ssl.SSLContext, cert: str, key: str, cert_setting: str) -> None:
    """Load a certificate and its key into ``context``, saying which of them is wrong."""
    try:
        context.load_cert_chain(cert, key, password=_no_passphrase)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TlsFileError(
                cert_setting, f"the private key {key} does not belong to the certificate {cert}"
            ) from None
        raise TlsFileError(
            cert_setting,
            f"cannot load the certificate {cert} with the key {key}: {exc.reason or exc}",
        ) from None
    except OSError as exc:
        raise TlsFileError(cert_setting, f"cannot read {cert} or {key}: {exc}") from None


def _load_ca(context: ssl.SSLContext, ca: str, setting: str) -> None:
    try:
        context.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise TlsFileError(setting, f"cannot load CA certificates from {ca}: {reason}") from None


# ---------------------------------------------------------------- listeners


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A listener's certificate files.

    Attributes:
        cert: PEM certificate chain of the listener (leaf first).
        key: its unencrypted PEM private key.
        client_ca: PEM CA bundle that client certificates must chain to; when set, a
            client without such a certificate is refused during the handshake (mTLS).
        setting: the prefix of the settings that named the files, for messages (the
            server's ``tls``, the agent's ``metrics_tls``).
    """

    cert: str
    key: str
    client_ca: str | None = None
    setting: str = "tls"

    @property
    def mutual(self) -> bool:
        """Whether clients must present a certificate."""
        return self.client_ca is not None

    def _files(self) -> tuple[str, ...]:
        return (self.cert, self.key, *((self.client_ca,) if self.client_ca else ()))

    def signature(self) -> tuple[tuple[int, int, int], ...]:
        """What changes when a file is replaced (inode, size, mtime), for reloading.

        Raises:
            OSError: a file is gone.
        """
        out = []
        for path in self._files():
            st = os.stat(path)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def load(self) -> LoadedTls:
        """Read and check the files.

        Raises:
            TlsFileError: a file is missing, unreadable, not PEM, an encrypted key, a key
                that is not the certificate's, or a CA bundle that does not load.
        """
        cert = read_pem(self.cert, f"{self.setting}_cert")
        key = read_pem(self.key, f"{self.setting}_key", key=True)
        client_ca = (
            read_pem(self.client_ca, f"{self.setting}_client_ca") if self.client_ca else None
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        _load_pair(context, self.cert, self.key, f"{self.setting}_cert")
        if self.client_ca:
            _load_ca(context, self.client_ca, f"{self.setting}_client_ca")
            context.verify_mode = ssl.CERT_REQUIRED
        # HTTP/1.1 only: the /metrics server speaks nothing else.
        context.set_alpn_protocols(["http/1.1"])
        return LoadedTls(cert, key, client_ca, context)


@dataclass(frozen=True, slots=True)
class LoadedTls:
    """The contents of a :class:`ServerTls`, checked: PEM bytes for gRPC, an SSL context
    for HTTPS."""

    cert: bytes
    key: bytes
    client_ca: bytes | None
    context: ssl.SSLContext

    def grpc_configuration(self) -> Any:
        return grpc.ssl_server_certificate_configuration(
            [(self.key, self.cert)], root_certificates=self.client_ca
        )


class ServerTlsSource:
    """A listener's current certificate, re-read when its files change.

    Both listeners of a server share one source, so they always present the same pair.
    Thread-safe: gRPC's handshakes and the ``/metrics`` threads ask concurrently.
    """

    def __init__(self, tls: ServerTls) -> None:
        """Raises TlsFileError when the files cannot be used (see :meth:`ServerTls.load`)."""
        self.tls = tls
        self._lock = threading.Lock()
        self._signature = self._current_signature()
        self._loaded = tls.load()
        self._generation = 0
        self._grpc_generation = 0
        self._rejected: tuple[Any, ...] | None = None

    def _current_signature(self) -> tuple[Any, ...] | None:
        try:
            return self.tls.signature()
        except OSError:
            return None  # a file is being replaced: keep what we have

    def refresh(self) -> bool:
        """Reload the files if they changed and load cleanly; True if the pair changed."""
        signature = self._current_signature()
        with self._lock:
            if signature is None or signature == self._signature:
                return False
            try:
                loaded = self.tls.load()
            except TlsFileError as exc:
                if signature != self._rejected:  # once per bad version, not per handshake
                    self._rejected = signature
                    log.warning(
                        "TLS files changed but cannot be used; keeping the old ones: %s", exc
                    )
                return False
            if self._current_signature() != signature:
                return False  # changed again while being read: next handshake retries
            self._signature, self._loaded = signature, loaded
            self._generation += 1
            log.info("TLS certificate reloaded from %s", self.tls.cert)
            return True

    def ssl_context(self) -> ssl.SSLContext:
        """The SSL context of the current pair (for an HTTPS listener)."""
        self.refresh()
        with self._lock:
            return self._loaded.context

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials that follow the files (``add_secure_port``)."""
        with self._lock:
            initial = self._loaded.grpc_configuration()
            self._grpc_generation = self._generation
        return grpc.dynamic_ssl_server_credentials(
            initial, self._grpc_fetch, require_client_authentication=self.tls.mutual
        )

    def _grpc_fetch(self) -> Any:
        """gRPC core asks this at each handshake: a new configuration, or None to keep."""
        try:
            self.refresh()
            with self._lock:
                if self._grpc_generation == self._generation:
                    return None
                self._grpc_generation = self._generation
                return self._loaded.grpc_configuration()
        except Exception:  # never fail a handshake over a reload
            log.exception("TLS reload check failed")
            return None


# ---------------------------------------------------------------- clients


@dataclass(frozen=True, slots=True)
class ClientTls:
    """How a client verifies the server and proves itself.

    Attributes:
        ca: PEM CA bundle the server's certificate must chain to (None: the system roots).
        cert / key: the client's certificate and unencrypted key, for servers that require
            client certificates (mTLS); both or neither.
        server_name: the name to check the server's certificate against instead of the
            target's host (connecting by IP to a certificate that names a host).
    """

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TlsError(
                "tls_key" if self.key is None else "tls_cert",
                "tls_cert and tls_key go together: give the client certificate and its key",
            )

    def check(self) -> None:
        """Read every file now, so a wrong path fails at start, not at the first call.

        Raises:
            TlsFileError: naming the setting and the path.
        """
        self.channel_credentials()
        self.ssl_context()

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials (``grpc.secure_channel``).

        Raises:
            TlsFileError: naming the setting and the path.
        """
        ca = read_pem(self.ca, "tls_ca") if self.ca else None
        cert = read_pem(self.cert, "tls_cert") if self.cert else None
        key = read_pem(self.key, "tls_key", key=True) if self.key else None
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        """Channel arguments these settings need (the server-name override)."""
        if self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []

    def ssl_context(self) -> ssl.SSLContext:
        """A client SSL context for HTTPS (``/metrics``), verifying the server.

        Raises:
            TlsFileError: naming the setting and the path.
        """
        context = ssl.create_default_context()
        if self.ca:
            read_pem(self.ca, "tls_ca")
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            _load_ca(context, self.ca, "tls_ca")
        if self.cert and self.key:
            read_pem(self.cert, "tls_cert")
            read_pem(self.key, "tls_key", key=True)
            _load_pair(context, self.cert, self.key, "tls_cert")
        return context


def client_tls(
    ca: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    server_name: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> ClientTls | None:
    """The client TLS settings, explicit values first, then the ``KVSVC_TLS_*`` variables.

    ``None`` for a value reads its variable; ``""`` turns it off even when the variable is
    set (``ca=""``, ``cert=""`` and ``key=""``: plaintext whatever the environment says).

    Returns:
        None when neither a CA nor a client certificate is set: a plaintext channel.

    Raises:
        TlsError: a certificate without its key (or the reverse), or an explicit
            ``server_name`` with TLS off (which would silently connect in plaintext).
    """
    env = os.environ if environ is None else environ

    def pick(value: str | None, variable: str) -> str | None:
        return (env.get(variable) if value is None else value) or None

    resolved_ca = pick(ca, TLS_CA_ENV)
    resolved_cert = pick(cert, TLS_CERT_ENV)
    resolved_key = pick(key, TLS_KEY_ENV)
    resolved_name = pick(server_name, TLS_SERVER_NAME_ENV)
    if resolved_ca is None and resolved_cert is None and resolved_key is None:
        if server_name:
            raise TlsError("tls_server_name", "needs TLS: give tls_ca (or a client certificate)")
        return None
    return ClientTls(resolved_ca, resolved_cert, resolved_key, resolved_name)


# The name a server's certificate is checked for over a Unix-domain socket (unix:PATH has
# no host; gRPC would check the path), unless a server name is given: the host's own name
# for the server, as for a client that connects to 127.0.0.1 with a certificate naming it.
UNIX_SOCKET_SERVER_NAME = "localhost"


def secure_channel_args(
    tls: ClientTls | None, options: Any = (), target: str = ""
) -> list[tuple[str, Any]]:
    """``options`` plus what ``tls`` needs (for ``grpc.secure_channel``) to ``target``."""
    if tls is None:
        return list(options)
    extra = tls.channel_options()
    if not extra and target.startswith("unix:"):
        extra = [("grpc.ssl_target_name_override", UNIX_SOCKET_SERVER_NAME)]
    return [*options, *extra]


def open_channel(target: str, tls: ClientTls | None, options: Any = ()) -> grpc.Channel:
    """A blocking channel to ``target``: TLS when ``tls`` is set, plaintext otherwise.

    Raises:
        TlsFileError: a TLS file cannot be used.
    """
    if tls is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(
        target, tls.channel_credentials(), options=secure_channel_args(tls, options, target)
    )


def open_aio_channel(target: str, tls: ClientTls | None, options: Any = ()) -> grpc.aio.Channel:
    """The asyncio counterpart of :func:`open_channel`."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    return grpc.aio.secure_channel(
        target, tls.channel_credentials(), options=secure_channel_args(tls, options, target)
    )
