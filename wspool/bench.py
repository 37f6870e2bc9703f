"""Benchmarks that print their figures: the per-call path against the seed's bare function.

The seed (vLLM's FlashInfer MLA backend) kept one module-level buffer and a
size check: ``_get_workspace_buffer(return_lse)``. wspool replaces it with a
registry lookup and a rule resolution, which must stay within a small factor
of it. Figures are medians over many timed batches after warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from wspool.registry import PoolRegistry

__all__ = ["HotPathFigures", "measure_hot_path", "time_per_call_ns"]

_SEED_DEFAULT_BYTES = 128 * 1024 * 1024
_SEED_LSE_BYTES = 256 * 1024 * 1024
_LSE_EXPRESSION = "8 * num_heads * batch_size * round_up(q_len, 256) + 1MiB + 32MiB"


def _seed_function(device: torch.device) -> Callable[[bool], torch.Tensor]:
    """Rebuild the seed's ``_get_workspace_buffer`` (a module global and one size check)."""
    state: dict[str, torch.Tensor | None] = {"buffer": None}

    def _get_workspace_buffer(return_lse: bool) -> torch.Tensor:
        buffer_size = _SEED_LSE_BYTES if return_lse else _SEED_DEFAULT_BYTES
        buffer = state["buffer"]
        if buffer is None or buffer.numel() < buffer_size:
            buffer = state["buffer"] = torch.zeros(buffer_size, dtype=torch.uint8, device=device)
        return buffer

    return _get_workspace_buffer


def time_per_call_ns(call: Callable[[], object], *, batch: int = 2000, repeats: int = 101) -> float:
    """Return the median time of one ``call()`` in nanoseconds over ``repeats`` timed batches."""
    for _ in range(batch):
        call()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(repeats):
        start = clock()
        for _ in range(batch):
            call()
        samples.append((clock() - start) / batch)
    return statistics.median(samples)


@dataclass(frozen=True)
class HotPathFigures:
    """Median per-call costs of the hot path, in nanoseconds."""

    device: str
    seed_bare_ns: float
    literal_rule_ns: float
    expression_rule_ns: float
    empty_loop_ns: float

    @property
    def literal_vs_seed(self) -> float:
        """How many times the seed's cost a literal-rule request costs."""
        return self.literal_rule_ns / self.seed_bare_ns

    def as_dict(self) -> dict[str, Any]:
        """Return the figures and ratios as plain data (for ``--json``)."""
        return {**asdict(self), "literal_vs_seed": self.literal_vs_seed}


def measure_hot_path(device: str = "cpu", *, repeats: int = 101) -> HotPathFigures:
    """Measure ``reg.workspace(...)`` against the seed's function on ``device``.

    All three are timed in the same run, each through a closure of the same
    shape, so the loop's own overhead (reported as ``empty_loop_ns``) is in
    every figure alike.
    """
    registry = PoolRegistry.from_config(
        pools={"flashinfer_mla": {"rules": {"default": "128MiB", "lse": "256MiB", "lse_expr": _LSE_EXPRESSION}}}
    )
    target = torch.device(device)
    seed = _seed_function(target)
    workspace = registry.workspace

    def seed_call() -> object:
        return seed(True)

    def literal_call() -> object:
        return workspace("flashinfer_mla", device, rule="lse")

    def expression_call() -> object:
        return workspace("flashinfer_mla", device, rule="lse_expr", batch_size=64, num_heads=128, q_len=1)

    def empty_call() -> object:
        return None

    return HotPathFigures(
        device=str(target),
        seed_bare_ns=time_per_call_ns(seed_call, repeats=repeats),
        literal_rule_ns=time_per_call_ns(literal_call, repeats=repeats),
        expression_rule_ns=time_per_call_ns(expression_call, repeats=repeats),
        empty_loop_ns=time_per_call_ns(empty_call, repeats=repeats),
    )
