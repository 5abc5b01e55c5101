"""A container health check: ``grpc.health.v1`` of a server, or a worker agent's readiness.

Docker's ``HEALTHCHECK`` and compose ``healthcheck`` need a command that exits 0 when
healthy; no ``grpc_health_probe`` binary ships with kvsvc, so this is that command
(Kubernetes uses its native ``grpc:`` probes against the same health service)::

    python -m kvsvc.tools.healthcheck --server 127.0.0.1:50051
    python -m kvsvc.tools.healthcheck --server 127.0.0.1:50051 \
        --service kvsvc.v1.KVCacheService/demo
    python -m kvsvc.tools.healthcheck --server unix:/run/kvsvc/kvsvc.sock
    python -m kvsvc.tools.healthcheck --server auto   # the server image's HEALTHCHECK
    python -m kvsvc.tools.healthcheck --agent-metrics 127.0.0.1:9401
    python -m kvsvc.tools.healthcheck --agent-metrics auto   # the worker image's HEALTHCHECK
    KVSVC_TLS_CA=/etc/kvsvc/tls/ca.crt python -m kvsvc.tools.healthcheck --server 127.0.0.1:50051
    python -m kvsvc.tools.healthcheck --agent-metrics https://127.0.0.1:9401 --tls-ca ca.crt

``--server auto`` asks the ``kvsvc serve`` process running beside the check (a container's
PID 1, else the only one visible) on the address it was told to listen on: its first TCP
``--listen`` (or its ``--config`` file's ``listen``; ``0.0.0.0`` and ``::`` are asked on
loopback), else its Unix socket, else the default port. The server image's ``HEALTHCHECK``
uses it, so a container started with ``serve --listen 0.0.0.0:6000`` is checked on 6000:
a fixed ``--server 127.0.0.1:50051`` would call that healthy server unhealthy.
``--agent-metrics auto`` does the same for the ``kvsvc worker`` beside the check: its
``--metrics-listen`` (the worker image's ``HEALTHCHECK``).

The server's health names (see :mod:`kvsvc.server.app`): ``""`` is SERVING while the server
runs, ``kvsvc.v1.KVCacheService`` when every pool serves engine calls, and
``kvsvc.v1.KVCacheService/<pool>`` when that pool does. A worker agent has no gRPC server;
it is healthy when its ``/metrics`` says ``kvsvc_agent_ready 1`` (the server accepted its
allocation).

TLS: ``--tls-ca``, ``--tls-cert``, ``--tls-key`` and ``--tls-server-name`` (or ``KVSVC_TLS_CA``,
``KVSVC_TLS_CERT``, ``KVSVC_TLS_KEY``, ``KVSVC_TLS_SERVER_NAME``, which a container sets once
for its kvsvc process and its health check alike) make the ``--server`` check speak TLS.
An agent's ``/metrics`` is read over HTTPS, with the same settings, for
``--agent-metrics https://HOST:PORT``, or for a bare ``HOST:PORT`` when
``KVSVC_METRICS_TLS_CERT`` is set: the variable that makes the agent in the same container
serve HTTPS (``KVSVC_TLS_CA`` alone cannot decide: an agent trusts its server's CA whether
or not its own ``/metrics`` is HTTPS). ``http://`` forces plain HTTP.

Exit status: 0 healthy, 1 unhealthy or unreachable (one line on stderr says why), 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from kvsvc.ports import is_unix_address, unix_path
from kvsvc.tls import ClientTls, TlsError, open_channel
from kvsvc.tls_flags import (
    METRICS_TLS_CERT_ENV,
    add_client_tls_flags,
    client_tls_from_args,
    tls_exit_status,
)

HEALTHY, UNHEALTHY, USAGE = 0, 1, 2
DEFAULT_TIMEOUT_S = 3.0
# --server's value that means "the kvsvc serve process beside me" (no address has no colon).
AUTO = "auto"
PROC = Path("/proc")


class HealthResult(NamedTuple):
    """Outcome of one check: ``healthy`` and a line saying what was seen."""

    healthy: bool
    message: str


def _bracket(address: str) -> str:
    """``host:port`` as a URL authority (IPv6 hosts in brackets)."""
    host, _, port = address.rpartition(":")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _validate_address(address: str, flag: str, *, unix: bool = False) -> str:
    """``address`` when it is ``HOST:PORT`` (or, with ``unix``, ``unix:PATH``).

    Raises:
        ValueError: anything else, naming ``flag``.
    """
    if unix and is_unix_address(address):
        if not unix_path(address):
            raise ValueError(f"{flag}: expected unix:PATH, got {address!r}")
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{flag}: expected HOST:PORT with a port in 1-65535, got {address!r}")
    return address


class ServeProcessError(ValueError):
    """No ``kvsvc serve`` process to ask, or one whose address cannot be told: unhealthy."""


def _kvsvc_arguments(argv: Sequence[str], command: str) -> list[str] | None:
    """The arguments after ``command`` when ``argv`` runs ``kvsvc COMMAND``, else None.

    The entry point shows as ``kvsvc serve ...``, ``.../python .../bin/kvsvc serve ...`` (a
    console script's interpreter line) or ``python -m kvsvc serve ...``.
    """
    for i, arg in enumerate(argv[:-1]):
        is_kvsvc = Path(arg).name == "kvsvc" or (
            i > 0 and argv[i - 1] == "-m" and arg in ("kvsvc", "kvsvc.cli")
        )
        if is_kvsvc:
            return list(argv[i + 2 :]) if argv[i + 1] == command else None
    return None


def _process_argv(proc: Path, pid: str) -> list[str]:
    """``pid``'s command line (empty when it is gone or unreadable)."""
    try:
        raw = (proc / pid / "cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0")[:-1]]


