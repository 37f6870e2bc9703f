"""Tests for wspool.freeze: the freeze and its epoch, counted blocks, the growth allowance, and the capture probe."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from typing import Any

import pytest
import torch

from wspool import freeze
from wspool.errors import WorkspaceFrozenError
from wspool.freeze import TORCH_NAMES_READ_FROM, FreezeState, cuda_capture_probe, cuda_stream_functions


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU build of torch has no CUDA stream functions")
def test_a_cuda_build_of_torch_has_the_stream_functions_the_probe_calls() -> None:
    """Fails, naming the functions and the releases they were read from, where a CUDA torch lacks them."""
    raw_stream, capturing = cuda_stream_functions()
    assert raw_stream is not None and capturing is not None, (
        f"torch {torch.__version__} has no torch._C._cuda_getCurrentRawStream or _cuda_isCurrentStreamCapturing "
        f"(read from {TORCH_NAMES_READ_FROM}); wspool.freeze.cuda_stream_functions must change"
    )
    probe = cuda_capture_probe(torch.device("cuda", 0))
    assert getattr(probe, "cuda_parts", None) == (raw_stream, 0, capturing)


def test_a_cpu_build_gets_torchs_public_probe() -> None:
    """Without the C functions the probe is torch's public capture check, never a placeholder."""
    if cuda_stream_functions() != (None, None):
        pytest.skip("this torch has the C functions (a CUDA build)")
    assert cuda_capture_probe(torch.device("cuda", 0)) is torch.cuda.is_current_stream_capturing


def test_the_freeze_epoch_moves_once_per_freeze_not_per_call() -> None:
    """Freezing an unfrozen state moves the epoch by one; freezing again, or opening a block inside, does not."""
    state = FreezeState()
    assert (state.epoch, state.frozen, state.refuses_growth()) == (0, False, False)
    state.frozen = True
    state.frozen = True
    token = state.enter()
    assert (state.epoch, state.frozen, state.refuses_growth()) == (1, True, True)
    state.leave(token)
    state.frozen = False
    assert (state.epoch, state.frozen) == (1, False)
    token = state.enter()
    assert (state.epoch, state.frozen) == (2, True)
    state.leave(token)
    assert (state.epoch, state.frozen, state.refuses_growth()) == (2, False, False)


def test_blocks_are_counted_and_clear_ends_them_all() -> None:
    """Two open blocks keep the freeze until both leave; clear() unfreezes, and a block's late leave changes nothing."""
    state = FreezeState()
    first, second = state.enter(), state.enter()
    state.leave(first)
    assert state.frozen
    state.leave(second)
    assert not state.frozen
    stale = state.enter()
    state.frozen = True
    state.clear()
    assert not state.frozen and not state.refuses_growth()
    fresh = state.enter()
    state.leave(stale)  # opened before clear(): must not close the block opened after it
    assert state.frozen
    state.leave(fresh)
    assert not state.frozen


def test_the_growth_allowance_holds_inside_its_block_in_its_own_thread_only() -> None:
    """Inside allowing_growth() a frozen state lets the calling thread grow; another thread, or after it, may not."""
    state = FreezeState()
    state.frozen = True
    seen: list[bool] = []
    with state.allowing_growth():
        assert not state.refuses_growth() and state.frozen
        other = threading.Thread(target=lambda: seen.append(state.refuses_growth()))
        other.start()
        other.join()
        with state.allowing_growth():
            pass
        assert not state.refuses_growth()  # a nested block's end leaves the outer one's allowance
    assert seen == [True] and state.refuses_growth()


def _fake_stream_functions(streams: dict[int, int], capturing: list[bool]) -> tuple[object, object]:
    def raw_stream(index: int) -> int:
        return streams.get(index, 0)

    def is_capturing() -> bool:
        return capturing[0]

    return raw_stream, is_capturing


@pytest.mark.parametrize(("device", "index"), [(torch.device("cuda", 2), 2), (torch.device("cuda"), 0)])
def test_the_capture_probe_asks_the_devices_stream_and_never_the_legacy_default_stream(
    monkeypatch: pytest.MonkeyPatch, device: torch.device, index: int
) -> None:
    """The probe says capturing only where the device's current stream is not the legacy default one (0)."""
    streams: dict[int, int] = {}
    capturing = [False]
    raw_stream, is_capturing = _fake_stream_functions(streams, capturing)
    monkeypatch.setattr(freeze, "cuda_stream_functions", lambda: (raw_stream, is_capturing))
    probe = cuda_capture_probe(device)
    assert getattr(probe, "cuda_parts", None) == (raw_stream, index, is_capturing)
    assert probe() is False
    capturing[0] = True
    assert not probe()  # the legacy default stream never captures
    streams[index] = 7
    assert probe() is True
    capturing[0] = False
    assert probe() is False
    streams[index + 1] = 9
    assert cuda_capture_probe(torch.device("cuda", index + 1))() is False


def test_the_capture_probe_falls_back_to_what_torch_has(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the raw-stream function the probe is the capture check itself; without either, torch's public one."""
    capturing = [True]
    _, is_capturing = _fake_stream_functions({}, capturing)
    monkeypatch.setattr(freeze, "cuda_stream_functions", lambda: (None, is_capturing))
    assert cuda_capture_probe(torch.device("cuda", 1)) is is_capturing
    monkeypatch.setattr(freeze, "cuda_stream_functions", lambda: (None, None))
    assert cuda_capture_probe(torch.device("cuda", 1)) is torch.cuda.is_current_stream_capturing


def test_the_stream_functions_are_taken_only_where_torch_has_the_c_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built-in functions are returned as they are; a Python placeholder or a missing name gives None."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", abs, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", callable, raising=False)
    assert cuda_stream_functions() == (abs, callable)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0)
    assert cuda_stream_functions() == (None, callable)
    monkeypatch.delattr(torch._C, "_cuda_isCurrentStreamCapturing")
    assert cuda_stream_functions() == (None, None)


