"""GPU tests of per-device pools on several GPUs: one process per GPU, and one process driving two devices in turn.

Every test runs in freshly spawned processes, so PyTorch's allocator counters
start at zero on every device and show exactly where each process allocated
(``torch.cuda.memory_allocated`` and ``max_memory_allocated``, the latter
catching buffers that were freed again). Each device's buffer is sized by its
own call: the MLA pool's rule grows with the batch, and the ranks decode
different batches. With one GPU there is nothing to compare a device with, so
these tests skip, saying how many devices they need and how many there are.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

import wspool
from tests.helpers.mla_inputs import make_inputs
from tests.helpers.process_world import Outcome, cuda_world_skip_reason, run_world
from wspool.distributed import agree
from wspool.flashinfer import mla_decode, mla_decode_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason=cuda_world_skip_reason(2)),
]

MiB = 1 << 20
HEADS = 16
#: Above what FlashInfer's MLA kernels need on Hopper (17 MB) and Blackwell (about 75 MB) at these
#: shapes, and different for every batch, so a buffer's size says which call sized it.
RULE = "128MiB + batch_size * 1MiB"
POOLS = {"flashinfer_mla": {"rules": {"default": RULE, "lse": RULE}}}
#: Spawned CUDA processes load torch and FlashInfer's compiled kernels (compiled by the test process first).
JOIN_TIMEOUT_S = 300.0


def _expected(batch: int) -> int:
    return 128 * MiB + batch * MiB


def _registry() -> wspool.PoolRegistry:
    return wspool.PoolRegistry(wspool.load_settings(pools=POOLS))


def _counters() -> tuple[list[int], list[int]]:
    """Bytes allocated now and at the peak since the last reset, per device."""
    devices = range(torch.cuda.device_count())
    return [torch.cuda.memory_allocated(d) for d in devices], [torch.cuda.max_memory_allocated(d) for d in devices]


def _decode_on(registry: wspool.PoolRegistry, device: torch.device, batch: int, seed: int) -> Outcome:
    """Run mla_decode with the LSE on ``device``; report where memory was allocated and how the result compares."""
    lengths = [(97 * i + 31 * seed) % 2000 + 33 for i in range(batch)]
    inputs = make_inputs(batch, HEADS, lengths, page_size=64, dtype=torch.bfloat16, device=device, seed=seed)
    want_out, want_lse = mla_decode_reference(
        inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, sm_scale=inputs.sm_scale
    )
    used = sorted({device.index, torch.cuda.current_device()})  # syncing another device would start a context there
    for d in used:
        torch.cuda.synchronize(d)
    for d in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(d)
    before, _ = _counters()
    out, lse = mla_decode(
        inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, inputs.max_seq_len,
        sm_scale=inputs.sm_scale, return_lse=True, registry=registry,
    )  # fmt: skip
    for d in used:
        torch.cuda.synchronize(d)
    after, peaks = _counters()
    pool = registry.pool("flashinfer_mla", device)
    stats = pool.stats()
    assert pool.buffer is not None
    return {
        "device": str(device),
        "current": torch.cuda.current_device(),
        "batch": batch,
        "before": before,
        "after": after,
        "peaks": peaks,
        "capacity": stats.capacity_bytes,
        "grows": stats.grow_count,
        "buffer_device": str(pool.buffer.device),
        "buffer_ptr": pool.buffer.data_ptr(),
        "out_device": str(out.device),
        "out_err": float((out.float() - want_out.float()).norm() / want_out.float().norm()),
        "lse_err": float((lse - want_lse).abs().max()),
    }


def _decode_then_agree(rank: int, world: int, device: str) -> Outcome:
    # One process per GPU: rank r decodes a batch of 2 * (r + 1) on its own device, then the ranks agree.
    registry = _registry()
    decoded = _decode_on(registry, torch.device("cuda", rank), 2 * (rank + 1), seed=rank)
    torch.cuda.reset_peak_memory_stats(rank)
    changes = agree(registry, device=device)
    torch.cuda.synchronize(rank)
    after, peaks = _counters()
    agreed = registry.stats("flashinfer_mla", device, lane="main").capacity_bytes
    changed = [(c.pool, c.device, c.old_bytes, c.new_bytes) for c in changes if c.pool == "flashinfer_mla"]
    return {"decode": decoded, "agreed": agreed, "changes": changed, "after_agree": after, "peaks_agree": peaks}


def _in_turn(follows: bool) -> Outcome:
    # cuda:0, then cuda:1, then cuda:0 again, each with its own batch, in one process and one registry.
    registry = _registry()
    steps = []
    for index, batch in ((0, 4), (1, 12), (0, 4)):
        current = torch.cuda.device(index) if follows else contextlib.nullcontext()
        with current:
            steps.append(_decode_on(registry, torch.device("cuda", index), batch, seed=len(steps)))
    mla = [p for p in registry.pools() if p.spec.name == "flashinfer_mla"]
    pools = sorted((str(p.device), p.lane, p.capacity_bytes) for p in mla)
    return {"steps": steps, "pools": pools}


def _in_turn_current_follows(rank: int, world: int, device: str) -> Outcome:
    return _in_turn(follows=True)


def _in_turn_current_stays(rank: int, world: int, device: str) -> Outcome:
    return _in_turn(follows=False)


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels() -> None:
    """Compile (or load) FlashInfer's MLA kernels once here, so spawned processes load them from its cache."""
    inputs = make_inputs(1, HEADS, [100], page_size=64, device="cuda:0")
    mla_decode(
        inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, inputs.max_seq_len,
        sm_scale=inputs.sm_scale, return_lse=True, registry=_registry(),
    )  # fmt: skip
    torch.cuda.synchronize()


