"""Tests for wspool.flashinfer.refusals: every refusal text of the supported FlashInfer versions, and recovery."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import wspool
from tests.helpers.paged_doubles import overflow_message
from wspool.errors import WorkspaceOverflowError
from wspool.flashinfer.refusals import MAX_RECOVERIES, REFUSAL_FORMS, grow_after_overflow, parse_refusal
from wspool.units import MAX_SIZE_BYTES, MiB, round_up

#: trtllm-gen's overflow at vLLM's fixed 128 MiB (8 MiB carved before the softmax slab).
VLLM_128MIB_OVERFLOW = (
    "RuntimeError: Error in function 'aligned_alloc' at /workspace/include/flashinfer/allocator.h:49: "
    "Buffer overflow when allocating memory for trtllm_gen_softmax_workspace with size 135266304 and "
    "alignment 16, but only 125829120 bytes available in AlignedAllocator. Increase the workspace buffer size."
)
# Texts captured on the H200 test machine (SM90, 132 SMs), verbatim but for the install prefix of the
# allocator.h path in the C++ messages (shown as <site-packages>), one per distinct message and capacity:
# (FlashInfer version, the case, the exception type, the capacity the call was given, the message).
CAPTURED = [
    (r["flashinfer"], r["case"], r["type"], r["capacity_bytes"], r["message"])
    for r in map(json.loads, (Path(__file__).parent / "refusals_h200.jsonl").read_text().splitlines())
]
# 0.7.4, backend="auto" on an H200 with an 8 MiB buffer, as captured there.
AUTO_074 = next(msg for v, case, _, _, msg in CAPTURED if v == "0.7.4" and case.startswith("direct-mla backend=auto"))
# The needs each captured refusal names, on the H200 (132 SMs), worked out by hand from FlashInfer's sources.
_H200_NEEDS = {"mla_partial_o": 17301504 + 16, "batch_decode_tmp_v": 2424832 + 16, "fa3": 17369088, "fa2": 17369088}


@pytest.mark.parametrize(
    ("version", "case", "kind", "capacity", "message"), CAPTURED, ids=[f"{c[0]}:{c[1]}" for c in CAPTURED]
)
def test_every_captured_h200_text(version: str, case: str, kind: str, capacity: int | None, message: str) -> None:
    """Each text captured on the H200 parses to its need, or (not about the workspace) to None."""
    backend = case.split("backend=")[1].split()[0] if "backend=" in case else None
    path = "fa3" if backend == "auto" else backend  # what wspool resolves 'auto' to on SM90
    refusal = parse_refusal(message, path)
    if case.startswith("direct-trtllm"):  # Hopper refusing a Blackwell/SM120 kernel, or a failed download
        assert refusal is None
        return
    assert refusal is not None and capacity is not None
    assert refusal.needed_capacity(capacity) == _H200_NEEDS[refusal.name]
    if kind == "_BackendPlanUnsupportedError":
        assert (version, refusal.form, refusal.name) == ("0.7.4", "fa-preflight", path)
    else:
        assert (kind, refusal.form, refusal.available_bytes) == ("RuntimeError", "aligned-allocator", capacity)


@pytest.mark.parametrize("form", REFUSAL_FORMS, ids=[f.name for f in REFUSAL_FORMS])
def test_every_example_parses_to_its_form(form: object) -> None:
    """Each table entry's example text parses to that form, with the size it names."""
    refusal = parse_refusal(form.example)  # type: ignore[attr-defined]
    assert refusal is not None and refusal.form == form.name  # type: ignore[attr-defined]
    assert refusal.sized is (form.sized != "none")  # type: ignore[attr-defined]


def test_the_trtllm_gen_carve_at_vllms_fixed_128mib() -> None:
    """trtllm-gen's overflow at vLLM's fixed 128 MiB: 8 MiB used before the slab, so the need is used + slab + 16."""
    refusal = parse_refusal(RuntimeError(VLLM_128MIB_OVERFLOW))
    assert refusal is not None
    assert (refusal.form, refusal.name, refusal.size_bytes, refusal.alignment, refusal.available_bytes) == (
        "aligned-allocator", "trtllm_gen_softmax_workspace", 135266304, 16, 125829120,
    )  # fmt: skip
    assert refusal.needed_capacity(128 * MiB) == 8 * MiB + 135266304 + 16
    assert refusal.needed_capacity(128 * MiB, padding=False) == 8 * MiB + 135266304


def test_the_hopper_carve_of_072() -> None:
    """0.7.2.post1's fa3 plan on an 8 MiB buffer: nothing used before mla_partial_o."""
    refusal = parse_refusal(REFUSAL_FORMS[0].example)
    assert refusal is not None and refusal.needed_capacity(8 * MiB) == 17301504 + 16


