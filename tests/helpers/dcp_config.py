"""A configuration with configs/kimi_dcp.yaml's DCP rule but none of the default facts that file ships."""

from __future__ import annotations

from pathlib import Path

import pytest

import wspool

#: configs/kimi_dcp.yaml's lse rule: the trtllm-gen softmax slab under DCP, plus scratch headroom.
DCP_LSE_RULE = "8 * num_heads * cp_world * batch_size * round_up(q_len, 256) + 1MiB + 32MiB"


def use_lse_rule_without_facts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, lse_rule: str = DCP_LSE_RULE) -> None:
    """Point ``WSPOOL_CONFIG`` at a file that sets only ``pools.flashinfer_mla.rules.lse``; reset the registry."""
    config = tmp_path / "lse_rule_without_facts.yaml"
    config.write_text(f"pools:\n  flashinfer_mla:\n    rules:\n      lse: {lse_rule}\n")
    monkeypatch.setenv("WSPOOL_CONFIG", str(config))
    wspool.reset_registry()
