"""Tests for wspool.cli.doctor: what it reports, the problems it finds and its exit status."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wspool.cli.doctor as doctor
from wspool.cli import main
from wspool.integrations import ENGINES
from wspool.integrations.patching import Integration
from wspool.settings.profiles import EngineSpec, EngineVariable, engine_knobs
from wspool.targets import Target, TargetGroup

VLLM_VAR = "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE"
GiB = 1 << 30
# An engine that is "installed" in every test environment: pytest's own distribution stands in.
FAKE = EngineSpec(
    key="fake",
    name="Fake",
    distribution="pytest",
    supported=">=1",
    order=1,
    entry_point_group="vllm.general_plugins",  # where wspool's installed distribution registers an entry point
    entry_point="wspool.integrations.vllm:register",
    switch_var="WSPOOL_FAKE",
    allowlist_var="FAKE_PLUGINS",
    denylist_var="FAKE_DISABLE_PLUGINS",
    variables=(EngineVariable(VLLM_VAR, "vLLM", (("flashinfer", "vllm"), ("flashinfer_mla_sparse", "default"))),),
)
FAKE_GROUPS = (
    TargetGroup("the fake workspace", (Target("fake.attention", "workspace", None, lambda v: v, "pool flashinfer"),)),
)


def _subprocess(code: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WSPOOL_")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean, timeout=120)


class _FakeIntegration(Integration):
    """The integration of whichever FAKE doctor's ENGINES holds now: FAKE_GROUPS, no checks of its own."""

    def __init__(self, info: EngineSpec) -> None:
        self.info = info
        super().__init__(logging.getLogger("wspool.test.fake"))

    def groups(self) -> tuple[TargetGroup, ...]:
        return FAKE_GROUPS


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Doctor sees one engine, FAKE, whose targets are FAKE_GROUPS."""
    monkeypatch.setattr(doctor, "engine_specs", lambda: (FAKE,))
    monkeypatch.setattr(doctor, "integration", lambda key: _FakeIntegration(next(i for i in doctor.engine_specs()
                                                                                   if i.key == key)))  # fmt: skip
    yield


def _engine(report: dict[str, Any]) -> dict[str, Any]:
    (engine,) = report["engines"]
    return engine


def test_doctor_reports_every_section_and_exits_0_here(capsys: pytest.CaptureFixture[str]) -> None:
    """In the test environment: versions, a device and its profile, the engines, the configuration, no problem."""
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"wspool", "python", "torch", "devices", "flashinfer", "engines", "configuration", "problems"}
    assert report["wspool"]["version"] == doctor.__version__
    assert report["python"]["executable"] == sys.executable
    assert report["torch"]["version"] and report["devices"][0]["profile"]
    assert report["flashinfer"]["admitted"] is True
    assert [e["key"] for e in report["engines"]] == [info.key for info in ENGINES]
    assert report["configuration"]["valid"] and report["configuration"]["changed"] == []
    assert report["problems"] == []
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"wspool {doctor.__version__} (")
    assert out.splitlines()[-1] == "problems: none"
    assert all(len(line) <= 100 for line in out.splitlines())


def test_doctor_imports_no_engine_and_no_torch_without_a_driver() -> None:
    """Where no engine is installed and torch cannot use CUDA, doctor imports neither torch nor an engine."""
    code = (
        "import sys\n"
        "from wspool.cli.doctor import diagnose\n"
        "report = diagnose()\n"
        "engines = [e['key'] for e in report['engines'] if e['installed']]\n"
        "if engines or report['torch']['cuda_available']:\n"
        "    print('SKIP', engines, report['torch']['why'])\n"
        "    sys.exit(0)\n"
        "loaded = sorted(m for m in ('torch', 'flashinfer', 'vllm', 'sglang', 'tokenspeed') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
        "print('OK', report['torch']['why'])\n"
    )
    done = _subprocess(code)
    assert done.returncode == 0, done.stderr
    if done.stdout.startswith("SKIP"):
        pytest.skip(f"an engine or CUDA is here: {done.stdout.strip()}")
    assert done.stdout.startswith("OK ")


@pytest.mark.usefixtures("fake_engine")
def test_an_installed_supported_registered_engine_is_active_with_its_targets() -> None:
    """Installed, supported, wspool's entry point registered, switch unset: active, with what it patches."""
    report = doctor.diagnose(environ={})
    engine = _engine(report)
    assert (engine["installed"], engine["supported"], engine["active"], engine["why_inactive"]) == (
        True,
        True,
        True,
        [],
    )
    assert engine["entry_point"]["registered"] is True
    assert engine["targets"] == [
        {"group": "the fake workspace", "targets": [{"module": "fake.attention", "path": "workspace",
                                                     "what": "pool flashinfer"}]}
    ]  # fmt: skip
    assert report["problems"] == []
    text = doctor.format_report(report)
    assert re.search(r"^  Fake \S+: installed, supported, active$", text, re.MULTILINE)
    assert "        fake.attention: workspace -> pool flashinfer" in text


