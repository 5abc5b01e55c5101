"""The framed listener: the server side of the framed transport, the same servicers'
unary methods called without gRPC (the wire: :mod:`kvsvc.wire.frames`; the client side:
:mod:`kvsvc_client._frames`).

Each connection is served by one task, one call after another: read a frame, check the
caller's credential for the method (by :mod:`kvsvc.server.transports.auth`, the gRPC
listener's rule), decode the request, run the servicer's handler (the same coroutine
gRPC runs, with a small stand-in for gRPC's context), write the reply.
The handlers run on the server's event loop beside gRPC's, so the pool's one-writer rule
(a write runs whole between two awaits) holds across both transports.

What a client can hit (each answered with an error frame that names it, then the
connection is closed without reading further): a header over
:data:`~kvsvc.wire.frames.MAX_HEADER_BYTES`, a body over ``max_message_bytes``, bytes
that are not the protocol, an unknown or streaming method, a call its credential may not
make. A deadline is the client's: a handler, once started, runs to its end (an engine
call is journaled whole or not at all), as a gRPC handler whose caller went away mostly
does too.

Who holds a connection, and for how long (:class:`FrameLimits`): a connection that has not
said hello yet is *pending*; at most ``max_pending`` are, each for ``hello_timeout_s``, and
a new one past the cap pushes out the oldest (a real client says hello within a round trip,
so a crowd of silent connections cannot keep it out). When the server has tokens, a hello
without a known one is answered UNAUTHENTICATED and the connection closed: only a
credential holder gets one of the ``max_connections`` slots (RESOURCE_EXHAUSTED in the
hello's answer past it), and only one of a role the framed methods take (an engine's or an
operator's: an agent's token is answered PERMISSION_DENIED at the hello). A slot is held
while the connection is used: one that sends nothing for ``idle_timeout_s`` between frames,
leaves a frame half sent for ``frame_timeout_s``, or leaves its replies unread that long
once they pass the socket's buffers and ``_WRITE_HIGH_WATER`` (a client that pipelines
calls and never reads), is closed (a call in progress has no bound: it runs to its end).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from kvsvc.errors import quoted
from kvsvc.ports import (
    DEFAULT_UNIX_SOCKET_MODE,
    ListenError,
    is_unix_address,
    private_umask,
    set_unix_socket_mode,
    unix_path,
)
from kvsvc.server.config import join_host_port, split_host_port
from kvsvc.server.errors import CallObserver
from kvsvc.server.namespace import current_engine, current_pools
from kvsvc.server.reply_early import early_reply
from kvsvc.server.request_caps import SMALL_REQUEST_BYTES, RequestCaps
from kvsvc.server.seclog import RateLimitedLog
from kvsvc.server.transports.auth import (
    Credential,
    Credentials,
    Refusal,
    Role,
    decide,
    peer_host,
    report_refusal,
    roles_for_method,
)
from kvsvc.server.transports.budget import RequestBudget
from kvsvc.server.transports.codecs import request_parser
from kvsvc.wire.frames import (
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX,
    VERSION,
    FrameHeader,
    frame,
    reply_header,
)

log = logging.getLogger("kvsvc.server")

# What a ListenError tells the user to change (``kvsvc serve``'s flag, the config key).
FRAMES_LISTEN_FLAG = "--frames-listen (config key frames_listen)"

DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_PENDING = 64
DEFAULT_HELLO_TIMEOUT_S = 5.0
DEFAULT_IDLE_TIMEOUT_S = 300.0
DEFAULT_FRAME_TIMEOUT_S = 30.0
# Past this much unsent reply data a connection waits for its client to read.
_WRITE_HIGH_WATER = 1 << 20
# Reply headers by (code, trailing metadata): the success header of a pool's calls is the
# same bytes for every call while its epoch stays.
_HEADER_CACHE_LIMIT = 256

Handler = Callable[[Any, Any], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class FrameMethod:
    """One unary method as the framed listener serves it."""

    path: str  # "/kvsvc.v1.KVCacheService/Allocate"
    handler: Handler  # the servicer's bound coroutine (request, context) -> response
    parse: Callable[[bytes], Any]  # the request message's FromString, or its raw codec
    roles: frozenset[Role] | None  # who may call it (None: anyone)


def unary_methods(service: Any, servicer: Any) -> list[FrameMethod]:
    """The unary methods of ``service`` (a ServiceDescriptor) served by ``servicer``;
    streaming ones are left to gRPC."""
    methods = []
    for method in service.methods:
        if method.client_streaming or method.server_streaming:
            continue
        path = f"/{service.full_name}/{method.name}"
        methods.append(
            FrameMethod(
                path=path,
                handler=getattr(servicer, method.name),
                parse=request_parser(path, GetMessageClass(method.input_type).FromString),
                roles=roles_for_method(path),
            )
        )
    return methods


@dataclass(frozen=True, slots=True)
class FrameLimits:
    """How many connections the framed listeners hold, and for how long (see the module's
    docstring; the server's config keys are ``frames_max_connections``,
    ``frames_max_pending_connections`` and ``frames_<name>`` for the timeouts)."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS  # past the hello
    max_pending: int = DEFAULT_MAX_PENDING  # not past the hello yet
    hello_timeout_s: float = DEFAULT_HELLO_TIMEOUT_S  # connect (TLS included) to the hello
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S  # between frames (0: no bound)
    frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S  # a frame's first byte to its last


