"""wspool.flashinfer.wrapper_buffers' regions on a CUDA device: pinned copies cut from page-locked chunks, and no
region made during capture.

Every test skips, with the reason, where there is no CUDA device; the CPU side is in
tests/flashinfer/test_wrapper_regions.py.
"""

from __future__ import annotations

import pytest
import torch

import wspool
from tests.reliability.gpu_scratch import current_cuda_device
from wspool.errors import WorkspaceFrozenError
from wspool.flashinfer.wrapper_buffers import PINNED_CHUNK_BYTES, REGION_ALIGNMENT, wrapper_regions

pytestmark = pytest.mark.gpu

MiB = 1 << 20


class _Wrapper:
    """Any object wspool binds (kernel wrappers are plain objects held weakly)."""


def _chunk_and_offset(copy: torch.Tensor) -> tuple[int, int]:
    storage = copy.untyped_storage()
    return storage.data_ptr(), copy.data_ptr() - storage.data_ptr()


def test_pinned_copies_are_carved_in_order_from_one_page_locked_chunk() -> None:
    """Small pinned copies share one 4 MiB page-locked chunk, each right after the last on a 16-byte boundary."""
    regions = wrapper_regions(wspool.PoolRegistry())
    device = current_cuda_device()
    keep = [_Wrapper() for _ in range(3)]
    copies = [
        regions.bind(w, device=device, nbytes=n, kind="x", lane="main", pinned=True).pinned
        for w, n in zip(keep, (100, 1000, 5000), strict=True)
    ]
    assert all(c is not None and c.is_pinned() and c.device.type == "cpu" for c in copies)
    places = [_chunk_and_offset(c) for c in copies]  # type: ignore[arg-type]
    assert len({chunk for chunk, _ in places}) == 1
    assert [offset for _, offset in places] == [0, 112, 112 + 1008]
    assert all(offset % REGION_ALIGNMENT == 0 for _, offset in places)
    assert copies[0].untyped_storage().nbytes() == PINNED_CHUNK_BYTES  # type: ignore[union-attr]
    ((stats,),) = [regions.stats()]
    assert (stats["pinned_bytes"], stats["pinned_chunk_bytes"]) == (112 + 1008 + 5008, PINNED_CHUNK_BYTES)


def test_a_copy_that_does_not_fit_the_chunk_gets_a_new_one_sized_a_power_of_two() -> None:
    """A copy past the chunk's free bytes starts a new chunk; one larger than a chunk gets a power of two of its own."""
    regions = wrapper_regions(wspool.PoolRegistry())
    device = current_cuda_device()
    a, b, c = _Wrapper(), _Wrapper(), _Wrapper()
    first = regions.bind(a, device=device, nbytes=3 * MiB, kind="x", lane="main", pinned=True).pinned
    second = regions.bind(b, device=device, nbytes=2 * MiB, kind="x", lane="main", pinned=True).pinned
    third = regions.bind(c, device=device, nbytes=5 * MiB + 1, kind="x", lane="main", pinned=True).pinned
    assert first is not None and second is not None and third is not None
    chunks = [_chunk_and_offset(t) for t in (first, second, third)]
    assert len({chunk for chunk, _ in chunks}) == 3 and all(offset == 0 for _, offset in chunks)
    assert [t.untyped_storage().nbytes() for t in (first, second, third)] == [
        PINNED_CHUNK_BYTES,
        PINNED_CHUNK_BYTES,
        8 * MiB,
    ]
    ((stats,),) = [regions.stats()]
    assert stats["pinned_chunk_bytes"] == 2 * PINNED_CHUNK_BYTES + 8 * MiB


def test_no_region_is_allocated_while_the_stream_captures_but_a_bound_group_serves() -> None:
    """During capture a new region is refused naming capture; a wrapper joining a group's region allocates nothing."""
    regions = wrapper_regions(wspool.PoolRegistry())
    device = current_cuda_device()
    first, joining, fresh = _Wrapper(), _Wrapper(), _Wrapper()
    region = regions.bind(first, device=device, nbytes=4096, kind="x", lane="main", group="g").region
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        joined = regions.bind(joining, device=device, nbytes=1000, kind="x", lane="main", group="g")
        with pytest.raises(WorkspaceFrozenError, match="during CUDA-graph capture"):
            regions.bind(fresh, device=device, nbytes=1000, kind="x", lane="main")
    assert joined.region is region and regions.binding(fresh) is None
    # Outside capture, on the same device spelt without an index, the new region is made.
    made = regions.bind(fresh, device=torch.device("cuda"), nbytes=1000, kind="x", lane="main")
    assert made.region.device == str(device) and made.region.tensor.device == device
