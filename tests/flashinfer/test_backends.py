"""Tests for wspool.flashinfer.backends: path selection, Blackwell's backends and DCP checks, and each path's need."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest
import torch

from wspool.flashinfer import backends, select_path
from wspool.flashinfer.backends import (
    TRTLLM_SCRATCH_BYTES,
    DCPArgs,
    blackwell_backend,
    check_dcp,
    check_kernel_keywords,
    cute_dsl_workspace_bytes,
    int8_view,
    path_need_bytes,
)
from wspool.rules import compile_rule
from wspool.units import MiB

CPU = torch.device("cpu")
FACTS = {"sm_count": 132, "batch_size": 64, "q_len": 1, "num_heads": 128, "kv_lora_rank": 512, "max_seq_len": 4096}


def test_path_selection() -> None:
    """CPU picks the reference; GPU kernels are never replaced by it silently; unknown backends fail."""
    cpu = torch.device("cpu")
    assert select_path(cpu) == "reference"
    assert select_path(cpu, "reference") == "reference"
    with pytest.raises(ValueError, match="backend 'fa3' needs a CUDA device"):
        select_path(cpu, "fa3")
    with pytest.raises(ValueError, match="unknown MLA decode backend 'flash'"):
        select_path(cpu, "flash")


def test_blackwell_and_hopper_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """'auto' resolves to a concrete path: trtllm-gen on SM100/103/107, fa3 on SM90, fa2 elsewhere."""
    gpu = torch.device("cuda", 0)
    for arch, path in [((10, 0), "trtllm-gen"), ((10, 3), "trtllm-gen"), ((9, 0), "fa3"), ((8, 0), "fa2"),
                       ((8, 9), "fa2"), ((12, 0), "fa2")]:  # fmt: skip
        monkeypatch.setattr(backends, "device_arch", lambda device, arch=arch: arch)
        assert select_path(gpu) == path
    assert select_path(gpu, "fa2") == "fa2"


def test_blackwell_auto_takes_cute_dsl_where_trtllm_gen_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    """On Blackwell, DCP, 64 < heads < 128 and page sizes other than 32/64 take cute-dsl; explicit choices stay."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(backends, "device_arch", lambda device: (10, 0))
    assert select_path(gpu, num_heads=16, page_size=32) == "trtllm-gen"
    assert select_path(gpu, num_heads=96) == "cute-dsl"
    assert select_path(gpu, page_size=128) == "cute-dsl"
    assert select_path(gpu, enable_dcp=True) == "cute-dsl"
    assert select_path(gpu, "trtllm-gen", num_heads=96) == "trtllm-gen"  # FlashInfer says why it refuses


