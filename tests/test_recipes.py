"""The engine install recipes in README.md and docs/ are the ones CI builds with (.ci/engine-envs)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

import pytest

from tests.helpers.paths import REPO_ROOT

SCRIPT = (REPO_ROOT / ".ci" / "engine-envs").read_text()
DOCS = ("README.md", "docs/vllm.md", "docs/sglang.md", "docs/tokenspeed.md")


def _array(name: str) -> list[str]:
    found = re.search(rf"^{name}=\(([^)]*)\)$", SCRIPT, re.MULTILINE)
    assert found, name
    return found.group(1).split()


@dataclass(frozen=True)
class Environment:
    """One engine environment as .ci/engine-envs builds it."""

    venv: str
    spec: str
    installer: str  # "pip" or "uv"
    flashinfer_override: str | None = None
    constraints: tuple[str, ...] = ()  # beyond the script's cuda-python constraint


def _environments() -> list[Environment]:
    """Read each build function of .ci/engine-envs: pip (``.venv-x/bin/pip install -q SPEC``) or uv_engine."""
    found = []
    for venv, spec in re.findall(r"^\s+(\.venv-\w+)/bin/pip install -q (\S+==\S+)", SCRIPT, re.MULTILINE):
        found.append(Environment(venv, spec, "pip"))
    for venv, spec, rest in re.findall(r"^\s+uv_engine (\.venv-\w+) (\S+==\S+)(.*)$", SCRIPT, re.MULTILINE):
        override, *constraints = shlex.split(rest) or [""]
        found.append(Environment(venv, spec, "uv", override or None, tuple(constraints)))
    return found


ENVIRONMENTS = _environments()


def _bash_blocks(name: str) -> list[str]:
    """The bash code blocks of a document, continuation lines joined."""
    text = (REPO_ROOT / name).read_text()
    return [block.replace("\\\n", " ") for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL)]


def _recipes(venv: str) -> list[tuple[str, str]]:
    """(document, block) for every bash block that creates ``venv``."""
    creates = re.compile(rf"(python3 -m venv|uv venv --seed) {re.escape(venv)}(\s|$)")
    return [(name, block) for name in DOCS for block in _bash_blocks(name) if creates.search(block)]


def test_the_script_builds_the_four_engine_environments() -> None:
    """.ci/engine-envs builds vLLM 0.33.0 with pip, vLLM 0.34.0, SGLang 0.5.23 and TokenSpeed 0.1.1 with uv."""
    assert _environments() == [
        Environment(".venv-vllm", "vllm==0.33.0", "pip"),
        Environment(".venv-vllm034", "vllm==0.34.0", "uv", "0.7.4"),
        Environment(".venv-sglang", "sglang==0.5.23", "uv"),
        Environment(".venv-tokenspeed", "tokenspeed==0.1.1", "uv", None, ("tokenspeed-scheduler<=0.1.36",)),
    ]
    assert _array("test_packages") == ["pytest", "hypothesis"]
    assert _array("wspool_packages") == ["pydantic-settings", "PyYAML"]


@pytest.mark.parametrize("environment", ENVIRONMENTS, ids=[e.venv for e in ENVIRONMENTS])
def test_every_recipe_installs_what_the_script_installs(environment: Environment) -> None:
    """Each documented recipe for an engine environment has the script's engine, test and wspool packages, its
    installer's flags, FlashInfer override and constraint, and installs wspool without its dependencies."""
    recipes = _recipes(environment.venv)
    assert recipes, f"no recipe in {', '.join(DOCS)} creates {environment.venv}"
    for name, block in recipes:
        words = block.split()
        where = f"{name}: the recipe for {environment.venv}"
        assert environment.spec in words, where
        assert set(_array("test_packages")) <= set(words), where
        named = {re.split(r"[<>=]", w.strip("'"))[0] for w in words}
        assert set(_array("wspool_packages")) <= named, where
        assert f"{environment.venv}/bin/pip install --no-deps -e" in " ".join(w for w in words if w != "-q"), where
        if environment.installer == "uv":
            constraint = re.search(r"printf '%s\\n' \"(cuda-python[^\"]+)\"", SCRIPT)
            assert constraint, "the script's cuda-python constraint"
            for needed in (constraint.group(1), *environment.constraints):
                assert needed in block, f"{where}: {needed}"
            assert "--index-strategy unsafe-best-match" in block and " -c " in block, where
            override = f"'flashinfer-python=={environment.flashinfer_override}'"
            assert (override in block and "--override" in block) == bool(environment.flashinfer_override), where
        else:
            assert f"python3 -m venv {environment.venv}" in block, where


def test_readme_has_the_vllm_test_line_ci_runs() -> None:
    """README's "Use with vLLM" test line, which .ci/run runs as written, is one of the checked recipes."""
    lines = [line for line in (REPO_ROOT / "README.md").read_text().splitlines() if line.startswith("python3 -m venv")]
    vllm = [line for line in lines if line.startswith("python3 -m venv .venv-vllm ") and "pytest" in line]
    assert len(vllm) == 1
    assert ("README.md", vllm[0] + "\n") in _recipes(".venv-vllm")
