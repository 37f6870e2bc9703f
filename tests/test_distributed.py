"""Tests for wspool.distributed: pool sizes agreed across torch.distributed ranks.

Each world (2 and 4 processes, gloo on 127.0.0.1) is spawned once per module and
runs every scenario in order on one process group; the tests then check what
each rank reported. A rank that hangs fails the test at the join timeout.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import wspool
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
#: Longer than the collectives' own timeout, so a stuck collective reports before we give up.
JOIN_TIMEOUT_S = 90.0
COLLECTIVE_TIMEOUT_S = 45.0

Outcome = dict[str, Any]


def _registry(pools: dict[str, Any], allocator: Any = None) -> wspool.PoolRegistry:
    return wspool.PoolRegistry(wspool.load_settings(pools=pools), allocator=allocator)


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
    reg = _registry(MLA)
    reg.workspace("mla", device, x=rank + 1)
    reg.workspace("mla", device, lane="ubatch1", x=world - rank)
    changes = agree(reg, device=device)
    again = agree(reg, device=device)
    stats = reg.stats("mla", device)
    reason = stats.last_grow_reason
    return {"caps": _caps(reg), "changes": _changes(changes), "again": _changes(again), "reason": reason}


def _missing(rank: int, world: int, device: str) -> Outcome:
    reg = _registry({**MLA, "paged": {"rules": {"default": "3KiB"}}})
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
    reg = _registry(MLA)
    reg.workspace("mla", device, x=rank + 1)
    if rank == 0:
        reg.freeze()
    return _refused(reg, device)


def _frozen_at_max(rank: int, world: int, device: str) -> Outcome:
    reg = _registry(MLA)
    reg.workspace("mla", device, x=rank + 1)
    if rank == world - 1:
        reg.freeze()
    return {"changes": _changes(agree(reg, device=device)), "caps": _caps(reg)}


def _limit(rank: int, world: int, device: str) -> Outcome:
    reg = _registry({"mla": {**MLA["mla"], "max_bytes": "1KiB" if rank == 0 else None}})
    reg.workspace("mla", device, x=rank + 1)
    return _refused(reg, device)


def _unconfigured(rank: int, world: int, device: str) -> Outcome:
    extra = {"only0": {"rules": {"default": "2KiB"}}} if rank == 0 else {}
    reg = _registry({**MLA, **extra})
    reg.workspace("mla", device, x=1)
    if rank == 0:
        reg.workspace("only0", device)
    return _refused(reg, device)


def _oom(rank: int, world: int, device: str) -> Outcome:
    def allocator(nbytes: int, where: torch.device) -> torch.Tensor:
        if rank == 0 and nbytes > KiB:
            raise torch.OutOfMemoryError(f"simulated: cannot allocate {nbytes} bytes")
        return torch.zeros(nbytes, dtype=torch.uint8, device=where)

    reg = _registry(MLA, allocator)
    reg.workspace("mla", device, x=rank + 1)
    try:
        agree(reg, device=device)
    except Exception as exc:
        return {**_error(exc), "caps": _caps(reg)}
    return {"error": None}


def _warmup(rank: int, world: int, device: str) -> Outcome:
    reg = _registry(MLA)
    capacity = reg.warmup("mla", [{"x": 1}, {"x": rank + 1}], device, agree_group=dist.group.WORLD)
    stats = reg.stats("mla", device)
    return {"capacity": capacity, "grows": stats.grow_count, "peak": stats.peak_request_bytes}


def _growth_differs(rank: int, world: int, device: str) -> Outcome:
    reg = _registry({"mla": {**MLA["mla"], "growth": "4KiB" if rank == 0 else "exact"}})
    reg.workspace("mla", device, x=1 if rank == 0 else rank + 4)
    return {"changes": _changes(agree(reg, device=device)), "caps": _caps(reg)}


SCENARIOS: dict[str, Callable[[int, int, str], Outcome]] = {
    "needs": _needs,
    "missing": _missing,
    "frozen": _frozen,
    "frozen_at_max": _frozen_at_max,
    "limit": _limit,
    "unconfigured": _unconfigured,
    "oom": _oom,
    "warmup": _warmup,
    "growth_differs": _growth_differs,
}


def _worker(rank: int, world: int, port: int, backend: str, results: Any) -> None:
    for name in [n for n in os.environ if n.startswith("WSPOOL_")]:
        del os.environ[name]
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    outcomes: dict[str, Outcome] = {}
    try:
        device = "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = "cuda"
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        for name, scenario in SCENARIOS.items():
            outcomes[name] = scenario(rank, world, device)
        dist.destroy_process_group()
    except BaseException:
        outcomes["crash"] = {"traceback": traceback.format_exc()}
    results.put((rank, outcomes))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_world(world: int, backend: str = "gloo") -> dict[int, dict[str, Outcome]]:
    """Spawn ``world`` ranks running every scenario; return each rank's outcomes, failing on a hang."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, backend, results), daemon=True) for r in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    outcomes: dict[int, dict[str, Outcome]] = {}
    try:
        while len(outcomes) < world and time.monotonic() < deadline:
            try:
                rank, out = results.get(timeout=0.5)
                outcomes[rank] = out
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
        for proc in procs:
            proc.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    silent = sorted(set(range(world)) - set(outcomes))
    codes = [p.exitcode for p in procs]
    assert not silent, f"ranks {silent} did not report within {JOIN_TIMEOUT_S}s (exit codes {codes}): hang or crash"
    crashes = {r: o["crash"]["traceback"] for r, o in outcomes.items() if "crash" in o}
    assert not crashes, f"ranks crashed: {crashes}"
    return outcomes


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def world(request: pytest.FixtureRequest) -> tuple[int, dict[int, dict[str, Outcome]]]:
    """Run every scenario once on a gloo world of 2 and of 4 processes."""
    return request.param, run_world(request.param)


