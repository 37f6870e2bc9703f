"""Tests for wspool.settings.profiles: the package data is configs/ itself, and the wheel and installs hold it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT
from wspool.errors import ConfigError
from wspool.settings.profiles import PROFILE_NAMES, shipped_config, shipped_config_names, shipped_text

SHIPPED_CONFIGS = ["blackwell", "default", "hopper", "kimi_dcp", "sglang", "tokenspeed", "vllm"]


def _copy_source(destination: Path) -> Path:
    """Copy the files a build reads into ``destination``, links kept as links (as a checkout holds them)."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO_ROOT / "wspool", destination / "wspool", symlinks=True, ignore=ignore)
    shutil.copytree(REPO_ROOT / "configs", destination / "configs", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, destination / name)
    return destination


def test_configs_are_the_package_data_through_one_link() -> None:
    """The package's data/configs is a link to configs/, so each shipped configuration exists once."""
    link = REPO_ROOT / "wspool" / "data" / "configs"
    assert link.is_symlink() and link.resolve() == (REPO_ROOT / "configs").resolve()
    top = sorted(p.stem for p in (REPO_ROOT / "configs").glob("*.yaml"))
    assert top == SHIPPED_CONFIGS
    assert shipped_config_names() == SHIPPED_CONFIGS
    for name in top:
        assert (REPO_ROOT / "configs" / f"{name}.yaml").read_text() == shipped_text("configs", name), name


@pytest.mark.slow
def test_the_wheel_holds_every_shipped_configuration_and_profile(tmp_path: Path) -> None:
    """A wheel built from the sources holds each file of configs/ and every profile, as real files."""
    pytest.importorskip("setuptools", reason="building the wheel without isolation needs setuptools")
    source = _copy_source(tmp_path / "src")
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*build, "-w", str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("wspool-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        held = {info.filename: info for info in archive.infolist() if info.filename.startswith("wspool/data/")}
        configs = {f"wspool/data/configs/{name}.yaml" for name in SHIPPED_CONFIGS}
        profiles = {f"wspool/data/profiles/{name}.yaml" for name in PROFILE_NAMES}
        assert set(held) == configs | profiles
        assert "wspool/py.typed" in archive.namelist()  # PEP 561: a user's mypy checks calls to wspool
        for name in SHIPPED_CONFIGS:
            shipped = archive.read(f"wspool/data/configs/{name}.yaml").decode()
            assert shipped == (REPO_ROOT / "configs" / f"{name}.yaml").read_text(), name


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
    source = _copy_source(tmp_path / "src")
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
    assert result.stdout.strip() == f"{SHIPPED_CONFIGS} True"


def test_a_users_mypy_checks_calls_to_an_installed_wspool(tmp_path: Path) -> None:
    """wspool installed in a venv's site-packages is typed for a user's mypy (py.typed): a wrong call is an error."""
    pytest.importorskip("mypy", reason="needs mypy (the test extra)")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=60)
    python = tmp_path / "venv" / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "wspool").symlink_to(REPO_ROOT / "wspool", target_is_directory=True)
    user = tmp_path / "user.py"
    user.write_text('import wspool\n\nsize: str = wspool.parse_size("1MiB")\n')
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    command = [sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", os.devnull, "--python-executable"]
    done = subprocess.run(
        [*command, str(python), str(user)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert "missing library stubs or py.typed marker" not in done.stdout, done.stdout
    assert 'Incompatible types in assignment (expression has type "int", variable has type "str")' in done.stdout


def test_no_message_names_a_checkout_path() -> None:
    """No string wspool prints names configs/ (a checkout's folder): advice names what works after an install."""
    import ast

    found = []
    for path in sorted((REPO_ROOT / "wspool").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            text = node.value if isinstance(node, ast.Constant) and id(node) not in docstrings else None
            if isinstance(text, str) and "configs/" in text:
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    assert not found, found
