"""Tests for wspool.tools.bench, wspool.tools.bench_report and the bench command on the CPU (GPU sections skip)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from wspool.cli import main
from wspool.tools.bench import CPU_SECTIONS, SECTIONS, run_benchmarks
from wspool.tools.bench_gpu import (
    DecodeCallFigures,
    DecodeStepFigures,
    MemoryRow,
    PlanSupplyFigures,
    added_time_budget_us,
)
from wspool.tools.bench_report import BenchError, failed_sections, format_report, load_figures, plot_memory
from wspool.tools.sweep import MLAShape

H200_NEED = 17369088


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WSPOOL_")}
    return subprocess.run(
        [sys.executable, "-m", "wspool", *args],
        capture_output=True,
        text=True,
        env={**clean, "CUDA_VISIBLE_DEVICES": ""},
    )


def _gpu_figures() -> dict[str, Any]:
    """Figures shaped like an H200 run's, built from the GPU dataclasses."""
    calls = [
        DecodeCallFigures(1, 128, 4096, False, 1000.0, 990.0),  # no paired figures: the difference of medians
        DecodeCallFigures(128, 128, 4096, False, 1500.0, 1490.0, "4-D", 12.0, -1.0, 7.5),
        DecodeCallFigures(1, 128, 4096, True, 1000.0, 990.0, "packed", 25.0, 3.0),
    ]
    steps = [
        DecodeStepFigures(1, 128, 4096, 61, 1.0, 81.0, 80.0, 4100.0, "replayed", 0.5, -0.25),
        DecodeStepFigures(128, 128, 4096, 61, 1.0, 254.0, 250.0, None, "skipped: graph mode failed: RuntimeError: x"),
    ]
    memory = [
        MemoryRow(MLAShape(1, 16, 1024), H200_NEED, H200_NEED, None),
        MemoryRow(MLAShape(512, 128, 32768, return_lse=True), H200_NEED, H200_NEED, None),
    ]
    return {
        "machine": {"gpu": "NVIDIA H200 (compute capability 9.0, 132 SMs, 140 GiB)", "cpu": "x", "python": "3.12"},
        "mla_decode": {"rules_file": "configs/hopper.yaml", "runs": 100, "rows": [c.as_dict() for c in calls]},
        "decode_step": {"rules_file": "configs/hopper.yaml", "runs": 100, "rows": [s.as_dict() for s in steps]},
        "mla_plan": PlanSupplyFigures(64, 128, 1024, own_us=40.0, wspool_us=38.5, noise_us=1.25).as_dict(),
        "memory": {"rules_file": "configs/hopper.yaml", "rows": [m.as_dict() for m in memory]},
    }


def test_budget_is_2_percent_or_2_us() -> None:
    """The added-time budget is 2% of the direct time or 2 us, whichever is larger."""
    assert added_time_budget_us(50.0) == 2.0
    assert added_time_budget_us(1000.0) == 20.0
    assert DecodeCallFigures(1, 128, 4096, False, 1019.0, 1000.0).ok
    assert not DecodeCallFigures(1, 128, 4096, False, 1021.0, 1000.0).ok
    assert not DecodeCallFigures(1, 128, 4096, False, 1000.0, 1000.0, "4-D", 20.5).ok  # the paired figure decides
    assert DecodeCallFigures(1, 128, 4096, False, 1030.0, 1000.0, "4-D", 19.5).ok
    assert not DecodeStepFigures(1, 128, 4096, 61, 2.0, 80.0, 80.0, None, "").ok  # two plans in a step