# What a connection is waiting for (the sweep's bound depends on it).
_HELLO, _IDLE, _FRAME, _CALL, _REPLY, _BUDGET = range(6)
_WAITING_FOR = {
    _HELLO: "the hello",
    _IDLE: "a frame (idle)",
    _FRAME: "the rest of a frame",
    _REPLY: "its client to read its replies",
}


class _Conn:
    """One open connection, as the sweep and the caps see it."""

    __slots__ = ("allowed", "authenticated", "phase", "since", "task")

    def __init__(self, task: asyncio.Task[None], now: float) -> None:
        self.task = task
        self.phase = _HELLO
        self.since = now  # loop time the current phase began
        self.authenticated = False
        # The calls it was allowed, by their header's bytes: an engine sends the same few
        # small headers on every call, so each is parsed and decided once (the credential
        # is the connection's; a refusal closes it, so none is kept). At most
        # _ALLOWED_HEADERS_KEPT of at most _ALLOWED_HEADER_BYTES each: a client sending
        # ever new or large headers holds no more than that.
        self.allowed: dict[bytes, tuple[FrameMethod, str, frozenset[str] | None]] = {}


@dataclass(frozen=True, slots=True)
class _PeerAuth:
    """A connection's credential, looked up once from its hello."""

    credential: Credential | None
    header_given: bool


