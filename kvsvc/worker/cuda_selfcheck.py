"""Self-check of the worker's device path: profile, allocate real plans, probe the bytes.

Run on a CUDA machine (the unit tests run the same checks on CPU)::

    python -m kvsvc.worker.cuda_selfcheck                 # cuda:0
    python -m kvsvc.worker.cuda_selfcheck --device cuda:1
    python -m kvsvc.worker.cuda_selfcheck --device cpu    # the same checks on the host

Checks:

1. profiling: a baseline snapshot, 384 MiB of stand-in weights and activations, then the
   budget: the non-KV figure must cover the torch peak increase and the KV budget must be
   ``total * utilisation - non_kv``; a fixed budget is taken as is; one larger than the free
   memory is refused.
2. layouts: plans of bundled models (layer-outer and packed; flash, HND, K/V-first, MLA,
   Mamba hybrid, cross-attention) are allocated on the device; writing block ``b`` through
   each view must change bytes of block ``b``'s page only, and two block ids never share a
   byte across the layers of one tensor; the views' shapes and strides equal the CPU ones.
3. allocation time of a 1 GiB plan, without and with zeroing (reported, not judged).

Exit status: 0 every check passed, 1 a check failed, 2 the device is unavailable.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

import torch

from kvsvc.errors import InvalidArgument, PlanningError
from kvsvc.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from kvsvc.worker.allocation import (
    KVCacheView,
    allocate_kv_cache,
    describe_views,
    reshape_kv_cache,
)
from kvsvc.worker.layouts import resolve_layouts
from kvsvc.worker.profiling import profile_memory, take_cuda_snapshot

MiB = 1 << 20

# (model, planner layout, spec options, attention layout)
PLAN_CASES: list[tuple[str, str, dict[str, object], str]] = [
    ("llama-3.2-1b", "layer_outer", {}, "flash"),
    ("llama-3.2-1b", "block_outer", {}, "flash_hnd"),
    ("llama-3.2-1b", "layer_outer", {"tp": 2, "pp": 2}, "kv_first"),
    ("gemma-2-9b", "layer_outer", {}, "kv_first"),
    ("deepseek-v2-lite", "block_outer", {}, "flash"),
    ("jamba-v0.1", "layer_outer", {"max_model_len": 64}, "kv_first"),
    ("jamba-v0.1", "block_outer", {"mamba_cache_mode": "align"}, "flash"),
    ("whisper-large-v3", "layer_outer", {}, "flash"),
]


def small_plan(model: str, layout: str, **spec_options: object) -> KVCacheConfig:
    """Rank 0's plan with the fewest blocks (a power of two) one 32-token request needs."""
    from kvsvc import models
    from kvsvc.planner import PlannerOptions, plan_kv_cache

    config, _ = models.resolve_model_config(model)
    options = models.ModelSpecOptions(**spec_options)  # type: ignore[arg-type]
    specs = models.layer_specs_all_ranks(config, options)
    encoder_tokens = min(32, models.default_max_num_encoder_input_tokens(config))
    for blocks in (4, 8, 16, 32, 64):
        planner_options = PlannerOptions(
            max_model_len=32,
            max_num_batched_tokens=32,
            max_num_encoder_input_tokens=encoder_tokens,
            num_gpu_blocks_override=blocks,
            layout=layout,
        )
        try:
            return plan_kv_cache(specs, [1 << 40] * len(specs), planner_options).worker_configs[0]
        except PlanningError:
            continue
    raise PlanningError(f"{model}: no plan of up to 64 blocks holds one 32-token request")


def padded_plan() -> KVCacheConfig:
    """One layer whose pages carry padding (hybrid page unification)."""
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16", page_size_padded=9216
    )
    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[KVCacheTensor(size=8 * 9216, shared_by=["l0"])],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
    )


def _changed_runs(raw: torch.Tensor) -> list[tuple[int, int]]:
    index = (raw.view(torch.int8) != 0).nonzero().flatten()
    if index.numel() == 0:
        return []
    gaps = (index[1:] != index[:-1] + 1).nonzero().flatten()
    starts = torch.cat([index[:1], index[gaps + 1]])
    ends = torch.cat([index[gaps] + 1, index[-1:] + 1])
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def _fill(view: torch.Tensor) -> None:
    view.fill_(1.1 if view.dtype.is_floating_point else 7)


