"""Tests for wspool.flashinfer.kernels: every FlashInfer call binds to the installed signatures; wrapper owners."""

from __future__ import annotations

import gc
import inspect
import weakref
from types import ModuleType

import pytest
import torch

from wspool.flashinfer import kernels
from wspool.flashinfer.backends import DCPArgs

B, H, PAGES, PAGE = 2, 16, 8, 64


@pytest.fixture
def fi_mla() -> ModuleType:
    """The installed ``flashinfer.mla`` (the binding tests skip without FlashInfer)."""
    return pytest.importorskip("flashinfer.mla", reason="flashinfer-python is not installed")


def _t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


def _trtllm_kwargs(backend: str, dcp: DCPArgs, counters: torch.Tensor | None) -> dict[str, object]:
    return kernels.trtllm_decode_kwargs(
        query=_t(B, 1, H, 576), kv_cache=_t(PAGES, PAGE, 576), workspace=_t(1024, dtype=torch.uint8),
        backend=backend, dcp=dcp, counters=counters, block_tables=_t(B, 4, dtype=torch.int32),
        seq_lens=_t(B, dtype=torch.int32), max_seq_len=256, sm_scale=0.1, out=None, lse=None, return_lse=True,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
    )  # fmt: skip


def test_trtllm_gen_decode_binds(fi_mla: ModuleType) -> None:
    """The trtllm-gen call binds to trtllm_batch_decode_with_kv_cache_mla: uint8 workspace, counters, no DCP."""
    counters = _t(64, dtype=torch.uint8)
    kwargs = _trtllm_kwargs("trtllm-gen", DCPArgs(), counters)
    bound = inspect.signature(fi_mla.trtllm_batch_decode_with_kv_cache_mla).bind(**kwargs)
    assert bound.arguments["return_lse_base"] == "basee" and bound.arguments["backend"] == "trtllm-gen"
    assert bound.arguments["kv_cache"].shape == (PAGES, 1, PAGE, 576)
    assert bound.arguments["multi_ctas_kv_counter_buffer"] is counters
    assert bound.arguments["workspace_buffer"].dtype is torch.uint8
    assert (bound.arguments["enable_dcp"], bound.arguments["cp_world"], bound.arguments["cp_rank"]) == (False, 1, 0)


def test_cute_dsl_dcp_decode_binds(fi_mla: ModuleType) -> None:
    """The cute-dsl DCP call binds as vLLM makes it: int8 view of the workspace, DCP arguments, no counters."""
    lengths = _t(B, dtype=torch.int32)
    kwargs = _trtllm_kwargs("cute-dsl", DCPArgs(True, 4, 3, lengths), None)
    bound = inspect.signature(fi_mla.trtllm_batch_decode_with_kv_cache_mla).bind(**kwargs)
    assert bound.arguments["backend"] == "cute-dsl" and bound.arguments["multi_ctas_kv_counter_buffer"] is None
    assert bound.arguments["workspace_buffer"].dtype is torch.int8
    assert (bound.arguments["enable_dcp"], bound.arguments["cp_world"], bound.arguments["cp_rank"]) == (True, 4, 3)
    assert bound.arguments["causal_seqlens_kv_global"] is lengths


def test_every_trtllm_keyword_is_listed_and_taken(fi_mla: ModuleType) -> None:
    """TRTLLM_DECODE_KEYWORDS is exactly what wspool passes, and the installed kernel takes each one by name."""
    kwargs = _trtllm_kwargs("trtllm-gen", DCPArgs(), None)
    assert set(kwargs) == set(kernels.TRTLLM_DECODE_KEYWORDS)
    parameters = inspect.signature(fi_mla.trtllm_batch_decode_with_kv_cache_mla).parameters
    assert [k for k in kernels.TRTLLM_DECODE_KEYWORDS if k not in parameters] == []