@pytest.mark.usefixtures("fake_engine")
@pytest.mark.parametrize(
    ("change", "environ", "problem"),
    [
        ({"supported": "<1"}, {}, r"^Fake \S+ is installed, but wspool supports <1: its plugin patches nothing; "
                                  r"install a supported Fake, or set WSPOOL_FAKE=0$"),
        ({"entry_point_group": "no.such.group"}, {},
         r"^Fake is installed, but wspool's entry point wspool\.integrations\.vllm:register is not registered in "
         r"no\.such\.group: install wspool into this environment"),
        ({"entry_point": "wspool.elsewhere:register"}, {},
         r"is not registered in vllm\.general_plugins \(registered: wspool\.integrations\.vllm:register\)"),
        ({}, {"WSPOOL_FAKE": "maybe"}, r"^invalid environment variable WSPOOL_FAKE = 'maybe': expected 1 or 0"),
        ({}, {"FAKE_PLUGINS": "other"}, r"^FAKE_PLUGINS='other' does not name wspool: Fake will not load wspool's "
                                        r"plugin; add wspool to FAKE_PLUGINS or unset it$"),
    ],
)  # fmt: skip
def test_what_keeps_an_installed_engine_off_is_a_problem_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch, change: dict[str, str], environ: dict[str, str], problem: str
) -> None:
    """An unsupported version, an unregistered entry point, a switch value not understood, an allowlist without
    wspool: the engine is not active, and one problem line says what to change; doctor exits 1."""
    from dataclasses import replace

    monkeypatch.setattr(doctor, "engine_specs", lambda: (replace(FAKE, **change),))
    report = doctor.diagnose(environ=environ)
    engine = _engine(report)
    assert engine["active"] is False and engine["why_inactive"]
    (line,) = report["problems"]
    assert re.search(problem, line), line


@pytest.mark.usefixtures("fake_engine")
@pytest.mark.parametrize(
    ("environ", "why"),
    [({"WSPOOL_FAKE": "0"}, "WSPOOL_FAKE=0 turns it off"),
     ({"FAKE_DISABLE_PLUGINS": "a, wspool"}, "FAKE_DISABLE_PLUGINS='a, wspool' names wspool")],
)  # fmt: skip
def test_an_engine_switched_off_on_purpose_is_inactive_and_no_problem(environ: dict[str, str], why: str) -> None:
    """wspool's switch at 0, or the engine's disable list naming wspool: inactive, said why, not a problem."""
    report = doctor.diagnose(environ=environ)
    assert (_engine(report)["active"], _engine(report)["why_inactive"], report["problems"]) == (False, [why], [])


