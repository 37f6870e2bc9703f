"""Tests for wspool.integrations.tokenspeed inside the real TokenSpeed 0.1.1, loaded by TokenSpeed's own plugin loader.

Every test needs TokenSpeed and skips, with the reason, where it is not
installed; on a host without a GPU the stand-ins of
tests/helpers/tokenspeed_cpu.py let it import. Run them with

    .ci/engine-envs tokenspeed && .venv-tokenspeed/bin/python -m pytest -q tests/integrations/test_tokenspeed.py

TokenSpeed's backends are built on the CPU through their own constructors;
only FlashInfer's wrappers (which pin host memory, impossible without a GPU)
and the SM count query of the cute-dsl backend are stood in for, per test.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import wspool
from tests.helpers.sglang_model import TINY_LLAMA
from tests.helpers.tokenspeed_cpu import SM100_SM_COUNT
from wspool.errors import RuleError, WorkspaceFrozenError
from wspool.integrations import tokenspeed
from wspool.integrations.tokenspeed import buffers
from wspool.settings.schema import load_settings_with_provenance

MiB = 1 << 20
CPU = torch.device("cpu")
TARGET_NAMES = [target.name for target in tokenspeed.TARGETS]
LOGGER = "wspool.integrations.tokenspeed"
SCRATCH_ON_DSA = """\
pools:
  tokenspeed_dsa:
    rules: {default: tokenspeed_bytes}
  tokenspeed_scratch:
    shared_with: tokenspeed_dsa
    rules: {block: tokenspeed_bytes, trtllm_mha: tokenspeed_bytes}
"""


class TokenSpeed(SimpleNamespace):
    """The real TokenSpeed modules the tests call, and TokenSpeed's own WorkspacePool class."""


@pytest.fixture(scope="module")
def ts(tokenspeed_on_cpu: bool) -> TokenSpeed:
    """TokenSpeed's modules, imported behind the stand-ins; skips where TokenSpeed 0.1.1 is not installed."""
    names = {
        "plugins": "tokenspeed.runtime.plugins",
        "recorder": "tokenspeed.runtime.plugins.registry",
        "workspace": "tokenspeed.runtime.execution.workspace",
        "trtllm": "tokenspeed.runtime.layers.attention.backends.paged.trtllm",
        "trtllm_mla": "tokenspeed.runtime.layers.attention.backends.paged.trtllm_mla",
        "flashmla": "tokenspeed.runtime.layers.attention.backends.paged.flashmla",
        "cute_dsl": "tokenspeed.runtime.layers.attention.backends.paged.tokenspeed_mla",
        "dsa": "tokenspeed_kernel.ops.attention.dsa.flashinfer",
        "configs": "tokenspeed.runtime.layers.attention.configs.base",
        "mha_configs": "tokenspeed.runtime.layers.attention.configs.mha",
        "mla_configs": "tokenspeed.runtime.layers.attention.configs.mla",
        "model_config": "tokenspeed.runtime.configs.model_config",
        "server_args": "tokenspeed.runtime.utils.server_args",
        "sampling": "tokenspeed.runtime.sampling.backends.triton",
        "sampling_base": "tokenspeed.runtime.sampling.backends.base",
    }
    modules = {key: importlib.import_module(module) for key, module in names.items()}
    assert tokenspeed.patched() == [], "wspool was loaded into TokenSpeed before the tests"
    return TokenSpeed(**modules, own_pool_class=modules["workspace"].WorkspacePool)


@pytest.fixture(autouse=True)
def fresh_loader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with TokenSpeed's plugin loader not yet run and wspool not loaded, and ends so."""
    if "ts" not in request.fixturenames:
        yield
        return
    ts: TokenSpeed = request.getfixturevalue("ts")
    monkeypatch.setattr(ts.plugins, "_loaded", False)
    monkeypatch.setattr(ts.plugins, "_loaded_plugins", {})
    try:
        yield
    finally:
        tokenspeed.unregister()
        ts.workspace.reset_workspace_pools()
        assert ts.workspace.WorkspacePool is ts.own_pool_class


