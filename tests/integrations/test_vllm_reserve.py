"""Tests for the vLLM plugin's reservation: limits from the real VllmConfig, reserved before the KV-cache measurement.

They build vLLM's own configuration of a local DeepSeek-V2 config.json (no
download) on the CPU platform, and run vLLM's own
``Worker.determine_available_memory`` on a worker whose profile run records what
wspool holds when vLLM measures. They skip, with the reason, without vLLM.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

import wspool
from tests.helpers.dcp_config import DCP_LSE_RULE
from wspool.integrations import vllm as plugin
from wspool.integrations.vllm.facts import limits_from_config

MiB = 1 << 20
WORKER = "vllm.v1.worker.gpu_worker"
MLA = "vllm.v1.attention.backends.mla.flashinfer_mla"
SEQS, TOKENS, TP, DCP = 64, 1024, 8, 8
#: DeepSeek-V2's attention, shortened to four layers: MLA with kv_lora_rank 512, 128 heads.
DEEPSEEK = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 128,
    "num_key_value_heads": 128, "num_hidden_layers": 4, "vocab_size": 129280, "max_position_embeddings": 4096,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
}  # fmt: skip


@pytest.fixture
def vllm() -> ModuleType:
    """The real vLLM package; skips where it is not installed."""
    return pytest.importorskip(
        "vllm", reason="vLLM is not installed here; `.ci/engine-envs` builds .venv-vllm (0.33.0) and .venv-vllm034"
    )


@pytest.fixture
def loaded(vllm: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """The plugin loaded by vLLM, every getter on the CPU, the DCP LSE rule configured, the model a local file."""
    monkeypatch.setenv("WSPOOL_VLLM_DEVICE", "cpu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tmp_path / "wspool.yaml"
    config.write_text(f"pools:\n  flashinfer_mla:\n    rules:\n      lse: {DCP_LSE_RULE}\n")
    monkeypatch.setenv("WSPOOL_CONFIG", str(config))
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK))
    wspool.reset_registry()
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    try:
        yield
    finally:
        plugin.unregister()
        wspool.reset_registry()


def _config(model: Path, *, drafts: int = 0) -> Any:
    """vLLM's VllmConfig of the local DeepSeek-V2 at TP 8 and DCP 8 (``drafts``: n-gram speculative tokens)."""
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig

    speculative = (
        SpeculativeConfig(method="ngram", num_speculative_tokens=drafts, prompt_lookup_max=3, prompt_lookup_min=1)
        if drafts
        else None
    )
    return VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, max_model_len=4096),
        scheduler_config=SchedulerConfig(
            max_num_seqs=SEQS, max_num_batched_tokens=TOKENS, max_model_len=4096, is_encoder_decoder=False
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=TP, decode_context_parallel_size=DCP),
        device_config=DeviceConfig(device="cpu"),
        speculative_config=speculative,
    )


