"""Flags and flag types shared by the commands (the model flags of ``plan`` and ``worker``).

One definition, so the two commands accept the same spellings, choices and defaults.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from kvsvc.specs import KV_CACHE_DTYPE_CHOICES, MAMBA_CACHE_MODES

MODEL_DTYPES = ("auto", "bfloat16", "float16", "float32")


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (and <= ``maximum`` when given: the
    width of the wire field it goes to), with a message naming the bound."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(
                f"expected an integer in [{minimum}, {maximum}], got {text!r}"
            )
        return value

    return parse


def positive_float(text: str) -> float:
    """An argparse type: a number of seconds (or a ratio) above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_model_source(parser: argparse.ArgumentParser, spec_file_help: str) -> Any:
    """``--model-config`` | ``--spec-file`` (one required); returns the group."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model-config",
        metavar="PATH|NAME",
        help="a Hugging Face config.json (or its directory), or the name of a bundled config",
    )
    source.add_argument("--spec-file", metavar="PATH", help=spec_file_help)
    return source


def add_model_flags(group: Any, *, tp_default: int | None, pp_default: int | None) -> None:
    """Parallel layout, block size and dtypes of the model's KV cache."""
    group.add_argument(
        "--tp", type=int_at_least(1), default=tp_default, metavar="N", help="tensor-parallel size"
    )
    group.add_argument(
        "--pp",
        type=int_at_least(1),
        default=pp_default,
        metavar="N",
        help="pipeline-parallel size (default 1)",
    )
    group.add_argument(
        "--block-size", type=int_at_least(1), default=16, metavar="N", help="tokens per block"
    )
    group.add_argument("--dtype", choices=MODEL_DTYPES, default="auto")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default="auto")
    group.add_argument("--mamba-cache-mode", choices=MAMBA_CACHE_MODES, default="none")
