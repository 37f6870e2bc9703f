"""Tests for wspool.integrations.vllm_facts: the facts read from a vLLM configuration and from call sites."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from wspool.integrations.vllm_facts import ConfigFacts, call_facts, facts_from_config, set_call_facts


def _config(**overrides: Any) -> SimpleNamespace:
    """An object with the attributes of a VllmConfig that the facts read."""
    base: dict[str, Any] = {
        "parallel_config": SimpleNamespace(decode_context_parallel_size=4),
        "scheduler_config": SimpleNamespace(max_num_seqs=256),
        "model_config": SimpleNamespace(get_num_attention_heads=lambda parallel: 16, dtype=torch.bfloat16),
        "cache_config": SimpleNamespace(cache_dtype="auto"),
        "speculative_config": SimpleNamespace(num_speculative_tokens=3),
    }
    return SimpleNamespace(**{**base, **overrides})


def test_every_fact_from_a_full_config() -> None:
    """A full configuration gives heads per rank, the DCP size, the largest batch, q_len and the KV dtype size."""
    assert facts_from_config(_config()) == {
        "num_heads": 16,
        "cp_world": 4,
        "batch_size": 256,
        "q_len": 4,
        "kv_dtype_size": 2,
    }


@pytest.mark.parametrize(("cache_dtype", "size"), [("fp8", 1), ("fp8_e5m2", 1), ("float32", 4), ("bfloat16", 2)])
def test_kv_dtype_size_follows_the_cache_dtype(cache_dtype: str, size: int) -> None:
    """An explicit KV-cache dtype gives its size; auto gives the model's dtype size."""
    assert facts_from_config(_config(cache_config=SimpleNamespace(cache_dtype=cache_dtype)))["kv_dtype_size"] == size


def test_no_speculation_is_q_len_one_and_unknowns_are_left_out() -> None:
    """Without a speculative config q_len is 1; a model config that cannot count heads leaves num_heads out."""

    def no_hf_config(parallel: object) -> int:
        raise AttributeError("no hf_config")

    facts = facts_from_config(
        _config(
            speculative_config=None,
            model_config=SimpleNamespace(get_num_attention_heads=no_hf_config),
            cache_config=SimpleNamespace(cache_dtype="weird"),
        )
    )
    assert facts == {"cp_world": 4, "batch_size": 256, "q_len": 1}


def test_bad_values_are_left_out() -> None:
    """Zero, negative, boolean or non-integer values are not facts."""
    facts = facts_from_config(
        _config(
            parallel_config=SimpleNamespace(decode_context_parallel_size=0),
            scheduler_config=SimpleNamespace(max_num_seqs=True),
            speculative_config=SimpleNamespace(num_speculative_tokens=-1),
        )
    )
    assert set(facts) == {"num_heads", "kv_dtype_size"}


def test_config_facts_are_cached_until_the_object_changes() -> None:
    """The facts are read once per configuration object; another object is read again; None gives none."""
    reads = []

    def heads(parallel: object) -> int:
        reads.append(1)
        return 8

    first = _config(model_config=SimpleNamespace(get_num_attention_heads=heads, dtype=torch.float16))
    current: list[object] = [first]
    facts = ConfigFacts(lambda: current[0])
    assert facts.get()["num_heads"] == 8 and facts.get() is facts.get() and len(reads) == 1
    current[0] = _config(scheduler_config=SimpleNamespace(max_num_seqs=4))
    assert facts.get()["batch_size"] == 4
    current[0] = None
    assert facts.get() == {} and ConfigFacts(None).get() == {}


def test_call_facts_are_per_thread() -> None:
    """Facts set by one thread's call site are not seen by another thread."""
    previous = set_call_facts({"num_heads": 2})
    seen: list[object] = []
    worker = threading.Thread(target=lambda: seen.append(call_facts()))
    worker.start()
    worker.join()
    assert seen == [None] and call_facts() == {"num_heads": 2}
    set_call_facts(previous)
    assert call_facts() is None
