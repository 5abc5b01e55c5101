"""The client side of the framed transport: a ``grpc.Channel`` the generated stubs take.

``FrameChannel("unix:/run/kvsvc/kvsvc.sock")`` (or ``"HOST:PORT"``) answers
``unary_unary`` with a callable that has gRPC's ``__call__`` and ``with_call``: the reply's
trailing metadata is there, and a failure raises an ``RpcError`` with ``code()`` and
``details()``. So every client written against the stubs (kvsvc's own
:class:`kvsvc_client.KVCacheClient` among them) runs on it unchanged; kvsvc's clients pick
it for a target that starts with ``frames:``.

A call takes an idle connection of the channel (or opens one), sends its frame and reads
its reply on the calling thread: no thread hop and no event loop, which is most of what
the transport saves. Calls from several threads at once use several connections. A
deadline that passes closes the connection it was on (its reply would come out of
turn): UNAVAILABLE and DEADLINE_EXCEEDED are then the caller's to retry, as over gRPC.
Streaming methods raise UNIMPLEMENTED (they are served over gRPC).

:class:`AioFrameChannel` is the same for ``grpc.aio`` stubs (kvsvc's
:class:`kvsvc_client.AsyncKVCacheClient`): a call awaits its reply on the caller's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError

from kvsvc.ports import is_unix_address, unix_path
from kvsvc.wire.frames import (
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX,
    VERSION,
    FrameHeader,
    call_header,
    frame,
    hello_header,
)

_CODES = {code.value[0]: code for code in grpc.StatusCode}
DEFAULT_MAX_REPLY_BYTES = 64 * 1024 * 1024
# An idle connection unused this long is checked before it is reused: the server closes
# one idle past its frames_idle_timeout_s (minutes), and a call sent on it would fail.
_RECHECK_IDLE_S = 1.0
Metadata = tuple[tuple[str, str], ...]


class FrameRpcError(grpc.RpcError):
    """A framed call that failed: gRPC's status code and message (``code()``,
    ``details()``), as ``grpc.RpcError`` raised by a gRPC channel carries them."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Metadata = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._trailing = trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Metadata:
        return self._trailing

    def initial_metadata(self) -> Metadata:
        return ()


class FrameCallOutcome:
    """What ``with_call`` returns beside the response (gRPC's ``Call``, the parts kept)."""

    __slots__ = ("_trailing",)

    def __init__(self, trailing: Metadata) -> None:
        self._trailing = trailing

    def trailing_metadata(self) -> Metadata:
        return self._trailing

    def initial_metadata(self) -> Metadata:
        return ()

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK

    def details(self) -> str:
        return ""


class _Connection:
    """One socket, one call at a time."""

    def __init__(self, sock: socket.socket, max_reply_bytes: int) -> None:
        self.sock = sock
        self._buffer = bytearray()
        self._max_reply_bytes = max_reply_bytes
        self._timeout: float | None = -1.0
        self.idle_since = 0.0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def closed_by_server(self) -> bool:
        """Whether the server closed this idle connection: between calls it sends
        nothing, so anything to read (its EOF) means it is gone."""
        with contextlib.suppress(OSError, ValueError):
            return bool(select.select([self.sock], [], [], 0)[0])
        return True

    def exchange(self, data: bytes, deadline: float | None) -> tuple[FrameHeader, bytes]:
        """Send one frame, read the reply frame; socket errors propagate."""
        self.send(data, deadline)
        return self.read(deadline)

    def send(self, data: bytes, deadline: float | None) -> None:
        """Send one frame (its reply is read by :meth:`read`); socket errors propagate."""
        self._set_deadline(deadline)
        self.sock.sendall(data)

    def read(self, deadline: float | None) -> tuple[FrameHeader, bytes]:
        buffer = self._buffer
        while len(buffer) < PREFIX.size:
            self._fill(deadline)
        header_size, body_size = PREFIX.unpack_from(buffer)
        _check_reply_sizes(header_size, body_size, self._max_reply_bytes)
        end = PREFIX.size + header_size + body_size
        while len(buffer) < end:
            self._fill(deadline)
        view = memoryview(buffer)
        try:
            header = _parse_reply_header(view[PREFIX.size : PREFIX.size + header_size])
            body = bytes(view[PREFIX.size + header_size : end])
        finally:
            view.release()
        del buffer[:end]
        return header, body

    def _set_deadline(self, deadline: float | None) -> None:
        timeout = None if deadline is None else deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            # (A zero timeout would make the socket non-blocking: EAGAIN, not a deadline.)
            raise TimeoutError("the call's deadline passed")
        # A blocking socket reads without a poll() first; set a timeout only for a deadline.
        if timeout != self._timeout:
            self.sock.settimeout(timeout)
            self._timeout = timeout

    def _fill(self, deadline: float | None) -> None:
        if deadline is not None and self._timeout is not None:
            self._set_deadline(deadline)
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionResetError("the server closed the connection")
        self._buffer += chunk


