"""The documentation runs: every Python example in README.md and docs/*.md, and every name and path it cites.

Each fenced ``python`` block is one test. It runs on its own, as a reader would
paste it: a fresh namespace, a clean environment and default registry (the
autouse fixture in tests/conftest.py), and as working directory a temporary
folder holding a copy of ``configs/``. Blocks do not build on each other, so any
one of them can be copied alone. A block's first line may say how it runs:

- ``# needs a CUDA device``: a ``gpu``-marked test, which skips without CUDA;
- ``# not run: <reason>``: compiled only, then skipped with the reason.

Any other block must run as written, so a fragment that uses a name it never
defines fails. In bash blocks, each ``wspool show|resolve|plan|stats`` example runs as a
command and exits 0; YAML and text blocks are not run.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from unittest import mock

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH_CITATION = r"(?<![\w./-])((?:wspool|tests|configs|docs|\.ci)/[\w./*-]*)"

NEEDS_CUDA = "# needs a CUDA device"
NOT_RUN = "# not run:"

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    path: Path
    line: int  # 1-based line of the block's first code line
    lang: str
    source: str

    @property
    def name(self) -> str:
        shown = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name
        return f"{shown}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.source.lstrip("\n").split("\n", 1)[0].strip()

    def compiled(self) -> CodeType:
        """Compile the block so that tracebacks point at the Markdown file's own lines."""
        return compile("\n" * (self.line - 1) + self.source, str(self.path), "exec")


def fenced_blocks(path: Path) -> list[Block]:
    """Return the fenced code blocks of ``path``, dedented by their fence's indent (blocks inside list items)."""
    blocks: list[Block] = []
    lines = path.read_text(encoding="utf-8").split("\n")
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        index += 1
        if opening is None or not opening["lang"]:
            continue
        start = index
        while index < len(lines) and lines[index].strip() != "```":
            index += 1
        if index == len(lines):
            raise AssertionError(f"{path.name}:{start}: a ```{opening['lang']} block is never closed")
        source = textwrap.dedent("\n".join(lines[start:index])) + "\n"
        blocks.append(Block(path, start + 1, opening["lang"], source))
        index += 1
    return blocks


def python_blocks() -> list[Block]:
    """Return every Python block of the documents, in reading order."""
    return [block for path in DOCUMENTS for block in fenced_blocks(path) if block.lang == "python"]


def run_block(block: Block) -> dict[str, object]:
    """Run ``block`` in a fresh namespace and return it; ``# not run:`` blocks are compiled, then skipped."""
    code = block.compiled()
    if block.first_line.startswith(NOT_RUN):
        pytest.skip(f"{block.name} is not run: {block.first_line[len(NOT_RUN) :].strip()}")
    namespace: dict[str, object] = {"__name__": "__doc_example__"}
    exec(code, namespace)  # the documentation's own example, as a reader would run it
    return namespace


def _params() -> list[object]:
    return [
        pytest.param(block, id=block.name, marks=[pytest.mark.gpu] if block.first_line == NEEDS_CUDA else [])
        for block in python_blocks()
    ]


@pytest.mark.parametrize("block", _params())
def test_python_example_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Python example of the documentation runs as written, in a folder that holds configs/."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    with mock.patch.dict(os.environ):  # whatever the example sets goes with it
        run_block(block)


def test_every_python_block_is_found_and_compiles() -> None:
    """Every ```python fence opens a block the runner sees, and every block compiles, GPU and excluded ones too."""
    fences = sum(
        1 for path in DOCUMENTS for line in path.read_text(encoding="utf-8").split("\n") if line.strip() == "```python"
    )
    blocks = python_blocks()
    assert len(blocks) == fences
    for block in blocks:
        block.compiled()


def test_markers_are_spelled_as_the_runner_reads_them() -> None:
    """A first-line comment that looks like a marker is exactly one, so no block is run or skipped by mistake."""
    for block in python_blocks():
        first = block.first_line.lower()
        if "cuda" in first and first.startswith("# needs"):
            assert block.first_line == NEEDS_CUDA, block.name
        if first.startswith(("# not run", "# skip", "# no run")):
            assert block.first_line.startswith(NOT_RUN) and block.first_line[len(NOT_RUN) :].strip(), block.name


def test_a_fragment_that_is_not_excluded_fails(tmp_path: Path) -> None:
    """A block that uses names it never defines fails its test; marked ``# not run:`` it is skipped with the reason."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Text.\n\n```python\nout = plan.run(q, kv_caches[0])\n```\n\n"
        "```python\n# not run: needs an engine\nout = plan.run(q, kv_caches[0])\n```\n"
    )
    fragment, excluded = fenced_blocks(doc)
    with pytest.raises(NameError, match="'plan' is not defined") as info:
        run_block(fragment)
    assert info.traceback[-1].lineno + 1 == fragment.line  # reported at the Markdown file's own line
    with pytest.raises(pytest.skip.Exception, match=r"doc\.md:8 is not run: needs an engine"):
        run_block(excluded)


def test_readme_default_yaml_is_configs_default_yaml() -> None:
    """README's "built-in defaults, written out" holds exactly what configs/default.yaml holds."""
    (written_out,) = [
        block
        for block in fenced_blocks(ROOT / "README.md")
        if block.lang == "yaml" and block.first_line.startswith("# configs/default.yaml")
    ]
    assert yaml.safe_load(written_out.source) == yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())


