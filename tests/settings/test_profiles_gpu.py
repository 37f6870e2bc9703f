"""GPU tests for profiles and device facts on the H200 test machine: right-sized by default."""

from __future__ import annotations

import pytest
import torch

import wspool
from wspool.integrations import vllm as drop_in
from wspool.tools.demo import run_demo

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _hopper() -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper (SM90) GPU, where auto picks the hopper profile")


def _hopper_bytes() -> int:
    return 64 * torch.cuda.get_device_properties(0).multi_processor_count * (4 * 512 + 8)


def test_device_facts_come_from_the_device() -> None:
    """The registry's device facts are the GPU's own properties."""
    props = torch.cuda.get_device_properties(0)
    facts = wspool.PoolRegistry().device_facts("cuda:0")
    assert dict(facts) == {
        "sm_count": props.multi_processor_count,
        "cc_major": props.major,
        "cc_minor": props.minor,
        "device_memory": props.total_memory,
    }


def test_demo_on_the_embedded_default_reports_the_hopper_size() -> None:
    """wspool demo with no configuration runs through the hopper profile at 16.56MiB on an H200."""
    _hopper()
    lines: list[str] = []
    registry = wspool.PoolRegistry()
    assert run_demo(registry, "cuda", echo=lines.append)
    text = "\n".join(lines)
    assert "profile hopper on cuda" in text
    size = wspool.format_size(_hopper_bytes())
    assert sum(f"workspace {size:>7}" in line for line in lines) == 2, text
    assert registry.stats("flashinfer_mla", "cuda").capacity_bytes == _hopper_bytes()
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert size == "16.56MiB"


def test_profile_fixed_gives_vllms_fixed_sizes() -> None:
    """profile: fixed on the GPU keeps 128MiB without and 256MiB with the LSE."""
    lines: list[str] = []
    registry = wspool.PoolRegistry(wspool.load_settings(profile="fixed"))
    assert run_demo(registry, "cuda", echo=lines.append)
    assert any("rule=default workspace  128MiB" in line for line in lines), lines
    assert any("rule=lse     workspace  256MiB" in line for line in lines), lines
    assert registry.stats("flashinfer_mla", "cuda").capacity_bytes == 256 * MiB


def test_adapter_without_facts_serves_the_hopper_size() -> None:
    """_get_workspace_buffer(return_lse) alone gets 17369088 bytes on an H200, for both rules."""
    _hopper()
    drop_in.check_workspace_facts()
    assert drop_in._get_workspace_buffer(False).numel() == _hopper_bytes()
    assert drop_in._get_workspace_buffer(True).numel() == _hopper_bytes()
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert _hopper_bytes() == 17_369_088


def test_graph_plans_count_the_wrappers_own_buffers() -> None:
    """Four CUDA-graph MLA plans: the pool holds the hopper size; FlashInfer's 8MiB pairs, or wspool's regions."""
    _hopper()
    from wspool.tools.graph_plans import measure_graph_plans

    own = measure_graph_plans(
        wspool.PoolRegistry(), batch_sizes=(1, 8, 64, 256), seq_len=256, int_workspace="flashinfer"
    )
    assert own["profile"] == "hopper"
    assert own["pool_bytes"] == _hopper_bytes()
    assert own["wrappers"] == 4
    assert own["kernel_device_bytes"] >= 4 * 8 * MiB
    assert own["kernel_pinned_host_bytes"] >= 4 * 8 * MiB
    assert own["region_bytes"] == 0
    pooled = measure_graph_plans(wspool.PoolRegistry(), batch_sizes=(1, 8, 64, 256), seq_len=256)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    region = 9 * 65536 + 5 * -(-4 * sm // 16) * 16
    assert pooled["region_bytes"] == 4 * region
    assert pooled["kernel_device_bytes"] == 0  # nothing of FlashInfer's own left on the device
    assert pooled["kernel_pinned_host_bytes"] == 4 * region