def test_the_auto_list_of_074_is_read_for_the_path() -> None:
    """0.7.4's backend='auto' list gives the named backend's whole need, whatever the capacity."""
    refusal = parse_refusal(ValueError(AUTO_074), "fa2")
    assert refusal is not None and (refusal.form, refusal.name) == ("fa-preflight", "fa2")
    assert refusal.needed_capacity(8 * MiB) == refusal.needed_capacity(1) == 17369088
    assert parse_refusal(AUTO_074, "trtllm-gen").name == "fa3"  # type: ignore[union-attr]  # not listed: the largest


def test_explicit_fa3_of_074() -> None:
    """0.7.4's explicit fa3 refusal (a ValueError) names the whole need."""
    refusal = parse_refusal(ValueError("fa3 MLA needs 17369088 float workspace bytes for partial outputs and LSE."))
    assert refusal is not None and refusal.needed_capacity(0) == 17369088


def test_cute_dsl_texts() -> None:
    """Both cute-dsl texts give the need; the split-tactic text is recognised but names no size."""
    functional = parse_refusal("workspace_buffer too small: 1048576 bytes, need 16809984 bytes")
    assert functional is not None and functional.needed_capacity(MiB) == 16809984
    assert functional.available_bytes == MiB
    planned = parse_refusal("workspace_buffer too small for cute-dsl backend: have 5 bytes, need 7 bytes.")
    assert planned is not None and (planned.name, planned.needed_capacity(5)) == ("cute-dsl", 7)
    tactic = parse_refusal("workspace_buffer too small for the requested split tactic")
    assert tactic is not None and not tactic.sized and tactic.needed_capacity(MiB) == 0


def test_other_errors_are_not_refusals() -> None:
    """Any other error text is not a refusal."""
    assert parse_refusal(RuntimeError("CUDA error: an illegal memory access was encountered")) is None
    assert parse_refusal("XQA MLA requires SM120a (CUDA >= 12.8) or SM121a (CUDA >= 12.9)") is None
    assert parse_refusal(ValueError("trtllm-gen MLA requires SM100/SM103/SM107")) is None


# Where each form's text lives in FlashInfer's installed sources.
_SOURCES = {
    "aligned-allocator": ("data/include/flashinfer/allocator.h", "Buffer overflow when allocating memory for "),
    "fa-preflight": ("mla/_batch_mla/_backends/_fa_common.py", "float workspace bytes for partial outputs and LSE."),
    "cute-dsl-planned": ("mla/_batch_mla/_backends/_cute_dsl_common.py", "too small for cute-dsl backend: "),
    "cute-dsl-functional": ("cute_dsl/attention/monolithic/mla_decode.py", 'f"workspace_buffer too small: {'),
    "cute-dsl-split-tactic": (
        "mla/_batch_mla/_backends/cute_dsl_monolithic_backend.py",
        "workspace_buffer too small for the requested split tactic",
    ),
}


@pytest.mark.parametrize("form", REFUSAL_FORMS, ids=[f.name for f in REFUSAL_FORMS])
def test_the_table_matches_the_installed_flashinfer(form: object) -> None:
    """A form's text is in the installed FlashInfer's source exactly when the table lists its version."""
    import importlib.metadata

    flashinfer = pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    version = importlib.metadata.version("flashinfer-python")
    relative, fragment = _SOURCES[form.name]  # type: ignore[attr-defined]
    source = Path(flashinfer.__file__).parent / relative
    text = source.read_text() if source.is_file() else ""
    assert (fragment in text) is (version in form.versions), (version, relative)  # type: ignore[attr-defined]


def _carve_text(size: str, available: str) -> str:
    """FlashInfer's allocator text with the numbers given as digits (too long for an int's str() past 4300)."""
    return (
        f"Buffer overflow when allocating memory for tmp_v with size {size} and alignment 16, but only "
        f"{available} bytes available in AlignedAllocator. Increase the workspace buffer size."
    )


@pytest.mark.parametrize("digits", [17, 400, 5000, 1_000_000])
def test_a_size_beyond_any_device_is_not_a_refusal(digits: int) -> None:
    """A text naming more bytes than MAX_SIZE_BYTES (17 digits up to a 1 MB number) is no refusal wspool reads."""
    absurd = "9" * digits
    assert parse_refusal(_carve_text(absurd, "4096")) is None
    assert parse_refusal(_carve_text("4096", absurd)) is None
    assert parse_refusal(f"fa3 MLA needs {absurd} float workspace bytes for partial outputs and LSE.") is None
    assert parse_refusal(f"workspace_buffer too small: 4096 bytes, need {absurd} bytes") is None


