"""Tests for ``wspool plan``: each rule's bound over --limit values, its facts and method; refusals; bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wspool.cli import main

LSE_KIMI = 8 * 8 * 8 * 256 * 256 + 33 * 2**20


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(["plan", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_plan_kimi_dcp_proves_the_lse_slab(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's example: kimi_dcp's LSE slab is proven at batch_size=256, q_len=4 and the DCP defaults."""
    args = ("--config", "kimi_dcp", "--limit", "batch_size=256", "--limit", "q_len=4", "--pool", "flashinfer_mla")
    status, out, _ = _plan(capsys, *args)
    assert status == 0
    text = " ".join(out.split())
    assert (
        f"flashinfer_mla.lse on cpu lane main: {LSE_KIMI} bytes (65MiB), proven, at batch_size=256, cp_world=8" in text
    )
    assert "flashinfer_mla.default on cpu lane main: 134217728 bytes (128MiB), literal" in text
    assert "buffer flashinfer_mla on cpu lane main: 134217728 bytes (128MiB)" in text


def test_plan_json_has_the_same_content(capsys: pytest.CaptureFixture[str]) -> None:
    """--json gives each rule's bytes, facts and method, the buffers and the total."""
    args = ("--config", "kimi_dcp", "--limit", "batch_size=256", "--limit", "q_len=1,2,4", "--pool", "flashinfer_mla")
    status, out, _ = _plan(capsys, *args, "--json")
    data = json.loads(out)
    assert status == 0
    assert data["limits"] == {"batch_size": "256", "q_len": "1,2,4"}
    lse = next(row for row in data["rules"] if row["rule"] == "lse")
    assert (lse["bytes"], lse["method"], lse["facts"]["q_len"]) == (LSE_KIMI, "proven", 4)
    assert data["buffers"] == [
        {"buffer": "flashinfer_mla", "device": "cpu", "lane": "main", "bytes": 134217728, "size": "128MiB"}
    ]
    assert data["total_bytes"] == 134217728


def test_plan_decreasing_and_searched_rules(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A decreasing rule is bounded at its true maximum (proven); a non-monotone one is searched value by value."""
    path = tmp_path / "c.yaml"
    rules = {"shrink": "64MiB - batch_size * 1KiB", "hump": "batch_size * (300 - batch_size) * 1KiB"}
    path.write_text("pools:\n  p:\n    rules:\n" + "".join(f"      {k}: {v}\n" for k, v in rules.items()))
    status, out, _ = _plan(capsys, "--config", str(path), "--pool", "p", "--limit", "batch_size=256", "--json")
    rows = {row["rule"]: row for row in json.loads(out)["rules"]}
    assert status == 0
    assert (rows["shrink"]["bytes"], rows["shrink"]["method"], rows["shrink"]["facts"]) == (
        64 * 2**20 - 1024,
        "proven",
        {"batch_size": 1},
    )
    assert (rows["hump"]["bytes"], rows["hump"]["method"], rows["hump"]["points"]) == (
        150 * 150 * 1024,
        "searched",
        256,
    )


def test_plan_names_a_fact_without_limit_and_exits_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A rule reading a fact with no limit and no default is listed as refused, naming the fact; exit status 1."""
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  p:\n    rules:\n      slab: batch_size * q_len * 1KiB\n")
    status, out, _ = _plan(capsys, "--config", str(path), "--pool", "p", "--limit", "batch_size=8")
    assert status == 1
    assert "p.slab on cpu lane main: refused: cannot bound rule" in out
    assert "fact 'q_len' has neither a limit nor a default" in " ".join(out.split())


def test_plan_fact_fixes_a_value(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--fact fixes a fact the rule reads (a device's SM count planned on another machine)."""
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  p:\n    rules:\n      d: 512 * sm_count * batch_size\n")
    status, out, _ = _plan(
        capsys, "--config", str(path), "--pool", "p", "--limit", "batch_size=2", "--fact", "sm_count=132"
    )
    assert status == 0
    assert f"p.d on cpu lane main: {512 * 132 * 2} bytes" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--limit", "batch_size"), "--limit 'batch_size': expected NAME=MAX, NAME=LO..HI or NAME=A,B,C"),
        (("--limit", "q_len=8..2"), "--limit 'q_len=8..2': values must be non-negative integers"),
        (("--pool", "nope"), "unknown pool 'nope'"),
    ],
)
def test_plan_bad_input_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    """A malformed --limit or an unknown pool is one error line and exit status 2."""
    status, _, err = _plan(capsys, *args)
    assert status == 2
    assert len(err.splitlines()) == 1
    assert err.startswith(f"wspool plan: error: {message}")
