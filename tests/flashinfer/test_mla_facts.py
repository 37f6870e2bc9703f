"""Tests for wspool.flashinfer.mla with device facts, default facts and profiles (reference path, on the CPU)."""

from __future__ import annotations

import wspool
from tests.helpers.devices_fake import H200, HOPPER_MLA_BYTES, meta_allocator
from tests.helpers.mla_inputs import make_inputs
from wspool.devices import fake_device
from wspool.flashinfer import mla_decode_plan
from wspool.flashinfer.layouts import softmax_slab_bytes
from wspool.settings.profiles import shipped_config
from wspool.tools.demo import run_demo

MiB = 1 << 20


def test_a_plan_on_a_faked_h200_sizes_with_the_hopper_profile() -> None:
    """The plan reads sm_count from the device and kv_lora_rank from its geometry: 17369088 bytes."""
    inputs = make_inputs(4, 16, [100, 200, 300, 400])
    with fake_device("cpu", H200):
        registry = wspool.PoolRegistry(allocator=meta_allocator)
        plan = mla_decode_plan(
            inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, num_heads=16, sm_scale=inputs.sm_scale,
            page_size=64, return_lse=True, registry=registry,
        )  # fmt: skip
        assert plan.facts["sm_count"] == 132
        assert registry.stats("flashinfer_mla", "cpu").capacity_bytes == HOPPER_MLA_BYTES


def test_a_plan_takes_cp_world_from_the_default_facts() -> None:
    """Without cp_world in the call, configs/kimi_dcp.yaml's default (8) sizes the LSE slab; a call's own wins."""
    inputs = make_inputs(4, 8, [64, 64, 64, 64])
    registry = wspool.PoolRegistry(wspool.load_settings(shipped_config("kimi_dcp")), allocator=meta_allocator)
    kwargs = {"num_heads": 8, "sm_scale": inputs.sm_scale, "page_size": 64, "return_lse": True, "registry": registry}
    plan = mla_decode_plan(inputs.block_tables, inputs.seq_lens, inputs.max_seq_len, **kwargs)  # type: ignore[arg-type]
    assert plan.facts["cp_world"] == 8  # the file's default fact, merged into the plan's
    nbytes = registry.resolve("flashinfer_mla", "lse", device="cpu", **plan.facts)
    assert nbytes == softmax_slab_bytes(8 * 8, 4, 1) + 32 * MiB
    assert registry.stats("flashinfer_mla", "cpu").capacity_bytes >= nbytes
    own = mla_decode_plan(
        inputs.block_tables,
        inputs.seq_lens,
        inputs.max_seq_len,
        facts={"cp_world": 2},
        **kwargs,  # type: ignore[arg-type]
    )
    nbytes = registry.resolve("flashinfer_mla", "lse", device="cpu", **own.facts)
    assert nbytes == softmax_slab_bytes(8 * 2, 4, 1) + 32 * MiB


def test_demo_on_a_faked_h200_reports_the_hopper_size() -> None:
    """wspool demo on the embedded default, on a CPU standing in for an H200, reports 16.56MiB through hopper."""
    lines: list[str] = []
    with fake_device("cpu", H200):
        registry = wspool.PoolRegistry()
        assert run_demo(registry, "cpu", batch=2, heads=4, max_len=128, layers=1, echo=lines.append)
    assert "profile hopper on cpu: auto: compute capability 9.0 (NVIDIA H200) is hopper's" in lines
    assert sum("workspace 16.56MiB" in line for line in lines) == 2, lines
