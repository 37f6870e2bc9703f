"""Agree workspace sizes across the ranks of a ``torch.distributed`` process group.

Engines run one process per GPU (tensor, expert, decode-context parallel). If
ranks size their workspaces differently, their CUDA graphs differ and one rank
can run out of memory where the others do not. :func:`agree` makes every rank
of a group hold, for every (pool, lane), the largest capacity that any rank
holds or reserves, and refuses on every rank at once when one rank cannot.

Device semantics: :func:`agree` works on the pools of one device per rank
(``device=None`` or ``"cuda"``: the current device at call time). The
collectives use CPU tensors on backends that take them (gloo) and the rank's
CUDA device on NCCL, so NCCL ranks must have called ``torch.cuda.set_device``.

Thread semantics: :func:`agree` is a collective. Every rank of the group calls
it, in the same order as its other collectives on that group, and no other
thread runs collectives on the group meanwhile.

Capture semantics: call it before freezing and before CUDA-graph capture; it
refuses to run while the current stream is capturing. A rank that is frozen
and would have to grow is found before anything is allocated, and every rank
raises the same :class:`AgreementError`.

``import wspool.distributed`` creates no CUDA context and does not need a
process group; only :func:`agree` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from wspool.devices import DeviceLike, resolve_device
from wspool.errors import ConfigError, WorkspaceFrozenError, WorkspaceLimitError, WspoolError
from wspool.units import format_size

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


@dataclass(frozen=True)
class AgreedChange:
    """One pool that :func:`agree` grew on this rank.

    Attributes:
        pool: The pool's name.
        lane: The lane.
        device: The device, as a string (``"cuda:0"``, ``"cpu"``).
        old_bytes: The capacity before (0 where the pool had no buffer or did not exist).
        new_bytes: The capacity after.
    """

    pool: str
    lane: str
    device: str
    old_bytes: int
    new_bytes: int


@dataclass(frozen=True)
class Refusal:
    """Why one rank could not take one pool to the agreed size.

    Attributes:
        rank: The rank in the group.
        pool: The pool's name.
        lane: The lane.
        device: The rank's device, as a string.
        kind: ``"frozen"``, ``"limit"`` (``max_bytes`` or out of memory), ``"config"``
            (the pool is not configured on that rank) or ``"error"``.
        needed_bytes: The agreed size (the maximum over the ranks).
        available_bytes: The rank's capacity.
        detail: What the rank said, and which setting changes it.
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
    """Ranks could not agree; raised on every rank of the group with the same message.

    Attributes:
        refusals: Every rank's refusals, sorted by rank, pool and lane.
    """

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
    reserve: Mapping[_Key, int] | None = None,
) -> list[AgreedChange]:
    """Grow every (pool, lane) on every rank to the maximum capacity over the ranks.

    A collective over ``group``: every rank must call it. Ranks may hold
    different pools; a pool that only some ranks hold is created on the others.
    Before anything is allocated, the ranks check together that each can grow
    (not frozen, within ``max_bytes``, pool configured); if one cannot, every
    rank raises the same error and no rank allocates. If an allocation then
    fails (out of memory), every rank raises too; ranks that had already grown
    keep their larger buffers.

    Device, thread and capture semantics are the module's: one device per
    rank, a collective on ``group`` (one caller per rank, in the same order as
    the group's other collectives), never during CUDA-graph capture.

    Args:
        registry: This rank's registry.
        group: The process group; ``None`` is the default (world) group.
        device: This rank's device for its pools; ``None`` is the current
            device (CUDA when available, else the CPU), ``"cuda"`` the current
            CUDA device, resolved once per call. Pools on other devices are untouched.
        reserve: Sizes this rank wants in addition to what its pools hold,
            keyed by ``(pool, lane)``; they count in the maximum like capacities.

    Returns:
        This rank's changes, sorted by pool and lane (empty when all agreed already).

    Raises:
        AgreementFrozenError: A frozen rank would have to grow (also a ``WorkspaceFrozenError``).
        AgreementLimitError: A rank is over ``max_bytes`` or out of memory (also a ``MemoryError``).
        AgreementConfigError: A pool is not configured on some rank (also a ``ValueError``).
        AgreementError: Capacities still differ after several rounds (``growth`` differs between ranks).
        WorkspaceFrozenError: The current CUDA stream is capturing (raised before any collective).
        RuntimeError: ``torch.distributed`` is unavailable or not initialised.
    """
    dist = _distributed()
    local = resolve_device(device)
    if local.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise WorkspaceFrozenError(
            f"wspool.distributed.agree() cannot run during CUDA-graph capture on {local}: "
            "agree before capturing (its collectives would be captured, not run)"
        )
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    wanted = {(str(p), str(lane)): int(n) for (p, lane), n in (reserve or {}).items()}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, sorted(set(_local_pools(registry, local)) | set(wanted)), group=group)
    keys: list[_Key] = sorted({(str(p), str(lane)) for keys_of_rank in gathered for p, lane in keys_of_rank})
    if not keys:
        return []
    collective_device = _collective_device(dist, group, local)
    reason = f"agree: max over {world} ranks"
    before: dict[_Key, int] = {}
    for round_index in range(MAX_ROUNDS + 1):
        pools = _local_pools(registry, local)
        have = [pools[k].capacity_bytes if k in pools else 0 for k in keys]
        need = [max(h, wanted.get(k, 0)) for k, h in zip(keys, have, strict=True)]
        # One MAX all-reduce gives both the largest need and (negated) the smallest capacity.
        reduced = torch.tensor(need + [-h for h in have], dtype=torch.int64, device=collective_device)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
        values = [int(v) for v in reduced.tolist()]
        targets, least = values[: len(keys)], [-v for v in values[len(keys) :]]
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
        refusals = []
        for key, target, held in todo:
            refusal = _check(registry, pools.get(key), key, target, held, local, rank)
            if refusal is not None:
                refusals.append(refusal)
        spared = "nothing was allocated on any rank" if round_index == 0 else "this round allocated nothing"
        _raise_if_any(dist, group, refusals, world, spared)
        failures = []
        for key, target, held in todo:
            before.setdefault(key, held)
            try:
                pool = pools.get(key) or registry.pool(key[0], local, lane=key[1])
                pool.grow_to(target, reason)
            except Exception as exc:  # any local failure must reach the other ranks, or they hang
                kind = _kind(exc)
                failures.append(Refusal(rank, key[0], key[1], str(local), kind, target, held, str(exc)))
        _raise_if_any(dist, group, failures, world, "ranks without a refusal may have grown already")
    pools = _local_pools(registry, local)
    changes = [
        AgreedChange(pool, lane, str(local), old, pools[(pool, lane)].capacity_bytes)
        for (pool, lane), old in sorted(before.items())
        if (pool, lane) in pools and pools[(pool, lane)].capacity_bytes != old
    ]
    return changes


def _distributed() -> Any:
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("wspool.distributed.agree() needs torch.distributed, which this PyTorch build lacks")
    if not dist.is_initialized():
        raise RuntimeError(
            "wspool.distributed.agree() needs a process group: call torch.distributed.init_process_group() first"
        )
    return dist


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
        spec = pool.spec if pool is not None else registry.spec(name)
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