def test_cpu_run_skips_gpu_sections_and_writes_json(tmp_path: Path) -> None:
    """On the CPU, bench prints the hot path, says each GPU section was skipped, and writes the JSON."""
    out = tmp_path / "bench.json"
    result = _run("bench", "--repeats", "3", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "x vLLM's)" in result.stdout
    for title in ("(b) mla_decode", "(b2) decode step", "(b3) SGLang's eager MLA decode plan", "(c) memory"):
        assert any(
            line.startswith(title) and line.endswith("skipped: no CUDA device") for line in result.stdout.splitlines()
        )
    figures = json.loads(out.read_text())
    assert figures["machine"]["gpu"] == "none" and figures["hot_path"]["device"] == "cpu"
    assert {figures[s]["skipped"] for s in SECTIONS if s not in CPU_SECTIONS} == {"no CUDA device"}


def test_json_without_file_prints_only_json(capsys: pytest.CaptureFixture[str]) -> None:
    """--json without a file prints the figures as JSON and nothing else."""
    assert main(["bench", "--repeats", "3", "--json", "--sections", "hot_path"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(figures) == {"machine", "hot_path"} and figures["hot_path"]["literal_vs_seed"] > 0


def test_sections_subset_runs_only_those() -> None:
    """run_benchmarks runs only the sections asked for."""
    figures = run_benchmarks(sections=("hot_path",), repeats=3)
    assert set(figures) == {"machine", "hot_path"}


def test_report_prints_markdown_tables_and_verdicts() -> None:
    """GPU figures print as Markdown tables with the budget verdicts, graph notes and the memory verdict."""
    text = format_report(_gpu_figures())
    assert "| 1 | 128 | 4096 | no | 4-D | 1000.0 | 990.0 | +10.0 | - | yes | - |" in text
    assert "| 128 | 128 | 4096 | no | 4-D | 1500.0 | 1490.0 | +12.0 | -1.0 | yes | +7.5 |" in text
    assert "| 1 | 128 | 4096 | yes | packed | 1000.0 | 990.0 | +25.0 | +3.0 | no | - |" in text
    assert "| 1 | 128 | 4096 | 1 | 81.0 | 80.0 | +0.50 | -0.25 | yes | 4100.0 |" in text
    assert "| 128 | 128 | 4096 | 1 | 254.0 | 250.0 | +4.00 | - | yes | - |" in text
    assert "batch 128: skipped: graph mode failed: RuntimeError: x" in text
    assert "FlashInfer's own 40.0 us, wspool 38.5 us, added -1.50 us (spread of FlashInfer's own rounds 1.25" in text
    assert (
        "| B=512 H=128 L=32768 q=1 lse | 17369088 (16.56MiB) | 17369088 (16.56MiB) | 1.000 | 256MiB | 15.5 | ok |"
        in text
    )
    assert "measured rule: never below the minimum; at most 1.000x the true minimum" in text


def test_report_flags_an_underestimating_rule() -> None:
    """A rule below a shape's minimum, or a failed run at the rule's size, is named in the verdict."""
    figures = _gpu_figures()
    figures["memory"]["rows"][0]["rule_bytes"] = H200_NEED - 1
    figures["memory"]["rows"][1]["run_at_rule"] = "overflow"
    assert "BELOW the minimum or failed for B=1 H=16 L=1024 q=1, B=512 H=128 L=32768 q=1 lse" in format_report(figures)


def test_failed_section_is_reported() -> None:
    """A section that raised prints FAILED with its error and is listed as failed."""
    figures = _gpu_figures()
    figures["memory"] = {"failed": "RuntimeError: boom"}
    assert "(c) memory: bytes reserved per MLA decode call: FAILED: RuntimeError: boom" in format_report(figures)
    assert failed_sections(figures) == ["memory"]


def test_plot_needs_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without matplotlib, --plot is a clear error with the install hint."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(BenchError, match=r"--plot needs matplotlib, which is not installed: pip install matplotlib$"):
        plot_memory(_gpu_figures(), tmp_path / "m.png")


def test_plot_from_json(tmp_path: Path) -> None:
    """--plot-from draws the memory sweep of a saved run (when matplotlib is installed)."""
    pytest.importorskip("matplotlib")
    saved, png = tmp_path / "bench.json", tmp_path / "bench.png"
    saved.write_text(json.dumps(_gpu_figures()))
    assert main(["bench", "--plot-from", str(saved), "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "--sections", "hot_path,bogus"], "--sections takes a subset of"),
        (["bench", "--runs", "0"], "--runs and --repeats must be at least 1"),
        (["bench", "--plot-from", "x.json"], "--plot-from needs --plot FILE.png"),
        (
            ["bench", "--plot-from", "/nonexistent.json", "--plot", "x.png"],
            "figures file /nonexistent.json does not exist or is not a file",
        ),
        (["bench", "--repeats", "3", "--sections", "hot_path", "--plot", "x.png"], "--plot "),
        (["bench", "--rules", "/nonexistent.yaml", "--repeats", "3"], "does not exist"),
        (["bench", "--shapes", "/nonexistent.yaml", "--repeats", "3"], "shapes file /nonexistent.yaml does not exist"),
    ],
)
def test_bad_bench_input_exits_2_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad bench input exits 2 with one error line on stderr."""
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("wspool bench: error: ")


def test_load_figures_rejects_other_json(tmp_path: Path) -> None:
    """A JSON file that is not bench figures is refused."""
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    with pytest.raises(BenchError, match="does not hold wspool bench figures"):
        load_figures(path)
    path.write_text("{nope")
    with pytest.raises(BenchError, match="is not JSON"):
        load_figures(path)


def test_gpu_measurements_run_against_doubles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU sections' code runs end to end on the CPU against FlashInfer doubles (graph mode skips)."""
    import torch

    from tests.helpers.fake_prober import FakeProber
    from tests.helpers.mla_doubles import WrapperDouble, fake_flashinfer_mla
    from tests.helpers.paths import REPO_ROOT
    from wspool.flashinfer import backends
    from wspool.flashinfer import kernels as fi_kernels
    from wspool.registry import PoolRegistry
    from wspool.tools import bench_gpu

    WrapperDouble.instances.clear()
    monkeypatch.setattr(backends, "device_arch", lambda device: (9, 0))
    monkeypatch.setattr(backends, "sm_count", lambda device: 132)
    monkeypatch.setattr(fi_kernels, "load_flashinfer_mla", lambda: fake_flashinfer_mla())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    registry = PoolRegistry.from_config(REPO_ROOT / "configs" / "hopper.yaml")
    cpu = torch.device("cpu")
    calls = bench_gpu.measure_mla_decode(registry, cpu, batches=(1, 2), num_heads=16, max_seq_len=256, runs=2, warmup=1)
    assert [(c.batch_size, c.return_lse, c.query_form) for c in calls] == [
        (b, lse, form) for b in (1, 2) for lse in (False, True) for form in ("4-D", "packed")
    ]
    assert all(c.wspool_us > 0 and c.direct_us > 0 for c in calls)
    assert all((c.reshape_us is None) == (c.query_form == "packed") for c in calls)
    steps = bench_gpu.measure_decode_step(
        registry, cpu, batches=(2,), num_heads=16, max_seq_len=256, layers=3, runs=2, warmup=1
    )
    assert steps[0].plans_per_step == 1 and steps[0].graph_step_us is None and steps[0].noise_layer_us is not None
    assert steps[0].graph_note.startswith("skipped: graph mode failed: ")
    memory = bench_gpu.measure_memory(registry, [MLAShape(1, 16, 1024)], FakeProber())  # type: ignore[arg-type]
    assert (memory[0].minimum_bytes, memory[0].rule_bytes, memory[0].run_at_rule) == (H200_NEED, H200_NEED, None)
    assert registry.stats("flashinfer_mla", device="cpu").capacity_bytes == H200_NEED


def test_the_engine_path_reports_each_engine_or_why_not() -> None:
    """Each engine is a table of its probes, or one line saying it is not installed."""
    figures = {
        "engine_path": {
            "vLLM": {
                "version": "0.34.0",
                "rows": [
                    {"call": "MLA workspace", "path": "per layer", "own_ns": 100.0, "wspool_ns": 125.0, "ratio": 1.25}
                ],
            },
            "SGLang": {"skipped": "SGLang is not installed here"},
        }
    }
    text = format_report(figures)
    assert "(a2) engine path" in text and "SGLang: skipped (SGLang is not installed here)" in text
    assert any("MLA workspace" in line and line.rstrip().endswith("1.25x") for line in text.splitlines())


def test_the_engine_path_without_engines_skips_each() -> None:
    """Where no engine is installed, the section says so per engine and times nothing."""
    from importlib.util import find_spec

    from wspool.tools.engine_path import measure_engine_path

    if find_spec("vllm") or find_spec("sglang"):
        pytest.skip("an engine is installed here: its own tests time its probes")
    assert measure_engine_path(rounds=1, batch=1) == {
        "vLLM": {"skipped": "vLLM is not installed here"},
        "SGLang": {"skipped": "SGLang is not installed here"},
    }


@pytest.mark.parametrize(
    ("sections", "matplotlib", "blocker", "message"),
    [
        ("hot_path,memory", False, None, "--plot needs matplotlib, which is not installed: pip install matplotlib"),
        ("hot_path", True, None, "--plot draws the memory sweep, and --sections hot_path leaves it out: add memory"),
        ("memory", True, "no CUDA device", "--plot draws the memory sweep, which cannot run here (no CUDA device)"),
    ],
)
def test_plot_is_checked_before_anything_is_measured(
    sections: str,
    matplotlib: bool,
    blocker: str | None,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """bench --plot exits 2 with one line before measuring when it could not draw the plot."""
    import importlib.util

    from wspool.tools import bench

    found = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return (found(name, *args) or object()) if name != "matplotlib" else (object() if matplotlib else None)

    def measure(**kwargs: Any) -> dict[str, Any]:
        raise AssertionError("measured before the plot was checked")

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(bench, "run_benchmarks", measure)
    monkeypatch.setattr(bench, "memory_sweep_blocker", lambda: blocker)
    assert main(["bench", "--sections", sections, "--plot", "x.png"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"wspool bench: error: {message}")


def test_plot_from_figures_without_a_sweep_says_how_to_get_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--plot-from a CPU run's file names what it lacks and the command that writes it, not --plot-from again."""
    saved = tmp_path / "cpu.json"
    saved.write_text(json.dumps({"machine": {"gpu": None}, "memory": {"skipped": "no CUDA device"}}))
    assert main(["bench", "--plot-from", str(saved), "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert f"{saved} holds no memory sweep to plot (its memory section was skipped: no CUDA device" in err
    assert "wspool bench --sections memory --json FILE` on a Hopper or Ampere GPU" in err
    assert "run on a GPU or use --plot-from" not in err
