"""Tests for wspool.flashinfer.wrapper_buffers' regions: shared by group, capped, freed with their wrappers."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

import wspool
from tests.helpers.paths import REPO_ROOT
from wspool.errors import WorkspaceLimitError
from wspool.flashinfer import wrapper_buffers
from wspool.flashinfer.wrapper_buffers import WrapperRegions, binding_of, wrapper_regions


class _Wrapper:
    """Any object wspool binds (kernel wrappers are plain objects held weakly)."""


def test_regions_of_a_group_are_shared_and_live_as_long_as_a_wrapper() -> None:
    """One region per group, device and lane; a larger need gets a new one; regions die with their wrappers."""
    regions = wrapper_regions(wspool.PoolRegistry())
    cpu = torch.device("cpu")
    a, b, c, d = _Wrapper(), _Wrapper(), _Wrapper(), _Wrapper()
    ra = regions.bind(a, device=cpu, nbytes=100, kind="x", lane="main", group="g").region
    rb = regions.bind(b, device=cpu, nbytes=90, kind="x", lane="main", group="g").region
    rc = regions.bind(c, device=cpu, nbytes=200, kind="x", lane="main", group="g").region
    rd = regions.bind(d, device=cpu, nbytes=90, kind="x", lane="other", group="g").region
    assert ra is rb and rc is not ra and rc.nbytes == 208 and rd is not rc
    assert ra.nbytes == 112  # rounded to 16 bytes
    ((main, other),) = [regions.stats()]
    assert (main["regions"], main["wrappers"], other["regions"]) == (2, 3, 1)
    del a, b, c, d, ra, rb, rc, rd, main, other
    gc.collect()
    assert regions.stats() == []


def test_regions_past_max_bytes_are_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """pools.flashinfer_int.max_bytes caps a device and lane's regions; the refusal names the key."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_INT__MAX_BYTES", "1KiB")
    registry = wspool.PoolRegistry()
    wrapper_buffers.declare_int_pool(registry)
    regions = wrapper_regions(registry)
    keep = _Wrapper()
    regions.bind(keep, device=torch.device("cpu"), nbytes=1000, kind="x", lane="main")
    with pytest.raises(WorkspaceLimitError, match=r"max_bytes 1024; raise pools\.flashinfer_int\.max_bytes"):
        regions.bind(_Wrapper(), device=torch.device("cpu"), nbytes=100, kind="x", lane="main")


def test_a_rebound_wrapper_leaves_its_old_regions_record_to_nobody() -> None:
    """A wrapper moved to a larger region clears the old region's owner: no plan may trust it any more."""
    regions = wrapper_regions(wspool.PoolRegistry())
    wrapper = _Wrapper()
    old = regions.bind(wrapper, device=torch.device("cpu"), nbytes=64, kind="x", lane="main")
    old.region.record.owner = token = object()
    new = regions.bind(wrapper, device=torch.device("cpu"), nbytes=640, kind="x", lane="main")
    assert binding_of(wrapper) is new and new.region is not old.region
    assert old.region.record.owner is None and token is not None


def test_a_failed_install_records_nothing_and_leaves_the_previous_binding() -> None:
    """An install (the wrapper taking its region) that raises records no binding: the previous one stays, its
    region's record untouched, and the region it would have moved to counts nowhere."""
    regions = wrapper_regions(wspool.PoolRegistry())
    wrapper, cpu = _Wrapper(), torch.device("cpu")
    old = regions.bind(wrapper, device=cpu, nbytes=64, kind="x", lane="main")
    old.region.record.owner = token = object()
    offered: list[object] = []

    def refuse(binding: object) -> None:
        offered.append(binding)
        raise MemoryError("no pinned memory for the copy")

    with pytest.raises(MemoryError, match=r"^no pinned memory for the copy$"):
        regions.bind(wrapper, device=cpu, nbytes=640, kind="x", lane="main", install=refuse)
    assert binding_of(wrapper) is old and regions.binding(wrapper) is old and old.region.record.owner is token
    assert len(offered) == 1 and offered[0] is not old
    ((stats,),) = [regions.stats()]
    assert (stats["regions"], stats["region_bytes"]) == (1, 64)
    taken: list[object] = []
    new = regions.bind(wrapper, device=cpu, nbytes=640, kind="x", lane="main", install=taken.append)
    assert taken == [new] and binding_of(wrapper) is new and new.region.nbytes == 640
    assert old.region.record.owner is None  # moved: no plan may trust the old region now