@pytest.mark.parametrize("graph", [False, True])
def test_wrapper_init_binds(graph: bool, fi_mla: ModuleType) -> None:
    """BatchMLAPagedAttentionWrapper(...) binds in eager and CUDA-graph form."""
    buffers = tuple(_t(n, dtype=torch.int32) for n in (B + 1, B + 1, PAGES, B)) if graph else None
    kwargs = kernels.wrapper_init_kwargs(workspace=_t(1024, dtype=torch.uint8), backend="fa3", graph_buffers=buffers)  # type: ignore[arg-type]
    signature = inspect.signature(fi_mla.BatchMLAPagedAttentionWrapper.__init__)
    bound = signature.bind(object(), **kwargs)
    assert bound.arguments.get("use_cuda_graph", False) is graph


@pytest.mark.parametrize("return_lse", [False, True])
def test_wrapper_plan_binds(return_lse: bool, fi_mla: ModuleType) -> None:
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
def test_wrapper_run_binds(return_lse: bool, fi_mla: ModuleType) -> None:
    """wrapper.run binds with packed inputs; the natural-log flag matches the plan's LSE mode."""
    kwargs = kernels.wrapper_run_kwargs(
        query=_t(B, H, 576), kv_cache=_t(PAGES, PAGE, 576), out=None, lse=None, return_lse=return_lse
    )
    bound = inspect.signature(fi_mla.BatchMLAPagedAttentionWrapper.run).bind(object(), **kwargs)
    assert bound.arguments["return_lse_base_on_e"] is return_lse


def test_missing_flashinfer_has_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without FlashInfer, loading a kernel raises ImportError with the pip command."""
    import importlib

    def fail(name: str) -> None:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(importlib, "import_module", fail)
    monkeypatch.setattr(kernels, "_flashinfer_mla", None)  # as in a fresh process
    with pytest.raises(ImportError, match=r"pip install 'flashinfer-python"):
        kernels.load_flashinfer_mla()


def _paged_csr() -> dict[str, torch.Tensor]:
    return {
        "kv_indptr": _t(B + 1, dtype=torch.int32),
        "kv_indices": _t(PAGES, dtype=torch.int32),
        "kv_last_page_len": _t(B, dtype=torch.int32),
    }


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_paged_decode_calls_bind(tensor_cores: bool) -> None:
    """BatchDecodeWithPagedKVCacheWrapper's constructor, plan (and its keyword-only _plan_impl) and run bind."""
    flashinfer = pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    cls = flashinfer.BatchDecodeWithPagedKVCacheWrapper
    init = kernels.paged_decode_init_kwargs(
        workspace=_t(1024, dtype=torch.uint8), backend="auto", use_tensor_cores=tensor_cores
    )
    assert inspect.signature(cls.__init__).bind(object(), **init).arguments["kv_layout"] == "NHD"
    plan = kernels.paged_decode_plan_kwargs(
        **_paged_csr(), num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, sm_scale=0.1,
        q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
    )  # fmt: skip
    inspect.signature(cls.plan).bind(object(), **plan)
    bound = inspect.signature(cls._plan_impl).bind(object(), **plan)  # plan() passes **kwargs through to it
    assert bound.arguments["q_data_type"] is torch.bfloat16
    run = kernels.paged_decode_run_kwargs(
        query=_t(B, 32, 128), kv_cache=_t(PAGES, 2, 16, 8, 128), out=None, lse=None, return_lse=True
    )
    assert inspect.signature(cls.run).bind(object(), **run).arguments["return_lse"] is True
    assert "lse_base" not in inspect.signature(cls.run).parameters  # so wspool converts decode's base-2 LSE