@pytest.mark.usefixtures("fake_engine")
def test_an_engine_variable_is_shown_with_what_it_sets_and_what_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """With --config vllm, VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE's keys name it as the source, over the shipped file;
    the values that differ from the built-in defaults list them too."""
    monkeypatch.setenv(VLLM_VAR, str(GiB))
    report = doctor.diagnose("vllm", environ=dict(os.environ))
    (variable,) = _engine(report)["engine_variables"]
    over = f"vLLM's variable {VLLM_VAR}, over shipped configuration vllm = '394MiB'"
    assert variable == {
        "name": VLLM_VAR,
        "value": str(GiB),
        "sets": [
            {"key": "pools.flashinfer.rules.vllm", "source": over},
            {"key": "pools.flashinfer_mla_sparse.rules.default", "source": over},
        ],
    }
    changed = {row["key"]: row for row in report["configuration"]["changed"]}
    assert changed["pools.flashinfer.rules.vllm"]["source"] == over
    assert changed["pools.flashinfer_dash.rules.default"]["source"] == "shipped configuration vllm"
    assert "pools.flashinfer_dash.growth" not in changed  # the schema's default: no source gives it
    assert all(row["source"] != "built-in default" for row in changed.values())
    assert report["configuration"]["shipped"] == "vllm"
    text = " ".join(doctor.format_report(report).split())
    assert f"{VLLM_VAR} = {GiB}: pools.flashinfer.rules.vllm from {over}" in text


def test_an_invalid_configuration_is_a_problem_and_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A configuration that does not load: doctor still reports the rest, lists the error, exits 1."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_MLA__RULE__LSE", "1GiB")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "configuration: INVALID" in out
    problems = out[out.index("problems: 1") :]
    assert "did you mean 'rules'? set pools.flashinfer_mla.rules.lse / WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE" in (
        " ".join(problems.split())
    )


def test_flashinfer_missing_is_a_problem_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without FlashInfer's distribution, doctor says so and how to install it."""
    monkeypatch.setattr(doctor, "FLASHINFER_DISTRIBUTION", "no-such-flashinfer")
    report = doctor.diagnose()
    assert report["flashinfer"]["version"] is None
    assert report["problems"] == [
        "FlashInfer is not installed: wspool's kernels need it; pip install no-such-flashinfer"
    ]


def test_the_engine_variables_doctor_shows_are_the_ones_wspool_honours() -> None:
    """Each engine's declared workspace variables are engine knobs of the settings, and vice versa."""
    declared = {v for info in ENGINES for v in info.engine_variables}
    knobs = {knob.name for knob in engine_knobs()}
    # TokenSpeed's initial block size is honoured by its integration (a floor of the block's first request).
    assert declared - knobs == {"TOKENSPEED_WORKSPACE_INITIAL_MB"} and knobs <= declared


def test_each_installed_engine_is_installed_supported_and_active() -> None:
    """In an engine's environment, doctor names that engine installed, supported and active (run by CI there)."""
    installed = [info for info in ENGINES if info.installed_version() is not None]
    if not installed:
        pytest.skip("no engine wspool integrates is installed in this environment")
    code = (
        "import json, sys\n"
        "from wspool.cli.doctor import diagnose\n"
        "report = diagnose()\n"
        "print(json.dumps({'report': report, 'imported': [m for m in ('vllm', 'sglang', 'tokenspeed') "
        "if m in sys.modules]}))\n"
    )
    done = _subprocess(code)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["imported"] == []
    by_key = {engine["key"]: engine for engine in result["report"]["engines"]}
    for info in installed:
        engine = by_key[info.key]
        assert (engine["installed"], engine["supported"], engine["active"]) == (True, True, True), engine
        assert engine["targets"], info.key
    assert result["report"]["problems"] == []


# -- one preflight: what keeps load() from patching is what doctor reports ----------------------------------------

#: A version each engine's integration supports, given to EngineSpec.installed_version below.
SUPPORTED = {"vllm": "0.34.0", "sglang": "0.5.23", "tokenspeed": "0.1.1"}
#: Not a variable: the version the test gives the engine's installed_version.
VERSION_VAR = "installed version"
#: A pool with a rule no other pool has, for a pool to share its buffer with.
SCRATCH = "pools:\n  elsewhere:\n    rules: {elsewhere_only: 1MiB}\n"


