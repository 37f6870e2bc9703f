"""The engine path: each engine getter wspool replaces, timed at the engine's call site against the engine's own.

For every installed engine (vLLM, SGLang) this loads wspool's integration,
then times, in one process and in interleaved rounds, the call as the engine
writes it (a module global or a method looked up at call time) with the
attribute set to the engine's original and to wspool's replacement, in turn.
The engine's own functions run in their steady state: their cached buffer is
made once first (on the CPU where they would name CUDA). Wrappers that record
a call's shape are timed around a call that does nothing, so the figure is what
the wrapper adds. Each probe says how often the engine calls it; vLLM's MLA
getters are timed again under the hopper profile. Figures: docs/performance.md.

Device semantics: the CPU (``WSPOOL_VLLM_DEVICE`` / ``WSPOOL_SGLANG_DEVICE`` are
set to ``cpu`` here). Nothing here runs at import; an engine that is not
installed is reported as such.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from wspool.targets import Patch

__all__ = ["ProbeFigures", "measure_engine_path"]

_MiB = 1 << 20


@dataclass(frozen=True)
class ProbeFigures:
    """One probe's per-call times, in nanoseconds (the minimum over the rounds)."""

    engine: str
    call: str
    path: str  # how often the engine makes the call: per layer, per step, per construction
    own_ns: float
    wspool_ns: float

    @property
    def ratio(self) -> float:
        """wspool's time over the engine's own."""
        return self.wspool_ns / self.own_ns

    def as_dict(self) -> dict[str, Any]:
        """The figures and the ratio as plain data."""
        return {**asdict(self), "ratio": self.ratio}


@dataclass(frozen=True)
class _Probe:
    call: str
    path: str
    own: Callable[[], object]
    wspool: Callable[[], object]
    # Puts the engine's original in place around the timing of ``own`` (None: ``own`` calls it directly).
    own_in_place: Callable[[], AbstractContextManager[None]] | None = None


@contextmanager
def _as_is() -> Iterator[None]:
    yield


def _per_call_ns(call: Callable[[], object], batch: int) -> float:
    clock = time.perf_counter_ns
    start = clock()
    for _ in range(batch):
        call()
    return (clock() - start) / batch


