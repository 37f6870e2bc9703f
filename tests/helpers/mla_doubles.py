"""Test doubles of FlashInfer's MLA kernels that run on the CPU.

They take the same arguments as the real ones (the binding tests check that
wspool's calls fit the real signatures), carve or use the workspace they are
given the way FlashInfer does, and compute with the fp32 reference, so a
stale plan or a wrong buffer shows up as a wrong result.

The wrapper double builds FlashInfer's real MLA backend object at every plan,
as FlashInfer does (so wspool's constructor hook supplies its int workspace
and pinned copy, or the backend keeps an 8 MiB one of its own), writes the
plan's lengths into that int workspace and computes from what it reads back
(:mod:`tests.helpers.int_plans`).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

from tests.helpers.int_plans import read_plan, write_plan
from wspool.flashinfer.layouts import carve_trtllm_mla_workspace
from wspool.flashinfer.reference import mla_decode_reference
from wspool.units import MiB


def bind_to_flashinfer(name: str, *args: Any, **kwargs: Any) -> None:
    """Check a call against the installed FlashInfer's real signature (``"Class.method"`` or a function)."""
    import flashinfer.mla as real

    target: Any = real
    for part in name.split("."):
        target = getattr(target, part)
    inspect.signature(target).bind(*args, **kwargs)


class TrtllmDouble:
    """``trtllm_batch_decode_with_kv_cache_mla``: carves like the launcher, then computes."""

    def __init__(self, scratch_bytes: int = 32 * MiB) -> None:
        self.scratch_bytes = scratch_bytes
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> Any:
        bind_to_flashinfer("trtllm_batch_decode_with_kv_cache_mla", **kwargs)
        self.calls.append(kwargs)
        query = kwargs["query"]
        batch, q_len, heads, _ = query.shape
        carve_trtllm_mla_workspace(
            kwargs["workspace_buffer"].numel(),
            num_heads=heads,
            batch_size=batch,
            q_len=q_len,
            return_lse=kwargs["return_lse"],
            scratch_bytes=self.scratch_bytes,
        )
        kv = kwargs["kv_cache"].squeeze(1)
        out, lse = mla_decode_reference(
            query, kv, kwargs["block_tables"], kwargs["seq_lens"], sm_scale=kwargs["bmm1_scale"]
        )
        if kwargs["out"] is not None:
            kwargs["out"].copy_(out)
            out = kwargs["out"]
        lse = lse.view(batch * q_len, heads)
        if kwargs["lse"] is not None:  # FlashInfer writes a given LSE buffer and returns it
            kwargs["lse"].copy_(lse)
            lse = kwargs["lse"]
        if kwargs["return_lse"]:
            return out, lse
        return out


