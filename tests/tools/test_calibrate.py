"""Tests for the calibration tools (calibrate, search, sweep) and the shipped rules, on the CPU with a fake kernel."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

import wspool
from tests.helpers.fake_prober import H200_SMS, FakeProber
from tests.helpers.mla_doubles import WrapperDouble, fake_flashinfer_mla
from tests.helpers.mla_inputs import make_inputs
from tests.helpers.paths import REPO_ROOT
from wspool.cli import main
from wspool.errors import ConfigError
from wspool.flashinfer import backends, mla_decode
from wspool.flashinfer import kernels as fi_kernels
from wspool.flashinfer.layouts import FA_MLA_WORKSPACE_RULE, fa_mla_float_workspace_bytes
from wspool.rules import compile_rule
from wspool.tools.calibrate import CalibrationReport, derive_rules, run_calibration
from wspool.tools.search import CalibrationError, search_min_bytes
from wspool.tools.sweep import DEFAULT_SHAPES, MLAShape, ShapeError, load_shapes, parse_shape

MiB = 1 << 20
H200_NEED = 17369088


# -- the search ----------------------------------------------------------------------------


def test_search_finds_the_exact_h200_minimum_in_a_few_probes() -> None:
    """Guided by the overflow messages, the search finds 17369088 bytes exactly in at most 6 probes."""
    shape = MLAShape(128, 128, 4096, return_lse=True)
    result = FakeProber().search(shape)
    assert result.min_bytes == H200_NEED == fa_mla_float_workspace_bytes(sm_count=132, num_heads=128, q_len=1)
    assert result.probe_count <= 6
    assert (H200_NEED, True) in result.probes and (H200_NEED - 1, False) in result.probes


@given(
    need=st.integers(1, 1 << 36),
    granularity=st.sampled_from([1, 16, 1024, 4096]),
    quarters=st.integers(0, 4),
)
def test_search_is_exact_whatever_the_messages_say(need: int, granularity: int, quarters: int) -> None:
    """Any monotone need is found exactly (to the granularity), with exact, partial or no bounds from failures."""

    def probe(nbytes: int) -> int | None:
        if nbytes >= need:
            return None
        return need * quarters // 4  # 4: the exact need, 1-3: a partial bound, 0: nothing learned

    result = search_min_bytes(probe, granularity=granularity)
    assert result.min_bytes == -(-need // granularity) * granularity
    assert result.probe_count <= (4 if quarters == 4 else 80)
    fitting = [n for n, ok in result.probes if ok]
    assert min(fitting) == result.min_bytes and all(n < result.min_bytes for n, ok in result.probes if not ok)


def test_search_grows_past_a_small_start_and_gives_up_at_the_limit() -> None:
    """A start below the need doubles up; a need beyond the limit is a CalibrationError."""
    assert search_min_bytes(lambda n: None if n >= 5000 else 0, start_bytes=1000).min_bytes == 5000
    with pytest.raises(CalibrationError, match="still overflows a 4096-byte"):
        search_min_bytes(lambda n: 0, start_bytes=1024, limit_bytes=4096)
    with pytest.raises(ValueError, match="granularity must be a positive"):
        search_min_bytes(lambda n: None, granularity=0)


# -- FlashInfer's fa2/fa3 layout and the shipped rules ----------------------------------------


@given(sm_count=st.integers(11, 200), heads=st.sampled_from([1, 8, 16, 32, 64, 128]), q_len=st.integers(1, 8))
def test_fa_rule_covers_the_carve_within_10_percent(sm_count: int, heads: int, q_len: int) -> None:
    """The shipped formula equals the carve for even SM counts and covers odd ones within 1.1x."""
    need = fa_mla_float_workspace_bytes(sm_count=sm_count, num_heads=heads, q_len=q_len)
    rule = compile_rule(FA_MLA_WORKSPACE_RULE).resolve({"sm_count": sm_count, "kv_lora_rank": 512})
    assert need <= rule <= 1.1 * need
    if sm_count % 2 == 0:
        assert rule == need


def test_hopper_config_is_the_exact_h200_need() -> None:
    """configs/hopper.yaml resolves to 17369088 bytes on 132 SMs for both rules, above the overflow's carve."""
    reg = wspool.PoolRegistry.from_config(REPO_ROOT / "configs" / "hopper.yaml")
    for shape in (MLAShape(1, 16, 1024), MLAShape(512, 128, 32768, return_lse=True)):
        assert reg.resolve("flashinfer_mla", shape.rule, **shape.facts(H200_SMS)) == H200_NEED
    assert WrapperDouble.partial_bytes < H200_NEED


