"""Agree workspace sizes across the ranks of a ``torch.distributed`` process group.

:func:`agree` is a collective, called by every rank in the same order as its
other collectives on the group. One device per rank; collectives use CPU
tensors on gloo, else the rank's CUDA device (after ``torch.cuda.set_device``).
Call it before freezing and capture; a capturing rank refuses. Importing it
creates no CUDA context. Details: docs/multi-gpu.md.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from wspool.devices import DeviceLike, resolve_device
from wspool.errors import ConfigError, WorkspaceFrozenError, WorkspaceLimitError, WspoolError, quote
from wspool.units import format_size, parse_size

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from wspool.pool import PoolSource, WorkspacePool

__all__ = [
    "AgreedChange",
    "AgreementConfigError",
    "AgreementError",
    "AgreementFrozenError",
    "AgreementLimitError",
    "Refusal",
    "agree",
]

#: Growth rounds before giving up when ranks round capacities differently (differing ``growth``).
MAX_ROUNDS = 4

_Key = tuple[str, str]  # (pool, lane)
#: What a rank found wrong before the first collective: (refusal kind, what to change).
_Problem = tuple[str, str]
_CPU = torch.device("cpu")


@dataclass(frozen=True)
class AgreedChange:
    """One pool that :func:`agree` grew on this rank (``old_bytes`` 0 where it had no buffer)."""

    pool: str
    lane: str
    device: str
    old_bytes: int
    new_bytes: int


@dataclass(frozen=True)
class Refusal:
    """Why one rank could not take one pool to the agreed size.

    ``kind`` is ``"frozen"``, ``"limit"`` (``max_bytes`` or out of memory),
    ``"config"`` (the pool is not configured on that rank) or ``"error"``.
    """

    rank: int
    pool: str
    lane: str
    device: str
    kind: str
    needed_bytes: int
    available_bytes: int
    detail: str

    def describe(self) -> str:
        """Return one line naming the rank, pool, lane, needed and available bytes."""
        return (
            f"rank {self.rank}: pool {self.pool!r} (lane {self.lane}) on {self.device} needs "
            f"{self.needed_bytes} bytes ({format_size(self.needed_bytes)}), {self.available_bytes} bytes "
            f"available: {self.detail}"
        )


class AgreementError(WspoolError):
    """Ranks could not agree; raised on every rank of the group with the same message and ``refusals``."""

    def __init__(self, message: str, refusals: tuple[Refusal, ...] = ()) -> None:
        super().__init__(message)
        self.refusals = refusals


class AgreementFrozenError(AgreementError, WorkspaceFrozenError):
    """A frozen rank would have had to grow; nothing was allocated on any rank."""


class AgreementLimitError(AgreementError, WorkspaceLimitError):
    """A rank would exceed ``max_bytes`` or ran out of device memory."""


class AgreementConfigError(AgreementError, ConfigError):
    """A pool that another rank uses is not configured on some rank."""


def agree(
    registry: PoolSource,
    group: ProcessGroup | None = None,
    *,
    device: DeviceLike = None,
    reserve: Mapping[_Key, int | str] | None = None,
) -> list[AgreedChange]:
    """Grow every (pool, lane) on ``device`` on every rank to the largest capacity any rank holds or reserves.

    A pool only some ranks hold is created on the others. The ranks check
    together that each can grow before any allocates; when one cannot, or an
    allocation fails, every rank raises the same error (ranks that grew keep
    their buffers). ``reserve`` adds sizes per ``(pool, lane)``, at most 1 PiB;
    a ``shared_with`` pool's size is agreed, checked and grown as its host's
    buffer, under the host's name. Returns this rank's changes, sorted by pool
    (the buffer's) and lane.

    Raises:
        AgreementFrozenError: A frozen rank would have to grow, or a rank is capturing.
        AgreementLimitError: A rank is over ``max_bytes`` or out of memory.
        AgreementConfigError: A pool is not configured on some rank, or a bad ``device`` or ``reserve``.
        AgreementError: Capacities still differ after :data:`MAX_ROUNDS` rounds (``growth`` differs).
        WorkspaceFrozenError: This rank is capturing and the group has no CPU backend to tell the others.
    """
    dist = _distributed()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    local, wanted, problems = _local_request(device, reserve)
    wanted = _by_buffer(registry, wanted)
    if any(kind == "frozen" for kind, _ in problems) and _collective_device(dist, group, _CPU).type != "cpu":
        # An NCCL-only group runs its collectives on this rank's capturing stream: they cannot run.
        raise WorkspaceFrozenError(dict(problems)["frozen"])
    held = _local_pools(registry, local) if local is not None else {}
    keys = _gather_keys(dist, group, world, sorted(set(held) | set(wanted)), problems)
    if not keys or local is None:  # local is None only with a problem, which raised on every rank
        return []
    before = _grow_to_max(dist, group, world, rank, registry, local, keys, wanted)
    pools = _local_pools(registry, local)
    return [
        AgreedChange(pool, lane, str(local), old, pools[(pool, lane)].capacity_bytes)
        for (pool, lane), old in sorted(before.items())
        if (pool, lane) in pools and pools[(pool, lane)].capacity_bytes != old
    ]


def _distributed() -> Any:
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("wspool.distributed.agree() needs torch.distributed, which this PyTorch build lacks")
    if not dist.is_initialized():
        raise RuntimeError(
            "wspool.distributed.agree() needs a process group: call torch.distributed.init_process_group() first"
        )
    return dist


def _local_request(
    device: DeviceLike, reserve: Mapping[_Key, int | str] | None
) -> tuple[torch.device | None, dict[_Key, int], list[_Problem]]:
    """Resolve this rank's device and reserve, and check it is not capturing; never raise: collect the problems."""
    problems: list[_Problem] = []
    try:
        local: torch.device | None = resolve_device(device)
    except ValueError as exc:
        local = None
        problems.append(("config", f"device={quote(device)} does not name a device ({exc})"))
    # Whatever the pools' device: a rank in the middle of a capture is in no state to agree.
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():  # type: ignore[no-untyped-call]
        problems.append(
            (
                "frozen",
                f"wspool.distributed.agree() cannot run during CUDA-graph capture on {local}: agree before "
                "capturing (its collectives would be captured, not run)",
            )
        )
    wanted: dict[_Key, int] = {}
    if reserve is not None and not isinstance(reserve, Mapping):
        problems.append(("config", f"reserve must map (pool, lane) to a size, got {type(reserve).__name__}"))
        return local, wanted, problems
    for key, size in (reserve or {}).items():
        try:
            pool, lane = key
            wanted[(str(pool), str(lane))] = _reserve_bytes(size)
        except (TypeError, ValueError) as exc:  # a key that is no pair; a SizeError (a ValueError)
            problems.append(("config", f"reserve[{quote(key)}]: {exc}"))
    return local, wanted, problems


def _by_buffer(registry: PoolSource, wanted: Mapping[_Key, int]) -> dict[_Key, int]:
    """Key each reserve by the pool whose buffer it draws from (a ``shared_with`` host), the larger where two meet."""
    hosts: dict[_Key, int] = {}
    for (pool, lane), nbytes in wanted.items():
        key = (registry.buffer_pool(pool), lane)
        hosts[key] = max(hosts.get(key, 0), nbytes)
    return hosts


def _reserve_bytes(size: object) -> int:
    """A reserve's size in bytes: an integer (numpy's too) or a size string, at most 1 PiB; else ``SizeError``."""
    if not isinstance(size, (str, bool)):
        with contextlib.suppress(TypeError):
            size = operator.index(size)  # type: ignore[arg-type]
    return parse_size(size)


def _gather_keys(
    dist: Any, group: ProcessGroup | None, world: int, mine: list[_Key], problems: list[_Problem]
) -> list[_Key]:
    """The first collective: every key any rank holds or reserves, sorted; a problem on any rank raises on all."""
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (mine, problems), group=group)
    found = [(r, kind, text) for r, (_, rank_problems) in enumerate(gathered) for kind, text in rank_problems]
    if found:
        ranks = sorted({r for r, _, _ in found})
        message = (
            f"wspool.distributed.agree over {world} ranks refused by rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))} (before the ranks compared sizes; nothing was allocated on any rank): "
            + "; ".join(f"rank {r}: {text}" for r, _, text in found)
        )
        kinds = {kind for _, kind, _ in found}
        raise (AgreementFrozenError if "frozen" in kinds else AgreementConfigError)(message)
    return sorted({(str(p), str(lane)) for rank_keys, _ in gathered for p, lane in rank_keys})


