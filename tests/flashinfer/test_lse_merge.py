"""Tests for wspool.flashinfer.merge_lse_partials: partial attention outputs merged by their natural-log LSEs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from wspool.flashinfer.reference import merge_lse_partials

NEG_INF = float("-inf")


def _reference(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge in float64 through torch's own logsumexp and softmax over the shares."""
    lse = torch.stack(lses).double()
    weights = torch.softmax(lse, dim=0).unsqueeze(-1)
    return (weights * torch.stack(outs).double()).sum(0), torch.logsumexp(lse, dim=0)


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [rows, d]`` over ``keys [n, d]`` in float64, with its natural-log LSE (NaN output if n = 0)."""
    scores = q.double() @ keys.double().T
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ values.double(), lse


def _random(shares: int, rows: tuple[int, ...], dim: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    outs = [torch.randn(*rows, dim, generator=generator) for _ in range(shares)]
    lses = [torch.randn(*rows, generator=generator) * 4 for _ in range(shares)]
    return outs, lses


@pytest.mark.parametrize(("shares", "rows"), [(1, (3, 4)), (2, (5, 1, 8)), (3, (7, 2)), (8, (2, 1, 16))])
def test_matches_the_softmax_weighted_reference(shares: int, rows: tuple[int, ...]) -> None:
    """The merge equals the float64 softmax-over-shares reference within fp32 rounding."""
    outs, lses = _random(shares, rows, 32, seed=shares)
    out, lse = merge_lse_partials(outs, lses)
    want_out, want_lse = _reference(outs, lses)
    assert out.shape == (*rows, 32) and lse.shape == rows
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("bounds", [[0, 5, 13, 40], [0, 0, 17, 40], [0, 1, 40, 40], [0, 39, 40]])
def test_merging_shares_equals_attention_over_the_whole(bounds: list[int]) -> None:
    """Attention over contiguous key ranges (empty ones included), merged, equals attention over all keys."""
    generator = torch.Generator().manual_seed(len(bounds))
    q = torch.randn(6, 16, generator=generator)
    keys = torch.randn(40, 16, generator=generator)
    values = torch.randn(40, 24, generator=generator)
    outs, lses = [], []
    for start, end in itertools.pairwise(bounds):
        out, lse = _attention(q, keys[start:end], values[start:end])
        outs.append(out.float())  # an empty range gives LSE -inf
        lses.append(lse.float())
    merged, merged_lse = merge_lse_partials(outs, lses)
    want, want_lse = _attention(q, keys, values)
    torch.testing.assert_close(merged.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged_lse.double(), want_lse, rtol=1e-6, atol=1e-5)


def test_empty_share_weighs_nothing_whatever_its_output_holds() -> None:
    """A share with LSE -inf contributes nothing, even when its output is NaN or infinite."""
    outs, lses = _random(3, (4, 2), 8, seed=7)
    outs[1] = torch.full_like(outs[1], float("nan"))
    outs[1][0] = float("inf")
    lses[1] = torch.full_like(lses[1], NEG_INF)
    out, lse = merge_lse_partials(outs, lses)
    want_out, want_lse = _reference([outs[0], outs[2]], [lses[0], lses[2]])
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)


def test_row_that_every_share_left_empty_is_the_identity() -> None:
    """A row with LSE -inf on every share merges to output 0 and LSE -inf, without NaN; other rows are unaffected."""
    outs, lses = _random(2, (3,), 4, seed=3)
    for share in range(2):
        outs[share][1] = float("nan")
        lses[share][1] = NEG_INF
    out, lse = merge_lse_partials(outs, lses)
    assert torch.equal(out[1], torch.zeros(4)) and lse[1] == NEG_INF
    want_out, want_lse = _reference([o[[0, 2]] for o in outs], [s[[0, 2]] for s in lses])
    torch.testing.assert_close(out[[0, 2]].double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[[0, 2]].double(), want_lse, rtol=1e-6, atol=1e-5)


def test_single_share_is_returned_unchanged() -> None:
    """Merging one share gives back its output and LSE."""
    outs, lses = _random(1, (5, 3), 16, seed=1)
    out, lse = merge_lse_partials(outs, lses)
    torch.testing.assert_close(out, outs[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, lses[0], rtol=0, atol=1e-6)


def test_stacked_tensors_and_sequences_merge_alike() -> None:
    """A stacked [shares, ...] tensor (as an all-gather gives) merges like the sequence of its shares."""
    outs, lses = _random(4, (2, 3), 8, seed=4)
    from_list = merge_lse_partials(outs, lses)
    from_stack = merge_lse_partials(torch.stack(outs), torch.stack(lses))
    assert torch.equal(from_list[0], from_stack[0]) and torch.equal(from_list[1], from_stack[1])


def test_merging_in_steps_equals_merging_at_once() -> None:
    """Merging two shares, then the result with a third, equals merging all three at once."""
    outs, lses = _random(3, (6, 2), 8, seed=5)
    first = merge_lse_partials(outs[:2], lses[:2])
    stepwise = merge_lse_partials([first[0], outs[2]], [first[1], lses[2]])
    at_once = merge_lse_partials(outs, lses)
    torch.testing.assert_close(stepwise[0], at_once[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stepwise[1], at_once[1], rtol=1e-6, atol=1e-5)


def test_large_lses_neither_overflow_nor_underflow() -> None:
    """LSEs of +-1e4 (far outside exp's fp32 range) merge to finite values relative to their maximum."""
    outs, _ = _random(2, (3,), 4, seed=6)
    lses = [torch.tensor([1e4, -1e4, 50.0]), torch.tensor([1e4 - 1, -1e4, 50.0])]  # exact in fp32
    out, lse = merge_lse_partials(outs, lses)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    weight = math.exp(-1.0)
    torch.testing.assert_close(out[0], (outs[0][0] + weight * outs[1][0]) / (1 + weight), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[1], torch.tensor(-1e4 + math.log(2.0)), rtol=1e-6, atol=1e-2)


def test_keeps_the_output_dtype_and_returns_an_fp32_lse() -> None:
    """bf16 partial outputs merge (in fp32) to a bf16 output; LSEs of any float dtype give an fp32 LSE."""
    outs, lses = _random(2, (4, 8), 16, seed=8)
    out, lse = merge_lse_partials([o.bfloat16() for o in outs], [s.half() for s in lses])
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want_out, _ = _reference([o.bfloat16().float() for o in outs], [s.half().float() for s in lses])
    # The fp32 result is rounded once to bf16: a relative error of at most 2**-8 per element.
    assert float(((out.double() - want_out).abs() / want_out.abs().clamp_min(1e-3)).max()) <= 2**-8


OUT, LSE = torch.zeros(2, 3, 4), torch.zeros(2, 3)


@pytest.mark.parametrize(
    ("outs", "lses", "match"),
    [
        ([], [], r"needs at least one share, got no outs"),
        (torch.zeros(0, 3, 4), torch.zeros(0, 3), r"stacked outs must be \[shares, \.\.\.\] with a share"),
        ([OUT, OUT], [LSE], r"got 2 outputs but 1 LSEs"),
        ([OUT, torch.zeros(2, 3, 5)], [LSE, LSE], r"outs\[1\] is \(2, 3, 5\) torch\.float32 on cpu, but outs\[0\]"),
        ([OUT, OUT.double()], [LSE, LSE], r"outs\[1\] is \(2, 3, 4\) torch\.float64"),
        ([OUT], [torch.zeros(2, 4)], r"LSE must have its output's shape without the last dimension: .*\(2, 3, 4\)"),
        ([OUT], ["lse"], r"lses\[0\] is a str, not a tensor"),
        ([OUT.long()], [LSE], r"outs must be floating point, got torch\.int64"),
        ([OUT], [LSE.long()], r"lses must be floating point, got torch\.int64"),
    ],
    ids=["none", "stacked-empty", "counts", "shape", "dtype", "lse-shape", "not-tensor", "int-out", "int-lse"],
)
def test_bad_partials_are_refused(outs: object, lses: object, match: str) -> None:
    """Mismatched or missing partials are a ValueError that says what differs."""
    with pytest.raises(ValueError, match=match):
        merge_lse_partials(outs, lses)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "plus-inf"])
