"""``kvsvc worker``: a standalone worker agent that holds one rank's KV cache tensors.

Derives the rank's layer specs from a model config (or a spec file), profiles the device,
registers with the server, allocates the tensors of its plan and holds them, heartbeating,
until SIGINT or SIGTERM. It registers again on its own when the server restarts.

Exit status: 0 stopped by a signal; 1 the server rejected the rank, planning failed, the
plan could not be allocated (the log says what to change), or the ``--metrics-listen``
port is taken; 2 bad flags, an unusable model config, or a memory budget that does not fit.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import warnings
from typing import Any

from kvsvc.commands._args import (
    add_model_flags,
    add_model_source,
    int_at_least,
    positive_float,
)
from kvsvc.errors import InvalidArgument
from kvsvc.tls import TlsError
from kvsvc.tls_flags import (
    add_client_tls_flags,
    add_metrics_tls_flags,
    client_tls_from_args,
    metrics_tls_from_args,
    tls_exit_status,
)
from kvsvc.units import parse_bytes

EXAMPLES = """\
examples:
  kvsvc worker --server 127.0.0.1:50051 --pool llama --rank 0 --world-size 1 --device cpu \\
      --model-config llama-3.2-1b --max-model-len 4096 --kv-cache-memory 2GiB
  kvsvc worker --server kvsvc:50051 --pool big --rank 3 --world-size 8 --tp 4 --pp 2 \\
      --device cuda:3 --model-config examples/config.json --gpu-memory-utilization 0.9 \\
      --metrics-listen 0.0.0.0:9400
  kvsvc worker --server 127.0.0.1:50051 --pool p --rank 0 --world-size 1 --device cpu \\
      --spec-file examples/specs.json --kv-cache-memory 512MiB --attn-layout kv_first \\
      --attn-layout model.layers.0.self_attn.attn=flash
