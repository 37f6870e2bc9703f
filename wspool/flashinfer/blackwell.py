"""MLA decode on Blackwell as vLLM calls it: trtllm-gen or cute-dsl, with decode-context parallelism.

vLLM's FlashInfer MLA backend calls ``trtllm_batch_decode_with_kv_cache_mla``
with ``backend="trtllm-gen"``, falling back to ``"cute-dsl"`` for the shapes
trtllm-gen cannot tile, and with ``backend="cute-dsl"``, ``enable_dcp=True``,
``cp_world``, ``cp_rank`` and ``causal_seqlens_kv_global`` under
decode-context parallelism (DCP). The cute-dsl kernel takes an ``int8``
workspace; wspool hands it an ``int8`` view of the pool's ``uint8`` buffer
(the same memory).

This module holds the choices and checks that do not need a GPU:

- :func:`blackwell_backend` resolves ``"auto"`` to the concrete kernel, the
  rule FlashInfer's own sources state (trtllm-gen refuses
  ``64 < num_heads < 128`` and page sizes other than 32 and 64; DCP exists
  only in cute-dsl);
- :func:`check_dcp` rejects bad DCP arguments with a ``ValueError`` naming the
  argument, before any pool grows or kernel runs;
- :func:`cute_dsl_workspace_bytes` asks FlashInfer's own cute-dsl size
  function (pure Python; it imports on the CPU) what a call needs;
- :func:`check_kernel_keywords` names the installed FlashInfer version when
  its kernel lacks a keyword wspool passes.

Device semantics: nothing here allocates or touches CUDA. Thread-safe.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "BLACKWELL_BACKENDS",
    "DCPArgs",
    "blackwell_backend",
    "check_dcp",
    "check_kernel_keywords",
    "cute_dsl_workspace_bytes",
    "int8_view",
]

#: The kernels of ``trtllm_batch_decode_with_kv_cache_mla`` that wspool drives.
BLACKWELL_BACKENDS = ("trtllm-gen", "cute-dsl")
_TRTLLM_PAGE_SIZES = (32, 64)


@dataclass(frozen=True)
class DCPArgs:
    """Decode-context-parallel arguments of one MLA decode plan (all defaults: no DCP).

    Attributes:
        enable_dcp: Whether this rank holds every ``cp_world``-th token of each request.
        cp_world: The DCP group's size.
        cp_rank: This rank's index in it.
        causal_seqlens_kv_global: ``[batch]`` int32 global lengths (the causal bound), with DCP.
    """

    enable_dcp: bool = False
    cp_world: int = 1
    cp_rank: int = 0
    causal_seqlens_kv_global: torch.Tensor | None = None

    def kwargs(self) -> dict[str, Any]:
        """FlashInfer's keyword arguments for them."""
        return {
            "enable_dcp": self.enable_dcp,
            "cp_world": self.cp_world,
            "cp_rank": self.cp_rank,
            "causal_seqlens_kv_global": self.causal_seqlens_kv_global,
        }


