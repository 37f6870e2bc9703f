"""Tests for wspool.distributed: pool sizes agreed across torch.distributed ranks.

Each world (2 and 4 processes over gloo on 127.0.0.1, and one process per CUDA
device over NCCL where there are at least two) is spawned once per module and
runs every scenario in order on one process group; the tests then check what
each rank reported. A gloo world of 2 runs the scenarios in which one rank's
own arguments or state are wrong. A rank that hangs fails the test at the join
timeout (``JOIN_TIMEOUT_S``: 90 s for a gloo world, ``NCCL_JOIN_TIMEOUT_S``:
180 s for an NCCL one, each above the 45 s collective timeout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

import wspool
from tests.helpers.process_world import JOIN_TIMEOUT_S, Outcome, Scenario, cuda_world_skip_reason, run_world
from tests.helpers.registry import make_registry
from wspool.distributed import (
    AgreedChange,
    AgreementConfigError,
    AgreementError,
    AgreementFrozenError,
    AgreementLimitError,
    agree,
)

pytestmark = pytest.mark.slow

KiB = 1024
#: NCCL worlds start one CUDA process per device, up to 8: more time to report than gloo's.
NCCL_JOIN_TIMEOUT_S = 180.0


def _caps(reg: wspool.PoolRegistry) -> dict[str, int]:
    return {f"{s.pool}/{s.lane}": s.capacity_bytes for s in reg.all_stats()}


def _changes(changes: list[AgreedChange]) -> list[tuple[str, str, int, int]]:
    return [(c.pool, c.lane, c.old_bytes, c.new_bytes) for c in changes]


def _error(exc: BaseException) -> Outcome:
    found = getattr(exc, "refusals", ())
    refusals = [(r.rank, r.pool, r.lane, r.kind, r.needed_bytes, r.available_bytes) for r in found]
    mro = [c.__name__ for c in type(exc).__mro__]
    return {"error": type(exc).__name__, "mro": mro, "message": str(exc), "refusals": refusals}


MLA = {"mla": {"rules": {"default": "x * 1KiB"}}}


def _needs(rank: int, world: int, device: str) -> Outcome:
    reg = make_registry(MLA)
    reg.workspace("mla", device, x=rank + 1)
    reg.workspace("mla", device, lane="ubatch1", x=world - rank)
    changes = agree(reg, device=device)
    again = agree(reg, device=device)
    stats = reg.stats("mla", device)
    reason = stats.last_grow_reason
    return {"caps": _caps(reg), "changes": _changes(changes), "again": _changes(again), "reason": reason}


def _missing(rank: int, world: int, device: str) -> Outcome:
    reg = make_registry({**MLA, "paged": {"rules": {"default": "3KiB"}}})
    if rank == 0:
        reg.reserve("paged", device, nbytes="3KiB")
    if rank == world - 1:
        reg.workspace("mla", device, lane="spare", x=2)
    return {"changes": _changes(agree(reg, device=device)), "caps": _caps(reg)}


def _refused(reg: wspool.PoolRegistry, device: str) -> Outcome:
    before = _caps(reg)
    try:
        agree(reg, device=device)
    except Exception as exc:
        return {**_error(exc), "unchanged": _caps(reg) == before}
    return {"error": None}


def _frozen(rank: int, world: int, device: str) -> Outcome:
    reg = make_registry(MLA)
    reg.workspace("mla", device, x=rank + 1)
    if rank == 0:
        reg.freeze()
    return _refused(reg, device)


def _frozen_at_max(rank: int, world: int, device: str) -> Outcome:
    reg = make_registry(MLA)
    reg.workspace("mla", device, x=rank + 1)
    if rank == world - 1:
        reg.freeze()
    return {"changes": _changes(agree(reg, device=device)), "caps": _caps(reg)}


def _limit(rank: int, world: int, device: str) -> Outcome:
    reg = make_registry({"mla": {**MLA["mla"], "max_bytes": "1KiB" if rank == 0 else None}})
    reg.workspace("mla", device, x=rank + 1)
    return _refused(reg, device)


def _unconfigured(rank: int, world: int, device: str) -> Outcome:
    extra = {"only0": {"rules": {"default": "2KiB"}}} if rank == 0 else {}
    reg = make_registry({**MLA, **extra})
    reg.workspace("mla", device, x=1)
    if rank == 0:
        reg.workspace("only0", device)
    return _refused(reg, device)


def _oom(rank: int, world: int, device: str) -> Outcome:
    def allocator(nbytes: int, where: torch.device) -> torch.Tensor:
        if rank == 0 and nbytes > KiB:
            raise torch.OutOfMemoryError(f"simulated: cannot allocate {nbytes} bytes")
        return torch.zeros(nbytes, dtype=torch.uint8, device=where)

    reg = make_registry(MLA, allocator=allocator)
    reg.workspace("mla", device, x=rank + 1)
    try:
        agree(reg, device=device)
    except Exception as exc:
        return {**_error(exc), "caps": _caps(reg)}
    return {"error": None}


def _warmup(rank: int, world: int, device: str) -> Outcome:
    reg = make_registry(MLA)
    capacity = reg.warmup("mla", [{"x": 1}, {"x": rank + 1}], device, agree_group=dist.group.WORLD)
    stats = reg.stats("mla", device)
    return {"capacity": capacity, "grows": stats.grow_count, "peak": stats.peak_request_bytes}


def _growth_differs(rank: int, world: int, device: str) -> Outcome:
    reg = make_registry({"mla": {**MLA["mla"], "growth": "4KiB" if rank == 0 else "exact"}})
    reg.workspace("mla", device, x=1 if rank == 0 else rank + 4)
    return {"changes": _changes(agree(reg, device=device)), "caps": _caps(reg)}


#: An MLA-like pool sized by the batch: with 16 heads, batch 8 needs 8KiB and batch 64 needs 64KiB.
BATCHED = {"mla": {"rules": {"default": "batch_size * num_heads * 64"}}}
HEADS, SMALL_BATCH, LARGE_BATCH = 16, 8, 64
SMALL, LARGE = 8 * KiB, 64 * KiB


class _FailingAllocator:
    """The default allocator, except that requests above ``limit_bytes`` raise ``error`` (and are counted)."""

    def __init__(self, limit_bytes: int, error: type[Exception]) -> None:
        self.limit_bytes = limit_bytes
        self.error = error
        self.failures = 0

    def __call__(self, nbytes: int, where: torch.device) -> torch.Tensor:
        if nbytes > self.limit_bytes:
            self.failures += 1
            raise self.error(f"simulated: cannot allocate {nbytes} bytes on {where}")
        return torch.zeros(nbytes, dtype=torch.uint8, device=where)


def _batched(rank: int, allocator: _FailingAllocator | None, device: str) -> wspool.PoolRegistry:
    """Rank 0 decodes the larger batch; every other rank the smaller one."""
    reg = make_registry(BATCHED, allocator=allocator)
    reg.workspace("mla", device, batch_size=LARGE_BATCH if rank == 0 else SMALL_BATCH, num_heads=HEADS)
    return reg


def _mixed_frozen(rank: int, world: int, device: str) -> Outcome:
    # Rank 0: the larger batch; rank 1: frozen; the last rank (rank 1 in a world of 2): out of memory.
    allocator = _FailingAllocator(SMALL, torch.OutOfMemoryError) if rank == world - 1 else None
    reg = _batched(rank, allocator, device)
    if rank == 1:
        reg.freeze()
    return {**_refused(reg, device), "failed_allocations": allocator.failures if allocator else 0}


def _mixed_oom(rank: int, world: int, device: str) -> Outcome:
    # Rank 0: the larger batch; the last rank: out of memory; the others grow.
    allocator = _FailingAllocator(SMALL, torch.OutOfMemoryError) if rank == world - 1 else None
    reg = _batched(rank, allocator, device)
    outcomes = []
    for _ in range(2):  # the same call again: the same error on every rank, no rank left waiting
        try:
            agree(reg, device=device)
            outcomes.append({"error": None})
        except Exception as exc:
            outcomes.append(_error(exc))
    return {**outcomes[0], "again": outcomes[1], "caps": _caps(reg)}


def _alloc_error(rank: int, world: int, device: str) -> Outcome:
    # The last rank's allocator fails with an error that is not about memory (RuntimeError, MemoryError
    # and OverflowError count as out of memory: a WorkspaceLimitError).
    allocator = _FailingAllocator(SMALL, ValueError) if rank == world - 1 else None
    reg = _batched(rank, allocator, device)
    try:
        agree(reg, device=device)
    except Exception as exc:
        return {**_error(exc), "caps": _caps(reg)}
    return {"error": None}


SCENARIOS: dict[str, Scenario] = {
    "needs": _needs,
    "missing": _missing,
    "frozen": _frozen,
    "frozen_at_max": _frozen_at_max,
    "limit": _limit,
    "unconfigured": _unconfigured,
    "oom": _oom,
    "warmup": _warmup,
    "growth_differs": _growth_differs,
    "mixed_frozen": _mixed_frozen,
    "mixed_oom": _mixed_oom,
    "alloc_error": _alloc_error,
}
#: The scenarios in which every rank must raise: the same class and message on every rank.
REFUSED = ("frozen", "limit", "unconfigured", "oom", "mixed_frozen", "mixed_oom", "alloc_error")


@dataclass(frozen=True)
class World:
    """What every rank of one spawned world reported."""

    size: int
    backend: str
    outcomes: dict[int, dict[str, Outcome]]

    def device(self, rank: int) -> str:
        """A rank's device, as agree() names it in messages."""
        return "cpu" if self.backend == "gloo" else f"cuda:{rank}"


