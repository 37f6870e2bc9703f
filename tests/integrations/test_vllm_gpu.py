"""The vLLM plugin's replacements on cuda:0, called the way vLLM 0.33's call sites call them; vLLM not needed.

``forward_mqa`` calls ``_get_workspace_buffer(return_lse)`` and
``_get_multi_ctas_kv_counter_buffer(min_bytes, q.device)`` on every layer,
including while vLLM captures its CUDA graphs under ``lock_workspace()``. Every
test skips, with the reason, where there is no CUDA device.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

import wspool
from wspool.errors import WorkspaceFrozenError
from wspool.integrations import vllm as plugin
from wspool.integrations.vllm import getters as ws

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture(autouse=True)
def on_cuda() -> Iterator[torch.device]:
    """cuda:0 as the current device."""
    torch.cuda.set_device(0)
    yield torch.device("cuda", 0)
    torch.cuda.synchronize()


@pytest.fixture
def vg() -> ws.VllmGetters:
    """The replacements with no device override (vLLM's own devices) and no vLLM hooks."""
    return ws.VllmGetters()


def _counter_bytes(max_batch: int, heads: int, device: torch.device) -> int:
    """What forward_mqa asks for: FlashInfer's own size where it has the helper, else its formula."""
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    try:
        from flashinfer.utils import get_trtllm_gen_multi_ctas_kv_counter_bytes
    except ImportError:
        return -(-max(max_batch * heads, sm_count) // 8) * 8 * 4
    return int(get_trtllm_gen_multi_ctas_kv_counter_bytes(max_batch, heads, sm_count))


def test_mla_workspace_is_an_int8_view_on_the_current_device(
    on_cuda: torch.device, monkeypatch: pytest.MonkeyPatch, vg: ws.VllmGetters
) -> None:
    """_get_workspace_buffer(return_lse) gives a zeroed int8 buffer on cuda:0, the same tensor per call, grown once."""
    monkeypatch.setenv("WSPOOL_PROFILE", "fixed")  # 128MiB, then 256MiB with the LSE: one growth between them
    plain = vg.get_mla_workspace_buffer(False)
    assert (plain.dtype, plain.device, plain.numel()) == (torch.int8, on_cuda, 128 * MiB)
    assert int(plain.count_nonzero()) == 0
    assert vg.get_mla_workspace_buffer(False) is plain
    lse = vg.get_mla_workspace_buffer(True)
    assert (lse.dtype, lse.numel()) == (torch.int8, 256 * MiB) and vg.get_mla_workspace_buffer(False) is lse
    assert lse.view(torch.uint8).data_ptr() == wspool.get_registry().pool("flashinfer_mla", on_cuda).buffer.data_ptr()


def test_mla_workspace_serves_the_device_profile_rules(on_cuda: torch.device, vg: ws.VllmGetters) -> None:
    """Under profile auto the plugin serves the device's own default and lse rules (on an H200: hopper's size)."""
    registry = wspool.get_registry()
    default = registry.resolve("flashinfer_mla", "default", device=on_cuda)
    lse = registry.resolve("flashinfer_mla", "lse", device=on_cuda)
    assert vg.get_mla_workspace_buffer(False).numel() == default
    assert vg.get_mla_workspace_buffer(True).numel() == max(default, lse)
    if registry.profile_of(on_cuda).profile == "hopper":
        sm_count = torch.cuda.get_device_properties(on_cuda).multi_processor_count
        assert default == lse == 64 * sm_count * (4 * 512 + 8)
        assert registry.stats("flashinfer_mla", on_cuda).grow_count == 1


def test_counters_are_zeroed_and_persist(on_cuda: torch.device, vg: ws.VllmGetters) -> None:
    """The counters are zero when allocated and keep what the kernel leaves in them (it resets them itself)."""
    nbytes = _counter_bytes(1024, 128, on_cuda)
    counters = vg.get_multi_ctas_kv_counter_buffer(nbytes, on_cuda)
    assert (counters.dtype, counters.device, counters.numel()) == (torch.uint8, on_cuda, nbytes)
    assert int(counters.count_nonzero()) == 0
    counters[:8].fill_(7)  # a launch in flight holds its semaphores
    again = vg.get_multi_ctas_kv_counter_buffer(nbytes, on_cuda)
    assert again is counters and int(again[:8].sum()) == 56
    assert wspool.get_registry().buffer_pool("flashinfer_mla_counters") == "flashinfer_mla_counters"


def test_vllm_lock_freezes_and_capture_refuses_growth(
    on_cuda: torch.device, monkeypatch: pytest.MonkeyPatch, vg: ws.VllmGetters
) -> None:
    """Under vLLM's lock a layer that fits is captured; one that would grow raises; unlock allows growth again."""
    monkeypatch.setenv("WSPOOL_PROFILE", "fixed")  # rule lse (256MiB) needs more than rule default (128MiB)

    class Manager:  # vLLM's WorkspaceManager.lock/unlock, wrapped as the plugin wraps them
        locked = False

        def lock(self) -> None:
            self.locked = True

        def unlock(self) -> None:
            self.locked = False

    wrap = {t.path.rsplit(".", 1)[-1]: t.make for t in plugin.TARGETS if t.path.startswith("WorkspaceManager.")}
    lock, unlock = wrap["lock"](Manager.lock), wrap["unlock"](Manager.unlock)
    manager = Manager()
    counter_bytes = _counter_bytes(256, 16, on_cuda)
    x = torch.randn(1 << 20, device=on_cuda)

    def layer(return_lse: bool) -> None:
        buffer = vg.get_mla_workspace_buffer(return_lse)
        vg.get_multi_ctas_kv_counter_buffer(counter_bytes, on_cuda)
        buffer[: x.numel() * 4].view(torch.float32).copy_(x)

    layer(False)  # vLLM's warm-up before capture
    torch.cuda.synchronize()
    lock(manager)
    assert manager.locked and wspool.get_registry().is_frozen
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(False)
    graph.replay()
    second = torch.cuda.CUDAGraph()
    with (
        pytest.raises(WorkspaceFrozenError, match=r"pool 'flashinfer_mla' on cuda:0 \(lane main\) would have to grow"),
        torch.cuda.graph(second),
    ):
        layer(True)
    assert not torch.cuda.is_current_stream_capturing()
    del second
    assert wspool.get_registry().stats("flashinfer_mla", on_cuda).capacity_bytes == 128 * MiB
    unlock(manager)
    assert not manager.locked and not wspool.get_registry().is_frozen
    assert vg.get_mla_workspace_buffer(True).numel() == 256 * MiB
    graph.replay()  # through the retired buffer the graph was captured with
    torch.cuda.synchronize()


def test_sparse_and_paged_workspaces_on_cuda(on_cuda: torch.device, vg: ws.VllmGetters) -> None:
    """Sparse MLA gets int8 at vLLM's size with its floor; the builder's paged buffer is uint8 on its device."""
    sparse = vg.get_sparse_workspace_buffer(on_cuda)
    assert (sparse.dtype, sparse.device, sparse.numel()) == (torch.int8, on_cuda, 394 * MiB)
    assert vg.get_sparse_workspace_buffer(on_cuda, 400 * MiB).numel() == 400 * MiB
    builder = SimpleNamespace(_workspace_buffer=None, device=on_cuda, max_num_batched_tokens=8192)
    builder.num_qo_heads, builder.head_dim = 8, 128
    paged = vg.get_paged_workspace_buffer(builder, 16)
    assert (paged.dtype, paged.device, paged.numel()) == (torch.uint8, on_cuda, 394 * MiB)
    assert vg.get_paged_workspace_buffer(builder, 16) is paged
