"""The server side of the framed transport: the same servicers, called without gRPC.

Each connection is served by one task, one call after another: read a frame, check the
caller's credential for the method, decode the request, run the servicer's handler (the
same coroutine gRPC runs, with a small stand-in for gRPC's context), write the reply.
The handlers run on the server's event loop beside gRPC's, so the pool's one-writer rule
(a write runs whole between two awaits) holds across both transports.

What a client can hit (each answered with an error frame that names it, then the
connection is closed without reading further): a header over
:data:`~kvsvc.frames.protocol.MAX_HEADER_BYTES`, a body over ``max_message_bytes``, bytes
that are not the protocol, an unknown or streaming method, a call its credential may not
make. A connection must say hello within :data:`HELLO_TIMEOUT_S`; at most
``max_connections`` are open at once (RESOURCE_EXHAUSTED in the hello's answer past it).
A deadline is the client's: a handler, once started, runs to its end (an engine call is
journaled whole or not at all), as a gRPC handler whose caller went away mostly does too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from kvsvc.errors import quoted
from kvsvc.frames.protocol import (
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX,
    VERSION,
    FrameHeader,
    frame,
    reply_header,
)
from kvsvc.ports import unix_path
from kvsvc.server.auth import (
    Credential,
    Credentials,
    Refusal,
    Role,
    decide,
    report_refusal,
    roles_for_method,
)
from kvsvc.server.errors import CallObserver
from kvsvc.server.namespace import current_engine
from kvsvc.server.seclog import RateLimitedLog

log = logging.getLogger("kvsvc.server")

# A connection that has not said hello by then is closed (it holds a slot meanwhile).
HELLO_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 1024
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
    parse: Callable[[bytes], Any]  # the request message's FromString
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
                parse=GetMessageClass(method.input_type).FromString,
                roles=roles_for_method(path),
            )
        )
    return methods


@dataclass(frozen=True, slots=True)
class _PeerAuth:
    """A connection's credential, looked up once from its hello."""

    credential: Credential | None
    header_given: bool


