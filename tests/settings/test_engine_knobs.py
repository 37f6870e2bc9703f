"""Tests for wspool.settings.sources: the engines' own workspace variables keep their meaning.

Precedence of each key an engine's variable sets, highest first: code, ``WSPOOL_*``,
the user's YAML file, the engine's variable, a shipped configuration, a profile, the
built-in defaults (README, "Configuration").
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import wspool
from wspool.cli import main
from wspool.errors import ConfigError
from wspool.settings.profiles import engine_knobs, shipped_config
from wspool.settings.schema import load_settings, load_settings_with_provenance

VLLM = "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE"
SGLANG = "SGLANG_FLASHINFER_WORKSPACE_SIZE"
MiB = 1 << 20
GiB = 1 << 30

#: Each engine variable, its engine, its shipped configuration, and the (pool, rule) keys of the
#: buffers the engine sizes with it (the vLLM plugin's and the SGLang integration's rules).
KNOBS = [
    (VLLM, "vLLM", "vllm", [("flashinfer", "vllm"), ("flashinfer_mla_sparse", "default")]),
    (
        SGLANG,
        "SGLang",
        "sglang",
        [("flashinfer", "sglang"), ("flashinfer_mla", "sglang_mla"), ("sglang_dsa_sparse_mla", "default")],
    ),
    ("FLASHINFER_WORKSPACE_SIZE", "TokenSpeed", "tokenspeed", [("flashinfer", "tokenspeed_flashmla")]),
]
KNOB_IDS = [name for name, *_ in KNOBS]
#: TokenSpeed's variables that count MiB (tested on their own, below).
MIB_KNOBS = [
    ("TOKENSPEED_WORKSPACE_TRTLLM_MHA_MB", "TokenSpeed", [("tokenspeed_scratch", "trtllm_mha")]),
    ("TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB", "TokenSpeed", [("tokenspeed_trtllm_mla", "default")]),
]


def _key(pool: str, rule: str) -> tuple[str, str, str, str]:
    return ("pools", pool, "rules", rule)


def test_the_knobs_are_the_engines_workspace_variables() -> None:
    """wspool honours exactly vLLM's, SGLang's and TokenSpeed's workspace variables, each for its engine's rules."""
    assert sorted((knob.name, knob.engine, list(knob.keys)) for knob in engine_knobs()) == sorted(
        [(name, engine, keys) for name, engine, _, keys in KNOBS] + MIB_KNOBS
    )


@pytest.mark.parametrize(("variable", "engine", "shipped", "keys"), KNOBS, ids=KNOB_IDS)
def test_the_variable_alone_sets_exactly_its_engines_rules(
    monkeypatch: pytest.MonkeyPatch, variable: str, engine: str, shipped: str, keys: list[tuple[str, str]]
) -> None:
    """Set alone, the variable sizes its engine's buffers and nothing else; the source names it."""
    monkeypatch.setenv(variable, str(GiB))
    settings, provenance = load_settings_with_provenance()
    given = {
        (pool, rule) for pool, config in settings.pools.items() for rule, v in config.rules.items() if v == str(GiB)
    }
    assert given == set(keys)
    for pool, rule in keys:
        assert provenance.source_of(_key(pool, rule)) == f"{engine}'s variable {variable}"
    assert settings.pools["flashinfer"].rules["decode"].startswith("(512 * sm_count")  # wspool's own paged rule
    assert dict(settings.pools["flashinfer_mla"].rules).items() >= {"default": "128MiB", "lse": "256MiB"}.items()


@pytest.mark.parametrize(("variable", "engine", "shipped", "keys"), KNOBS, ids=KNOB_IDS)
@pytest.mark.parametrize("named", ["by name", "by path"])
def test_the_variable_wins_over_the_engines_shipped_configuration(
    monkeypatch: pytest.MonkeyPatch, variable: str, engine: str, shipped: str, keys: list[tuple[str, str]], named: str
) -> None:
    """With the shipped engine configuration (a shipped default), the user's variable sizes the buffer."""
    monkeypatch.setenv(variable, str(GiB))
    config = shipped if named == "by name" else shipped_config(shipped)
    settings, provenance = load_settings_with_provenance(config)
    for pool, rule in keys:
        assert settings.pools[pool].rules[rule] == str(GiB)
        assert provenance.explain(_key(pool, rule)).startswith(f"{engine}'s variable {variable}, over shipped ")
    assert provenance.shipped == shipped
    monkeypatch.delenv(variable)
    plain = load_settings(config)
    assert all(plain.pools[pool].rules[rule] != str(GiB) for pool, rule in keys)


