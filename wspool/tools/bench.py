"""``wspool bench``: the per-call path against vLLM's bare function, and the GPU sections.

A section that cannot run or raised says so and the others still run.
Single-threaded; the GPU sections use the current CUDA device. Sections and
figures: docs/performance.md.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from wspool.flashinfer.backends import BLACKWELL_ARCHS
from wspool.registry import PoolRegistry
from wspool.settings.profiles import shipped_config
from wspool.settings.schema import VLLM_FIXED_MLA_WORKSPACE_BYTES
from wspool.tools.sweep import DEFAULT_SHAPES, MLAShape
from wspool.units import GiB

__all__ = [
    "SECTIONS",
    "HotPathFigures",
    "default_rules_file",
    "machine_info",
    "measure_hot_path",
    "memory_sweep_blocker",
    "run_benchmarks",
    "time_per_call_ns",
]

#: The sections of ``wspool bench``, in the order they run and print.
SECTIONS = ("hot_path", "engine_path", "mla_decode", "mla_plan", "decode_step", "memory")
#: The sections that run on the CPU too; the others need a CUDA device.
CPU_SECTIONS = ("hot_path", "engine_path")

_LSE_EXPRESSION = "8 * num_heads * batch_size * round_up(q_len, 256) + 1MiB + 32MiB"


def _vllm_function(device: torch.device) -> Callable[[bool], torch.Tensor]:
    """Rebuild vLLM's ``_get_workspace_buffer`` (a module global and one size check)."""
    state: dict[str, torch.Tensor | None] = {"buffer": None}
    default_bytes, lse_bytes = VLLM_FIXED_MLA_WORKSPACE_BYTES["default"], VLLM_FIXED_MLA_WORKSPACE_BYTES["lse"]

    def _get_workspace_buffer(return_lse: bool) -> torch.Tensor:
        buffer_size = lse_bytes if return_lse else default_bytes
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
    # "seed" names vLLM's function in the JSON keys, which saved figure files (--plot-from) still carry.
    seed_bare_ns: float
    literal_rule_ns: float
    expression_rule_ns: float
    empty_loop_ns: float

    @property
    def literal_vs_seed(self) -> float:
        """How many times vLLM's cost a literal-rule request costs."""
        return self.literal_rule_ns / self.seed_bare_ns

    def as_dict(self) -> dict[str, Any]:
        """Return the figures and ratios as plain data (for ``--json``)."""
        return {**asdict(self), "literal_vs_seed": self.literal_vs_seed}


def measure_hot_path(device: str = "cpu", *, repeats: int = 101) -> HotPathFigures:
    """Measure ``reg.workspace(...)`` against vLLM's function on ``device``, through closures of one shape."""
    registry = PoolRegistry.from_config(
        pools={"flashinfer_mla": {"rules": {"default": "128MiB", "lse": "256MiB", "lse_expr": _LSE_EXPRESSION}}}
    )
    target = torch.device(device)
    vllm = _vllm_function(target)
    workspace = registry.workspace

    def vllm_call() -> object:
        return vllm(True)

    def literal_call() -> object:
        return workspace("flashinfer_mla", device, rule="lse")

    def expression_call() -> object:
        return workspace("flashinfer_mla", device, rule="lse_expr", batch_size=64, num_heads=128, q_len=1)

    def empty_call() -> object:
        return None

    return HotPathFigures(
        device=str(target),
        seed_bare_ns=time_per_call_ns(vllm_call, repeats=repeats),
        literal_rule_ns=time_per_call_ns(literal_call, repeats=repeats),
        expression_rule_ns=time_per_call_ns(expression_call, repeats=repeats),
        empty_loop_ns=time_per_call_ns(empty_call, repeats=repeats),
    )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device | None) -> dict[str, str]:
    """Describe where the figures came from: CPU, GPU, library versions."""
    try:
        flashinfer = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        flashinfer = "not installed"
    info = {
        "cpu": f"{_cpu_model()} ({os.cpu_count()} threads)",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "flashinfer": flashinfer,
        "gpu": "none",
    }
    if device is not None:
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = (
            f"{props.name} (compute capability {props.major}.{props.minor}, "
            f"{props.multi_processor_count} SMs, {props.total_memory / GiB:.0f} GiB)"
        )
        info["cuda"] = str(torch.version.cuda)
    return info