class FrameCallContext:
    """What a servicer's handler uses of gRPC's ``ServicerContext``, for one framed call."""

    __slots__ = ("_code", "_details", "_peer", "trailing")

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.trailing: tuple[tuple[str, str], ...] = ()

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
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        ssl_context: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        """``ssl_context``: the server's current TLS context (re-read on each handshake,
        so a renewed certificate is used from the next connection on); TCP listeners serve
        TLS with it. Unix sockets are plaintext (their file mode guards them)."""
        self._methods = {m.path: m for m in methods}
        self._credentials = credentials
        self._observer = observer
        self._max_message_bytes = max_message_bytes
        self._max_connections = max_connections
        self._ssl_context = ssl_context
        self._servers: list[asyncio.AbstractServer] = []
        self._connections: dict[asyncio.Task[None], bool] = {}  # task -> in a call
        self._closing = False
        self._log = RateLimitedLog()
        self._headers: dict[tuple[int, tuple[tuple[str, str], ...]], bytes] = {}
        self.port = 0  # the first TCP listener's port
        self.unix_sockets: list[str] = []

    async def listen(self, address: str, host: str = "", port: int = 0) -> int:
        """Start listening on ``address`` (``unix:PATH``, or TCP at ``host``/``port``);
        returns the TCP port bound (0 for a socket)."""
        if address.startswith("unix:"):
            path = unix_path(address)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # stale: the caller checked that nothing listens on it
            server = await asyncio.start_unix_server(self._serve, path=path)
            self._servers.append(server)
            self.unix_sockets.append(address)
            return 0
        context = self._tls_for_listener() if self._ssl_context is not None else None
        server = await asyncio.start_server(
            self._serve,
            host=host or None,
            port=port,
            ssl=context,
            ssl_handshake_timeout=HELLO_TIMEOUT_S if context is not None else None,
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
        for server in self._servers:
            server.close()
        for task, busy in list(self._connections.items()):
            if not busy:
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
        self._connections[task] = False
        try:
            await self._connection(task, reader, writer, peer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, TimeoutError):
            pass  # the client went away (or never spoke the protocol): nothing to answer
        except asyncio.CancelledError:
            pass  # the server is stopping
        except Exception:  # a bug: say so, with the traceback; the connection goes
            log.exception("frames: the connection from %s failed", peer)
        finally:
            self._connections.pop(task, None)
            writer.close()

    async def _connection(
        self,
        task: asyncio.Task[None],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str,
    ) -> None:
        credential = await asyncio.wait_for(self._hello(reader, writer, peer), HELLO_TIMEOUT_S)
        if credential is None:
            return
        methods = self._methods
        read = reader.readexactly
        unpack = PREFIX.unpack
        while True:
            header_size, body_size = unpack(await read(PREFIX.size))
            self._connections[task] = True
            try:
                if header_size > MAX_HEADER_BYTES:
                    raise _Closing(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"a frame header of {header_size} bytes is over the bound of "
                        f"{MAX_HEADER_BYTES}",
                    )
                header = _parse_header(await read(header_size))
                method = methods.get(header.method)
                if method is None:
                    raise _Closing(grpc.StatusCode.UNIMPLEMENTED, _unknown_method(header.method))
                engine = self._check_call(credential, method, peer)
                if body_size > self._max_message_bytes:
                    raise _Closing(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"a request message of {body_size} bytes is over the server's "
                        f"max_message_bytes ({self._max_message_bytes})",
                    )
                body = await read(body_size)
                writer.write(await self._call(method, body, engine, peer))
            except _Closing as exc:
                writer.write(frame(reply_header(_number(exc.code), exc.details, close=True)))
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
                return
            finally:
                self._connections[task] = False
            if self._closing:
                return
            transport = writer.transport
            if transport.get_write_buffer_size() > _WRITE_HIGH_WATER:
                await writer.drain()

    async def _hello(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str
    ) -> _PeerAuth | None:
        """Read the magic and the hello; answer it. Returns what the connection's calls
        are authorized by, or None when it is refused."""
        magic = await reader.readexactly(len(MAGIC))
        if magic != MAGIC:
            what = "a gRPC (HTTP/2) client" if magic.startswith(b"PRI * ") else "another protocol"
            self._log.warning(f"magic:{peer}", "frames: %s connected from %s; closed", what, peer)
            return None
        header_size, body_size = PREFIX.unpack(await reader.readexactly(PREFIX.size))
        try:
            if header_size > MAX_HEADER_BYTES or body_size:
                raise _Closing(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"a hello has no body and a header of at most {MAX_HEADER_BYTES} bytes",
                )
            hello = _parse_header(await reader.readexactly(header_size))
            if hello.version != VERSION:
                raise _Closing(
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"frames protocol version {hello.version} is not served (this server "
                    f"speaks version {VERSION})",
                )
            if len(self._connections) > self._max_connections:
                raise _Closing(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the server has {self._max_connections} framed connections open, its "
                    "bound (frames_max_connections); close idle ones or raise it",
                )
        except _Closing as exc:
            writer.write(
                frame(reply_header(_number(exc.code), exc.details, close=True, version=VERSION))
            )
            await writer.drain()
            return None
        header = next((m.value for m in hello.metadata if m.key == "authorization"), None)
        writer.write(frame(reply_header(0, version=VERSION)))
        found = self._credentials.lookup(header) if header is not None else None
        return _PeerAuth(found, header is not None)

    def _check_call(self, peer_auth: _PeerAuth, method: FrameMethod, peer: str) -> str:
        """The engine namespace the call runs in; raises _Closing when it is refused."""
        allowed = method.roles
        if allowed is None or not self._credentials.enabled:
            return ""
        decision = decide(peer_auth.credential, peer_auth.header_given, method.path, allowed)
        if isinstance(decision, Refusal):
            report_refusal(self._log, self._observer, method.path, decision, peer)
            raise _Closing(decision.code, decision.reason)
        return decision.engine if Role.ENGINE in allowed else ""

    async def _call(self, method: FrameMethod, body: bytes, engine: str, peer: str) -> bytes:
        """Run one call; the reply frame's bytes."""
        try:
            request = method.parse(body)
        except DecodeError as exc:
            return frame(
                reply_header(
                    _number(grpc.StatusCode.INVALID_ARGUMENT),
                    f"the request message does not parse as the method's request: {exc}",
                )
            )
        context = FrameCallContext(peer)
        current_engine.set(engine)
        try:
            response = await method.handler(request, context)
        except grpc.aio.AbortError:
            code = context.code() or grpc.StatusCode.UNKNOWN
            return frame(reply_header(_number(code), context.details(), context.trailing))
        return frame(self._ok_header(context.trailing), response.SerializeToString())

    def _ok_header(self, trailing: tuple[tuple[str, str], ...]) -> bytes:
        key = (0, trailing)
        header = self._headers.get(key)
        if header is None:
            if len(self._headers) >= _HEADER_CACHE_LIMIT:
                self._headers.clear()
            header = self._headers[key] = reply_header(0, metadata=trailing)
        return header


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