"""

logger = logging.getLogger("kvsvc.worker")


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected LAYER=VALUE, got {text!r}")
    return name, value


def add_parser(subparsers: Any) -> None:
    """Register ``kvsvc worker`` and its flags."""

    parser = subparsers.add_parser(
        "worker",
        help="run a worker agent that allocates and holds one rank's KV cache",
        description="Run a worker agent: profile the device, register one rank's layers with "
        "the kvsvc server, allocate the planned KV cache tensors and hold them (heartbeating, "
        "reconnecting) until SIGINT/SIGTERM.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_argument_group("server and rank")
    where.add_argument(
        "--server",
        required=True,
        metavar="HOST:PORT|unix:PATH",
        help="kvsvc server (unix:PATH: its Unix-domain socket, on the same host)",
    )
    where.add_argument("--pool", required=True, help="pool name (configured on the server)")
    where.add_argument("--rank", required=True, type=int_at_least(0), help="this rank")
    where.add_argument(
        "--world-size", required=True, type=int_at_least(1), help="ranks in the pool (TP x PP)"
    )
    where.add_argument("--device", required=True, help="cpu, cuda or cuda:N")
    where.add_argument(
        "--token-file",
        metavar="FILE",
        help="file with the agent's bearer token (default: env KVSVC_AGENT_TOKEN, "
        "KVSVC_AGENT_TOKEN_FILE, then KVSVC_AUTH_TOKEN, KVSVC_AUTH_TOKEN_FILE)",
    )
    where.add_argument(
        "--auth-token", help="bearer token on the command line (compatibility: visible in ps)"
    )

    add_model_source(parser, "JSON of layer name -> spec (one TP rank, all layers)")

    model = parser.add_argument_group("model and parallelism")
    add_model_flags(model, tp_default=None, pp_default=None)
    model.add_argument(
        "--max-model-len",
        type=int_at_least(1),
        help="context length reported to the server (default: the model config's; none "
        "with --spec-file, the pool then needs its own)",
    )
    model.add_argument(
        "--attn-layout",
        action="append",
        default=[],
        metavar="NAME|LAYER=NAME",
        help="attention tensor layout: flash (default), flash_hnd, kv_first, kv_first_hnd; "
        "LAYER=NAME for one layer; repeatable. MLA layers always use mla",
    )
    model.add_argument(
        "--shared-layer",
        action="append",
        type=_pair,
        default=[],
        metavar="LAYER=TARGET",
        help="a layer that reuses TARGET's KV cache (not registered); repeatable",
    )

    memory = parser.add_argument_group("memory")
    memory.add_argument(
        "--kv-cache-memory",
        type=_byte_size,
        metavar="BYTES",
        help="KV cache budget (40GiB, 512MiB, ...): required on cpu; on cuda it replaces "
        "the utilisation arithmetic",
    )
    memory.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="cuda: share of the device the engine may use (default 0.9)",
    )

    agent = parser.add_argument_group("agent")
    agent.add_argument(
        "--heartbeat-interval", type=positive_float, default=2.0, help="seconds (default 2)"
    )
    agent.add_argument(
        "--rpc-timeout", type=positive_float, default=10.0, help="deadline per call, seconds"
    )
    agent.add_argument(
        "--connect-timeout",
        type=positive_float,
        help="give up after this many seconds without the server (default: retry forever)",
    )
    agent.add_argument(
        "--metrics-listen", metavar="HOST:PORT", help="serve Prometheus /metrics here"
    )
    agent.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    add_client_tls_flags(parser)
    metrics_tls = parser.add_argument_group(
        "agent /metrics over HTTPS",
        "The agent's own listener takes a server certificate of its own (for the name "
        "scrapers connect to): the client certificate above is for the kvsvc server.",
    )
    add_metrics_tls_flags(metrics_tls)
    parser.set_defaults(func=run)


def _parallel_layout(args: argparse.Namespace) -> tuple[int, int]:
    pp = args.pp or 1
    tp = args.tp if args.tp is not None else args.world_size // pp
    if tp * pp != args.world_size:
        raise InvalidArgument(
            "world_size",
            f"--tp {tp} x --pp {pp} = {tp * pp} ranks, not --world-size {args.world_size}",
        )
    return tp, pp


def _layouts(values: list[str]) -> tuple[str, dict[str, str]]:
    """``--attn-layout`` values: a bare name sets the default, ``LAYER=NAME`` one layer."""
    from kvsvc.worker.layouts import DEFAULT_LAYOUT, get_layout

    default, per_layer = DEFAULT_LAYOUT, {}
    for value in values:
        name, sep, layout = value.partition("=")
        if sep:
            per_layer[name] = layout
        else:
            default = get_layout(value).name
    return default, per_layer


def build_agent(args: argparse.Namespace) -> Any:
    """The agent the flags describe.

    Raises:
        InvalidArgument: naming the flag that is wrong.
        TlsError: TLS flags that do not go together, or a TLS file that cannot be used.
    """
    from kvsvc_client import resolve_token

    from kvsvc import models
    from kvsvc.worker import AgentMetrics, WorkerAgent, WorkerAgentConfig, parse_device
    from kvsvc.worker.profiling import FLAG_NAMES

    try:
        token = resolve_token("agent", args.auth_token, args.token_file)
    except ValueError as exc:
        raise InvalidArgument("--token-file", str(exc)) from None
    tp, pp = _parallel_layout(args)
    if not args.rank < args.world_size:
        raise InvalidArgument(
            "rank", f"must be in [0, {args.world_size}) for --world-size {args.world_size}"
        )
    device = str(parse_device(args.device))
    max_model_len = args.max_model_len or 0
    encoder_tokens = 0
    if args.model_config is not None:
        config, model_name = models.resolve_model_config(args.model_config)
        options = models.ModelSpecOptions(
            tp=tp,
            pp=pp,
            block_size=args.block_size,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            mamba_cache_mode=args.mamba_cache_mode,
            max_model_len=args.max_model_len,
        )
        specs = models.layer_specs_for_rank(config, options, args.rank)
        max_model_len = max_model_len or models.default_max_model_len(config)
        encoder_tokens = models.default_max_num_encoder_input_tokens(config)
    else:
        all_specs = models.load_spec_file(args.spec_file)
        specs = models.split_specs_over_ranks(all_specs, tp=tp, pp=pp)[args.rank]
        model_name = os.path.basename(args.spec_file)
    default_layout, layouts = _layouts(args.attn_layout)
    tls = client_tls_from_args(args)
    if tls is not None:
        tls.check()  # a TLS file error exits 1 (the environment), before the agent exists
    agent_config = WorkerAgentConfig(
        server=args.server,
        pool=args.pool,
        rank=args.rank,
        world_size=args.world_size,
        device=device,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_model_len=max_model_len,
        max_num_encoder_input_tokens=encoder_tokens,
        model=model_name,
        heartbeat_interval=args.heartbeat_interval,
        rpc_timeout=args.rpc_timeout,
        auth_token=token,
        connect_timeout=args.connect_timeout,
        allow_replan=True,  # nothing outside this process bound the tensors
        # Resolved above (flags, then KVSVC_TLS_*); "" keeps the agent from looking again.
        tls_ca=(tls.ca or "") if tls else "",
        tls_cert=(tls.cert or "") if tls else "",
        tls_key=(tls.key or "") if tls else "",
        tls_server_name=(tls.server_name or "") if tls else "",
    )
    return WorkerAgent(
        agent_config,
        specs,
        attn_layouts=layouts,
        default_attn_layout=default_layout,
        shared_layers=dict(args.shared_layer),
        metrics=AgentMetrics(args.pool, args.rank, device),
        # Memory errors name this command's flags, not WorkerAgentConfig's fields.
        setting_names=FLAG_NAMES,
    )


def import_torch_holding_ctrl_c() -> None:
    """Import torch with SIGINT held back, then let a Ctrl-C that came meanwhile through.

    torch's import runs C++ initialisers (pybind11) for seconds: a KeyboardInterrupt
    raised inside one is swallowed there (the agent then runs on as if no Ctrl-C came) or
    aborts the process ("terminate called after throwing ... KeyboardInterrupt"). Blocked
    during the import, the signal stays pending and arrives once it is done, as the
    ``KeyboardInterrupt`` the command line turns into one line (exit 130).
    """
    if not hasattr(signal, "pthread_sigmask") or "torch" in sys.modules:
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        import torch  # noqa: F401  (the agent's modules import it next)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def run(args: argparse.Namespace) -> int:
    """Run the agent until a signal (0) or a fatal error (1); bad flags exit 2."""
    # torch warns at import when NumPy is absent; the agent never hands tensors to NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # torch's own INFO lines are its internals' (an exit hook of its fake tensors logs
    # cache statistics, even after Ctrl-C during its import): not the agent's to print.
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("torch").setLevel(logging.WARNING)
    prog = "kvsvc worker"
    metrics_server = None
    import_torch_holding_ctrl_c()
    try:
        agent = build_agent(args)
        if args.metrics_listen:
            from kvsvc.worker import serve_metrics

            metrics_tls = metrics_tls_from_args(args)
            metrics_server = serve_metrics(
                args.metrics_listen, agent.metrics.registry, tls=metrics_tls
            )
            host = args.metrics_listen.rpartition(":")[0] or "0.0.0.0"
            scheme = "https" if metrics_tls is not None else "http"
            logger.info("metrics on %s://%s:%d/metrics", scheme, host, metrics_server.port)
        elif args.metrics_tls_cert or args.metrics_tls_key or args.metrics_tls_client_ca:
            raise InvalidArgument("--metrics-tls-cert", "needs --metrics-listen")
    except TlsError as exc:  # before InvalidArgument: both are ValueErrors
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return tls_exit_status(exc)
    except InvalidArgument as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the metrics port is taken: the environment, not a bad flag
        from kvsvc.ports import ListenError

        error = ListenError(args.metrics_listen, "agent /metrics", "--metrics-listen", exc)
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1

    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        logger.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        from kvsvc.worker import WorkerAgentError  # torch: imported by build_agent already

        try:
            agent.launch()
        except WorkerAgentError as exc:  # the memory budget does not fit (MEMORY, DEVICE)
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        announced = False
        while not stop.is_set():
            if agent.wait(timeout=0.2):
                break
            if agent.ready and not announced:
                announced = True
                config = agent.kv_cache_config
                logger.info(
                    "holding %d blocks x %d layers (%.2f GiB) for rank %d of pool %s; "
                    "max_model_len %d; SIGINT/SIGTERM to stop",
                    config.num_blocks,
                    len(config.layer_names),
                    agent.allocated_bytes / 1024**3,
                    args.rank,
                    args.pool,
                    agent.max_model_len,
                )
    finally:
        agent.stop()
        if metrics_server is not None:
            metrics_server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    error = agent.error
    if error is not None:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1
    return 0