def _model_config(ts: TokenSpeed, directory: Path) -> Any:
    """Build TokenSpeed's ModelConfig for a one-layer Llama; its constructor runs the plugin loader first."""
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    args = ts.server_args.ServerArgs(model=str(directory), device="cpu", skip_tokenizer_init=True)
    return ts.model_config.ModelConfig(str(directory), server_args=args, model_override_args="{}")


def _attn_config(ts: TokenSpeed, spec: Any) -> Any:
    return ts.configs.AttnConfig(
        device="cpu", dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16, kv_cache_quant_method="none",
        prefix_granularity=64, context_len=1024, max_bs=8, components=(spec,),
    )  # fmt: skip


def _mha_spec(ts: TokenSpeed) -> Any:
    return ts.mha_configs.MHAConfig(num_attention_heads=8, num_kv_heads=2, head_dim=128, attn_tp_size=1)


def _mla_spec(ts: TokenSpeed) -> Any:
    return ts.mla_configs.MLAConfig(
        num_attention_heads=2, num_kv_heads=1, head_dim=576, attn_tp_size=1, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, scaling=0.1, kv_cache_dim=576,
    )  # fmt: skip


def _buffer(pool: str, device: torch.device = CPU) -> torch.Tensor:
    found = wspool.get_registry().pool(pool, device).buffer
    assert found is not None, f"pool {pool} has no buffer on {device}"
    return found


def _within(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= view.data_ptr() and view.data_ptr() + view.numel() * view.element_size() <= start + buffer.numel()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= level]


# -- loading ------------------------------------------------------------------------------------


def test_tokenspeeds_loader_loads_wspool_through_model_config(ts: TokenSpeed, tmp_path: Path) -> None:
    """Building a ModelConfig runs TokenSpeed's loader, which loads wspool and records its five patches."""
    _model_config(ts, tmp_path)
    (info,) = [p for p in ts.plugins.list_plugins() if p.name == "wspool"]
    assert info.registrations == (("wspool", tuple(TARGET_NAMES)),)
    assert tokenspeed.patched() == TARGET_NAMES
    assert ts.workspace.WorkspacePool is buffers.ServedWorkspacePool


def test_tokenspeed_undoes_wspools_patches_when_the_registration_fails(ts: TokenSpeed) -> None:
    """The patches are reported through record_external: a registration that fails after them takes them back."""
    with pytest.raises(RuntimeError, match="a later registration failed"), ts.recorder.recording() as record:
        tokenspeed.register()
        assert tokenspeed.patched() == TARGET_NAMES
        raise RuntimeError("a later registration failed")
    assert record.names == {"wspool": TARGET_NAMES}
    assert tokenspeed.patched() == []
    assert ts.workspace.WorkspacePool is ts.own_pool_class
    assert ts.dsa._get_dsa_sparse_workspace is not buffers.dsa_workspace


def test_loading_twice_patches_once(ts: TokenSpeed, caplog: pytest.LogCaptureFixture) -> None:
    """A second register() patches nothing more and says nothing more at INFO."""
    with caplog.at_level(logging.INFO, logger=LOGGER):
        tokenspeed.register()
        tokenspeed.register()
    assert tokenspeed.patched() == TARGET_NAMES
    assert [line for line in _lines(caplog, logging.INFO) if "targets patched" in line] == [
        "wspool: TokenSpeed 0.1.1: 6 targets patched; config: built-in defaults; profile auto"
    ]


