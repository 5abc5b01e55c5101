"""``kvsvc plan``: how many tokens and requests a model's KV cache holds, without a GPU.

Derives every rank's layer specs from a Hugging Face ``config.json`` (or a spec file), runs
the same planner the server runs, and prints the groups, the block count per rank, the
token capacity and the max concurrency, as a table or as JSON.

Exit status: 0 planned; 1 the plan is impossible (e.g. one request of ``max_model_len``
does not fit, with the longest length that would); 2 bad flags or an unusable model
config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvsvc.commands._args import add_model_flags, add_model_source, int_at_least
from kvsvc.errors import PlanningError
from kvsvc.planner.memory import MORE_MEMORY_HINT
from kvsvc.units import format_sizes, parse_bytes

EXAMPLES = """\
examples:
  kvsvc plan --model-config llama-3.2-1b --kv-cache-memory 8GiB
  kvsvc plan --model-config examples/config.json --tp 4 --pp 2 --kv-cache-memory 40GiB \\
      --max-model-len -1
  kvsvc plan --model-config gemma-3-12b --gpu-memory 80GiB --gpu-memory-utilization 0.9 \\
      --non-kv-memory 30GiB --json
  kvsvc plan --spec-file examples/specs.json --max-model-len 32768 --kv-cache-memory 20GiB
  kvsvc plan --list-models