class _ProtocolError(Exception):
    """The peer does not speak the framed protocol (or broke it)."""


# What both channels decide alike; each raises the failures as its own exception type
# (FrameRpcError, grpc.aio.AioRpcError), which is what the stubs' callers catch.
Failure = tuple[grpc.StatusCode, str]


def _check_reply_sizes(header_size: int, body_size: int, max_reply_bytes: int) -> None:
    if header_size > MAX_HEADER_BYTES or body_size > max_reply_bytes:
        raise _ProtocolError(
            f"a reply frame of {header_size} + {body_size} bytes is over the client's "
            f"bounds ({MAX_HEADER_BYTES} + {max_reply_bytes})"
        )


def _parse_reply_header(data: bytes | memoryview) -> FrameHeader:
    try:
        return FrameHeader.FromString(data)
    except DecodeError:
        raise _ProtocolError("a reply frame's header does not parse") from None


def _hello_frame(metadata: Metadata | None) -> bytes:
    """What a client sends first on a connection: the magic and its hello."""
    return MAGIC + frame(hello_header(metadata))


def _unreachable(address: str, exc: BaseException) -> Failure:
    """A connection that could not be made (or its TLS handshake failed)."""
    if isinstance(exc, ssl.SSLError):
        return grpc.StatusCode.UNAVAILABLE, (
            f"TLS handshake with {address} failed: {exc.reason or exc}"
        )
    reason = getattr(exc, "strerror", None) or str(exc) or "timed out"
    return grpc.StatusCode.UNAVAILABLE, f"failed to connect to {address}: {reason}"


def _no_hello(address: str, exc: BaseException) -> Failure:
    return grpc.StatusCode.UNAVAILABLE, (
        f"{address} did not answer the framed protocol's hello ({exc!r}); is it a kvsvc "
        "--frames-listen address?"
    )


def _hello_refused(address: str, reply: FrameHeader) -> Failure | None:
    """Why the server's answer to the hello ends the connection (None: it accepts it)."""
    if reply.code:
        return _CODES.get(reply.code, grpc.StatusCode.UNKNOWN), reply.details
    if reply.version != VERSION:
        return grpc.StatusCode.UNIMPLEMENTED, (
            f"{address} answered with frames protocol version {reply.version}"
        )
    return None


def _broken(address: str, exc: BaseException) -> Failure:
    return grpc.StatusCode.UNAVAILABLE, f"the connection to {address} failed: {exc!r}"


def _streaming_only(method: str) -> Failure:
    return grpc.StatusCode.UNIMPLEMENTED, (
        f"{method} is a streaming method, served over gRPC only: use the server's gRPC "
        "address (--listen) for it"
    )