class WrapperDouble:
    """``BatchMLAPagedAttentionWrapper``: computes from the CSR metadata of its last plan."""

    instances: ClassVar[list[WrapperDouble]] = []
    partial_bytes = 17301504  # what FlashInfer's fa3 plan carves on an H200 (mla_partial_o)
    preflight_074 = False  # refuse as FlashInfer 0.7.4 does (a ValueError), not as 0.7.2.post1's allocator

    def __init__(self, float_workspace_buffer: torch.Tensor, backend: str = "auto", **kwargs: Any) -> None:
        bind_to_flashinfer(
            "BatchMLAPagedAttentionWrapper.__init__", self, float_workspace_buffer, backend=backend, **kwargs
        )
        self._float_workspace_buffer = float_workspace_buffer  # FlashInfer's own attribute name
        self.backend = backend
        self.init_kwargs = kwargs
        self.plan_calls = 0
        self.planned: dict[str, Any] | None = None
        self._planned_backend: Any = None
        WrapperDouble.instances.append(self)

    @property
    def workspace(self) -> torch.Tensor:
        """The float workspace the wrapper keeps."""
        return self._float_workspace_buffer

    def _build_backend(self) -> Any:
        """Build FlashInfer's fa2/fa3 backend object as its plan does (graph mode reuses the last int workspace)."""
        from flashinfer.mla._batch_mla._backends._fa_common import _BatchMLAGeneratedFaMechanics as backend_cls

        previous = self._planned_backend
        reuse = previous._int_workspace_buffer if self.init_kwargs.get("use_cuda_graph") and previous else None
        backend = backend_cls.__new__(backend_cls)
        try:
            backend_cls.__init__(
                backend, backend=self.backend, float_workspace_buffer=self.workspace,
                use_cuda_graph=bool(self.init_kwargs.get("use_cuda_graph")), qo_indptr_buf=None, kv_indptr_buf=None,
                kv_indices_buf=None, kv_len_arr_buf=None, int_workspace_buffer=reuse,
            )  # fmt: skip
        except RuntimeError:  # FlashInfer's own pinned copy, on a machine that cannot pin: the same pair, unpinned
            backend._int_workspace_buffer = reuse if reuse is not None else torch.empty(8 * MiB, dtype=torch.uint8)
            backend._pin_memory_int_workspace_buffer = torch.empty(backend._int_workspace_buffer.shape,
                                                                   dtype=torch.uint8)  # fmt: skip
        return backend

    def plan(self, **kwargs: Any) -> None:
        bind_to_flashinfer("BatchMLAPagedAttentionWrapper.plan", self, **kwargs)
        self.plan_calls += 1
        capacity = self.workspace.numel()
        if capacity < self.partial_bytes and self.preflight_074:
            # FlashInfer 0.7.4 refuses in Python first, naming the whole need (text as captured on an H200).
            raise ValueError(
                f"{self.backend} MLA needs {self.partial_bytes} float workspace bytes for partial outputs and LSE."
            )
        if capacity < self.partial_bytes:
            raise RuntimeError(
                "Error in function 'aligned_alloc' at allocator.h:49: Buffer overflow when allocating memory for "
                f"mla_partial_o with size {self.partial_bytes} and alignment 16, but only {capacity} bytes "
                "available in AlignedAllocator. Increase the workspace buffer size."
            )
        meta = kwargs["metadata"]
        backend = self._build_backend()
        qo_indptr, kv_indptr, _, kv_lens = meta
        write_plan(backend._int_workspace_buffer, [qo_indptr, kv_indptr, kv_lens], "mla_q_indptr", self.plan_calls)
        # Copy, as FlashInfer does at plan time: later in-place edits must not leak in.
        self.planned = {**kwargs, "csr": tuple(t.clone() for t in meta)}
        self._planned_backend = backend
        # FlashInfer mirrors the backend's buffers onto the wrapper.
        self._int_workspace_buffer = backend._int_workspace_buffer
        self._pin_memory_int_workspace_buffer = backend._pin_memory_int_workspace_buffer

    def run(self, **kwargs: Any) -> Any:
        bind_to_flashinfer("BatchMLAPagedAttentionWrapper.run", self, **kwargs)
        assert self.planned is not None, "run() before plan()"
        _, kv_indices, _ = self.planned["csr"][1:]
        # Whatever plan the backend's int workspace holds now (another wrapper's, on a shared region).
        _, (qo_indptr, kv_indptr, kv_lens) = read_plan(self._planned_backend._int_workspace_buffer)
        query, kv_cache = kwargs["query"], kwargs["kv_cache"]
        batch = kv_lens.numel()
        q_len = int(qo_indptr[1] - qo_indptr[0])
        heads = query.shape[1]
        widest = int((kv_indptr[1:] - kv_indptr[:-1]).max())
        tables = torch.zeros(batch, max(widest, 1), dtype=torch.int32)
        for b in range(batch):
            pages = kv_indices[kv_indptr[b] : kv_indptr[b + 1]]
            tables[b, : pages.numel()] = pages
        out, lse = mla_decode_reference(
            query.view(batch, q_len, heads, -1), kv_cache, tables, kv_lens, sm_scale=self.planned["sm_scale"]
        )
        out = out.view(batch * q_len, heads, -1)
        lse = lse.view(batch * q_len, heads)
        if kwargs["out"] is not None:
            kwargs["out"].copy_(out)
            out = kwargs["out"]
        if kwargs["lse"] is not None:  # FlashInfer writes a given LSE buffer and returns it
            kwargs["lse"].copy_(lse)
            lse = kwargs["lse"]
        # FlashInfer rejects a run whose LSE mode differs from the plan's.
        run_mode = "basee" if kwargs["return_lse_base_on_e"] else ("base2" if kwargs["return_lse"] else "none")
        if run_mode != self.planned["lse_mode"]:
            raise ValueError(f"MLA planned run argument LSE mode mismatch: planned {self.planned['lse_mode']!r}")
        if kwargs["return_lse"]:
            return out, lse
        return out


def metadata_csr(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Stand-in for ``MLAPlanMetadata.csr``: the tensors themselves."""
    return tensors


def fake_flashinfer_mla(trtllm: TrtllmDouble | None = None) -> SimpleNamespace:
    """A stand-in for the ``flashinfer.mla`` module built from the doubles."""
    return SimpleNamespace(
        trtllm_batch_decode_with_kv_cache_mla=trtllm or TrtllmDouble(),
        BatchMLAPagedAttentionWrapper=WrapperDouble,
        MLAPlanMetadata=SimpleNamespace(csr=metadata_csr),
    )
