"""Shared fixtures: a clean environment and default registry for every test, and the gpu marker."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

import wspool

# CI runs each property at least 2,000 times; local runs stay quick.
settings.register_profile("ci", max_examples=2000, deadline=None)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(autouse=True)
def clean_wspool_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Remove WSPOOL_* variables and engine knobs, and forget the default registry around each test."""
    from wspool.settings.profiles import engine_knobs

    knobs = {knob.name for knob in engine_knobs()}
    for name in list(os.environ):
        if name.startswith("WSPOOL_") or name in knobs:
            monkeypatch.delenv(name)
    wspool.reset_registry()
    yield
    wspool.reset_registry()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip gpu-marked tests, with the reason, where no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none is available on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