def _own_buffer_cases() -> list[tuple[str, dict[str, str], str, str]]:
    """Every pool an engine needs its own buffer for, given a shared_with: (engine, environment, file, error)."""
    from wspool.integrations.sglang.buffers import BUFFERS
    from wspool.integrations.tokenspeed.buffers import FLASHMLA, WORKSPACES
    from wspool.integrations.vllm.getters import OWN_BUFFER_POOLS

    def shared(pool: str, host: str = "elsewhere") -> str:
        return f"{SCRATCH}  {pool}:\n    shared_with: {host}\n"

    cases = [("vllm", {}, shared(pool), rf"pool '{pool}' must have its own buffer") for pool in OWN_BUFFER_POOLS]
    cases += [("sglang", {}, shared(w.pool), rf"pool '{w.pool}' must have its own buffer")
              for w in BUFFERS.values() if w.own_buffer]  # fmt: skip
    cases += [("tokenspeed", {}, shared(w.pool), rf"pool '{w.pool}' must have its own buffer")
              for w in WORKSPACES if w.own_buffer]  # fmt: skip
    flashmla_buffer = "flashinfer_mla" if FLASHMLA.pool == "flashinfer" else FLASHMLA.pool  # the built-in sharing
    cases.append(("tokenspeed", {}, shared("tokenspeed_scratch", flashmla_buffer), r"shares pool 'tokenspeed_scratch'"))
    return cases


#: Every refusal load() has that is a mistake, for each engine it applies to: (engine, environment, file, error).
MISTAKES: list[tuple[str, dict[str, str], str, str]] = [
    *[(key, {var: "maybe"}, "", rf"invalid environment variable {var} = 'maybe'")
      for key, var in (("vllm", "WSPOOL_VLLM"), ("sglang", "WSPOOL_SGLANG"), ("tokenspeed", "WSPOOL_TOKENSPEED"))],
    *[(key, {var: "other"}, "", rf"{var}='other' does not name wspool")
      for key, var in (("vllm", "VLLM_PLUGINS"), ("sglang", "SGLANG_PLUGINS"))],
    *[(key, {VERSION_VAR: "0.0.1"}, "", r"0\.0\.1 is \D*wspool supports >=") for key in SUPPORTED],
    *[(key, {}, "pools:\n  flashinfer_mla:\n    rules: {lse: 12 parsecs}\n", r"pools\.flashinfer_mla\.rules\.lse")
      for key in SUPPORTED],
    *[(key, {var: "gpu0"}, "", rf"invalid environment variable {var} = 'gpu0': not a device")
      for key, var in (("vllm", "WSPOOL_VLLM_DEVICE"), ("sglang", "WSPOOL_SGLANG_DEVICE"))],
    *_own_buffer_cases(),
]  # fmt: skip


def _installed(monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], key: str) -> None:
    """Every engine installed at a supported version; ``key``'s at ``environ[VERSION_VAR]`` where given."""
    versions = {**SUPPORTED, key: environ.get(VERSION_VAR, SUPPORTED[key])}
    monkeypatch.setattr(EngineSpec, "installed_version", lambda self: versions[self.key])
    for var, value in environ.items():
        if var != VERSION_VAR:
            monkeypatch.setenv(var, value)


def _load_refuses(key: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Run the engine's load(); return its log lines (it must patch nothing)."""
    import wspool
    from wspool.integrations import integration

    wspool.reset_registry()
    engine = integration(key)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=engine.logger.name):
        loaded = engine.load()
    patched = engine.patched()
    if patched:  # a load that should have refused: put the engine back before failing
        engine.unload()
    assert (loaded, patched) == (False, [])
    return [r.getMessage() for r in caplog.records if r.name == engine.logger.name]


