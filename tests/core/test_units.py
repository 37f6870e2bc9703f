"""Tests for wspool.units: parsing and printing sizes."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wspool.errors import SizeError
from wspool.units import MAX_SIZE_BYTES, format_size, parse_size, positive_int, size_spelling_hint


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("256MiB", 256 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("128MB", 128 * 10**6),
        ("4096", 4096),
        (4096, 4096),
        ("0", 0),
        ("64kib", 64 * 1024),
        ("2 GiB", 2 * 2**30),
        ("  1tb ", 10**12),
        ("7b", 7),
        ("1.1KiB", math.ceil(1.1 * 1024)),
    ],
)
def test_parse_size_accepts_units(text: object, expected: int) -> None:
    """Binary and SI units, bare numbers and integers parse to bytes, case-insensitively."""
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("-1MiB", "invalid size"),
        (-5, "must not be negative"),
        ("12 parsecs", "unknown unit 'parsecs'"),
        ("nan", "invalid size 'nan'"),
        (float("nan"), "got float nan"),
        (True, "got bool True"),
        ("", "invalid size ''"),
        ("   ", "invalid size"),
        (1.5, "got float"),
        (None, "got NoneType"),
        ("2PiB", "unknown unit"),
        ("2048TiB", "exceeds the limit"),
        (MAX_SIZE_BYTES + 1, "exceeds the limit"),
    ],
)
def test_parse_size_rejects_bad_input(value: object, match: str) -> None:
    """Negatives, unknown units, NaN, booleans, empty strings and huge sizes are SizeErrors."""
    with pytest.raises(SizeError, match=match):
        parse_size(value)


def test_size_error_names_the_setting() -> None:
    """A size error names the YAML key and the environment variable."""
    with pytest.raises(SizeError, match=r"pools\.x\.max_bytes / WSPOOL_POOLS__X__MAX_BYTES") as info:
        parse_size("lots", setting=("pools", "x", "max_bytes"))
    assert info.value.env_var == "WSPOOL_POOLS__X__MAX_BYTES"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(268435456, "256MiB"), (17301504, "16.5MiB"), (1023, "1023B"), (0, "0B"), (3 * 2**29, "1.5GiB"), (2**40, "1TiB")],
)
def test_format_size(nbytes: int, text: str) -> None:
    """Sizes print in the largest binary unit, exact multiples without decimals."""
    assert format_size(nbytes) == text


@given(st.integers(min_value=0, max_value=MAX_SIZE_BYTES))
def test_exact_sizes_round_trip(nbytes: int) -> None:
    """Every exact format_size output parses back to the same byte count."""
    text = format_size(nbytes)
    if "." not in text:
        assert parse_size(text) == nbytes


@given(st.one_of(st.text(max_size=30), st.integers(), st.floats(), st.booleans(), st.none()))
def test_parse_size_never_crashes(value: object) -> None:
    """Arbitrary input either parses to a bounded size or raises SizeError."""
    try:
        nbytes = parse_size(value)
    except SizeError:
        return
    assert 0 <= nbytes <= MAX_SIZE_BYTES


@pytest.mark.parametrize("text", ["１２", "١٢", "12０MiB", "٣KiB"])
def test_only_ascii_digits_make_a_size(text: str) -> None:
    """Fullwidth and Arabic-Indic digits are not sizes."""
    with pytest.raises(SizeError, match="invalid size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (10**400 + 1, "1e+400B"),
        (-(10**400) - 1, "-1e+400B"),
        (2 * 10**5000, "2e+5000B"),
        (10**40 - 1, "9094947017729282379150390625.0TiB"),
        ((10**20 << 40) + 3, "100000000000000000000.0TiB"),
    ],
    ids=["400-digits", "negative", "5000-digits", "40-digits", "inexact-tib"],
)
def test_format_size_formats_huge_integers(nbytes: int, text: str) -> None:
    """Sizes far beyond any device, of hundreds or thousands of digits, print without OverflowError or ValueError."""
    assert format_size(nbytes) == text


@given(st.integers(min_value=-(10**600), max_value=10**600))
def test_format_size_formats_any_integer(nbytes: int) -> None:
    """format_size returns a size string for every integer."""
    assert format_size(nbytes).endswith("B")


@pytest.mark.parametrize("value", [10**5000, 10**400 + 1], ids=["5000-digits", "400-digits"])
def test_a_huge_integer_size_is_a_readable_size_error(value: int) -> None:
    """An integer size of thousands of digits is a SizeError quoting its magnitude, not Python's ValueError."""
    with pytest.raises(SizeError, match=r"^size 1e\+(5000|400) exceeds the limit of 1024TiB$"):
        parse_size(value)


def test_positive_int_takes_positive_ints_only() -> None:
    """positive_int returns a positive int unchanged and None for zero, negatives, bools and other types."""
    assert positive_int(3) == 3
    assert [positive_int(v) for v in (0, -1, True, 2.0, "4", None)] == [None] * 6


@pytest.mark.parametrize(
    ("text", "fix"),
    [
        ("512M", "write 512MiB (powers of 1024) or 512MB (powers of 1000)"),
        ("1G", "write 1GiB (powers of 1024) or 1GB (powers of 1000)"),
        ("512Mi", "write 512MiB"),
        ("64k", "write 64KiB (powers of 1024) or 64KB (powers of 1000)"),
        ("2 * 1.5g + 1", "write 1.5GiB (powers of 1024) or 1.5GB (powers of 1000)"),
    ],
)
def test_a_kubernetes_or_docker_size_gets_wspools_spelling(text: str, fix: str) -> None:
    """A size written as Kubernetes or Docker write one is answered with wspool's spelling and its units."""
    hint = size_spelling_hint(text)
    assert hint is not None and fix in hint and hint.endswith("the units are B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")


@pytest.mark.parametrize("text", ["512MiB", "batch_size * 4", "round_up(q_len, 256)", "8 * num_heads"])
def test_a_size_or_expression_wspool_takes_gets_no_spelling_hint(text: str) -> None:
    """Sizes and expressions wspool reads are not mistaken for a foreign spelling."""
    assert size_spelling_hint(text) is None


def test_parse_size_suggests_the_spelling_of_a_kubernetes_size() -> None:
    """parse_size('512Mi') lists the units and says to write 512MiB."""
    with pytest.raises(
        SizeError, match=r"unknown unit 'Mi' \(use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB\); write 512MiB"
    ):
        parse_size("512Mi")