def test_different_needs_end_with_equal_capacities(world: tuple[int, dict[int, dict[str, Outcome]]]) -> None:
    """Ranks with different needs all end with the largest capacity of every pool and lane."""
    size, outcomes = world
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


def test_pool_missing_on_a_rank_is_created_there(world: tuple[int, dict[int, dict[str, Outcome]]]) -> None:
    """A pool or lane that only one rank uses is created, at the same size, on every other rank."""
    _, outcomes = world
    for out in outcomes.values():
        assert out["missing"]["caps"] == {"mla/spare": 2 * KiB, "paged/main": 3 * KiB}
    assert outcomes[0]["missing"]["changes"] == [("mla", "spare", 0, 2 * KiB)]
    assert outcomes[1]["missing"]["changes"][-1] == ("paged", "main", 0, 3 * KiB)


def test_frozen_rank_refuses_on_every_rank_before_allocating(world: tuple[int, dict[int, dict[str, Outcome]]]) -> None:
    """A frozen rank that would have to grow makes every rank raise the same frozen error, allocating nothing."""
    size, outcomes = world
    messages = {out["frozen"]["message"] for out in outcomes.values()}
    assert len(messages) == 1
    for out in outcomes.values():
        frozen = out["frozen"]
        assert frozen["error"] == "AgreementFrozenError"
        assert {"WorkspaceFrozenError", "AgreementError", "WspoolError"} <= set(frozen["mro"])
        assert frozen["refusals"] == [(0, "mla", "main", "frozen", size * KiB, KiB)]
        assert frozen["unchanged"]
    expected = (
        rf"agree over {size} ranks refused by rank 0 \(nothing was allocated on any rank\): rank 0: "
        rf"pool 'mla' \(lane main\) on cpu needs {size * KiB} bytes \({size}KiB\), 1024 bytes available: "
        r"the registry is frozen; agree .* before freeze\(\)"
    )
    with pytest.raises(AgreementFrozenError, match=expected):
        _reraise(outcomes[1]["frozen"])


