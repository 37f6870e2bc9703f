"""Test doubles of FlashInfer's paged decode and prefill wrappers that run on the CPU.

They bind every call to the installed FlashInfer's real signatures, carve the
float workspace they are given the way a split-KV plan does (an undersized one
raises FlashInfer's overflow message), copy the page table at plan time as
FlashInfer does, and compute with the fp32 reference from what was planned, so
a stale plan or a wrong buffer shows up as a wrong result. Like FlashInfer's,
they keep an 8 MiB int workspace of their own until ``reset_workspace_buffer``
swaps it, write the plan's lengths into it, and read them back at run time
(:mod:`tests.helpers.int_plans`). Decode returns FlashInfer's base-2 LSE;
prefill honours ``lse_base``.
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

from tests.helpers.int_plans import read_plan, write_plan
from wspool.flashinfer.reference import paged_attention_reference
from wspool.units import MiB


def bind_to_flashinfer(name: str, *args: Any, **kwargs: Any) -> None:
    """Check a call against ``flashinfer.<Class>.<method>``'s real signature (``plan`` also against ``_plan_impl``)."""
    import flashinfer

    cls_name, method = name.split(".")
    cls = getattr(flashinfer, cls_name)
    inspect.signature(getattr(cls, method)).bind(*args, **kwargs)
    if method == "plan" and hasattr(cls, "_plan_impl"):  # decode's plan takes **kwargs: check the names too
        inspect.signature(cls._plan_impl).bind(*args, **kwargs)


def overflow_message(name: str, size: int, available: int) -> str:
    """FlashInfer's AlignedAllocator error, as its plan raises it."""
    return (
        f"Error in function 'aligned_alloc' at allocator.h:85: Buffer overflow when allocating memory for {name} "
        f"with size {size} and alignment 16, but only {available} bytes available in AlignedAllocator. "
        "Increase the workspace buffer size."
    )