def test_a_device_spelt_with_or_without_an_index_is_one_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.device("cpu", 0) is the device whose tensors say "cpu": one cap, one group region, one stats row."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_INT__MAX_BYTES", "1KiB")
    registry = wspool.PoolRegistry()
    wrapper_buffers.declare_int_pool(registry)
    regions = wrapper_regions(registry)
    plain, indexed = torch.device("cpu"), torch.device("cpu", 0)
    a, b, c = _Wrapper(), _Wrapper(), _Wrapper()
    shared = regions.bind(a, device=plain, nbytes=600, kind="x", lane="main", group="g").region
    assert regions.bind(b, device=indexed, nbytes=500, kind="x", lane="main", group="g").region is shared
    with pytest.raises(WorkspaceLimitError, match=r"on cpu lane main would hold 1120 bytes, over max_bytes 1024"):
        regions.bind(c, device=indexed, nbytes=500, kind="x", lane="main")
    ((stats,),) = [regions.stats()]
    assert (stats["device"], stats["wrappers"], stats["regions"], stats["region_bytes"]) == ("cpu", 2, 1, 608)


def test_growth_is_charged_for_the_region_it_moves_to_not_the_one_it_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrapper moving to a larger region under the cap fits: the region it leaves is no longer its own charge;
    a region it leaves that another wrapper still holds is."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_INT__MAX_BYTES", "57344")
    registry = wspool.PoolRegistry()
    wrapper_buffers.declare_int_pool(registry)
    regions = wrapper_regions(registry)
    cpu = torch.device("cpu")
    alone, a, b = _Wrapper(), _Wrapper(), _Wrapper()
    regions.bind(alone, device=cpu, nbytes=20000, kind="x", lane="main")
    grown = regions.bind(alone, device=cpu, nbytes=40240, kind="x", lane="main")
    assert binding_of(alone) is grown and grown.region.nbytes == 40240
    ((stats,),) = [regions.stats()]
    assert (stats["regions"], stats["region_bytes"]) == (1, 40240)
    regions.bind(a, device=cpu, nbytes=8000, kind="x", lane="other", group="g")
    regions.bind(b, device=cpu, nbytes=8000, kind="x", lane="other", group="g")
    with pytest.raises(WorkspaceLimitError, match=r"on cpu lane other would hold 58000 bytes, over max_bytes 57344"):
        regions.bind(a, device=cpu, nbytes=50000, kind="x", lane="other", group="g")  # b stays on the old one


def test_pinned_copies_off_cuda_are_counted_byte_for_byte() -> None:
    """Off CUDA a pinned copy is plain host memory of the region's size: pinned and chunk bytes count it exactly."""
    regions = wrapper_regions(wspool.PoolRegistry())
    cpu = torch.device("cpu")
    a, b, c = _Wrapper(), _Wrapper(), _Wrapper()
    first = regions.bind(a, device=cpu, nbytes=100, kind="x", lane="main", pinned=True)
    second = regions.bind(b, device=cpu, nbytes=1000, kind="y", lane="main", pinned=True)
    regions.bind(c, device=cpu, nbytes=50, kind="x", lane="main")
    assert first.pinned is not None and first.pinned.numel() == first.region.nbytes == 112
    assert second.pinned is not None and second.pinned.numel() == 1008
    ((stats,),) = [regions.stats()]
    assert (stats["pinned_bytes"], stats["pinned_chunk_bytes"]) == (1120, 1120)
    assert (stats["wrappers"], stats["regions"], stats["region_bytes"]) == (3, 3, 1184)
    assert stats["kinds"] == {"x": 2, "y": 1}


def test_a_region_is_at_least_the_alignment_and_a_multiple_of_it() -> None:
    """Each region is rounded up to 16 bytes, and a request of 0 or 1 byte still gets 16."""
    regions = wrapper_regions(wspool.PoolRegistry())
    cpu = torch.device("cpu")
    keep = [_Wrapper() for _ in range(4)]
    sizes = [regions.bind(w, device=cpu, nbytes=n, kind="x", lane="main").region.nbytes
             for w, n in zip(keep, (0, 1, 16, 17), strict=True)]  # fmt: skip
    assert sizes == [16, 16, 16, 32]


