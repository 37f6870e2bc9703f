"""MLA decode's kernel paths: which path a device runs, its Blackwell arguments, and the float workspace it needs.

wspool resolves ``backend="auto"`` itself, so the buffer's size never picks the
kernel and each path's need is known before FlashInfer is called (paths:
docs/kernels.md; versions: docs/flashinfer-versions.md). Pure functions apart
from FlashInfer's own size function, which runs on the CPU; thread-safe.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from wspool.devices import device_facts
from wspool.flashinfer.layouts import check_int_tensor, fa_mla_float_workspace_bytes, softmax_slab_bytes

__all__ = [
    "BACKENDS",
    "BLACKWELL_ARCHS",
    "BLACKWELL_BACKENDS",
    "KV_LORA_RANK",
    "PRIVATE_NAMES_READ",
    "QK_ROPE_HEAD_DIM",
    "READ_VERSIONS",
    "TRTLLM_SCRATCH_BYTES",
    "DCPArgs",
    "blackwell_backend",
    "call_facts",
    "check_dcp",
    "check_int_tensor",  # importable here too; it lives with the page-table checks in layouts
    "check_kernel_keywords",
    "cute_dsl_sizer_functions",
    "cute_dsl_workspace_bytes",
    "device_arch",
    "int8_view",
    "path_need_bytes",
    "select_path",
    "sm_count",
]


#: The kernels of ``trtllm_batch_decode_with_kv_cache_mla`` that wspool drives.
BLACKWELL_BACKENDS = ("trtllm-gen", "cute-dsl")
_TRTLLM_PAGE_SIZES = (32, 64)


@dataclass(frozen=True)
class DCPArgs:
    """Decode-context-parallel arguments of one MLA decode plan (all defaults: no DCP)."""

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
    """Validate a plan's DCP arguments and return them; ``ValueError`` names a bad one.

    DCP needs ``return_lse`` (ranks merge by it) and a backend that has it.
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
    """Resolve ``backend`` on Blackwell: ``"auto"`` is trtllm-gen unless DCP or the shape needs cute-dsl."""
    if backend != "auto":
        return backend
    if enable_dcp or 64 < num_heads < 128 or page_size not in _TRTLLM_PAGE_SIZES:
        return "cute-dsl"
    return "trtllm-gen"


def cute_dsl_workspace_bytes(
    *,
    batch_size: int,
    q_len: int,
    num_heads: int,
    kv_lora_rank: int,
    sm_count: int,
    max_seq_len: int,
    enable_dcp: bool,
) -> int:
    """Return the workspace bytes FlashInfer's cute-dsl MLA decode needs, asking its own size function on the CPU."""
    resolve, call = cute_dsl_sizer_functions()
    try:
        sizer, impl = resolve("auto", None, enable_dcp)
    except AttributeError as exc:
        raise ImportError(
            f"FlashInfer {_flashinfer_version()} has no cute-dsl MLA workspace size function ({exc}); "
            f"wspool's cute-dsl path is tested with {PRIVATE_NAMES_READ}"
        ) from exc
    _, nbytes = call(sizer, impl, batch_size, q_len, num_heads, kv_lora_rank, sm_count, max_seq_len)
    return int(nbytes)


#: The FlashInfer releases whose source wspool has read (0.7.3's was not available; it is admitted
#: as vLLM 0.34.0 pins it): their refusal texts, their MLA backend constructor and their private names.
READ_VERSIONS = ("0.7.1rc2", "0.7.2", "0.7.2.post1", "0.7.4")
#: :data:`READ_VERSIONS` in words, for messages about the private names read: the cute-dsl size
#: functions here, and the wrappers' ``_backend`` and ``_float_workspace_buffer`` (``wspool.flashinfer.kernels``).
PRIVATE_NAMES_READ = f"flashinfer-python {', '.join(READ_VERSIONS[:-1])} and {READ_VERSIONS[-1]}"


def cute_dsl_sizer_functions() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Return FlashInfer's private cute-dsl size functions (:data:`PRIVATE_NAMES_READ`); ``ImportError`` if absent."""
    try:
        core = importlib.import_module("flashinfer.mla._core")
        return core._resolve_cute_dsl_workspace_sizer, core._call_cute_dsl_workspace_sizer
    except (ImportError, AttributeError) as exc:
        raise ImportError(
            f"FlashInfer {_flashinfer_version()} has no cute-dsl MLA workspace size function ({exc}); "
            f"wspool's cute-dsl path is tested with {PRIVATE_NAMES_READ}"
        ) from exc


def int8_view(workspace: torch.Tensor) -> torch.Tensor:
    """The pool's ``uint8`` buffer as the ``int8`` tensor the cute-dsl kernel asserts (same memory)."""
    return workspace.view(torch.int8)


_checked: set[int] = set()


def check_kernel_keywords(kernel: Callable[..., Any], keywords: Iterable[str]) -> None:
    """Check once per kernel that it takes every keyword wspool passes; ``TypeError`` names the FlashInfer version."""
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
            f"{', '.join(missing)}; install flashinfer-python 0.7.1rc2, 0.7.2, 0.7.2.post1 or 0.7.4 "
            "(the tested versions)"
        )
    _checked.add(id(kernel))


