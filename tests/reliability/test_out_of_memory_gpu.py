"""Reliability on a CUDA device when memory runs out: a request larger than the GPU is a counted limit error.

Skips, with the reason, where there is no CUDA device; injected out-of-memory
errors on the CPU are in tests/reliability/test_out_of_memory.py.
"""

from __future__ import annotations

import pytest

from tests.helpers.registry import make_registry
from tests.reliability.gpu_scratch import current_cuda_device
from wspool.errors import WorkspaceLimitError

pytestmark = pytest.mark.gpu


def test_real_out_of_memory_is_a_counted_limit_error_and_the_pool_still_serves() -> None:
    """A request larger than the GPU (512 TiB) is a WorkspaceLimitError, counted; the old buffer is still served."""
    reg = make_registry({"p": {"rules": {"default": "1MiB"}}})
    device = current_cuda_device()
    before = reg.workspace("p", device)
    with pytest.raises(WorkspaceLimitError, match="could not grow from 1048576 to 562949953421312 bytes"):
        reg.pool("p", device).request(2**49)
    stats = reg.stats("p", device)
    assert (stats.refused_count, stats.capacity_bytes) == (1, 1 << 20)
    assert reg.workspace("p", device).data_ptr() == before.data_ptr()
