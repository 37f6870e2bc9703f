"""Fixtures shared by the engine integrations' tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture
def warnings_seen(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Capture the vLLM plugin's log lines (vLLM's logger may not propagate to the root logger)."""
    log = logging.getLogger("vllm.wspool")
    log.addHandler(caplog.handler)
    previous = log.level
    log.setLevel(logging.DEBUG)
    try:
        yield caplog
    finally:
        log.setLevel(previous)
        log.removeHandler(caplog.handler)
