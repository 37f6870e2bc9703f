"""The facts of an SGLang engine that wspool's sizing rules read, and what SGLang itself would allocate.

At each ``get_buffer(name, factory)`` the rules see ``sglang_bytes`` (the
factory run under fake tensors: nothing allocated, no CUDA context) and the
model runner's facts, which exist only inside an attention backend's
constructor (:func:`building`). The runner being built is a context variable,
following the constructing thread or task; what the integration read of
SGLang when it loaded is :data:`RUNTIME`. Nothing here imports SGLang. Each
fact and its source: docs/sglang.md ("Facts: sizes that follow the engine").
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from wspool.units import positive_int

__all__ = [
    "FACT_NAMES",
    "RUNTIME",
    "Request",
    "Runtime",
    "building",
    "current_facts",
    "facts_from_runner",
    "prefill_rows",
    "probe_factory",
    "set_context_readers",
]

#: The facts this module can give a rule, in the order of the table above.
FACT_NAMES = (
    "sglang_bytes",
    "num_heads",
    "num_qo_heads",
    "num_kv_heads",
    "head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "page_size",
    "batch_size",
    "kv_dtype_size",
    "dtype_bytes",
    "cp_world",
    "q_len",
)


@dataclass(frozen=True)
class Request:
    """What SGLang's factory allocates: a tensor of ``shape`` and ``dtype`` on ``device`` (``"cuda"`` resolved)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        """The size in bytes: elements times the element size."""
        count = 1
        for extent in self.shape:
            count *= extent
        return count * self.dtype.itemsize


def probe_factory(factory: Callable[[], Any]) -> Request:
    """Return what SGLang's ``get_buffer`` ``factory`` would allocate, without allocating (``TypeError``: no tensor)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        made = factory()
    if not isinstance(made, torch.Tensor):
        raise TypeError(f"the factory returns {type(made).__name__}, not a tensor")
    return Request(tuple(made.shape), made.dtype, made.device)


def _read(get: Callable[[], Any]) -> Any:
    # SGLang's accessors raise while its configuration is not published (a bare
    # runner in a test, a process that never publishes): the facts they give are left out.
    try:
        return get()
    except Exception:
        return None


def _itemsize(dtype: object) -> int | None:
    return positive_int(getattr(dtype, "itemsize", None))


_UNKNOWN = object()  # a context SGLang could not give: every fact read from it is left out


def _q_len(spec: Any) -> int | None:
    if spec is None:
        return 1
    try:
        tokens = spec.speculative_num_draft_tokens
    except Exception:
        return None
    return positive_int(tokens) or 1  # SGLang's None: no speculative decoding, one query token


def facts_from_runner(runner: Any, *, parallel: Any = None, spec: Any = None) -> dict[str, int]:
    """Return the positive facts a ``ModelRunner`` and SGLang's context give; missing ones are left out.

    ``parallel`` and ``spec`` are the runtime context's ``get_parallel()`` and
    ``get_spec()``; ``None``: one attention-TP rank without DCP, no speculation.
    """
    tp = positive_int(_read(lambda: parallel.attn_tp_size)) if parallel is not None else 1
    model = getattr(runner, "model_config", None)
    heads = positive_int(getattr(model, "num_attention_heads", None))
    facts: dict[str, int | None] = {
        "num_heads": heads // tp if heads and tp else None,
        "num_kv_heads": positive_int(_read(lambda: model.get_num_kv_heads(tp))) if model is not None and tp else None,
        "head_dim": positive_int(getattr(model, "head_dim", None)),
        "kv_lora_rank": positive_int(getattr(model, "kv_lora_rank", None)),
        "qk_rope_head_dim": positive_int(getattr(model, "qk_rope_head_dim", None)),
        "page_size": positive_int(getattr(runner, "page_size", None)),
        "batch_size": positive_int(getattr(runner, "max_running_requests", None)),
        "kv_dtype_size": _itemsize(getattr(runner, "kv_cache_dtype", None)),
        "dtype_bytes": _itemsize(getattr(runner, "dtype", None)),
        "cp_world": positive_int(_read(lambda: parallel.attn_dcp_size)) if parallel is not None else 1,
        "q_len": _q_len(spec),
    }
    facts["num_qo_heads"] = facts["num_heads"]
    return {name: value for name, value in facts.items() if value is not None}


_RUNNER: contextvars.ContextVar[Any] = contextvars.ContextVar("wspool_sglang_runner", default=None)
_Reader = Callable[[], Any] | None


def _never() -> bool:
    return False


class Runtime:
    """What the integration read of SGLang when it loaded (defaults: no SGLang).

    One per process (:data:`RUNTIME`), as SGLang's runtime context and the
    integration's patches are: a registry set or reset after loading reads
    the same SGLang. ``configure()`` of :mod:`~wspool.integrations.sglang.buffers`
    writes it (:meth:`read`) at load and clears it at unload, at start-up, before serving;
    the serving paths read it without a lock.

    Attributes:
        device: Overrides every pool buffer's device (``cpu`` in tests); ``None``: the factory's.
        deterministic: Whether SGLang's deterministic inference is on.
        parallel: ``get_parallel`` (attention TP and DCP widths); ``None``: not read.
        spec: ``get_spec`` (speculative draft tokens); ``None``: not read.
        schedule: ``get_schedule`` (``max_prefill_tokens``, ``chunked_prefill_size``); ``None``: not read.
        prefill_buffer_tokens: ``max_prefill_buffer_tokens`` (the chunk ceiling); ``None``: not read.
    """

    def __init__(self) -> None:
        self.device: torch.device | None = None
        self.deterministic: Callable[[], bool] = _never
        self.parallel: _Reader = None
        self.spec: _Reader = None
        self.schedule: _Reader = None
        self.prefill_buffer_tokens: _Reader = None

    def read(
        self,
        *,
        device: str | torch.device | None = None,
        deterministic: Callable[[], bool] | None = None,
        parallel: _Reader = None,
        spec: _Reader = None,
        schedule: _Reader = None,
        prefill_buffer_tokens: _Reader = None,
    ) -> None:
        """Replace what was read of SGLang; what is left out takes its default (no SGLang)."""
        self.device = None if device is None else torch.device(device)
        self.deterministic = deterministic or _never
        self.parallel, self.spec, self.schedule = parallel, spec, schedule
        self.prefill_buffer_tokens = prefill_buffer_tokens


#: The integration's reading of SGLang in this process.
RUNTIME = Runtime()


def set_context_readers(
    parallel: _Reader, spec: _Reader, schedule: _Reader = None, prefill_buffer_tokens: _Reader = None
) -> None:
    """Tell :func:`current_facts` and :func:`prefill_rows` how to read SGLang's runtime context (``None``: not at all).

    Args:
        parallel: ``get_parallel`` (attention TP and DCP widths).
        spec: ``get_spec`` (speculative draft tokens).
        schedule: ``get_schedule`` (``max_prefill_tokens``, ``chunked_prefill_size``).
        prefill_buffer_tokens: ``max_prefill_buffer_tokens`` (the chunk ceiling).
    """
    RUNTIME.parallel, RUNTIME.spec = parallel, spec
    RUNTIME.schedule, RUNTIME.prefill_buffer_tokens = schedule, prefill_buffer_tokens


@contextmanager
def building(runner: Any) -> Iterator[None]:
    """Make ``runner``'s facts those of every ``get_buffer`` call inside the block (this thread or task)."""
    token = _RUNNER.set(runner)
    try:
        yield
    finally:
        _RUNNER.reset(token)


