"""Tests for the SGLang integration's reservation: SGLang's server arguments, reserved before the KV pool is sized.

They publish real SGLang 0.5.23 server arguments for a tiny local model and run
SGLang's own ``KVCacheConfigurator._profile_available_bytes`` up to its memory
measurement, which records what wspool holds then. They skip, with the reason,
without SGLang.
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
from tests.helpers.sglang_model import TINY_LLAMA
from wspool.integrations import sglang as sg

CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator"
MiB = 1 << 20


class Measured(Exception):
    """Stops SGLang's sizing at its memory measurement (the test has what it needs then)."""


@pytest.fixture
def srt(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """SGLang's runtime context, and the integration loaded by SGLang with every pool on the CPU."""
    sglang = pytest.importorskip("sglang", reason="SGLang is not installed here; `.ci/engine-envs` builds .venv-sglang")
    if sglang.__version__ != "0.5.23":
        pytest.skip(f"the integration targets SGLang 0.5.23; this environment has {sglang.__version__}")
    plugins = importlib.import_module("sglang.srt.plugins")
    context = importlib.import_module("sglang.srt.runtime_context")
    monkeypatch.setenv("WSPOOL_SGLANG_DEVICE", "cpu")
    monkeypatch.setenv("SGLANG_PLUGINS", "wspool")
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    wspool.reset_registry()
    plugins.load_plugins()
    assert sg.patched(), "the integration did not load"
    try:
        yield context
    finally:
        sg.unregister()
        context.reset_context()
        wspool.reset_registry()


def _publish(context: ModuleType, directory: Path, model: dict[str, Any] | None = None, **args: Any) -> None:
    from sglang.srt.server_args import ServerArgs

    (directory / "config.json").write_text(json.dumps(model or TINY_LLAMA))
    context.publish(
        ServerArgs(model_path=str(directory), skip_tokenizer_init=True, device="cpu", **args), role="scheduler"
    )


def _measure(monkeypatch: pytest.MonkeyPatch, pool: str) -> list[int]:
    """Run SGLang's _profile_available_bytes up to its measurement; return the pool's capacity seen there."""
    module = importlib.import_module(CONFIGURATOR)
    seen: list[int] = []

    def measured(*args: Any, **kwargs: Any) -> float:
        seen.append(wspool.get_registry().stats(pool, "cpu").capacity_bytes)
        raise Measured

    monkeypatch.setattr(module, "get_available_gpu_memory", measured)
    hf = SimpleNamespace(architectures=["LlamaForCausalLM"])
    model_config = SimpleNamespace(
        hf_config=hf, num_attention_heads=4, head_dim=16, get_num_kv_heads=lambda tp: 2, kv_lora_rank=None
    )
    configurator = SimpleNamespace(
        model_config=model_config, page_size=16, kv_cache_dtype=torch.bfloat16, model_dtype=torch.float32,
        device="cpu", gpu_id=0, is_draft_worker=False,
    )  # fmt: skip
    context = importlib.import_module("sglang.srt.runtime_context")
    with context.get_parallel().override(world_group=SimpleNamespace(cpu_group=None)), pytest.raises(Measured):
        module.KVCacheConfigurator._profile_available_bytes(configurator, 80 << 30)
    return seen


def test_flashinfer_workspace_reserved_before_sglang_measures(
    srt: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """--attention-backend flashinfer: SGLang measures for its KV pool with its 384 MiB workspace already held."""
    _publish(srt, tmp_path, attention_backend="flashinfer")
    with caplog.at_level(logging.INFO, logger="wspool"):
        assert _measure(monkeypatch, "flashinfer") == [384 * MiB]
    (line,) = [r.getMessage() for r in caplog.records if "before SGLang sizes its KV cache" in r.getMessage()]
    assert "SGLang's own constants would hold 384MiB" in line


def test_rules_over_the_server_limits(srt: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule over the batch is reserved at --max-running-requests and the model's heads per rank."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER__RULES__SGLANG", "batch_size * num_heads * 1KiB + 1MiB")
    wspool.reset_registry()
    _publish(srt, tmp_path, attention_backend="flashinfer", max_running_requests=48)
    assert _measure(monkeypatch, "flashinfer") == [48 * 4 * 1024 + MiB]


def test_other_backends_reserve_nothing(srt: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend whose workspace wspool does not reserve (triton) leaves the pools empty when SGLang measures."""
    _publish(srt, tmp_path, attention_backend="triton")
    assert _measure(monkeypatch, "flashinfer") == [0]


def test_reserve_switch_off(srt: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """WSPOOL_RESERVE=0: SGLang measures with wspool's pools still empty."""
    monkeypatch.setenv("WSPOOL_RESERVE", "0")
    _publish(srt, tmp_path, attention_backend="flashinfer")
    assert _measure(monkeypatch, "flashinfer") == [0]


def test_plan_follows_sglangs_own_sizes() -> None:
    """Deterministic inference gives FlashInfer 2 GiB and Qwen models 512 MiB, as SGLang's backend does."""
    assert sg.reservation_plan(["flashinfer"], ["LlamaForCausalLM"], True) == (
        {"flashinfer": ["sglang_deterministic"]},
        2048 * MiB,
    )
    assert sg.reservation_plan(["flashinfer"], ["Qwen3ForCausalLM"], False)[1] == 512 * MiB
    assert sg.reservation_plan(["flashinfer_mla", None], [], False)[0] == {"flashinfer_mla": ["sglang_mla"]}
    assert sg.reservation_plan(["fa3"], [], False) == ({}, None)