_CUDA_WORLD = max(torch.cuda.device_count(), 2)  # 2, 4 or 8 on a multi-GPU machine; skips below 2
_NCCL = pytest.param(
    ("nccl", _CUDA_WORLD),
    id="nccl",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"NCCL world: {cuda_world_skip_reason(2)}"),
    ],
)


@pytest.fixture(
    scope="module", params=[pytest.param(("gloo", 2), id="world2"), pytest.param(("gloo", 4), id="world4"), _NCCL]
)
def world(request: pytest.FixtureRequest) -> World:
    """Run every scenario once: gloo worlds of 2 and 4 processes, and NCCL with one process per GPU."""
    backend, size = request.param
    timeout = JOIN_TIMEOUT_S if backend == "gloo" else NCCL_JOIN_TIMEOUT_S
    return World(size, backend, run_world(size, SCENARIOS, backend=backend, join_timeout_s=timeout))


def test_different_needs_end_with_equal_capacities(world: World) -> None:
    """Ranks with different needs all end with the largest capacity of every pool and lane."""
    size, outcomes = world.size, world.outcomes
    for rank, out in outcomes.items():
        needs = out["needs"]
        assert needs["caps"] == {"mla/main": size * KiB, "mla/ubatch1": size * KiB}
        expected = []
        if rank + 1 < size:
            expected.append(("mla", "main", (rank + 1) * KiB, size * KiB))
        if rank > 0:
            expected.append(("mla", "ubatch1", (size - rank) * KiB, size * KiB))
        assert needs["changes"] == expected
        assert needs["again"] == []
        if rank + 1 < size:
            assert needs["reason"] == f"agree: max over {size} ranks: {size}KiB"