# -- the freeze's guarantees: buffers current while frozen are retired, the allowance ends with its block ----


def _frozen_registry() -> tuple[Any, torch.device]:
    from tests.helpers.registry import make_registry

    reg = make_registry({"p": {"rules": {"small": "1KiB", "mid": "2KiB", "big": "4KiB"}}})
    return reg, torch.device("cpu")


def test_a_buffer_grown_under_the_allowance_while_frozen_is_retired_not_freed() -> None:
    """A buffer grown inside allowing_growth() while frozen was current while frozen: replaced later, it is retired."""
    reg, cpu = _frozen_registry()
    reg.workspace("p", cpu, rule="small")
    reg.freeze()
    with reg.allowing_growth():
        grown = reg.workspace("p", cpu, rule="mid")
    held = weakref.ref(grown)
    del grown
    reg.unfreeze()
    reg.workspace("p", cpu, rule="big")
    gc.collect()
    assert held() is not None, "a buffer current while frozen was freed on the next growth"
    assert reg.stats("p", cpu).retired_bytes == 1024 + 2048
    assert reg.release_retired() == 1024 + 2048
    gc.collect()
    assert held() is None


def test_a_buffer_grown_while_unfrozen_after_a_freeze_is_freed_on_growth() -> None:
    """A buffer first current after the freeze ended, never captured, is dropped (not retired) when replaced."""
    reg, cpu = _frozen_registry()
    with reg.frozen():
        pass
    held = weakref.ref(reg.workspace("p", cpu, rule="small"))
    reg.workspace("p", cpu, rule="big")
    gc.collect()
    assert held() is None and reg.stats("p", cpu).retired_bytes == 0


def test_a_task_created_inside_the_allowance_loses_it_when_the_block_ends() -> None:
    """An asyncio task made inside allowing_growth() copies the context, yet cannot grow once the block closed."""
    reg, cpu = _frozen_registry()
    reg.freeze()

    async def grow() -> None:
        reg.workspace("p", cpu, rule="big")

    async def main() -> None:
        with reg.allowing_growth():
            task = asyncio.get_running_loop().create_task(grow())
        with pytest.raises(WorkspaceFrozenError, match="while the registry is frozen"):
            await task

    asyncio.run(main())
    assert reg.stats("p", cpu).capacity_bytes == 0


def test_a_task_awaited_inside_the_allowance_may_grow() -> None:
    """A task made and awaited inside allowing_growth() runs while the block is open: it grows the frozen pool."""
    reg, cpu = _frozen_registry()
    reg.freeze()

    async def main() -> None:
        with reg.allowing_growth():
            await asyncio.get_running_loop().create_task(asyncio.to_thread(reg.workspace, "p", cpu, rule="mid"))
            await asyncio.to_thread(reg.workspace, "p", cpu, rule="big")

    asyncio.run(main())
    assert reg.stats("p", cpu).capacity_bytes == 4096


def test_a_thread_started_inside_the_allowance_has_none() -> None:
    """A thread started inside allowing_growth() starts with a fresh context: its growth is refused."""
    reg, cpu = _frozen_registry()
    reg.freeze()
    errors: list[BaseException] = []

    def grow() -> None:
        try:
            reg.workspace("p", cpu, rule="big")
        except WorkspaceFrozenError as exc:
            errors.append(exc)

    with reg.allowing_growth():
        thread = threading.Thread(target=grow)
        thread.start()
        thread.join()
    assert len(errors) == 1 and reg.stats("p", cpu).capacity_bytes == 0


def test_the_allowance_ends_when_its_block_raises_and_nests() -> None:
    """An exception inside allowing_growth() closes it; a nested block's end leaves the outer one open."""
    reg, cpu = _frozen_registry()
    reg.freeze()
    with pytest.raises(KeyError), reg.allowing_growth():
        raise KeyError("inside")
    with pytest.raises(WorkspaceFrozenError):
        reg.workspace("p", cpu, rule="small")
    with reg.allowing_growth():
        with reg.allowing_growth():
            reg.workspace("p", cpu, rule="small")
        reg.workspace("p", cpu, rule="mid")
    with pytest.raises(WorkspaceFrozenError):
        reg.workspace("p", cpu, rule="big")


def test_a_leave_without_its_enter_changes_nothing() -> None:
    """Leaving a block twice does not count below zero: the next block still freezes."""
    state = FreezeState()
    token = state.enter()
    state.leave(token)
    state.leave(token)
    assert not state.frozen
    state.enter()
    assert state.frozen and state.refuses_growth()


def test_a_buffer_grown_under_the_allowance_inside_a_frozen_block_is_retired_not_freed() -> None:
    """Inside a frozen() block (no freeze() held), a buffer grown under the allowance is retired when replaced later."""
    reg, cpu = _frozen_registry()
    reg.workspace("p", cpu, rule="small")
    with reg.frozen(), reg.allowing_growth():
        grown = reg.workspace("p", cpu, rule="mid")
    held = weakref.ref(grown)
    del grown
    reg.workspace("p", cpu, rule="big")
    gc.collect()
    assert held() is not None, "a buffer current inside a frozen block was freed on the next growth"
    assert reg.stats("p", cpu).retired_bytes == 1024 + 2048
