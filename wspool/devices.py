"""Devices: turning a ``device`` argument into a ``torch.device``, the facts a rule may read about it, and lanes.

``None`` is the current device (CUDA when available, else the CPU); ``"cuda"``
is the current CUDA device, read at call time. A CUDA device's facts
(``sm_count``, ``cc_major``, ``cc_minor``, ``device_memory``) are read once per
device and cached; other devices have none. :func:`fake_device` makes any
device describe itself as a given GPU, for tests without CUDA. Nothing here
creates a CUDA context before a call that names CUDA; thread-safe.

A pool is keyed by ``(name, device, lane)`` and lanes never share memory:
work that may run concurrently takes a lane of its own (:func:`lane`, a
context variable that follows threads and asyncio tasks). With
``debug_streams`` on, :class:`StreamOrderWatch` warns once per pool and pair
of streams that used one buffer without ordering; off, it costs nothing.
"""

from __future__ import annotations

import contextvars
import threading
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch

from wspool.errors import ConfigError

__all__ = [
    "DEFAULT_LANE",
    "LANES_ENTERED",
    "DeviceDescription",
    "DeviceLike",
    "StreamOrderWarning",
    "StreamOrderWatch",
    "current_lane",
    "describe_device",
    "device_facts",
    "fake_device",
    "is_dynamic",
    "lane",
    "resolve_device",
]


_EMPTY: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True)
class DeviceDescription:
    """What wspool knows about one GPU.

    Attributes:
        name: The device's name, e.g. ``"NVIDIA H200"``.
        cc_major: Compute capability, major part (9 on Hopper, 10 on B200).
        cc_minor: Compute capability, minor part.
        sm_count: Streaming multiprocessors.
        device_memory: Total device memory in bytes.
    """

    name: str
    cc_major: int
    cc_minor: int
    sm_count: int
    device_memory: int

    @property
    def compute_capability(self) -> tuple[int, int]:
        """``(cc_major, cc_minor)``."""
        return self.cc_major, self.cc_minor

    def facts(self) -> Mapping[str, int]:
        """Return the device facts (the settings' ``DEVICE_FACTS``) as a read-only mapping."""
        return MappingProxyType(
            {
                "sm_count": self.sm_count,
                "cc_major": self.cc_major,
                "cc_minor": self.cc_minor,
                "device_memory": self.device_memory,
            }
        )

    def label(self) -> str:
        """Return e.g. ``"NVIDIA H200, compute capability 9.0, 132 SMs, 140.4 GiB"``."""
        return (
            f"{self.name}, compute capability {self.cc_major}.{self.cc_minor}, {self.sm_count} SMs, "
            f"{self.device_memory / 2**30:.1f} GiB"
        )


_fakes: dict[torch.device, DeviceDescription | None] = {}
_described: dict[torch.device, DeviceDescription] = {}
_facts: dict[torch.device, Mapping[str, int]] = {}


def describe_device(device: torch.device) -> DeviceDescription | None:
    """Return ``device``'s description, read once per device; ``None`` for devices that are not GPUs.

    Args:
        device: A concrete device (``cuda:0``, ``cpu``); a CUDA device without an
            index is the current one.

    Returns:
        The description; ``None`` off the GPU, and for a CUDA device that torch
        cannot describe (then the pool's first allocation there fails with torch's error).
    """
    if _fakes and device in _fakes:
        return _fakes[device]
    if device.type != "cuda":
        return None
    found = _described.get(device)
    if found is None:
        try:
            props = torch.cuda.get_device_properties(device)
        except (AssertionError, RuntimeError):
            # torch cannot describe it (built without CUDA, no such index): no facts, and the
            # pool's allocation on that device reports the real problem.
            return None
        found = DeviceDescription(
            name=str(props.name),
            cc_major=int(props.major),
            cc_minor=int(props.minor),
            sm_count=int(props.multi_processor_count),
            device_memory=int(props.total_memory),
        )
        _described[device] = found
    return found


def device_facts(device: torch.device) -> Mapping[str, int]:
    """Return the facts ``device`` supplies to rules (empty off the GPU), cached per device."""
    found = _facts.get(device)
    if found is None:
        description = describe_device(device)
        found = _EMPTY if description is None else description.facts()
        if not _fakes:
            _facts[device] = found
    return found


@contextmanager
def fake_device(device: torch.device | str, description: DeviceDescription | None) -> Iterator[None]:
    """Make ``device`` describe itself as ``description`` inside the block (a test hook).

    Registries built inside the block read the fake for pools on ``device``:
    ``fake_device("cpu", DeviceDescription("NVIDIA H200", 9, 0, 132, 141 << 30))``
    gives CPU pools the H200's facts and the profile ``auto`` picks for it.
    ``None`` makes a GPU look like it has no description.

    Thread semantics: the fake is process-wide while the block runs.
    """
    key = torch.device(device)
    previous = _fakes.get(key, _MISSING)
    _fakes[key] = description
    _facts.clear()
    try:
        yield
    finally:
        if previous is _MISSING:
            del _fakes[key]
        else:
            _fakes[key] = previous  # type: ignore[assignment]
        _facts.clear()


_MISSING = object()


DeviceLike = str | torch.device | int | None

_CPU = torch.device("cpu")
_cuda_devices: dict[int, torch.device] = {}
_cuda_available: bool | None = None


