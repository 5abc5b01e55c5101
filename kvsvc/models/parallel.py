"""How an engine splits a model over tensor- and pipeline-parallel ranks.

These rules decide which layers a rank holds and how many KV heads each of its layers
caches; they must match the engine's, or the plan sizes pages the worker will not use.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsvc.errors import InvalidArgument


def get_pp_indices(
    num_layers: int, pp_rank: int, pp_size: int, partition: Sequence[int] | None = None
) -> tuple[int, int]:
    """The ``[start, end)`` layer range pipeline stage ``pp_rank`` holds (vLLM's rule).

    Layers are split evenly; the remainder goes one each to the stages just before the
    last one (the last stage also carries the final norm and LM head, so it is kept
    light): 10 layers over 4 stages -> [2, 3, 3, 2]. ``partition`` (vLLM's
    ``VLLM_PP_LAYER_PARTITION``) gives the per-stage layer counts explicitly.

    Raises:
        InvalidArgument: when the partition does not match the stages or the layers.
    """
    if pp_size < 1:
        raise InvalidArgument("pp", f"must be >= 1, got {pp_size}")
    if not 0 <= pp_rank < pp_size:
        raise InvalidArgument("pp_rank", f"must be in [0, {pp_size}), got {pp_rank}")
    if partition is not None:
        counts = [int(c) for c in partition]
        if len(counts) != pp_size:
            raise InvalidArgument(
                "pp_layer_partition",
                f"has {len(counts)} entries but there are {pp_size} pipeline stages",
            )
        if sum(counts) != num_layers or any(c < 0 for c in counts):
            raise InvalidArgument(
                "pp_layer_partition",
                f"counts {counts} must be non-negative and sum to {num_layers} layers",
            )
    else:
        counts = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            counts[-i] += 1
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


def kv_heads_per_rank(total_kv_heads: int, num_attention_heads: int, tp: int) -> int:
    """KV heads one TP rank caches: split evenly, or one replicated head per rank.

    With fewer KV heads than ranks each rank keeps one head and ``tp / total`` consecutive
    ranks hold the same one (the TP replicas of the plan).

    Raises:
        InvalidArgument: when the heads do not divide over the ranks (or vice versa).
    """
    if num_attention_heads % tp:
        raise InvalidArgument(
            "tp", f"num_attention_heads={num_attention_heads} is not divisible by tp={tp}"
        )
    if total_kv_heads >= tp:
        if total_kv_heads % tp:
            raise InvalidArgument(
                "tp", f"num_key_value_heads={total_kv_heads} is not divisible by tp={tp}"
            )
        return total_kv_heads // tp
    if tp % total_kv_heads:
        raise InvalidArgument(
            "tp",
            f"tp={tp} is not a multiple of num_key_value_heads={total_kv_heads} "
            "(KV heads are replicated only in whole copies)",
        )
    return 1


def shard(value: int, tp: int, what: str) -> int:
    """``value / tp``, requiring an even split (a TP-sharded dimension)."""
    if value % tp:
        raise InvalidArgument("tp", f"{what}={value} is not divisible by tp={tp}")
    return value // tp
