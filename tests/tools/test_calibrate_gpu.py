"""GPU smoke tests of wspool calibrate and the bench memory sweep (skip without a CUDA device)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import wspool
from wspool.cli import main
from wspool.flashinfer.layouts import fa_mla_float_workspace_bytes

pytestmark = pytest.mark.gpu

SHAPES = ("b=1,h=16,l=1024", "b=64,h=128,l=4096,lse")


@pytest.fixture
def wrapper_gpu() -> int:
    """The current GPU's SM count; skip where MLA decode takes trtllm-gen (Blackwell)."""
    if torch.cuda.get_device_capability() in ((10, 0), (10, 3), (10, 7)):
        pytest.skip("calibrate measures the planned-wrapper path; this GPU takes trtllm-gen")
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def test_calibrate_two_shapes(wrapper_gpu: int, tmp_path: Path) -> None:
    """calibrate finds FlashInfer's carve exactly for two shapes, and the rules file loads and covers them."""
    out, data = tmp_path / "rules.yaml", tmp_path / "c.json"
    args = ["calibrate", "--quiet", "--out", str(out), "--json", str(data)]
    assert main([*args, *(a for s in SHAPES for a in ("--shape", s))]) == 0
    shapes = json.loads(data.read_text())["shapes"]
    for row in shapes:
        assert row["minimum_bytes"] == fa_mla_float_workspace_bytes(
            sm_count=wrapper_gpu, num_heads=row["num_heads"], q_len=row["q_len"]
        )
        assert row["run_at_minimum"] == row["run_at_rule"] == "ok"
    reg = wspool.PoolRegistry.from_config(out)
    assert reg.resolve("flashinfer_mla", "lse", sm_count=wrapper_gpu, kv_lora_rank=512) >= shapes[1]["minimum_bytes"]


def test_bench_memory_sweep(wrapper_gpu: int, tmp_path: Path) -> None:
    """bench's memory section over two shapes: the shipped Hopper rule never underestimates and runs."""
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text("shapes:\n  - {b: 1, h: 16, l: 1024}\n  - {b: 64, h: 128, l: 4096, lse: true}\n")
    out = tmp_path / "bench.json"
    assert main(["bench", "--sections", "memory", "--shapes", str(shapes), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["memory"]["rows"]
    assert all(r["minimum_bytes"] <= r["rule_bytes"] <= 1.1 * r["minimum_bytes"] for r in rows)
    assert {r["run_at_rule"] for r in rows} == {"ok"}


def test_the_plan_section_times_both_sides_and_leaves_the_hook_in_place(wrapper_gpu: int) -> None:
    """bench's mla_plan section plans with FlashInfer's own buffers and with wspool's, and reinstalls the hook."""
    from wspool.flashinfer import wrapper_buffers
    from wspool.tools.bench_gpu import measure_mla_plan

    figures = measure_mla_plan(torch.device("cuda"), rounds=2, plans=3, batch_size=4, max_seq_len=128)
    assert figures.own_us > 0 and figures.wspool_us > 0 and figures.noise_us >= 0
    assert wrapper_buffers.install_mla_hook() is None
