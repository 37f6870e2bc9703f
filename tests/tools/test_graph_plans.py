"""Tests for wspool.tools.graph_plans on the CPU: its arguments are checked before any device work.

The measurement itself captures CUDA graphs: tests/flashinfer/test_wrapper_buffers_gpu.py runs it.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.registry import make_registry
from wspool.tools.graph_plans import BATCH_SIZES, INT_WORKSPACES, KINDS, main, measure_graph_plans


def test_the_capture_list_runs_from_one_to_256() -> None:
    """Twenty batch sizes, increasing, as an engine's capture list runs from 1 to 256."""
    assert len(BATCH_SIZES) == 20 and BATCH_SIZES[0] == 1 and BATCH_SIZES[-1] == 256
    assert list(BATCH_SIZES) == sorted(set(BATCH_SIZES))
    assert (KINDS, INT_WORKSPACES) == (("mla", "paged"), ("pooled", "shared", "flashinfer"))


@pytest.mark.parametrize(("kind", "int_workspace"), [("gqa", "pooled"), ("mla", "mine")])
def test_an_unknown_kind_or_int_workspace_is_refused_first(kind: str, int_workspace: str) -> None:
    """A kind or int workspace outside the lists is a ValueError naming both lists, before any device is read."""
    with pytest.raises(ValueError, match=r"kind must be one of \('mla', 'paged'\) and int_workspace one of"):
        measure_graph_plans(make_registry(), kind=kind, int_workspace=int_workspace)


def test_main_without_a_cuda_device_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """On a host without CUDA the command prints one error line and exits 2."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the measurement would run")
    assert main(["--kind", "paged"]) == 2
    assert capsys.readouterr().err == "python -m wspool.tools.graph_plans: error: needs a CUDA device\n"