def test_disable_plugins_leaves_tokenspeed_untouched(
    ts: TokenSpeed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TOKENSPEED_DISABLE_PLUGINS=wspool: TokenSpeed's loader skips wspool, and nothing is patched."""
    monkeypatch.setenv("TOKENSPEED_DISABLE_PLUGINS", "wspool")
    _model_config(ts, tmp_path)
    assert "wspool" not in [p.name for p in ts.plugins.list_plugins()]
    assert tokenspeed.patched() == []
    assert ts.workspace.WorkspacePool is ts.own_pool_class


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("WSPOOL_POOLS__TOKENSPEED_DSA__RULES__DEFAULT", "lots", "WSPOOL_POOLS__TOKENSPEED_DSA__RULES__DEFAULT"),
        ("WSPOOL_CONFIG", "scratch-on-dsa.yaml", "TokenSpeed zeroes its DSA sparse MLA workspace"),
        ("TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB", "a lot", "whole number of MiB"),
        ("WSPOOL_TOKENSPEED", "maybe", "invalid environment variable WSPOOL_TOKENSPEED"),
    ],
)
def test_a_broken_configuration_leaves_tokenspeed_untouched_in_one_line(
    ts: TokenSpeed,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    variable: str,
    value: str,
    says: str,
) -> None:
    """A bad rule, a zeroed pool sharing a buffer, a bad TokenSpeed variable or switch: one line, nothing patched."""
    if value.endswith(".yaml"):  # the scratch block drawing from DSA's zeroed buffer
        (tmp_path / value).write_text(SCRATCH_ON_DSA)
        value = str(tmp_path / value)
    monkeypatch.setenv(variable, value)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _model_config(ts, tmp_path)
    assert tokenspeed.patched() == []
    assert ts.workspace.WorkspacePool is ts.own_pool_class
    (line,) = _lines(caplog, logging.WARNING)
    assert "\n" not in line
    assert line.startswith("wspool: TokenSpeed: nothing patched, TokenSpeed's own workspaces stay in use: ")
    assert says in line


def test_the_private_names_read_exist(ts: TokenSpeed) -> None:
    """Every TokenSpeed name the accessors in buffers.py read exists in the installed TokenSpeed, as read."""
    assert buffers.READ_FROM.startswith("TokenSpeed 0.1.1")
    assert sorted(buffers.ACCESSORS) == ["dsa_workspace_bytes", "flashmla_workspace"]
    for accessor, (module, name) in buffers.ACCESSORS.items():
        assert hasattr(importlib.import_module(module), name), accessor
    assert buffers.dsa_workspace_bytes() == 384 * MiB


# -- the shared block ---------------------------------------------------------------------------


def test_the_shared_block_is_a_pool_made_on_first_use_with_tokenspeeds_carve(ts: TokenSpeed) -> None:
    """workspace_pool() allocates nothing; allocate() carves non-overlapping 256-byte-aligned views of the pool."""
    tokenspeed.register()
    pool = ts.workspace.workspace_pool(CPU)
    assert isinstance(pool, buffers.ServedWorkspacePool)
    assert wspool.get_registry().stats(buffers.BLOCK.pool, CPU).capacity_bytes == 0
    ints, floats = pool.allocate(((100,), torch.int32), ((3, 5), torch.float32))
    block = _buffer(buffers.BLOCK.pool)
    assert (ints.shape, floats.shape) == ((100,), (3, 5))
    assert (ints.data_ptr() - block.data_ptr(), floats.data_ptr() - block.data_ptr()) == (0, 512)
    assert block.numel() == 768  # 400 bytes rounded to 512, then 60 bytes rounded to 256
    (again,) = pool.allocate(((16,), torch.uint8))
    assert again.data_ptr() == ints.data_ptr()  # separate calls share the same bytes