def test_pool_missing_on_a_rank_is_created_there(world: World) -> None:
    """A pool or lane that only one rank uses is created, at the same size, on every other rank."""
    outcomes = world.outcomes
    for out in outcomes.values():
        assert out["missing"]["caps"] == {"mla/spare": 2 * KiB, "paged/main": 3 * KiB}
    assert outcomes[0]["missing"]["changes"] == [("mla", "spare", 0, 2 * KiB)]
    assert outcomes[1]["missing"]["changes"][-1] == ("paged", "main", 0, 3 * KiB)


def test_frozen_rank_refuses_on_every_rank_before_allocating(world: World) -> None:
    """A frozen rank that would have to grow makes every rank raise the same frozen error, allocating nothing."""
    size, outcomes = world.size, world.outcomes
    for out in outcomes.values():
        frozen = out["frozen"]
        assert frozen["error"] == "AgreementFrozenError"
        assert {"WorkspaceFrozenError", "AgreementError", "WspoolError"} <= set(frozen["mro"])
        assert frozen["refusals"] == [(0, "mla", "main", "frozen", size * KiB, KiB)]
        assert frozen["unchanged"]
    expected = (
        rf"agree over {size} ranks refused by rank 0 \(nothing was allocated on any rank\): rank 0: "
        rf"pool 'mla' \(lane main\) on {world.device(0)} needs {size * KiB} bytes \({size}KiB\), 1024 bytes available: "
        r"the registry is frozen; agree .* before freeze\(\)"
    )
    with pytest.raises(AgreementFrozenError, match=expected):
        _reraise(outcomes[1]["frozen"])