def test_paged_prefill_calls_bind() -> None:
    """BatchPrefillWithPagedKVCacheWrapper's constructor, plan and run bind; run asks for the natural-log LSE."""
    flashinfer = pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    cls = flashinfer.BatchPrefillWithPagedKVCacheWrapper
    init = kernels.paged_prefill_init_kwargs(workspace=_t(1024, dtype=torch.uint8), backend="auto")
    inspect.signature(cls.__init__).bind(object(), **init)
    plan = kernels.paged_prefill_plan_kwargs(
        qo_indptr=_t(B + 1, dtype=torch.int32), **_paged_csr(), num_qo_heads=32, num_kv_heads=8, head_dim=128,
        page_size=16, causal=True, sm_scale=0.1, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
    )  # fmt: skip
    assert inspect.signature(cls.plan).bind(object(), **plan).arguments["causal"] is True
    run = kernels.paged_prefill_run_kwargs(
        query=_t(10, 32, 128), kv_cache=_t(PAGES, 2, 16, 8, 128), out=None, lse=None, return_lse=True
    )
    assert inspect.signature(cls.run).bind(object(), **run).arguments["lse_base"] == "ln"


def test_an_ownership_record_lives_as_long_as_its_wrapper() -> None:
    """Every plan gets the one record of a wrapper; the side table never keeps the wrapper alive."""

    class Wrapper:
        pass

    wrapper = Wrapper()
    record = kernels.ownership(wrapper)
    assert kernels.ownership(wrapper) is record and record.owner is None
    alive = weakref.ref(wrapper)
    del wrapper
    gc.collect()
    assert alive() is None


# -- FlashInfer's private names, each read through one accessor -----------------------------------------------


def _private_names_read() -> dict[str, tuple[str, ...]]:
    """FlashInfer's wrapper classes and the private attributes their constructors set that wspool reads."""
    mla = pytest.importorskip("flashinfer.mla", reason="flashinfer-python is not installed")
    prefill = pytest.importorskip("flashinfer.prefill")
    decode = pytest.importorskip("flashinfer.decode")
    return {
        "BatchMLAPagedAttentionWrapper": (inspect.getsource(mla.BatchMLAPagedAttentionWrapper), "_backend"),
        "BatchPrefillWithRaggedKVCacheWrapper": (
            inspect.getsource(prefill.BatchPrefillWithRaggedKVCacheWrapper),
            "_backend",
            "_float_workspace_buffer",
        ),
        "BatchPrefillWithPagedKVCacheWrapper": (
            inspect.getsource(prefill.BatchPrefillWithPagedKVCacheWrapper),
            "_float_workspace_buffer",
        ),
        "BatchDecodeWithPagedKVCacheWrapper": (
            inspect.getsource(decode.BatchDecodeWithPagedKVCacheWrapper),
            "_float_workspace_buffer",
        ),
    }


def test_the_installed_flashinfer_still_sets_the_private_names_read() -> None:
    """Each wrapper class wspool reads a private attribute of still assigns it (else: which name, which releases)."""
    from importlib.metadata import version

    from wspool.flashinfer.backends import PRIVATE_NAMES_READ

    found = _private_names_read()
    assert len(found) == 4
    gone = [
        f"{cls}.{name}" for cls, (source, *names) in found.items() for name in names if f"self.{name} = " not in source
    ]
    assert not gone, (
        f"flashinfer-python {version('flashinfer-python')} no longer sets {', '.join(gone)}: "
        f"wspool.flashinfer.kernels.wrapper_backend / wrapper_float_workspace were read from {PRIVATE_NAMES_READ}"
    )


def test_the_installed_flashinfer_has_the_cute_dsl_size_functions() -> None:
    """FlashInfer's private cute-dsl size functions are found (the ImportError names the releases read otherwise)."""
    pytest.importorskip("flashinfer.mla", reason="flashinfer-python is not installed")
    from wspool.flashinfer.backends import cute_dsl_sizer_functions

    resolve, call = cute_dsl_sizer_functions()
    assert callable(resolve) and callable(call)


def test_a_wrapper_without_the_private_names_is_named() -> None:
    """No ``_backend``: none; no ``_float_workspace_buffer``: an error naming the releases read."""
    assert kernels.wrapper_backend(object()) is None
    with pytest.raises(
        AttributeError, match=r"^object has no _float_workspace_buffer \(read from flashinfer-python 0\.7\.1rc2"
    ):
        kernels.wrapper_float_workspace(object())
