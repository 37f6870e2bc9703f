"""Tests for wspool.integrations.vllm.facts: the facts read from a vLLM configuration and from call sites."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from wspool.integrations.vllm.facts import (
    REQUESTS,
    TOKENS,
    ConfigFacts,
    KernelShape,
    call_facts,
    decode_kernel_shape,
    facts_from_config,
    folded_kernel_shape,
    kernel_facts,
    set_call_facts,
    widest_facts,
)

MiB = 1 << 20


def _config(**overrides: Any) -> SimpleNamespace:
    """An object with the attributes of a VllmConfig that the facts read."""
    base: dict[str, Any] = {
        "parallel_config": SimpleNamespace(decode_context_parallel_size=4),
        "scheduler_config": SimpleNamespace(max_num_seqs=256, max_num_batched_tokens=8192),
        "model_config": SimpleNamespace(get_num_attention_heads=lambda parallel: 16, dtype=torch.bfloat16),
        "cache_config": SimpleNamespace(cache_dtype="auto"),
        "speculative_config": SimpleNamespace(num_speculative_tokens=3),
    }
    return SimpleNamespace(**{**base, **overrides})


def test_every_fact_from_a_full_config() -> None:
    """A full configuration gives heads per rank, the DCP size, the largest batch and step, q_len, the KV dtype size."""
    assert facts_from_config(_config()) == {
        "num_heads": 16,
        "cp_world": 4,
        "batch_size": 256,
        "batch_tokens": 8192,
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
    assert facts == {"cp_world": 4, "batch_size": 256, "batch_tokens": 8192, "q_len": 1}


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


def _metadata(*, num_decodes: int, tokens: int, max_query_len: int, causal: bool = True) -> SimpleNamespace:
    """The attributes of vLLM's FlashInferMLAMetadata that forward_mqa's branches read."""
    decode = SimpleNamespace(max_query_len=max_query_len)
    return SimpleNamespace(decode=decode, num_decodes=num_decodes, num_decode_tokens=tokens, causal=causal)


@pytest.mark.parametrize(
    ("metadata", "cp_world", "expected"),
    [
        # Plain decode: one row per request.
        (_metadata(num_decodes=8, tokens=8, max_query_len=1), 1, KernelShape(REQUESTS, 8, 1, 32, 1)),
        # Uniform speculative decode under DCP: [requests, 1 + k].
        (_metadata(num_decodes=8, tokens=32, max_query_len=4), 4, KernelShape(REQUESTS, 8, 4, 32, 4)),
        # Causal speculative decode without DCP: the compact ragged query, tiled per request.
        (_metadata(num_decodes=8, tokens=20, max_query_len=4), 1, KernelShape(REQUESTS, 8, 4, 32, 1)),
        # vLLM 0.34's ragged causal DCP decode: every token its own row.
        (_metadata(num_decodes=8, tokens=20, max_query_len=4), 4, KernelShape(TOKENS, 20, 1, 32, 4)),
        # A non-causal block (DSpark draft) is flattened to single-token rows.
        (_metadata(num_decodes=8, tokens=32, max_query_len=4, causal=False), 4, KernelShape(TOKENS, 32, 1, 32, 4)),
    ],
)
def test_decode_kernel_shape_follows_vllms_branches(metadata: Any, cp_world: int, expected: KernelShape) -> None:
    """The shape the kernel gets follows FlashInferMLAImpl.forward_mqa's branches."""
    tokens = metadata.num_decode_tokens
    assert decode_kernel_shape(tokens, 32, cp_world, metadata) == expected


def test_unreadable_metadata_has_no_shape() -> None:
    """Metadata without the attributes the branches read gives no shape (the caller takes the widest facts)."""
    assert decode_kernel_shape(8, 32, 1, None) is None
    assert decode_kernel_shape(8, 32, 1, SimpleNamespace(decode=SimpleNamespace(), num_decodes=8)) is None