def check_block_ownership(
    config: KVCacheConfig,
    raw: dict[str, torch.Tensor],
    views: dict[str, KVCacheView],
    default_layout: str,
) -> list[str]:
    """Write block 1 and the last block through every view; return what went wrong.

    ``raw`` must be zeroed. Block ``b`` may touch only its page (packed: its slot in the
    block stride; K/V-first storage without Mamba: its K and V half-pages), and two block
    ids never share a byte across the layers of one tensor.
    """
    problems: list[str] = []
    specs = {name: config.layer_spec(name) for name in config.layer_names}
    layouts = resolve_layouts(specs, default=default_layout)
    placement = {name: t for t in config.kv_cache_tensors for name in t.shared_by}
    n = config.num_blocks
    owned: dict[int, list[tuple[int, str, list[tuple[int, int]]]]] = {}
    for name in config.layer_names:
        view, tensor = views[name], placement[name]
        split_kv = name in layouts and layouts[name].kv_first and not config.has_mamba_layers
        for block in (1, n - 1):
            if tensor.is_packed:
                start = block * tensor.block_stride + tensor.offset
                expected = [(start, start + specs[name].page_size_bytes)]
            elif split_kv:
                half = tensor.size // n // 2
                expected = [
                    (block * half, (block + 1) * half),
                    (n * half + block * half, n * half + (block + 1) * half),
                ]
            else:
                page = tensor.size // n
                expected = [(block * page, (block + 1) * page)]
            if isinstance(view, list):
                parts = [state[block] for state in view]
            elif layouts[name].kv_first:
                parts = [view[:, block]]
            else:
                parts = [view[block]]
            for part in parts:
                _fill(part)
            runs = _changed_runs(raw[name])
            for part in parts:
                part.zero_()
            if not runs:
                problems.append(f"{name} block {block}: nothing written")
            for lo, hi in runs:
                if not any(a <= lo and hi <= b for a, b in expected):
                    problems.append(f"{name} block {block}: wrote [{lo}, {hi}) outside {expected}")
            owned.setdefault(id(raw[name]), []).append((block, name, runs))
    for entries in owned.values():
        for block_a, name_a, runs_a in entries:
            for block_b, name_b, runs_b in entries:
                if block_a < block_b and any(
                    a0 < b1 and b0 < a1 for a0, a1 in runs_a for b0, b1 in runs_b
                ):
                    problems.append(f"{name_a} block {block_a} overlaps {name_b} block {block_b}")
    return problems


def _check(label: str, run: Callable[[], list[str]], failures: list[str]) -> None:
    try:
        problems = run()
    except Exception as exc:
        problems = [f"{type(exc).__name__}: {exc}"]
    status = "PASS" if not problems else "FAIL"
    print(f"{status}  {label}")
    for problem in problems[:10]:
        print(f"      {problem}")
    failures.extend(f"{label}: {p}" for p in problems)


def check_cuda_profile(device: str, utilization: float) -> list[str]:
    dev = torch.device(device)
    problems = []
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    baseline = take_cuda_snapshot(dev)
    weights = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
    activations = torch.empty(128 * MiB, dtype=torch.uint8, device=dev)
    del activations  # freed, but part of the peak
    torch.cuda.synchronize(dev)
    profile = profile_memory(device, gpu_memory_utilization=utilization, baseline=baseline)
    gib = 1 << 30
    print(
        f"      total {profile.total_bytes / gib:.2f} GiB, free {profile.free_bytes / gib:.2f} "
        f"GiB, non-KV {profile.non_kv_bytes / MiB:.0f} MiB, KV {profile.kv_cache_bytes / gib:.2f} "
        "GiB"
    )
    if profile.non_kv_bytes < 384 * MiB:
        problems.append(f"non-KV {profile.non_kv_bytes} B misses the 384 MiB torch peak")
    expected = int(profile.total_bytes * utilization) - profile.non_kv_bytes
    if profile.kv_cache_bytes != expected:
        problems.append(f"KV budget {profile.kv_cache_bytes} != total*util - non_kv {expected}")
    fixed = profile_memory(device, kv_cache_memory=64 * MiB)
    if fixed.kv_cache_bytes != 64 * MiB:
        problems.append(f"fixed budget came back as {fixed.kv_cache_bytes}")
    try:
        profile_memory(device, kv_cache_memory=profile.total_bytes * 2)
        problems.append("a budget of twice the device was accepted")
    except InvalidArgument:
        pass
    del weights
    return problems