DEADLINE_EXCEEDED: Failure = (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


@dataclass(frozen=True, slots=True)
class FrameAddress:
    """Where a framed server listens: a Unix socket's ``path``, or ``host`` and ``port``."""

    address: str  # as given: "unix:PATH" or "HOST:PORT"
    path: str = ""
    host: str = ""
    port: int = 0

    @classmethod
    def parse(cls, address: str, tls: bool = False) -> FrameAddress:
        """Raises ValueError naming the address when it is neither form (or TLS is asked
        for on a Unix socket, which the server serves in plaintext)."""
        if is_unix_address(address):
            path = unix_path(address)
            if not path:
                raise ValueError(f"frames target {address!r}: expected unix:PATH")
            if tls:
                raise ValueError(f"frames target {address!r}: TLS is for TCP targets only")
            return cls(address, path=path)
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"frames target {address!r}: expected HOST:PORT or unix:PATH")
        return cls(address, host=host.strip("[]"), port=int(port))


class _Unimplemented:
    """A streaming method on a framed channel: served over gRPC only."""

    def __init__(self, method: str) -> None:
        self._method = method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise FrameRpcError(*_streaming_only(self._method))

    with_call = __call__
    future = __call__


_Ch = TypeVar("_Ch")


class _UnaryMethod(Generic[_Ch]):
    """What a unary method on either channel keeps: its channel, call header and codecs."""

    def __init__(
        self,
        channel: _Ch,
        method: str,
        serialize: Callable[[Any], bytes] | None,
        deserialize: Callable[[bytes], Any] | None,
    ) -> None:
        self._channel = channel
        self._header = call_header(method)
        self._serialize = serialize or bytes
        self._deserialize: Callable[[bytes], Any] = deserialize or (lambda data: data)