def find_kvsvc_process(
    command: str = "serve", proc: Path = PROC, flag: str = "--server"
) -> tuple[str, list[str]]:
    """``(pid, arguments)`` of the ``kvsvc COMMAND`` process this check belongs to.

    PID 1 when it is one (the container's entry point); else the only one ``proc`` shows
    (an init process such as ``podman run --init`` at PID 1, or a host).

    Raises:
        ServeProcessError: none, or several (the check cannot tell which is meant); the
            message names ``flag`` (the check's flag that said ``auto``).
    """
    arguments = _kvsvc_arguments(_process_argv(proc, "1"), command)
    if arguments is not None:
        return "1", arguments
    found = []
    for entry in proc.iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            arguments = _kvsvc_arguments(_process_argv(proc, entry.name), command)
            if arguments is not None:
                found.append((entry.name, arguments))
    if not found:
        raise ServeProcessError(f"{flag} auto: no kvsvc {command} process is running here")
    if len(found) > 1:
        pids = ", ".join(sorted((pid for pid, _ in found), key=int))
        raise ServeProcessError(
            f"{flag} auto: several kvsvc {command} processes ({pids}); give {flag} HOST:PORT"
        )
    return found[0]


def find_serve_process(proc: Path = PROC) -> tuple[str, list[str]]:
    """``(pid, serve arguments)`` of the ``kvsvc serve`` process this check belongs to
    (see :func:`find_kvsvc_process`)."""
    return find_kvsvc_process("serve", proc)


