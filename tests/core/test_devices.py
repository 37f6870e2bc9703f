"""Tests for wspool.devices and the registry's per-device keys, simulating CUDA devices on the CPU.

``torch.cuda.current_device`` is replaced by a per-thread fake and buffers are
allocated on the CPU, so device switching is exercised without a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

import wspool
import wspool.devices
from tests.helpers.registry import make_registry
from wspool.devices import is_dynamic, resolve_device
from wspool.errors import ConfigError

KiB = 1024


class _FakeCurrentDevice(threading.local):
    index = 0


@pytest.fixture
def current() -> Iterator[_FakeCurrentDevice]:
    """Pretend CUDA is available, with a per-thread current device the test sets."""
    fake = _FakeCurrentDevice()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "current_device", lambda: fake.index)
        mp.setattr(wspool.devices, "_cuda_available", True)
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        yield fake


def _registry() -> wspool.PoolRegistry:
    def on_cpu(nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)  # stands in for memory on `device`

    return wspool.PoolRegistry(wspool.load_settings(pools={"p": {"rules": {"default": "x * 1KiB"}}}), allocator=on_cpu)


def test_cuda_and_none_follow_the_current_device(current: _FakeCurrentDevice) -> None:
    """device="cuda", torch.device("cuda") and None name the current device of each call, never a stale one."""
    reg = _registry()
    for device in ("cuda", torch.device("cuda"), None):
        current.index = 0
        first = reg.workspace("p", device, x=1)
        current.index = 1
        second = reg.workspace("p", device, x=2)
        current.index = 0
        again = reg.workspace("p", device, x=1)
        assert first.data_ptr() != second.data_ptr()
        assert again.data_ptr() == first.data_ptr()
    assert reg.stats("p", "cuda:0").capacity_bytes == KiB
    assert reg.stats("p", "cuda:1").capacity_bytes == 2 * KiB
    assert not any(is_dynamic(key[1]) for key in reg._fast), "a dynamic device name was cached"


def test_one_pool_per_device_however_it_is_named(current: _FakeCurrentDevice) -> None:
    """An index, "cuda:1" and torch.device("cuda", 1) are one pool; another index is another pool."""
    reg = _registry()
    named = [reg.pool("p", name) for name in (1, "cuda:1", torch.device("cuda", 1))]
    assert named[0] is named[1] is named[2]
    assert reg.pool("p", 0) is not named[0]
    assert {s.device for s in reg.all_stats()} == {"cuda:0", "cuda:1"}


def test_threads_on_different_devices_get_their_own_pools(current: _FakeCurrentDevice) -> None:
    """Threads whose current devices differ each get the pool of their own device from device="cuda"."""
    reg = _registry()
    seen: dict[int, set[int]] = {0: set(), 1: set()}
    barrier = threading.Barrier(2)

    def worker(index: int) -> None:
        current.index = index
        barrier.wait()
        for _ in range(200):
            seen[index].add(reg.workspace("p", "cuda", x=index + 1).data_ptr())

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen[0]) == len(seen[1]) == 1
    assert seen[0] != seen[1]
    assert reg.stats("p", "cuda:0").request_count == reg.stats("p", "cuda:1").request_count == 200


def test_resolve_device_reads_the_current_device_each_time(current: _FakeCurrentDevice) -> None:
    """resolve_device("cuda") returns the device current at the call."""
    current.index = 3
    assert resolve_device("cuda") == torch.device("cuda", 3)
    current.index = 2
    assert resolve_device(None) == torch.device("cuda", 2)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 2)
    assert resolve_device("cpu") == torch.device("cpu")


def test_is_dynamic_names_only_the_current_device_forms() -> None:
    """None, "cuda" and torch.device("cuda") are dynamic; an explicit index or the CPU is not."""
    assert all(is_dynamic(d) for d in (None, "cuda", torch.device("cuda")))
    assert not any(is_dynamic(d) for d in ("cpu", "cuda:0", 0, torch.device("cuda", 1)))


def test_invalid_device_is_a_clear_error() -> None:
    """A value that names no device is a ValueError saying so."""
    with pytest.raises(ValueError, match=r"invalid device 'gpu0'"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match=r"invalid device True"):
        resolve_device(True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch has no CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda", 1)])
def test_a_cuda_device_without_cuda_is_a_wspool_error_that_says_what_is_missing(device: object) -> None:
    """Asking for a CUDA device where torch has none is a ConfigError naming the device, not torch's AssertionError."""
    reg = make_registry({"p": {"rules": {"default": "1KiB"}}})
    with pytest.raises(ConfigError, match=r"device 'cuda(:\d)?' needs CUDA, but torch .* cannot use it here"):
        reg.workspace("p", device)  # type: ignore[arg-type]
    assert reg.all_stats() == []
