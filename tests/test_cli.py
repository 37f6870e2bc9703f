"""Tests for wspool.cli: show and resolve, exit codes and error lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wspool.cli import main

LSE_ENV = "WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WSPOOL_")}
    return subprocess.run(
        [sys.executable, "-m", "wspool", *args], capture_output=True, text=True, env={**clean, **(env or {})}
    )


def test_resolve_acceptance_values(tmp_path: Path) -> None:
    """The issue's acceptance: defaults, env override, YAML file, env beats file (real processes)."""
    assert _run("resolve", "flashinfer_mla", "lse", "--bytes").stdout.strip() == "268435456"
    assert _run("resolve", "flashinfer_mla", "--bytes").stdout.strip() == "134217728"
    assert _run("resolve", "flashinfer_mla", "lse", "--bytes", env={LSE_ENV: "512MiB"}).stdout.strip() == "536870912"
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  flashinfer_mla:\n    rules:\n      lse: 300MiB\n")
    assert _run("resolve", "flashinfer_mla", "lse", "--bytes", "--config", str(path)).stdout.strip() == "314572800"
    assert (
        _run("resolve", "flashinfer_mla", "lse", "--bytes", env={"WSPOOL_CONFIG": str(path)}).stdout.strip()
        == "314572800"
    )
    both = _run("resolve", "flashinfer_mla", "lse", "--bytes", env={"WSPOOL_CONFIG": str(path), LSE_ENV: "512MiB"})
    assert both.stdout.strip() == "536870912"


def test_resolve_with_facts(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--fact supplies the facts of an expression rule; without --bytes the size is explained."""
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  mla:\n    rules:\n      lse: 8 * num_heads * batch_size * round_up(q_len, 256) + 1MiB\n")
    assert (
        main(
            [
                "resolve",
                "mla",
                "lse",
                "--config",
                str(path),
                "--fact",
                "num_heads=128",
                "--fact",
                "batch_size=2",
                "--fact",
                "q_len=1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("mla.lse = 1572864 bytes (1.5MiB)")
    assert "WSPOOL_POOLS__MLA__RULES__LSE" in out


def test_show_names_sources(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """show prints each value with default, YAML file or environment variable as its source."""
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  flashinfer_mla:\n    rules:\n      default: 64MiB\n")
    monkeypatch.setenv(LSE_ENV, "512MiB")
    assert main(["show", "--config", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"config file: {path}"
    by_key = {line.split()[0]: " ".join(line.split()) for line in lines[1:]}  # columns are padded to the widest
    assert by_key["pools.flashinfer_mla.rules.lse"].endswith(f"512MiB environment variable {LSE_ENV}")
    assert by_key["pools.flashinfer_mla.rules.default"].endswith(f"YAML file {path}")
    assert by_key["pools.flashinfer_mla.growth"].endswith("default")


def test_show_json(capsys: pytest.CaptureFixture[str]) -> None:
    """show --json is machine-readable."""
    assert main(["show", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {row["key"]: row for row in data["settings"]}
    assert rows["pools.flashinfer_mla.rules.lse"] == {
        "key": "pools.flashinfer_mla.rules.lse",
        "value": "256MiB",
        "source": "profile fixed",  # the CPU's profile under auto
    }
    assert data["devices"][0]["profile"] == "fixed"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["resolve", "nope"], {}, "wspool resolve: error: unknown pool 'nope'"),
        (["resolve", "flashinfer_mla", "prefill"], {}, "wspool resolve: error: pool 'flashinfer_mla' has no rule"),
        (["resolve", "flashinfer_mla", "--config", "/nonexistent.yaml"], {}, "does not exist"),
        (["resolve", "flashinfer_mla", "--fact", "x=y"], {}, "fact 'x' must be an integer"),
        (["resolve", "flashinfer_mla", "lse"], {LSE_ENV: "lots of"}, f"from environment variable {LSE_ENV}"),
        (["show"], {"WSPOOL_CONFIG": "/nonexistent.yaml"}, "named by WSPOOL_CONFIG"),
        (["frobnicate"], {}, "invalid choice"),
        ([], {}, "required"),
    ],
)
def test_bad_input_exits_2_with_one_line(args: list[str], env: dict[str, str], message: str) -> None:
    """Bad input exits 2 with a single error line on stderr and no traceback."""
    result = _run(*args, env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr


def test_bench_prints_hot_path_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """bench prints the seed's and wspool's per-call costs from one run."""
    assert main(["bench", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert "seed _get_workspace_buffer(True)" in out
    assert "x the seed" in out
