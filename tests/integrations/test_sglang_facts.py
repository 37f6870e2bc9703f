"""Tests for wspool.integrations.sglang.facts: what SGLang tells the rules, without SGLang."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import wspool
from wspool.integrations.sglang import facts as sf

MiB = 1 << 20


@pytest.fixture(autouse=True)
def no_readers() -> Iterator[None]:
    """Forget the context readers a test sets."""
    yield
    sf.set_context_readers(None, None)


def _runner(**model: Any) -> SimpleNamespace:
    """A model runner with the attributes SGLang's ModelRunner has for the facts (a 32-head GQA model)."""
    config = {"num_attention_heads": 32, "head_dim": 128, **model}
    kv_heads = config.pop("kv_heads", 8)
    model_config = SimpleNamespace(get_num_kv_heads=lambda tp: max(1, kv_heads // tp), **config)
    return SimpleNamespace(
        model_config=model_config,
        page_size=64,
        max_running_requests=256,
        kv_cache_dtype=torch.float8_e4m3fn,
        dtype=torch.bfloat16,
    )


def test_facts_of_a_runner_and_context() -> None:
    """Heads per attention-TP rank, DCP, draft tokens and the runner's sizes become facts."""
    parallel = SimpleNamespace(attn_tp_size=4, attn_dcp_size=2)
    spec = SimpleNamespace(speculative_num_draft_tokens=4)
    facts = sf.facts_from_runner(_runner(), parallel=parallel, spec=spec)
    assert facts == {
        "num_heads": 8,
        "num_qo_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 128,
        "page_size": 64,
        "batch_size": 256,
        "kv_dtype_size": 1,
        "dtype_bytes": 2,
        "cp_world": 2,
        "q_len": 4,
    }


def test_mla_geometry_and_defaults_without_context() -> None:
    """An MLA model adds its latent geometry; no context means one rank, no DCP, one query token."""
    facts = sf.facts_from_runner(_runner(kv_lora_rank=512, qk_rope_head_dim=64, kv_heads=1))
    assert (facts["kv_lora_rank"], facts["qk_rope_head_dim"]) == (512, 64)
    assert (facts["num_heads"], facts["num_kv_heads"], facts["cp_world"], facts["q_len"]) == (32, 1, 1, 1)


def test_what_sglang_does_not_give_is_left_out() -> None:
    """Unpublished context (SGLang raises), a missing attribute, a zero or a bool give no fact."""

    class Unpublished:
        def __getattr__(self, name: str) -> Any:
            raise ValueError("config namespace 'parallel' not published")

    runner = _runner()
    runner.max_running_requests = None
    runner.page_size = True
    spec = SimpleNamespace(speculative_num_draft_tokens=None)
    facts = sf.facts_from_runner(runner, parallel=Unpublished(), spec=spec)
    for name in ("num_heads", "num_qo_heads", "num_kv_heads", "cp_world", "batch_size", "page_size"):
        assert name not in facts
    assert (facts["head_dim"], facts["q_len"]) == (128, 1)


def test_probe_reads_a_cuda_factory_without_a_gpu_or_memory() -> None:
    """SGLang's factory runs under the fake-tensor mode: its shape, dtype and device, nothing allocated."""
    made: list[str] = []

    def factory() -> torch.Tensor:
        tensor = torch.empty(1 << 40, dtype=torch.int8, device="cuda")  # 1 TiB if it were real
        made.append(type(tensor).__name__)
        return tensor

    request = sf.probe_factory(factory)
    assert (request.shape, request.dtype, request.device.type, request.nbytes) == (
        (1 << 40,),
        torch.int8,
        "cuda",
        1 << 40,
    )
    assert made == ["FakeTensor"]


def test_probe_counts_bytes_of_wider_dtypes_and_refuses_non_tensors() -> None:
    """nbytes is elements times element size; a factory that makes no tensor is a TypeError."""
    request = sf.probe_factory(lambda: torch.zeros((3, 4), dtype=torch.float32))
    assert (request.nbytes, request.device) == (48, torch.device("cpu"))
    with pytest.raises(TypeError, match="returns list, not a tensor"):
        sf.probe_factory(lambda: [1, 2])


def test_current_facts_follow_the_runner_being_built() -> None:
    """Outside a constructor there are no facts; inside, the runner's, with nesting restored."""
    sf.set_context_readers(lambda: SimpleNamespace(attn_tp_size=2, attn_dcp_size=1), None)
    assert sf.current_facts() == {}
    with sf.building(_runner()):
        assert sf.current_facts()["num_heads"] == 16
        with sf.building(_runner(num_attention_heads=8)):
            assert sf.current_facts()["num_heads"] == 4
        assert sf.current_facts()["num_heads"] == 16
    assert sf.current_facts() == {}


def test_what_the_integration_read_of_sglang_outlives_a_registry_reset() -> None:
    """SGLang's runtime context is the process's: a registry reset or set after loading reads the same SGLang."""
    sf.RUNTIME.read(device="cpu", parallel=lambda: SimpleNamespace(attn_tp_size=4, attn_dcp_size=1))
    try:
        wspool.reset_registry()
        wspool.set_registry(wspool.PoolRegistry.from_config())
        with sf.building(_runner()):
            assert sf.current_facts()["num_heads"] == 8
        assert sf.RUNTIME.device == torch.device("cpu") and sf.RUNTIME.deterministic() is False
    finally:
        sf.RUNTIME.read()
    assert (sf.RUNTIME.device, sf.RUNTIME.parallel) == (None, None)


def test_a_reader_that_raises_leaves_its_facts_out() -> None:
    """SGLang's get_parallel() before publication raises; the facts it would give are left out."""

    def unpublished() -> Any:
        raise ValueError("not published")

    sf.set_context_readers(unpublished, unpublished)
    with sf.building(_runner()):
        facts = sf.current_facts()
    assert not {"num_heads", "num_qo_heads", "num_kv_heads", "cp_world", "q_len"} & set(facts)
    assert facts["head_dim"] == 128 and facts["batch_size"] == 256


def _unpublished() -> Any:
    raise ValueError("config bag 'schedule' not published")  # as SGLang's accessor raises


def test_prefill_rows_follow_sglangs_limits() -> None:
    """The largest extend: the chunk or max_prefill_tokens, unchunked a whole context too, verify rows; else None."""
    limits = SimpleNamespace(max_prefill_tokens=16384, chunked_prefill_size=8192)
    sf.set_context_readers(None, None, lambda: limits, lambda: 8192)
    try:
        assert sf.prefill_rows(131072, 8, 1) == 16384  # chunked: no batch holds a whole long prompt
        assert sf.prefill_rows(131072, 8, 1, whole_prompts=True) == 131072
        assert sf.prefill_rows(4096, 1024, 16) == 16384  # verify: 1024 requests x 16 draft tokens
        limits.max_prefill_tokens = 0  # unset: the chunk ceiling still bounds it
        assert sf.prefill_rows(4096, 8, 1) == 8192
        limits.chunked_prefill_size = -1  # chunked prefill off: a first request of a whole context, alone
        assert sf.prefill_rows(131072, 8, 1) == 131072
        sf.set_context_readers(None, None, _unpublished, lambda: 8192)
        assert sf.prefill_rows(4096, 8, 1) is None
        sf.set_context_readers(None, None)
        assert sf.prefill_rows(4096, 8, 1) is None
    finally:
        sf.set_context_readers(None, None)