def default_rules_file(device: torch.device) -> Path:
    """The shipped rules for ``device``: ``blackwell.yaml`` on SM100/103/107, else ``hopper.yaml`` (package data)."""
    blackwell = torch.cuda.get_device_capability(device) in BLACKWELL_ARCHS
    return shipped_config("blackwell" if blackwell else "hopper")


def run_benchmarks(
    *,
    sections: Sequence[str] = SECTIONS,
    hot_device: str | None = None,
    repeats: int = 101,
    runs: int | None = None,
    rules_file: str | os.PathLike[str] | None = None,
    shapes: Sequence[MLAShape] = DEFAULT_SHAPES,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the chosen :data:`SECTIONS` in one process and return their figures as plain data.

    ``runs`` is timed pairs per GPU figure (``None``: 1000 per ``mla_decode``
    figure, 100 per decode-step figure); ``rules_file`` defaults to :func:`default_rules_file`.
    """
    say = progress or (lambda line: None)
    registry = None if rules_file is None else PoolRegistry.from_config(rules_file)  # a bad file fails first
    gpu = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    figures: dict[str, Any] = {"machine": machine_info(gpu)}
    if hot_device is None:
        hot_device = "cpu" if gpu is None else str(gpu)
    if "hot_path" in sections:
        say(f"hot path on {hot_device} ...")
        figures["hot_path"] = measure_hot_path(hot_device, repeats=repeats).as_dict()
    if "engine_path" in sections:
        say("engine path (each installed engine's getters at its call sites) ...")
        from wspool.tools.engine_path import measure_engine_path

        figures["engine_path"] = measure_engine_path()
    gpu_sections = [s for s in SECTIONS if s in sections and s not in CPU_SECTIONS]
    if not gpu_sections:
        return figures
    why = _gpu_skip_reason(gpu)
    if why is not None:
        figures.update({s: {"skipped": why} for s in gpu_sections})
        return figures
    assert gpu is not None
    from wspool.tools import bench_gpu
    from wspool.tools.mla_probe import MLAWorkspaceProbe

    rules = Path(rules_file) if rules_file is not None else default_rules_file(gpu)
    if registry is None:
        registry = PoolRegistry.from_config(rules)
    call_runs, step_runs = runs or 1000, runs or 100

    def mla_decode() -> dict[str, Any]:
        rows = bench_gpu.measure_mla_decode(registry, gpu, runs=call_runs)
        return {"rules_file": str(rules), "runs": call_runs, "rows": [r.as_dict() for r in rows]}

    def memory() -> dict[str, Any]:
        rows = bench_gpu.measure_memory(registry, shapes, MLAWorkspaceProbe(gpu))
        return {"rules_file": str(rules), "rows": [r.as_dict() for r in rows]}

    def mla_plan() -> dict[str, Any]:
        return bench_gpu.measure_mla_plan(gpu).as_dict()

    def decode_step() -> dict[str, Any]:
        rows = bench_gpu.measure_decode_step(registry, gpu, runs=step_runs)
        return {"rules_file": str(rules), "runs": step_runs, "rows": [r.as_dict() for r in rows]}

    # The step (with its CUDA-graph capture) runs last; a failed section is recorded and the rest still run.
    for name, measure in (
        ("mla_decode", mla_decode), ("mla_plan", mla_plan), ("memory", memory), ("decode_step", decode_step),
    ):  # fmt: skip
        if name in sections:
            say(f"{name} ...")
            try:
                figures[name] = measure()
            except Exception as exc:
                figures[name] = {"failed": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    return figures


def memory_sweep_blocker() -> str | None:
    """Why the memory sweep (what ``--plot`` draws) cannot run on this machine's current GPU; ``None`` if it can."""
    return _gpu_skip_reason(torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None)


def _gpu_skip_reason(gpu: torch.device | None) -> str | None:
    if gpu is None:
        return "no CUDA device"
    if torch.cuda.get_device_capability(gpu) in BLACKWELL_ARCHS:
        return (
            "the direct baseline and the workspace probe cover FlashInfer's planned wrapper "
            "(Hopper, Ampere); this device takes the trtllm-gen path"
        )
    return None
