"""GPU tests for wspool.flashinfer.paged: FlashInfer paged attention beside MLA decode, one registry, one buffer."""

from __future__ import annotations

import pytest
import torch

import wspool
from tests.helpers.mla_inputs import make_inputs
from tests.helpers.paged_inputs import PagedInputs, make_paged_inputs
from wspool.flashinfer import (
    mla_decode,
    mla_decode_reference,
    paged_attention_reference,
    paged_decode_plan,
    paged_prefill_plan,
)
from wspool.units import MiB, format_size

pytestmark = pytest.mark.gpu

# Llama-3-8B-like GQA: 32 query heads over 8 KV heads, head_dim 128, bf16, 16-token pages.
HEADS = {"num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128, "page_size": 16}
DECODE_LENGTHS = [1, 17, 300, 4096, 1000, 63, 64, 2048]
PREFILL_LENGTHS = [17, 300, 4096, 1000, 64, 2048]
PREFILL_ROWS = [17, 1, 512, 1000, 33, 128]
#: What engines reserve today with fixed buffers for the same backends (vLLM: MLA with LSE, FlashInfer attention).
FIXED_ENGINE_BYTES = {"vLLM FlashInfer MLA (LSE)": 256 * MiB, "vLLM FlashInfer attention": 394 * MiB}


def _decode_inputs(seed: int = 0) -> PagedInputs:
    return make_paged_inputs(DECODE_LENGTHS, device="cuda", seed=seed, **HEADS)  # type: ignore[arg-type]


def _prefill_inputs(seed: int = 0) -> PagedInputs:
    return make_paged_inputs(PREFILL_LENGTHS, q_lens=PREFILL_ROWS, device="cuda", seed=seed, **HEADS)  # type: ignore[arg-type]


def _heads(inputs: PagedInputs) -> dict[str, int]:
    return {k: getattr(inputs, k) for k in HEADS}


def _reference(inputs: PagedInputs, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return paged_attention_reference(
        inputs.query, inputs.kv_cache, inputs.qo_indptr, inputs.block_tables, inputs.seq_lens,
        sm_scale=inputs.head_dim**-0.5, causal=causal,
    )  # fmt: skip


def _check(label: str, got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Output within 1e-2 relative (bf16), natural-log LSE within 5e-3 absolute."""
    err = float((got[0].float() - want[0].float()).norm() / want[0].float().norm())
    lse_err = float((got[1] - want[1]).abs().max())
    print(f"\n{label}: out rel err {err:.2e}, lse abs err {lse_err:.2e}", end="")
    assert err < 1e-2
    assert lse_err < 5e-3


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda-cores", "tensor-cores"])
def test_paged_decode_matches_reference(tensor_cores: bool) -> None:
    """FlashInfer's paged GQA decode through the pool matches the fp32 reference, LSE in natural log."""
    registry = wspool.PoolRegistry.from_config()
    inputs = _decode_inputs()
    plan = paged_decode_plan(
        inputs.block_tables, inputs.seq_lens, **_heads(inputs), use_tensor_cores=tensor_cores, registry=registry
    )
    label = f"paged decode ({'tensor' if tensor_cores else 'CUDA'} cores)"
    for layer in range(3):  # one plan per step, one run per layer: a new query and KV cache each time
        if layer:
            inputs.query, inputs.kv_cache = torch.randn_like(inputs.query), torch.randn_like(inputs.kv_cache)
        result = plan.run(inputs.query, inputs.kv_cache, return_lse=True)
        _check(f"{label}, layer {layer}", result, _reference(inputs, causal=False))  # type: ignore[arg-type]
    assert plan.plan_calls == 1


def test_paged_prefill_matches_reference() -> None:
    """FlashInfer's paged causal prefill over ragged rows matches the fp32 reference."""
    registry = wspool.PoolRegistry.from_config()
    inputs = _prefill_inputs()
    plan = paged_prefill_plan(
        inputs.qo_indptr, inputs.block_tables, inputs.seq_lens, **_heads(inputs), registry=registry
    )
    result = plan.run(inputs.query, inputs.kv_cache, return_lse=True)
    _check("paged prefill (causal)", result, _reference(inputs, causal=True))  # type: ignore[arg-type]


def test_undersized_decode_rule_recovers_on_the_device() -> None:
    """A 1MiB decode rule on its own buffer overflows FlashInfer's split-KV carve; the pool grows once and serves."""
    registry = wspool.PoolRegistry.from_config(pools={"flashinfer": {"shared_with": "", "rules": {"decode": "1MiB"}}})
    inputs = make_paged_inputs([8192, 8000], device="cuda", **HEADS)  # type: ignore[arg-type]
    plan = paged_decode_plan(
        inputs.block_tables, inputs.seq_lens, **_heads(inputs), use_tensor_cores=False, registry=registry
    )
    _check(
        "paged decode after recovery",
        plan.run(inputs.query, inputs.kv_cache, return_lse=True),
        _reference(inputs, False),
    )  # type: ignore[arg-type]
    stats = registry.stats("flashinfer", "cuda")
    print(f"; grew to {format_size(stats.capacity_bytes)} for {stats.last_grow_reason}", end="")
    assert stats.grow_count == 2
    assert stats.last_grow_reason.startswith("overflow recovery (batch_decode_tmp_")  # type: ignore[union-attr]


def test_one_registry_serves_mla_and_paged_attention() -> None:
    """MLA decode, paged decode and paged prefill share one buffer: it holds the largest need, not the sum."""
    registry = wspool.PoolRegistry.from_config()  # the default configuration: flashinfer shares flashinfer_mla
    device = torch.device("cuda", torch.cuda.current_device())

    mla = make_inputs(32, 128, [4096 - 97 * i for i in range(32)], page_size=64, device=device)
    mla_out = mla_decode(
        mla.query, mla.kv_cache, mla.block_tables, mla.seq_lens, mla.max_seq_len, sm_scale=mla.sm_scale,
        return_lse=True, registry=registry,
    )  # fmt: skip
    want = mla_decode_reference(mla.query, mla.kv_cache, mla.block_tables, mla.seq_lens, sm_scale=mla.sm_scale)
    _check("MLA decode", (mla_out[0].flatten(0, 1), mla_out[1].flatten(0, 1)),  # type: ignore[index]
           (want[0].flatten(0, 1), want[1].flatten(0, 1)))  # fmt: skip

    decode = _decode_inputs()
    decode_plan = paged_decode_plan(decode.block_tables, decode.seq_lens, **_heads(decode), registry=registry)
    _check("paged decode", decode_plan.run(decode.query, decode.kv_cache, return_lse=True), _reference(decode, False))  # type: ignore[arg-type]

    prefill = _prefill_inputs()
    prefill_plan = paged_prefill_plan(
        prefill.qo_indptr, prefill.block_tables, prefill.seq_lens, **_heads(prefill), registry=registry
    )
    _check(
        "paged prefill", prefill_plan.run(prefill.query, prefill.kv_cache, return_lse=True), _reference(prefill, True)
    )  # type: ignore[arg-type]

    needs = {
        "MLA decode (rule lse)": registry.resolve("flashinfer_mla", "lse"),
        "paged decode (rule decode)": registry.resolve("flashinfer", "decode", **decode_plan.facts),
        "paged prefill (rule prefill)": registry.resolve("flashinfer", "prefill", **prefill_plan.facts),
    }
    shared = registry.stats("flashinfer", device)
    held = registry.memory_stats()["devices"][str(device)]
    print("\n" + registry.memory_summary())
    for label, nbytes in needs.items():
        print(f"  need of {label}: {format_size(nbytes)}")
    print(f"  held by the shared buffer: {format_size(shared.capacity_bytes)} (the largest single need)")
    print(f"  sum of the needs (a buffer per backend): {format_size(sum(needs.values()))}")
    print(f"  sum of engines' fixed buffers today: {format_size(sum(FIXED_ENGINE_BYTES.values()))} "
          f"({', '.join(f'{k} {format_size(v)}' for k, v in FIXED_ENGINE_BYTES.items())})")  # fmt: skip
    assert shared.pool == "flashinfer_mla" and registry.pool("flashinfer", device) is registry.pool(
        "flashinfer_mla", device
    )
    assert shared.capacity_bytes == max(needs.values()) < sum(needs.values())
    # Grown only by the rules, in call order, each time a need exceeded what it held: no overflow recovery.
    # (The fixed profile's MLA lse rule, 256MiB, covers both paged needs; hopper's 16.56MiB does not.)
    held_before, grows = 0, 0
    for nbytes in needs.values():
        grows += nbytes > held_before
        held_before = max(held_before, nbytes)
    largest = max(needs, key=needs.__getitem__)
    largest_rule = largest.split("(rule ")[1].rstrip(")")
    assert shared.grow_count == grows
    assert shared.last_grow_reason == f"rule {largest_rule}: {format_size(needs[largest])}"
    assert dict(shared.requests_by_rule) == {"lse": 1, "decode": 1, "prefill": 1}
    assert held["held_bytes"] >= shared.capacity_bytes and held["torch_allocated_bytes"] >= held["held_bytes"]
