"""Tests for wspool.flashinfer.kernels: every FlashInfer call binds to the installed signatures."""

from __future__ import annotations

import inspect

import pytest
import torch

from wspool.flashinfer import kernels

fi_mla = pytest.importorskip("flashinfer.mla", reason="flashinfer-python is not installed")

B, H, PAGES, PAGE = 2, 16, 8, 64


def _t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


def test_trtllm_decode_binds() -> None:
    """The trtllm-gen decode call (Blackwell) binds to trtllm_batch_decode_with_kv_cache_mla."""
    counters = _t(64, dtype=torch.uint8)
    kwargs = kernels.trtllm_decode_kwargs(
        query=_t(B, 1, H, 576), kv_cache=_t(PAGES, PAGE, 576), workspace=_t(1024, dtype=torch.uint8),
        counters=counters, block_tables=_t(B, 4, dtype=torch.int32),
        seq_lens=_t(B, dtype=torch.int32), max_seq_len=256, sm_scale=0.1, out=None, lse=None, return_lse=True,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
    )  # fmt: skip
    bound = inspect.signature(fi_mla.trtllm_batch_decode_with_kv_cache_mla).bind(**kwargs)
    assert bound.arguments["return_lse_base"] == "basee"
    assert bound.arguments["kv_cache"].shape == (PAGES, 1, PAGE, 576)
    assert bound.arguments["multi_ctas_kv_counter_buffer"] is counters


@pytest.mark.parametrize("graph", [False, True])
def test_wrapper_init_binds(graph: bool) -> None:
    """BatchMLAPagedAttentionWrapper(...) binds in eager and CUDA-graph form."""
    buffers = tuple(_t(n, dtype=torch.int32) for n in (B + 1, B + 1, PAGES, B)) if graph else None
    kwargs = kernels.wrapper_init_kwargs(workspace=_t(1024, dtype=torch.uint8), backend="fa3", graph_buffers=buffers)  # type: ignore[arg-type]
    signature = inspect.signature(fi_mla.BatchMLAPagedAttentionWrapper.__init__)
    bound = signature.bind(object(), **kwargs)
    assert bound.arguments.get("use_cuda_graph", False) is graph


@pytest.mark.parametrize("return_lse", [False, True])
def test_wrapper_plan_binds(return_lse: bool) -> None:
    """wrapper.plan binds with canonical CSR metadata, and the metadata object accepts our tensors."""
    metadata = fi_mla.MLAPlanMetadata.csr(
        _t(B + 1, dtype=torch.int32),
        _t(B + 1, dtype=torch.int32),
        _t(PAGES, dtype=torch.int32),
        _t(B, dtype=torch.int32),
    )
    kwargs = kernels.wrapper_plan_kwargs(
        metadata=metadata, num_heads=H, kv_lora_rank=512, qk_rope_head_dim=64, page_size=PAGE, causal=False,
        sm_scale=0.1, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, return_lse=return_lse,
    )  # fmt: skip
    signature = inspect.signature(fi_mla.BatchMLAPagedAttentionWrapper.plan)
    bound = signature.bind(object(), **kwargs)
    assert bound.arguments["lse_mode"] == ("basee" if return_lse else "none")


@pytest.mark.parametrize("return_lse", [False, True])
def test_wrapper_run_binds(return_lse: bool) -> None:
    """wrapper.run binds with packed inputs; the natural-log flag matches the plan's LSE mode."""
    kwargs = kernels.wrapper_run_kwargs(
        query=_t(B, H, 576), kv_cache=_t(PAGES, PAGE, 576), out=None, lse=None, return_lse=return_lse
    )
    bound = inspect.signature(fi_mla.BatchMLAPagedAttentionWrapper.run).bind(object(), **kwargs)
    assert bound.arguments["return_lse_base_on_e"] is return_lse


def test_counter_rule_matches_flashinfer() -> None:
    """The counter pool's rule gives exactly FlashInfer's counter size."""
    from flashinfer.utils import get_trtllm_gen_multi_ctas_kv_counter_bytes

    from wspool.flashinfer.mla import COUNTER_RULE
    from wspool.rules import compile_rule

    rule = compile_rule(COUNTER_RULE)
    for batch, heads, sms in [(1, 16, 148), (512, 128, 148), (3, 5, 132), (64, 128, 160)]:
        want = get_trtllm_gen_multi_ctas_kv_counter_bytes(batch, heads, sms)
        assert rule.resolve({"batch_size": batch, "num_heads": heads, "sm_count": sms}) == want


def test_missing_flashinfer_has_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without FlashInfer, loading a kernel raises ImportError with the pip command."""
    import importlib

    def fail(name: str) -> None:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(importlib, "import_module", fail)
    with pytest.raises(ImportError, match=r"pip install 'flashinfer-python"):
        kernels.load_flashinfer_mla()