def test_frozen_rank_already_at_the_max_does_not_refuse(world: tuple[int, dict[int, dict[str, Outcome]]]) -> None:
    """A frozen rank that already holds the largest capacity lets the others grow to it."""
    size, outcomes = world
    for rank, out in outcomes.items():
        assert out["frozen_at_max"]["caps"] == {"mla/main": size * KiB}
        grown = [] if rank == size - 1 else [("mla", "main", (rank + 1) * KiB, size * KiB)]
        assert out["frozen_at_max"]["changes"] == grown


def test_rank_over_max_bytes_refuses_on_every_rank(world: tuple[int, dict[int, dict[str, Outcome]]]) -> None:
    """A rank whose max_bytes is below the agreed size makes every rank raise a limit error naming the setting."""
    size, outcomes = world
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


def test_unconfigured_pool_refuses_on_every_rank(world: tuple[int, dict[int, dict[str, Outcome]]]) -> None:
    """A pool that one rank uses but others do not configure is a config error on every rank, naming those ranks."""
    size, outcomes = world
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


def test_out_of_memory_while_growing_raises_on_every_rank(world: tuple[int, dict[int, dict[str, Outcome]]]) -> None:
    """A rank that runs out of memory while growing makes every rank raise, instead of leaving them waiting."""
    size, outcomes = world
    for rank, out in outcomes.items():
        oom = out["oom"]
        assert oom["error"] == "AgreementLimitError"
        assert oom["refusals"] == [(0, "mla", "main", "limit", size * KiB, KiB)]
        assert "ranks without a refusal may have grown already" in oom["message"]
        assert "out of memory" in oom["message"]
        assert oom["caps"] == {"mla/main": KiB if rank == 0 else size * KiB}


def test_warmup_with_agree_group_grows_once_to_the_max(world: tuple[int, dict[int, dict[str, Outcome]]]) -> None:
    """warmup(agree_group=WORLD) grows every rank once, straight to the largest size over the ranks."""
    size, outcomes = world
    for rank, out in outcomes.items():
        assert out["warmup"] == {"capacity": size * KiB, "grows": 1, "peak": (rank + 1) * KiB}


def test_differing_growth_policies_still_converge(world: tuple[int, dict[int, dict[str, Outcome]]]) -> None:
    """When one rank rounds capacities up (growth: 4KiB), further rounds bring every rank to its capacity."""
    _, outcomes = world
    for rank, out in outcomes.items():
        assert out["growth_differs"]["caps"] == {"mla/main": 8 * KiB}
        assert out["growth_differs"]["changes"] == [("mla", "main", (4 if rank == 0 else rank + 4) * KiB, 8 * KiB)]


def _reraise(outcome: Outcome) -> None:
    """Raise the error class a rank reported, with its message, so pytest.raises(match=...) can pin the text."""
    classes = {c.__name__: c for c in (AgreementFrozenError, AgreementLimitError, AgreementConfigError, AgreementError)}
    raise classes[outcome["error"]](outcome["message"])


def test_agree_without_a_process_group_says_so() -> None:
    """agree() before init_process_group is a clear error, not a hang."""
    with pytest.raises(RuntimeError, match=r"call torch\.distributed\.init_process_group\(\) first"):
        agree(_registry(MLA), device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for an NCCL world of 2")
def test_nccl_world_of_two_agrees() -> None:
    """Over NCCL on two GPUs, agree() runs the same code path: equal capacities and errors on every rank."""
    outcomes = run_world(2, backend="nccl")
    for rank, out in outcomes.items():
        assert out["needs"]["caps"] == {"mla/main": 2 * KiB, "mla/ubatch1": 2 * KiB}
        assert out["frozen"]["error"] == "AgreementFrozenError"
        assert out["frozen"]["refusals"] == [(0, "mla", "main", "frozen", 2 * KiB, KiB)]
        assert out["warmup"]["capacity"] == 2 * KiB
        assert out["oom"]["caps"] == {"mla/main": KiB if rank == 0 else 2 * KiB}
