"""A registry reserved for its limits, then frozen: 1,000 random MLA decode and paged decode calls never grow it.

Each call runs twice, through the reserved registry and through an unreserved
one that grows on first use, and both give the same output. A call beyond a
limit is refused with the error naming the fact, its limit and where to raise
it, and the reserved buffer is kept. On the GPU the calls run FlashInfer's
kernels (the H200 test machine: the hopper profile, 132 SMs); on the CPU the
fp32 reference path, with the SM count a limit (the CPU has no such fact).
"""

from __future__ import annotations

import random

import pytest
import torch

import wspool
from tests.helpers.mla_inputs import MLAInputs, make_inputs
from tests.helpers.paged_inputs import PagedInputs, make_paged_inputs
from wspool.flashinfer import mla_decode, paged_decode_plan

CALLS = 1000
MAX_BATCH = 16
#: The paged call's limits: GQA heads up to 32, head_dim 64 or 128.
PAGED_HEADS = ((8, 2, 64), (16, 4, 128), (32, 8, 128))
LIMITS: dict[str, object] = {"batch_size": MAX_BATCH, "num_qo_heads": 32, "head_dim": [64, 128], "q_len": 1}
RULES = {"flashinfer_mla": ["default", "lse"], "flashinfer": ["decode"]}


def _mla_sets(device: str, longest: int) -> list[MLAInputs]:
    rng = random.Random(1)
    sets = []
    for seed in range(12):
        batch = rng.randint(1, MAX_BATCH)
        lengths = [rng.randint(1, longest) for _ in range(batch)]
        sets.append(make_inputs(batch, rng.choice([16, 128]), lengths, device=device, seed=seed))
    return sets


def _paged_sets(device: str, longest: int) -> list[PagedInputs]:
    rng = random.Random(2)
    sets = []
    for seed in range(12):
        qo, kv, dim = rng.choice(PAGED_HEADS)
        lengths = [rng.randint(1, longest) for _ in range(rng.randint(1, MAX_BATCH))]
        sets.append(
            make_paged_inputs(lengths, num_qo_heads=qo, num_kv_heads=kv, head_dim=dim, device=device, seed=seed)
        )
    return sets


def _mla(registry: wspool.PoolRegistry, inputs: MLAInputs, backend: str, return_lse: bool) -> torch.Tensor:
    result = mla_decode(
        inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, inputs.max_seq_len,
        sm_scale=inputs.sm_scale, return_lse=return_lse, registry=registry, backend=backend,
    )  # fmt: skip
    return result[0] if isinstance(result, tuple) else result


def _paged(registry: wspool.PoolRegistry, inputs: PagedInputs, backend: str) -> torch.Tensor:
    plan = paged_decode_plan(
        inputs.block_tables, inputs.seq_lens, num_qo_heads=inputs.num_qo_heads, num_kv_heads=inputs.num_kv_heads,
        head_dim=inputs.head_dim, page_size=inputs.page_size, registry=registry, backend=backend,
    )  # fmt: skip
    out = plan.run(inputs.query, inputs.kv_cache)
    return out[0] if isinstance(out, tuple) else out


def _grows(registry: wspool.PoolRegistry) -> int:
    return sum(stats.grow_count for stats in registry.all_stats())


def _random_calls_never_grow(device: str, backend: str, limits: dict[str, object], calls: int, longest: int) -> None:
    # The hopper profile's rules (the H200's own; named for the CPU, which has no profile of its own).
    reserved = wspool.PoolRegistry.from_config(profile="hopper")
    plan = reserved.reserve_for(limits, pools=list(RULES), rules=RULES, devices=[device])
    reserved.freeze()
    lazy = wspool.PoolRegistry.from_config(profile="hopper")
    buffer = reserved.pool("flashinfer_mla", device).buffer
    key = ("flashinfer_mla", str(buffer.device) if buffer is not None else device, "main")
    assert buffer is not None and buffer.numel() == plan.buffers[key]
    grows = _grows(reserved)
    mla_sets, paged_sets = _mla_sets(device, longest), _paged_sets(device, longest)
    rng = random.Random(3)
    for _ in range(calls):
        if rng.random() < 0.5:
            inputs, lse = rng.choice(mla_sets), rng.random() < 0.5
            got, want = _mla(reserved, inputs, backend, lse), _mla(lazy, inputs, backend, lse)
        else:
            paged = rng.choice(paged_sets)
            got, want = _paged(reserved, paged, backend), _paged(lazy, paged, backend)
        assert torch.equal(got, want)
    assert _grows(reserved) == grows
    assert reserved.pool("flashinfer_mla", device).buffer is buffer

    beyond = make_paged_inputs([300, 5], num_qo_heads=64, num_kv_heads=8, head_dim=128, device=device)
    with pytest.raises(
        wspool.WorkspaceFrozenError,
        match=r"pool 'flashinfer_mla' on .* was reserved for its limits and is frozen: rule decode asks for more "
        r"for this call: fact num_qo_heads=64 is beyond its limit 32 \(raise it: the limits given to reserve_for\)",
    ):
        _paged(reserved, beyond, backend)
    assert reserved.pool("flashinfer_mla", device).buffer is buffer  # nothing freed, nothing replaced
    assert torch.equal(_paged(reserved, paged_sets[0], backend), _paged(lazy, paged_sets[0], backend))
    assert _grows(reserved) == grows


def test_reserved_registry_serves_random_calls_without_growth_on_the_cpu() -> None:
    """On the CPU's reference path: random calls within the limits never grow; one beyond is refused, named."""
    _random_calls_never_grow("cpu", "reference", {**LIMITS, "sm_count": [1]}, calls=40, longest=64)


@pytest.mark.gpu
def test_reserved_registry_serves_random_flashinfer_calls_without_growth() -> None:
    """With FlashInfer's kernels: 1,000 random calls within the limits never grow, outputs as an unreserved run."""
    _random_calls_never_grow("cuda", "auto", LIMITS, calls=CALLS, longest=700)
