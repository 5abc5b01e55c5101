"""Settings shared by the sync and asyncio clients."""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from kvsvc.keepalive import CLIENT_KEEPALIVE_TIME_S, client_options
from kvsvc.ports import is_unix_address
from kvsvc.tls import ClientTls, client_tls, open_aio_channel, open_channel
from kvsvc.wire.frames import frames_address, is_frames_target
from kvsvc_client._frames import AioFrameChannel, FrameChannel

# Calls that change nothing may be retried after UNAVAILABLE.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
# Allocate, Free and Step carry a call_id: the server answers a repeat of an applied one
# with its first reply (and a repeated admission or Free is answered safely even without
# one), so they are also retried when the reply was lost: the call may have been applied.
RETRYABLE_REPEATS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# Trailing metadata of every reply of a call that names a pool: the pool's state epoch.
EPOCH_METADATA = "kvsvc-epoch"
# ClientOptions.step_sender's values.
STEP_SENDERS = ("thread", "inline")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_MESSAGE_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


_log = logging.getLogger("kvsvc_client")


def epoch_of_reply(
    metadata: Iterable[tuple[str, str]] | None, pool: str, known: str | None
) -> str | None:
    """The pool's state epoch a reply's trailing metadata carries (``known`` when it
    carries none). A change from ``known`` means the server lost the pool's state, and
    with it every request made before: said once, as a warning."""
    for key, value in metadata or ():
        if key == EPOCH_METADATA:
            if known is not None and value != known:
                _log.warning(
                    "pool %r: the server's state epoch changed from %s to %s: the "
                    "requests this client made before are gone",
                    pool,
                    known,
                    value,
                )
            return value
    return known


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """Attributes:
    timeout: deadline of each unary call, seconds.
    retries: extra attempts of a side-effect-free call after UNAVAILABLE, and of an
        ``allocate``, ``free`` or ``step`` after UNAVAILABLE or DEADLINE_EXCEEDED (each
        attempt gets the whole ``timeout``; a repeat is answered, not applied again).
    unavailable_timeout: seconds an ``allocate``, ``free`` or ``step`` keeps being retried
        (past ``retries``) while the server answers UNAVAILABLE: a restart on its state
        directory, after which the pool goes on where it was. 0: ``retries`` attempts only.
    backoff: first retry delay, seconds (doubles, with jitter, up to ``max_backoff``).
    token: bearer token sent as ``authorization`` metadata ("" = send none).
    token_file: a file holding the token (its first line that is not blank or a comment).
    role: whose token to look for in the environment when neither is given: ``engine``
        (``KVSVC_ENGINE_TOKEN``), ``admin``, ``agent`` or ``indexer``;
        ``KVSVC_AUTH_TOKEN`` (one token for every role) after it. See
        :func:`resolve_token`.
    tls_ca: PEM CA bundle that verifies the server (default: $KVSVC_TLS_CA); setting it
        (or a client certificate) makes the channel TLS. "" = plaintext whatever the
        environment says.
    tls_cert / tls_key: client certificate and key for a server that requires them (mTLS;
        default: $KVSVC_TLS_CERT / $KVSVC_TLS_KEY).
    tls_server_name: check the server's certificate for this name instead of the target's
        host (default: $KVSVC_TLS_SERVER_NAME). See :mod:`kvsvc.tls`.
    keepalive_time: seconds between HTTP/2 pings while a gRPC call is open (a quiet
        stream's dead server is noticed within it + 20 s); at least the server's
        ``keepalive_min_ping_interval_s``, or the server cuts the connection (see
        :mod:`kvsvc.keepalive`).
    step_sender: how :meth:`SyncStep.send_future` sends a Step without waiting:
        ``thread`` (a sender thread of the client makes the call) or ``inline`` (a framed
        target only: the frame is written on the caller's thread and the reply read there
        when asked for, no thread at all). ``inline`` costs a little less CPU in all (no
        thread wake-ups, no GIL hand-offs) but puts the sending and the reading on the
        caller's thread (an engine's scheduler: ~130-170 us a step there against ~25-50
        with the thread, in benchmarks/vllm_bench.py on 2 cores); ``thread`` leaves them to
        a core the forward pass does not use.
    """

    timeout: float = 10.0
    retries: int = 3
    unavailable_timeout: float = 30.0
    backoff: float = 0.05
    max_backoff: float = 2.0
    token: str | None = None
    token_file: str | None = None
    role: str = "engine"
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    keepalive_time: float = CLIENT_KEEPALIVE_TIME_S
    step_sender: str = "thread"

    def __post_init__(self) -> None:
        if self.step_sender not in STEP_SENDERS:
            raise ValueError(
                f"step_sender must be one of {', '.join(STEP_SENDERS)}, got {self.step_sender!r}"
            )

    def _grpc_options(self) -> tuple[tuple[str, int], ...]:
        return (*_MESSAGE_OPTIONS, *client_options(self.keepalive_time))

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        token = resolve_token(self.role, self.token, self.token_file)
        return (("authorization", f"Bearer {token}"),) if token else None

    def tls(self) -> ClientTls | None:
        """The channel's TLS settings (None: plaintext), environment fallbacks applied.

        Raises:
            TlsError: a certificate without its key, or a server name without TLS.
        """
        return client_tls(self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)

    def connection(self, target: str) -> dict[str, bool]:
        """How a channel to ``target`` connects, as :func:`kvsvc_client.errors.error_from_rpc`
        takes it for the hint it adds to a connection closed without a word (TLS or not, a
        client certificate or not); empty for a framed target (its own errors say more)."""
        if is_frames_target(target):
            return {}
        tls = self.tls()
        return {"tls": tls is not None, "client_cert": tls is not None and tls.cert is not None}

    def channel(self, target: str) -> grpc.Channel:
        """A blocking channel to ``target`` with these options' TLS (plaintext without).

        ``frames:unix:PATH`` or ``frames:HOST:PORT`` is the server's framed transport
        (``kvsvc serve --frames-listen``): the same unary calls without gRPC's per-call
        work (see :mod:`kvsvc_client._frames`); streaming calls (``watch_events``) need a
        gRPC target. The framed transport serves TLS on TCP only: on a ``frames:unix:`` target
        the TLS settings are not used (the socket's directory guards it, and the traffic
        never leaves the host), as Docker's client ignores its TLS settings on a socket,
        so TLS settings from the environment do not stand in the way of the sidecar's
        socket.

        Raises:
            TlsError: inconsistent TLS settings; TlsFileError: a TLS file cannot be read.
        """
        if is_frames_target(target):
            return FrameChannel(**self._frames_channel_args(target))
        return open_channel(target, self.tls(), self._grpc_options())

    def aio_channel(self, target: str) -> grpc.aio.Channel:
        """The asyncio counterpart of :meth:`channel`."""
        if is_frames_target(target):
            return AioFrameChannel(**self._frames_channel_args(target))
        return open_aio_channel(target, self.tls(), self._grpc_options())

    def _frames_channel_args(self, target: str) -> dict[str, Any]:
        """A framed channel's arguments for a ``frames:`` target: TLS for TCP only."""
        address = frames_address(target)
        tls = self.tls()  # checked either way: inconsistent settings are an error
        if is_unix_address(address):
            tls = None
        return {
            "address": address,
            "ssl_context": tls.ssl_context() if tls is not None else None,
            "server_name": tls.server_name if tls is not None else None,
            "max_reply_bytes": MAX_MESSAGE_BYTES,
        }

    def delay(self, attempt: int) -> float:
        base = min(self.max_backoff, self.backoff * (2**attempt))
        return base * (0.5 + random.random() / 2)

    def retry_delay(
        self,
        code: grpc.StatusCode,
        attempt: int,
        retry: bool,
        codes: frozenset[grpc.StatusCode],
        patience: float,
    ) -> float | None:
        """Seconds to wait before attempt ``attempt + 1`` of a call that failed with
        ``code``, or None to give up: with ``retry``, up to ``retries`` more after a status
        in ``codes``, and more while the server answers UNAVAILABLE until the monotonic
        time ``patience`` (a restart). The sync and asyncio clients share this rule."""
        if not retry or code not in codes:
            return None
        if attempt < 1 + self.retries or (
            code == grpc.StatusCode.UNAVAILABLE and time.monotonic() < patience
        ):
            return self.delay(min(attempt - 1, 16))
        return None