def _kimi_dcp_lse(facts: dict[str, int]) -> int:
    """configs/kimi_dcp.yaml's lse rule, evaluated here to show what the facts size."""
    round_up = -(-facts["q_len"] // 256) * 256
    return 8 * facts["num_heads"] * facts["cp_world"] * facts["batch_size"] * round_up + 33 * MiB


def test_ragged_dcp_rows_are_bounded_by_the_steps_tokens() -> None:
    """Kimi K2 (8 heads per rank, DCP 8), 256 sequences, 3 speculative tokens, 8192 batched tokens.

    Uniform, the kernel sees at most 256 rows of q_len 4: 65 MiB. Ragged, every token is a row:
    at most min(256 * 4, 8192) = 1024 rows of q_len 1, 161 MiB; the request rows' 65 MiB would be
    (1 + k) times too small for the softmax slab.
    """
    configured = {"num_heads": 8, "cp_world": 8, "batch_size": 256, "q_len": 4, "batch_tokens": 8192}
    uniform = kernel_facts(configured, KernelShape(REQUESTS, 37, 4, 64, 8))
    ragged = kernel_facts(configured, KernelShape(TOKENS, 90, 1, 64, 8))
    assert (uniform["batch_size"], uniform["q_len"], uniform["num_heads"], uniform["q_heads"]) == (256, 4, 8, 64)
    assert (ragged["batch_size"], ragged["q_len"], ragged["num_heads"], ragged["q_heads"]) == (1024, 1, 8, 64)
    assert _kimi_dcp_lse(uniform) == 65 * MiB and _kimi_dcp_lse(ragged) == 161 * MiB
    # A step may not hold more tokens than max_num_batched_tokens: 300 sequences x 4 > 1024.
    capped = kernel_facts({**configured, "batch_size": 300, "batch_tokens": 1024}, KernelShape(TOKENS, 90, 1, 64, 8))
    assert capped["batch_size"] == 1024


def test_kernel_facts_never_below_the_call() -> None:
    """A call with more rows or a longer q_len than the configuration allows is sized for what it has."""
    configured = {"batch_size": 16, "q_len": 2, "batch_tokens": 32}
    assert kernel_facts(configured, KernelShape(REQUESTS, 20, 3, 8, 1))["batch_size"] == 20
    assert kernel_facts(configured, KernelShape(REQUESTS, 20, 3, 8, 1))["q_len"] == 3
    assert kernel_facts(configured, KernelShape(TOKENS, 40, 1, 8, 1))["batch_size"] == 40
    # Without a configuration, the call's own shape.
    assert kernel_facts({}, KernelShape(TOKENS, 5, 1, 8, 2)) == {
        "q_heads": 8,
        "num_heads": 4,
        "cp_world": 2,
        "batch_size": 5,
        "q_len": 1,
    }


def test_folded_rows_carry_the_folded_heads() -> None:
    """Kimi K3's draft decode folds tokens into heads: fewer rows, more heads per row."""
    shape = folded_kernel_shape(tokens=64, heads=32, cp_world=4, fold=4)
    assert shape == KernelShape(TOKENS, 16, 1, 128, 4, fold=4)
    facts = kernel_facts({"batch_size": 64, "q_len": 4, "batch_tokens": 8192}, shape)
    # At most min(64 * 4, 8192) = 256 tokens, 4 to a row: 64 rows of 128 heads (32 per DCP rank).
    assert (facts["batch_size"], facts["q_heads"], facts["num_heads"], facts["q_len"]) == (64, 128, 32, 1)


def test_widest_facts_cover_every_layout() -> None:
    """Outside a wrapped call site, batch_size is the most rows of either layout, at the configured q_len."""
    assert widest_facts({"batch_size": 256, "q_len": 4, "batch_tokens": 8192})["batch_size"] == 1024
    assert widest_facts({"batch_size": 256, "q_len": 4, "batch_tokens": 128})["batch_size"] == 256
    assert widest_facts({"batch_size": 8, "q_len": 1}) == {"batch_size": 8, "q_len": 1}
    assert widest_facts({"q_len": 4}) == {"q_len": 4}


def test_for_kernel_returns_one_mapping_per_resolved_shape() -> None:
    """Calls that resolve to the same facts share one mapping; a new configuration object is read again."""
    current: list[object] = [_config()]
    facts = ConfigFacts(lambda: current[0])
    first = facts.for_kernel(KernelShape(REQUESTS, 3, 4, 64, 4))
    assert facts.for_kernel(KernelShape(REQUESTS, 200, 1, 64, 4)) is first  # both at the configured 256 rows
    assert first["batch_size"] == 256 and first["kv_dtype_size"] == 2
    assert facts.widest()["batch_size"] == 1024
    current[0] = _config(scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64))
    assert facts.for_kernel(KernelShape(REQUESTS, 3, 4, 64, 4))["batch_size"] == 4
