"""Tests for wspool.tools.mla_probe on the CPU: the probe refuses a host it cannot measure on.

Its measurements run FlashInfer's kernels: tests/tools/test_calibrate_gpu.py runs them (through calibrate and bench).
"""

from __future__ import annotations

import pytest
import torch

from wspool.tools.calibrate import NEEDS_GPU
from wspool.tools.mla_probe import MLAWorkspaceProbe
from wspool.tools.search import CalibrationError


def test_the_probe_needs_a_cuda_device() -> None:
    """Without CUDA the probe is a CalibrationError saying where to measure, before any allocation."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the probe would be made")
    with pytest.raises(CalibrationError) as raised:
        MLAWorkspaceProbe()
    assert str(raised.value) == NEEDS_GPU
