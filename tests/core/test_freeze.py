"""Tests for wspool.freeze: torch's private stream functions the capture probe calls, read through one accessor."""

from __future__ import annotations

import pytest
import torch

from wspool.freeze import TORCH_NAMES_READ_FROM, cuda_capture_probe, cuda_stream_functions


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU build of torch has no CUDA stream functions")
def test_a_cuda_build_of_torch_has_the_stream_functions_the_probe_calls() -> None:
    """Fails, naming the functions and the releases they were read from, where a CUDA torch lacks them."""
    raw_stream, capturing = cuda_stream_functions()
    assert raw_stream is not None and capturing is not None, (
        f"torch {torch.__version__} has no torch._C._cuda_getCurrentRawStream or _cuda_isCurrentStreamCapturing "
        f"(read from {TORCH_NAMES_READ_FROM}); wspool.freeze.cuda_stream_functions must change"
    )
    probe = cuda_capture_probe(torch.device("cuda", 0))
    assert getattr(probe, "cuda_parts", None) == (raw_stream, 0, capturing)


def test_a_cpu_build_gets_torchs_public_probe() -> None:
    """Without the C functions the probe is torch's public capture check, never a placeholder."""
    if cuda_stream_functions() != (None, None):
        pytest.skip("this torch has the C functions (a CUDA build)")
    assert cuda_capture_probe(torch.device("cuda", 0)) is torch.cuda.is_current_stream_capturing
