"""Request traces in Mooncake's JSONL format, read and checked; the tokens of a trace block.

One JSON object per line: ``timestamp`` (arrival, ms from the trace's start),
``input_length`` (prompt tokens), ``output_length`` (generated tokens), ``hash_ids`` (one
id per block of ``--trace-block-size`` tokens, the last one maybe partial; equal ids mean
equal prefixes: block ``i``'s id stands for the whole prefix up to it). Other fields are
ignored. The public Mooncake traces (kvcache-ai/Mooncake, ``FAST25-release/traces/``) are
in this format.

A trace says which prefixes are equal, not their tokens, so the replay makes tokens that
are equal exactly where the ids are: block ``i`` with id ``h`` holds the tokens
``d(h) * B .. d(h) * B + B - 1``, where ``d`` numbers the trace's distinct ids in order of
first appearance (so up to 2^31 / B distinct ids never share a token). A partial last
block holds the first tokens of its id's block, so a later prompt that extends it shares
them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TRACE_BLOCK_SIZE = 512
# Token ids are below 2^31; the longest prompt a router takes is 2^20 tokens.
TOKEN_SPACE = 1 << 31
MAX_PROMPT_TOKENS = 1 << 20
MAX_OUTPUT_TOKENS = 1 << 20
# A trace line longer than this is refused before it is parsed.
MAX_LINE_BYTES = 16 << 20


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file, line and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        index: its position in the trace (0 first).
        arrival_s: arrival, seconds from the trace's start.
        input_length: prompt tokens.
        output_length: tokens to generate (at least 1).
        blocks: the prompt's blocks as dense ids (see the module's docstring).
    """

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    blocks: tuple[int, ...]

    def prompt_tokens(self, block_size: int) -> list[int]:
        """The prompt's token ids: equal exactly where the trace's prefixes are."""
        tokens: list[int] = []
        left = self.input_length
        for block in self.blocks:
            base = block * block_size
            n = min(block_size, left)
            tokens.extend(range(base, base + n))
            left -= n
        return tokens

    def output_tokens(self, start: int, count: int) -> list[int]:
        """Generated tokens ``start .. start + count - 1`` (made up, one sequence per
        request, so two requests' outputs do not look alike)."""
        base = (self.index * 7919 + 1) % TOKEN_SPACE
        return [(base + k) % TOKEN_SPACE for k in range(start, start + count)]


def _field(obj: dict[str, object], name: str, where: str, least: int, most: int) -> int:
    value = obj.get(name)
    if type(value) is not int:
        raise TraceError(f"{where}: {name} must be an integer, got {value!r:.40}")
    if not least <= value <= most:
        raise TraceError(f"{where}: {name} {value} is outside [{least}, {most}]")
    return value


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            if len(line) > MAX_LINE_BYTES:
                raise TraceError(f"{path}, line {number}: longer than {MAX_LINE_BYTES} bytes")
            yield number, line


def read_trace(path: str | Path, block_size: int = DEFAULT_TRACE_BLOCK_SIZE) -> list[TraceRequest]:
    """The trace's requests in arrival order (a stable sort by ``timestamp``).

    Args:
        path: the JSONL file.
        block_size: tokens per ``hash_ids`` entry (``--trace-block-size``).

    Raises:
        TraceError: an unreadable file, a line that is not a JSON object, a missing or
            bad field, ``hash_ids`` that do not cover ``input_length`` in blocks of
            ``block_size``, too many distinct ids, or no request at all (each naming the
            line).
    """
    path = Path(path)
    if block_size < 1:
        raise TraceError(f"--trace-block-size must be >= 1, got {block_size}")
    dense: dict[int, int] = {}
    max_ids = TOKEN_SPACE // block_size
    requests: list[TraceRequest] = []
    try:
        for number, raw in _lines(path):
            if not raw.strip():
                continue
            where = f"{path}, line {number}"
            try:
                obj = json.loads(raw)
            except ValueError as exc:
                raise TraceError(f"{where}: not JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object")
            timestamp = obj.get("timestamp")
            if (
                not isinstance(timestamp, int | float)
                or isinstance(timestamp, bool)
                or not 0 <= timestamp < 1e15
            ):
                raise TraceError(f"{where}: timestamp must be a number of ms >= 0")
            input_length = _field(obj, "input_length", where, 1, MAX_PROMPT_TOKENS)
            output_length = _field(obj, "output_length", where, 1, MAX_OUTPUT_TOKENS)
            hash_ids = obj.get("hash_ids")
            if not isinstance(hash_ids, list) or any(type(h) is not int for h in hash_ids):
                raise TraceError(f"{where}: hash_ids must be a list of integers")
            expected = -(-input_length // block_size)
            if len(hash_ids) != expected:
                raise TraceError(
                    f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}: "
                    f"expected {expected} blocks of {block_size} tokens (--trace-block-size)"
                )
            blocks = []
            for h in hash_ids:
                d = dense.get(h)
                if d is None:
                    if len(dense) >= max_ids:
                        raise TraceError(
                            f"{where}: more than {max_ids} distinct hash_ids (2^31 tokens)"
                        )
                    d = dense[h] = len(dense)
                blocks.append(d)
            requests.append(
                TraceRequest(
                    len(requests), float(timestamp) / 1000, input_length, output_length,
                    tuple(blocks),
                )
            )  # fmt: skip
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror}") from None
    if not requests:
        raise TraceError(f"{path}: no request")
    requests.sort(key=lambda r: r.arrival_s)
    return requests
