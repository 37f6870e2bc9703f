"""Tests for wspool.integrations.vllm._get_workspace_buffer: it behaves like the seed's function (vLLM PR #47074)."""

from __future__ import annotations

import itertools

import pytest
import torch

import wspool
from wspool.errors import WorkspaceFrozenError
from wspool.integrations import vllm as drop_in

MiB = 1 << 20


def _seed_function() -> object:
    """The seed's code, verbatim but for the device (the CPU here) and a closure instead of a module global."""
    FLASHINFER_MLA_WORKSPACE_BUFFER_SIZE = 128 * 1024 * 1024
    FLASHINFER_MLA_LSE_WORKSPACE_BUFFER_SIZE = 256 * 1024 * 1024
    state: dict[str, torch.Tensor | None] = {"_fi_workspace": None}

    def _get_workspace_buffer(return_lse: bool) -> torch.Tensor:
        buffer_size = FLASHINFER_MLA_LSE_WORKSPACE_BUFFER_SIZE if return_lse else FLASHINFER_MLA_WORKSPACE_BUFFER_SIZE
        _fi_workspace = state["_fi_workspace"]
        if _fi_workspace is None or _fi_workspace.numel() < buffer_size:
            _fi_workspace = state["_fi_workspace"] = torch.zeros(buffer_size, dtype=torch.uint8, device="cpu")
        return _fi_workspace

    return _get_workspace_buffer


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Point the adapter at the CPU, as the seed's copy is."""
    monkeypatch.setattr(drop_in, "_DROP_IN_DEVICE", "cpu")


@pytest.mark.parametrize("calls", list(itertools.product([False, True], repeat=4)))
def test_same_sizes_growth_and_reuse_as_the_seed(calls: tuple[bool, ...]) -> None:
    """For every sequence of return_lse calls: same sizes, growth only when larger, the same tensor reused."""
    seed = _seed_function()
    seen_seed: list[torch.Tensor] = []
    seen_ours: list[torch.Tensor] = []
    for return_lse in calls:
        want = seed(return_lse)  # type: ignore[operator]
        got = drop_in._get_workspace_buffer(return_lse)
        assert (got.numel(), got.dtype, got.device) == (want.numel(), want.dtype, want.device)
        assert int(got.count_nonzero()) == 0
        # Reuse follows the seed exactly: a new tensor exactly when the seed made one.
        assert (seen_ours and got is seen_ours[-1]) == (seen_seed and want is seen_seed[-1])
        seen_seed.append(want)
        seen_ours.append(got)
    stats = wspool.get_registry().stats("flashinfer_mla", "cpu")
    assert stats.grow_count == len({id(t) for t in seen_seed})
    assert stats.request_count == len(calls)


def test_signature_and_constants_match_the_seed() -> None:
    """The function's signature is the seed's; its constants are still importable."""
    import inspect

    assert str(inspect.signature(drop_in._get_workspace_buffer)) == "(return_lse: 'bool') -> 'torch.Tensor'"
    sizes = (drop_in.FLASHINFER_MLA_WORKSPACE_BUFFER_SIZE, drop_in.FLASHINFER_MLA_LSE_WORKSPACE_BUFFER_SIZE)
    assert sizes == (128 * MiB, 256 * MiB)


def test_sizes_follow_the_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    """WSPOOL_* variables change what the adapter serves, which the seed's constants could not."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE", "300MiB")
    wspool.reset_registry()
    assert drop_in._get_workspace_buffer(True).numel() == 300 * MiB
    assert drop_in._get_workspace_buffer(False).numel() == 300 * MiB


def test_no_growth_while_frozen() -> None:
    """Where the seed would replace the buffer behind a captured graph, the adapter refuses."""
    drop_in._get_workspace_buffer(False)
    with wspool.get_registry().frozen(), pytest.raises(WorkspaceFrozenError, match="RULES__LSE"):
        drop_in._get_workspace_buffer(True)
    assert drop_in._get_workspace_buffer(False).numel() == 128 * MiB
