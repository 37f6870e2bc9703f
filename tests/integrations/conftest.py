"""Fixtures shared by the engine integrations' tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version

import pytest

from tests.helpers.tokenspeed_cpu import enter_tokenspeed_on_cpu

#: The TokenSpeed release the integration targets.
TOKENSPEED_VERSION = "0.1.1"


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


@pytest.fixture(scope="session")
def tokenspeed_on_cpu(tmp_path_factory: pytest.TempPathFactory) -> bool:
    """TokenSpeed 0.1.1 importable in this process, with the CPU stand-ins where there is no GPU (True if installed).

    Skips where TokenSpeed is not installed or is another version
    (``.ci/engine-envs tokenspeed`` builds ``.venv-tokenspeed``). The
    stand-ins (tests/helpers/tokenspeed_cpu.py) stay for the rest of the session.
    """
    try:
        installed = version("tokenspeed")
    except PackageNotFoundError:
        pytest.skip("TokenSpeed is not installed here; `.ci/engine-envs tokenspeed` builds .venv-tokenspeed with it")
    if installed != TOKENSPEED_VERSION:
        pytest.skip(f"the integration targets TokenSpeed {TOKENSPEED_VERSION}; this environment has {installed}")
    return enter_tokenspeed_on_cpu(tmp_path_factory.mktemp("tokenspeed-cpu"))
