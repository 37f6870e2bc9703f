"""Measuring, on the current GPU, the float workspace FlashInfer's planned MLA wrapper needs.

A size is probed with ``plan()`` alone on a slice of one large buffer (its
allocator is bounds-checked) and confirmed by ``run()`` with an untouched guard
region; Blackwell's unchecked trtllm-gen scratch is not measured. One CUDA
device, chosen at construction; not thread-safe.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

import torch

from wspool.devices import DeviceLike, resolve_device
from wspool.flashinfer import kernels
from wspool.flashinfer.backends import BLACKWELL_BACKENDS, KV_LORA_RANK, QK_ROPE_HEAD_DIM, select_path
from wspool.flashinfer.refusals import parse_refusal
from wspool.tools.calibrate import NEEDS_GPU
from wspool.tools.direct import SM_SCALE
from wspool.tools.search import CalibrationError, SearchResult, search_min_bytes
from wspool.tools.sweep import MLAShape
from wspool.units import GiB, MiB, ceil_div, format_size

__all__ = ["MLAWorkspaceProbe", "device_description"]

_GUARD_BYTES = 1 * MiB
_GUARD_VALUE = 0xA5
_ROOMY_BYTES = 256 * MiB
_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM


def device_description(device: torch.device, path: str) -> dict[str, str]:
    """Describe the device, the library versions and the kernel path (for headers and JSON)."""
    props = torch.cuda.get_device_properties(device)
    try:
        flashinfer = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        flashinfer = str(getattr(importlib.import_module("flashinfer"), "__version__", "unknown"))
    return {
        "device": f"{props.name} (compute capability {props.major}.{props.minor}, {props.multi_processor_count} SMs, "
        f"{props.total_memory / GiB:.0f} GiB)",
        "sm_count": str(props.multi_processor_count),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "flashinfer": flashinfer,
        "path": path,
    }


class MLAWorkspaceProbe:
    """Finds and checks the float workspace of MLA decode through FlashInfer's planned wrapper.

    ``backend`` is resolved to a concrete one first. ``CalibrationError``: no CUDA
    device, or the device takes a Blackwell path.
    """

    def __init__(self, device: DeviceLike = None, *, backend: str = "auto", kv_pages: int = 4096, seed: int = 0):
        if not torch.cuda.is_available():
            raise CalibrationError(NEEDS_GPU)
        self.device = resolve_device("cuda" if device is None else device)
        if self.device.type != "cuda":
            raise CalibrationError(f"needs a CUDA device, got {self.device}")
        self.path = select_path(self.device, backend)
        if self.path in BLACKWELL_BACKENDS:
            raise CalibrationError(
                f"cannot measure {self.path} MLA decode (Blackwell): trtllm-gen's scratch is not bounds-checked "
                "and cute-dsl's need comes from FlashInfer's own size function, so no probe is needed or possible; "
                "use the shipped configuration blackwell, the launcher's formula with a margin (--config "
                "blackwell, WSPOOL_CONFIG=blackwell)"
            )
        self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._fi = kernels.load_flashinfer_mla()
        self._kv_pages = kv_pages
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._buffer = torch.zeros(0, dtype=torch.uint8, device=self.device)
        self._roomy: torch.Tensor | None = None
        self._kv: dict[int, torch.Tensor] = {}
        self._metadata: dict[MLAShape, tuple[Any, ...]] = {}

    def describe(self) -> dict[str, str]:
        """The device, library versions and kernel path."""
        path = "planned wrapper (BatchMLAPagedAttentionWrapper), backend " + self.path
        return device_description(self.device, path + ", bf16")

    # -- probing -----------------------------------------------------------------

    def fits(self, shape: MLAShape, nbytes: int) -> int | None:
        """Plan ``shape`` on an ``nbytes`` workspace: ``None`` if it fits, else the bytes the overflow named."""
        try:
            self._plan(shape, self._workspace(nbytes)[:nbytes])
        except (RuntimeError, ValueError) as exc:  # the C++ allocator's, or FlashInfer's Python checks
            refusal = parse_refusal(exc, self.path)
            if refusal is None:
                raise
            return refusal.needed_capacity(nbytes, padding=False)
        return None

    def search(self, shape: MLAShape, *, granularity: int = 1) -> SearchResult:
        """Find the smallest float workspace ``plan()`` accepts for ``shape``."""
        return search_min_bytes(lambda n: self.fits(shape, n), granularity=granularity)

    def verify(self, shape: MLAShape, nbytes: int) -> str | None:
        """Plan and run ``shape`` on ``nbytes``; ``None`` if the guard is untouched and results match, else why not."""
        buffer = self._workspace(nbytes)
        guard = buffer[nbytes : nbytes + _GUARD_BYTES]
        guard.fill_(_GUARD_VALUE)
        query = self._random((shape.batch_size * shape.q_len, shape.num_heads, _DIM))
        try:
            got = self._run(shape, buffer[:nbytes], query)
        except (RuntimeError, ValueError) as exc:
            return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        torch.cuda.synchronize(self.device)
        if not bool((guard == _GUARD_VALUE).all()):
            return f"the kernel wrote past the {nbytes}-byte workspace"
        if self._roomy is None:
            self._roomy = torch.zeros(_ROOMY_BYTES, dtype=torch.uint8, device=self.device)
        want = self._run(shape, self._roomy, query)
        for name, a, b in zip(("output", "lse"), got, want, strict=False):
            if not bool(torch.isfinite(a).all()):
                return f"non-finite {name}"
            diff = float((a.float() - b.float()).abs().max())
            if diff > 1e-2:
                return f"{name} differs from a run with a {format_size(_ROOMY_BYTES)} workspace by {diff:.3g}"
        return None

    # -- FlashInfer calls (the arguments wspool's MLA op passes) -----------------

    def _plan(self, shape: MLAShape, workspace: torch.Tensor) -> Any:
        wrapper = self._fi.BatchMLAPagedAttentionWrapper(
            **kernels.wrapper_init_kwargs(workspace=workspace, backend=self.path)
        )
        wrapper.plan(
            **kernels.wrapper_plan_kwargs(
                metadata=self._fi.MLAPlanMetadata.csr(*self._csr(shape)),
                num_heads=shape.num_heads,
                kv_lora_rank=KV_LORA_RANK,
                qk_rope_head_dim=QK_ROPE_HEAD_DIM,
                page_size=shape.page_size,
                causal=shape.q_len > 1,
                sm_scale=SM_SCALE,
                q_dtype=torch.bfloat16,
                kv_dtype=torch.bfloat16,
                return_lse=shape.return_lse,
            )
        )
        return wrapper

    def _run(self, shape: MLAShape, workspace: torch.Tensor, query: torch.Tensor) -> tuple[torch.Tensor, ...]:
        wrapper = self._plan(shape, workspace)
        result = wrapper.run(
            **kernels.wrapper_run_kwargs(
                query=query, kv_cache=self._kv_cache(shape.page_size), out=None, lse=None, return_lse=shape.return_lse
            )
        )
        return tuple(result) if shape.return_lse else (result,)

    # -- inputs --------------------------------------------------------------------

    def _workspace(self, nbytes: int) -> torch.Tensor:
        if self._buffer.numel() < nbytes + _GUARD_BYTES:
            self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)  # free before growing
            self._buffer = torch.zeros(nbytes + _GUARD_BYTES, dtype=torch.uint8, device=self.device)
        return self._buffer

    def _random(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=self._generator, device=self.device, dtype=torch.bfloat16)

    def _kv_cache(self, page_size: int) -> torch.Tensor:
        found = self._kv.get(page_size)
        if found is None:
            found = self._kv[page_size] = self._random((self._kv_pages, page_size, _DIM))
        return found

    def _csr(self, shape: MLAShape) -> tuple[Any, ...]:
        """Every request at ``max_seq_len`` tokens, its pages drawn at random from the shared cache."""
        found = self._metadata.get(shape)
        if found is None:
            batch, q_len, device = shape.batch_size, shape.q_len, self.device
            pages = ceil_div(shape.max_seq_len, shape.page_size)
            found = self._metadata[shape] = (
                torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=device),
                torch.arange(0, (batch + 1) * pages, pages, dtype=torch.int32, device=device),
                torch.randint(
                    0, self._kv_pages, (batch * pages,), generator=self._generator, device=device, dtype=torch.int32
                ),
                torch.full((batch,), shape.max_seq_len, dtype=torch.int32, device=device),
            )
        return found
