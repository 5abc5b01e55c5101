"""Raw tensors and per-layer views: every view addresses exactly the bytes the plan says.

Each test writes through a view and checks which raw bytes changed, the way vLLM's worker
reshape (``_allocate_kv_cache`` / ``_reshape_kv_cache``) must behave: block ``b`` of a
layer lives at its planned offset and nowhere else.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvsvc.errors import InvalidArgument  # noqa: E402
from kvsvc.specs import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvsvc.worker import (  # noqa: E402
    AllocationError,
    allocate_kv_cache,
    allocated_bytes,
    describe_views,
    reshape_kv_cache,
    torch_dtype,
)

from .helpers import (  # noqa: E402
    block_outer,
    byte_offset,
    byte_range,
    changed_bytes,
    fill_nonzero,
    layer_outer,
)

pytestmark = pytest.mark.torch

# 4 tokens x 2 heads x (8 K + 8 V) x 2 bytes = 256-byte pages, 128-byte K/V halves.
ATT = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float16")
PAGE = 256
HALF = 128


def build(config: KVCacheConfig, **kwargs):  # type: ignore[no-untyped-def]
    raw = allocate_kv_cache(config, "cpu", zero=True)
    return raw, reshape_kv_cache(config, raw, **kwargs)


def test_flash_layout_block_b_is_its_page_and_nothing_else() -> None:
    config = layer_outer(5, [(["a0", "a1"], ATT)])
    raw, views = build(config)
    view = views["a0"]
    assert view.shape == (5, 2, 4, 2, 8) and view.dtype == torch.float16
    fill_nonzero(view[3])
    assert changed_bytes(raw["a0"]) == byte_range(3 * PAGE, PAGE)
    assert changed_bytes(raw["a1"]) == []
    # V of token 1, head 0 in block 3: the V half, then token-major (NHD).
    assert byte_offset(view, (3, 1, 1, 0, 0)) == 3 * PAGE + HALF + 1 * 2 * 8 * 2


def test_hnd_stride_order_puts_heads_before_tokens_in_memory() -> None:
    config = layer_outer(5, [(["a0"], ATT)])
    _, views = build(config, layouts={"a0": "flash_hnd"})
    view = views["a0"]
    assert view.shape == (5, 2, 4, 2, 8)  # logical shape unchanged
    # block 3, V, token 2, head 1: head-major inside the half page.
    assert byte_offset(view, (3, 1, 2, 1, 0)) == 3 * PAGE + HALF + 1 * (4 * 8 * 2) + 2 * (8 * 2)


def test_kv_first_layout_keeps_all_keys_then_all_values() -> None:
    config = layer_outer(5, [(["a0"], ATT)])
    raw, views = build(config, layouts={"a0": "kv_first"})
    view = views["a0"]
    assert view.shape == (2, 5, 4, 2, 8)
    fill_nonzero(view[:, 3])
    assert changed_bytes(raw["a0"]) == byte_range(3 * HALF, HALF) + byte_range(
        5 * HALF + 3 * HALF, HALF
    )


def test_padded_pages_skip_the_padding_through_the_block_stride() -> None:
    padded = FullAttentionSpec(
        block_size=4, num_kv_heads=2, head_size=8, dtype="float16", page_size_padded=320
    )
    config = layer_outer(5, [(["a0"], padded)])
    raw, views = build(config)
    view = views["a0"]
    assert view.stride(0) * 2 == 320
    fill_nonzero(view[3])
    assert changed_bytes(raw["a0"]) == byte_range(3 * 320, PAGE)
    fill_nonzero(view)
    expected = [b for block in range(5) for b in byte_range(block * 320, PAGE)]
    assert changed_bytes(raw["a0"]) == expected  # the padding tails stay untouched


def test_padded_pages_refuse_a_kv_first_layout() -> None:
    padded = FullAttentionSpec(
        block_size=4, num_kv_heads=2, head_size=8, dtype="float16", page_size_padded=320
    )
    config = layer_outer(5, [(["a0"], padded)])
    raw = allocate_kv_cache(config, "cpu")
    with pytest.raises(AllocationError, match=r"padded pages .* need a blocks-first layout"):
        reshape_kv_cache(config, raw, layouts={"a0": "kv_first"})


def test_packed_layout_addresses_offset_and_block_stride() -> None:
    # Group 0 packs a and b side by side (stride 512); group 1's c aliases a at offset 0.
    config = block_outer(4, [(["a", "b"], ATT), (["c"], ATT)])
    raw, views = build(config)
    assert raw["a"] is raw["b"] is raw["c"]
    assert allocated_bytes(raw) == 4 * 2 * PAGE
    view_b = views["b"]
    assert view_b.stride(0) * 2 == 2 * PAGE
    fill_nonzero(view_b[2])
    assert changed_bytes(raw["b"]) == byte_range(2 * 2 * PAGE + PAGE, PAGE)
    assert byte_offset(views["c"], (1, 0, 0, 0, 0)) == byte_offset(views["a"], (1, 0, 0, 0, 0))


def test_packed_layout_refuses_kv_first() -> None:
    config = block_outer(4, [(["a", "b"], ATT)])
    raw = allocate_kv_cache(config, "cpu")
    with pytest.raises(AllocationError, match=r"packed plan needs a blocks-first layout"):
        reshape_kv_cache(config, raw, layouts={"b": "kv_first"})


def test_layers_of_two_groups_sharing_a_tensor_see_the_same_bytes() -> None:
    window = SlidingWindowSpec(
        block_size=4, num_kv_heads=2, head_size=8, dtype="float16", sliding_window=8
    )
    config = layer_outer(6, [(["full0"], ATT), (["swa0"], window)])
    raw, views = build(config)
    assert raw["full0"] is raw["swa0"]
    views["full0"][2].copy_(torch.arange(2 * 4 * 2 * 8, dtype=torch.float16).view(2, 4, 2, 8))
    assert torch.equal(views["swa0"][2], views["full0"][2])
    assert views["swa0"][1].abs().sum() == 0


MAMBA = MambaSpec(
    block_size=4, shapes=((3, 4), (2, 5)), dtypes=("float16", "float32"), page_size_padded=96
)  # 24 + 40 = 64 state bytes in a 96-byte page


def test_mamba_states_are_strided_views_at_their_offsets() -> None:
    config = layer_outer(6, [(["m0"], MAMBA)])
    raw, views = build(config)
    conv, ssm = views["m0"]
    assert conv.shape == (6, 3, 4) and conv.dtype == torch.float16
    assert ssm.shape == (6, 2, 5) and ssm.dtype == torch.float32
    assert conv.stride() == (48, 4, 1) and ssm.stride() == (24, 5, 1)
    fill_nonzero(conv[2])
    assert changed_bytes(raw["m0"]) == byte_range(2 * 96, 24)
    fill_nonzero(ssm[2])
    assert changed_bytes(raw["m0"]) == byte_range(2 * 96, 64)


def test_mamba_plans_are_zeroed_and_attention_plans_are_not(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls: list[str] = []
    real_zeros, real_empty = torch.zeros, torch.empty

    def zeros(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("zeros")
        return real_zeros(*args, **kwargs)

    def empty(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("empty")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(torch, "empty", empty)
    allocate_kv_cache(layer_outer(6, [(["m0"], MAMBA)]), "cpu")
    assert calls == ["zeros"]
    calls.clear()
    allocate_kv_cache(layer_outer(6, [(["a0", "a1"], ATT)]), "cpu")
    assert calls == ["empty", "empty"]
    calls.clear()
    fp8 = FullAttentionSpec(
        block_size=4,
        num_kv_heads=4,
        head_size=8,
        dtype="float8_e4m3fn",
        kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
    )  # same page as ATT, other precision: a reused block would decode stale bytes
    allocate_kv_cache(layer_outer(6, [(["a0"], ATT), (["q0"], fp8)]), "cpu")
    assert calls == ["zeros"]


def test_hybrid_plans_make_kv_first_blocks_contiguous() -> None:
    attention = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=6, dtype="float16")
    assert attention.page_size_bytes == MAMBA.page_size_bytes == 96
    config = layer_outer(5, [(["att"], attention), (["mam"], MAMBA)])
    raw, views = build(config, layouts={"att": "kv_first"})
    view = views["att"]
    assert view.shape == (2, 5, 4, 1, 6)
    fill_nonzero(view[:, 3])  # K and V of block 3
    assert changed_bytes(raw["att"]) == byte_range(3 * 96, 96)
    conv, _ = views["mam"]
    assert byte_offset(conv, (3, 0, 0)) == 3 * 96


def test_mixed_layouts_on_one_tensor_follow_the_kv_first_storage() -> None:
    window = SlidingWindowSpec(
        block_size=4, num_kv_heads=2, head_size=8, dtype="float16", sliding_window=8
    )
    config = layer_outer(5, [(["kf"], ATT), (["bf"], window)])
    raw, views = build(config, layouts={"kf": "kv_first", "bf": "flash"})
    blocks_first, kv_first = views["bf"], views["kf"]
    assert blocks_first.shape == (5, 2, 4, 2, 8)
    fill_nonzero(blocks_first[3])
    assert changed_bytes(raw["bf"]) == byte_range(3 * HALF, HALF) + byte_range(
        5 * HALF + 3 * HALF, HALF
    )
    for kv in (0, 1):
        assert byte_offset(blocks_first, (3, kv, 0, 0, 0)) == byte_offset(
            kv_first, (kv, 3, 0, 0, 0)
        )


def test_a_kv_sharing_layer_aliases_its_target() -> None:
    config = layer_outer(4, [(["a0", "a1"], ATT)])
    _, views = build(config, shared_layers={"a5": "a0"})
    assert views["a5"] is views["a0"]
    with pytest.raises(InvalidArgument, match=r"shared_layers\[a6\].*not a planned layer"):
        build(config, shared_layers={"a6": "nope"})


def test_mla_layers_get_one_latent_row_per_token() -> None:
    mla = MLAAttentionSpec(block_size=4, num_kv_heads=1, head_size=10, dtype="bfloat16")
    config = layer_outer(3, [(["m"], mla)])
    raw, views = build(config)
    assert views["m"].shape == (3, 4, 10) and views["m"].dtype == torch.bfloat16
    fill_nonzero(views["m"][1, 2])
    assert changed_bytes(raw["m"]) == byte_range(80 + 2 * 20, 20)
    with pytest.raises(InvalidArgument, match=r"MLA layers use the 'mla' layout"):
        build(config, layouts={"m": "flash"})


def test_fp8_ds_mla_rows_and_aligned_deepseek_v4_pages() -> None:
    v32 = MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=576,
        dtype="uint8",
        kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        cache_dtype_str="fp8_ds_mla",
    )
    _, views = build(layer_outer(2, [(["m"], v32)]))
    assert views["m"].shape == (2, 64, 656)
    v4 = MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=512,
        dtype="uint8",
        kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        cache_dtype_str="fp8_ds_mla",
        model_version="deepseek_v4",
        compress_ratio=4,
        alignment=4096,
    )
    assert v4.page_size_bytes == 12288  # 16 rows x 584 bytes, aligned up
    raw, views = build(layer_outer(2, [(["m"], v4)]))
    assert views["m"].shape == (2, 16, 584) and views["m"].stride(0) == 12288
    fill_nonzero(views["m"][1])
    assert changed_bytes(raw["m"]) == byte_range(12288, 16 * 584)


def test_per_token_head_scales_widen_the_row() -> None:
    int8 = FullAttentionSpec(
        block_size=4,
        num_kv_heads=2,
        head_size=8,
        dtype="int8",
        kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD,
    )
    assert int8.page_size_bytes == 192  # 128 value bytes + 2 x 4 x 2 fp32 scales
    _, views = build(layer_outer(3, [(["q"], int8)]))
    assert views["q"].shape == (3, 2, 4, 2, 12)  # 8 int8 values + a 4-byte scale per row


def test_unequal_key_and_value_heads_use_the_diffkv_layout() -> None:
    diff = FullAttentionSpec(
        block_size=4, num_kv_heads=2, head_size=8, head_size_v=4, dtype="float16"
    )
    _, views = build(layer_outer(3, [(["d"], diff)]))
    assert views["d"].shape == (3, 4, 2, 12)
    with pytest.raises(InvalidArgument, match=r"only the 'diffkv' layout"):
        build(layer_outer(3, [(["d"], diff)]), layouts={"d": "kv_first"})


def test_kernel_blocks_split_a_plan_block() -> None:
    big = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype="float16")
    config = layer_outer(3, [(["a"], big)])
    raw, views = build(config, kernel_block_sizes={"a": 4})
    view = views["a"]
    assert view.shape == (12, 2, 4, 2, 8)
    fill_nonzero(view[4 * 2 + 1])  # plan block 2, second kernel block
    assert changed_bytes(raw["a"]) == byte_range(2 * 1024 + 256, 256)
    with pytest.raises(InvalidArgument, match=r"kernel_block_size"):
        build(config, kernel_block_sizes={"a": 5})


def test_uniform_type_groups_give_each_layer_its_own_page() -> None:
    small = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    uniform = UniformTypeKVCacheSpecs(block_size=4, kv_cache_specs={"big": ATT, "small": small})
    config = KVCacheConfig(
        num_blocks=3,
        kv_cache_tensors=[KVCacheTensor(3 * PAGE, ["big"]), KVCacheTensor(3 * 128, ["small"])],
        kv_cache_groups=[KVCacheGroupSpec(["big", "small"], uniform)],
    )
    _, views = build(config)
    assert views["big"].shape == (3, 2, 4, 2, 8)
    assert views["small"].shape == (3, 2, 4, 1, 8)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([KVCacheTensor(4 * PAGE, ["a0"])], "gives no tensor to layer.*a1"),
        (
            [KVCacheTensor(4 * PAGE, ["a0"]), KVCacheTensor(4 * PAGE, ["a1", "zz"])],
            "names layer 'zz'",
        ),
        (
            [KVCacheTensor(4 * PAGE, ["a0"]), KVCacheTensor(4 * PAGE, ["a1", "a0"])],
            "'a0' is in plan tensors 0 and 1",
        ),
        (
            [KVCacheTensor(4 * PAGE, ["a0"]), KVCacheTensor(5 * PAGE, ["a1"])],
            "is not num_blocks=4 pages of 256 bytes",
        ),
    ],
)
def test_plans_that_disagree_with_the_pages_are_refused(
    tensors: list[KVCacheTensor], message: str
) -> None:
    config = KVCacheConfig(4, tensors, [KVCacheGroupSpec(["a0", "a1"], ATT)])
    with pytest.raises(AllocationError, match=message):
        raw = allocate_kv_cache(config, "cpu")
        reshape_kv_cache(config, raw)


def test_unknown_layout_names_list_the_valid_ones() -> None:
    config = layer_outer(2, [(["a0"], ATT)])
    with pytest.raises(InvalidArgument, match=r"attn_layout\[a0\].*valid layouts: flash, "):
        build(config, layouts={"a0": "paged"})


def test_describe_views_lists_each_tensor_with_shape_stride_and_dtype() -> None:
    attention = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=6, dtype="float16")
    _, views = build(layer_outer(6, [(["a0"], attention), (["m0"], MAMBA)]))
    infos = describe_views(views)
    assert [(i.layer_name, i.shape, i.stride, i.dtype) for i in infos] == [
        ("a0", (6, 2, 4, 1, 6), (48, 24, 6, 6, 1), "float16"),
        ("m0", (6, 3, 4), (48, 4, 1), "float16"),
        ("m0", (6, 2, 5), (24, 5, 1), "float32"),
    ]


def test_torch_dtype_maps_every_spec_dtype_name() -> None:
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("fp8") is torch.float8_e4m3fn
    assert torch_dtype("torch.uint8") is torch.uint8
    with pytest.raises(InvalidArgument, match=r"unknown dtype 'float7'"):
        torch_dtype("float7")
