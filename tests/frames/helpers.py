"""Shared pieces of the framed-transport tests: short socket directories, an in-process
server with frames listeners, and a raw client that speaks the wire protocol byte by byte
(to send what kvsvc's own FrameChannel never would)."""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvsvc_client import ClientOptions

from kvsvc.ports import unix_path
from kvsvc.server.config import PoolConfig, ServerConfig
from kvsvc.wire.frames import MAGIC, PREFIX, FrameHeader, call_header, frame, hello_header
from tests.server.harness import FakeRank, ServerThread, bring_up

POOL = "p"
# A client that fails fast: tests of errors do not wait out retries.
QUICK = ClientOptions(timeout=5, retries=0, unavailable_timeout=0.0)
# 4 layers x 2 heads x (64 + 64) x fp16 x 16 tokens = 32 KiB per block (llama_like_specs).
BYTES_PER_BLOCK = 4 * 2 * 128 * 2 * 16
KVCACHE = "/kvsvc.v1.KVCacheService/"
ADMIN = "/kvsvc.v1.AdminService/"
TINY_SPECS = {
    "model.layers.0.self_attn.attn": {
        "type": "full_attention",
        "block_size": 16,
        "num_kv_heads": 1,
        "head_size": 64,
        "dtype": "float16",
    }
}


@contextmanager
def short_dir() -> Iterator[Path]:
    """A directory under /tmp with a short name: a Unix socket path must stay < 108 bytes,
    and pytest's tmp_path can be longer than that."""
    path = Path(tempfile.mkdtemp(prefix="kf-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def config(frames_listen: str, **kwargs: Any) -> ServerConfig:
    """A one-pool server config on a free gRPC port with ``frames_listen``."""
    return ServerConfig(
        pools=(kwargs.pop("pool", None) or PoolConfig(name=POOL, world_size=1, max_model_len=512),),
        listen=kwargs.pop("listen", "127.0.0.1:0"),
        metrics_listen=None,
        frames_listen=frames_listen,
        **kwargs,
    )


@contextmanager
def frames_server(
    frames_listen: str,
    *,
    ready: bool = True,
    token: str | None = None,
    blocks: int = 64,
    server_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Iterator[ServerThread]:
    """A real server in this process with frames listeners; with ``ready``, its pool
    READY by one fake rank registered over gRPC."""
    thread = ServerThread(config(frames_listen, **kwargs), **(server_kwargs or {}))
    ranks: list[FakeRank] = []
    try:
        if ready:
            ranks = bring_up(
                thread, POOL, kv_cache_bytes=(blocks + 1) * BYTES_PER_BLOCK, token=token
            )
        yield thread
    finally:
        for rank in ranks:
            rank.close()
        thread.stop()


def unix_target(server: ServerThread) -> str:
    """The client target of the server's first frames Unix socket."""
    return "frames:" + next(a for a in server.server.frames_addresses if a.startswith("unix:"))


def tcp_target(server: ServerThread) -> str:
    return f"frames:127.0.0.1:{server.server.frames_port}"


@contextmanager
def unix_and_tcp_server(blocks: int = 64) -> Iterator[ServerThread]:
    """A READY server with one framed Unix socket and one framed TCP port (the client
    tests run each case over both)."""
    with short_dir() as tmp, frames_server(f"unix:{tmp}/s.sock,127.0.0.1:0", blocks=blocks) as srv:
        yield srv


def target_of(kind: str, server: ServerThread) -> str:
    """The client target of ``kind`` ("unix" or "tcp")."""
    return unix_target(server) if kind == "unix" else tcp_target(server)


def live_requests(server: ServerThread, pool: str = POOL) -> list[str]:
    """The pool's live request ids (read on the server's loop)."""

    def read() -> list[str]:
        cache = server.server.pools.by_name[pool].cache
        return [] if cache is None else list(cache.request_ids())

    return list(server.run(read))


class RawClient:
    """One framed connection driven by hand (a blocking socket with a 5 s timeout)."""

    def __init__(self, address: str) -> None:
        if address.startswith("unix:"):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(5.0)
            self.sock.connect(unix_path(address))
        else:
            host, _, port = address.rpartition(":")
            self.sock = socket.create_connection((host, int(port)), timeout=5.0)
        self._buffer = b""

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def hello(self, metadata: tuple[tuple[str, str], ...] | None = None) -> FrameHeader:
        """Send the magic and a hello; the server's answer."""
        header = hello_header(metadata)
        self.send(MAGIC + frame(header))
        return self.read()[0]

    def call(self, method: str, body: bytes = b"") -> tuple[FrameHeader, bytes]:
        self.send(frame(call_header(method), body))
        return self.read()

    def _recv(self, size: int) -> bytes:
        while len(self._buffer) < size:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionResetError(f"closed after {len(self._buffer)} of {size} bytes")
            self._buffer += chunk
        out, self._buffer = self._buffer[:size], self._buffer[size:]
        return out

    def read(self) -> tuple[FrameHeader, bytes]:
        """One frame from the server."""
        header_size, body_size = PREFIX.unpack(self._recv(PREFIX.size))
        header = FrameHeader.FromString(self._recv(header_size))
        return header, self._recv(body_size)

    def closed_by_server(self) -> bool:
        """Whether the server closed the connection (EOF with nothing more unread)."""
        if self._buffer:
            return False
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


@contextmanager
def token_server(
    listen: str, tmp: Path, tokens: dict[str, str], **kwargs: Any
) -> Iterator[ServerThread]:
    """A READY :func:`frames_server` (``listen``'s ``{tmp}`` filled in) with token files
    in ``tmp``: ``tokens`` maps a role (engine, agent, admin) to its file's text; the fake
    rank registers with the agent file's first token."""
    files = {}
    for role, text in tokens.items():
        path = tmp / role
        path.write_text(text)
        files[f"{role}_token_file"] = str(path)
    agent = tokens["agent"].split()[0]
    with frames_server(listen.format(tmp=tmp), token=agent, **files, **kwargs) as srv:
        yield srv