def test_an_initial_size_the_user_set_is_the_least_the_first_request_makes(
    ts: TokenSpeed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TOKENSPEED_WORKSPACE_INITIAL_MB set by the user: nothing in the constructor, that much at the first request."""
    monkeypatch.setenv("TOKENSPEED_WORKSPACE_INITIAL_MB", "1")
    tokenspeed.register()
    pool = ts.workspace.workspace_pool(CPU)
    assert wspool.get_registry().stats(buffers.BLOCK.pool, CPU).capacity_bytes == 0
    (view,) = pool.allocate(((1024,), torch.uint8))
    assert view.numel() == 1024 and _buffer(buffers.BLOCK.pool).numel() == MiB


def test_trtllm_mha_and_cute_dsl_mla_draw_from_the_block(ts: TokenSpeed, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both backends' scratch are views of pool tokenspeed_scratch; TokenSpeed's variable sizes MHA's draw."""
    monkeypatch.setenv("TOKENSPEED_WORKSPACE_TRTLLM_MHA_MB", "2")
    monkeypatch.setattr(ts.cute_dsl, "get_num_sm", lambda device: SM100_SM_COUNT)  # a CUDA device property query
    tokenspeed.register()
    mla = _mla_spec(ts)
    cute = ts.cute_dsl.CuteDSLMLABackend(_attn_config(ts, mla), mla, kernel_page_size=64)
    closed_form = SM100_SM_COUNT * 2 * 1 * 8 * (512 + 1) * 4  # SMs x heads x DCP x q_len x (latent + 1) x fp32
    assert cute.cutedsl_workspace.numel() == closed_form
    mha = ts.trtllm.TRTLLMMHAAttnBackend(_attn_config(ts, _mha_spec(ts)), _mha_spec(ts), kernel_page_size=64)
    scratch = mha.workspace_buffer  # fetched per use, as TokenSpeed's contract asks
    assert scratch.numel() == 2 * MiB
    block = _buffer(buffers.BLOCK.pool)
    assert block.numel() == max(2 * MiB, closed_form)
    assert _within(scratch, block) and _within(cute.cutedsl_workspace, block)
    assert scratch.data_ptr() == cute.cutedsl_workspace.data_ptr() == block.data_ptr()


def test_tokenspeeds_variable_wins_over_the_shipped_configuration(
    ts: TokenSpeed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the shipped configuration (a shipped default), the user's TokenSpeed variable sizes trtllm MHA's draw."""
    monkeypatch.setenv("WSPOOL_CONFIG", "tokenspeed")
    monkeypatch.setenv("TOKENSPEED_WORKSPACE_TRTLLM_MHA_MB", "512")
    tokenspeed.register()
    mha = ts.trtllm.TRTLLMMHAAttnBackend(_attn_config(ts, _mha_spec(ts)), _mha_spec(ts), kernel_page_size=64)
    assert mha.workspace_buffer.numel() == 512 * MiB
    _, provenance = load_settings_with_provenance()
    explained = provenance.explain(("pools", "tokenspeed_scratch", "rules", "trtllm_mha"))
    assert explained.startswith(
        "TokenSpeed's variable TOKENSPEED_WORKSPACE_TRTLLM_MHA_MB, over shipped configuration tokenspeed = "
    )


def test_the_users_rule_wins_over_tokenspeeds_variable_and_show_says_so(
    ts: TokenSpeed, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A rule the user's own file gives for trtllm MHA's draw wins over TokenSpeed's variable, and both are named."""
    path = tmp_path / "mine.yaml"
    path.write_text("pools:\n  tokenspeed_scratch:\n    rules:\n      trtllm_mha: 96MiB\n")
    monkeypatch.setenv("WSPOOL_CONFIG", str(path))
    monkeypatch.setenv("TOKENSPEED_WORKSPACE_TRTLLM_MHA_MB", "512")
    tokenspeed.register()
    mha = ts.trtllm.TRTLLMMHAAttnBackend(_attn_config(ts, _mha_spec(ts)), _mha_spec(ts), kernel_page_size=64)
    assert mha.workspace_buffer.numel() == 96 * MiB
    assert ts.trtllm.envs.TOKENSPEED_WORKSPACE_TRTLLM_MHA_MB.get() == 512  # TokenSpeed's variable as the user set it
    _, provenance = load_settings_with_provenance()
    explained = provenance.explain(("pools", "tokenspeed_scratch", "rules", "trtllm_mha"))
    assert explained == f"YAML file {path}, over TokenSpeed's variable TOKENSPEED_WORKSPACE_TRTLLM_MHA_MB = {512 * MiB}"


def test_a_frozen_block_refuses_to_grow_with_wspools_error(ts: TokenSpeed) -> None:
    """TokenSpeed's freeze is wspool's: growth raises WorkspaceFrozenError, a fitting request is served; and back."""
    tokenspeed.register()
    pool = ts.workspace.workspace_pool(CPU)
    pool.allocate(((1024,), torch.uint8))
    pool.freeze()
    assert wspool.get_registry().is_frozen and pool.frozen
    with pytest.raises(WorkspaceFrozenError, match=r"pool 'tokenspeed_scratch' on cpu .*while the registry is frozen"):
        pool.allocate(((4096,), torch.uint8))
    assert pool.allocate(((512,), torch.uint8))[0].numel() == 512
    pool.unfreeze()
    assert not wspool.get_registry().is_frozen
    wspool.get_registry().freeze()  # wspool's freeze is TokenSpeed's too
    assert pool.frozen
    wspool.get_registry().unfreeze()
    assert pool.allocate(((4096,), torch.uint8))[0].numel() == 4096


# -- the buffers kept apart from the block ------------------------------------------------------


def test_the_zeroed_buffers_have_pools_of_their_own_per_device(ts: TokenSpeed, monkeypatch: pytest.MonkeyPatch) -> None:
    """trtllm-gen MLA's and DSA's workspaces are zeroed, per device, and never share bytes with the block."""
    monkeypatch.setenv("TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB", "1")
    monkeypatch.setenv("WSPOOL_POOLS__TOKENSPEED_DSA__RULES__DEFAULT", "3MiB")
    tokenspeed.register()
    ts.workspace.workspace_pool(CPU).allocate(((4 * MiB,), torch.uint8))
    mla = _mla_spec(ts)
    backend = ts.trtllm_mla.TRTLLMMLABackend(_attn_config(ts, mla), mla, kernel_page_size=64)
    dsa = ts.dsa._get_dsa_sparse_workspace(CPU)
    block = _buffer(buffers.BLOCK.pool)
    assert backend.trtllm_workspace is _buffer(buffers.TRTLLM_MLA.pool)
    assert dsa is _buffer(buffers.DSA.pool)
    assert (backend.trtllm_workspace.numel(), dsa.numel()) == (MiB, 3 * MiB)
    for zeroed in (backend.trtllm_workspace, dsa):
        assert int(zeroed.count_nonzero()) == 0
        assert not _overlap(zeroed, block)
    assert not _overlap(backend.trtllm_workspace, dsa)
    meta = torch.device("meta")  # a second device: TokenSpeed's own getter would return the first one's buffer
    assert ts.trtllm_mla.get_trtllm_workspace_buffer(meta).device == meta
    assert ts.dsa._get_dsa_sparse_workspace(meta).device == meta
    assert ts.trtllm_mla.get_trtllm_workspace_buffer(CPU) is backend.trtllm_workspace


def test_a_rule_reading_a_fact_the_integration_does_not_pass_names_the_facts_it_does(
    ts: TokenSpeed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DSA's workspace sized by a fact TokenSpeed's integration does not pass fails naming the facts it does pass."""
    monkeypatch.setenv("WSPOOL_POOLS__TOKENSPEED_DSA__RULES__DEFAULT", "q_len * 1MiB")
    tokenspeed.register()
    with pytest.raises(
        RuleError,
        match=r"needs fact\(s\) q_len .*\(for TokenSpeed's DSA sparse MLA workspace the integration passes the "
        r"facts it knows: tokenspeed_bytes=\d+; .*; see docs/tokenspeed\.md\)$",
    ):
        ts.dsa._get_dsa_sparse_workspace(CPU)
    monkeypatch.setenv("WSPOOL_POOLS__TOKENSPEED_DSA__FACTS__Q_LEN", "2")
    wspool.reset_registry()
    assert ts.dsa._get_dsa_sparse_workspace(CPU).numel() == 2 * MiB  # a default fact serves it


class _Wrapper:
    """Stands in for a FlashInfer wrapper, whose constructor pins host memory (impossible without a GPU)."""

    def __init__(self, workspace: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.workspace = workspace


def test_flashmlas_flashinfer_workspace_is_a_pool_kept_apart_from_the_block(
    ts: TokenSpeed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FlashMLA's FlashInfer wrappers get pool flashinfer's buffer, sized by FLASHINFER_WORKSPACE_SIZE; the global
    TokenSpeed keeps for it is left as it was."""
    monkeypatch.setenv("FLASHINFER_WORKSPACE_SIZE", str(2 * MiB))
    monkeypatch.setattr(ts.flashmla, "BatchPrefillWithRaggedKVCacheWrapper", _Wrapper)
    monkeypatch.setattr(ts.flashmla, "BatchMLAPagedAttentionWrapper", _Wrapper)
    tokenspeed.register()
    ts.workspace.workspace_pool(CPU).allocate(((MiB,), torch.uint8))
    mla = _mla_spec(ts)
    backend = ts.flashmla.FlashMLABackend(_attn_config(ts, mla), mla, kernel_page_size=ts.flashmla.PAGE_SIZE)
    buffer = _buffer(buffers.FLASHMLA.pool)
    assert backend.workspace_buffer is buffer and buffer.numel() == 2 * MiB
    assert backend.prefill_wrapper_ragged.workspace is buffer and backend.prefill_wrapper_paged.workspace is buffer
    assert not _overlap(buffer, _buffer(buffers.BLOCK.pool))
    assert buffers.flashmla_workspace(ts.flashmla) is None


def test_sampling_scratch_stays_tokenspeeds(ts: TokenSpeed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TokenSpeed's sampling backend allocates its own scratch: no wspool pool serves or grows for it."""
    sm100 = SimpleNamespace(multi_processor_count=SM100_SM_COUNT)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: sm100)  # a CUDA device property query
    _model_config(ts, tmp_path)
    assert tokenspeed.patched() == TARGET_NAMES
    args = ts.server_args.ServerArgs(model=str(tmp_path), device="cpu", skip_tokenizer_init=True)
    config = ts.sampling_base.SamplingBackendConfig.from_server_args(
        args, max_bs=4, max_draft_tokens_per_req=1, device="cpu", vocab_size=128, max_req_pool_size=8
    )
    sampler = ts.sampling.TritonSamplingBackend(config)
    assert sampler._gumbel_local_scores.numel() > 0
    assert [s for s in wspool.get_registry().all_stats() if s.capacity_bytes] == []


# -- the reservation before TokenSpeed sizes its cache ----------------------------------------------


class _Measured(Exception):
    """Stops TokenSpeed's cache profile at its memory measurement."""


def _profile_sees(ts: TokenSpeed, monkeypatch: pytest.MonkeyPatch, pool: str, spec: Any) -> list[int]:
    """Run TokenSpeed's cache profile (the registry's copy) up to its measurement; return ``pool``'s capacity then."""
    utils = importlib.import_module("tokenspeed.runtime.layers.attention.utils")
    seen: list[int] = []

    def measured(*args: Any) -> float:
        seen.append(wspool.get_registry().stats(pool, CPU).capacity_bytes)
        raise _Measured

    monkeypatch.setattr(utils, "get_available_gpu_memory", measured)
    registry = importlib.import_module("tokenspeed.runtime.layers.attention.registry")
    with pytest.raises(_Measured):
        registry.profile_available_cache_memory_bytes(_attn_config(ts, spec), 0, 1, 0.9, 80, 0)
    return seen


def test_trtllm_mla_workspace_reserved_before_tokenspeed_measures(
    ts: TokenSpeed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the trtllm_mla backend, TokenSpeed measures for its cache with its MLA workspace already held."""
    monkeypatch.setenv("TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB", "8")
    _model_config(ts, tmp_path)  # runs the loader
    spec = dataclasses.replace(_mla_spec(ts), backend_name="trtllm_mla")
    assert _profile_sees(ts, monkeypatch, buffers.TRTLLM_MLA.pool, spec) == [8 << 20]


def test_reservation_switch_off_and_other_backends_reserve_nothing(
    ts: TokenSpeed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WSPOOL_RESERVE=0, or a backend wspool does not reserve for, leaves the pools empty when TokenSpeed measures."""
    monkeypatch.setenv("TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB", "8")
    _model_config(ts, tmp_path)
    assert _profile_sees(ts, monkeypatch, buffers.TRTLLM_MLA.pool, _mha_spec(ts)) == [0]
    monkeypatch.setenv("WSPOOL_RESERVE", "0")
    spec = dataclasses.replace(_mla_spec(ts), backend_name="trtllm_mla")
    assert _profile_sees(ts, monkeypatch, buffers.TRTLLM_MLA.pool, spec) == [0]
