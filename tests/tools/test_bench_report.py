"""Tests for wspool.tools.bench_report on the CPU: the report of small figures, and their JSON round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from wspool.tools.bench_report import BenchError, failed_sections, format_report, load_figures, save_figures

FIGURES = {
    "machine": {"gpu": "none", "cpu": "2 cores", "python": "3.11", "torch": "2.13", "flashinfer": "0.7.4"},
    "engine_path": {
        "vllm": {
            "version": "0.34.0",
            "rows": [
                {"call": "_get_workspace_buffer", "path": "lse", "own_ns": 100.0, "wspool_ns": 150.0, "ratio": 1.5}
            ],
        },
        "sglang": {"skipped": "not installed"},
    },
    "memory": {"skipped": "needs a CUDA device"},
}


def test_the_report_lists_the_engine_rows_and_the_skipped_sections() -> None:
    """The header names the machine; each engine row shows both timings and their ratio; a skip says why."""
    lines = format_report(FIGURES).split("\n")
    assert lines[0] == "wspool bench: GPU none; CPU 2 cores; python 3.11, torch 2.13, FlashInfer 0.7.4"
    row = next(line for line in lines if "_get_workspace_buffer" in line)
    assert row.split() == ["_get_workspace_buffer", "lse", "100.0", "150.0", "1.50x"]
    assert "  sglang: skipped (not installed)" in lines
    assert "(c) memory: bytes reserved per MLA decode call: skipped: needs a CUDA device" in lines
    assert failed_sections(FIGURES) == []


def test_saved_figures_load_back_equal(tmp_path: Path) -> None:
    """save_figures writes JSON that load_figures reads back unchanged."""
    path = tmp_path / "figures.json"
    save_figures(FIGURES, path)
    assert load_figures(path) == FIGURES


def test_figures_that_cannot_be_written_are_a_bench_error(tmp_path: Path) -> None:
    """Writing into a missing folder is a BenchError naming the path."""
    with pytest.raises(BenchError, match=r"cannot write .*missing/figures\.json"):
        save_figures(FIGURES, tmp_path / "missing" / "figures.json")