def test_a_nan_or_infinite_lse_makes_its_row_nan(bad: float) -> None:
    """A NaN or +inf LSE in one share makes that row's output and LSE NaN, never a silent row of zeros."""
    outs, lses = _random(3, (4,), 8, seed=11)
    lses[1][2] = bad
    out, lse = merge_lse_partials(outs, lses)
    assert torch.isnan(out[2]).all() and torch.isnan(lse[2])
    want_out, want_lse = _reference([o[[0, 1, 3]] for o in outs], [s[[0, 1, 3]] for s in lses])
    torch.testing.assert_close(out[[0, 1, 3]].double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[[0, 1, 3]].double(), want_lse, rtol=1e-6, atol=1e-5)


def test_a_nan_lse_next_to_empty_shares_is_still_nan() -> None:
    """A row whose other shares are empty (-inf) and one share NaN merges to NaN, not to the empty identity."""
    outs, lses = _random(2, (2,), 4, seed=12)
    lses[0][0], lses[1][0] = NEG_INF, float("nan")
    out, lse = merge_lse_partials([o.bfloat16() for o in outs], lses)
    assert out.dtype == torch.bfloat16 and torch.isnan(out[0]).all() and torch.isnan(lse[0])
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1])


def test_a_nan_output_with_a_finite_lse_is_nan_in_the_merge() -> None:
    """A share that has keys for a row (finite LSE) and a NaN output propagates NaN into that row's output."""
    outs, lses = _random(2, (3,), 4, seed=13)
    outs[0][1, 2] = float("nan")
    out, lse = merge_lse_partials(outs, lses)
    assert torch.isnan(out[1, 2]) and torch.isfinite(lse).all()
