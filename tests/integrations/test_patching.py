"""Tests for wspool.integrations.patching: the one seam every engine integration loads through."""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

import wspool
from wspool.errors import ConfigError
from wspool.integrations import ENGINES, integration, targets_of
from wspool.integrations.patching import Integration, describe_config, parse_switch
from wspool.settings.profiles import EngineSpec, engine_spec
from wspool.targets import Target, TargetGroup

VLLM, SGLANG, TOKENSPEED = engine_spec("vllm"), engine_spec("sglang"), engine_spec("tokenspeed")
ENGINE = "wspool_test_engine_module"
# An engine whose distribution is installed everywhere the tests run: pytest itself.
INFO = EngineSpec(
    key="demo", name="Demo", distribution="pytest", supported=">=7", order=9, entry_point_group="demo.plugins",
    entry_point="wspool.integrations.demo:register", switch_var="WSPOOL_DEMO", denylist_var="DEMO_DISABLE_PLUGINS",
)  # fmt: skip


def _f(a: int) -> int:
    return a


@pytest.fixture
def engine() -> Iterator[types.ModuleType]:
    """A stand-in engine module with three functions."""
    module = types.ModuleType(ENGINE)
    module.one = module.two = module.three = _f  # type: ignore[attr-defined]
    sys.modules[ENGINE] = module
    yield module
    del sys.modules[ENGINE]


def _wrap(original: Any) -> Any:
    def replacement(a: int) -> int:
        return original(a) + 1

    return replacement


class _Demo(Integration):
    info = INFO

    def __init__(self, targets: tuple[Target, ...]) -> None:
        super().__init__(logging.getLogger("wspool.test.demo"))
        self._targets = targets
        self.activated = 0
        self.deactivated = 0

    def groups(self) -> tuple[TargetGroup, ...]:
        return (TargetGroup("demo", self._targets),)

    def activate(self) -> list[str]:
        self.activated += 1
        return []

    def deactivate(self) -> None:
        self.deactivated += 1


def _targets(make_third: Any = _wrap) -> tuple[Target, ...]:
    return (
        Target(ENGINE, "one", ("a",), _wrap, "one"),
        Target(ENGINE, "two", ("a",), _wrap, "two"),
        Target(ENGINE, "three", ("a",), make_third, "three"),
    )


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """The stand-in integration's log lines, from debug up."""
    caplog.set_level(logging.DEBUG, logger="wspool.test.demo")
    return caplog


def _lines(log: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in log.records if r.name == "wspool.test.demo" and r.levelno == level]


@pytest.mark.parametrize(("raw", "on"), [("", True), ("1", True), (" Yes ", True), ("off", False), ("0", False)])
def test_the_switch_reads_on_and_off_words(raw: str, on: bool) -> None:
    """Unset, 1/true/on/yes are on; 0/false/off/no are off, in any case and with spaces."""
    assert parse_switch("WSPOOL_DEMO", {"WSPOOL_DEMO": raw}) is on
    assert parse_switch("WSPOOL_DEMO", {}) is True


def test_an_unknown_switch_value_is_an_error_naming_the_variable() -> None:
    """A value that is neither on nor off is refused, never taken as on."""
    with pytest.raises(ConfigError, match=r"invalid environment variable WSPOOL_DEMO = 'disabled': expected 1 or 0"):
        parse_switch("WSPOOL_DEMO", {"WSPOOL_DEMO": "disabled"})


def test_the_engines_are_declared_and_light() -> None:
    """ENGINES names vLLM and SGLang with their entry points; importing them, or their targets, imports no engine."""
    probe = (
        "import sys, wspool.integrations as i; i.targets_of('vllm'); i.targets_of('sglang'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang')))"
    )
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]"
    assert [info.key for info in ENGINES][:2] == ["vllm", "sglang"]
    assert VLLM.entry_point == "wspool.integrations.vllm:register" and VLLM.allowlist_var == "VLLM_PLUGINS"
    assert SGLANG.entry_point == "wspool.integrations.sglang:register" and SGLANG.switch_var == "WSPOOL_SGLANG"
    assert targets_of("vllm")[0].name == "the MLA decode workspace"
    with pytest.raises(KeyError, match="no wspool integration for 'nope'"):
        integration("nope")


