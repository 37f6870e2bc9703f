"""Tests for wspool.settings.profiles: the package data matches configs/, and survives a regular installation."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT
from wspool.errors import ConfigError
from wspool.settings.profiles import shipped_config, shipped_config_names, shipped_text


def test_top_level_configs_are_the_package_data() -> None:
    """configs/*.yaml, the files users read and copy, are byte for byte the shipped package data."""
    top = sorted(p.stem for p in (REPO_ROOT / "configs").glob("*.yaml"))
    assert top == shipped_config_names()
    for name in top:
        assert (REPO_ROOT / "configs" / f"{name}.yaml").read_text() == shipped_text("configs", name), name


def test_shipped_config_is_a_readable_path() -> None:
    """shipped_config returns a file the configuration loader reads."""
    assert shipped_config("hopper").read_text().startswith("#")


def test_an_unknown_shipped_config_is_a_config_error() -> None:
    """Asking for a file that is not shipped names the ones that are."""
    with pytest.raises(ConfigError, match=r"no shipped configuration 'nope' \(shipped: blackwell, default"):
        shipped_config("nope")


def test_bench_finds_its_rules_in_the_package() -> None:
    """wspool bench's default rules come from the package data, not from a path next to the sources."""
    import wspool.tools.bench

    assert not hasattr(wspool.tools.bench, "_CONFIGS")
    assert shipped_config("hopper").parent.parts[-2:] == ("data", "configs")


@pytest.mark.slow
def test_a_regular_install_finds_the_profiles_and_configs(tmp_path: Path) -> None:
    """A non-editable pip install (no dependencies, no build isolation) loads every profile and shipped config,
    each also by its name."""
    pytest.importorskip("setuptools", reason="building the wheel without isolation needs setuptools")
    source = tmp_path / "src"
    shutil.copytree(REPO_ROOT / "wspool", source / "wspool", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*install, "--target", str(target), str(source)], check=True, capture_output=True, timeout=300)
    check = (
        "import wspool, wspool.settings.profiles as p, wspool.settings.profiles as s\n"
        f"assert wspool.__file__.startswith({str(target)!r}), wspool.__file__\n"
        "for n in s.shipped_config_names():\n"
        "    assert wspool.load_settings(n) == wspool.load_settings(s.shipped_config(n)), n\n"
        "    for q in p.PROFILE_NAMES:\n"
        "        wspool.load_settings(s.shipped_config(n), profile=q)\n"
        "print(sorted(s.shipped_config_names()), p.load_profile('hopper').measured)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    names = "['blackwell', 'default', 'hopper', 'kimi_dcp', 'sglang', 'tokenspeed', 'vllm']"
    assert result.stdout.strip() == f"{names} True"