def test_blackwell_kernels_elsewhere_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking for a Blackwell kernel on Hopper is a ValueError naming the backend, before any kernel runs."""
    monkeypatch.setattr(backends, "device_arch", lambda device: (9, 0))
    with pytest.raises(ValueError, match=r"backend 'cute-dsl' needs Blackwell \(SM100/SM103/SM107\), this GPU is SM90"):
        select_path(torch.device("cuda", 0), "cute-dsl")


# -- Blackwell: trtllm-gen or cute-dsl, and decode-context parallel ---------------------


def _dcp(**kwargs: Any) -> DCPArgs:
    args: dict[str, Any] = {"enable_dcp": True, "cp_world": 4, "cp_rank": 1,
                            "causal_seqlens_kv_global": torch.zeros(2, dtype=torch.int32)}  # fmt: skip
    args.update(kwargs)
    return check_dcp(
        args["enable_dcp"], args["cp_world"], args["cp_rank"], args["causal_seqlens_kv_global"],
        backend=args.get("backend", "cute-dsl"), return_lse=args.get("return_lse", True), batch_size=2, device=CPU,
    )  # fmt: skip


def test_no_dcp_is_the_default() -> None:
    """Default arguments mean no DCP, and FlashInfer gets its own defaults."""
    dcp = check_dcp(False, 1, 0, None, backend="auto", return_lse=False, batch_size=2, device=CPU)
    assert dcp == DCPArgs()
    assert dcp.kwargs() == {"enable_dcp": False, "cp_world": 1, "cp_rank": 0, "causal_seqlens_kv_global": None}


def test_valid_dcp_is_kept() -> None:
    """A valid DCP call keeps its rank, world and global lengths."""
    dcp = _dcp()
    assert (dcp.enable_dcp, dcp.cp_world, dcp.cp_rank) == (True, 4, 1)
    assert dcp.causal_seqlens_kv_global is not None


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"cp_rank": 4}, r"cp_rank must be below cp_world, got cp_rank=4, cp_world=4"),
        ({"cp_rank": 7}, r"cp_rank must be below cp_world"),
        ({"cp_rank": -1}, r"cp_rank must be a non-negative integer, got -1"),
        ({"cp_world": 0}, r"cp_world must be a positive integer, got 0"),
        ({"cp_world": True}, r"cp_world must be a positive integer, got True"),
        ({"enable_dcp": 1}, r"enable_dcp must be True or False, got 1"),
        ({"enable_dcp": False}, r"cp_world=4, cp_rank=1, causal_seqlens_kv_global given without enable_dcp=True"),
        ({"backend": "trtllm-gen"}, r"enable_dcp=True runs only on backend='cute-dsl'.*got backend='trtllm-gen'"),
        ({"return_lse": False}, r"enable_dcp=True needs return_lse=True"),
        ({"causal_seqlens_kv_global": None}, r"causal_seqlens_kv_global must be a \[2\] int32 tensor.*got None"),
        ({"causal_seqlens_kv_global": torch.zeros(3, dtype=torch.int32)}, r"causal_seqlens_kv_global must be a \[2\]"),
        ({"causal_seqlens_kv_global": torch.zeros(2)}, r"causal_seqlens_kv_global.*got \(2,\) torch.float32"),
    ],
)
def test_bad_dcp_arguments_name_the_argument(change: dict[str, Any], match: str) -> None:
    """Each bad DCP argument is a ValueError that names it."""
    with pytest.raises(ValueError, match=match):
        _dcp(**change)


def test_dcp_arguments_without_enable_dcp_are_named_one_by_one() -> None:
    """Without enable_dcp, only the DCP arguments actually given are named."""
    with pytest.raises(ValueError, match=r"^cp_rank=2 given without enable_dcp=True"):
        check_dcp(False, 1, 2, None, backend="auto", return_lse=True, batch_size=2, device=CPU)


def test_auto_backend_follows_flashinfers_limits() -> None:
    """'auto' takes trtllm-gen unless DCP, 64 < heads < 128 or a page size other than 32/64 need cute-dsl."""
    assert blackwell_backend("auto", num_heads=128, page_size=64, enable_dcp=False) == "trtllm-gen"
    assert blackwell_backend("auto", num_heads=16, page_size=32, enable_dcp=False) == "trtllm-gen"
    assert blackwell_backend("auto", num_heads=65, page_size=64, enable_dcp=False) == "cute-dsl"
    assert blackwell_backend("auto", num_heads=128, page_size=16, enable_dcp=False) == "cute-dsl"
    assert blackwell_backend("auto", num_heads=128, page_size=64, enable_dcp=True) == "cute-dsl"
    assert blackwell_backend("trtllm-gen", num_heads=96, page_size=64, enable_dcp=False) == "trtllm-gen"


def test_int8_view_is_the_same_memory() -> None:
    """The cute-dsl workspace is an int8 view of the pool's uint8 buffer, not a copy."""
    buffer = torch.zeros(64, dtype=torch.uint8)
    view = int8_view(buffer)
    assert view.dtype is torch.int8 and view.data_ptr() == buffer.data_ptr() and view.numel() == 64


def test_cute_dsl_size_comes_from_flashinfer() -> None:
    """cute-dsl's need is what FlashInfer's own size function (the implementation its dispatcher picks) says."""
    pytest.importorskip("flashinfer.mla", reason="flashinfer-python is not installed")
    from flashinfer.cute_dsl.attention.monolithic.mla_decode import _get_split_kv_and_workspace_size

    facts = {"batch_size": 32, "q_len": 1, "num_heads": 128, "kv_lora_rank": 512, "sm_count": 148,
             "max_seq_len": 4096}  # fmt: skip
    want = _get_split_kv_and_workspace_size(32, 1, 128, 512, 148, 4096)[1]  # DCP: the monolithic kernel
    assert cute_dsl_workspace_bytes(**facts, enable_dcp=True) == want > 0
    assert cute_dsl_workspace_bytes(**facts, enable_dcp=False) > 0
    print(f"\nFlashInfer {importlib.metadata.version('flashinfer-python')}: cute-dsl needs {want} bytes", end="")


def test_a_kernel_without_a_keyword_names_the_version() -> None:
    """A kernel lacking a keyword wspool passes is a TypeError naming the installed FlashInfer version."""

    def old_kernel(query: object, enable_dcp: bool = False) -> None: ...

    with pytest.raises(TypeError, match=r"FlashInfer \S+'s old_kernel takes no cp_rank; install flashinfer-python"):
        check_kernel_keywords(old_kernel, ("query", "enable_dcp", "cp_rank"))
    check_kernel_keywords(old_kernel, ("query", "enable_dcp"))


# -- what each path needs, known before FlashInfer is called ---------------------------


@pytest.mark.parametrize("path", ["fa3", "fa2"])
def test_planned_wrapper_need_is_the_sm_count_rule(path: str) -> None:
    """fa3/fa2 need 64 * sm_count * (4 * kv_lora_rank + 8) on an H200: 17369088 bytes, whatever the LSE."""
    for lse in (False, True):
        assert path_need_bytes(path, **FACTS, return_lse=lse) == 17369088
    assert compile_rule("64 * sm_count * (4 * kv_lora_rank + 8)").resolve(FACTS) == 17369088


def test_trtllm_gen_need_is_the_slab_and_its_scratch() -> None:
    """trtllm-gen needs the launcher's softmax slab with the LSE, and the scratch margin always."""
    slab = 8 * 128 * 64 * 256 + MiB
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
