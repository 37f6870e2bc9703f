"""The hostile-input corpus: YAML files, environments, facts, command lines and wrapper-region bindings,
each with its exact outcome.

The cases live in tests/reliability/corpus/*.jsonl, one JSON object a line. Configuration
cases must raise ConfigError with the named key (``key``: the YAML key, or null where the
error is about the file itself) and a message matching ``match``. Command lines must
exit 2 with exactly one line on stderr matching ``match`` and no traceback; they run
in-process through wspool.cli.main, and a handful also as real processes. Region cases
are sequences of bindings under a ``max_bytes`` cap, some refused or failing in their
install; a step that fails changes nothing, and the regions held at the end are exact.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

import wspool
from wspool.cli import main
from wspool.errors import ConfigError, RuleError
from wspool.flashinfer.wrapper_buffers import WrapperBinding, declare_int_pool, wrapper_regions
from wspool.settings.schema import load_settings

CORPUS = Path(__file__).parent / "corpus"


def _cases(name: str) -> list[Any]:
    rows = [json.loads(line) for line in (CORPUS / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [pytest.param(row, id=row["id"]) for row in rows]


def test_the_corpus_holds_at_least_300_inputs() -> None:
    """YAML, environment, facts and CLI together hold 300 or more cases, each 40 or more; regions 25 or more."""
    assert sorted(p.name for p in CORPUS.glob("*.jsonl")) == [
        "cli.jsonl", "env.jsonl", "facts.jsonl", "regions.jsonl", "yaml.jsonl",
    ]  # fmt: skip
    counts = {name: len(_cases(name)) for name in ("yaml.jsonl", "env.jsonl", "facts.jsonl", "cli.jsonl")}
    assert sum(counts.values()) >= 300, counts
    assert min(counts.values()) >= 40, counts
    assert len(_cases("regions.jsonl")) >= 25


def _check(error: ConfigError, case: dict[str, Any]) -> None:
    assert re.search(case["match"], str(error)), (case["id"], str(error))
    assert error.key == case["key"], (case["id"], error.key, str(error))
    assert len(str(error)) < 4000, case["id"]
    assert "\n" not in str(error) and "\x1b" not in str(error), case["id"]


@pytest.mark.parametrize("case", _cases("yaml.jsonl"))
def test_yaml_case(case: dict[str, Any], tmp_path: Path) -> None:
    """Each hostile YAML file is a ConfigError naming its key."""
    path = tmp_path / "c.yaml"
    path.write_text(case["yaml"], encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    _check(info.value, case)


@pytest.mark.parametrize("case", _cases("env.jsonl"))
def test_environment_case(case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each hostile environment is a ConfigError naming its key."""
    for name, value in case["env"].items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    _check(info.value, case)


def _fact(value: Any) -> object:
    """Decode a tagged fact value: {"bool": true}, {"decimal": "1"}, {"float_tensor": 1.0}..."""
    if not isinstance(value, dict):
        return value
    ((kind, raw),) = value.items()
    decoders = {
        "bool": bool, "float": float, "decimal": Decimal, "complex": lambda v: complex(*v), "str": str,
        "list": list, "dict": dict, "none": lambda v: None, "bytes": str.encode, "fraction": lambda v: Fraction(*v),
        "float_tensor": torch.tensor, "set": set, "int": int,
    }  # fmt: skip
    return decoders[kind](raw)


@pytest.mark.parametrize("case", _cases("facts.jsonl"))
def test_facts_case(case: dict[str, Any]) -> None:
    """Each hostile fact is a RuleError naming the rule, whether or not an equal integer was cached first."""
    reg = wspool.PoolRegistry.from_config(None, pools={"p": {"rules": {"r": case["rule"]}}})
    if case["prime"] is not None:
        reg.resolve("p", "r", **case["prime"])
    facts = {name: _fact(value) for name, value in case["facts"].items()}
    for _ in range(2):  # the second time, whatever the first left in the cache
        with pytest.raises(RuleError, match=case["match"]) as info:
            reg.resolve("p", "r", **facts)
        assert info.value.key == "pools.p.rules.r"
        with pytest.raises(RuleError, match=case["match"]):
            reg.workspace("p", "meta", rule="r", **facts)
    assert reg.stats("p", "meta").request_count == 0