def _current_cuda() -> torch.device:
    try:
        index = torch.cuda.current_device()
    except (AssertionError, RuntimeError):  # a CPU build of torch, or no driver or device
        raise _no_cuda("cuda") from None
    found = _cuda_devices.get(index)
    if found is None:
        found = _cuda_devices[index] = torch.device("cuda", index)
    return found


def _no_cuda(device: object) -> ConfigError:
    """The error for a CUDA device asked for where torch sees none, saying what is missing."""
    why = "it is a CPU build" if torch.version.cuda is None else "it finds no CUDA driver or device"
    return ConfigError(
        f"device {str(device)!r} needs CUDA, but torch {torch.__version__} cannot use it here ({why}); "
        f"install a CUDA build of PyTorch on a machine with an NVIDIA GPU, or pass device='cpu'"
    )


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
        ConfigError: It names a CUDA device and torch can use none here (also a ``ValueError``).
    """
    if device is None:
        return _current_cuda() if _has_cuda() else _CPU
    if isinstance(device, bool):
        raise ValueError(f"invalid device {device!r}")
    if isinstance(device, int):
        if not torch.cuda.is_available():
            raise _no_cuda(f"cuda:{device}")
        return torch.device("cuda", device)
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"invalid device {device!r}: {exc}") from None
    if resolved.type == "cuda":
        if resolved.index is None:
            return _current_cuda()
        if not torch.cuda.is_available():  # asked live: only a pool's first lookup comes here
            raise _no_cuda(resolved)
    return resolved


DEFAULT_LANE = "main"

_LANE: contextvars.ContextVar[str] = contextvars.ContextVar("wspool_lane", default=DEFAULT_LANE)

#: The hot path reads the lane through this bound method (no attribute lookups).
current_lane = _LANE.get
#: ``[True]`` once any thread or task entered :func:`lane`: until then every lane is
#: :data:`DEFAULT_LANE`, which a hot path may take without asking.
LANES_ENTERED = [False]


@contextmanager
def lane(name: str) -> Iterator[str]:
    """Use lane ``name`` for every request made inside the block (this thread/task only).

    Example:
        >>> with wspool.lane("ubatch1"):
        ...     buf = reg.workspace("flashinfer_mla", device="cuda")
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a lane name must be a non-empty string, got {name!r}")
    LANES_ENTERED[0] = True
    token = _LANE.set(name)
    try:
        yield name
    finally:
        _LANE.reset(token)


class StreamOrderWarning(RuntimeWarning):
    """One pool's buffer was handed to two CUDA streams that are not ordered."""


class _Event(Protocol):
    """The part of :class:`torch.cuda.Event` the watch uses."""

    def record(self, stream: torch.cuda.Stream) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class StreamOrderWatch:
    """Watch one pool's requests for unordered use from two CUDA streams.

    Args:
        where: Names the pool in warnings, e.g. ``"pool 'flashinfer_mla' on cuda:0 (lane main)"``.
        device: The pool's CUDA device; its current stream is the requesting stream.
        current_stream: Returns the requesting stream (default
            ``torch.cuda.current_stream(device)``); tests pass fakes.
        new_event: Makes an event (default :class:`torch.cuda.Event`); tests pass fakes.
    """

    def __init__(
        self,
        where: str,
        device: torch.device,
        *,
        current_stream: Callable[[], Hashable] | None = None,
        new_event: Callable[[], _Event] | None = None,
    ) -> None:
        self.where = where
        self._current_stream: Callable[[], Hashable] = current_stream or (lambda: torch.cuda.current_stream(device))
        self._new_event: Callable[[], _Event] = new_event or torch.cuda.Event
        self._lock = threading.Lock()
        self._last: tuple[Hashable, _Event] | None = None
        self._warned: set[tuple[Hashable, Hashable]] = set()
        self.warning_count = 0
        """Warnings issued so far."""

    def observe(self) -> None:
        """Note a request from the current stream; warn if it races the previous stream's.

        Call outside CUDA-graph capture only.
        """
        stream = self._current_stream()
        event = self._new_event()
        event.record(stream)  # type: ignore[arg-type]
        with self._lock:
            previous = self._last
            self._last = (stream, event)
        if previous is None or previous[0] == stream:
            return
        old_stream, old_event = previous
        if old_event.query():
            return  # the old stream is past its request point: nothing decidable, stay quiet
        event.synchronize()  # wait until the new stream reaches its request point
        if old_event.query():
            return  # the new stream waited for the old one (or the old one just finished)
        self._warn(old_stream, stream)

    def _warn(self, old_stream: Hashable, new_stream: Hashable) -> None:
        with self._lock:
            if (old_stream, new_stream) in self._warned:
                return
            self._warned.add((old_stream, new_stream))
            self.warning_count += 1
        warnings.warn(
            f"wspool: {self.where} was handed to stream {new_stream} while stream {old_stream}, "
            f"which requested the same buffer earlier, had not reached that request on the GPU, and "
            f"{new_stream} did not wait for it: the two streams may use the buffer at the same time. "
            f"Give each stream its own lane (with wspool.lane('...') or lane='...'), or order the "
            f"streams (new.wait_stream(old)) before the request",
            StreamOrderWarning,
            stacklevel=4,
        )
