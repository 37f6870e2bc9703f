"""A pool's configuration (:class:`PoolSpec`), its statistics (:class:`PoolStats`) and the allocator type.

Plain data: nothing here allocates, locks or touches CUDA except the default
allocator, which allocates on the device it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from wspool.errors import describe_setting
from wspool.rules import SizeRule, compile_rule

__all__ = ["Allocator", "PoolSpec", "PoolStats", "zeros_allocator"]


#: Makes a zero-filled ``uint8`` tensor of ``nbytes`` on ``device``.
Allocator = Callable[[int, torch.device], torch.Tensor]


def zeros_allocator(nbytes: int, device: torch.device) -> torch.Tensor:
    """Allocate a zero-filled ``uint8`` buffer (the default allocator)."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of one pool's state; reading it has no side effects.

    Attributes:
        pool: The pool's name.
        device: The device, as a string (``"cuda:0"``, ``"cpu"``).
        lane: The lane (``"main"`` unless a lane was chosen).
        capacity_bytes: Size of the current buffer (0 before the first request).
        peak_request_bytes: Largest size any request resolved to.
        request_count: Requests served.
        grow_count: Times the buffer was (re)allocated, the first allocation included.
        last_grow_reason: Why the buffer last grew, e.g. ``"rule lse: 256MiB"``.
        refused_count: Requests refused (frozen, capturing, over the limit, out of memory).
        retired_bytes: Bytes of old buffers kept alive for captured graphs.
        requests_by_rule: Requests served per rule (or per reason for sized requests).
    """

    pool: str
    device: str
    lane: str
    capacity_bytes: int
    peak_request_bytes: int
    request_count: int
    grow_count: int
    last_grow_reason: str | None
    refused_count: int = 0
    retired_bytes: int = 0
    requests_by_rule: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))


class PoolSpec:
    """A pool's configuration, shared by its instances on every device and lane.

    Args:
        name: The pool's name.
        rules: Rule name -> rule source (size or expression).
        growth: ``"exact"``, ``"power_of_two"`` or a granularity size string.
        max_bytes: Largest capacity allowed, or ``None``.
        rule_pools: For rules that another pool brought to this one's buffer
            (``shared_with``), the pool whose key sets them; others are this pool's.
        facts: The pool's configured default facts (``pools.<name>.facts``).
        rule_facts: For rules another pool brought, that pool's default facts.
    """

    def __init__(
        self,
        name: str,
        rules: Mapping[str, str | int],
        growth: str = "exact",
        max_bytes: int | None = None,
        rule_pools: Mapping[str, str] | None = None,
        facts: Mapping[str, int] | None = None,
        rule_facts: Mapping[str, Mapping[str, int]] | None = None,
    ) -> None:
        from wspool.units import parse_size  # the one place sizes are parsed

        self.name = name
        self.rule_pools: dict[str, str] = {rule: (rule_pools or {}).get(rule, name) for rule in rules}
        """Rule name -> the pool whose ``pools.<pool>.rules.<rule>`` key sets it."""
        self.rules: dict[str, SizeRule] = {
            rule: compile_rule(source, ("pools", self.rule_pools[rule], "rules", rule))
            for rule, source in rules.items()
        }
        self.facts: dict[str, int] = dict(facts or {})
        """The pool's own default facts."""
        self.rule_facts: dict[str, Mapping[str, int]] = {
            rule: (rule_facts or {}).get(rule, self.facts) for rule in rules
        }
        """Rule name -> the default facts of the pool that brought it (this pool's, for its own rules)."""
        self.growth = growth
        self.granularity = 0 if growth in ("exact", "power_of_two") else parse_size(growth)
        self.max_bytes = max_bytes

    def setting(self, *parts: str) -> str:
        """Name a setting of this pool as ``"key / ENV_VAR"``."""
        return describe_setting(("pools", self.name, *parts))

    def rule_setting(self, rule: str) -> str:
        """Name the key that sets ``rule`` (in the pool that brought it, for shared buffers)."""
        return describe_setting(("pools", self.rule_pools.get(rule, self.name), "rules", rule))

    def capacity_for(self, nbytes: int) -> int:
        """Return the capacity to allocate for a request of ``nbytes``."""
        if self.growth == "power_of_two":
            capacity = 1 << max(nbytes - 1, 0).bit_length()
        elif self.granularity:
            capacity = -(-nbytes // self.granularity) * self.granularity
        else:
            capacity = nbytes
        if self.max_bytes is not None and capacity > self.max_bytes >= nbytes:
            capacity = self.max_bytes  # rounding may not push a fitting request over the cap
        return capacity