@pytest.mark.parametrize(
    ("version", "supported"), [("0.33.0", True), ("0.34.0", True), ("0.34.2", True), ("0.35.0", False), ("x", False)]
)
def test_versions_are_checked_against_the_declared_range(version: str, supported: bool) -> None:
    """vLLM's declared range admits 0.33 and 0.34 and nothing else; a version that does not parse is not supported."""
    assert VLLM.supports(version) is supported


@pytest.mark.parametrize(
    ("info", "version"),
    [(SGLANG, "0.5.23rc0"), (TOKENSPEED, "0.1.1rc2"), (VLLM, "0.33.0rc1"), (VLLM, "0.34.0.dev3"),
     (SGLANG, "0.5.23+cu130")],
)  # fmt: skip
def test_a_pre_release_of_a_supported_version_is_supported(info: EngineSpec, version: str) -> None:
    """A release candidate or development release of a supported version counts as that version."""
    assert info.supports(version) is True


@pytest.mark.parametrize(("info", "version"), [(SGLANG, "0.5.24rc0"), (VLLM, "0.35.0rc1"), (VLLM, "0.32.9rc1")])
def test_a_pre_release_of_an_unsupported_version_is_not(info: EngineSpec, version: str) -> None:
    """A pre-release of a version outside the range stays outside it."""
    assert info.supports(version) is False


def test_the_engines_own_plugin_variables_are_read() -> None:
    """An allowlist without wspool, or a denylist naming it, is said; otherwise nothing."""
    assert VLLM.selection({"VLLM_PLUGINS": "other"}) == "VLLM_PLUGINS='other' does not name wspool"
    assert VLLM.selection({"VLLM_PLUGINS": "other, wspool"}) is None
    assert INFO.selection({"DEMO_DISABLE_PLUGINS": "a,wspool"}) == "DEMO_DISABLE_PLUGINS='a,wspool' names wspool"
    assert INFO.installed_version() == version("pytest")


def test_a_load_patches_reports_and_says_one_line(engine: types.ModuleType, log: pytest.LogCaptureFixture) -> None:
    """Every target is patched, each reported to the engine's undo registry, and the load is one info line."""
    demo = _Demo(_targets())
    reported: list[tuple[str, str, Callable[[], None]]] = []
    assert demo.load(reporter=lambda kind, name, undo: reported.append((kind, name, undo)))
    assert engine.one(1) == 2 and demo.activated == 1
    assert [(kind, name) for kind, name, _ in reported] == [
        ("wspool", f"{ENGINE}.{n}") for n in ("one", "two", "three")
    ]
    assert _lines(log, logging.INFO) == [
        f"wspool: Demo {version('pytest')}: 3 targets patched; config: built-in defaults"
    ]
    reported[1][2]()  # the engine undoes its plugins: everything goes
    assert engine.one is _f and engine.three is _f and demo.patched() == [] and demo.deactivated == 1


def test_loading_twice_patches_once(engine: types.ModuleType, log: pytest.LogCaptureFixture) -> None:
    """A second load changes nothing and says so at debug level."""
    demo = _Demo(_targets())
    demo.load()
    first = engine.one
    assert demo.load() and engine.one is first and engine.one(1) == 2
    assert "wspool: the Demo integration is already loaded" in _lines(log, logging.DEBUG)


def test_the_third_of_three_failing_leaves_the_engine_untouched(
    engine: types.ModuleType, log: pytest.LogCaptureFixture
) -> None:
    """A third replacement that raises: the first two are restored, the hooks forgotten, one error logged."""

    def explode(original: Any) -> Any:
        raise RuntimeError("cannot wrap three")

    demo = _Demo(_targets(explode))
    assert not demo.load()
    assert (engine.one, engine.two, engine.three) == (_f, _f, _f) and demo.patched() == []
    assert demo.deactivated == 1
    (error,) = _lines(log, logging.ERROR)
    assert error == "wspool: the Demo integration failed to load and patched nothing; Demo's own workspaces stay in use"


