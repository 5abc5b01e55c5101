"""The running-request shortcuts of KVCacheManager behave exactly like the general path."""

from __future__ import annotations

from core_factories import (
    chunked_spec,
    full_spec,
    make_config,
    make_request,
    sliding_spec,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.core import KVCacheManager, RequestState
from kvsvc.specs import KVCacheConfig

CONFIGS = {
    "full": make_config(14, full_spec(4)),
    "full+sliding": make_config(22, full_spec(4), sliding_spec(4, 6)),
    "sliding+chunked": make_config(22, sliding_spec(2, 5), chunked_spec(2, 8)),
}


def build(config: KVCacheConfig, *, shortcuts: bool) -> KVCacheManager:
    manager = KVCacheManager(config, 48, hash_algo="xxh3_128", hash_seed="s")
    if not shortcuts:
        manager._plain_group = None
        manager._windowed_groups = None
    return manager


def state(manager: KVCacheManager) -> tuple[object, ...]:
    pool = manager.block_pool
    return (
        pool.free_queue.get_all_free_blocks(),
        list(pool.ref_cnt),
        list(pool.block_hash),
        [dict(m.req_to_blocks) for m in manager.coordinator.managers],
        [dict(m.num_cached_block) for m in manager.coordinator.managers],
    )


@settings(deadline=None, max_examples=150)
@given(
    name=st.sampled_from(sorted(CONFIGS)),
    ops=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=40,
    ),
)
def test_shortcuts_match_the_general_path(name: str, ops: list[tuple[int, int, int, bool]]) -> None:
    config = CONFIGS[name]
    fast = build(config, shortcuts=True)
    slow = build(config, shortcuts=False)
    assert fast._plain_group is not None or fast._windowed_groups is not None
    requests: dict[str, tuple[RequestState, RequestState]] = {}
    for slot, num_new, lookahead, finish in ops:
        rid = f"r{slot}"
        if rid not in requests:
            prompt = [slot % 2] * 5 + list(range(num_new))
            pair = (make_request(fast, rid, prompt), make_request(slow, rid, prompt))
            outcomes = []
            for manager, request in zip((fast, slow), pair, strict=True):
                hits, num_hits = manager.get_computed_blocks(request)
                blocks = manager.allocate_slots(
                    request, request.num_tokens - num_hits, num_hits, hits, lookahead
                )
                if blocks is not None:
                    request.num_computed_tokens = request.num_tokens
                outcomes.append(None if blocks is None else blocks.get_block_ids())
            assert outcomes[0] == outcomes[1]
            if outcomes[0] is not None:
                requests[rid] = pair
        elif finish:
            for manager, request in zip((fast, slow), requests.pop(rid), strict=True):
                manager.free(request)
        else:
            outcomes = []
            for manager, request in zip((fast, slow), requests[rid], strict=True):
                if request.num_tokens + num_new + lookahead > 44:
                    continue
                request.append_token_ids([7] * num_new)
                blocks = manager.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
                if blocks is None:
                    request.truncate(request.num_tokens - num_new)
                else:
                    request.num_computed_tokens += num_new
                outcomes.append(None if blocks is None else blocks.get_block_ids())
            if outcomes:
                assert outcomes[0] == outcomes[1]
        assert state(fast) == state(slow)


def test_the_shortcuts_are_taken_and_refusals_happen() -> None:
    """Guard for the property test above: its sequences do reach both shortcuts and NO_SPACE."""
    import random

    for name in CONFIGS:
        rng = random.Random(name)
        manager = build(CONFIGS[name], shortcuts=True)
        taken = {"shortcut": 0, "refused": 0}
        for attr in ("_allocate_running_plain", "_allocate_running_windowed"):
            original = getattr(manager, attr)

            def counted(
                *args: object, _original: object = original, _taken: dict[str, int] = taken
            ) -> object:
                _taken["shortcut"] += 1
                return _original(*args)  # type: ignore[operator]

            setattr(manager, attr, counted)
        live: list[RequestState] = []
        for step in range(300):
            if len(live) < 3:
                request = make_request(manager, f"r{step}", [1] * rng.randrange(1, 12))
                hits, num_hits = manager.get_computed_blocks(request)
                if manager.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits):
                    request.num_computed_tokens = request.num_tokens
                    live.append(request)
            elif rng.random() < 0.1:
                manager.free(live.pop(rng.randrange(len(live))))
            else:
                request = rng.choice(live)
                if request.num_tokens > 40:
                    manager.free(request)
                    live.remove(request)
                    continue
                request.append_token_ids([2, 3])
                if manager.allocate_slots(request, 2, num_lookahead_tokens=rng.randrange(3)):
                    request.num_computed_tokens += 2
                else:
                    request.truncate(request.num_tokens - 2)
                    taken["refused"] += 1
        assert taken["shortcut"] > 50 and taken["refused"] > 0, (name, taken)