@pytest.mark.parametrize(("key", "environ", "config", "error"), MISTAKES)
def test_every_mistake_that_stops_load_makes_doctor_exit_1_naming_it(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    key: str,
    environ: dict[str, str],
    config: str,
    error: str,
) -> None:
    """A bad switch, an allowlist without wspool, an unsupported version, a bad configuration, a device variable that
    names no device, a pool the engine needs its own buffer for given a shared_with: load() patches nothing and says
    why, and doctor names the same reason, the engine NOT active, and exits 1."""
    _installed(monkeypatch, environ, key)
    if config:
        path = tmp_path / "wspool.yaml"
        path.write_text(config)
        monkeypatch.setenv("WSPOOL_CONFIG", str(path))
    said = " ".join(_load_refuses(key, caplog))
    assert re.search(error, said), said
    assert main(["doctor"]) == 1
    text = " ".join(capsys.readouterr().out.split())
    version = re.escape(environ.get(VERSION_VAR, SUPPORTED[key]))
    assert re.search(rf"{version}: installed, (NOT )?supported.*?, NOT active", text), text
    problems = text[text.index("problems: ") :]
    assert re.search(error, problems), problems
    report = doctor.diagnose(environ=dict(os.environ))
    (engine,) = [e for e in report["engines"] if e["key"] == key]
    assert engine["active"] is False and engine["why_inactive"]


@pytest.mark.parametrize(
    ("key", "environ", "why"),
    [("vllm", {"WSPOOL_VLLM": "0"}, "WSPOOL_VLLM=0 turns it off"),
     ("sglang", {"WSPOOL_SGLANG": "off"}, "WSPOOL_SGLANG=off turns it off"),
     ("tokenspeed", {"WSPOOL_TOKENSPEED": "no"}, "WSPOOL_TOKENSPEED=no turns it off"),
     ("tokenspeed", {"TOKENSPEED_DISABLE_PLUGINS": "wspool"}, "TOKENSPEED_DISABLE_PLUGINS='wspool' names wspool")],
)  # fmt: skip
def test_an_engine_turned_off_on_purpose_is_not_active_in_doctor_and_load_patches_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, key: str, environ: dict[str, str], why: str
) -> None:
    """wspool's switch at 0, or the engine's disable list naming wspool: load() patches nothing, and doctor says the
    same reason, NOT active, and no problem."""
    _installed(monkeypatch, environ, key)
    assert _load_refuses(key, caplog)
    report = doctor.diagnose(environ=dict(os.environ))
    (engine,) = [e for e in report["engines"] if e["key"] == key]
    assert (engine["active"], engine["why_inactive"], report["problems"]) == (False, [why], [])


@pytest.mark.parametrize(
    ("key", "version"), [("sglang", "0.5.23rc0"), ("tokenspeed", "0.1.1rc2"), ("vllm", "0.33.0rc1")]
)
def test_a_release_candidate_of_a_supported_version_is_supported_and_active_in_doctor(
    monkeypatch: pytest.MonkeyPatch, key: str, version: str
) -> None:
    """SGLang 0.5.23rc0, TokenSpeed 0.1.1rc2 and vLLM 0.33.0rc1 count as the releases they precede: doctor exits 0."""
    _installed(monkeypatch, {VERSION_VAR: version}, key)
    report = doctor.diagnose(environ=dict(os.environ))
    (engine,) = [e for e in report["engines"] if e["key"] == key]
    assert (engine["version"], engine["supported"], engine["active"]) == (version, True, True)
    assert report["problems"] == []


