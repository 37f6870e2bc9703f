"""Bound handles on a CUDA device: the steady state asks the device's stream, so a capture retires its buffer.

Every test skips, with the reason, where there is no CUDA device; the CPU side (a probe with CUDA's
parts stood in) is in tests/core/test_handles.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.helpers.registry import make_registry
from tests.reliability.gpu_scratch import current_cuda_device
from wspool.freeze import cuda_stream_functions

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.mark.parametrize("path", ["get", "fetch", "sized", "workspace"])
def test_a_steady_state_call_inside_a_capture_retires_its_buffer_on_growth(path: str) -> None:
    """Calls warmed up on a side stream, then one captured in a graph: growth afterwards retires that buffer."""
    device = current_cuda_device()
    reg = make_registry({"p": {"rules": {"small": "rows * 1MiB", "big": "8MiB"}, "facts": {"rows": 2}}})
    handle = reg.handle("p", "small", device=device, call_facts=("rows",) if path == "sized" else ())
    facts = {"rows": 2}
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "get": handle.get,
        "fetch": lambda: handle.fetch(dict),
        "sized": lambda: handle.sized(facts),
        "workspace": lambda: reg.workspace("p", device, rule="small"),
    }
    call = calls[path]
    call()  # grows
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call().fill_(1)  # the steady state, on a stream that is not the legacy default one
    torch.cuda.current_stream().wait_stream(side)
    assert reg.stats("p", device).retired_bytes == 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call().fill_(2)
    grown = reg.workspace("p", device, rule="big")
    assert grown.numel() == 8 * MiB
    assert reg.stats("p", device).retired_bytes == 2 * MiB
    del graph
    torch.cuda.synchronize()
    assert reg.release_retired() == 2 * MiB


def test_calls_on_the_legacy_default_stream_keep_the_steady_state_and_retire_nothing() -> None:
    """On the legacy default stream (which cannot capture) calls stay in the steady state and count; growth frees."""
    device = current_cuda_device()
    reg = make_registry({"p": {"rules": {"small": "2MiB", "big": "8MiB"}}})
    handle = reg.handle("p", "small", device=device)
    handle.get()
    buffer = handle.get()
    raw_stream, _ = cuda_stream_functions()
    assert raw_stream(device.index) == 0  # the legacy default stream, which cannot capture
    assert handle.held() is buffer
    for _ in range(5):
        assert handle.get() is buffer and reg.workspace("p", device, rule="small") is buffer
    assert reg.stats("p", device).requests_by_rule["small"] == 13
    reg.workspace("p", device, rule="big")
    assert reg.stats("p", device).retired_bytes == 0
