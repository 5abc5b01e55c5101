"""Error messages that reach clients speak the API's terms, not the wire's (issue 34).

A Step is a batch of operations (``StepBuilder.allocate``, ``.free``, ...): its errors
name the operation and what the API calls the value (a request id, a token count), with
the column's name only in brackets for a client that writes the columns itself; a
Lookup's prompt is its ``token_ids`` whichever encoding carried it. Each message is
asserted whole. The Step cases run the server's decoding and apply step on a core pool
(no network); the Lookup and the operation bound go through the Python client and a real
server, as an engine meets them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from kvsvc_client import ClientOptions, InvalidArgumentError, KVCacheClient

from kvsvc.errors import InvalidArgument
from kvsvc.server.config import PoolConfig
from kvsvc.server.engine_stats import EngineCounters
from kvsvc.server.step import apply_step
from kvsvc.server.wire import StepColumns
from kvsvc.v1 import kvcache_pb2 as pb
from tests.server.harness import ServerThread, bring_up, running_server
from tests.server.test_request_id_bounds import make_pool

ALLOCATE, FREE = pb.STEP_OPERATION_TYPE_ALLOCATE, pb.STEP_OPERATION_TYPE_FREE
LOOKUP = pb.STEP_OPERATION_TYPE_LOOKUP


def step(**fields: object) -> pb.StepRequest:
    """A one-operation admission of 4 tokens, with ``fields`` replacing its columns."""
    columns: dict[str, object] = {
        "pool": "p",
        "types": [ALLOCATE],
        "request_ids": ["r"],
        "num_token_ids": [4],
        "token_ids": [1, 2, 3, 4],
        "num_new_tokens": [4],
    }
    columns.update(fields)
    request = pb.StepRequest(**columns)  # type: ignore[arg-type]
    if columns["types"] == [ALLOCATE]:
        request.starts[0].CopyFrom(pb.RequestStart())
    return request


def refused_whole(request: pb.StepRequest, max_operations: int = 8192) -> str:
    with pytest.raises(InvalidArgument) as refused:
        StepColumns(request, max_operations)
    return str(refused.value)


def operation_error(request: pb.StepRequest) -> str:
    """The message of the Step's one rejected operation (the others applied)."""
    response = apply_step(make_pool(), StepColumns(request, 8192), EngineCounters()).to_pb()
    (message,) = [e.message for e in response.errors.values()]
    return message


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"types": [ALLOCATE] * 3},
            "Step: 3 operations exceed the limit of 2 per call (the server's max_step_operations)",
        ),
        (
            {"request_ids": ["r", "s"]},
            "Step: 2 request ids (request_ids) for 1 operations: one per operation",
        ),
        (
            {"num_new_tokens": [4, 4]},
            "Step: 2 num_new_tokens values (num_new_tokens) for 1 operations: one per "
            "operation, or none for all 0",
        ),
        (
            {"num_token_ids": [3]},
            "Step: the operations' token counts (num_token_ids) must be >= 0 and add up to "
            "the 4 token ids sent",
        ),
        (
            # They add up, but one is negative: refused all the same.
            {
                "types": [ALLOCATE] * 2,
                "request_ids": ["r", "s"],
                "num_token_ids": [-1, 5],
                "num_new_tokens": [4, 4],
            },
            "Step: the operations' token counts (num_token_ids) must be >= 0 and add up to "
            "the 4 token ids sent",
        ),
        (
            {"packed_token_ids": b"\x01\x00\x00\x00"},
            "Step token ids: sent both as a list and packed (packed_token_ids): send one of "
            "the two",
        ),
        (
            {"token_ids": [], "packed_token_ids": b"\x01\x00\x00"},
            "Step token ids (packed_token_ids): packed token ids need 4 bytes each, got 3 bytes",
        ),
    ],
    ids=[
        "operations",
        "request-ids",
        "counts",
        "token-counts",
        "negative-token-count",
        "both-encodings",
        "packed",
    ],
)
def test_a_malformed_step_is_refused_in_the_api_s_terms(
    fields: dict[str, object], message: str
) -> None:
    assert refused_whole(step(**fields), max_operations=2) == message


