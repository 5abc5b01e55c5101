"""What a worker agent needs to know before it talks to the server, checked up front.

:class:`WorkerAgentConfig` names the server, the pool and this rank, the device and its memory
budget, and how the agent retries; :meth:`WorkerAgentConfig.validate` refuses a bad value
naming its field before any call is made (the agent's reconnect loop never sees one).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from kvsvc.errors import InvalidArgument
from kvsvc.tls import ClientTls, TlsError, client_tls
from kvsvc.worker.allocation import parse_device


@dataclass(slots=True)
class WorkerAgentConfig:
    """Where the agent registers, for which rank, and how it behaves.

    Attributes:
        server: ``HOST:PORT`` of the kvsvc server.
        pool: the pool this rank belongs to (configured on the server).
        rank / world_size: this rank and the number of ranks in the pool.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        kv_cache_memory: fixed KV cache budget in bytes (required on CPU).
        gpu_memory_utilization: CUDA: fraction of the device the engine may use.
        tensor_parallel_size / pipeline_parallel_size: the rank's parallel layout.
        max_model_len: the model's context length (0: not given; the pool decides).
        max_num_encoder_input_tokens: encoder input length of cross-attention models.
        model: the model's name (informational: the server shows it).
        heartbeat_interval: seconds between heartbeats.
        rpc_timeout: deadline of every unary call, seconds.
        auth_token: sent as ``authorization: Bearer <token>`` when set.
        connect_timeout: give up after this many seconds without reaching the server
            (``None``: retry forever).
        backoff_initial / backoff_max: reconnect delays, doubled per failed attempt up to
            the cap, each jittered down by up to half.
        heartbeat_failures_before_reconnect: consecutive failed heartbeats after which the
            agent drops its session and reconnects (a server that hangs without closing the
            plan stream).
        allow_replan: a different plan after tensors exist reallocates them (a standalone
            process) instead of stopping with ``REPLANNED`` (an engine that bound them).
        hostname: reported at registration.
        in_engine: the agent runs inside an engine whose own workers hold the tensors
            (vLLM on kvsvc): operators restart the engine to bring the rank back, and
            ``kvsvc ctl`` says so.
        tls_ca / tls_cert / tls_key / tls_server_name: TLS of the channel to the server,
            as :class:`kvsvc_client.ClientOptions` takes them (None: the ``KVSVC_TLS_*``
            variable; ""; off); a CA or a client certificate makes the channel TLS.
    """

    server: str
    pool: str
    rank: int
    world_size: int
    device: str = "cpu"
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_model_len: int = 0
    max_num_encoder_input_tokens: int = 0
    model: str = ""
    heartbeat_interval: float = 2.0
    rpc_timeout: float = 10.0
    auth_token: str | None = None
    connect_timeout: float | None = None
    backoff_initial: float = 0.2
    backoff_max: float = 5.0
    heartbeat_failures_before_reconnect: int = 3
    allow_replan: bool = False
    hostname: str = field(default_factory=socket.gethostname)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    in_engine: bool = False

    def client_tls(self) -> ClientTls | None:
        """The channel's TLS settings, environment fallbacks applied (None: plaintext).

        Raises:
            TlsError: a certificate without its key, or a server name without TLS.
        """
        return client_tls(self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)

    def validate(self) -> None:
        """Raises InvalidArgument naming the first bad field."""
        if not self.server or ":" not in self.server:
            raise InvalidArgument("server", f"expected HOST:PORT or unix:PATH, got {self.server!r}")
        if self.server.startswith("frames:"):
            raise InvalidArgument(
                "server",
                f"{self.server!r} is the server's framed transport, which serves engine calls "
                "only; an agent registers and follows its plan over gRPC: give the server's "
                "--listen address (HOST:PORT or unix:PATH)",
            )
        if not self.pool:
            raise InvalidArgument("pool", "must not be empty")
        if self.world_size < 1:
            raise InvalidArgument("world_size", f"must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise InvalidArgument(
                "rank", f"must be in [0, {self.world_size}) for world size {self.world_size}"
            )
        parse_device(self.device)
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise InvalidArgument(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "max_num_encoder_input_tokens"):
            if getattr(self, name) < 0:
                raise InvalidArgument(name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("heartbeat_interval", "rpc_timeout", "backoff_initial", "backoff_max"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(name, f"must be positive, got {getattr(self, name)}")
        if self.connect_timeout is not None and self.connect_timeout <= 0:
            raise InvalidArgument("connect_timeout", "must be positive")
        try:
            tls = self.client_tls()
            if tls is not None:
                tls.check()  # a wrong path fails here, not in the reconnect loop
        except TlsError as exc:
            raise InvalidArgument(exc.setting, exc.message) from None
        if self.heartbeat_failures_before_reconnect < 1:
            raise InvalidArgument("heartbeat_failures_before_reconnect", "must be >= 1")


__all__ = ["WorkerAgentConfig"]
