"""Tests for wspool.flashinfer.backends: each kernel path's known need, before FlashInfer is called."""

from __future__ import annotations

import pytest

from wspool.flashinfer.backends import TRTLLM_SCRATCH_BYTES, cute_dsl_workspace_bytes, path_need_bytes
from wspool.rules import compile_rule

FACTS = {"sm_count": 132, "batch_size": 64, "q_len": 1, "num_heads": 128, "kv_lora_rank": 512, "max_seq_len": 4096}


@pytest.mark.parametrize("path", ["fa3", "fa2"])
def test_planned_wrapper_need_is_the_sm_count_rule(path: str) -> None:
    """fa3/fa2 need 64 * sm_count * (4 * kv_lora_rank + 8) on an H200: 17369088 bytes, whatever the LSE."""
    for lse in (False, True):
        assert path_need_bytes(path, **FACTS, return_lse=lse) == 17369088
    assert compile_rule("64 * sm_count * (4 * kv_lora_rank + 8)").resolve(FACTS) == 17369088


def test_trtllm_gen_need_is_the_slab_and_its_scratch() -> None:
    """trtllm-gen needs the launcher's softmax slab with the LSE, and the scratch margin always."""
    slab = 8 * 128 * 64 * 256 + (1 << 20)
    assert path_need_bytes("trtllm-gen", **FACTS, return_lse=True) == slab + TRTLLM_SCRATCH_BYTES
    assert path_need_bytes("trtllm-gen", **FACTS, return_lse=False) == TRTLLM_SCRATCH_BYTES


def test_cute_dsl_need_is_flashinfers() -> None:
    """cute-dsl's need is FlashInfer's own size function's answer, with and without DCP."""
    pytest.importorskip("flashinfer.mla", reason="flashinfer-python is not installed")
    kwargs = {k: FACTS[k] for k in ("sm_count", "batch_size", "q_len", "num_heads", "kv_lora_rank", "max_seq_len")}
    for dcp in (False, True):
        assert path_need_bytes("cute-dsl", **FACTS, return_lse=True, enable_dcp=dcp) == cute_dsl_workspace_bytes(
            **kwargs, enable_dcp=dcp
        )


def test_reference_needs_nothing_and_auto_is_refused() -> None:
    """The reference path needs no workspace; 'auto' must be resolved before sizing."""
    assert path_need_bytes("reference", **FACTS, return_lse=True) == 0
    with pytest.raises(ValueError, match="no known workspace need for MLA decode path 'auto'; resolve 'auto' first"):
        path_need_bytes("auto", **FACTS, return_lse=True)