def test_the_largest_size_any_device_holds_is_still_read() -> None:
    """MAX_SIZE_BYTES and long runs of zeros parse; a list naming an absurd need for any backend is not read at all."""
    refusal = parse_refusal(_carve_text(str(MAX_SIZE_BYTES), "0" * 5000))
    assert refusal is not None and (refusal.size_bytes, refusal.available_bytes) == (MAX_SIZE_BYTES, 0)
    listed = (
        f"fa2 MLA needs {'9' * 400} float workspace bytes for partial outputs; "
        "fa3 MLA needs 17369088 float workspace bytes for partial outputs and LSE."
    )
    assert parse_refusal(listed, "fa3") is None and parse_refusal(listed, "fa2") is None


# -- recovery: growth past an overflow, other errors untouched, giving up -------------------

SETTING = "pools.p.rules.default / WSPOOL_POOLS__P__RULES__DEFAULT"


def _pool() -> wspool.WorkspacePool:
    registry = wspool.PoolRegistry.from_config(pools={"p": {"rules": {"default": "4MiB"}}})
    pool = registry.pool("p", "cpu")
    pool.workspace("default", {})
    return pool


def _grow(pool: wspool.WorkspacePool, exc: RuntimeError, attempt: int = 0, **kwargs: object) -> object:
    return grow_after_overflow(
        exc, pool=pool, capacity=pool.capacity_bytes, attempt=attempt, op="test op", rule="default",
        setting=SETTING, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


def test_grows_past_the_need_with_headroom() -> None:
    """The pool grows to the capacity the carve needed plus an eighth (at least 1MiB), rounded to MiB."""
    pool = _pool()
    grown = _grow(pool, RuntimeError(overflow_message("tmp_v", 10 * MiB, 3 * MiB)))
    needed = 4 * MiB - 3 * MiB + 10 * MiB + 16
    assert grown is pool.buffer and pool.capacity_bytes == round_up(needed + needed // 8, MiB)
    assert pool.stats().last_grow_reason.startswith("overflow recovery (tmp_v)")  # type: ignore[union-attr]


def test_other_errors_and_foreign_carves_are_raised_as_they_are() -> None:
    """Anything but an overflow, or an overflow of a carve outside float_carves, is re-raised unchanged."""
    pool = _pool()
    other = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError) as info:
        _grow(pool, other)
    assert info.value is other
    foreign = RuntimeError(overflow_message("int_buffer_indices", 9 * MiB, 8 * MiB))
    with pytest.raises(RuntimeError, match="int_buffer_indices"):
        _grow(pool, foreign, float_carves={"tmp_v"})
    assert pool.capacity_bytes == 4 * MiB


def test_gives_up_after_the_last_recovery() -> None:
    """At MAX_RECOVERIES growths the overflow is reported with the setting to raise."""
    pool = _pool()
    exc = RuntimeError(overflow_message("tmp_v", 10 * MiB, 3 * MiB))
    with pytest.raises(WorkspaceOverflowError, match=r"test op still overflowed pool 'p' on cpu after 3 growth.*"
                       r"WSPOOL_POOLS__P__RULES__DEFAULT"):  # fmt: skip
        _grow(pool, exc, attempt=MAX_RECOVERIES)


def test_headroom_stops_at_max_bytes(caplog: pytest.LogCaptureFixture) -> None:
    """A 60MiB need on a pool capped at 64MiB is served at the cap: the headroom never asks past max_bytes."""
    registry = wspool.PoolRegistry.from_config(pools={"p": {"rules": {"default": "4MiB"}, "max_bytes": "64MiB"}})
    pool = registry.pool("p", "cpu")
    pool.workspace("default", {})
    with caplog.at_level(logging.WARNING, logger="wspool"):
        grown = _grow(pool, RuntimeError(overflow_message("tmp_v", 60 * MiB, 4 * MiB)))
    assert grown is pool.buffer and pool.capacity_bytes == 64 * MiB
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "tmp_v needed 62914560 bytes, 4194304 available of 4MiB; growing to 64MiB and retrying" in warning


@pytest.mark.parametrize("digits", [17, 400, 5000])
def test_an_absurd_refusal_is_raised_as_it_is(digits: int) -> None:
    """A refusal naming more bytes than any device holds is re-raised unchanged; the pool does not grow."""
    pool = _pool()
    absurd = RuntimeError(
        f"Buffer overflow when allocating memory for tmp_v with size {'9' * digits} and alignment 16, "
        f"but only 4194304 bytes available in AlignedAllocator. Increase the workspace buffer size."
    )
    with pytest.raises(RuntimeError) as info:
        _grow(pool, absurd)
    assert info.value is absurd and pool.capacity_bytes == 4 * MiB