def _grow_to_max(
    dist: Any,
    group: ProcessGroup | None,
    world: int,
    rank: int,
    registry: PoolSource,
    local: torch.device,
    keys: list[_Key],
    wanted: Mapping[_Key, int],
) -> dict[_Key, int]:
    """Reduce, check and grow until every rank holds the maximum of every key; return the capacities before."""
    collective_device = _collective_device(dist, group, local)
    reason = f"agree: max over {world} ranks"
    before: dict[_Key, int] = {}
    for round_index in range(MAX_ROUNDS + 1):
        pools = _local_pools(registry, local)
        have = [pools[k].capacity_bytes if k in pools else 0 for k in keys]
        need = [max(h, wanted.get(k, 0)) for k, h in zip(keys, have, strict=True)]
        targets, least = _reduce_max(dist, group, collective_device, need, have)
        if all(low >= target for low, target in zip(least, targets, strict=True)):
            break
        if round_index == MAX_ROUNDS:
            differ = [f"{p!r} (lane {lane})" for (p, lane), low, t in zip(keys, least, targets, strict=True) if low < t]
            raise AgreementError(
                f"wspool.distributed.agree: capacities of pool(s) {', '.join(differ)} still differ between "
                f"the {world} ranks after {MAX_ROUNDS} rounds; make pools.<pool>.growth / "
                "WSPOOL_POOLS__<POOL>__GROWTH the same on every rank"
            )
        todo = [(k, t, h) for k, t, h in zip(keys, targets, have, strict=True) if h < t]
        refusals = [r for k, t, h in todo if (r := _check(registry, pools.get(k), k, t, h, local, rank)) is not None]
        spared = "nothing was allocated on any rank" if round_index == 0 else "this round allocated nothing"
        _raise_if_any(dist, group, refusals, world, spared)
        failures = []
        for key, target, held in todo:
            before.setdefault(key, held)
            try:
                pool = pools.get(key) or registry.pool(key[0], local, lane=key[1])
                pool.grow_to(target, reason)
            except Exception as exc:  # any local failure must reach the other ranks, or they hang
                failures.append(Refusal(rank, key[0], key[1], str(local), _kind(exc), target, held, str(exc)))
        _raise_if_any(dist, group, failures, world, "ranks without a refusal may have grown already")
    return before