(examples/ is in the kvsvc repository; docs/spec-files.md describes spec files)
"""


def _max_model_len(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer or -1 (auto-fit), got {text!r}"
        ) from None
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer or -1 (auto-fit), got {text!r}"
        )
    return value


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _byte_sizes(text: str) -> list[int]:
    return [_byte_size(part) for part in text.split(",")]


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def add_parser(subparsers: Any) -> None:
    """Register ``kvsvc plan`` and its flags."""
    from kvsvc.planner import LAYOUTS

    parser = subparsers.add_parser(
        "plan",
        help="plan a model's KV cache: blocks per GPU, token capacity, max concurrency",
        description="Plan the KV cache of a model on a TP x PP layout, the way the server "
        "will: groups, blocks per rank, tokens that fit and max concurrency. Needs no GPU.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = add_model_source(
        parser, "JSON of layer name -> spec (one TP rank, all layers) instead of a config"
    )
    source.add_argument(
        "--list-models", action="store_true", help="list the bundled model configs and exit"
    )

    model = parser.add_argument_group("model and parallelism")
    add_model_flags(model, tp_default=1, pp_default=1)
    model.add_argument(
        "--mamba-ssm-cache-dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="SSM state dtype of Mamba layers (auto: the model dtype, vLLM's default)",
    )
    model.add_argument(
        "--disable-sliding-window",
        action="store_true",
        help="run sliding-window layers as full attention",
    )

    memory = parser.add_argument_group(
        "memory per GPU (give --kv-cache-memory, or --gpu-memory and what the rest uses)"
    )
    memory.add_argument(
        "--kv-cache-memory",
        type=_byte_sizes,
        metavar="BYTES[,BYTES...]",
        help="memory for the KV cache per GPU (40GiB, 512MiB, ...); a comma list gives "
        "each rank its own",
    )
    memory.add_argument("--gpu-memory", type=_byte_size, metavar="BYTES", help="GPU memory")
    memory.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=0.9,
        metavar="F",
        help="share of --gpu-memory the engine may use (default 0.9)",
    )
    memory.add_argument(
        "--non-kv-memory",
        type=_byte_size,
        default=0,
        metavar="BYTES",
        help="weights, activations and graphs: subtracted from the usable GPU memory",
    )

    engine = parser.add_argument_group("engine settings")
    engine.add_argument(
        "--max-model-len",
        type=_max_model_len,
        metavar="N",
        help="longest request; -1 fits the longest the memory holds (default: the model's)",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=int_at_least(1),
        default=8192,
        metavar="N",
        help="tokens one step may schedule (default 8192)",
    )
    engine.add_argument(
        "--max-num-encoder-input-tokens",
        type=int_at_least(0),
        metavar="N",
        help="longest encoder input (default: the model's, e.g. 1500 for Whisper)",
    )
    engine.add_argument(
        "--num-gpu-blocks-override",
        type=int_at_least(1),
        metavar="N",
        help="use exactly N blocks per GPU, whatever the memory",
    )
    engine.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="one block table for all layers (local attention allocated as full)",
    )
    engine.add_argument(
        "--no-prefix-caching", action="store_true", help="plan as with prefix caching disabled"
    )
    engine.add_argument(
        "--prefix-match-unit",
        type=int_at_least(1),
        metavar="N",
        help="hash granularity of multi-group models (default: gcd of group block sizes)",
    )
    engine.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="layer_outer",
        help="tensor layout; block_outer packs layers with different page sizes",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.set_defaults(func=run)


class _UsageError(Exception):
    """A flag combination the parser cannot reject by itself (exit status 2)."""


def _available_memory(args: argparse.Namespace, world_size: int) -> list[int]:
    if args.kv_cache_memory is not None and args.gpu_memory is not None:
        raise _UsageError("give either --kv-cache-memory or --gpu-memory, not both")
    if args.kv_cache_memory is not None:
        values: list[int] = args.kv_cache_memory
        if len(values) == 1:
            return values * world_size
        if len(values) != world_size:
            raise _UsageError(
                f"--kv-cache-memory lists {len(values)} sizes for {world_size} ranks "
                "(give one size, or one per rank)"
            )
        return values
    if args.gpu_memory is not None:
        usable = int(args.gpu_memory * args.gpu_memory_utilization) - args.non_kv_memory
        return [usable] * world_size
    if args.num_gpu_blocks_override is not None:
        return [0] * world_size  # the override alone sizes the pool
    raise _UsageError(
        "say how much memory the KV cache gets: --kv-cache-memory BYTES (per GPU), or "
        "--gpu-memory BYTES [--gpu-memory-utilization F] [--non-kv-memory BYTES]"
    )


def _build(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """Plan from the flags; also return what the table header shows."""
    from kvsvc import models
    from kvsvc.planner import PlannerOptions, plan_kv_cache

    world_size = args.tp * args.pp
    info: dict[str, Any] = {"tp": args.tp, "pp": args.pp}
    if args.model_config is not None:
        config, display = models.resolve_model_config(args.model_config)
        max_model_len = args.max_model_len or models.default_max_model_len(config)
        spec_options = models.ModelSpecOptions(
            tp=args.tp,
            pp=args.pp,
            block_size=args.block_size,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            mamba_cache_mode=args.mamba_cache_mode,
            mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
            max_model_len=models.default_max_model_len(config)
            if max_model_len == -1
            else max_model_len,
            disable_sliding_window=args.disable_sliding_window,
        )
        worker_specs = models.layer_specs_all_ranks(config, spec_options)
        derived: int | None = models.default_max_model_len(config)
        encoder = args.max_num_encoder_input_tokens
        if encoder is None:
            encoder = models.default_max_num_encoder_input_tokens(config)
        kv_heads = models.total_num_kv_heads(config)
        info["model"] = f"{display} ({config['model_type']})"
        dtype = models.model_dtype(config, args.dtype)
        info["dtype"] = dtype
        info["kv_cache_dtype"] = dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    else:
        if args.max_model_len is None:
            raise _UsageError("--spec-file needs --max-model-len (a length, or -1 to auto-fit)")
        specs = models.load_spec_file(args.spec_file)
        worker_specs = models.split_specs_over_ranks(specs, tp=args.tp, pp=args.pp)
        max_model_len = args.max_model_len
        derived = None
        encoder = args.max_num_encoder_input_tokens or 0
        kv_heads = None
        info["model"] = f"{args.spec_file} (spec file, {len(specs)} layers)"
    has_mamba = any(s.kind == "mamba" for specs in worker_specs for s in specs.values())
    options = PlannerOptions(
        max_model_len=max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_encoder_input_tokens=encoder,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        # vLLM caches Mamba state per block only in modes align/all; mode none means no
        # prefix caching for the model.
        enable_prefix_caching=not args.no_prefix_caching
        and not (has_mamba and args.mamba_cache_mode == "none"),
        prefix_match_unit=args.prefix_match_unit,
        layout=args.layout,
        tensor_parallel_size=args.tp,
        derived_max_model_len=derived,
        total_num_kv_heads=kv_heads,
    )
    memory = _available_memory(args, world_size)
    return plan_kv_cache(worker_specs, memory, options), info


def _gib(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 1024**3:.2f}"


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def render_table(plan: Any, info: dict[str, Any]) -> str:
    """The human-readable form of a plan."""
    return render_plan_dict(plan.to_dict(), info)


def render_plan_dict(data: dict[str, Any], info: dict[str, Any] | None = None) -> str:
    """The human-readable form of a plan's JSON object (``kvsvc ctl plan`` shows it too).

    ``info`` (model name, tp, pp, dtypes) adds a header line and the pp/tp columns.
    """
    tp = info["tp"] if info else None
    if info:
        header = f"Model: {info['model']}  TP={info['tp']} PP={info['pp']}"
        if "dtype" in info:
            header += f"  dtype={info['dtype']}  kv-cache={info['kv_cache_dtype']}"
    else:
        header = f"Ranks: {len(data['workers'])}"
    lines = [header, f"Layout: {data['layout']}", "", "KV cache groups"]
    rows = [["group", "kind", "layers", "block", "page bytes", "window", "blocks/request"]]
    for g in data["groups"]:
        rows.append(
            [
                str(g["index"]),
                g["kind"],
                str(g["num_layers"]),
                str(g["block_size"]),
                f"{g['page_size_bytes']:,}",
                "-" if g["sliding_window"] is None else str(g["sliding_window"]),
                f"{g['blocks_per_request']:,}",
            ]
        )
    if len(rows) == 1:
        lines.append("  (none: the model keeps no KV cache)")
    else:
        lines += _table(rows, right={2, 3, 4, 5, 6})
    lines += ["", "Ranks (every rank gets the same block count)"]
    rows = [["rank", "pp", "tp", "layers", "tensors", "available GiB", "used GiB", "blocks"]]
    for w in data["workers"]:
        rows.append(
            [
                str(w["rank"]),
                str(w["rank"] // tp) if tp else "-",
                str(w["rank"] % tp) if tp else "-",
                str(sum(len(names) for names in w["groups"])),
                str(len(w["tensors"])),
                _gib(w["available_memory"]),
                _gib(w["allocated_bytes"]),
                f"{w['num_blocks']:,}",
            ]
        )
    lines += _table(rows, right={3, 4, 5, 6, 7})
    concurrency = data["max_concurrency"]
    lines += [
        "",
        f"Blocks per rank:   {data['num_blocks']:,} (incl. the null block)",
        f"Block size:        {data['block_size']:,} tokens (hash block size "
        f"{data['hash_block_size']:,})",
        f"Max model len:     {data['max_model_len']:,} tokens",
        f"KV cache tokens:   {data['kv_cache_tokens']:,}",
        "Max concurrency:   "
        + (
            "unbounded (no KV cache)"
            if concurrency is None
            else f"{concurrency:.2f}x for requests of {data['max_model_len']:,} tokens"
        ),
        f"TP replicas:       {data['tp_replicas']}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Plan and print; see the module docstring for the exit status."""
    from kvsvc import models

    if args.list_models:
        for name in models.list_bundled_configs():
            print(name)
        return 0
    try:
        plan, info = _build(args)
    except PlanningError as exc:
        # The plan is impossible as asked: the message says what would fit.
        message = str(exc)
        if args.gpu_memory is not None and MORE_MEMORY_HINT in message:
            # The KV cache's share came from three flags here: show the arithmetic.
            usable = int(args.gpu_memory * args.gpu_memory_utilization) - args.non_kv_memory
            (usable_text,) = format_sizes(usable)
            message += (
                f" Here the KV cache gets --gpu-memory x --gpu-memory-utilization - "
                f"--non-kv-memory = {usable_text} per GPU."
            )
        print(f"kvsvc plan: {message}", file=sys.stderr)
        return 1
    except (_UsageError, ValueError) as exc:
        print(f"kvsvc plan: error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.json:
            print(json.dumps(plan.to_dict(), indent=2))
        else:
            print(render_table(plan, info))
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader (``| head``) went away: not an error of ours.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (keep interpreter exit quiet)
    return 0
