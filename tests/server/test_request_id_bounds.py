"""Request ids are bounded in UTF-8 bytes on every path that admits a request.

Regressions: a Step admission took ids over 256 bytes that Free then refused (their blocks
were held until a restart), and the check let 256 four-byte characters (1024 bytes) pass.
"""

from __future__ import annotations

import pytest

from kvsvc.core import PoolKVCache
from kvsvc.errors import InvalidArgument
from kvsvc.server.engine_stats import EngineCounters
from kvsvc.server.step import apply_step
from kvsvc.server.wire import MAX_REQUEST_ID_BYTES, StepColumns, check_request_id
from kvsvc.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvsvc.v1 import kvcache_pb2 as pb


def make_pool() -> PoolKVCache:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    config = KVCacheConfig(num_blocks=16, kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return PoolKVCache(config, max_model_len=64, hash_seed="seed")


@pytest.mark.parametrize(
    "request_id",
    ["x" * (MAX_REQUEST_ID_BYTES + 1), "\U0001f600" * (MAX_REQUEST_ID_BYTES // 4 + 1)],
    ids=["ascii", "four-byte"],
)
def test_ids_over_the_byte_limit_are_refused(request_id: str) -> None:
    assert len(request_id.encode()) > MAX_REQUEST_ID_BYTES
    with pytest.raises(InvalidArgument, match="bytes"):
        check_request_id(request_id)


def test_ids_at_the_limit_pass() -> None:
    check_request_id("x" * MAX_REQUEST_ID_BYTES)
    check_request_id("\U0001f600" * (MAX_REQUEST_ID_BYTES // 4))


def test_a_step_admission_with_a_long_id_is_rejected_and_changes_nothing() -> None:
    cache = make_pool()
    before = cache.usage()
    request = pb.StepRequest(
        pool="p",
        types=[pb.STEP_OPERATION_TYPE_ALLOCATE],
        request_ids=["\U0001f600" * MAX_REQUEST_ID_BYTES],
        num_token_ids=[5],
        token_ids=[1, 2, 3, 4, 5],
        num_new_tokens=[5],
        num_lookahead_tokens=[0],
        num_rejected_tokens=[0],
    )
    request.starts[0].CopyFrom(pb.RequestStart())
    response = apply_step(cache, StepColumns(request, 8192), EngineCounters()).to_pb()
    assert response.errors[0].code == 3  # INVALID_ARGUMENT
    assert response.errors[0].message.startswith("operation 0's request id: longer than")
    assert cache.usage() == before
    assert cache.request_ids() == []