def _reduce_max(
    dist: Any, group: ProcessGroup | None, device: torch.device, need: list[int], have: list[int]
) -> tuple[list[int], list[int]]:
    """Return the largest need and smallest capacity of each key over the ranks, in one int64 MAX all-reduce."""
    reduced = torch.tensor(need + [-h for h in have], dtype=torch.int64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    values = [int(v) for v in reduced.tolist()]
    return values[: len(need)], [-v for v in values[len(need) :]]


def _check(
    registry: PoolSource,
    pool: WorkspacePool | None,
    key: _Key,
    target: int,
    held: int,
    device: torch.device,
    rank: int,
) -> Refusal | None:
    """Say why this rank would refuse to grow ``key`` to ``target``, allocating nothing."""
    name, lane = key

    def refuse(kind: str, detail: str) -> Refusal:
        return Refusal(rank, name, lane, str(device), kind, target, held, detail)

    try:
        # A pool not created yet: its configuration under this device's profile (a host's cap is its buffer's).
        spec = pool.spec if pool is not None else registry.spec(name, device)
    except ConfigError as exc:
        return refuse("config", f"{exc}; configure the pool the same way on every rank")
    if spec.max_bytes is not None and target > spec.max_bytes:
        return refuse(
            "limit",
            f"above max_bytes = {spec.max_bytes} bytes ({format_size(spec.max_bytes)}); "
            f"raise {spec.setting('max_bytes')} on every rank",
        )
    if registry.is_frozen:
        return refuse(
            "frozen",
            "the registry is frozen; agree (or warmup(..., agree_group=...)) on every rank before "
            "freeze() and CUDA-graph capture",
        )
    return None


def _kind(exc: BaseException) -> str:
    if isinstance(exc, WorkspaceFrozenError):
        return "frozen"
    if isinstance(exc, (WorkspaceLimitError, MemoryError)):
        return "limit"
    return "config" if isinstance(exc, ConfigError) else "error"


def _raise_if_any(dist: Any, group: ProcessGroup | None, mine: list[Refusal], world: int, consequence: str) -> None:
    """Share every rank's refusals; if there are any, raise the same error on every rank."""
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    refusals = tuple(
        sorted((r for rank_refusals in gathered for r in rank_refusals), key=lambda r: (r.rank, r.pool, r.lane))
    )
    if not refusals:
        return
    ranks = sorted({r.rank for r in refusals})
    message = (
        f"wspool.distributed.agree over {world} ranks refused by rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks))} ({consequence}): " + "; ".join(r.describe() for r in refusals)
    )
    kinds = {r.kind for r in refusals}
    classes = (("frozen", AgreementFrozenError), ("config", AgreementConfigError), ("limit", AgreementLimitError))
    cls = next((c for kind, c in classes if kind in kinds), AgreementError)
    raise cls(message, refusals)


def _local_pools(registry: PoolSource, device: torch.device) -> dict[_Key, WorkspacePool]:
    return {(p.spec.name, p.lane): p for p in registry.pools() if p.device == device}


def _collective_device(dist: Any, group: ProcessGroup | None, local: torch.device) -> torch.device:
    """Pick where the all-reduce tensor lives: CPU where the backend takes it, else the rank's accelerator."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:  # e.g. "cpu:gloo,cuda:nccl": one backend per device type
        types = [part.split(":", 1)[0].strip() for part in backend.split(",")]
    else:
        capability: dict[str, list[str]] = getattr(dist.Backend, "backend_capability", {})
        types = capability.get(backend, ["cuda"] if backend == "nccl" else ["cpu"])
    if "cpu" in types:
        return torch.device("cpu")
    if local.type in types:
        return local
    if "cuda" in types:
        return torch.device("cuda", torch.cuda.current_device())
    return local
