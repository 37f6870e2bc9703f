"""The SGLang integration's serving on cuda:0, with factories shaped like SGLang 0.5.23's; SGLang not needed.

SGLang's factories name ``"cuda"`` (``model_runner.device``). On a GPU the
integration learns their size, dtype and device under PyTorch's fake-tensor
mode, which must resolve ``"cuda"`` to the current device and allocate
nothing, and serves the pool's buffer there. Every test skips, with the
reason, where there is no CUDA device.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import wspool
from wspool.errors import WorkspaceFrozenError
from wspool.integrations import sglang as sg

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture(autouse=True)
def on_cuda() -> Iterator[torch.device]:
    """The integration with no device override (SGLang's own devices), on cuda:0."""
    sg.configure()
    torch.cuda.set_device(0)
    yield torch.device("cuda", 0)
    torch.cuda.synchronize()
    sg.unregister()


def _own(name: str) -> Any:
    raise AssertionError(f"SGLang's own get_buffer was called for {name}")


def _serve(name: str, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    factory = lambda: torch.zeros(nbytes // dtype.itemsize, dtype=dtype, device="cuda")  # noqa: E731
    return sg.serve(name, factory, lambda: _own(name))  # type: ignore[no-any-return]


def test_cuda_factories_are_served_on_the_current_device(on_cuda: torch.device) -> None:
    """Each workspace lands on cuda:0 from its pool; SGLang's factories allocate no device memory."""
    gc.collect()  # earlier tests' garbage must not be freed inside the measurement
    before = torch.cuda.memory_allocated(on_cuda)
    paged = _serve("flashinfer_workspace", 8 * MiB)
    mla = _serve("flashinfer_mla_workspace", 8 * MiB)
    trtllm = _serve("trtllm_mla_zero_workspace", 4 * MiB, torch.int8)
    assert (paged.device, trtllm.device, trtllm.dtype) == (on_cuda, on_cuda, torch.int8)
    assert mla.data_ptr() == paged.data_ptr() and int(trtllm.count_nonzero()) == 0
    assert torch.cuda.memory_allocated(on_cuda) - before == 12 * MiB  # the two pools' buffers, nothing else


def test_capture_freezes_and_a_later_constructor_grows_without_moving_the_graphs_buffer(
    on_cuda: torch.device,
) -> None:
    """A graph captured on a served workspace replays after a backend built later grew the pool."""
    x = torch.arange(MiB // 4, device=on_cuda, dtype=torch.float32)
    graph = torch.cuda.CUDAGraph()

    def capture(runner: object) -> None:  # SGLang's capture(): warm-up, then the graph
        _serve("flashinfer_mla_workspace", MiB)[:MiB].view(torch.float32).copy_(x)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            workspace = _serve("flashinfer_mla_workspace", MiB)  # fits: served during capture
            workspace[:MiB].view(torch.float32).mul_(2)

    sg.buffers.wrap_capture(capture)(object())
    registry = wspool.get_registry()
    assert registry.is_frozen
    captured = _serve("flashinfer_mla_workspace", MiB)
    with pytest.raises(WorkspaceFrozenError, match=r"pool 'flashinfer_mla' on cuda:0 \(lane main\) would have to grow"):
        _serve("flashinfer_mla_workspace", 2 * MiB)

    class Backend:  # a backend SGLang builds after the capture (a draft model's)
        def __init__(self, model_runner: object, skip_prefill: bool = False) -> None:
            self.workspace = _serve("flashinfer_mla_workspace", 2 * MiB)

    Backend.__init__ = sg.buffers.wrap_constructor(Backend.__init__)  # type: ignore[method-assign]
    grown = Backend(object()).workspace
    stats = registry.stats("flashinfer_mla", on_cuda)
    assert grown.data_ptr() != captured.data_ptr() and registry.is_frozen
    assert (stats.capacity_bytes, stats.retired_bytes) == (2 * MiB, MiB)
    graph.replay()  # into the retired buffer it was captured with
    torch.cuda.synchronize()
    assert torch.equal(captured[:MiB].view(torch.float32), x * 2)  # the warm-up wrote x; the replay doubled it
