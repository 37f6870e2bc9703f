"""Tests for wspool.tools.demo on the CPU: two decode steps on the reference path, checked against dense attention."""

from __future__ import annotations

from tests.helpers.registry import make_registry
from wspool.tools.demo import run_demo


def test_the_demo_checks_both_steps_and_replays_vllms_overflow() -> None:
    """Small inputs on the CPU: both steps match dense attention, the pool grows once per rule, vLLM's 128MiB
    overflows the modelled Blackwell call, and a rule set in code is reported before the profile's own is checked."""
    registry = make_registry({"flashinfer_mla": {"rules": {"default": "1MiB", "lse": "2MiB"}}})
    lines: list[str] = []
    assert run_demo(registry, "cpu", batch=2, heads=4, max_len=128, layers=2, echo=lines.append)
    steps = [line for line in lines if line.startswith("  step ")]
    assert len(steps) == 2 and all(line.endswith("  ok") for line in steps)
    assert "rule=default workspace    1MiB" in steps[0] and "rule=lse     workspace    2MiB" in steps[1]
    assert any(line.startswith("pool flashinfer_mla on cpu: capacity 2MiB") and "2 grows" in line for line in lines)
    assert any(line.startswith("  vLLM's fixed size = 128MiB: Buffer overflow") for line in lines)
    assert any(
        line.startswith("  rule pools.flashinfer_mla.rules.lse on a modelled NVIDIA B200 (from code) = 2MiB: Buffer")
        for line in lines
    )
    assert any(
        line.startswith("  this configuration does not size MLA decode for Blackwell (code replaces") for line in lines
    )
    assert "  the blackwell profile's rule = 193MiB: fits" in lines
    assert lines[-1] == "demo: all checks passed"
