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


def format_sizes(*sizes: int | float) -> tuple[str, ...]:
    """Byte counts side by side, in one unit and precise enough to tell them apart.

    Capacity messages compare what is needed with what is available, and the two often
    differ by one block: at two decimals of a GiB, 128 MiB needed and 127.5 MiB
    available both read "0.12 GiB", which tells the reader nothing. The unit is GiB from
    1 GiB up, else MiB (KiB, B below); decimals grow from 2 until different counts print
    differently (up to 6), and exact byte counts follow when even that is not enough.
    """
    largest = max((abs(s) for s in sizes), default=0)
    unit, scale = next(
        ((name, value) for name, value in _DISPLAY_UNITS if largest >= value), ("B", 1)
    )
    if scale == 1:
        return tuple(f"{int(s)} B" for s in sizes)
    distinct = len(set(sizes))
    for decimals in range(2, 7):
        texts = tuple(f"{s / scale:.{decimals}f} {unit}" for s in sizes)
        if len(set(texts)) == distinct:
            return texts
    return tuple(f"{s / scale:.2f} {unit} ({int(s):,} bytes)" for s in sizes)


_DISPLAY_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))