def _flashinfer_version() -> str:
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown version)"


#: DeepSeek-style MLA geometry: the latent (compressed KV) width and the rope width per head.
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
BACKENDS = ("auto", "reference", "trtllm-gen", "cute-dsl", "fa3", "fa2")
#: The Blackwell compute capabilities (SM100, SM103, SM107) that run trtllm-gen and cute-dsl.
BLACKWELL_ARCHS = ((10, 0), (10, 3), (10, 7))

_capabilities: dict[torch.device, tuple[int, int]] = {}


def device_arch(device: torch.device) -> tuple[int, int] | None:
    """Return a CUDA device's compute capability (read once per device), ``None`` off the GPU."""
    if device.type != "cuda":
        return None
    found = _capabilities.get(device)
    if found is None:
        found = _capabilities[device] = torch.cuda.get_device_capability(device)
    return found


def sm_count(device: torch.device) -> int:
    """Return the device's SM count fact (1 off the GPU, where the reference path runs)."""
    # The device's fact (read once per device; wspool.devices.fake_device stands a CPU in for a GPU);
    # 1 off the GPU, where the reference path runs.
    return device_facts(device).get("sm_count", 1)


def select_path(
    device: torch.device, backend: str = "auto", *, num_heads: int = 128, page_size: int = 64, enable_dcp: bool = False
) -> str:
    """Return the concrete kernel path for ``device``, never ``"auto"`` (the table in docs/kernels.md).

    ``ValueError``: ``backend`` is unknown or not for this device.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown MLA decode backend {backend!r} (choose one of {', '.join(BACKENDS)})")
    if backend == "reference":
        return "reference"
    arch = device_arch(device)
    if arch is None:
        if backend == "auto":
            return "reference"
        raise ValueError(f"MLA decode backend {backend!r} needs a CUDA device, got {device}; use backend='reference'")
    if arch in BLACKWELL_ARCHS and backend in ("auto", *BLACKWELL_BACKENDS):
        return blackwell_backend(backend, num_heads=num_heads, page_size=page_size, enable_dcp=enable_dcp)
    if backend in BLACKWELL_BACKENDS:
        raise ValueError(
            f"MLA decode backend {backend!r} needs Blackwell (SM100/SM103/SM107), this GPU is SM{arch[0]}{arch[1]}; "
            f"use backend='auto'"
        )
    if backend == "auto":
        return "fa3" if arch == (9, 0) else "fa2"
    return backend


def call_facts(
    *,
    batch_size: int,
    q_len: int,
    num_heads: int,
    max_seq_len: int,
    page_size: int,
    dtype_bytes: int,
    sm_count: int,
    cp_world: int | None,
    kv_lora_rank: int = KV_LORA_RANK,
    qk_rope_head_dim: int = QK_ROPE_HEAD_DIM,
) -> dict[str, int]:
    """Return the facts an MLA decode call passes to its pool's rules (``cp_world`` left out when ``None``)."""
    facts = {
        "batch_size": batch_size,
        "q_len": q_len,
        "num_heads": num_heads,
        "max_seq_len": max_seq_len,
        "page_size": page_size,
        "kv_lora_rank": kv_lora_rank,
        "qk_rope_head_dim": qk_rope_head_dim,
        "dtype_bytes": dtype_bytes,
        "sm_count": sm_count,
    }
    if cp_world is not None:
        facts["cp_world"] = cp_world
    return facts


#: The scratch kept behind trtllm-gen's softmax slab (unchecked by FlashInfer; about 20-32 MB on a B200).
TRTLLM_SCRATCH_BYTES = 64 << 20


def path_need_bytes(
    path: str,
    *,
    sm_count: int,
    batch_size: int,
    q_len: int,
    num_heads: int,
    kv_lora_rank: int,
    max_seq_len: int,
    return_lse: bool,
    enable_dcp: bool = False,
) -> int:
    """Return the float workspace bytes concrete ``path`` is known to need for one plan's facts."""
    if path in ("fa3", "fa2"):
        return fa_mla_float_workspace_bytes(
            sm_count=sm_count, num_heads=num_heads, q_len=q_len, kv_lora_rank=kv_lora_rank
        )
    if path == "trtllm-gen":
        slab = softmax_slab_bytes(num_heads, batch_size, q_len) if return_lse else 0
        return slab + TRTLLM_SCRATCH_BYTES
    if path == "cute-dsl":
        return cute_dsl_workspace_bytes(
            batch_size=batch_size,
            q_len=q_len,
            num_heads=num_heads,
            kv_lora_rank=kv_lora_rank,
            sm_count=sm_count,
            max_seq_len=max_seq_len,
            enable_dcp=enable_dcp,
        )
    if path == "reference":
        return 0
    raise ValueError(f"no known workspace need for MLA decode path {path!r}; resolve 'auto' first")