def test_a_broken_configuration_leaves_the_engine_untouched(
    engine: types.ModuleType, log: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A configuration that does not load stops the load before anything is located or patched, in one line."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("pools: [not, a, mapping]\n")
    monkeypatch.setenv("WSPOOL_CONFIG", str(broken))
    wspool.reset_registry()
    demo = _Demo(_targets())
    assert not demo.load()
    assert engine.one is _f and demo.activated == 0
    (error,) = _lines(log, logging.ERROR)
    assert error.startswith("wspool: Demo: nothing patched, Demo's own workspaces stay in use: ") and "\n" not in error


def test_an_unsupported_version_patches_nothing(engine: types.ModuleType, log: pytest.LogCaptureFixture) -> None:
    """An installed engine outside the declared range is left alone with one warning naming both."""

    class Old(_Demo):
        info = EngineSpec(**{**INFO.__dict__, "supported": "<1"})

    demo = Old(_targets())
    assert not demo.load() and engine.one is _f
    (warning,) = _lines(log, logging.WARNING)
    assert f"Demo {version('pytest')} is not supported (wspool supports <1); nothing patched" in warning


def test_describe_config_names_how_the_configuration_was_named(tmp_path: Path) -> None:
    """Built-in defaults, a shipped configuration by name, or a file path."""
    assert describe_config({}) == "config: built-in defaults"
    assert describe_config({"WSPOOL_CONFIG": "vllm"}) == "config vllm (shipped)"
    path = tmp_path / "mine.yaml"
    path.write_text("{}\n")
    assert describe_config({"WSPOOL_CONFIG": str(path)}) == f"config {path}"


def test_every_engines_switch_is_a_variable_the_settings_know() -> None:
    """Turning an engine's integration off (WSPOOL_<ENGINE>=0) is never refused as an unknown WSPOOL_* variable."""
    from wspool.settings.schema import all_extra_env_vars

    switches = [info.switch_var for info in ENGINES]
    assert switches == ["WSPOOL_VLLM", "WSPOOL_SGLANG", "WSPOOL_TOKENSPEED"]
    assert set(switches) <= set(all_extra_env_vars())


@pytest.mark.parametrize("key", ["vllm", "sglang", "tokenspeed"])
def test_each_engine_package_and_pyproject_follow_its_spec(key: str) -> None:
    """The package's integration carries its spec; its switch, device variable and entry point are the spec's."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    package = importlib.import_module(f"wspool.integrations.{key}")
    spec = engine_spec(key)
    assert package.INTEGRATION.info == spec  # equal: a test that reads the specs again makes new ones
    assert spec.switch_var == package.ENABLE_ENV_VAR
    assert getattr(package, "DEVICE_ENV_VAR", None) == spec.device_var
    assert spec.entry_point == f"wspool.integrations.{key}:register" and callable(package.register)
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"][spec.entry_point_group] == {"wspool": spec.entry_point}


def test_plugin_variables_that_are_unset_keep_wspool_on() -> None:
    """An engine with an allowlist and a denylist variable, neither set, selects wspool; set but empty too."""
    both = EngineSpec(**{**INFO.__dict__, "allowlist_var": "DEMO_PLUGINS"})
    assert both.selection({}) is None and both.selection({"DEMO_DISABLE_PLUGINS": ""}) is None
    assert both.selection({"DEMO_PLUGINS": "wspool"}) is None
    assert both.selection({"DEMO_PLUGINS": ""}) == "DEMO_PLUGINS='' does not name wspool"
    assert INFO.selection({"DEMO_DISABLE_PLUGINS": "other"}) is None


def test_load_answers_true_or_false_for_every_outcome(
    engine: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load() returns True when active and False (never another falsy value) whatever kept it from patching."""

    class Old(_Demo):
        info = EngineSpec(**{**INFO.__dict__, "supported": "<1"})

    monkeypatch.setenv("WSPOOL_DEMO", "0")
    assert _Demo(_targets()).load() is False
    monkeypatch.delenv("WSPOOL_DEMO")
    monkeypatch.setenv("DEMO_DISABLE_PLUGINS", "wspool")
    assert _Demo(_targets()).load() is False
    monkeypatch.delenv("DEMO_DISABLE_PLUGINS")
    assert Old(_targets()).load() is False
    changed = (Target(ENGINE, "one", ("a", "b"), _wrap, "one"),)
    assert _Demo(changed).load() is False
    assert engine.one is _f
    demo = _Demo(_targets())
    assert demo.load() is True and demo.load() is True
    demo.unload()
    assert engine.one is _f


def test_preflight_reads_the_environment_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """preflight(environ) judges the switch and plugin variables of that mapping, not of os.environ."""
    monkeypatch.setenv("DEMO_DISABLE_PLUGINS", "wspool")
    demo = _Demo(_targets())
    assert demo.preflight({}).cleared
    (refusal,) = demo.preflight({"WSPOOL_DEMO": "off"}).refusals
    assert (refusal.kind, refusal.problem) == ("switch", None)
    assert [r.kind for r in demo.preflight().refusals] == ["selection"]


def test_a_switch_value_not_understood_is_a_refusal_naming_the_variable() -> None:
    """WSPOOL_DEMO=maybe refuses with the switch's error as problem and cause; nothing else is read as on."""
    verdict = _Demo(_targets()).preflight({"WSPOOL_DEMO": "maybe"})
    assert not verdict.cleared
    (refusal,) = verdict.refusals
    assert refusal.kind == "switch" and refusal.reason == "WSPOOL_DEMO = 'maybe' is not understood"
    assert refusal.problem == refusal.cause and "WSPOOL_DEMO" in refusal.cause


def test_an_allowlist_without_wspool_says_the_fix_and_a_denylist_is_the_users_choice() -> None:
    """An allowlist that omits wspool is a problem naming the variable to fix; a denylist naming it has none."""

    class Listed(_Demo):
        info = EngineSpec(**{**INFO.__dict__, "allowlist_var": "DEMO_PLUGINS"})

    demo = Listed(_targets())
    (allow,) = demo.preflight({"DEMO_PLUGINS": "other"}).refusals
    assert allow.kind == "selection" and allow.problem is not None and "add wspool to DEMO_PLUGINS" in allow.problem
    (deny,) = demo.preflight({"DEMO_DISABLE_PLUGINS": "wspool"}).refusals
    assert (deny.kind, deny.problem) == ("selection", None)


def test_a_replacement_that_raises_makes_load_answer_false_and_unload_names_what_it_restores(
    engine: types.ModuleType,
) -> None:
    """load() is False when a replacement raises, leaving the engine as it was; unload() returns the names restored."""

    def explode(original: Any) -> Any:
        raise RuntimeError("cannot wrap three")

    assert _Demo(_targets(explode)).load() is False and engine.one is _f
    demo = _Demo(_targets())
    assert demo.load() is True
    assert demo.unload() == [f"{ENGINE}.one", f"{ENGINE}.two", f"{ENGINE}.three"] and engine.one is _f


def test_a_load_that_leaves_a_group_unpatched_warns_naming_it(
    engine: types.ModuleType, log: pytest.LogCaptureFixture
) -> None:
    """Where one group patches and another's target changed, load() is active and one warning names the other."""

    class Two(_Demo):
        def groups(self) -> tuple[TargetGroup, ...]:
            changed = (Target(ENGINE, "three", ("a", "b"), _wrap, "three"),)
            return (TargetGroup("demo", self._targets[:2]), TargetGroup("other", changed))

    demo = Two(_targets())
    assert demo.load() is True and demo.patched() == [f"{ENGINE}.one", f"{ENGINE}.two"]
    (warning,) = _lines(log, logging.WARNING)
    assert "not patched: other (" in warning and "Demo's own behaviour stays" in warning
    demo.unload()


def test_an_integration_that_declares_no_groups_says_so() -> None:
    """The base class's groups() raises NotImplementedError: a subclass must declare its targets."""

    class Bare(Integration):
        info = INFO

    with pytest.raises(NotImplementedError):
        Bare(logging.getLogger("wspool.test.demo")).groups()


def test_the_load_line_for_targets_absent_from_the_version_appears_only_when_some_are(
    engine: types.ModuleType, log: pytest.LogCaptureFixture
) -> None:
    """An optional target the engine lacks is named in one debug line; with none absent, no such line is written."""
    absent = Target(ENGINE, "four", ("a",), _wrap, "four", optional=True)
    demo = _Demo((*_targets(), absent))
    assert demo.load() is True
    demo.unload()
    assert [line for line in _lines(log, logging.DEBUG) if "not in this version" in line] == [
        f"wspool: Demo {version('pytest')}: not in this version, so not patched: {ENGINE}.four"
    ]
    log.clear()
    other = _Demo(_targets())
    assert other.load() is True
    other.unload()
    assert not [line for line in _lines(log, logging.DEBUG) if "not in this version" in line]