def test_frozen_rank_already_at_the_max_does_not_refuse(world: World) -> None:
    """A frozen rank that already holds the largest capacity lets the others grow to it."""
    size, outcomes = world.size, world.outcomes
    for rank, out in outcomes.items():
        assert out["frozen_at_max"]["caps"] == {"mla/main": size * KiB}
        grown = [] if rank == size - 1 else [("mla", "main", (rank + 1) * KiB, size * KiB)]
        assert out["frozen_at_max"]["changes"] == grown


def test_rank_over_max_bytes_refuses_on_every_rank(world: World) -> None:
    """A rank whose max_bytes is below the agreed size makes every rank raise a limit error naming the setting."""
    size, outcomes = world.size, world.outcomes
    for out in outcomes.values():
        limit = out["limit"]
        assert limit["error"] == "AgreementLimitError"
        assert "MemoryError" in limit["mro"]
        assert limit["refusals"] == [(0, "mla", "main", "limit", size * KiB, KiB)]
        assert limit["unchanged"]
    expected = (
        r"refused by rank 0 .*above max_bytes = 1024 bytes \(1KiB\); raise pools\.mla\.max_bytes / "
        r"WSPOOL_POOLS__MLA__MAX_BYTES on every rank"
    )
    with pytest.raises(AgreementLimitError, match=expected):
        _reraise(outcomes[1]["limit"])


def test_unconfigured_pool_refuses_on_every_rank(world: World) -> None:
    """A pool that one rank uses but others do not configure is a config error on every rank, naming those ranks."""
    size, outcomes = world.size, world.outcomes
    others = ", ".join(str(r) for r in range(1, size))
    for out in outcomes.values():
        unconfigured = out["unconfigured"]
        assert unconfigured["error"] == "AgreementConfigError"
        assert "ValueError" in unconfigured["mro"]
        assert [r[0] for r in unconfigured["refusals"]] == list(range(1, size))
        assert unconfigured["unchanged"]
    expected = rf"refused by ranks? {others} .*unknown pool 'only0'.*WSPOOL_POOLS__ONLY0__RULES__DEFAULT"
    with pytest.raises(AgreementConfigError, match=expected):
        _reraise(outcomes[0]["unconfigured"])