def _loopback(host: str) -> str:
    """The host to ask for a server bound to ``host`` (a wildcard is asked on loopback)."""
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "*"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def agent_metrics_address(arguments: Sequence[str]) -> str:
    """The ``/metrics`` address of an agent started with ``kvsvc worker ARGUMENTS``: its
    ``--metrics-listen``, a wildcard host replaced by loopback.

    Raises:
        ServeProcessError: no ``--metrics-listen`` (the agent serves no /metrics: nothing
            to ask), a value without it, or port 0.
    """
    # Only the flag asked about (the worker's full parser would also insist on flags this
    # check does not need); the worker itself refuses an abbreviation of it as ambiguous.
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--metrics-listen")
    try:
        args, _ = parser.parse_known_args(list(arguments))
    except argparse.ArgumentError as exc:
        raise ServeProcessError(
            f"--agent-metrics auto: cannot read the worker command: {exc}"
        ) from None
    address = args.metrics_listen
    if not address:
        raise ServeProcessError(
            "--agent-metrics auto: the kvsvc worker serves no /metrics (no --metrics-listen)"
        )
    host, _, port = address.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        raise ServeProcessError(
            f"--agent-metrics auto: the worker's --metrics-listen is {address} (no fixed "
            "port); give --agent-metrics HOST:PORT"
        )
    host = _loopback(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve_auto_agent_metrics(proc: Path = PROC) -> str:
    """``--agent-metrics auto``: the /metrics address of the ``kvsvc worker`` beside this
    check (the worker image's HEALTHCHECK: a worker started with another
    ``--metrics-listen`` port is checked there, not on a fixed 9401)."""
    _, arguments = find_kvsvc_process("worker", proc, flag="--agent-metrics")
    return agent_metrics_address(arguments)


def serve_address(arguments: Sequence[str], cwd: Path) -> str:
    """The address to check a server started with ``kvsvc serve ARGUMENTS`` (in ``cwd``) on.

    Read as the server reads them (its own flag parser; flags over the ``--config`` file
    over the default): the first TCP address, a wildcard host replaced by loopback, else the
    first Unix socket.

    Raises:
        ServeProcessError: arguments the server would refuse, or a TCP port 0 (a free port
            the command line does not name).
    """
    from kvsvc.commands import serve
    from kvsvc.server.config import DEFAULT_LISTEN, ConfigError, listen_addresses, load_config_file

    parser = argparse.ArgumentParser(prog="kvsvc", exit_on_error=False)
    serve.add_parser(parser.add_subparsers(dest="command"))
    try:
        args, _ = parser.parse_known_args(["serve", *arguments])
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ServeProcessError(f"--server auto: cannot read the serve command: {exc}") from None
    try:
        if args.listen:
            listen = ",".join(args.listen)
        elif args.config:
            listen = load_config_file(cwd / args.config).get("listen", DEFAULT_LISTEN)
        else:
            listen = DEFAULT_LISTEN
        addresses = listen_addresses(str(listen))
    except ConfigError as exc:
        raise ServeProcessError(f"--server auto: {exc}") from None
    for address in addresses:
        if is_unix_address(address):
            continue
        host, _, port = address.rpartition(":")
        if int(port) == 0:
            raise ServeProcessError(
                f"--server auto: the server listens on {address} (a free port chosen at "
                "start); give --server HOST:PORT"
            )
        return f"{_loopback(host)}:{port}"
    unix = addresses[0]
    path = unix_path(unix)
    return unix if Path(path).is_absolute() else f"unix:{cwd / path}"


def resolve_auto_server(proc: Path = PROC) -> str:
    """``--server auto``: the address of the ``kvsvc serve`` process beside this check.

    Raises:
        ServeProcessError: see :func:`find_serve_process` and :func:`serve_address`.
    """
    pid, arguments = find_serve_process(proc)
    try:
        cwd = (proc / pid / "cwd").resolve(strict=True)
    except OSError:
        cwd = Path("/")  # another user's process: a relative path is read from /
    return serve_address(arguments, cwd)


def check_grpc(
    address: str,
    service: str = "",
    timeout: float = DEFAULT_TIMEOUT_S,
    tls: ClientTls | None = None,
) -> HealthResult:
    """Ask ``address``'s ``grpc.health.v1.Health/Check`` about ``service``.

    Args:
        address: the server's ``HOST:PORT``.
        service: the health service name (``""``: the server as a whole).
        timeout: deadline of the call, seconds (connecting included).
        tls: connect with TLS (None: plaintext).

    Returns:
        healthy only for SERVING; NOT_SERVING, an unknown service name and an unreachable
        server are unhealthy, with the reason in the message.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    shown = repr(service) if service else "the server"
    with open_channel(_bracket(address), tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
            if code == grpc.StatusCode.NOT_FOUND:
                return HealthResult(False, f"{address}: unknown health service {shown}")
            details = err.details() if hasattr(err, "details") else ""
            return HealthResult(False, f"{address}: {code.name}: {details or 'no details'}")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return HealthResult(
        response.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {shown} {status}"
    )


def check_agent(
    address: str,
    timeout: float = DEFAULT_TIMEOUT_S,
    tls: ClientTls | None = None,
    *,
    https: bool = False,
) -> HealthResult:
    """Read a worker agent's ``/metrics``; healthy when every ``kvsvc_agent_ready`` is 1.

    Args:
        address: the agent's metrics ``HOST:PORT``.
        timeout: HTTP timeout, seconds.
        tls: with ``https``, the CA that verifies the agent (None: the system roots) and
            the client certificate it may require.
        https: read ``https://`` instead of ``http://``.
    """
    from prometheus_client.parser import text_string_to_metric_families

    url = f"{'https' if https else 'http'}://{_bracket(address)}/metrics"
    try:
        text = _get_metrics(address, timeout, (tls or ClientTls()) if https else None)
    except (OSError, http.client.HTTPException) as exc:
        return HealthResult(False, f"{url}: {exc}")
    try:
        ready = [
            sample
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "kvsvc_agent_ready"
        ]
    except ValueError as exc:
        return HealthResult(False, f"{url}: not Prometheus text: {exc}")
    if not ready:
        return HealthResult(False, f"{url}: no kvsvc_agent_ready series (not a kvsvc agent?)")
    waiting = [s.labels for s in ready if s.value != 1]
    if waiting:
        return HealthResult(False, f"{url}: agent not ready: {waiting}")
    return HealthResult(True, f"{url}: ready")


def _get_metrics(address: str, timeout: float, tls: ClientTls | None) -> str:
    """The body of ``GET /metrics`` at ``address`` (HTTPS verified by ``tls`` when set).

    http.client rather than urllib: the certificate is checked against ``tls.server_name``
    when given, while the connection goes to ``address`` (urllib checks the URL's host).

    Raises:
        OSError: unreachable, a refused handshake, or an answer other than 200.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    connection: http.client.HTTPConnection
    if tls is None:
        connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    else:
        connection = _VerifiedHTTPS(host, int(port), tls, timeout)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise OSError(f"HTTP {response.status} {response.reason}")
        return body.decode("utf-8")
    finally:
        connection.close()


class _VerifiedHTTPS(http.client.HTTPSConnection):
    """HTTPS whose certificate must carry ``tls.server_name`` (or the host) and chain to
    ``tls.ca``; presents ``tls``' client certificate when it has one."""

    def __init__(self, host: str, port: int, tls: ClientTls, timeout: float) -> None:
        self._tls_context = tls.ssl_context()
        self._server_name = tls.server_name or host
        super().__init__(host, port, timeout=timeout, context=self._tls_context)

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._tls_context.wrap_socket(sock, server_hostname=self._server_name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvsvc.tools.healthcheck",
        description="Exit 0 when a kvsvc server's health service says SERVING, or a worker "
        "agent reports itself ready; 1 otherwise.",
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--server",
        metavar="HOST:PORT|unix:PATH|auto",
        help="kvsvc server gRPC address (unix:PATH: its Unix-domain socket; auto: the "
        "kvsvc serve process running here, PID 1 in a container, on its own --listen)",
    )
    target.add_argument(
        "--agent-metrics",
        metavar="[https://]HOST:PORT|auto",
        help="worker agent /metrics address (https:// for an agent with --metrics-tls-cert; "
        "auto: the --metrics-listen of the kvsvc worker process beside this check)",
    )
    parser.add_argument(
        "--service",
        default="",
        help="health service name with --server (default '': the server itself; "
        "'kvsvc.v1.KVCacheService' for all pools; 'kvsvc.v1.KVCacheService/POOL' for one)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for an answer (default {DEFAULT_TIMEOUT_S:g})",
    )
    add_client_tls_flags(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    if args.agent_metrics and args.service:
        parser.error("--service applies to --server only")
    try:
        tls = client_tls_from_args(args)
        if args.server == AUTO:
            try:
                server = resolve_auto_server()
            except ServeProcessError as exc:
                print(f"{exc}", file=sys.stderr)
                return UNHEALTHY
            result = check_grpc(server, args.service, args.timeout, tls)
        elif args.server:
            result = check_grpc(
                _validate_address(args.server, "--server", unix=True),
                args.service,
                args.timeout,
                tls,
            )
        else:
            address = args.agent_metrics
            if address == AUTO:
                try:
                    address = resolve_auto_agent_metrics()
                except ServeProcessError as exc:
                    print(f"{exc}", file=sys.stderr)
                    return UNHEALTHY
            https = address.startswith("https://") or (
                not address.startswith("http://") and bool(os.environ.get(METRICS_TLS_CERT_ENV))
            )
            address = address.removeprefix("https://").removeprefix("http://")
            result = check_agent(
                _validate_address(address, "--agent-metrics"), args.timeout, tls, https=https
            )
    except TlsError as exc:  # a TLS file that cannot be used is unhealthy (1); clashing flags 2
        print(f"{exc}", file=sys.stderr)
        return tls_exit_status(exc)
    except ValueError as exc:
        parser.error(str(exc))
    print(result.message, file=sys.stdout if result.healthy else sys.stderr)
    return HEALTHY if result.healthy else UNHEALTHY


if __name__ == "__main__":
    sys.exit(main())