def current_facts() -> dict[str, int]:
    """Return the facts of the runner whose backend is being built; empty outside :func:`building`."""
    runner = _RUNNER.get()
    if runner is None:
        return {}
    get_parallel, get_spec = RUNTIME.parallel, RUNTIME.spec
    parallel = (_read(get_parallel) or _UNKNOWN) if get_parallel is not None else None
    spec = (_read(get_spec) or _UNKNOWN) if get_spec is not None else None
    return facts_from_runner(runner, parallel=parallel, spec=spec)


def prefill_rows(context_len: int, batch: int, tokens_per_request: int, *, whole_prompts: bool = False) -> int | None:
    """Return the most query rows one extend batch of SGLang can carry, or ``None`` where SGLang's limits are unknown.

    With chunked prefill SGLang cuts every batch to its chunk
    (``max_prefill_buffer_tokens()``: ``chunked_prefill_size``, or pipeline
    parallelism's larger dynamic chunk; the mixed decode tokens are charged to
    it). Without, it admits one request of up to ``context_len`` tokens alone
    and further ones only within ``max_prefill_tokens``. Target verify and
    draft extend carry ``tokens_per_request`` rows per request.

    Args:
        context_len: The model's context length.
        batch: The most requests in one batch.
        tokens_per_request: Query rows per request in verify and draft extend.
        whole_prompts: The scheduler may admit whole prompts although chunked prefill is
            configured (SGLang turns it off for multimodal models on the Transformers
            backend; diffusion LMs extend by blocks of their own budget).
    """
    schedule, buffer_tokens = RUNTIME.schedule, RUNTIME.prefill_buffer_tokens
    if schedule is None or buffer_tokens is None:
        return None
    try:
        limits = schedule()
        chunked = positive_int(limits.chunked_prefill_size) or 0
        rows = max(
            positive_int(limits.max_prefill_tokens) or 0,
            positive_int(buffer_tokens()) or 0,
            batch * tokens_per_request,
        )
    except Exception:  # SGLang's accessors raise while nothing is published
        return None
    return max(rows, context_len) if whole_prompts or not chunked else rows