def test_out_of_memory_while_growing_raises_on_every_rank(world: World) -> None:
    """A rank that runs out of memory while growing makes every rank raise, instead of leaving them waiting."""
    size, outcomes = world.size, world.outcomes
    for rank, out in outcomes.items():
        oom = out["oom"]
        assert oom["error"] == "AgreementLimitError"
        assert oom["refusals"] == [(0, "mla", "main", "limit", size * KiB, KiB)]
        assert "ranks without a refusal may have grown already" in oom["message"]
        assert "out of memory" in oom["message"]
        assert oom["caps"] == {"mla/main": KiB if rank == 0 else size * KiB}


def test_warmup_with_agree_group_grows_once_to_the_max(world: World) -> None:
    """warmup(agree_group=WORLD) grows every rank once, straight to the largest size over the ranks."""
    size, outcomes = world.size, world.outcomes
    for rank, out in outcomes.items():
        assert out["warmup"] == {"capacity": size * KiB, "grows": 1, "peak": (rank + 1) * KiB}


def test_differing_growth_policies_still_converge(world: World) -> None:
    """When one rank rounds capacities up (growth: 4KiB), further rounds bring every rank to its capacity."""
    outcomes = world.outcomes
    for rank, out in outcomes.items():
        assert out["growth_differs"]["caps"] == {"mla/main": 8 * KiB}
        assert out["growth_differs"]["changes"] == [("mla", "main", (4 if rank == 0 else rank + 4) * KiB, 8 * KiB)]


def test_every_rank_raises_the_same_error(world: World) -> None:
    """Wherever agree() refuses, every rank raises the same class with the same message (none is left waiting)."""
    for name in REFUSED:
        reported = {(out[name]["error"], out[name]["message"]) for out in world.outcomes.values()}
        assert len(reported) == 1, f"{name}: ranks raised differently: {reported}"
        assert next(iter(reported))[0] is not None, f"{name}: no rank raised"


def test_frozen_rank_among_differing_needs_refuses_before_any_allocation(world: World) -> None:
    """Larger batch on rank 0, frozen rank 1, failing allocator on the last: the frozen refusal comes first."""
    size, outcomes = world.size, world.outcomes
    for out in outcomes.values():
        mixed = out["mixed_frozen"]
        assert mixed["error"] == "AgreementFrozenError"
        assert mixed["refusals"] == [(1, "mla", "main", "frozen", LARGE, SMALL)]
        assert mixed["unchanged"]
        assert mixed["failed_allocations"] == 0  # the out-of-memory rank was never asked to allocate
    expected = (
        rf"agree over {size} ranks refused by rank 1 \(nothing was allocated on any rank\): rank 1: pool 'mla' "
        rf"\(lane main\) on {world.device(1)} needs {LARGE} bytes \(64KiB\), {SMALL} bytes available: "
        r"the registry is frozen"
    )
    with pytest.raises(AgreementFrozenError, match=expected):
        _reraise(outcomes[0]["mixed_frozen"])


def test_out_of_memory_rank_among_differing_needs_raises_on_every_rank(world: World) -> None:
    """Larger batch on rank 0, the last rank out of memory: every rank raises, again on a retry; the others grew."""
    size, outcomes = world.size, world.outcomes
    last = size - 1
    for rank, out in outcomes.items():
        mixed = out["mixed_oom"]
        assert mixed["error"] == "AgreementLimitError"
        assert mixed["refusals"] == [(last, "mla", "main", "limit", LARGE, SMALL)]
        assert mixed["again"]["error"] == "AgreementLimitError"
        assert mixed["again"]["message"] == mixed["message"]
        assert mixed["caps"] == {"mla/main": SMALL if rank == last else LARGE}
    expected = (
        rf"refused by rank {last} \(ranks without a refusal may have grown already\): rank {last}: pool 'mla' "
        rf"\(lane main\) on {world.device(last)} needs {LARGE} bytes \(64KiB\), {SMALL} bytes available: "
        r".*out of memory"
    )
    with pytest.raises(AgreementLimitError, match=expected):
        _reraise(outcomes[0]["mixed_oom"])