_SWITCH = {"vllm": "WSPOOL_VLLM", "sglang": "WSPOOL_SGLANG", "tokenspeed": "WSPOOL_TOKENSPEED"}
_SELECTION = {"vllm": "VLLM_PLUGINS", "sglang": "SGLANG_PLUGINS", "tokenspeed": "TOKENSPEED_DISABLE_PLUGINS"}
_OWN_POOL = {"vllm": "flashinfer_mla_counters", "sglang": "sglang_trtllm_mla", "tokenspeed": "tokenspeed_dsa"}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    key=st.sampled_from(sorted(SUPPORTED)),
    switch=st.sampled_from([None, "1", "0", "off", "maybe"]),
    selection=st.sampled_from([None, "wspool", "other", "other,wspool"]),
    device=st.sampled_from([None, "cpu", "gpu0"]),
    version=st.sampled_from(["supported", "rc", "0.0.1"]),
    shared=st.booleans(),
)
def test_doctor_says_active_exactly_when_load_goes_on_to_patch(
    caplog: pytest.LogCaptureFixture,
    key: str,
    switch: str | None,
    selection: str | None,
    device: str | None,
    version: str,
    shared: bool,
) -> None:
    """Over random combinations of switch, plugin selection, device variable, version and a pool sharing a buffer
    it must own: doctor's engine is active exactly when load() goes on to locate targets, and when it is not, load's
    one line says a reason doctor lists."""
    from wspool.integrations import integration
    from wspool.targets import PatchPlan

    installed = {"supported": SUPPORTED[key], "rc": SUPPORTED[key] + "rc1", "0.0.1": "0.0.1"}[version]
    environ = {
        _SWITCH[key]: switch,
        _SELECTION[key]: selection,
        "WSPOOL_VLLM_DEVICE" if key == "vllm" else "WSPOOL_SGLANG_DEVICE": device,
    }
    if shared:
        environ["WSPOOL_POOLS__ELSEWHERE__RULES__ELSEWHERE_ONLY"] = "1MiB"
        environ[f"WSPOOL_POOLS__{_OWN_POOL[key].upper()}__SHARED_WITH"] = "elsewhere"
    engine = integration(key)
    located: list[bool] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineSpec, "installed_version", lambda self: installed if self.key == key else SUPPORTED[self.key])
        for var, value in environ.items():
            if value is not None:
                mp.setenv(var, value)
        mp.setattr(engine.patches, "plan", lambda groups: located.append(True) or PatchPlan())
        report = doctor.diagnose(environ=dict(os.environ))
        wspool_reset()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=engine.logger.name):
            assert engine.load() is False and engine.patched() == []
    (verdict,) = [e for e in report["engines"] if e["key"] == key]
    assert verdict["active"] is bool(located), (verdict["why_inactive"], located)
    if not located:  # load's line names what doctor's first reason names: a variable, a version or a pool
        said = " ".join(r.getMessage() for r in caplog.records if r.name == engine.logger.name)
        names = re.findall(r"\b[A-Z][A-Z_]{3,}\b|\d+\.\d+\.\d+\w*|pool '\w+'", verdict["why_inactive"][0])
        assert names and all(name in said for name in names), (said, verdict["why_inactive"])


def wspool_reset() -> None:
    """Forget the default registry (the next load reads the configuration afresh)."""
    import wspool

    wspool.reset_registry()


@pytest.mark.parametrize(("value", "shown"), [(None, "yes (WSPOOL_RESERVE: unset)"), ("0", "no (WSPOOL_RESERVE: '0')")])
def test_doctor_names_the_reserve_switch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str | None, shown: str
) -> None:
    """Doctor says, per installed engine, whether it reserves its pools before sizing its KV cache, and the switch."""
    monkeypatch.setattr(EngineSpec, "installed_version", lambda self: SUPPORTED[self.key])
    if value is not None:
        monkeypatch.setenv("WSPOOL_RESERVE", value)
    main(["doctor"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.count(f"reserves its pools before sizing its KV cache: {shown}") == len(ENGINES)
    main(["doctor", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert {e["key"]: e["reserve"]["on"] for e in data["engines"]} == {e.key: value is None for e in ENGINES}


def test_doctor_counts_a_reserve_switch_it_does_not_understand_as_a_problem(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """WSPOOL_RESERVE=maybe is one problem naming the variable and what it takes (exit 1), not "problems: none"."""
    monkeypatch.setattr(EngineSpec, "installed_version", lambda self: SUPPORTED[self.key])
    monkeypatch.setenv("WSPOOL_RESERVE", "maybe")
    assert main(["doctor"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "reserves its pools before sizing its KV cache: not understood (read as yes)" in out
    assert main(["doctor", "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert [p for p in problems if "WSPOOL_RESERVE" in p] == [
        "invalid environment variable WSPOOL_RESERVE = 'maybe': expected 1 or 0 (true/false, on/off, yes/no); "
        "unset it to keep wspool on (each engine reserves its pools, as with 1)"
    ]