def _check_only_on(step: dict[str, Any], index: int) -> None:
    """Nothing was allocated on any device but ``index`` during the step, not even transiently.

    Memory there may be freed: the new step's plan replaces the previous one, whose tensors lived on the other device.
    """
    for d, (before, after, peak) in enumerate(zip(step["before"], step["after"], step["peaks"], strict=True)):
        if d != index:
            assert peak == before >= after, f"{step['device']} decode allocated on cuda:{d}: {before} -> peak {peak}"


def test_one_process_per_gpu_allocates_on_its_own_device_only() -> None:
    """Each rank's buffer is on its GPU, sized by its batch; no rank allocates on another GPU; agree evens them."""
    world = torch.cuda.device_count()
    outcomes = run_world(world, {"run": _decode_then_agree}, backend="nccl", join_timeout_s=JOIN_TIMEOUT_S)
    for rank, out in outcomes.items():
        step = out["run"]["decode"]
        here = f"cuda:{rank}"
        print(
            f"\nrank {rank}: batch {step['batch']} on {step['device']}: {step['capacity']} bytes, out rel err "
            f"{step['out_err']:.2e}, lse abs err {step['lse_err']:.2e}; allocated per device {step['after']}; "
            f"after agree {out['run']['after_agree']}",
            end="",
        )
        assert step["device"] == step["buffer_device"] == step["out_device"] == here and step["current"] == rank
        assert step["capacity"] == _expected(2 * (rank + 1)) and step["grows"] == 1
        assert step["after"][rank] - step["before"][rank] >= step["capacity"]
        assert all(n == 0 for d, n in enumerate(step["peaks"]) if d != rank), step["peaks"]
        assert step["out_err"] < 1e-2 and step["lse_err"] < 1e-3
        assert out["run"]["agreed"] == _expected(2 * world)
        grew = [] if rank == world - 1 else [("flashinfer_mla", here, _expected(2 * (rank + 1)), _expected(2 * world))]
        assert out["run"]["changes"] == grew
        assert all(n == 0 for d, n in enumerate(out["run"]["peaks_agree"]) if d != rank), out["run"]["peaks_agree"]


@pytest.mark.parametrize(
    "scenario", [_in_turn_current_follows, _in_turn_current_stays], ids=["current-device-follows", "current-stays-0"]
)
def test_one_process_drives_two_devices_in_turn(scenario: Any) -> None:
    """One process decodes on cuda:0, cuda:1, cuda:0: one buffer per device, sized by its call, nothing on the other."""
    outcomes = run_world(1, {"run": scenario}, backend=None, join_timeout_s=JOIN_TIMEOUT_S)
    run = outcomes[0]["run"]
    follows = scenario is _in_turn_current_follows
    steps = run["steps"]
    for step, index in zip(steps, (0, 1, 0), strict=True):
        print(f"\n{step['device']} (current cuda:{step['current']}): allocated per device {step['after']}", end="")
        assert step["device"] == step["buffer_device"] == step["out_device"] == f"cuda:{index}"
        assert step["current"] == (index if follows else 0)
        assert step["capacity"] == _expected(step["batch"]) and step["grows"] == 1
        assert step["out_err"] < 1e-2 and step["lse_err"] < 1e-3
        _check_only_on(step, index)
    first, second, again = steps
    assert first["after"][0] - first["before"][0] >= first["capacity"]
    assert second["after"][1] - second["before"][1] >= second["capacity"]
    assert again["buffer_ptr"] == first["buffer_ptr"]  # cuda:0's buffer again, not a new one
    assert run["pools"] == [("cuda:0", "main", _expected(4)), ("cuda:1", "main", _expected(12))]
