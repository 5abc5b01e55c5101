"""The wire fast paths build the same messages as protobuf's constructors.

``StepResults.to_pb`` (server) and ``StepBuilder.to_pb`` (client) write columns whose values
are all one byte on the wire as those bytes and parse them; every other column is set as a
list. Whatever the values (empty, small, at and past the one-byte bound, large, a mix), the
message must equal, and serialize exactly as, the one the constructor builds from the same
columns.
"""

from __future__ import annotations

from typing import Any, cast

from hypothesis import given, settings
from hypothesis import strategies as st
from kvsvc_client._wire import StepBuilder, _indices_of

from kvsvc.server.calls import StepReply
from kvsvc.server.wire import StepResults
from kvsvc.v1 import kvcache_pb2 as pb

# Values around the one-byte bound (127/128) and the two-byte one, and large ones.
_VALUES = st.one_of(
    st.integers(0, 3),
    st.sampled_from([126, 127, 128, 129, 255, 256, 16383, 16384]),
    st.integers(0, 2**31 - 1),
)


def _column(n: int) -> st.SearchStrategy[list[int]]:
    return st.one_of(
        st.lists(st.integers(0, 1), min_size=n, max_size=n),
        st.lists(_VALUES, min_size=n, max_size=n),
    )


@st.composite
def _results(draw: Any) -> StepResults:
    n = draw(st.integers(0, 40))
    groups = draw(st.integers(1, 3))
    results = StepResults(groups)
    results.statuses = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    results.scheduled = draw(_column(n))
    results.computed = draw(_column(n))
    results.cached = draw(_column(n))
    results.num_new_blocks = draw(_column(n * groups))
    results.new_block_ids = draw(st.lists(_VALUES, max_size=60))
    results.num_null_blocks = draw(_column(n * groups))
    results.freed = draw(_column(n))
    results.free_queue_head = draw(st.lists(_VALUES, max_size=20))
    results.num_free_blocks = draw(st.integers(0, 2**40))
    for index in draw(st.lists(st.integers(0, max(0, n - 1)), max_size=3)) if n else []:
        results.errors[index] = pb.StepError(code=3, message=f"bad {index}")
    return results


def _constructed(results: StepResults) -> pb.StepResponse:
    return pb.StepResponse(
        statuses=cast(list[pb.AllocateStatus], results.statuses),
        num_scheduled_tokens=results.scheduled,
        num_computed_tokens=results.computed,
        num_cached_tokens=results.cached,
        num_groups=results.num_groups,
        num_new_blocks=results.num_new_blocks,
        new_block_ids=results.new_block_ids,
        num_null_blocks=results.num_null_blocks,
        num_freed_blocks=results.freed,
        errors=results.errors,
        free_queue_head=results.free_queue_head,
        num_free_blocks=results.num_free_blocks,
    )


@settings(max_examples=300, deadline=None)
@given(_results())
def test_step_response_equals_the_constructors(results: StepResults) -> None:
    fast = results.to_pb()
    slow = _constructed(results)
    assert fast == slow
    assert fast.SerializeToString(deterministic=True) == slow.SerializeToString(deterministic=True)
    assert list(fast.num_computed_tokens) == results.computed
    assert list(fast.statuses) == results.statuses


@settings(max_examples=300, deadline=None)
@given(_results(), st.sampled_from([None, -1, -(2**31), 2**31, 2**64]))
def test_step_reply_bytes_are_protobufs(results: StepResults, bad: int | None) -> None:
    """The reply written from the columns is byte for byte the message's serialization
    (the journal digests it; a journal written before must replay to the same digest)."""
    if bad is not None and results.statuses:
        results.computed = [*results.computed[:-1], bad]
    data = results.to_bytes()
    if results.errors or (bad is not None and bad >= 2**31 and results.statuses):
        assert data is None  # left to protobuf: its map order, its refusal
        return
    assert data == results.to_pb().SerializeToString()
    assert data == _constructed(results).SerializeToString()
    reply = StepReply(data)
    assert reply.SerializeToString() == data
    assert reply == _constructed(results)
    assert list(reply.statuses) == results.statuses


def test_step_reply_writes_every_field_under_its_key() -> None:
    results = StepResults(2)
    results.statuses, results.scheduled, results.computed, results.cached = [1], [2], [3], [4]
    results.num_new_blocks, results.new_block_ids = [5, 0], [6, 7, 8, 9, 10]
    results.num_null_blocks, results.freed, results.free_queue_head = [0, 1], [11], [12]
    results.num_free_blocks = 13
    # Every field set, each to values of its own: a key written under another field's
    # number would not give the constructor's bytes.
    assert results.to_bytes() == _constructed(results).SerializeToString()
    assert len(pb.StepResponse.DESCRIPTOR.fields) == 12


