"""Fixtures of the FlashInfer tests: the CPU standing in for a Hopper or a Blackwell GPU, with FlashInfer's doubles."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.mla_doubles import TrtllmDouble, WrapperDouble, fake_flashinfer_mla
from tests.helpers.paged_doubles import DecodeWrapperDouble, PrefillWrapperDouble, fake_flashinfer
from wspool.flashinfer import backends, kernels
from wspool.flashinfer import paged as paged_module


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Pretend the CPU is an SM90 GPU whose FlashInfer is the wrapper double."""
    WrapperDouble.instances.clear()
    monkeypatch.setattr(backends, "device_arch", lambda device: (9, 0))
    monkeypatch.setattr(kernels, "load_flashinfer_mla", lambda: fake_flashinfer_mla())
    yield


@pytest.fixture
def blackwell(monkeypatch: pytest.MonkeyPatch) -> TrtllmDouble:
    """Pretend the CPU is an SM100 GPU whose trtllm-gen kernel is the carving double."""
    double = TrtllmDouble()
    monkeypatch.setattr(backends, "device_arch", lambda device: (10, 0))
    monkeypatch.setattr(kernels, "load_flashinfer_mla", lambda: fake_flashinfer_mla(double))
    return double


@pytest.fixture
def h200_wrapper_doubles(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Pretend the CPU is an H200 (132 SMs) whose FlashInfer is the wrapper doubles."""
    DecodeWrapperDouble.instances.clear()
    PrefillWrapperDouble.instances.clear()
    monkeypatch.setattr(paged_module, "_has_kernels", lambda device: True)
    monkeypatch.setattr(backends, "sm_count", lambda device: 132)
    monkeypatch.setattr(kernels, "load_flashinfer_attention", fake_flashinfer)
    yield