def test_allocator_error_on_one_rank_raises_on_every_rank(world: World) -> None:
    """An allocator failing with a non-memory error on one rank raises the base AgreementError on every rank."""
    size, outcomes = world.size, world.outcomes
    last = size - 1
    for rank, out in outcomes.items():
        failed = out["alloc_error"]
        assert failed["error"] == "AgreementError"
        assert failed["refusals"] == [(last, "mla", "main", "error", LARGE, SMALL)]
        assert failed["caps"] == {"mla/main": SMALL if rank == last else LARGE}
    with pytest.raises(AgreementError, match=rf"rank {last}: .*simulated: cannot allocate {LARGE} bytes"):
        _reraise(outcomes[0]["alloc_error"])


def _reraise(outcome: Outcome) -> None:
    """Raise the error class a rank reported, with its message, so pytest.raises(match=...) can pin the text."""
    classes = {c.__name__: c for c in (AgreementFrozenError, AgreementLimitError, AgreementConfigError, AgreementError)}
    raise classes[outcome["error"]](outcome["message"])


def test_agree_without_a_process_group_says_so() -> None:
    """agree() before init_process_group is a clear error, not a hang."""
    with pytest.raises(RuntimeError, match=r"call torch\.distributed\.init_process_group\(\) first"):
        agree(make_registry(MLA), device="cpu")


# -- a failure on one rank alone, before the ranks compare sizes: every rank raises, none waits ----------


def _agree_outcome(reg: wspool.PoolRegistry, device: str, **kwargs: Any) -> Outcome:
    try:
        return {"error": None, "changes": _changes(agree(reg, **{"device": device, **kwargs}))}
    except Exception as exc:
        return {**_error(exc), "caps": _caps(reg)}


def _then_agree(reg: wspool.PoolRegistry, device: str, first: Outcome) -> Outcome:
    """After a refused call, a valid one: the ranks are still in step on the group."""
    return {"first": first, "then": _agree_outcome(reg, device), "caps": _caps(reg)}


def _reserve_outside_int64(rank: int, world: int, device: str) -> Outcome:
    reg = make_registry(MLA)
    reg.workspace("mla", device, x=rank + 1)
    reserve = {("mla", "main"): 2**70} if rank == 0 else None
    return _then_agree(reg, device, _agree_outcome(reg, device, reserve=reserve))


def _reserve_not_a_size(rank: int, world: int, device: str) -> Outcome:
    reg = make_registry(MLA)
    reg.workspace("mla", device, x=rank + 1)
    reserve: dict[Any, object] = {("mla", "main"): "8KiB"}
    if rank == world - 1:
        reserve = {("mla", "main"): "lots", "not a key": 1}
    return _then_agree(reg, device, _agree_outcome(reg, device, reserve=reserve))


def _capturing_rank(rank: int, world: int, device: str) -> Outcome:
    reg = make_registry(MLA)
    reg.workspace("mla", device, x=rank + 1)
    saved = torch.cuda.is_initialized, torch.cuda.is_current_stream_capturing
    if rank == 0:  # this process is the scenario's own: it stands in for a rank capturing a CUDA graph
        torch.cuda.is_initialized = lambda: True  # type: ignore[assignment]
        torch.cuda.is_current_stream_capturing = lambda: True  # type: ignore[assignment]
    try:
        first = _agree_outcome(reg, device)
    finally:
        torch.cuda.is_initialized, torch.cuda.is_current_stream_capturing = saved  # type: ignore[assignment]
    return _then_agree(reg, device, first)


def _bad_device(rank: int, world: int, device: str) -> Outcome:
    reg = make_registry(MLA)
    reg.workspace("mla", device, x=rank + 1)
    return _then_agree(reg, device, _agree_outcome(reg, "no-such-device" if rank == 1 else device))