class FrameCallContext:
    """What a servicer's handler uses of gRPC's ``ServicerContext``, for one framed call."""

    __slots__ = ("_code", "_details", "_ok_header", "_peer", "_writer", "replied", "trailing")

    def __init__(
        self,
        peer: str,
        writer: asyncio.StreamWriter,
        ok_header: Callable[[tuple[tuple[str, str], ...]], bytes],
    ) -> None:
        self._peer = peer
        self._writer = writer
        self._ok_header = ok_header
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.trailing: tuple[tuple[str, str], ...] = ()
        # Whether the OK reply went out already (reply_now): the handler's outcome is then
        # not written again, whatever it is.
        self.replied = False

    def reply_now(self, response: Any) -> bytes:
        """Write ``response`` as the call's OK reply now (with the trailing metadata set so
        far); returns its serialized message. See :mod:`kvsvc.server.reply_early`."""
        body: bytes = response.SerializeToString()
        self._writer.write(frame(self._ok_header(self.trailing), body))
        self.replied = True
        return body

    def set_trailing_metadata(self, metadata: Iterable[tuple[str, str]]) -> None:
        self.trailing = tuple(metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        self._code = code
        self._details = details
        raise grpc.aio.AbortError()

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def peer(self) -> str:
        return self._peer


class _Closing(Exception):
    """A frame the connection cannot go on after: answer it, then close."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class FrameServer:
    """The framed listeners of one server (any number of ``unix:PATH`` and TCP ones)."""

    def __init__(
        self,
        methods: Iterable[FrameMethod],
        credentials: Credentials,
        observer: CallObserver,
        *,
        max_message_bytes: int,
        limits: FrameLimits | None = None,
        ssl_context: Callable[[], ssl.SSLContext] | None = None,
        unix_socket_mode: int = DEFAULT_UNIX_SOCKET_MODE,
        budget: RequestBudget | None = None,
        caps: RequestCaps | None = None,
    ) -> None:
        """``ssl_context``: the server's current TLS context (re-read on each handshake,
        so a renewed certificate is used from the next connection on); TCP listeners serve
        TLS with it. Unix sockets are plaintext: their file mode, ``unix_socket_mode``
        (whatever the umask), guards them. ``budget``: the server's request budget,
        shared with the gRPC listener (by default one of its own, of 4 x
        ``max_message_bytes``): a frame's bytes are reserved there before they are read.
        ``caps``: each method's request bound (a body over it is refused unread)."""
        self._methods = {m.path: m for m in methods}
        self._credentials = credentials
        self._observer = observer
        self._max_message_bytes = max_message_bytes
        self._limits = limits or FrameLimits()
        self._ssl_context = ssl_context
        self._unix_socket_mode = unix_socket_mode
        self._budget = budget or RequestBudget(4 * max_message_bytes, max_message_bytes)
        self._caps = caps
        self._servers: list[asyncio.AbstractServer] = []
        # Every open connection; the pending ones (no hello yet), oldest first.
        self._connections: dict[asyncio.Task[None], _Conn] = {}
        self._pending: dict[asyncio.Task[None], _Conn] = {}
        self._num_authenticated = 0
        self._sweeper: asyncio.Task[None] | None = None
        self._closing = False
        self._log = RateLimitedLog()
        self._headers: dict[tuple[int, tuple[tuple[str, str], ...]], bytes] = {}
        self.port = 0  # the first TCP listener's port
        self.unix_sockets: list[str] = []

    async def listen(self, address: str, host: str = "", port: int = 0) -> int:
        """Start listening on ``address`` (``unix:PATH``, or TCP at ``host``/``port``);
        returns the TCP port bound (0 for a socket)."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        if address.startswith("unix:"):
            path = unix_path(address)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # stale: the caller checked that nothing listens on it
            # Bound, given its mode, then listened on: no connection comes in before the
            # file has its mode.
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                with private_umask():
                    sock.bind(path)
                set_unix_socket_mode(address, self._unix_socket_mode)
                server = await asyncio.start_unix_server(self._serve, sock=sock)
            except BaseException:
                sock.close()
                raise
            self._servers.append(server)
            self.unix_sockets.append(address)
            return 0
        context = self._tls_for_listener() if self._ssl_context is not None else None
        server = await asyncio.start_server(
            self._serve,
            host=host or None,
            port=port,
            ssl=context,
            ssl_handshake_timeout=self._limits.hello_timeout_s if context is not None else None,
            reuse_address=True,
        )
        self._servers.append(server)
        bound = int(server.sockets[0].getsockname()[1])
        if not self.port:
            self.port = bound
        return bound

    def _tls_for_listener(self) -> ssl.SSLContext:
        """A context whose handshakes each switch to the server's current one (a renewed
        certificate is picked up without a restart, as the gRPC listener does)."""
        assert self._ssl_context is not None
        current = self._ssl_context
        base = current()

        def pick(sock: ssl.SSLObject, name: str | None, _: ssl.SSLContext) -> None:
            sock.context = current()

        base.sni_callback = pick  # type: ignore[assignment]
        return base

    async def stop(self, grace: float) -> None:
        """Stop accepting; let calls in progress finish (up to ``grace`` s), then close
        every connection."""
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for server in self._servers:
            server.close()
        for task, conn in list(self._connections.items()):
            if conn.phase != _CALL:
                task.cancel()
        pending = list(self._connections)
        if pending:
            _, late = await asyncio.wait(pending, timeout=grace)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._servers = []
        # As gRPC's listener does (asyncio leaves the file before Python 3.13).
        for address in self.unix_sockets:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(unix_path(address))
        self.unix_sockets = []

    # ------------------------------------------------------------------ connections

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peer = _peer_name(writer)
        if self._closing:
            writer.close()
            return
        conn = _Conn(task, asyncio.get_running_loop().time())
        self._connections[task] = conn
        self._admit_pending(conn, peer)
        try:
            await self._connection(conn, reader, writer, peer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, TimeoutError):
            pass  # the client went away (or never spoke the protocol): nothing to answer
        except asyncio.CancelledError:
            pass  # the server is stopping, or the sweep (or the pending cap) closed it
        except Exception:  # a bug: say so, with the traceback; the connection goes
            log.exception("frames: the connection from %s failed", peer)
        finally:
            self._connections.pop(task, None)
            self._pending.pop(task, None)
            if conn.authenticated:
                self._num_authenticated -= 1
            if writer.transport.get_write_buffer_size():
                # Replies its client never read (the sweep cut it): a plain close would
                # wait for them to be read, holding the socket, for ever.
                writer.transport.abort()
            else:
                writer.close()

    def _admit_pending(self, conn: _Conn, peer: str) -> None:
        """Count a new connection as pending; past ``max_pending`` the oldest pending one
        is closed (it has had the longest to say hello)."""
        pending = self._pending
        if len(pending) >= self._limits.max_pending:
            oldest = next(iter(pending.values()))
            del pending[oldest.task]
            oldest.task.cancel()
            self._log.warning(
                f"pending:{peer_host(peer)}",
                "frames: %d connections had not said hello (frames_max_pending_connections); "
                "closed the oldest to admit one from %s",
                self._limits.max_pending,
                peer_host(peer),
            )
        pending[conn.task] = conn

    async def _sweep(self) -> None:
        """Close the connections that waited past their phase's bound: for the hello, for
        the next frame (idle), for the rest of a frame, for their client to read the
        replies it has not read (it pipelines calls and never reads: the replies would
        pile up, and the connection keep its slot, for ever). A call in progress is never
        cut."""
        limits = self._limits
        bounds = {
            _HELLO: limits.hello_timeout_s,
            _IDLE: limits.idle_timeout_s,
            _FRAME: limits.frame_timeout_s,
            _REPLY: limits.frame_timeout_s,
        }
        shortest = min(b for b in bounds.values() if b > 0)
        interval = min(1.0, max(0.01, shortest / 4))
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            for conn in list(self._connections.values()):
                bound = bounds.get(conn.phase, 0.0)
                if bound > 0 and now - conn.since > bound and not conn.task.done():
                    log.debug(
                        "frames: closed a connection that waited %.3g s for %s",
                        bound,
                        _WAITING_FOR[conn.phase],
                    )
                    conn.task.cancel()

    async def _connection(
        self,
        conn: _Conn,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str,
    ) -> None:
        credential = await self._hello(conn, reader, writer, peer)
        if credential is None:
            return
        # Whose reads its large frames count with: its token's on its host (without
        # tokens, its host's), the same caller as that client's gRPC calls, so one client
        # reads one large request at a time whichever transport it sends it on.
        caller: Hashable = (credential.credential, peer_host(peer))
        allowed = conn.allowed
        budget = self._budget
        methods = self._methods
        read = reader.readexactly
        unpack = PREFIX.unpack
        clock = asyncio.get_running_loop().time
        max_body = self._max_message_bytes
        while True:
            # The sweep closes a connection that stays in a phase too long (idle between
            # frames, a frame half sent): setting the phase is all it costs a frame.
            conn.phase = _IDLE
            conn.since = clock()
            header_size, body_size = unpack(await read(PREFIX.size))
            conn.phase = _FRAME
            conn.since = clock()
            reserved = held = 0
            try:
                if header_size > MAX_HEADER_BYTES:
                    raise _Closing(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"a frame header of {header_size} bytes is over the bound of "
                        f"{MAX_HEADER_BYTES}",
                    )
                # The frame's bytes are reserved before any is read (a body past
                # max_message_bytes is refused below, unread, so it reserves only that).
                # A small frame (an engine's Step, Lookup, Free) is read at once: each
                # connection reads one at a time, so they are bounded by the connections,
                # and large frames (of a client that sends all but their last byte) never
                # hold up the engines' small ones.
                wanted = min(header_size + min(body_size, max_body), budget.per_caller)
                if wanted > SMALL_REQUEST_BYTES:
                    # One gRPC read's worth (its size unknown) is left to gRPC.
                    leave = min(budget.per_caller, budget.total - budget.per_caller)
                    if not budget.try_reserve(caller, wanted, leave):
                        conn.phase = _BUDGET  # its bytes wait in the socket, unread
                        await budget.reserve(caller, wanted, leave)
                        conn.phase = _FRAME
                        conn.since = clock()  # the frame's time starts when it may be read
                    reserved = wanted
                header_bytes = await read(header_size)
                decided = allowed.get(header_bytes)
                if decided is None:
                    header = _parse_header(header_bytes)
                    method = methods.get(header.method)
                    if method is None:
                        raise _Closing(
                            grpc.StatusCode.UNIMPLEMENTED, _unknown_method(header.method)
                        )
                    engine, pools = self._check_call(credential, method, peer)
                    if (
                        len(allowed) < _ALLOWED_HEADERS_KEPT
                        and header_size <= _ALLOWED_HEADER_BYTES
                    ):
                        allowed[header_bytes] = (method, engine, pools)
                else:
                    method, engine, pools = decided
                if body_size > max_body:
                    raise _Closing(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"a request message of {body_size} bytes is over the server's "
                        f"max_message_bytes ({max_body})",
                    )
                if body_size > SMALL_REQUEST_BYTES and self._caps is not None:
                    cap = self._caps(method.path)
                    if body_size > cap:
                        raise _Closing(
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            self._caps.refusal(method.path, body_size, cap),
                        )
                body = await read(body_size)
                if reserved:
                    taken = budget.received(caller, reserved, body_size)
                    reserved = 0
                    if not taken:
                        details = _held_details(budget, body_size)
                        writer.write(frame(reply_header(_number(_EXHAUSTED), details)))
                        continue
                    held = body_size
                conn.phase = _CALL
                reply = await self._call(method, body, engine, pools, peer, writer)
                del body
                budget.release(caller, held)
                held = 0
                if reply is not None:
                    writer.write(reply)
            except _Closing as exc:
                writer.write(frame(reply_header(_number(exc.code), exc.details, close=True)))
                await _drain(conn, writer, clock())
                return
            finally:
                if reserved:
                    budget.cancel(caller, reserved)
                if held:
                    budget.release(caller, held)
            if self._closing:
                return
            if writer.transport.get_write_buffer_size() > _WRITE_HIGH_WATER:
                await _drain(conn, writer, clock())

    async def _hello(
        self,
        conn: _Conn,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str,
    ) -> _PeerAuth | None:
        """Read the magic and the hello; answer it. Returns what the connection's calls
        are authorized by, or None when it is refused (the answer says why)."""
        magic = await reader.readexactly(len(MAGIC))
        if magic != MAGIC:
            what = "a gRPC (HTTP/2) client" if magic.startswith(b"PRI * ") else "another protocol"
            # Keyed by host: every connection has a port of its own, and a flood of them
            # must not write a line each.
            host = peer_host(peer)
            self._log.warning(f"magic:{host}", "frames: %s connected from %s; closed", what, host)
            return None
        header_size, body_size = PREFIX.unpack(await reader.readexactly(PREFIX.size))
        try:
            if header_size > MAX_HEADER_BYTES or body_size:
                raise _Closing(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"a hello has no body and a header of at most {MAX_HEADER_BYTES} bytes",
                )
            hello = _parse_header(await reader.readexactly(header_size))
            self._pending.pop(conn.task, None)
            conn.phase = _CALL  # answering the hello: no bound until a frame is awaited
            if hello.version != VERSION:
                raise _Closing(
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"frames protocol version {hello.version} is not served (this server "
                    f"speaks version {VERSION})",
                )
            header = next((m.value for m in hello.metadata if m.key == "authorization"), None)
            found = self._credentials.lookup(header) if header is not None else None
            if self._credentials.enabled:
                # A connection none of whose calls could be allowed gets no slot: no known
                # token, or one of a role the framed methods do not take (an agent's).
                decision = decide(found, header is not None, _HELLO_PATH, _FRAMED_ROLES)
                if isinstance(decision, Refusal):
                    report_refusal(self._log, self._observer, _HELLO_PATH, decision, peer)
                    raise _Closing(
                        decision.code, decision.reason + _HELLO_NOTES.get(decision.code, "")
                    )
            if self._num_authenticated >= self._limits.max_connections:
                raise _Closing(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the server has {self._limits.max_connections} framed connections open, "
                    "its bound (frames_max_connections); close idle ones or raise it",
                )
        except _Closing as exc:
            writer.write(
                frame(reply_header(_number(exc.code), exc.details, close=True, version=VERSION))
            )
            await _drain(conn, writer, asyncio.get_running_loop().time())
            return None
        conn.authenticated = True
        self._num_authenticated += 1
        writer.write(frame(reply_header(0, version=VERSION)))
        return _PeerAuth(found, header is not None)

    def _check_call(
        self, peer_auth: _PeerAuth, method: FrameMethod, peer: str
    ) -> tuple[str, frozenset[str] | None]:
        """The engine namespace the call runs in and the pools it may use (None: every
        one); raises _Closing when it is refused."""
        allowed = method.roles
        if allowed is None or not self._credentials.enabled:
            return "", None
        decision = decide(peer_auth.credential, peer_auth.header_given, method.path, allowed)
        if isinstance(decision, Refusal):
            report_refusal(self._log, self._observer, method.path, decision, peer)
            raise _Closing(decision.code, decision.reason)
        if Role.ENGINE not in allowed:
            return "", None
        return decision.engine, decision.pools

    async def _call(
        self,
        method: FrameMethod,
        body: bytes,
        engine: str,
        pools: frozenset[str] | None,
        peer: str,
        writer: asyncio.StreamWriter,
    ) -> bytes | None:
        """Run one call; the reply frame's bytes (None: the handler wrote the reply
        already, :meth:`FrameCallContext.reply_now`)."""
        try:
            request = method.parse(body)
        except DecodeError as exc:
            return frame(
                reply_header(
                    _number(grpc.StatusCode.INVALID_ARGUMENT),
                    f"the request message does not parse as the method's request: {exc}",
                )
            )
        context = FrameCallContext(peer, writer, self._ok_header)
        current_engine.set(engine)
        current_pools.set(pools)
        early_reply.set(context.reply_now)
        try:
            response = await method.handler(request, context)
        except grpc.aio.AbortError:
            if context.replied:  # a fault after the reply went out: logged, not sent
                return None
            code = context.code() or grpc.StatusCode.UNKNOWN
            return frame(reply_header(_number(code), context.details(), context.trailing))
        if context.replied:
            return None
        return frame(self._ok_header(context.trailing), response.SerializeToString())

    def _ok_header(self, trailing: tuple[tuple[str, str], ...]) -> bytes:
        key = (0, trailing)
        header = self._headers.get(key)
        if header is None:
            if len(self._headers) >= _HEADER_CACHE_LIMIT:
                self._headers.clear()
            header = self._headers[key] = reply_header(0, metadata=trailing)
        return header


async def bind_frames_addresses(frames: FrameServer, addresses: Iterable[str]) -> list[str]:
    """Start ``frames`` listening on ``addresses`` (``HOST:PORT`` or ``unix:PATH``); the
    addresses as bound (a TCP port 0 resolved).

    Raises:
        ListenError: an address cannot be bound (taken since it was checked).
    """
    bound_addresses: list[str] = []
    for address in addresses:
        if is_unix_address(address):
            await frames.listen(address)
            bound_addresses.append(address)
            continue
        host, port = split_host_port(address, "frames_listen")
        try:
            bound = await frames.listen(address, host, port)
        except OSError as exc:
            raise ListenError(address, "frames", FRAMES_LISTEN_FLAG, exc) from None
        bound_addresses.append(join_host_port(host, bound))
    return bound_addresses


# The call headers a connection keeps its decisions by (see _Conn.allowed): its methods'
# few, each a method's path (~40 bytes; a header may be up to MAX_HEADER_BYTES). Past
# either bound a call is decided afresh: 1,024 connections hold about 10 MiB of them.
_ALLOWED_HEADERS_KEPT = 32
_ALLOWED_HEADER_BYTES = 256

# How a refused hello is named on the security log, and the roles a framed connection
# may hold (those of the services it serves: KVCache's and Admin's unary methods).
_HELLO_PATH = "/kvsvc.frames/Hello"
_FRAMED_ROLES = frozenset({Role.ENGINE, Role.ADMIN})
_HELLO_NOTES = {
    grpc.StatusCode.PERMISSION_DENIED: (
        " (the framed transport serves the unary calls of the KVCache and Admin services; "
        "agents and indexers call the server over gRPC)"
    )
}


async def _drain(conn: _Conn, writer: asyncio.StreamWriter, now: float) -> None:
    """Wait until the client has read enough of the replies written: the sweep closes the
    connection when that takes past ``frame_timeout_s``."""
    conn.phase = _REPLY
    conn.since = now
    with contextlib.suppress(ConnectionError):
        await writer.drain()


_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _held_details(budget: RequestBudget, size: int) -> str:
    return (
        f"the server holds {budget.held} bytes of requests in flight; this one's {size} "
        f"would pass its bound (max_inflight_request_bytes={budget.total}); retry, or "
        "raise it"
    )


def _number(code: grpc.StatusCode) -> int:
    return int(code.value[0])


def _parse_header(data: bytes) -> FrameHeader:
    try:
        return FrameHeader.FromString(data)
    except DecodeError:
        raise _Closing(
            grpc.StatusCode.INVALID_ARGUMENT, "a frame header does not parse as a FrameHeader"
        ) from None


def _unknown_method(path: str) -> str:
    if not path:
        return "a call frame names no method"
    return (
        f"method {quoted(path)} is not served over frames (the unary methods of "
        "kvsvc.v1.KVCacheService and kvsvc.v1.AdminService are; streaming methods and the "
        "Worker service are served over gRPC)"
    )


def _peer_name(writer: asyncio.StreamWriter) -> str:
    """gRPC's form of a peer: ``ipv4:HOST:PORT``, ``ipv6:[HOST]:PORT``, ``unix:PATH``."""
    name = writer.get_extra_info("peername")
    if isinstance(name, tuple) and len(name) >= 2:
        host, port = name[0], name[1]
        return f"ipv6:[{host}]:{port}" if ":" in str(host) else f"ipv4:{host}:{port}"
    sockname = writer.get_extra_info("sockname")
    return f"unix:{sockname}" if sockname else "unix:"