def test_a_start_for_no_operation_names_the_operation() -> None:
    request = step()
    request.starts[5].CopyFrom(pb.RequestStart())
    assert refused_whole(request) == (
        "Step: a start (starts) for operation 5, which is not one of its 1 operations"
    )


def two_operations(second: Callable[[pb.StepRequest], None]) -> pb.StepRequest:
    """A good admission, then an operation ``second`` shapes (its error is the Step's one)."""
    request = step(
        types=[ALLOCATE, FREE],
        request_ids=["r", "s"],
        num_token_ids=[4, 0],
        num_new_tokens=[4, 0],
    )
    request.starts[0].CopyFrom(pb.RequestStart())
    second(request)
    return request


def test_an_operation_s_errors_name_the_operation() -> None:
    def free_with_tokens(request: pb.StepRequest) -> None:
        request.num_new_tokens[1] = 2

    assert operation_error(two_operations(free_with_tokens)) == (
        "operation 1: a free carries a request id only, no tokens, counts or start"
    )

    def unknown_type(request: pb.StepRequest) -> None:
        request.types[1] = 9  # type: ignore[call-overload]

    assert operation_error(two_operations(unknown_type)) == (
        "operation 1: unknown operation type 9; valid: allocate (1), free (2), preempt (3), "
        "lookup (4), cache (5)"
    )

    def empty_id(request: pb.StepRequest) -> None:
        request.request_ids[1] = ""

    assert operation_error(two_operations(empty_id)) == (
        "operation 1's request id: must not be empty"
    )

    def continuation_without_id(request: pb.StepRequest) -> None:
        request.types[1] = ALLOCATE  # a running request's next step: no start
        request.request_ids[1] = ""
        request.num_new_tokens[1] = 1

    assert operation_error(two_operations(continuation_without_id)) == (
        "operation 1's request id: must not be empty"
    )

    def lookup_with_counts(request: pb.StepRequest) -> None:
        request.types[1] = LOOKUP
        request.num_lookahead_tokens.extend([0, 1])

    assert operation_error(two_operations(lookup_with_counts)) == (
        "operation 1: a lookup carries tokens and a start (its hashing context) only, no "
        "num_new_tokens, num_lookahead_tokens, num_rejected_tokens or num_in_flight_tokens"
    )

    def long_salt(request: pb.StepRequest) -> None:
        request.types[1] = ALLOCATE
        request.num_token_ids[:] = [4, 4]
        request.token_ids.extend([5, 6, 7, 8])
        request.num_new_tokens[1] = 4
        request.starts[1].hashing.cache_salt = "s" * 10_000

    message = operation_error(two_operations(long_salt))
    assert message.startswith("operation 1's start.hashing.cache_salt: longer than ")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with running_server(PoolConfig(name="p", world_size=1, max_model_len=64)) as srv:
        ranks = bring_up(srv, kv_cache_bytes=4 << 20)
        yield srv
        for rank in ranks:
            rank.close()


def test_the_python_client_s_errors_name_its_own_arguments(server: ServerThread) -> None:
    options = ClientOptions(timeout=10)
    with KVCacheClient(server.address, pool="p", options=options) as kv:
        # lookup(token_ids): the client packs them, the message does not say so.
        with pytest.raises(InvalidArgumentError) as refused:
            kv.lookup([1] * 65)
        assert refused.value.details == (
            "token_ids: 65 tokens exceed the pool's max_model_len=64: no admission takes a "
            "prompt that long, so none of it can be cached"
        )
        # The example: a StepBuilder past the server's bound.
        builder = kv.step()
        for i in range(8193):
            builder.free(f"r{i}")
        with pytest.raises(InvalidArgumentError) as refused:
            builder.send()
        assert refused.value.details == (
            "Step: 8193 operations exceed the limit of 8192 per call (the server's "
            "max_step_operations)"
        )
