"""Tests for wspool.integrations.sglang's logic on the CPU, without SGLang.

The integration's entry points (``register`` through SGLang's own plugin
loader, the patched ``get_buffer``, the constructors and the graph capture)
are tested against the real SGLang 0.5.23 in ``test_sglang.py``. Here the
same logic runs where SGLang is not installed: the serving of each name, the
wrappers around stand-in originals, the switches, and the shipped file.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

import wspool
from tests.helpers.paths import REPO_ROOT
from wspool.errors import ConfigError, RuleError, WorkspaceFrozenError
from wspool.integrations import sglang as sg
from wspool.integrations.sglang import facts as sf

MiB = 1 << 20
CPU = torch.device("cpu")

# What SGLang 0.5.23 allocates for each name, as its factories do (sizes scaled down to MiB).
FACTORY_DTYPES = {
    "flashinfer_workspace": torch.uint8,
    "flashinfer_mla_workspace": torch.uint8,
    "trtllm_mla_zero_workspace": torch.int8,
    "trtllm_mha_zero_workspace": torch.uint8,
    "dsa_flashinfer_sparse_mla_workspace": torch.uint8,
    "dsa_trtllm_workspace": torch.uint8,
    "trtllm_dsv4_zero_workspace": torch.int8,
}

# SGLang's module globals that the cute-dsl path reads; _constructor finds them in this module.
DEFAULT_WORKSPACE_SIZE_MB = 3
global_cute_dsl_workspace_buffer: torch.Tensor | None = None


@pytest.fixture(autouse=True)
def on_cpu() -> Iterator[None]:
    """Point the integration at the CPU, as WSPOOL_SGLANG_DEVICE=cpu does; forget every setting after."""
    sg.configure(device="cpu")
    yield
    sg.unregister()


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """The integration's log lines, from INFO up."""
    caplog.set_level(logging.INFO, logger=sg.logger.name)
    return caplog


