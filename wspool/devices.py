"""Turning a caller's ``device`` argument into the device a pool lives on.

``None`` means the current device: the current CUDA device when CUDA is
available, else the CPU. ``"cuda"`` (or ``torch.device("cuda")``) means the
current CUDA device, read at call time. Nothing here creates a CUDA context
before a call that names CUDA.
"""

from __future__ import annotations

import torch

__all__ = ["DeviceLike", "is_dynamic", "resolve_device"]

DeviceLike = str | torch.device | int | None

_CPU = torch.device("cpu")
_cuda_devices: dict[int, torch.device] = {}
_cuda_available: bool | None = None


def _current_cuda() -> torch.device:
    index = torch.cuda.current_device()
    found = _cuda_devices.get(index)
    if found is None:
        found = _cuda_devices[index] = torch.device("cuda", index)
    return found


def _has_cuda() -> bool:
    global _cuda_available
    if _cuda_available is None:
        _cuda_available = torch.cuda.is_available()
    return _cuda_available


def is_dynamic(device: DeviceLike) -> bool:
    """Whether ``device`` names "the current device", which may change between calls."""
    if device is None or device == "cuda":
        return True
    return isinstance(device, torch.device) and device.type == "cuda" and device.index is None


def resolve_device(device: DeviceLike) -> torch.device:
    """Return the concrete device that ``device`` names now.

    Args:
        device: ``None``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``, an ``int`` CUDA
            index, or a ``torch.device``.

    Raises:
        ValueError: The argument does not name a device.
    """
    if device is None:
        return _current_cuda() if _has_cuda() else _CPU
    if isinstance(device, bool):
        raise ValueError(f"invalid device {device!r}")
    if isinstance(device, int):
        return torch.device("cuda", device)
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"invalid device {device!r}: {exc}") from None
    if resolved.type == "cuda" and resolved.index is None:
        return _current_cuda()
    return resolved