def test_with_the_shipped_vllm_configuration_the_registry_serves_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case: --config vllm and VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE=1GiB give vLLM 1GiB, not 394MiB."""
    monkeypatch.setenv(VLLM, str(GiB))
    registry = wspool.PoolRegistry.from_config("vllm")
    # Declared as the vLLM plugin declares them: below every configured value.
    registry.declare_pool("flashinfer", {"vllm": "394MiB", "vllm_batch_invariant": "2GiB"})
    registry.declare_pool("flashinfer_mla_sparse", {"default": "394MiB"})
    assert registry.resolve("flashinfer", "vllm", device="cpu") == GiB
    assert registry.resolve("flashinfer_mla_sparse", device="cpu") == GiB
    assert registry.resolve("flashinfer", "vllm_batch_invariant", device="cpu") == 2 * GiB  # as vLLM: 2 GiB


@pytest.mark.parametrize(("variable", "engine", "shipped", "keys"), KNOBS, ids=KNOB_IDS)
def test_the_users_file_wins_over_the_variable_and_both_are_named(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    variable: str,
    engine: str,
    shipped: str,
    keys: list[tuple[str, str]],
) -> None:
    """A rule in the user's own YAML file beats the variable; the explanation names both, the file first."""
    monkeypatch.setenv(variable, str(GiB))
    (pool, rule), *others = keys
    path = tmp_path / "mine.yaml"
    path.write_text(f"pools:\n  {pool}:\n    rules:\n      {rule}: 64MiB\n")
    settings, provenance = load_settings_with_provenance(path)
    assert settings.pools[pool].rules[rule] == "64MiB"
    assert provenance.explain(_key(pool, rule)) == f"YAML file {path}, over {engine}'s variable {variable} = {GiB}"
    for other_pool, other_rule in others:  # the keys the file does not give keep the variable
        assert settings.pools[other_pool].rules[other_rule] == str(GiB)


def test_tokenspeed_knobs_count_mib_or_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """TokenSpeed's _MB variables count MiB and FLASHINFER_WORKSPACE_SIZE bytes; each sets one integration rule."""
    monkeypatch.setenv("TOKENSPEED_WORKSPACE_TRTLLM_MHA_MB", "96")
    monkeypatch.setenv("TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB", "128")
    monkeypatch.setenv("FLASHINFER_WORKSPACE_SIZE", str(200 * MiB))
    settings, provenance = load_settings_with_provenance()
    assert settings.pools["tokenspeed_scratch"].rules["trtllm_mha"] == str(96 * MiB)
    assert settings.pools["tokenspeed_trtllm_mla"].rules["default"] == str(128 * MiB)
    assert settings.pools["flashinfer"].rules["tokenspeed_flashmla"] == str(200 * MiB)
    assert settings.pools["flashinfer"].rules["decode"] != str(200 * MiB)  # TokenSpeed's variable sizes FlashMLA only
    source = provenance.source_of(("pools", "tokenspeed_trtllm_mla", "rules", "default"))
    assert source == "TokenSpeed's variable TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB"


def test_a_tokenspeed_mib_variable_that_is_not_a_whole_number_names_its_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    """TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB=1.5 is refused, naming MiB and the rule it sizes."""
    monkeypatch.setenv("TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB", "1.5")
    with pytest.raises(ConfigError, match=r"whole number of MiB, and wspool sizes pools\.tokenspeed_trtllm_mla"):
        load_settings()


@pytest.mark.parametrize(("variable", "engine", "shipped", "keys"), KNOBS, ids=KNOB_IDS)
def test_a_copy_of_the_shipped_file_is_the_users_own(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    variable: str,
    engine: str,
    shipped: str,
    keys: list[tuple[str, str]],
) -> None:
    """A shipped configuration copied elsewhere is the user's file: its rules are explicit and beat the variable."""
    monkeypatch.setenv(variable, str(GiB))
    copy = tmp_path / f"{shipped}.yaml"
    shutil.copy(shipped_config(shipped), copy)
    settings, provenance = load_settings_with_provenance(copy)
    assert provenance.shipped is None
    for pool, rule in keys:
        assert settings.pools[pool].rules[rule] != str(GiB)
        assert provenance.explain(_key(pool, rule)).startswith(f"YAML file {copy}, over {engine}'s variable")


@pytest.mark.parametrize(("variable", "engine", "shipped", "keys"), KNOBS, ids=KNOB_IDS)
def test_wspool_variables_and_code_win_over_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, engine: str, shipped: str, keys: list[tuple[str, str]]
) -> None:
    """A WSPOOL_* variable for the key beats the engine's variable, and a value in code beats both."""
    monkeypatch.setenv(variable, str(GiB))
    pool, rule = keys[0]
    wspool_var = f"WSPOOL_POOLS__{pool.upper()}__RULES__{rule.upper()}"
    monkeypatch.setenv(wspool_var, "512MiB")
    settings, provenance = load_settings_with_provenance(shipped)
    assert settings.pools[pool].rules[rule] == "512MiB"
    assert provenance.explain(_key(pool, rule)) == (
        f"environment variable {wspool_var}, over {engine}'s variable {variable} = {GiB}"
    )
    coded = load_settings(shipped, pools={pool: {"rules": {rule: "2GiB"}}})
    assert coded.pools[pool].rules[rule] == "2GiB"


