"""An engine's reservation: its pools grown to their bounds over its limits, before it sizes its KV cache.

Each engine's integration computes the limits its configuration gives (largest
batch, tokens, heads per rank, DCP world, speculative tokens) and the pools and
rules its attention backends call, then calls :func:`reserve_for_engine` from
the engine's own memory-sizing step, so the KV cache is sized with the
workspaces already counted. ``WSPOOL_RESERVE=0`` turns it off (pools then grow
on first use). Each rank logs one line; with ``WSPOOL_STATS_DIR`` it writes a
JSON snapshot of its pools after reserving, after capture and at exit, which
``wspool stats --from DIR`` reads. Never raises into the engine: a rule that
cannot be bounded or a buffer that cannot be allocated is a warning. Runs on
the engine's loading thread; no lock is held while logging or writing.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from wspool.bounds import FactLimit, Reservation, apply_reservation, plan_reservation
from wspool.devices import DeviceLike
from wspool.errors import WspoolError
from wspool.integrations import RESERVE_ENV_VAR
from wspool.integrations.patching import parse_switch
from wspool.registry import PoolRegistry, get_registry
from wspool.units import format_size

__all__ = [
    "RESERVE_ENV_VAR",
    "STATS_DIR_ENV_VAR",
    "engine_plan",
    "read_snapshots",
    "reserve_for_engine",
    "reserving_enabled",
    "write_snapshot",
]

#: A folder: each rank writes ``wspool-rank<R>.json`` there (after reserving, after capture, at exit).
STATS_DIR_ENV_VAR = "WSPOOL_STATS_DIR"

logger = logging.getLogger(__name__)
_exit_hooked = threading.Event()
_Plan = TypeVar("_Plan")


def reserving_enabled() -> bool:
    """Whether :data:`RESERVE_ENV_VAR` leaves the reservation on (a malformed value is a warning, and on)."""
    try:
        return parse_switch(RESERVE_ENV_VAR)
    except WspoolError as exc:
        logger.warning("wspool: %s; reserving", exc)
        return True


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except (ImportError, RuntimeError, ValueError):
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def engine_plan(
    engine: str, plan: Callable[[], _Plan], pools: Callable[[PoolRegistry], object]
) -> tuple[_Plan, PoolRegistry] | None:
    """Return what ``plan`` reads of the engine's configuration, and the registry in force with the engine's pools.

    ``pools(registry)`` declares and checks them. Where either raises (the engine's
    configuration changed shape, a pool is misconfigured) the reservation is left
    out with one warning, ``None``: the pools grow on first use.
    """
    try:
        planned = plan()
        registry = get_registry()
        pools(registry)
    except Exception as exc:
        logger.warning("wspool: %s's pools not reserved: %s: %s", engine, type(exc).__name__, exc)
        return None
    return planned, registry


def reserve_for_engine(
    engine: str,
    limits: Mapping[str, FactLimit],
    rules: Mapping[str, Iterable[str]],
    *,
    device: DeviceLike,
    lanes: Iterable[str],
    engine_bytes: int | None = None,
    registry: PoolRegistry | None = None,
) -> Reservation | None:
    """Reserve ``rules`` (pool -> the rules the engine calls) at their bounds over ``limits``; log one line.

    Args:
        engine: The engine's name, for the log line ("vLLM").
        limits: The limits the engine's configuration gives (each naming its setting as ``source``).
        rules: The pools the engine's attention backends use, and their rules.
        device: The rank's device.
        lanes: The lanes the engine's micro-batches and workspace lanes use.
        engine_bytes: What the engine's own constants would hold, for the log line.
        registry: Default :func:`wspool.get_registry`.

    Returns:
        The reservation, or ``None`` where it is off, has nothing to reserve, or failed (logged).
    """
    if not reserving_enabled():
        logger.info("wspool: %s=0: %s's pools grow on first use", RESERVE_ENV_VAR, engine)
        return None
    if not rules:
        logger.info("wspool: %s uses none of wspool's pools here: nothing to reserve", engine)
        return None
    registry = registry or get_registry()
    try:
        plan = plan_reservation(registry, limits, pools=list(rules), devices=[device], lanes=list(lanes), rules=rules)
        apply_reservation(registry, plan)
    except WspoolError as exc:
        logger.warning("wspool: %s's pools not reserved (they grow on first use): %s", engine, exc)
        return None
    for row in plan.refusals:
        logger.warning("wspool: %s.%s not reserved (it grows on first use): %s", row.pool, row.rule, row.refusal)
    own = "" if engine_bytes is None else f"; {engine}'s own constants would hold {format_size(engine_bytes)}"
    logger.info("wspool: rank %d reserved %s before %s sizes its KV cache%s", _rank(), plan.summary(), engine, own)
    write_snapshot("reserved", registry, plan=plan, engine_bytes=engine_bytes)
    return plan


def write_snapshot(
    event: str,
    registry: PoolRegistry | None = None,
    *,
    plan: Reservation | None = None,
    engine_bytes: int | None = None,
) -> Path | None:
    """Write this rank's pools to ``$WSPOOL_STATS_DIR/wspool-rank<R>.json`` under ``event``; ``None`` when unset.

    The file keeps the latest snapshot of each event (``reserved``, ``captured``,
    ``exit``); the first call also writes one at exit. A write that fails is a warning.
    """
    folder = os.environ.get(STATS_DIR_ENV_VAR, "").strip()
    if not folder:
        return None
    registry = registry or get_registry()
    rank = _rank()
    path = Path(folder) / f"wspool-rank{rank}.json"
    snapshot: dict[str, Any] = {
        "time": time.time(),
        "pools": [
            {f.name: getattr(s, f.name) for f in dataclasses.fields(s)} | {"requests_by_rule": dict(s.requests_by_rule)}
            for s in registry.all_stats()
        ],
    }
    if plan is not None:
        snapshot["reservation"] = plan.as_dict()
    if engine_bytes is not None:
        snapshot["engine_bytes"] = engine_bytes
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        if not isinstance(data, dict) or data.get("pid") != os.getpid():
            data = {"rank": rank, "pid": os.getpid(), "events": {}}
        data["events"][event] = snapshot
        path.write_text(json.dumps(data, indent=1))
    except OSError as exc:
        logger.warning("wspool: cannot write %s (%s): %s", path, STATS_DIR_ENV_VAR, exc.strerror or exc)
        return None
    if not _exit_hooked.is_set():
        _exit_hooked.set()
        atexit.register(write_snapshot, "exit", registry)
    return path


def read_snapshots(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Return the snapshots of every rank in ``folder``, sorted by rank (``wspool stats --from``).

    Raises:
        ValueError: ``folder`` is not a folder, holds no snapshot, or one is not wspool's JSON (named).
    """
    base = Path(folder)
    if not base.is_dir():
        raise ValueError(f"--from {folder}: not a folder (set {STATS_DIR_ENV_VAR} to it in the engine's environment)")
    found = []
    for path in sorted(base.glob("wspool-rank*.json")):
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("events"), dict):
                raise ValueError
        except (OSError, ValueError):
            raise ValueError(f"--from {folder}: {path.name} is not a wspool snapshot") from None
        found.append(data)
    if not found:
        raise ValueError(f"--from {folder}: no wspool-rank*.json (the engine writes them with {STATS_DIR_ENV_VAR})")
    return sorted(found, key=lambda d: d.get("rank", 0))
