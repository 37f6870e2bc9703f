"""Spawn a world of ranks, one process each, that run named scenarios and report what they saw.

A scenario is a module-level function ``(rank, world, device) -> dict`` (so the
spawned processes can import it). Every rank runs every scenario in order, on
one process group when there is a backend, and puts its outcomes on a queue;
:func:`run_world` returns them by rank and fails the test, naming the silent
ranks, when a rank has not reported by the join timeout (a hang or a crash).

Ranks use gloo on 127.0.0.1 with CPU pools, or NCCL (or no process group) with
one CUDA device per rank: rank ``r`` calls ``torch.cuda.set_device(r)`` and
gets ``device="cuda"``, the current device.
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
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "JOIN_TIMEOUT_S",
    "Outcome",
    "Scenario",
    "cuda_world_skip_reason",
    "run_world",
]

#: Longer than the collectives' own timeout, so a stuck collective reports before we give up.
JOIN_TIMEOUT_S = 90.0
COLLECTIVE_TIMEOUT_S = 45.0

Outcome = dict[str, Any]
Scenario = Callable[[int, int, str], Outcome]


def cuda_world_skip_reason(needed: int = 2) -> str:
    """The reason a test of a world of one process per CUDA device skips here."""
    count = torch.cuda.device_count()
    return f"needs at least {needed} CUDA devices, one per rank; this machine has {count}"


def _worker(
    rank: int, world: int, port: int, backend: str | None, scenarios: Mapping[str, Scenario], results: Any
) -> None:
    for name in [n for n in os.environ if n.startswith("WSPOOL_")]:
        del os.environ[name]
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    outcomes: dict[str, Outcome] = {}
    try:
        device = "cpu"
        if backend != "gloo":
            torch.cuda.set_device(rank)
            device = "cuda"
        if backend is not None:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            )
        for name, scenario in scenarios.items():
            outcomes[name] = scenario(rank, world, device)
        if backend is not None:
            dist.destroy_process_group()
    except BaseException:
        outcomes["crash"] = {"traceback": traceback.format_exc()}
    results.put((rank, outcomes))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_world(
    world: int,
    scenarios: Mapping[str, Scenario],
    *,
    backend: str | None = "gloo",
    join_timeout_s: float = JOIN_TIMEOUT_S,
) -> dict[int, dict[str, Outcome]]:
    """Spawn ``world`` ranks running every scenario; return each rank's outcomes, failing on a hang.

    Args:
        world: The number of ranks (processes).
        scenarios: Name -> module-level scenario function, run in this order on every rank.
        backend: ``"gloo"`` (CPU pools), ``"nccl"`` (one CUDA device per rank) or ``None``
            (one CUDA device per rank, no process group).
        join_timeout_s: How long every rank has, in all, to report.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, backend, dict(scenarios), results), daemon=True)
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + join_timeout_s
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
    assert not silent, f"ranks {silent} did not report within {join_timeout_s}s (exit codes {codes}): hang or crash"
    crashes = {r: o["crash"]["traceback"] for r, o in outcomes.items() if "crash" in o}
    assert not crashes, f"ranks crashed: {crashes}"
    return outcomes