def test_unset_or_empty_variables_leave_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset or empty, a variable sets nothing: the engines' rules are not configured at all."""
    monkeypatch.setenv(VLLM, "")
    monkeypatch.setenv(SGLANG, " ")
    settings = load_settings()
    assert "vllm" not in settings.pools["flashinfer"].rules
    assert "sglang" not in settings.pools["flashinfer"].rules


@pytest.mark.parametrize("value", ["394MiB", "-1", "0", "1e9", "lots"])
def test_bad_knob_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """A variable that is not a positive whole number of bytes is a ConfigError naming it and the keys it sets."""
    monkeypatch.setenv(VLLM, value)
    with pytest.raises(ConfigError, match=rf"invalid environment variable {VLLM} = '{value}': vLLM reads it as a "
                       r"positive whole number of bytes, and wspool sizes pools\.flashinfer\.rules\.vllm, "
                       r"pools\.flashinfer_mla_sparse\.rules\.default with it"):  # fmt: skip
        load_settings()


def test_show_names_the_variable_and_what_it_wins_over(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """wspool show --config vllm gives the variable as the source, over the shipped configuration's value."""
    monkeypatch.setenv(VLLM, str(GiB))
    assert main(["show", "--config", "vllm"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        f"pools.flashinfer.rules.vllm = {GiB} (from vLLM's variable {VLLM}, over shipped configuration vllm = '394MiB')"
    ) in text


def test_show_says_the_users_file_wins(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Where the user's file and the variable both give a key, show names both and the file as the winner."""
    monkeypatch.setenv(SGLANG, str(GiB))
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  flashinfer:\n    rules:\n      sglang: 300MiB\n")
    assert main(["show", "--config", str(path), "--json"]) == 0
    rows = {row["key"]: row for row in json.loads(capsys.readouterr().out)["settings"]}
    row = rows["pools.flashinfer.rules.sglang"]
    assert (row["value"], row["source"]) == ("300MiB", f"YAML file {path}")
    assert row["overrides"] == [{"source": f"SGLang's variable {SGLANG}", "value": GiB}]


STAND_IN_SPEC = """\
name: StandIn
distribution: pytest
supported: ">=1"
order: 4
entry_point: {group: standin.plugins, object: "wspool.integrations.standin:register"}
switch: WSPOOL_STANDIN
device: WSPOOL_STANDIN_DEVICE
denylist: STANDIN_DISABLE_PLUGINS
variables:
  STANDIN_WORKSPACE_MB: {unit: MiB, sizes: [standin_scratch.default, flashinfer.standin]}
pools: [standin_scratch, flashinfer]
facts: [standin_bytes]
"""
STAND_IN_PACKAGE = """\
import logging

from wspool.integrations.patching import Integration, entry_points
from wspool.settings.profiles import engine_spec


class StandIn(Integration):
    info = engine_spec("standin")

    def groups(self):
        return ()


INTEGRATION = StandIn(logging.getLogger("wspool.test.standin"))
register, unregister, patched = entry_points(INTEGRATION)
"""


@pytest.fixture
def stand_in_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """An engine package added as a new engine is: one folder under wspool.integrations, its spec and its module."""
    import sys

    import wspool.integrations
    from wspool.settings import profiles
    from wspool.settings.profiles import engine_specs

    package = tmp_path / "standin"
    package.mkdir()
    (package / "engine.yaml").write_text(STAND_IN_SPEC)
    (package / "__init__.py").write_text(STAND_IN_PACKAGE)
    # Installed, the package would sit beside the others: its spec among the package data, its module importable.
    shipped = profiles.engine_spec_files()
    monkeypatch.setattr(profiles, "engine_spec_files", lambda: [*shipped, package / "engine.yaml"])
    monkeypatch.setattr(wspool.integrations, "__path__", [*wspool.integrations.__path__, str(tmp_path)])
    engine_specs.cache_clear()
    yield
    engine_specs.cache_clear()
    sys.modules.pop("wspool.integrations.standin", None)


def test_a_new_engine_package_alone_is_read_by_the_settings_and_doctor(
    monkeypatch: pytest.MonkeyPatch, stand_in_engine: None
) -> None:
    """An engine package with its engine.yaml, and nothing else changed: its switch, device and workspace variable
    are the settings' own, and doctor lists it with what its variable sets."""
    from wspool.cli import doctor
    from wspool.settings.profiles import engine_spec, engine_specs

    assert [spec.key for spec in engine_specs()] == ["vllm", "sglang", "tokenspeed", "standin"]
    assert engine_spec("standin").engine_variables == ("STANDIN_WORKSPACE_MB",)
    monkeypatch.setenv("WSPOOL_STANDIN", "1")
    monkeypatch.setenv("WSPOOL_STANDIN_DEVICE", "cpu")
    monkeypatch.setenv("STANDIN_WORKSPACE_MB", "3")
    settings, provenance = load_settings_with_provenance()
    assert settings.pools["standin_scratch"].rules["default"] == str(3 * MiB)
    assert settings.pools["flashinfer"].rules["standin"] == str(3 * MiB)
    assert provenance.source_of(_key("standin_scratch", "default")) == "StandIn's variable STANDIN_WORKSPACE_MB"
    monkeypatch.setenv("STANDIN_WORKSPACE_MB", "3MiB")
    with pytest.raises(
        ConfigError,
        match=r"^invalid environment variable STANDIN_WORKSPACE_MB = '3MiB': StandIn "
        r"reads it as a positive whole number of MiB, and wspool sizes pools\.standin_scratch\.rules",
    ):
        load_settings()  # fmt: skip
    monkeypatch.setenv("STANDIN_WORKSPACE_MB", "3")
    (engine,) = [e for e in doctor.diagnose()["engines"] if e["key"] == "standin"]
    assert engine["name"] == "StandIn" and engine["switch"] == {"variable": "WSPOOL_STANDIN", "value": "1", "on": True}
    (variable,) = engine["engine_variables"]
    assert variable["value"] == "3" and [s["key"] for s in variable["sets"]] == [
        "pools.standin_scratch.rules.default",
        "pools.flashinfer.rules.standin",
    ]
    assert variable["sets"][0]["source"] == "StandIn's variable STANDIN_WORKSPACE_MB"
    assert engine["why_inactive"] == ["wspool's entry point is not registered in standin.plugins"]


def test_without_its_package_the_new_engines_variables_are_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in's switch is refused and its workspace variable ignored where its package is absent."""
    monkeypatch.setenv("STANDIN_WORKSPACE_MB", "3")
    assert "standin_scratch" not in load_settings().pools
    monkeypatch.setenv("WSPOOL_STANDIN", "1")
    with pytest.raises(ConfigError, match=r"^unknown environment variable\(s\) WSPOOL_STANDIN: no wspool setting"):
        load_settings()


@pytest.mark.parametrize(
    ("written", "instead", "error"),
    [
        ("switch: WSPOOL_STANDIN\n", "", r"switch must be a non-empty string"),
        ("order: 4", "order: four", r"order must be a whole number"),
        ("pools:", "pool:", r"unknown key 'pool' \(the keys are allowlist, denylist, "),
        (
            ", flashinfer]",
            "]",
            r"variables\.STANDIN_WORKSPACE_MB\.sizes names flashinfer\.standin, but 'flashinfer' is "
            r"not one of the pools it serves \(pools: standin_scratch\)$",
        ),
        ("standin_scratch.default,", "standin_scratch,", r"variables\.STANDIN_WORKSPACE_MB\.sizes must list the keys"),
        ("unit: MiB", "unit: MiBs", r"variables\.STANDIN_WORKSPACE_MB\.unit = 'MiBs' is not bytes or a size unit"),
    ],
)
def test_a_malformed_engine_spec_is_an_error_naming_its_file_and_key(
    stand_in_engine: None, tmp_path: Path, written: str, instead: str, error: str
) -> None:
    """A spec file with a key missing, mistyped or unknown fails naming the file and the key."""
    from wspool.settings.profiles import engine_specs

    (tmp_path / "standin" / "engine.yaml").write_text(STAND_IN_SPEC.replace(written, instead, 1))
    with pytest.raises(ConfigError, match=rf"^engine spec {re.escape(str(tmp_path))}/standin/engine\.yaml: {error}"):
        engine_specs()


def test_the_settings_read_the_engine_specs_without_importing_any_integration() -> None:
    """In a fresh interpreter, reading every spec and loading settings with an engine's switch set imports no
    module of wspool.integrations (the specs are package data read as files)."""
    import subprocess
    import sys

    code = (
        "import os, sys; os.environ['WSPOOL_VLLM'] = '0'; "
        "from wspool.settings.profiles import engine_specs; from wspool.settings.schema import load_settings; "
        "keys = [s.key for s in engine_specs()]; load_settings(); "
        "assert keys == ['vllm', 'sglang', 'tokenspeed'], keys; "
        "assert not [m for m in sys.modules if m.startswith('wspool.integrations')], sorted(sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