def _with_mla_layers(config: Any) -> None:
    """Register four layers whose backend is FlashInfer MLA, as a loaded model's forward context holds them."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    backend = importlib.import_module(MLA).FlashInferMLABackend

    class Layer(AttentionLayerBase):
        def get_attn_backend(self) -> Any:
            return backend

        def get_kv_cache_spec(self, vllm_config: Any) -> None:
            return None

    for index in range(4):
        config.compilation_config.static_forward_context[f"model.layers.{index}.self_attn.attn"] = Layer()


class _Worker(SimpleNamespace):
    """A worker with what vLLM's determine_available_memory reads; its profile run records wspool's pools."""

    def __init__(self, config: Any) -> None:
        seen: list[int] = []

        def profile_run(randomize_inputs: bool = False) -> None:
            seen.append(wspool.get_registry().stats("flashinfer_mla", "cpu").capacity_bytes)

        super().__init__(
            vllm_config=config,
            cache_config=SimpleNamespace(kv_cache_memory_bytes=1 << 30),  # vLLM's branch that runs on a CPU
            model_config=config.model_config,
            parallel_config=config.parallel_config,
            model_runner=SimpleNamespace(profile_run=profile_run),
            randomize_dummy_inputs=False,
            init_snapshot=SimpleNamespace(free_memory=80 << 30),
            device=torch.device("cpu"),
            seen=seen,
        )


def _lse_bytes(batch: int, q_len: int) -> int:
    heads_per_rank = 128 // TP
    return 8 * heads_per_rank * DCP * batch * (-(-q_len // 256) * 256) + 33 * MiB


def test_limits_come_from_vllms_config(vllm: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The limits follow the VllmConfig: rows, speculative q_len, heads per rank after TP, DCP, kv_lora_rank."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK))
    limits = limits_from_config(_config(tmp_path, drafts=3))
    shown = {name: (limit.low, limit.high) for name, limit in limits.items()}
    # Either layout's most rows: max(max_num_seqs, min(max_num_seqs * q_len, max_num_batched_tokens)).
    assert shown["batch_size"] == (1, max(SEQS, min(SEQS * 4, TOKENS)))
    assert shown["q_len"] == (1, 4)
    assert shown["num_heads"] == (1, 128 // TP)
    assert shown["q_heads"] == (1, 128 // TP * DCP)
    assert shown["cp_world"] == (DCP, DCP)
    assert shown["kv_lora_rank"] == (512, 512)
    assert shown["batch_tokens"] == (TOKENS, TOKENS)
    assert "--max-num-seqs" in limits["batch_size"].source


def test_reserves_before_vllm_measures_memory(loaded: None, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's determine_available_memory runs its profile run with the DCP LSE slab already reserved at its bound."""
    config = _config(tmp_path)
    _with_mla_layers(config)
    worker = _Worker(config)
    gpu_worker = importlib.import_module(WORKER)
    with caplog.at_level(logging.INFO, logger="wspool"):
        gpu_worker.Worker.determine_available_memory(worker)
    assert worker.seen == [_lse_bytes(SEQS, 1)]
    (line,) = [r.getMessage() for r in caplog.records if "before vLLM sizes its KV cache" in r.getMessage()]
    assert "reserved" in line and "flashinfer_mla" in line and "vLLM's own constants would hold 256MiB" in line


def test_speculative_tokens_raise_the_reservation(
    loaded: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With speculative decoding the slab is reserved at q_len = 1 + drafts and the widest rows."""
    config = _config(tmp_path, drafts=3)
    _with_mla_layers(config)
    worker = _Worker(config)
    importlib.import_module(WORKER).Worker.determine_available_memory(worker)
    assert worker.seen == [_lse_bytes(max(SEQS, min(SEQS * 4, TOKENS)), 4)]


def test_reserve_switch_off_leaves_pools_to_grow(loaded: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """WSPOOL_RESERVE=0 reserves nothing: vLLM measures with wspool's pools still empty."""
    monkeypatch.setenv("WSPOOL_RESERVE", "0")
    config = _config(tmp_path)
    _with_mla_layers(config)
    worker = _Worker(config)
    importlib.import_module(WORKER).Worker.determine_available_memory(worker)
    assert worker.seen == [0]


def test_model_without_wspools_backends_reserves_nothing(loaded: None, tmp_path: Path) -> None:
    """A model whose layers use none of wspool's backends (here: none registered) has nothing reserved."""
    worker = _Worker(_config(tmp_path))
    importlib.import_module(WORKER).Worker.determine_available_memory(worker)
    assert worker.seen == [0]


def test_call_beyond_the_limits_after_the_lock_names_vllms_setting(loaded: None, tmp_path: Path) -> None:
    """After the reservation and vLLM's lock, a larger batch than max_num_seqs is refused naming --max-num-seqs."""
    config = _config(tmp_path)
    _with_mla_layers(config)
    importlib.import_module(WORKER).Worker.determine_available_memory(_Worker(config))
    registry = wspool.get_registry()
    registry.freeze()
    facts = {"num_heads": 16, "cp_world": DCP, "q_len": 1}
    registry.workspace("flashinfer_mla", "cpu", rule="lse", batch_size=SEQS, **facts)
    with pytest.raises(
        wspool.WorkspaceFrozenError, match=r"fact batch_size=65 is beyond its limit 64 .*--max-num-seqs"
    ):
        registry.workspace("flashinfer_mla", "cpu", rule="lse", batch_size=SEQS + 1, **facts)
    assert registry.stats("flashinfer_mla", "cpu").grow_count == 1
