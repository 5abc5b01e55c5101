"""Real plans from the planner, for the bundled models: writing block ``b`` through any view
touches only block ``b``'s bytes, in every layout, for every kind of layer.

The probe is :mod:`kvsvc.worker.cuda_selfcheck`'s, so the GPU self-check runs exactly what
passes here on CPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvsvc.specs import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from kvsvc.worker import allocate_kv_cache, cuda_selfcheck, reshape_kv_cache  # noqa: E402
from kvsvc.worker.cuda_selfcheck import (  # noqa: E402
    PLAN_CASES,
    check_block_ownership,
    check_plan,
    small_plan,
)

pytestmark = pytest.mark.torch


@pytest.mark.parametrize(("model", "layout", "spec_options", "attn_layout"), PLAN_CASES)
def test_every_block_of_every_view_stays_in_its_page(
    model: str, layout: str, spec_options: dict[str, object], attn_layout: str
) -> None:
    config = small_plan(model, layout, **spec_options)
    assert check_plan(config, "cpu", attn_layout) == []


def test_the_probe_catches_views_that_stray_from_their_blocks() -> None:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float16")
    config = KVCacheConfig(  # two groups' layers share one tensor of 4 pages of 256 bytes
        num_blocks=4,
        kv_cache_tensors=[KVCacheTensor(size=4 * 256, shared_by=["a", "b"])],
        kv_cache_groups=[KVCacheGroupSpec(["a"], spec), KVCacheGroupSpec(["b"], spec)],
    )
    raw = allocate_kv_cache(config, "cpu", zero=True)
    views = reshape_kv_cache(config, raw)
    assert check_block_ownership(config, raw, views, "flash") == []
    # A block stride of half a page: block b writes into block b + 1's page.
    views["b"] = torch.as_strided(raw["b"].view(torch.float16), (4, 2, 4, 2, 8), (64, 64, 16, 8, 1))
    problems = check_block_ownership(config, raw, views, "flash")
    assert any(p.startswith("b block 1: wrote [128, 384) outside") for p in problems)
    assert "a block 1 overlaps b block 3" in problems
    views["b"] = torch.zeros(4, 2, 4, 2, 8, dtype=torch.float16)  # a copy: writes go nowhere
    problems = check_block_ownership(config, raw, views, "flash")
    assert "b block 1: nothing written" in problems


def test_the_self_check_runs_on_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cuda_selfcheck, "PLAN_CASES", PLAN_CASES[:1])
    assert cuda_selfcheck.main(["--device", "cpu", "--no-timing"]) == 0
    out = capsys.readouterr().out
    assert "PASS  padded pages" in out and "PASS  llama-3.2-1b layer_outer flash" in out
    assert out.rstrip().endswith("OK: 0 problem(s)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_the_self_check_says_when_there_is_no_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert cuda_selfcheck.main(["--device", "cuda:0"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