class FrameUnaryMethod(_UnaryMethod["FrameChannel"]):
    """A unary method on a :class:`FrameChannel` (gRPC's ``UnaryUnaryMultiCallable``)."""

    def with_call(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
        **_: Any,
    ) -> tuple[Any, FrameCallOutcome]:
        body, trailing = self._channel.call(
            self._header,
            self._serialize(request),
            timeout,
            tuple(metadata) if metadata is not None else None,
        )
        return self._deserialize(body), FrameCallOutcome(trailing)

    def __call__(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
        **kwargs: Any,
    ) -> Any:
        return self.with_call(request, timeout, metadata, **kwargs)[0]

    def start(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> Callable[[], tuple[Any, FrameCallOutcome]]:
        """Send the call now; the returned function reads its reply (what ``with_call``
        returns) when called, blocking until it is in, and raises what ``with_call`` would.

        The call holds a connection of its own until its reply is read: a caller that
        sends the next call before reading this one's reply gets another connection, and
        the server may apply the two in either order.
        """
        finish = self._channel.start(
            self._header,
            self._serialize(request),
            timeout,
            tuple(metadata) if metadata is not None else None,
        )
        deserialize = self._deserialize

        def reply() -> tuple[Any, FrameCallOutcome]:
            body, trailing = finish()
            return deserialize(body), FrameCallOutcome(trailing)

        return reply

    def future(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a framed channel has no future(); call it from a thread")


class _PooledConnection(Protocol):
    """What the shared channel code does with a connection of either kind."""

    def close(self) -> None: ...


_C = TypeVar("_C", bound=_PooledConnection)
_M = TypeVar("_M", bound=_UnaryMethod[Any])


class _FramedChannel(Generic[_C, _M]):
    """What :class:`FrameChannel` and :class:`AioFrameChannel` do alike, written once: the
    options, the idle connections (kept by the hello's metadata, which a connection is
    bound to), what becomes of a connection and its reply once the exchange is done, and
    the channel methods that hand the stubs their callables. Connecting, taking an idle
    connection and the exchange itself block or await, so they stay in each."""

    # Raised for a failed call: FrameRpcError, or what a grpc.aio call raises.
    _error: Callable[[grpc.StatusCode, str, Metadata], Exception]
    # What unary_unary returns: the stubs' callable for one method.
    _unary_method: type[_M]
    # What a streaming method returns: it fails with UNIMPLEMENTED when used.
    _unimplemented: Callable[[str], Any]

    def __init__(
        self,
        address: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_name: str | None = None,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        connect_timeout: float = 10.0,
    ) -> None:
        self.address = address
        self._where = FrameAddress.parse(address, tls=ssl_context is not None)
        self._ssl = ssl_context
        self._server_name = server_name
        self._max_reply_bytes = max_reply_bytes
        self._connect_timeout = connect_timeout
        self._idle: dict[Metadata | None, list[_C]] = {}
        # Guards _idle and _closed for FrameChannel's calls from several threads; an
        # AioFrameChannel's calls all run on its loop's thread and do not take it.
        self._lock = threading.Lock()
        self._closed = False

    def _accepted(self, connection: _C, reply: FrameHeader) -> _C:
        """A new connection, once the server's answer to its hello accepts it; else it is
        closed and the refusal raised."""
        refused = _hello_refused(self.address, reply)
        if refused is not None:
            connection.close()
            raise self._error(*refused, ())
        return connection

    @abstractmethod
    def _give_back(self, metadata: Metadata | None, connection: _C) -> None:
        """Keep a connection whose call is done for the next call (or close it)."""

    def _settle(self, metadata: Metadata | None, connection: _C, header: FrameHeader) -> Metadata:
        """After a reply came: its connection back to the idle ones (closed where the
        server said it closes it), then the reply's trailing metadata, or the call's
        failure raised as this channel's error type. Every call ends here, so the metadata
        and the status are read inline rather than by further calls."""
        if header.close:
            connection.close()
        else:
            self._give_back(metadata, connection)
        trailing = tuple((m.key, m.value) for m in header.metadata) if header.metadata else ()
        if header.code:
            raise self._error(
                _CODES.get(header.code, grpc.StatusCode.UNKNOWN), header.details, trailing
            )
        return trailing

    def _close_idle(self, idle: dict[Metadata | None, list[_C]]) -> None:
        """Close the idle connections ``close()`` took from the channel."""
        for connections in idle.values():
            for connection in connections:
                connection.close()

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> _M:
        return self._unary_method(self, method, request_serializer, response_deserializer)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._unimplemented(method)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._unimplemented(method)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._unimplemented(method)


class FrameChannel(_FramedChannel[_Connection, FrameUnaryMethod], grpc.Channel):
    """A client channel over the framed transport to ``address`` (``unix:PATH`` or
    ``HOST:PORT``); TLS on TCP when ``ssl_context`` is given (see
    :meth:`kvsvc.tls.ClientTls.ssl_context`)."""

    _error = FrameRpcError
    _unary_method = FrameUnaryMethod
    _unimplemented = _Unimplemented

    def __repr__(self) -> str:
        return f"FrameChannel({self.address!r})"

    # ------------------------------------------------------------------ connections

    def _connect(self, metadata: Metadata | None, deadline: float | None) -> _Connection:
        timeout = self._connect_timeout
        if deadline is not None:
            timeout = min(timeout, max(0.001, deadline - time.monotonic()))
        try:
            where = self._where
            if where.path:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                try:
                    sock.connect(where.path)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((where.host, where.port), timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._ssl is not None:
                    sock = self._ssl.wrap_socket(
                        sock, server_hostname=self._server_name or where.host
                    )
        except OSError as exc:  # ssl.SSLError among them
            raise FrameRpcError(*_unreachable(self.address, exc)) from None
        connection = _Connection(sock, self._max_reply_bytes)
        try:
            reply, _ = connection.exchange(_hello_frame(metadata), time.monotonic() + timeout)
        except (OSError, _ProtocolError) as exc:
            connection.close()
            raise FrameRpcError(*_no_hello(self.address, exc)) from None
        return self._accepted(connection, reply)

    def _take(self, metadata: Metadata | None, deadline: float | None) -> _Connection:
        with self._lock:
            if self._closed:
                raise ValueError("Cannot invoke RPC on closed channel!")
            idle = self._idle.get(metadata)
            connection = idle.pop() if idle else None
        while connection is not None:
            if time.monotonic() - connection.idle_since < _RECHECK_IDLE_S or (
                not connection.closed_by_server()
            ):
                return connection
            connection.close()
            with self._lock:
                idle = self._idle.get(metadata)
                connection = idle.pop() if idle else None
        return self._connect(metadata, deadline)

    def _give_back(self, metadata: Metadata | None, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        with self._lock:
            if not self._closed:
                self._idle.setdefault(metadata, []).append(connection)
                return
        connection.close()

    def call(
        self,
        method_header: bytes,
        body: bytes,
        timeout: float | None,
        metadata: Metadata | None,
    ) -> tuple[bytes, Metadata]:
        """One call: the reply's body and trailing metadata, or FrameRpcError."""
        return self.start(method_header, body, timeout, metadata)()

    def start(
        self,
        method_header: bytes,
        body: bytes,
        timeout: float | None,
        metadata: Metadata | None,
    ) -> Callable[[], tuple[bytes, Metadata]]:
        """Send one call; the returned function reads its reply (body and trailing
        metadata) when called. Either raises FrameRpcError for a failed call."""
        deadline = None if timeout is None else time.monotonic() + timeout
        connection = self._take(metadata, deadline)
        try:
            connection.send(frame(method_header, body), deadline)
        except BaseException as exc:
            raise self._failed(connection, exc) from None

        def finish() -> tuple[bytes, Metadata]:
            try:
                header, reply = connection.read(deadline)
            except BaseException as exc:
                raise self._failed(connection, exc) from None
            return reply, self._settle(metadata, connection, header)

        return finish

    def _failed(self, connection: _Connection, exc: BaseException) -> BaseException:
        """What a failed exchange raises, its connection closed (a reply left on it would
        answer the next call): FrameRpcError for a deadline or a broken connection, else
        ``exc`` itself (an interruption mid-call)."""
        connection.close()
        if isinstance(exc, TimeoutError):
            return FrameRpcError(*DEADLINE_EXCEEDED)
        if isinstance(exc, (OSError, _ProtocolError)):
            return FrameRpcError(*_broken(self.address, exc))
        return exc

    # ------------------------------------------------------------------ grpc.Channel

    def subscribe(self, callback: Any, try_to_connect: bool = False) -> None:
        raise NotImplementedError("a framed channel has no connectivity states")

    def unsubscribe(self, callback: Any) -> None:
        raise NotImplementedError("a framed channel has no connectivity states")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        self._close_idle(idle)

    def __enter__(self) -> FrameChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- asyncio


class _AioConnection:
    """One asyncio stream, one call at a time."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_reply_bytes: int
    ) -> None:
        self.reader = reader
        self.writer = writer
        self._max_reply_bytes = max_reply_bytes

    def close(self) -> None:
        self.writer.close()

    def closed_by_server(self) -> bool:
        """Whether the server closed this idle connection (its EOF has arrived)."""
        return self.reader.at_eof() or self.writer.is_closing()

    async def exchange(self, data: bytes) -> tuple[FrameHeader, bytes]:
        self.writer.write(data)
        header_size, body_size = PREFIX.unpack(await self.reader.readexactly(PREFIX.size))
        _check_reply_sizes(header_size, body_size, self._max_reply_bytes)
        rest = await self.reader.readexactly(header_size + body_size)
        return _parse_reply_header(rest[:header_size]), rest[header_size:]


def _aio_error(code: grpc.StatusCode, details: str, trailing: Metadata = ()) -> Exception:
    """What a grpc.aio call raises, so asyncio clients catch one exception type."""
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details
    )


class _AioUnimplemented:
    """A streaming method on an asyncio framed channel: served over gRPC only."""

    def __init__(self, method: str) -> None:
        self._method = method

    def __call__(self, *args: Any, **kwargs: Any) -> _AioUnimplemented:
        return self

    def __aiter__(self) -> _AioUnimplemented:
        return self

    async def __anext__(self) -> Any:
        raise _aio_error(*_streaming_only(self._method))

    def cancel(self) -> bool:
        return False


class AioFrameUnaryMethod(_UnaryMethod["AioFrameChannel"]):
    """A unary method on an :class:`AioFrameChannel` (``UnaryUnaryMultiCallable``)."""

    def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
        **_: Any,
    ) -> AioFrameCall:
        return AioFrameCall(
            self._channel.call(
                self._header,
                self._serialize(request),
                timeout,
                tuple(metadata) if metadata is not None else None,
            ),
            self._deserialize,
        )


class AioFrameChannel(_FramedChannel[_AioConnection, AioFrameUnaryMethod], grpc.aio.Channel):
    """The asyncio counterpart of :class:`FrameChannel` (``grpc.aio.Channel``'s interface,
    the parts the generated stubs use); its connections belong to the loop that made
    them."""

    _error = staticmethod(_aio_error)
    _unary_method = AioFrameUnaryMethod
    _unimplemented = _AioUnimplemented

    def __repr__(self) -> str:
        return f"AioFrameChannel({self.address!r})"

    async def _connect(self, metadata: Metadata | None) -> _AioConnection:
        where = self._where
        try:
            if where.path:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(where.path), self._connect_timeout
                )
            else:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(
                        where.host,
                        where.port,
                        ssl=self._ssl,
                        server_hostname=(self._server_name or where.host) if self._ssl else None,
                    ),
                    self._connect_timeout,
                )
        except (OSError, TimeoutError) as exc:  # ssl.SSLError among them
            raise _aio_error(*_unreachable(self.address, exc)) from None
        connection = _AioConnection(reader, writer, self._max_reply_bytes)
        try:
            reply, _ = await asyncio.wait_for(
                connection.exchange(_hello_frame(metadata)), self._connect_timeout
            )
        except (OSError, TimeoutError, asyncio.IncompleteReadError, _ProtocolError) as exc:
            connection.close()
            raise _aio_error(*_no_hello(self.address, exc)) from None
        return self._accepted(connection, reply)

    def _give_back(self, metadata: Metadata | None, connection: _AioConnection) -> None:
        if self._closed:
            connection.close()
        else:
            self._idle.setdefault(metadata, []).append(connection)

    async def call(
        self, method_header: bytes, body: bytes, timeout: float | None, metadata: Metadata | None
    ) -> tuple[bytes, Metadata]:
        """One call: the reply's body and trailing metadata, or AioRpcError."""
        if self._closed:
            raise _aio_error(grpc.StatusCode.CANCELLED, "the channel is closed")
        idle = self._idle.get(metadata)
        connection = idle.pop() if idle else None
        while connection is not None and connection.closed_by_server():
            connection.close()
            connection = idle.pop() if idle else None
        if connection is None:
            connection = await self._connect(metadata)
        try:
            header, reply = await asyncio.wait_for(
                connection.exchange(frame(method_header, body)), timeout
            )
        except TimeoutError:
            connection.close()
            raise _aio_error(*DEADLINE_EXCEEDED) from None
        except (OSError, asyncio.IncompleteReadError, _ProtocolError) as exc:
            connection.close()
            raise _aio_error(*_broken(self.address, exc)) from None
        except BaseException:
            connection.close()  # cancelled mid-call: its reply would come out of turn
            raise
        return reply, self._settle(metadata, connection, header)

    # ------------------------------------------------------------------ grpc.aio.Channel

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return grpc.ChannelConnectivity.READY

    async def wait_for_state_change(self, last_observed_state: Any) -> None:
        raise NotImplementedError("a framed channel has no connectivity states")

    async def channel_ready(self) -> None:
        return None

    async def close(self, grace: float | None = None) -> None:
        self._closed = True
        idle, self._idle = self._idle, {}
        self._close_idle(idle)

    async def __aenter__(self) -> AioFrameChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AioFrameCall:
    """One call in flight: awaiting it gives the response; then ``trailing_metadata()``."""

    def __init__(self, reply: Any, deserialize: Callable[[bytes], Any]) -> None:
        self._reply = reply
        self._deserialize = deserialize
        self._trailing: Metadata = ()

    def __await__(self) -> Any:
        return self._result().__await__()

    async def _result(self) -> Any:
        body, self._trailing = await self._reply
        return self._deserialize(body)

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata(*self._trailing)

    async def initial_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata()