def check_cpu_profile() -> list[str]:
    profile = profile_memory("cpu", kv_cache_memory=64 * MiB)
    if profile.kv_cache_bytes != 64 * MiB or not 0 < profile.free_bytes <= profile.total_bytes:
        return [f"unexpected profile {profile}"]
    try:
        profile_memory("cpu", kv_cache_memory=profile.total_bytes * 4)
    except InvalidArgument:
        return []
    return ["a budget of four times the host memory was accepted"]


def check_plan(config: KVCacheConfig, device: str, default_layout: str) -> list[str]:
    raw = allocate_kv_cache(config, device, zero=True)
    views = reshape_kv_cache(config, raw, default_layout=default_layout)
    problems = check_block_ownership(config, raw, views, default_layout)
    cpu_raw = allocate_kv_cache(config, "cpu")
    cpu_views = reshape_kv_cache(config, cpu_raw, default_layout=default_layout)
    here = [(i.layer_name, i.shape, i.stride, i.dtype) for i in describe_views(views)]
    there = [(i.layer_name, i.shape, i.stride, i.dtype) for i in describe_views(cpu_views)]
    if here != there:
        problems.append("view shapes/strides differ from the CPU ones")
    wrong_device = [n for n, t in raw.items() if t.device != torch.device(device)]
    if wrong_device:
        problems.append(f"tensors not on {device}: {wrong_device[:3]}")
    return problems


def time_allocation(device: str) -> list[str]:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    num_blocks = (1 << 30) // (8 * spec.page_size_bytes)
    names = [f"l{i}" for i in range(8)]
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=num_blocks * spec.page_size_bytes, shared_by=[n]) for n in names
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    for zero in (False, True):
        started = time.perf_counter()
        raw = allocate_kv_cache(config, device, zero=zero)
        if device.startswith("cuda"):
            torch.cuda.synchronize(torch.device(device))
        elapsed = time.perf_counter() - started
        print(f"      1 GiB in 8 tensors, zero={zero}: {elapsed * 1000:.1f} ms")
        del raw
    return []


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvsvc.worker.cuda_selfcheck", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--device", default="cuda:0", help="cuda:N (default cuda:0) or cpu")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--no-timing", action="store_true", help="skip the 1 GiB allocation")
    args = parser.parse_args(argv)
    device = args.device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            print(f"{device}: CUDA is not available (torch {torch.__version__})", file=sys.stderr)
            return 2
        print(f"device {device}: {torch.cuda.get_device_name(torch.device(device))}")
    failures: list[str] = []
    if device.startswith("cuda"):
        _check(
            "profiling (baseline, peak, non-torch, utilisation)",
            lambda: check_cuda_profile(device, args.gpu_memory_utilization),
            failures,
        )
    else:
        _check("profiling (host budget vs MemAvailable)", check_cpu_profile, failures)
    _check("padded pages", lambda: check_plan(padded_plan(), device, "flash"), failures)
    for model, layout, options, attn_layout in PLAN_CASES:
        label = f"{model} {layout} {options or ''} {attn_layout}".replace("  ", " ")
        _check(
            label,
            lambda m=model, lay=layout, o=options, a=attn_layout: check_plan(  # type: ignore[misc]
                small_plan(m, lay, **o), device, a
            ),
            failures,
        )
    if not args.no_timing:
        _check("allocation time", lambda: time_allocation(device), failures)
    print(f"{'OK' if not failures else 'FAILED'}: {len(failures)} problem(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