ROLES = ("engine", "agent", "admin", "indexer")


def read_token_file(path: str) -> str:
    """The token in ``path``: its first line that is neither blank nor a ``#`` comment."""
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                token = line.strip()
                if token and not token.startswith("#"):
                    return token
    except OSError as exc:
        raise ValueError(f"token file {path}: {exc.strerror}") from None
    raise ValueError(f"token file {path} holds no token")


def resolve_token(
    role: str,
    token: str | None = None,
    token_file: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> str | None:
    """The bearer token a client of ``role`` sends, None for none.

    In order: ``token`` (an empty string means "send none"), ``token_file``, then the
    environment: ``KVSVC_<ROLE>_TOKEN``, ``KVSVC_<ROLE>_TOKEN_FILE``, ``KVSVC_AUTH_TOKEN``,
    ``KVSVC_AUTH_TOKEN_FILE``. Secrets belong in files or the environment, not in argv.

    Raises:
        ValueError: an unknown role, or a token file that cannot be read or is empty.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if token is not None:
        return token or None
    if token_file:
        return read_token_file(token_file)
    for prefix in (f"KVSVC_{role.upper()}", "KVSVC_AUTH"):
        value = environ.get(f"{prefix}_TOKEN")
        if value:
            return value
        path = environ.get(f"{prefix}_TOKEN_FILE")
        if path:
            return read_token_file(path)
    return None
