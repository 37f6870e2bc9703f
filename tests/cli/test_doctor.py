"""Tests for wspool.cli.doctor: what it reports, the problems it finds and its exit status."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import wspool.cli.doctor as doctor
from wspool.cli import main
from wspool.integrations import ENGINES
from wspool.integrations.patching import EngineInfo
from wspool.targets import Target, TargetGroup

VLLM_VAR = "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE"
GiB = 1 << 30
# An engine that is "installed" in every test environment: pytest's own distribution stands in.
FAKE = EngineInfo(
    key="fake",
    name="Fake",
    distribution="pytest",
    supported=">=1",
    entry_point_group="vllm.general_plugins",  # where wspool's installed distribution registers an entry point
    entry_point="wspool.integrations.vllm:register",
    switch_var="WSPOOL_FAKE",
    allowlist_var="FAKE_PLUGINS",
    denylist_var="FAKE_DISABLE_PLUGINS",
    engine_variables=(VLLM_VAR,),
)
FAKE_GROUPS = (
    TargetGroup("the fake workspace", (Target("fake.attention", "workspace", None, lambda v: v, "pool flashinfer"),)),
)


def _subprocess(code: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WSPOOL_")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean, timeout=120)


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Doctor sees one engine, FAKE, whose targets are FAKE_GROUPS."""
    monkeypatch.setattr(doctor, "ENGINES", (FAKE,))
    monkeypatch.setattr(doctor, "targets_of", lambda key: FAKE_GROUPS if key == "fake" else ())
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

    monkeypatch.setattr(doctor, "ENGINES", (replace(FAKE, **change),))
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
    from wspool.settings.sources import ENGINE_KNOBS

    declared = {v for info in ENGINES for v in info.engine_variables}
    knobs = {name for name, _, _ in ENGINE_KNOBS}
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