def _argv(case: dict[str, Any], tmp_path: Path) -> list[str]:
    for name, text in case["files"].items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    return [arg.replace("{tmp}", str(tmp_path)) for arg in case["argv"]]


@pytest.mark.parametrize("case", _cases("cli.jsonl"))
def test_cli_case(case: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each bad invocation exits 2 with one line on stderr and no traceback (in-process)."""
    if torch.cuda.is_available() and any(a.startswith("cuda") for a in case["argv"]):
        pytest.skip("this machine has CUDA: the device exists")
    try:
        status = main(_argv(case, tmp_path))
    except SystemExit as exc:  # argparse's errors
        status = exc.code  # type: ignore[assignment]
    _, err = capsys.readouterr()
    assert status == 2, (case["id"], status, err)
    assert len(err.splitlines()) == 1, (case["id"], err)
    assert "Traceback" not in err and "\x1b" not in err
    assert re.search(case["match"], err), (case["id"], err)


@pytest.mark.parametrize("index", [0, 4, 30, 40, 70])
def test_cli_case_in_a_real_process(index: int, tmp_path: Path) -> None:
    """A handful of the command-line cases as real processes: exit 2, one stderr line, no traceback."""
    case = _cases("cli.jsonl")[index].values[0]
    if torch.cuda.is_available() and any(a.startswith("cuda") for a in case["argv"]):
        pytest.skip("this machine has CUDA: the device exists")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSPOOL_")}
    done = subprocess.run(
        [sys.executable, "-m", "wspool", *_argv(case, tmp_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 2, (case["id"], done.stderr)
    assert len(done.stderr.splitlines()) == 1 and re.search(case["match"], done.stderr), (case["id"], done.stderr)


class _Wrapper:
    """A kernel wrapper as wspool binds it: any object, held weakly."""


@pytest.mark.parametrize("case", _cases("regions.jsonl"))
def test_regions_case(case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each sequence of wrapper bindings holds exactly its regions at the end, never more than the cap; a step
    refused by the cap or failing in its install changes no binding and no region."""
    cap = case["max_bytes"]
    if cap is not None:
        monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_INT__MAX_BYTES", str(cap))
    registry = wspool.PoolRegistry()
    declare_int_pool(registry)
    regions = wrapper_regions(registry)
    wrappers: dict[str, _Wrapper] = {}
    for step in case["steps"]:
        wrapper = wrappers.setdefault(step["w"], _Wrapper())

        def install(binding: WrapperBinding, fails: bool = step.get("install") == "raise") -> None:
            if fails:
                raise MemoryError("cannot pin the host copy")

        before = (regions.binding(wrapper), regions.stats())
        bind = {
            "device": torch.device(step.get("device", "cpu")), "nbytes": step["nbytes"], "kind": "x",
            "lane": step.get("lane", "main"), "group": step.get("group"), "install": install,
        }  # fmt: skip
        if "match" in step:
            with pytest.raises(MemoryError, match=step["match"]):  # WorkspaceLimitError is a MemoryError too
                regions.bind(wrapper, **bind)
            assert (regions.binding(wrapper), regions.stats()) == before, case["id"]
        else:
            binding = regions.bind(wrapper, **bind)
            assert regions.binding(wrapper) is binding and binding.region.nbytes >= step["nbytes"], case["id"]
        assert cap is None or all(row["region_bytes"] <= cap for row in regions.stats()), case["id"]
    held = {f"{row['device']} {row['lane']}": row["region_bytes"] for row in regions.stats()}
    assert held == case["held"], case["id"]