def _interleaved(probes: list[_Probe], rounds: int, batch: int) -> list[tuple[float, float]]:
    """Time each probe's two calls in alternation, ``rounds`` times; the minimum of each."""
    best = [[float("inf"), float("inf")] for _ in probes]
    for probe in probes:  # warm both
        with (probe.own_in_place or _as_is)():
            _per_call_ns(probe.own, batch // 10 or 1)
        _per_call_ns(probe.wspool, batch // 10 or 1)
    for _ in range(rounds):
        for slot, probe in zip(best, probes, strict=True):
            with (probe.own_in_place or _as_is)():
                slot[0] = min(slot[0], _per_call_ns(probe.own, batch))
            slot[1] = min(slot[1], _per_call_ns(probe.wspool, batch))
    return [(own, mine) for own, mine in best]


@contextmanager
def _set(owner: Any, attr: str, value: Any) -> Iterator[None]:
    before = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        setattr(owner, attr, before)


def _in_place(patch: Patch) -> Callable[[], AbstractContextManager[None]]:
    """A context that puts the engine's original back where wspool's replacement is, for one timed batch."""
    return lambda: _set(patch.owner, patch.attr, patch.original)


def _module_call(module: Any, name: str, original: Any, args: str, call: str, path: str, **bound: Any) -> _Probe:
    """A probe of ``name(args)`` looked up in ``module``: wspool's as patched, the original in a copy of its globals."""
    source = f"def site():\n    return {name}({args})\n"
    own_globals = {**module.__dict__, name: original, **bound}
    mine_globals = {**module.__dict__, **bound}
    own_ns: dict[str, Any] = {}
    mine_ns: dict[str, Any] = {}
    exec(compile(source, "<call site>", "exec"), own_globals, own_ns)
    exec(compile(source, "<call site>", "exec"), mine_globals, mine_ns)
    return _Probe(call, path, own_ns["site"], mine_ns["site"])


def _wrapper_probe(call: str, path: str, wrap: Callable[[Any], Any], args: tuple[Any, ...], **kw: Any) -> _Probe:
    """What a wrapper adds: the wrapper around a function that does nothing, against that function."""

    def nothing(*_args: Any, **_kw: Any) -> None:
        return None

    wrapped = wrap(nothing)
    return _Probe(call, path, lambda: nothing(*args, **kw), lambda: wrapped(*args, **kw))


def _applied(integration: Any) -> dict[str, Patch]:
    return {patch.name: patch for patch in integration.patches.applied()}


def _vllm_probes() -> list[_Probe]:
    os.environ["WSPOOL_VLLM_DEVICE"] = "cpu"
    from wspool.integrations import vllm

    vllm.register()
    patches = _applied(vllm.INTEGRATION)
    mla = importlib.import_module("vllm.v1.attention.backends.mla.flashinfer_mla")
    # vLLM's own MLA getter allocates on "cuda": its steady state is its cached buffer, made here on the CPU.
    vars(mla)["_fi_workspace"] = torch.zeros(256 * _MiB, dtype=torch.int8)
    q = torch.zeros(4, 16, 576)
    probes = []
    name = f"{mla.__name__}._get_workspace_buffer"
    if name in patches:
        original = patches[name].original
        probes.append(_module_call(mla, "_get_workspace_buffer", original, "True", "MLA workspace (LSE)", "per layer"))
        probes.append(_module_call(mla, "_get_workspace_buffer", original, "False", "MLA workspace", "per layer"))
    name = f"{mla.__name__}._get_multi_ctas_kv_counter_buffer"
    if name in patches:
        probes.append(
            _module_call(
                mla,
                "_get_multi_ctas_kv_counter_buffer",
                patches[name].original,
                "4096, q.device",
                "MLA multi-CTA counters",
                "per layer",
                q=q,
            )
        )
    dsv4 = "vllm.models.deepseek_v4.nvidia.flashinfer_sparse"
    for module_name, attr, label in (
        ("vllm.v1.attention.backends.mla.flashinfer_mla_sparse", "_get_workspace_buffer", "sparse MLA workspace"),
        (dsv4, "get_flashinfer_dsv4_workspace", "DeepSeek V4 workspace"),  # vLLM 0.34's name
        (dsv4, "_get_flashinfer_dsv4_workspace", "DeepSeek V4 workspace"),  # vLLM 0.33's
    ):
        name = f"{module_name}.{attr}"
        if name in patches:
            module = importlib.import_module(module_name)
            probes.append(_module_call(module, attr, patches[name].original, "q.device", label, "per layer", q=q))
    if f"{mla.__name__}.FlashInferMLAImpl.forward_mqa" in patches:
        probes.append(
            _wrapper_probe(
                "forward_mqa wrapper (added)",
                "per layer",
                vllm.INTEGRATION.getters.wrap_forward_mqa,
                (object(), q, None, None, None),
            )
        )
    if "vllm.models.kimi_k3.nvidia.specialized_decode.drafter.attention.folded_decode" in patches:
        # Kimi K3's drafter (vLLM 0.34), as its attention calls it: a buffer of the pool's, the LSE asked.
        workspace = vllm.INTEGRATION.getters.get_mla_workspace_buffer(True)
        probes.append(
            _wrapper_probe(
                "folded_decode wrapper (added)",
                "per drafter layer",
                vllm.INTEGRATION.getters.wrap_folded_decode,
                (q, None, None, None, 8, 4),
                workspace=workspace,
                return_lse=True,
                dcp_world_size=1,
                kv_lora_rank=512,
            )
        )
    return probes


def _sglang_probes() -> list[_Probe]:
    os.environ["WSPOOL_SGLANG_DEVICE"] = "cpu"
    from wspool.integrations import sglang

    sglang.register()
    patches = _applied(sglang.INTEGRATION)
    context_module = importlib.import_module("sglang.srt.runtime_context")
    name = f"{context_module.__name__}.RuntimeContext.get_buffer"
    if name not in patches:
        return []
    ctx = context_module.get_context()
    made = torch.zeros(16)
    ctx.get_buffer("k3_symm:bench", lambda: made)  # a name wspool does not pool, as Kimi K3's per-layer buffers

    def call() -> object:
        return ctx.get_buffer("k3_symm:bench", _factory)

    def _factory() -> torch.Tensor:
        return made

    probes = [
        _Probe("RuntimeContext.get_buffer (a name not pooled)", "per layer", call, call, _in_place(patches[name]))
    ]
    probes.extend(_sglang_plan_probes())
    return probes


class _MLAWrapper:
    """Stands in for a FlashInfer MLA wrapper: wspool binds any object, held weakly."""


def _sglang_plan_probes() -> list[_Probe]:
    """What the MLA indices updater's wrapper adds to each step's plan call, for a wrapper bound to a region."""
    from wspool.flashinfer import wrapper_buffers
    from wspool.integrations.sglang import wrappers
    from wspool.registry import get_registry

    wrapper = _MLAWrapper()
    binding = wrapper_buffers.bind_mla_wrapper(
        wrapper, registry=get_registry(), device=torch.device("cpu"), lane="main", facts={"sm_count": 132}
    )
    if binding is None:
        return []
    # SGLang's call, as its decode updater makes it: six positional arguments after the wrapper, two keywords.
    arguments = (object(), wrapper, torch.ones(4), 4, torch.arange(5), torch.arange(5), False, None)
    probe = _wrapper_probe(
        "call_begin_forward wrapper (added)",
        "per step",
        wrappers.supplying_mla_decode,
        arguments,
        plan=object(),
        req_pool_indices=torch.arange(4),
    )
    return [_Probe(probe.call, probe.path, probe.own, probe.wspool)]


def _vllm_hopper_probes() -> list[_Probe]:
    """vLLM's MLA getters again under the hopper profile (its rules read facts vLLM never passes)."""
    from wspool.registry import PoolRegistry, set_registry

    # The engine path runs on the CPU, which has no SM count: the H200's stands in.
    set_registry(PoolRegistry.from_config(profile="hopper", pools={"flashinfer_mla": {"facts": {"sm_count": 132}}}))
    return [
        _Probe(f"{p.call}, hopper profile", p.path, p.own, p.wspool, p.own_in_place)
        for p in _vllm_probes()
        if p.call.startswith("MLA workspace")
    ]


#: Each engine: its distribution and its probe sets, each set timed on its own (a set may change the registry).
_ENGINES: tuple[tuple[str, str, tuple[Callable[[], list[_Probe]], ...]], ...] = (
    ("vLLM", "vllm", (_vllm_probes, _vllm_hopper_probes)),
    ("SGLang", "sglang", (_sglang_probes,)),
)


def measure_engine_path(*, rounds: int = 30, batch: int = 20000) -> dict[str, Any]:
    """Time every probe of every installed engine; return ``{engine: {"version", "rows"} or {"skipped"}}``."""
    from importlib.metadata import PackageNotFoundError, version

    from wspool.registry import get_registry, set_registry

    results: dict[str, Any] = {}
    for engine, distribution, probe_sets in _ENGINES:
        try:
            found = version(distribution)
        except PackageNotFoundError:
            results[engine] = {"skipped": f"{engine} is not installed here"}
            continue
        registry = get_registry()
        rows: list[dict[str, Any]] = []
        try:
            for probes_of in probe_sets:
                probes = probes_of()
                times = _interleaved(probes, rounds, batch)
                rows.extend(
                    ProbeFigures(engine, p.call, p.path, own, mine).as_dict()
                    for p, (own, mine) in zip(probes, times, strict=True)
                )
        finally:
            set_registry(registry)
        results[engine] = {"version": found, "rows": rows}
    return results