def test_readme_keeps_the_command_lines_ci_runs() -> None:
    """README holds one test command line for the main venv and one for the vLLM venv, as .ci/run greps them."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").split("\n")
    for pattern in (r"^python3 -m venv \.venv .*pytest", r"^python3 -m venv \.venv-vllm .*pytest"):
        assert len([line for line in lines if re.match(pattern, line)]) == 1, pattern


def test_every_readme_command_line_makes_the_venv_it_uses() -> None:
    """Each README command line that runs .venv/bin/..., or a backticked pip install into a venv, makes the venv
    first, so it works pasted into a fresh clone."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = [line for b in fenced_blocks(ROOT / "README.md") if b.lang == "bash" for line in b.source.splitlines()]
    lines += [span for span in re.findall(r"`([^`\n]+)`", text) if re.search(r"\.venv[\w-]*/bin/pip ", span)]
    for line in lines:
        for venv in set(re.findall(r"(\.venv[\w-]*)/bin/", line)):
            assert line.startswith(f"python3 -m venv {venv} && "), line


def test_a_plain_test_run_lists_no_skipped_tests(tmp_path: Path) -> None:
    """pyproject's pytest options summarise failures and errors but count skips without a line each."""
    (tmp_path / "test_one.py").write_text(
        "import pytest\n\ndef test_skips():\n    pytest.skip('no CUDA device')\n\ndef test_fails():\n    assert False\n"
    )
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml")]
    done = subprocess.run(
        [*command, "--rootdir", str(tmp_path), str(tmp_path / "test_one.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 failed, 1 skipped" in done.stdout and "FAILED" in done.stdout
    assert "SKIPPED" not in done.stdout


def _cited(pattern: str) -> list[tuple[str, str]]:
    """Return ``(document, match)`` for every backticked span of the documents matching ``pattern`` whole."""
    found = []
    for path in DOCUMENTS:
        for span in re.findall(r"`([^`\n]+)`", path.read_text(encoding="utf-8")):
            for match in re.findall(pattern, span):
                found.append((path.name, match))
    return found


def test_every_cited_path_exists() -> None:
    """Every repository path the documents cite (wspool/, tests/, configs/, docs/, .ci/) exists."""
    citations = _cited(PATH_CITATION)
    assert {("profiles.md", "wspool/data/configs/"), ("multi-gpu.md", "tests/flashinfer/test_mla_decode.py")} <= set(
        citations
    )
    missing = [(doc, cited) for doc, cited in citations if not list(ROOT.glob(cited.split("::")[0].rstrip("/")))]
    assert not missing, "cited but missing: " + ", ".join(f"{doc}: {cited}" for doc, cited in missing)


def test_every_cited_module_and_name_imports() -> None:
    """Every dotted ``wspool.…`` name the documents cite is a module, or a name in one."""
    missing = []
    citations = _cited(r"(?<![\w./])(wspool(?:\.\w+)+)")
    assert ("profiles.md", "wspool.settings.profiles.shipped_config") in citations
    for doc, cited in citations:
        parts = cited.split(".")
        for split in range(len(parts), 0, -1):
            try:
                found: object = importlib.import_module(".".join(parts[:split]))
            except ModuleNotFoundError:
                continue
            try:
                for attribute in parts[split:]:
                    found = getattr(found, attribute)
            except AttributeError:
                missing.append((doc, cited))
            break
    assert not missing, "cited but missing: " + ", ".join(f"{doc}: {cited}" for doc, cited in missing)


def test_every_cited_test_exists() -> None:
    """Every test module and test function the documents name is one that pytest collects."""
    tests = ROOT / "tests"
    files = {path.name for path in tests.rglob("test_*.py")}
    functions = {
        name for path in tests.rglob("test_*.py") for name in re.findall(r"^def (test_\w+)", path.read_text(), re.M)
    }
    files_cited = _cited(r"(?:^|/|::)?(test_\w+\.py)")
    assert ("multi-gpu.md", "test_mla_decode_gpu.py") in files_cited
    cited_files = [(doc, name) for doc, name in files_cited if name not in files]
    cited_functions = [(doc, name) for doc, name in _cited(r"(?:^|::)(test_\w+)(?![\w.])") if name not in functions]
    missing = cited_files + cited_functions
    assert not missing, "cited but missing: " + ", ".join(f"{doc}: {cited}" for doc, cited in missing)


def _cpu_command_lines() -> list[tuple[str, str]]:
    """The ``wspool show|resolve|plan|stats`` lines of the bash blocks, continuations joined, comments dropped."""
    found = []
    for document in DOCUMENTS:
        for block in fenced_blocks(document):
            if block.lang != "bash":
                continue
            for line in re.sub(r"\\\n\s*", "", block.source).splitlines():
                line = line.split(" #")[0].strip()
                synopsis = re.search(r"[\[\]|]|FILE|\.\.\.", line)  # a synopsis, not an example
                if re.match(r"wspool (show|resolve|plan|stats)\b", line) and not synopsis:
                    found.append((document.name, line))
    return found


@pytest.mark.parametrize(("document", "line"), _cpu_command_lines())
def test_a_documented_command_line_runs_verbatim_on_a_cpu(document: str, line: str, tmp_path: Path) -> None:
    """Each show/resolve/plan/stats example in the docs exits 0 pasted into a plain directory (no rule refused)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WSPOOL_", "VLLM_", "SGLANG_"))}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "-m", "wspool", *line.split()[1:]]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{document}: {line}\n{done.stdout}{done.stderr}"
