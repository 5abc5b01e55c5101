"""Human-friendly byte sizes for flags: ``40GiB``, ``512MiB``, ``1.5G``, ``1073741824``."""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """Parse a byte size. Decimal units (GB) are powers of 1000, binary ones (GiB) of 1024.

    Raises:
        ValueError: naming the text and the accepted forms.
    """
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(
            f"invalid byte size {text!r}: use a number with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 40GiB or 512MiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_gib(num_bytes: int | float) -> str:
    """Bytes as GiB with two decimals, the way capacity messages quote them."""
    return f"{num_bytes / 1024**3:.2f}"
