"""Tests for wspool.tools.search on the CPU: the minimum-size search against probes with a known threshold."""

from __future__ import annotations

import pytest

from wspool.tools.search import CalibrationError, Probe, search_min_bytes
from wspool.units import MiB


def _threshold_probe(minimum: int, *, names_need: bool) -> tuple[list[int], Probe]:
    """A probe accepting sizes from ``minimum`` up; a failure names ``minimum`` or says nothing (0)."""
    tried: list[int] = []

    def probe(nbytes: int) -> int | None:
        tried.append(nbytes)
        if nbytes >= minimum:
            return None
        return minimum if names_need else 0

    return tried, probe


@pytest.mark.parametrize("names_need", [False, True])
def test_the_search_finds_the_exact_minimum(names_need: bool) -> None:
    """Bisection (or a failure's named need) lands on the exact smallest accepted size."""
    tried, probe = _threshold_probe(3 * MiB + 17, names_need=names_need)
    result = search_min_bytes(probe, start_bytes=MiB)
    assert result.min_bytes == 3 * MiB + 17
    assert result.probe_count == len(tried) and [size for size, _ in result.probes] == tried
    assert (3 * MiB + 17, True) in result.probes and (3 * MiB + 16, False) in result.probes


def test_a_named_need_takes_fewer_probes_than_bisection() -> None:
    """A failure that names the size it needed ends the search in a few probes."""
    blind = search_min_bytes(_threshold_probe(5 * MiB + 3, names_need=False)[1], start_bytes=MiB)
    told = search_min_bytes(_threshold_probe(5 * MiB + 3, names_need=True)[1], start_bytes=MiB)
    assert told.min_bytes == blind.min_bytes == 5 * MiB + 3
    assert told.probe_count <= 4 < blind.probe_count


def test_granularity_rounds_the_minimum_up() -> None:
    """With a granularity the result is the smallest accepted multiple of it."""
    result = search_min_bytes(_threshold_probe(1000, names_need=False)[1], start_bytes=4096, granularity=256)
    assert result.min_bytes == 1024


def test_nothing_accepted_up_to_the_limit_is_a_calibration_error() -> None:
    """A probe that never accepts stops at limit_bytes with a CalibrationError."""
    with pytest.raises(CalibrationError, match=r"still overflows a 8388608-byte \(8MiB\) workspace"):
        search_min_bytes(lambda nbytes: 0, start_bytes=MiB, limit_bytes=8 * MiB)


def test_a_granularity_below_one_is_refused() -> None:
    """granularity must be a positive number of bytes."""
    with pytest.raises(ValueError, match="granularity must be a positive number of bytes, got 0"):
        search_min_bytes(lambda nbytes: None, granularity=0)
