"""Byte sizes as capacity messages print them: one unit, precise enough to differ."""

from __future__ import annotations

from kvsvc.units import format_sizes

MiB = 1 << 20
GiB = 1 << 30


def test_sizes_one_block_apart_print_differently() -> None:
    # At two decimals of a GiB both read "0.12": the message would say nothing.
    assert format_sizes(128 * MiB, 128 * MiB - 512 * 1024) == ("128.00 MiB", "127.50 MiB")
    assert format_sizes(8 * GiB + 2 * MiB, 8 * GiB - 2 * MiB) == ("8.002 GiB", "7.998 GiB")


def test_one_unit_for_all_from_the_largest() -> None:
    assert format_sizes(16 * GiB, 512 * MiB) == ("16.00 GiB", "0.50 GiB")
    assert format_sizes(-512 * MiB) == ("-512.00 MiB",)
    assert format_sizes(300 * 1024, 4096) == ("300.00 KiB", "4.00 KiB")
    assert format_sizes(512, 0) == ("512 B", "0 B")


def test_equal_sizes_stay_short_and_near_equal_ones_get_exact_bytes() -> None:
    assert format_sizes(GiB, GiB) == ("1.00 GiB", "1.00 GiB")
    assert format_sizes(GiB + 1, GiB) == (
        "1.00 GiB (1,073,741,825 bytes)",
        "1.00 GiB (1,073,741,824 bytes)",
    )