ONE_RANK_FAILS: dict[str, Scenario] = {
    "reserve_outside_int64": _reserve_outside_int64,
    "reserve_not_a_size": _reserve_not_a_size,
    "capturing_rank": _capturing_rank,
    "bad_device": _bad_device,
}


@pytest.fixture(scope="module")
def one_rank_fails() -> dict[int, dict[str, Outcome]]:
    """Run the scenarios in which one rank's own arguments or state are wrong, on a gloo world of 2."""
    return run_world(2, ONE_RANK_FAILS, backend="gloo")


def _same_error_everywhere(outcomes: dict[int, dict[str, Outcome]], scenario: str, error: str) -> str:
    """Check every rank raised ``error`` with one message, allocated nothing, and then agreed normally."""
    messages = set()
    for rank, out in outcomes.items():
        first, then = out[scenario]["first"], out[scenario]["then"]
        assert first["error"] == error, (rank, first)
        assert first["caps"] == {"mla/main": (rank + 1) * KiB}  # nothing grew
        assert then["error"] is None and out[scenario]["caps"] == {"mla/main": 2 * KiB}, (rank, then)
        messages.add(first["message"])
    (message,) = messages
    return message


def test_a_reserve_outside_int64_on_one_rank_raises_on_every_rank(
    one_rank_fails: dict[int, dict[str, Outcome]],
) -> None:
    """reserve = 2**70 on rank 0 only: every rank raises the same config error; none waits in all_reduce."""
    message = _same_error_everywhere(one_rank_fails, "reserve_outside_int64", "AgreementConfigError")
    assert message == (
        "wspool.distributed.agree over 2 ranks refused by rank 0 (before the ranks compared sizes; nothing was "
        "allocated on any rank): rank 0: reserve[('mla', 'main')]: size 1180591620717411303424 exceeds the limit "
        "of 1024TiB"
    )


def test_a_reserve_that_is_no_size_on_one_rank_raises_on_every_rank(
    one_rank_fails: dict[int, dict[str, Outcome]],
) -> None:
    """A reserve of 'lots' and a key that is no (pool, lane) pair, on the last rank: both named, on every rank."""
    message = _same_error_everywhere(one_rank_fails, "reserve_not_a_size", "AgreementConfigError")
    assert message.startswith(
        "wspool.distributed.agree over 2 ranks refused by rank 1 (before the ranks compared sizes; nothing was "
        "allocated on any rank): rank 1: reserve[('mla', 'main')]: invalid size 'lots': expected a non-negative "
        "number with an optional unit"
    )
    assert message.endswith("; rank 1: reserve['not a key']: too many values to unpack (expected 2)")


def test_a_rank_capturing_a_graph_makes_every_rank_raise(one_rank_fails: dict[int, dict[str, Outcome]]) -> None:
    """Rank 0 in the middle of a CUDA-graph capture: every rank raises the frozen error; none hangs."""
    message = _same_error_everywhere(one_rank_fails, "capturing_rank", "AgreementFrozenError")
    assert message == (
        "wspool.distributed.agree over 2 ranks refused by rank 0 (before the ranks compared sizes; nothing was "
        "allocated on any rank): rank 0: wspool.distributed.agree() cannot run during CUDA-graph capture on cpu: "
        "agree before capturing (its collectives would be captured, not run)"
    )
    assert "WorkspaceFrozenError" in one_rank_fails[1]["capturing_rank"]["first"]["mro"]


def test_a_bad_device_on_one_rank_raises_on_every_rank(one_rank_fails: dict[int, dict[str, Outcome]]) -> None:
    """device='no-such-device' on rank 1: every rank raises a config error naming it."""
    message = _same_error_everywhere(one_rank_fails, "bad_device", "AgreementConfigError")
    assert message.startswith(
        "wspool.distributed.agree over 2 ranks refused by rank 1 (before the ranks compared sizes; nothing was "
        "allocated on any rank): rank 1: device='no-such-device' does not name a device (invalid device"
    )