def _factory(name: str, nbytes: int, made: list[str] | None = None) -> Any:
    """A factory shaped like SGLang's for ``name``: a flat buffer on "cuda" (no GPU needed to probe it)."""

    def factory() -> torch.Tensor:
        tensor = torch.empty(nbytes // FACTORY_DTYPES[name].itemsize, dtype=FACTORY_DTYPES[name], device="cuda")
        if made is not None:
            made.append(type(tensor).__name__)
        return tensor

    return factory


def _own(name: str) -> Any:
    raise AssertionError(f"SGLang's own get_buffer was called for {name}")


def _serve(name: str, nbytes: int) -> torch.Tensor:
    return sg.serve(name, _factory(name, nbytes), lambda: _own(name))  # type: ignore[no-any-return]


def test_other_names_get_exactly_sglangs_own_object() -> None:
    """A name that is not a workspace reaches SGLang's get_buffer; its factory is not touched."""
    mine = torch.ones(3)
    assert sg.serve("trtllm_mha_default_kv_scale", lambda: pytest.fail("factory called"), lambda: mine) is mine
    assert wspool.get_registry().peek_state(sg.buffers.SglangPools) is None


@pytest.mark.parametrize("name", sorted(FACTORY_DTYPES))
def test_each_workspace_comes_from_its_pool(name: str) -> None:
    """Each name: its pool's zero-filled buffer, the factory's dtype and size, the same tensor again."""
    made: list[str] = []
    got = sg.serve(name, _factory(name, 2 * MiB, made), lambda: _own(name))
    w = sg.BUFFERS[name]
    registry = wspool.get_registry()
    pool = registry.pool(w.pool, CPU)
    assert made == ["FakeTensor"]  # the factory ran under the fake-tensor mode only
    assert (got.dtype, got.numel(), got.device) == (FACTORY_DTYPES[name], 2 * MiB, CPU)
    assert got.data_ptr() == pool.buffer.data_ptr() and not got.any()  # type: ignore[union-attr]
    stats = registry.stats(w.pool, CPU)
    assert (stats.capacity_bytes, stats.grow_count, stats.requests_by_rule[w.rule]) == (2 * MiB, 1, 1)
    assert sg.serve(name, _factory(name, 2 * MiB), lambda: _own(name)) is got


def test_float_workspaces_share_one_buffer_and_zeroed_ones_do_not() -> None:
    """flashinfer_workspace and the MLA workspace share flashinfer_mla's buffer; trtllm's stay apart."""
    paged = _serve("flashinfer_workspace", 2 * MiB)
    mla = _serve("flashinfer_mla_workspace", 1 * MiB)
    assert mla.data_ptr() == paged.data_ptr() and mla.numel() == 2 * MiB
    zeroed = [_serve(n, MiB) for n in ("trtllm_mla_zero_workspace", "trtllm_mha_zero_workspace")]
    assert len({t.data_ptr() for t in (paged, *zeroed)}) == 3


def test_a_zeroed_workspace_refuses_a_shared_buffer() -> None:
    """Configuring a zeroed workspace's pool to share another's buffer is a ConfigError naming the key."""
    pools = {"scratch": {"rules": {"x": "1MiB"}}, "sglang_trtllm_mha": {"shared_with": "scratch"}}
    wspool.set_registry(wspool.PoolRegistry.from_config(pools=pools))
    expected = (
        r"counters in it, which pool 'scratch' would overwrite; set pools\.sglang_trtllm_mha\.shared_with / "
        r"WSPOOL_POOLS__SGLANG_TRTLLM_MHA__SHARED_WITH empty"
    )
    with pytest.raises(ConfigError, match=expected):
        _serve("trtllm_mha_zero_workspace", MiB)


def test_a_rule_reads_the_runner_being_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """A configured expression sees the constructor's runner; a fact SGLang does not give is named."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_MLA__RULES__SGLANG_MLA", "num_heads * kv_lora_rank * batch_size")
    runner = SimpleNamespace(model_config=SimpleNamespace(num_attention_heads=16, kv_lora_rank=512))
    runner.max_running_requests = 64
    with sf.building(runner):
        got = _serve("flashinfer_mla_workspace", 8 * MiB)
    assert got.numel() == 16 * 512 * 64
    wspool.reset_registry()
    with pytest.raises(RuleError, match=r"flashinfer_mla_workspace the integration passes .*sglang_bytes=8388608.*"
                       r"unknown here: num_heads.*kv_lora_rank"):  # fmt: skip
        _serve("flashinfer_mla_workspace", 8 * MiB)


def test_a_smaller_rule_is_served_and_logged(monkeypatch: pytest.MonkeyPatch, log: pytest.LogCaptureFixture) -> None:
    """SGLang's variable sets the rule; below what SGLang allocates, a warning names the key to raise."""
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", str(MiB))
    assert _serve("flashinfer_workspace", 2 * MiB).numel() == MiB
    assert "less than the 2MiB SGLang allocates here; raise it (WSPOOL_POOLS__FLASHINFER__RULES__SGLANG)" in log.text
    log.clear()
    _serve("trtllm_mla_zero_workspace", MiB)
    assert "SGLang's trtllm_mla_zero_workspace is 1MiB of pool sglang_trtllm_mla" in log.text


def test_deterministic_inference_uses_its_own_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """While SGLang runs deterministic inference, flashinfer_workspace follows SGLang, not the variable."""
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", str(MiB))
    sg.configure(device="cpu", deterministic=lambda: True)
    assert _serve("flashinfer_workspace", 4 * MiB).numel() == 4 * MiB
    assert wspool.get_registry().stats("flashinfer", CPU).requests_by_rule == {"sglang_deterministic": 1}


def test_lanes_and_growth() -> None:
    """Another lane is another buffer; a larger request grows the pool and a new view follows."""
    main = _serve("dsa_trtllm_workspace", MiB)
    with wspool.lane("other"):
        other = _serve("dsa_trtllm_workspace", MiB)
    assert other.data_ptr() != main.data_ptr()
    grown = _serve("dsa_trtllm_workspace", 2 * MiB)
    assert grown is not main and grown.numel() == 2 * MiB


def test_frozen_registry_serves_what_fits_and_refuses_growth() -> None:
    """After a freeze the same request is served; one that needs more raises, naming the pool."""
    got = _serve("trtllm_dsv4_zero_workspace", MiB)
    wspool.get_registry().freeze()
    assert _serve("trtllm_dsv4_zero_workspace", MiB) is got
    with pytest.raises(WorkspaceFrozenError, match="sglang_trtllm_dsv4"):
        _serve("trtllm_dsv4_zero_workspace", 2 * MiB)


def test_unforeseen_factories_stay_sglangs_own(log: pytest.LogCaptureFixture) -> None:
    """A factory that cannot be probed, or makes no flat byte buffer, gets SGLang's own, said once."""
    mine = torch.zeros(4)

    def broken() -> torch.Tensor:
        raise RuntimeError("needs a real device")

    assert sg.serve("flashinfer_workspace", broken, lambda: mine) is mine
    assert sg.serve("flashinfer_workspace", broken, lambda: mine) is mine
    assert log.text.count("flashinfer_workspace stays SGLang's own: its factory cannot be sized") == 1
    wide = lambda: torch.empty((2, 8), dtype=torch.float16)  # noqa: E731
    assert sg.serve("dsa_trtllm_workspace", wide, lambda: mine) is mine
    assert "dsa_trtllm_workspace stays SGLang's own: it is torch.float16 [2, 8]" in log.text


class _Parent:
    """Stands in for FlashInferMLAAttnBackend: asks for its workspace in its constructor."""

    def __init__(self, model_runner: Any, skip_prefill: bool = False) -> None:
        self.workspace = _serve("flashinfer_mla_workspace", 4 * MiB)
        self.facts = sf.current_facts()


class _CuteDsl(_Parent):
    """Stands in for TRTLLMMLABackend: its parent's constructor first, then the module global."""

    def __init__(self, model_runner: Any, skip_prefill: bool = False, backend: str = "trtllm-gen") -> None:
        super().__init__(model_runner, skip_prefill)
        self.cute = global_cute_dsl_workspace_buffer if backend == "cute-dsl" else None


class _Paged:
    """Stands in for FlashInferAttnBackend: init_new_workspace=True is SGLang's own torch.empty."""

    def __init__(self, model_runner: Any, init_new_workspace: bool = False) -> None:
        if init_new_workspace:
            raise AssertionError("SGLang's own torch.empty path was taken")
        self.lane = wspool.current_lane()
        self.workspace = _serve("flashinfer_workspace", MiB)


@pytest.fixture
def wrapped(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The stand-ins' constructors wrapped as register() wraps SGLang's."""
    monkeypatch.setattr(_Parent, "__init__", sg.buffers.wrap_constructor(_Parent.__init__))
    monkeypatch.setattr(_CuteDsl, "__init__", sg.buffers.wrap_constructor(_CuteDsl.__init__, cute_dsl=True))
    monkeypatch.setattr(_Paged, "__init__", sg.buffers.wrap_constructor(_Paged.__init__, new_workspace=True))
    yield
    monkeypatch.setattr(sys.modules[__name__], "global_cute_dsl_workspace_buffer", None)


def _runner() -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(num_attention_heads=8), device="cpu")


def test_constructors_give_their_runners_facts(wrapped: None) -> None:
    """Inside a wrapped constructor the rules see its runner; positional or keyword, the same."""
    assert _Parent(_runner()).facts["num_heads"] == 8
    assert _Parent(model_runner=_runner(), skip_prefill=True).facts["num_heads"] == 8


def test_init_new_workspace_gets_a_lane_of_its_own(wrapped: None) -> None:
    """init_new_workspace=True runs SGLang's shared path in a new lane: a buffer no other backend has."""
    shared = _Paged(_runner())
    first, second = _Paged(_runner(), init_new_workspace=True), _Paged(_runner(), True)
    assert shared.lane == "main" and first.lane.startswith("sglang-new-workspace-") and first.lane != second.lane
    assert len({b.workspace.data_ptr() for b in (shared, first, second)}) == 3


def test_cute_dsl_buffer_follows_its_parents_workspace(wrapped: None) -> None:
    """The cute-dsl global is set after the parent's MLA workspace, so the shared pool grows once."""
    backend = _CuteDsl(_runner(), backend="cute-dsl")
    stats = wspool.get_registry().stats("flashinfer_mla", CPU)
    assert backend.cute is not None and backend.cute.dtype == torch.int8
    assert backend.cute.data_ptr() == backend.workspace.data_ptr() and backend.cute.numel() == 4 * MiB
    assert (stats.grow_count, stats.requests_by_rule["sglang_cute_dsl"]) == (1, 1)
    assert _CuteDsl(_runner(), backend="cute-dsl").cute is backend.cute  # SGLang's lazy global, set once
    assert _CuteDsl(_runner()).cute is None


def test_capture_freezes_and_constructors_may_still_grow(wrapped: None) -> None:
    """A capture leaves the registry frozen; a backend built after it may grow pools, nothing else may."""
    registry = wspool.get_registry()
    seen: list[bool] = []
    capture = sg.buffers.wrap_capture(lambda runner: seen.append(registry.is_frozen))
    _Paged(_runner())
    capture(object())
    assert seen == [False] and registry.is_frozen
    assert _Parent(_runner()).workspace.numel() == 4 * MiB  # grew the shared pool inside the constructor
    assert registry.is_frozen
    with pytest.raises(WorkspaceFrozenError):
        _serve("flashinfer_workspace", 8 * MiB)
    capture(object())  # a recapture: growth allowed while it runs, frozen after
    assert seen == [False, False] and registry.is_frozen


def test_a_failed_capture_still_freezes() -> None:
    """Graphs captured before the failure may replay: the registry is frozen whatever the capture did."""

    def fails(runner: object) -> None:
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        sg.buffers.wrap_capture(fails)(object())
    assert wspool.get_registry().is_frozen


def test_register_without_sglang_patches_nothing(log: pytest.LogCaptureFixture) -> None:
    """Where SGLang is not installed, loading warns once, says so with the versions supported, and patches nothing."""
    if "sglang" in sys.modules or _importable("sglang"):
        pytest.skip("SGLang is installed here; test_sglang.py tests a missing target against it")
    sg.register()
    assert sg.patched() == []
    warnings = [r for r in log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "SGLang is not installed (wspool supports >=0.5.23,<0.5.24); nothing patched" in warnings[0].getMessage()


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.parametrize(
    ("env", "value", "message"),
    [
        ("WSPOOL_SGLANG", "maybe", "invalid environment variable WSPOOL_SGLANG = 'maybe': expected 1 or 0"),
        ("WSPOOL_SGLANG_DEVICE", "gpu0", "invalid environment variable WSPOOL_SGLANG_DEVICE = 'gpu0': not a device"),
        ("WSPOOL_POOLS__FLASHINFER__RULES__SGLANG", "12 parsecs", r"pools\.flashinfer\.rules\.sglang"),
    ],
)
def test_bad_settings_load_nothing_and_name_the_setting(
    monkeypatch: pytest.MonkeyPatch, log: pytest.LogCaptureFixture, env: str, value: str, message: str
) -> None:
    """A bad switch, device or rule is one error naming the setting; SGLang keeps its own workspaces."""
    monkeypatch.setenv(env, value)
    sg.register()
    assert sg.patched() == []
    errors = [r.getMessage() for r in log.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "SGLang's own workspaces stay in use" in errors[0]
    assert re.search(message, errors[0]), errors[0]


def test_switch_off_loads_nothing(monkeypatch: pytest.MonkeyPatch, log: pytest.LogCaptureFixture) -> None:
    """WSPOOL_SGLANG=0: an info line, nothing patched, and the variable is no unknown wspool setting."""
    monkeypatch.setenv("WSPOOL_SGLANG", "0")
    monkeypatch.setenv("WSPOOL_SGLANG_DEVICE", "cpu")
    sg.register()
    assert sg.patched() == [] and "WSPOOL_SGLANG=0" in log.text
    wspool.load_settings()  # both variables are known to the configuration's spelling check


def test_configs_sglang_yaml_writes_out_the_declared_rules() -> None:
    """configs/sglang.yaml is the integration's declared rules, shipped as package data, and loads."""
    data = yaml.safe_load((Path(REPO_ROOT) / "configs" / "sglang.yaml").read_text())
    assert {pool: config["rules"] for pool, config in data["pools"].items()} == sg.SGLANG_POOLS
    shipped = resources.files("wspool").joinpath("data", "configs", "sglang.yaml")
    assert shipped.read_text() == (Path(REPO_ROOT) / "configs" / "sglang.yaml").read_text()
    with resources.as_file(shipped) as path:
        registry = wspool.PoolRegistry.from_config(path)
    assert registry.resolve("sglang_dsa_trtllm", sglang_bytes=3 * MiB) == 3 * MiB
    assert registry.buffer_pool("flashinfer") == "flashinfer_mla"