def check_dcp(
    enable_dcp: object,
    cp_world: object,
    cp_rank: object,
    causal_seqlens_kv_global: object,
    *,
    backend: str,
    return_lse: bool,
    batch_size: int,
    device: torch.device,
) -> DCPArgs:
    """Validate the DCP arguments of a plan; return them.

    Args:
        enable_dcp, cp_world, cp_rank, causal_seqlens_kv_global: As the plan was given them.
        backend: The backend asked for (``"auto"`` or a concrete one).
        return_lse: Whether the plan returns the LSE (DCP merges rank-local results by it).
        batch_size: Requests in the plan.
        device: The plan's device.

    Raises:
        ValueError: Naming the argument: a wrong type or range, ``cp_rank >= cp_world``,
            DCP arguments without ``enable_dcp=True``, or DCP with a backend or option that lacks it.
    """
    if not isinstance(enable_dcp, bool):
        raise ValueError(f"enable_dcp must be True or False, got {enable_dcp!r}")
    if isinstance(cp_world, bool) or not isinstance(cp_world, int) or cp_world < 1:
        raise ValueError(f"cp_world must be a positive integer, got {cp_world!r}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or cp_rank < 0:
        raise ValueError(f"cp_rank must be a non-negative integer, got {cp_rank!r}")
    if not enable_dcp:
        given = [f"cp_world={cp_world}"] if cp_world != 1 else []
        given += [f"cp_rank={cp_rank}"] if cp_rank != 0 else []
        given += ["causal_seqlens_kv_global"] if causal_seqlens_kv_global is not None else []
        if given:
            raise ValueError(f"{', '.join(given)} given without enable_dcp=True; pass enable_dcp=True for DCP")
        return DCPArgs()
    if cp_rank >= cp_world:
        raise ValueError(f"cp_rank must be below cp_world, got cp_rank={cp_rank}, cp_world={cp_world}")
    if backend not in ("auto", "cute-dsl"):
        raise ValueError(f"enable_dcp=True runs only on backend='cute-dsl' (or 'auto'), got backend={backend!r}")
    if not return_lse:
        raise ValueError("enable_dcp=True needs return_lse=True: the ranks' partial results are merged by their LSE")
    lengths = causal_seqlens_kv_global
    if (
        not isinstance(lengths, torch.Tensor)
        or lengths.dtype != torch.int32
        or tuple(lengths.shape) != (batch_size,)
        or lengths.device != device
    ):
        shown = (
            f"{tuple(lengths.shape)} {lengths.dtype} on {lengths.device}"
            if isinstance(lengths, torch.Tensor)
            else repr(lengths)
        )
        raise ValueError(
            f"causal_seqlens_kv_global must be a [{batch_size}] int32 tensor on {device} with enable_dcp=True, "
            f"got {shown}"
        )
    return DCPArgs(True, cp_world, cp_rank, lengths)


def blackwell_backend(backend: str, *, num_heads: int, page_size: int, enable_dcp: bool) -> str:
    """Resolve ``backend`` on a Blackwell GPU to ``"trtllm-gen"`` or ``"cute-dsl"``.

    ``"auto"`` takes trtllm-gen, as vLLM does, unless the call needs cute-dsl:
    DCP, or a head count or page size trtllm-gen cannot tile.
    """
    if backend != "auto":
        return backend
    if enable_dcp or 64 < num_heads < 128 or page_size not in _TRTLLM_PAGE_SIZES:
        return "cute-dsl"
    return "trtllm-gen"


def cute_dsl_workspace_bytes(
    *, batch_size: int, q_len: int, num_heads: int, kv_lora_rank: int, sm_count: int, max_seq_len: int,
    enable_dcp: bool,
) -> int:  # fmt: skip
    """Return the workspace bytes FlashInfer's cute-dsl MLA decode needs for these facts.

    Asks FlashInfer itself: the size function of the cute-dsl implementation
    its dispatcher picks for the call (monolithic with DCP), called the way
    its own autotuner calls it. It runs on the CPU.

    Raises:
        ImportError: The installed FlashInfer has no such function (the message names its version).
    """
    try:
        core = importlib.import_module("flashinfer.mla._core")
        resolve = core._resolve_cute_dsl_workspace_sizer
        call = core._call_cute_dsl_workspace_sizer
        sizer, impl = resolve("auto", None, enable_dcp)
    except (ImportError, AttributeError) as exc:
        raise ImportError(
            f"FlashInfer {_flashinfer_version()} has no cute-dsl MLA workspace size function ({exc}); "
            f"wspool's cute-dsl path is tested with flashinfer-python 0.7.2.post1 and 0.7.4"
        ) from exc
    _, nbytes = call(sizer, impl, batch_size, q_len, num_heads, kv_lora_rank, sm_count, max_seq_len)
    return int(nbytes)


def int8_view(workspace: torch.Tensor) -> torch.Tensor:
    """The pool's ``uint8`` buffer as the ``int8`` tensor the cute-dsl kernel asserts (same memory)."""
    return workspace.view(torch.int8)


_checked: set[int] = set()


def check_kernel_keywords(kernel: Callable[..., Any], keywords: Iterable[str]) -> None:
    """Check once per kernel that it takes every keyword wspool passes.

    Raises:
        TypeError: It lacks one; the message names the installed FlashInfer version.
    """
    if id(kernel) in _checked:
        return
    try:
        parameters = inspect.signature(kernel).parameters
    except (TypeError, ValueError):  # a builtin or double without a signature: nothing to check
        return
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    missing = [k for k in keywords if k not in parameters and not takes_any]
    if missing:
        raise TypeError(
            f"FlashInfer {_flashinfer_version()}'s {getattr(kernel, '__name__', 'kernel')} takes no "
            f"{', '.join(missing)}; install flashinfer-python 0.7.2.post1 or 0.7.4 (the tested versions)"
        )
    _checked.add(id(kernel))


def _flashinfer_version() -> str:
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown version)"
