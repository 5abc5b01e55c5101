"""Real plans from the planner, for the bundled models: every view of block ``b`` stays in
block ``b``'s page of its tensor, in every layout, for every kind of layer."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvsvc import models  # noqa: E402
from kvsvc.errors import PlanningError  # noqa: E402
from kvsvc.planner import PlannerOptions, plan_kv_cache  # noqa: E402
from kvsvc.specs import KVCacheConfig, MambaSpec  # noqa: E402
from kvsvc.worker import allocate_kv_cache, reshape_kv_cache  # noqa: E402
from kvsvc.worker.layouts import resolve_layouts  # noqa: E402

from .helpers import fill_nonzero  # noqa: E402

pytestmark = pytest.mark.torch


def small_plan(model: str, layout: str, rank: int = 0, **spec_options: object) -> KVCacheConfig:
    """The rank's plan with the fewest blocks (a power of two) one short request needs."""
    config, _ = models.resolve_model_config(model)
    specs = models.layer_specs_all_ranks(config, models.ModelSpecOptions(**spec_options))  # type: ignore[arg-type]
    encoder_tokens = min(32, models.default_max_num_encoder_input_tokens(config))
    for blocks in (4, 8, 16, 32, 64):
        options = PlannerOptions(
            max_model_len=32,
            max_num_batched_tokens=32,
            max_num_encoder_input_tokens=encoder_tokens,
            num_gpu_blocks_override=blocks,
            layout=layout,
        )
        try:
            return plan_kv_cache(specs, [1 << 40] * len(specs), options).worker_configs[rank]
        except PlanningError:
            continue
    raise AssertionError(f"{model}: no small plan")


CASES = [
    ("llama-3.2-1b", "layer_outer", {}, "flash"),
    ("llama-3.2-1b", "block_outer", {}, "flash_hnd"),
    ("llama-3.2-1b", "layer_outer", {"tp": 2, "pp": 2}, "kv_first"),
    ("gemma-2-9b", "layer_outer", {}, "kv_first"),  # full + sliding groups share tensors
    ("gemma-2-9b", "layer_outer", {}, "flash"),
    ("deepseek-v2-lite", "block_outer", {}, "flash"),  # MLA
    ("jamba-v0.1", "layer_outer", {"max_model_len": 64}, "kv_first"),  # Mamba + attention
    ("jamba-v0.1", "block_outer", {"mamba_cache_mode": "align"}, "flash"),
    ("whisper-large-v3", "layer_outer", {}, "flash"),  # cross-attention
]


def changed_runs(raw: torch.Tensor) -> list[tuple[int, int]]:
    """The non-zero bytes of ``raw`` as half-open runs ``[start, end)``."""
    index = (raw.view(torch.int8) != 0).nonzero().flatten()
    if index.numel() == 0:
        return []
    gaps = (index[1:] != index[:-1] + 1).nonzero().flatten()
    starts = torch.cat([index[:1], index[gaps + 1]])
    ends = torch.cat([index[gaps] + 1, index[-1:] + 1])
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


@pytest.mark.parametrize(("model", "layout", "spec_options", "attn_layout"), CASES)
def test_every_block_of_every_view_stays_in_its_page(
    model: str, layout: str, spec_options: dict[str, object], attn_layout: str
) -> None:
    config = small_plan(model, layout, **spec_options)
    raw = allocate_kv_cache(config, "cpu", zero=True)
    views = reshape_kv_cache(config, raw, default_layout=attn_layout)
    specs = {name: config.layer_spec(name) for name in config.layer_names}
    layouts = resolve_layouts(specs, default=attn_layout)
    placement = {name: t for t in config.kv_cache_tensors for name in t.shared_by}
    n = config.num_blocks
    assert set(views) == set(config.layer_names)
    owned: dict[int, list[tuple[int, str, list[tuple[int, int]]]]] = {}
    for name, view in views.items():
        tensor = placement[name]
        # K/V-first storage keeps every key first: block b is two half pages far apart,
        # unless Mamba state shares the tensor (then the views are restrided block-major).
        split_kv = name in layouts and layouts[name].kv_first and not config.has_mamba_layers
        for block in (1, n - 1):
            if tensor.is_packed:
                start = block * tensor.block_stride + tensor.offset
                expected = [(start, start + specs[name].page_size_bytes)]
            elif split_kv:
                half = tensor.size // n // 2
                expected = [(block * half, (block + 1) * half)]
                expected.append((n * half + block * half, n * half + (block + 1) * half))
            else:
                page = tensor.size // n
                expected = [(block * page, (block + 1) * page)]
            if isinstance(specs[name], MambaSpec):
                parts = [state[block] for state in view]
            elif layouts[name].kv_first:
                parts = [view[:, block]]
            else:
                parts = [view[block]]
            for part in parts:
                fill_nonzero(part)
            runs = changed_runs(raw[name])
            for part in parts:
                part.zero_()
            assert runs, name
            for run_start, run_end in runs:
                assert any(lo <= run_start and run_end <= hi for lo, hi in expected), (
                    name,
                    block,
                    (run_start, run_end),
                    expected,
                )
            owned.setdefault(id(raw[name]), []).append((block, name, runs))
    # Across the layers sharing a tensor, two different block ids never share a byte.
    for entries in owned.values():
        for block_a, name_a, runs_a in entries:
            for block_b, name_b, runs_b in entries:
                if block_a == block_b:
                    continue
                for a0, a1 in runs_a:
                    for b0, b1 in runs_b:
                        assert a1 <= b0 or b1 <= a0, (name_a, block_a, name_b, block_b)