_OPERATION = st.sampled_from(["allocate", "lookup", "free", "preempt"])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            _OPERATION,
            st.lists(st.integers(0, 2**31 - 1), max_size=20),
            st.sampled_from([0, 1, 5, 127, 128, 300, 70000]),
            st.booleans(),
        ),
        max_size=30,
    ),
    st.integers(0, 100),
)
def test_step_request_equals_the_constructors(operations: list[Any], head: int) -> None:
    builder = StepBuilder("pool")
    builder.free_queue_head_limit = head
    for i, (kind, tokens, new, start) in enumerate(operations):
        if kind == "allocate":
            builder.allocate(f"r{i}", tokens, new, start=start, num_lookahead_tokens=new % 3)
        elif kind == "lookup":
            builder.lookup(tokens)
        elif kind == "free":
            builder.free(f"r{i}")
        else:
            builder.preempt(f"r{i}")
    fast = builder.to_pb()
    b = builder
    slow = pb.StepRequest(
        pool="pool",
        types=cast(list[pb.StepOperationType], b._types),
        request_ids=b._ids,
        num_token_ids=b._counts,
        num_new_tokens=b._new,
        num_lookahead_tokens=b._lookahead if any(b._lookahead) else (),
        num_rejected_tokens=b._rejected if any(b._rejected) else (),
        starts=b._starts,
        free_queue_head_limit=head,
    )
    if fast.packed_token_ids:
        slow.packed_token_ids = fast.packed_token_ids
    else:
        slow.token_ids.extend(b._tokens)
    assert fast == slow
    assert fast.SerializeToString(deterministic=True) == slow.SerializeToString(deterministic=True)


@given(st.lists(st.integers(0, 3), max_size=50), st.integers(0, 3))
def test_indices_of_finds_every_position(values: list[int], value: int) -> None:
    assert _indices_of(values, value) == [i for i, v in enumerate(values) if v == value]


# Each RequestStart field set away from its default (presence counts: an explicit 0 for
# the optional max_cache_hit_tokens is a bound, not "no bound").
_SET_STARTS: list[pb.RequestStart] = [
    pb.RequestStart(hashing=pb.HashingContext(cache_salt="salt")),
    pb.RequestStart(skip_prefix_cache_read=True),
    pb.RequestStart(resumed=True),
    pb.RequestStart(num_encoder_tokens=3),
    pb.RequestStart(num_prompt_tokens=5),
    pb.RequestStart(max_cache_hit_tokens=0),
    pb.RequestStart(num_draft_tokens=2),
]


def test_an_empty_start_is_the_default_one_and_any_field_set_is_read() -> None:
    from kvsvc.core import RequestStart
    from kvsvc.server.wire import start_from_pb

    assert start_from_pb(pb.RequestStart(), "start") == RequestStart()
    assert {field.name for field in pb.RequestStart.DESCRIPTOR.fields} == {
        descriptor.name for start in _SET_STARTS for descriptor, _ in start.ListFields()
    }, "a RequestStart field this test does not set"
    for message in _SET_STARTS:
        assert start_from_pb(message, "start") != RequestStart(), message


_INT32 = st.integers(0, 2**31 - 1)
_SMALL_OR_INT32 = st.one_of(st.integers(0, 300), _INT32)


@st.composite
def _outcomes(draw: Any) -> Any:
    from kvsvc.core import AllocateOutcome

    groups = draw(st.integers(1, 3))
    return AllocateOutcome(
        ok=draw(st.booleans()),
        new_block_ids=tuple(draw(st.lists(_SMALL_OR_INT32, max_size=140)) for _ in range(groups)),
        num_null_blocks=tuple(draw(_SMALL_OR_INT32) for _ in range(groups)),
        num_cached_tokens=draw(_SMALL_OR_INT32),
        num_scheduled_tokens=draw(_SMALL_OR_INT32),
        num_computed_tokens=draw(_SMALL_OR_INT32),
        recompute=draw(st.booleans()),
    )


@settings(max_examples=300, deadline=None)
@given(_outcomes())
def test_allocate_reply_bytes_are_protobufs(outcome: Any) -> None:
    from kvsvc.server.calls import AllocateReply
    from kvsvc.server.wire import allocate_reply_bytes, allocate_response

    data = allocate_reply_bytes(outcome)
    message = allocate_response(outcome)
    assert data == message.SerializeToString()
    assert data is not None
    reply = AllocateReply(data)
    assert reply == message and reply.status == message.status
    assert [list(g.block_ids) for g in reply.new_blocks] == [list(g) for g in outcome.new_block_ids]


@given(_outcomes(), st.sampled_from(["block", "null", "count"]), st.integers(-5, -1))
def test_allocate_reply_bytes_leave_a_negative_value_to_protobuf(
    outcome: Any, where: str, bad: int
) -> None:
    import dataclasses

    from kvsvc.server.wire import allocate_reply_bytes

    if where == "block":
        ids = outcome.new_block_ids
        outcome = dataclasses.replace(outcome, new_block_ids=([*ids[0], bad], *ids[1:]))
    elif where == "null":
        nulls = outcome.num_null_blocks
        outcome = dataclasses.replace(outcome, num_null_blocks=(bad, *nulls[1:]))
    else:
        outcome = dataclasses.replace(outcome, num_computed_tokens=bad)
    assert allocate_reply_bytes(outcome) is None
