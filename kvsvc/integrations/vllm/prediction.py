"""What the engine's replica answered for a Step, and how the server's reply is held to it.

The replica (:mod:`kvsvc.integrations.vllm.manager`) answers vLLM at once and queues each
operation for the server; :class:`Prediction` records its answers in the reply's column
layout, so the reply is checked column against column (:func:`as_predicted`, on the
client's sender thread) and, when it differs, the first operation that differs is named
(:func:`describe_divergence`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsvc.v1 import kvcache_pb2 as pb


@dataclass(slots=True)
class Prediction:
    """What the server must answer for one Step: the replica's results, in the reply's
    column layout (see ``StepResponse`` in kvcache.proto)."""

    request_ids: list[str] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    num_new_blocks: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)
    num_null_blocks: list[int] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)
    num_free_blocks: int = 0

    def add(
        self,
        request_id: str,
        new_block_ids: Sequence[Sequence[int]],
        num_null_blocks: Sequence[int],
        status: int,
        groups: int,
    ) -> None:
        """Record the server's answer to the operation just queued (``groups``: the
        engine's KV cache groups; no new blocks is a 0 for each)."""
        self.request_ids.append(request_id)
        self.statuses.append(status)
        if new_block_ids:
            for ids in new_block_ids:
                self.num_new_blocks.append(len(ids))
                self.new_block_ids.extend(ids)
            self.num_null_blocks.extend(num_null_blocks)
        else:
            self.num_new_blocks.extend([0] * groups)
            self.num_null_blocks.extend(num_null_blocks or [0] * groups)
        self.num_cached_tokens.append(0)


def as_predicted(prediction: Prediction, response: Any, num_groups: int) -> bool:
    """Whether a Step's reply (a ``StepResponse``) is exactly what the replica answered."""
    return (
        not response.errors
        and response.num_groups == num_groups
        and list(response.statuses) == prediction.statuses
        and list(response.num_new_blocks) == prediction.num_new_blocks
        and list(response.new_block_ids) == prediction.new_block_ids
        and list(response.num_cached_tokens) == prediction.num_cached_tokens
        and list(response.num_null_blocks) == prediction.num_null_blocks
        and response.num_free_blocks == prediction.num_free_blocks
    )


def describe_divergence(prediction: Prediction, response: Any, groups: int) -> str:
    """Name the first operation whose reply differs from the replica's answer
    (``groups``: the engine's KV cache groups)."""
    got_pos = want_pos = 0
    for i, request_id in enumerate(prediction.request_ids):
        got_counts = list(response.num_new_blocks[i * groups : (i + 1) * groups])
        want_counts = prediction.num_new_blocks[i * groups : (i + 1) * groups]
        got = list(response.new_block_ids[got_pos : got_pos + sum(got_counts)])
        want = prediction.new_block_ids[want_pos : want_pos + sum(want_counts)]
        got_pos += sum(got_counts)
        want_pos += sum(want_counts)
        status = response.statuses[i]
        if (
            status != prediction.statuses[i]
            or got_counts != want_counts
            or got != want
            or response.num_cached_tokens[i] != prediction.num_cached_tokens[i]
        ):
            return (
                f"the server diverged from the engine's replica on {request_id!r}: "
                f"expected blocks {want} (per group {want_counts}) and "
                f"{prediction.num_cached_tokens[i]} cached tokens, got status "
                f"{pb.AllocateStatus.Name(status)}, blocks {got} (per group "
                f"{got_counts}) and {response.num_cached_tokens[i]} cached tokens"
            )
    return (
        f"the server diverged from the engine's replica: {response.num_free_blocks} free "
        f"blocks after a Step, the replica has {prediction.num_free_blocks}"
    )