_EXIT_SCRIPT = """
import holder
import threading
import torch
import wspool
import wspool.flashinfer.wrapper_buffers as home
from wspool.flashinfer.wrapper_buffers import wrapper_regions

class Wrapper:
    pass

wrapper = Wrapper()
wrapper_regions(wspool.PoolRegistry()).bind(wrapper, device=torch.device("cpu"), nbytes=64, kind="x", lane="main")
holder.held.append(wrapper)  # a module imported before wspool's keeps the wrapper: its globals are cleared last
del wrapper

def park(held, event=threading.Event()):
    event.wait()

# A thread still running at exit holds both modules and the table, so both outlive the final collection.
threading.Thread(target=park, args=((holder, home, home.__dict__["_BOUND"]),), daemon=True).start()
"""


def test_a_wrapper_that_dies_at_interpreter_exit_prints_nothing(tmp_path: Path) -> None:
    """A wrapper freed after wrapper_buffers' globals were cleared at exit forgets its binding without an error."""
    (tmp_path / "holder.py").write_text("held = []\n")
    (tmp_path / "main.py").write_text(_EXIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}
    out = subprocess.run(
        [sys.executable, str(tmp_path / "main.py")], capture_output=True, text=True, env=env, timeout=120
    )
    assert (out.returncode, out.stderr) == (0, "")


def test_a_group_member_needing_exactly_the_regions_size_shares_it() -> None:
    """A wrapper whose need equals the group region's size joins that region instead of allocating another."""
    regions = wrapper_regions(wspool.PoolRegistry())
    cpu = torch.device("cpu")
    a, b = _Wrapper(), _Wrapper()
    first = regions.bind(a, device=cpu, nbytes=100, kind="x", lane="main", group="g").region
    assert regions.bind(b, device=cpu, nbytes=first.nbytes, kind="x", lane="main", group="g").region is first
    ((stats,),) = [regions.stats()]
    assert (stats["regions"], stats["wrappers"], stats["region_bytes"]) == (1, 2, 112)


def test_a_dead_wrappers_region_is_freed_and_its_binding_forgotten() -> None:
    """When the last wrapper of a region dies, binding_of forgets it and the region's memory is released."""
    regions = wrapper_regions(wspool.PoolRegistry())
    wrapper = _Wrapper()
    binding = regions.bind(wrapper, device=torch.device("cpu"), nbytes=4096, kind="x", lane="main", pinned=True)
    region, tensor = weakref.ref(binding.region), weakref.ref(binding.region.tensor)
    assert binding_of(wrapper) is binding
    del binding, wrapper
    gc.collect()
    assert region() is None and tensor() is None and regions.stats() == []


def test_regions_and_copies_bound_under_inference_mode_are_normal_tensors() -> None:
    """A wrapper bound under torch.inference_mode gets a region and copy it may write in place outside it."""
    regions = wrapper_regions(wspool.PoolRegistry())
    wrapper = _Wrapper()
    with torch.inference_mode():
        binding = regions.bind(wrapper, device=torch.device("cpu"), nbytes=64, kind="x", lane="main", pinned=True)
    assert binding.pinned is not None
    assert not binding.region.tensor.is_inference() and not binding.pinned.is_inference()
    binding.region.tensor.fill_(1)
    binding.pinned.copy_(binding.region.tensor)
    assert int(binding.pinned.sum()) == 64


def test_an_allocation_failure_is_a_limit_error_and_binds_nothing() -> None:
    """An allocator out of memory makes bind() raise WorkspaceLimitError naming the region; nothing is bound."""

    def allocator(nbytes: int, device: torch.device) -> torch.Tensor:
        raise torch.OutOfMemoryError("out of memory (injected)")

    regions = WrapperRegions("flashinfer_int", lambda device: None, allocator=allocator)
    wrapper = _Wrapper()
    with pytest.raises(WorkspaceLimitError, match=r"out of memory allocating a 1KiB int workspace region") as info:
        regions.bind(wrapper, device=torch.device("cpu"), nbytes=1024, kind="x", lane="main")
    assert isinstance(info.value, MemoryError)
    assert regions.binding(wrapper) is None and binding_of(wrapper) is None and regions.stats() == []


def test_a_group_member_of_exactly_the_regions_size_allocates_nothing() -> None:
    """Joining a group's region whose size equals the need makes no allocation; a larger need makes one."""
    made: list[int] = []

    def allocator(nbytes: int, device: torch.device) -> torch.Tensor:
        made.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)

    regions = WrapperRegions("flashinfer_int", lambda device: None, allocator=allocator)
    cpu = torch.device("cpu")
    keep = [_Wrapper() for _ in range(3)]
    for wrapper, nbytes in zip(keep, (112, 112, 113), strict=True):
        regions.bind(wrapper, device=cpu, nbytes=nbytes, kind="x", lane="main", group="g")
    assert made == [112, 128]
