"""MLA decode's device facts and kernel paths: which path a device runs, and the checks every plan shares.

The MLA geometry (latent 512, rope 64) and the Blackwell compute capabilities
live here, once; the kernels, the benchmark and the sweep read them from here.
Nothing here imports FlashInfer or creates a CUDA context at import.
Thread semantics: thread-safe (the capability cache is filled idempotently).
"""

from __future__ import annotations

import torch

from wspool.device_facts import device_facts
from wspool.flashinfer.blackwell import BLACKWELL_BACKENDS, blackwell_backend

__all__ = [
    "BACKENDS",
    "BLACKWELL_ARCHS",
    "KV_LORA_RANK",
    "QK_ROPE_HEAD_DIM",
    "call_facts",
    "check_int_tensor",
    "device_arch",
    "select_path",
    "sm_count",
]

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
    # The device's fact (read once per device; wspool.device_facts.fake_device stands a CPU in for a GPU);
    # 1 off the GPU, where the reference path runs.
    return device_facts(device).get("sm_count", 1)


def select_path(
    device: torch.device, backend: str = "auto", *, num_heads: int = 128, page_size: int = 64, enable_dcp: bool = False
) -> str:
    """Return the concrete kernel path for ``device``, never ``"auto"``.

    ``"auto"`` is ``"reference"`` on the CPU, trtllm-gen or cute-dsl on
    Blackwell (see :func:`~wspool.flashinfer.blackwell.blackwell_backend`:
    ``num_heads``, ``page_size`` and ``enable_dcp`` decide), ``"fa3"`` on
    Hopper (SM90) and ``"fa2"`` on every other CUDA device.

    Raises:
        ValueError: ``backend`` is unknown, names a GPU kernel for a CPU device,
            or a Blackwell kernel for another GPU.
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


def check_int_tensor(name: str, tensor: torch.Tensor, dim: int, device: torch.device) -> None:
    """Check that ``tensor`` is a ``dim``-D integer tensor on ``device`` (the page table's device).

    Raises:
        ValueError: It is not, naming ``name``.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != dim or tensor.dtype not in (torch.int32, torch.int64):
        shown = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must be a {dim}-D int32 tensor, got {shown}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, but block_tables is on {device}")


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
    """Return the facts an MLA decode call passes to its pool's rules (``cp_world`` left out when ``None``).

    The one place the fact names of an MLA call are spelled: the plan, the
    calibration sweep and the benchmark all build them here.
    """
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