def test_blackwell_config_holds_the_overflowing_slab_plus_margin() -> None:
    """configs/blackwell.yaml gives the 129MiB slab that overflows vLLM's 128MiB plus 64MiB; 64MiB without the LSE."""
    reg = wspool.PoolRegistry.from_config(REPO_ROOT / "configs" / "blackwell.yaml")
    facts = MLAShape(512, 128, 4096).facts(148)
    assert reg.resolve("flashinfer_mla", "lse", **facts) == 135266304 + 64 * MiB
    assert reg.resolve("flashinfer_mla", "default", **facts) == 64 * MiB


@pytest.fixture
def hopper_h200(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Pretend the CPU is an H200 (SM90, 132 SMs) whose FlashInfer is the wrapper double."""
    WrapperDouble.instances.clear()
    monkeypatch.setattr(backends, "device_arch", lambda device: (9, 0))
    monkeypatch.setattr(backends, "sm_count", lambda device: H200_SMS)
    monkeypatch.setattr(fi_kernels, "load_flashinfer_mla", lambda: fake_flashinfer_mla())
    yield


def test_hopper_config_serves_the_op_without_recovery(hopper_h200: None, caplog: pytest.LogCaptureFixture) -> None:
    """The op's facts resolve the Hopper rule: one exact allocation, no overflow recovery, no warning."""
    reg = wspool.PoolRegistry.from_config(REPO_ROOT / "configs" / "hopper.yaml")
    inputs = make_inputs(3, 16, [70, 1, 128])
    with caplog.at_level(logging.WARNING, logger="wspool"):
        mla_decode(
            inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, inputs.max_seq_len,
            sm_scale=inputs.sm_scale, return_lse=True, registry=reg,
        )  # fmt: skip
    stats = reg.stats("flashinfer_mla", device="cpu")
    assert (stats.capacity_bytes, stats.grow_count) == (H200_NEED, 1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# -- deriving the rules --------------------------------------------------------------------------


def _measured(*rows: tuple[MLAShape, int], sm_count: int = H200_SMS) -> list[tuple[MLAShape, dict[str, int], int]]:
    return [(shape, shape.facts(sm_count), need) for shape, need in rows]


def test_derive_prefers_a_formula_that_fits() -> None:
    """When the formula covers every minimum within the ratio, it is the rule for each rule name."""
    rules = derive_rules(
        _measured((MLAShape(1, 16, 1024), H200_NEED), (MLAShape(8, 128, 4096, return_lse=True), H200_NEED))
    )
    assert list(rules) == ["default", "lse"]
    for rule in rules.values():
        assert (rule.source, rule.how, rule.worst_ratio, rule.shapes) == (FA_MLA_WORKSPACE_RULE, "formula", 1.0, 1)


def test_derive_falls_back_to_the_peak() -> None:
    """A formula that underestimates any shape, or wastes more than the ratio, gives way to the peak."""
    small, big = MLAShape(1, 16, 1024), MLAShape(512, 16, 1024)
    under = derive_rules(_measured((small, H200_NEED), (big, H200_NEED + 100)))["default"]
    assert (under.source, under.how, under.peak_bytes) == (str(H200_NEED + 100), "peak", H200_NEED + 100)
    wasteful = derive_rules(_measured((small, H200_NEED // 2)))["default"]
    assert wasteful.how == "peak" and wasteful.source == str(H200_NEED // 2)
    unknown_fact = derive_rules(_measured((small, 1000)), candidates=("sm_count * warp_size",))["default"]
    assert unknown_fact.how == "peak"


# -- a whole calibration, its table and its rules file ----------------------------------------------


def test_calibration_writes_a_loadable_rules_file(tmp_path: Path) -> None:
    """A run over shapes gives the formula, a table, and a YAML file the registry loads with the same sizes."""
    shapes = [MLAShape(1, 16, 1024), MLAShape(128, 128, 4096, return_lse=True), MLAShape(64, 128, 4096, q_len=4)]
    prober = FakeProber()
    report = run_calibration(shapes, prober)
    assert report.ok and [m.min_bytes for m in report.measurements] == [H200_NEED] * 3
    assert {(s, n) for s, n in prober.verified} == {(s, H200_NEED) for s in shapes}
    path = tmp_path / "rules.yaml"
    path.write_text(report.rules_yaml())
    reg = wspool.PoolRegistry.from_config(path)
    for m in report.measurements:
        assert reg.resolve("flashinfer_mla", m.shape.rule, **m.facts) == m.rule_bytes == m.min_bytes
    text = path.read_text()
    assert text.startswith("# Rules for the flashinfer_mla pool, measured by `wspool calibrate`.")
    assert "device: Fake H200 (132 SMs); FlashInfer 0.7.2.post1" in text and f"date: {report.date}" in text
    assert (
        "| B=128 H=128 L=4096 q=1 lse | 17369088 (16.56MiB) | 17369088 (16.56MiB) | 1.000 | 256MiB | 15.5 | ok |"
        in text
    )
    data = json.loads(json.dumps(report.as_dict()))
    assert data["shapes"][1]["constant_bytes"] == 256 * MiB and data["rules"]["lse"]["how"] == "formula"


def test_calibration_reports_failed_runs_and_peaks() -> None:
    """A shape that needs more than the formula gets a peak rule; a failed run marks the report not ok."""
    shapes = [MLAShape(1, 16, 1024), MLAShape(256, 16, 1024)]
    report = run_calibration(shapes, FakeProber(extra=4096))
    assert report.rules["default"].how == "peak" and report.rules["default"].peak_bytes == H200_NEED + 4096
    assert report.ok
    failing = run_calibration(shapes[:1], FakeProber(fail_verify="lse differs"))
    assert not failing.ok and "FAILED: lse differs" in failing.table()
    with pytest.raises(CalibrationError, match="no shapes"):
        run_calibration([], FakeProber())


def test_report_literal_rule_is_an_integer_in_yaml() -> None:
    """A peak rule is written as a plain integer of bytes."""
    report = CalibrationReport(machine={}, measurements=[], rules=derive_rules(_measured((MLAShape(1, 16, 1024), 123))))
    assert yaml.safe_load(report.rules_yaml())["pools"]["flashinfer_mla"]["rules"] == {"default": 123}


# -- shapes ---------------------------------------------------------------------------------------


def test_default_sweep_spans_the_issue_ranges() -> None:
    """The built-in sweep has at least 20 shapes over batch 1..512, heads 16..128, 1K..32K, with and without LSE."""
    assert len(DEFAULT_SHAPES) >= 20 and len(set(DEFAULT_SHAPES)) == len(DEFAULT_SHAPES)
    assert {s.batch_size for s in DEFAULT_SHAPES} >= {1, 512}
    assert {s.num_heads for s in DEFAULT_SHAPES} >= {16, 128}
    assert {s.max_seq_len for s in DEFAULT_SHAPES} >= {1024, 32768}
    assert {s.return_lse for s in DEFAULT_SHAPES} == {False, True}


def test_parse_shape_flags() -> None:
    """--shape takes full names or aliases, and a bare lse."""
    assert parse_shape("batch_size=8,num_heads=128,max_seq_len=4096,lse") == MLAShape(8, 128, 4096, return_lse=True)
    assert parse_shape("b=1, h=16, l=0x400, q=2, lse=false") == MLAShape(1, 16, 1024, q_len=2)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("batch_size=8,num_heads=128", "missing max_seq_len"),
        ("b=0,h=16,l=1024", "batch_size must be a positive integer, got 0"),
        ("b=1,h=16,l=1024,heads_per_gpu=2", "unknown key 'heads_per_gpu'"),
        ("b=1,h=16,l=1024,lse=maybe", "return_lse must be true or false"),
        ("b=1,h=sixteen,l=1024", "num_heads must be a positive integer"),
    ],
)
def test_bad_shape_flags(text: str, match: str) -> None:
    """A malformed --shape is a ShapeError naming the flag and the key."""
    with pytest.raises(ShapeError, match=match):
        parse_shape(text)


def test_load_shapes_file(tmp_path: Path) -> None:
    """A YAML shapes file gives its shapes; a bad one names the file and the entry."""
    path = tmp_path / "shapes.yaml"
    path.write_text("shapes:\n  - {batch_size: 1, num_heads: 128, max_seq_len: 4096, return_lse: true}\n")
    assert load_shapes(path) == [MLAShape(1, 128, 4096, return_lse=True)]
    path.write_text("shapes:\n  - {batch_size: 1, num_heads: 128}\n")
    with pytest.raises(ShapeError, match=r"shapes\[0\]: missing max_seq_len"):
        load_shapes(path)
    path.write_text("shape: []\n")
    with pytest.raises(ShapeError, match="must hold 'shapes:'"):
        load_shapes(path)
    with pytest.raises(ShapeError, match=r"shapes file .*missing\.yaml does not exist or is not a file"):
        load_shapes(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("shapes: !!timestamp x\n", r"invalid YAML in shapes file .*s\.yaml:1:9: cannot read 'x' as timestamp"),
        ("shapes: 2021-13-45\n", r"s\.yaml:1:9: cannot read '2021-13-45' as timestamp"),
        ("shapes:\n  - {b: 1, h: 16, l: 1024, b: 2}\n", r"s\.yaml:2:28: duplicate key 'b' \(first given on line 2\)"),
        ("shapes: !!python/object/apply:os.system ['true']\n", r"invalid YAML in shapes file"),
    ],
    ids=["bad-tag", "bad-date", "duplicate-key", "python-tag"],
)
def test_a_shapes_file_is_read_by_the_strict_loader(tmp_path: Path, text: str, match: str) -> None:
    """A shapes file is read as a configuration is: a ShapeError (a ConfigError), never a crash."""
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(ShapeError, match=match) as info:
        load_shapes(path)
    assert isinstance(info.value, ConfigError)


# -- the command -----------------------------------------------------------------------------------


def test_calibrate_on_cpu_exits_2_with_one_line() -> None:
    """Without a GPU, calibrate says it needs one, on one line, with exit status 2."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WSPOOL_")}
    result = subprocess.run(
        [sys.executable, "-m", "wspool", "calibrate"],
        capture_output=True,
        text=True,
        env={**clean, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("wspool calibrate: error: needs a CUDA GPU")


def test_calibrate_bad_shape_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed --shape is a usage error before anything is measured."""
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--shape", "b=1"])
    assert info.value.code == 2
    assert "missing num_heads, max_seq_len" in capsys.readouterr().err


def test_probe_refuses_blackwell(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe will not measure trtllm-gen, whose scratch is not bounds-checked."""
    from wspool.tools.mla_probe import MLAWorkspaceProbe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "device_arch", lambda device: (10, 0))
    with pytest.raises(CalibrationError, match=r"cannot measure trtllm-gen.*--config blackwell"):
        MLAWorkspaceProbe(torch.device("cuda", 0))


def test_calibrate_command_writes_its_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """calibrate prints the table and writes the rules, table and JSON files (with the fake prober)."""
    import wspool.tools.mla_probe as probe_module

    monkeypatch.setattr(probe_module, "MLAWorkspaceProbe", lambda device, backend: FakeProber())
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text("shapes:\n  - {b: 1, h: 16, l: 1024}\n")
    out, table, data = tmp_path / "hopper.yaml", tmp_path / "table.md", tmp_path / "c.json"
    args = ["calibrate", "--shapes", str(shapes), "--shape", "b=512,h=128,l=32768,lse", "--out", str(out)]
    assert main([*args, "--table", str(table), "--json", str(data), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "| B=1 H=16 L=1024 q=1 | 17369088" in printed and f"wrote {out}" in printed
    assert f"rule lse: {FA_MLA_WORKSPACE_RULE}  (formula; peak minimum 17369088 bytes (16.56MiB)" in printed
    assert wspool.PoolRegistry.from_config(out).spec("flashinfer_mla").rules["lse"].source == FA_MLA_WORKSPACE_RULE
    assert table.read_text().startswith("| shape | minimum |")
    assert len(json.loads(data.read_text())["shapes"]) == 2
    monkeypatch.setattr(probe_module, "MLAWorkspaceProbe", lambda device, backend: FakeProber(fail_verify="bad"))
    assert main(["calibrate", "--shape", "b=1,h=16,l=1024", "--quiet"]) == 1
    assert "1 shape(s) failed: B=1 H=16 L=1024 q=1" in capsys.readouterr().err


def test_probe_code_runs_against_the_wrapper_double(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's plan/run calls, search and guarded verification work against FlashInfer's wrapper double."""
    from wspool.tools.mla_probe import MLAWorkspaceProbe

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    WrapperDouble.instances.clear()
    probe = object.__new__(MLAWorkspaceProbe)
    cpu = torch.device("cpu")
    probe.__dict__.update(
        device=cpu, path="auto", sm_count=H200_SMS, _fi=fake_flashinfer_mla(), _kv_pages=64,
        _generator=torch.Generator().manual_seed(0), _buffer=torch.zeros(0, dtype=torch.uint8),
        _roomy=None, _kv={}, _metadata={},
    )  # fmt: skip
    shape = MLAShape(2, 16, 200, return_lse=True)
    result = probe.search(shape)
    assert result.min_bytes == WrapperDouble.partial_bytes and result.probe_count <= 4
    assert probe.verify(shape, result.min_bytes) is None
    assert probe.verify(MLAShape(3, 8, 100, q_len=2), H200_NEED) is None
    assert probe.verify(shape, result.min_bytes - 1).startswith("RuntimeError: Error in function 'aligned_alloc'")
    planned = [w.planned for w in WrapperDouble.instances if w.planned is not None]
    assert planned[0]["lse_mode"] == "basee" and planned[0]["num_heads"] == 16 and not planned[0]["causal"]
    assert planned[-1]["causal"]  # the q_len=2 shape of the second verify