class _WrapperDouble:
    """What the decode and prefill doubles share: carving at plan time, computing at run time."""

    cls_name: ClassVar[str]
    carve: ClassVar[str]
    int_carve: ClassVar[str]
    instances: ClassVar[list[Any]]
    partial_bytes: ClassVar[int] = 3 * MiB  # what the split-KV carve asks for
    int_overflow: ClassVar[bool] = False  # raise an overflow of FlashInfer's own int workspace instead
    pinned_failures: ClassVar[int] = 0  # how many of the next host copies fail to allocate, as pinned memory may

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", **kwargs: Any) -> None:
        bind_to_flashinfer(f"{self.cls_name}.__init__", self, float_workspace_buffer, kv_layout, **kwargs)
        # FlashInfer's own attribute names for the float workspace and the backend the wrapper was built with.
        self._float_workspace_buffer = float_workspace_buffer
        self._backend = kwargs.get("backend", "auto")
        self.init_kwargs = {"kv_layout": kv_layout, **kwargs}
        self.plan_calls = 0
        self.planned: dict[str, Any] | None = None
        # FlashInfer's own int workspace and its host copy (pinned on a GPU machine).
        self._int_workspace_buffer = torch.empty(8 * MiB, dtype=torch.uint8)
        self._pin_memory_int_workspace_buffer = torch.empty(8 * MiB, dtype=torch.uint8)
        type(self).instances.append(self)

    @property
    def workspace(self) -> torch.Tensor:
        """The float workspace the wrapper keeps."""
        return self._float_workspace_buffer

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor) -> None:
        bind_to_flashinfer(f"{self.cls_name}.reset_workspace_buffer", self, float_workspace_buffer,
                           int_workspace_buffer)  # fmt: skip
        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = int_workspace_buffer
        # FlashInfer makes a new host copy of the int workspace's size, after it stored the new workspace.
        if self.pinned_failures:
            type(self).pinned_failures -= 1
            raise RuntimeError("CUDA error: out of memory (a pinned host copy)")
        self._pin_memory_int_workspace_buffer = torch.empty(int_workspace_buffer.shape, dtype=torch.uint8)

    def plan(self, **kwargs: Any) -> None:
        bind_to_flashinfer(f"{self.cls_name}.plan", self, **kwargs)
        self.plan_calls += 1
        self.planned = None
        capacity = self.workspace.numel()
        if self.int_overflow:
            raise RuntimeError(overflow_message("batch_prefill_sm90_qo_tile_indices", 9 * MiB, 8 * MiB))
        if capacity < self.partial_bytes:
            raise RuntimeError(overflow_message(self.carve, self.partial_bytes, capacity))
        # Copy, as FlashInfer does at plan time: later in-place edits must not leak in.
        planned = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        indptr, _, last = self._csr(planned)
        write_plan(self._int_workspace_buffer, [indptr, last], self.int_carve, self.plan_calls)
        self.planned = planned

    def _compute(self, query: torch.Tensor, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.planned is not None, "run() before a successful plan()"
        p = self.planned
        _, indices, _ = self._csr(p)
        _, (indptr, last) = read_plan(self._int_workspace_buffer)  # whatever plan the int workspace holds now
        page_size = p["page_size"]
        batch = last.numel()
        counts = (indptr[1:] - indptr[:-1]).tolist()
        tables = torch.zeros(batch, max(max(counts), 1), dtype=torch.int32)
        for b in range(batch):
            tables[b, : counts[b]] = indices[indptr[b] : indptr[b + 1]]
        seq_lens = (indptr[1:] - indptr[:-1] - 1) * page_size + last
        qo_indptr = p.get("qo_indptr", torch.arange(batch + 1, dtype=torch.int32))
        return paged_attention_reference(
            query, kv_cache, qo_indptr, tables, seq_lens, sm_scale=p["sm_scale"], causal=p.get("causal", False)
        )

    def _csr(self, p: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _finish(self, kwargs: dict[str, Any], out: torch.Tensor, lse: torch.Tensor) -> Any:
        if kwargs.get("out") is not None:
            out = kwargs["out"].copy_(out)
        if not kwargs.get("return_lse"):
            return out
        if kwargs.get("lse") is not None:
            lse = kwargs["lse"].copy_(lse)
        return out, lse


class DecodeWrapperDouble(_WrapperDouble):
    """``BatchDecodeWithPagedKVCacheWrapper``; its LSE is base 2, like FlashInfer's decode kernels."""

    cls_name = "BatchDecodeWithPagedKVCacheWrapper"
    carve = "batch_decode_tmp_v"
    int_carve = "batch_decode_request_indices"
    instances: ClassVar[list[Any]] = []

    @property
    def use_tensor_cores(self) -> bool:
        """FlashInfer's public property: whether it plans with the prefill planner."""
        return bool(self.init_kwargs.get("use_tensor_cores", False))

    def _csr(self, p: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return p["indptr"], p["indices"], p["last_page_len"]

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor, **kwargs: Any) -> Any:
        bind_to_flashinfer(f"{self.cls_name}.run", self, q, paged_kv_cache, **kwargs)
        out, lse = self._compute(q, paged_kv_cache)
        return self._finish(kwargs, out, lse / math.log(2.0))


class PrefillWrapperDouble(_WrapperDouble):
    """``BatchPrefillWithPagedKVCacheWrapper``; its LSE is in the base asked for."""

    cls_name = "BatchPrefillWithPagedKVCacheWrapper"
    carve = "batch_prefill_tmp_v"
    int_carve = "batch_prefill_request_indices"
    instances: ClassVar[list[Any]] = []

    def _csr(self, p: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return p["paged_kv_indptr"], p["paged_kv_indices"], p["paged_kv_last_page_len"]

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor, **kwargs: Any) -> Any:
        bind_to_flashinfer(f"{self.cls_name}.run", self, q, paged_kv_cache, **kwargs)
        out, lse = self._compute(q, paged_kv_cache)
        return self._finish(kwargs, out, lse if kwargs.get("lse_base") == "ln" else lse / math.log(2.0))


class RaggedWrapperDouble(_WrapperDouble):
    """``BatchPrefillWithRaggedKVCacheWrapper``, as far as it is built and given a workspace (no plan or run)."""

    cls_name = "BatchPrefillWithRaggedKVCacheWrapper"
    carve = "batch_prefill_tmp_v"
    int_carve = "batch_prefill_request_indices"
    instances: ClassVar[list[Any]] = []


def fake_flashinfer() -> SimpleNamespace:
    """A stand-in for the ``flashinfer`` module built from the doubles."""
    return SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=DecodeWrapperDouble,
        BatchPrefillWithPagedKVCacheWrapper=PrefillWrapperDouble,
    )
