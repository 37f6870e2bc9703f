"""Reliability on a CUDA device with concurrent streams: two lanes at once, the stream-order check, MLA per lane.

Every test skips, with the reason, where there is no CUDA device; the
stream-order check's decisions are tested against a simulated GPU in
tests/core/test_streams.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import wspool
from tests.helpers.registry import make_registry
from tests.reliability.gpu_scratch import NUMEL, current_cuda_device, scratch_registry
from wspool.devices import StreamOrderWarning

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 200_000_000  # about 0.1 s of GPU time: keeps a stream busy while the host moves on


def test_two_lanes_on_two_streams_match_serial_results() -> None:
    """Two lanes used from two streams at once give bit-identical results to running them one after the other."""
    device = current_cuda_device()
    reg = scratch_registry(debug_streams=True)
    lanes = ("ubatch0", "ubatch1")
    generator = torch.Generator(device).manual_seed(7)
    inputs = [torch.randn(NUMEL, device=device, generator=generator) for _ in lanes]
    for lane in lanes:
        reg.reserve("ws", device, rule="default", lane=lane)
    iterations = 50

    def layer(x: torch.Tensor, acc: torch.Tensor, lane: str, i: int) -> None:
        scratch = reg.workspace("ws", device, lane=lane)[: NUMEL * 4].view(torch.float32)
        torch.mul(x, float(i + 1), out=scratch)
        scratch.sin_()
        acc.add_(scratch)

    serial = [torch.zeros_like(x) for x in inputs]
    for x, acc, lane in zip(inputs, serial, lanes, strict=True):
        for i in range(iterations):
            layer(x, acc, lane, i)
    torch.cuda.synchronize()

    concurrent = [torch.zeros_like(x) for x in inputs]
    streams = [torch.cuda.Stream() for _ in lanes]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamOrderWarning)  # one lane per stream: nothing to report
        for i in range(iterations):
            for stream, x, acc, lane in zip(streams, inputs, concurrent, lanes, strict=True):
                with torch.cuda.stream(stream):
                    layer(x, acc, lane, i)
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    for got, want in zip(concurrent, serial, strict=True):
        assert torch.equal(got, want)
    pointers = {reg.pool("ws", device, lane=lane).buffer.data_ptr() for lane in lanes}  # type: ignore[union-attr]
    assert len(pointers) == 2


def test_debug_streams_warns_about_unordered_streams_only() -> None:
    """With debug_streams, a stream that waited for the other is quiet; one that did not is reported."""
    device = current_cuda_device()
    reg = scratch_registry(debug_streams=True)
    reg.reserve("ws", device, rule="default")
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()

    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamOrderWarning)
        with torch.cuda.stream(a):
            torch.cuda._sleep(SLEEP_CYCLES)  # a is busy when it asks
            reg.workspace("ws", device)
        b.wait_stream(a)
        with torch.cuda.stream(b):
            reg.workspace("ws", device)
    torch.cuda.synchronize()

    with torch.cuda.stream(a):
        torch.cuda._sleep(SLEEP_CYCLES)
        reg.workspace("ws", device)
    with (
        pytest.warns(
            StreamOrderWarning,
            match=r"pool 'ws' on cuda:\d+ \(lane main\) was handed to stream .* while stream .* did not wait for it.*"
            r"own lane",
        ),
        torch.cuda.stream(b),
    ):
        reg.workspace("ws", device)
    torch.cuda.synchronize()


def test_mla_decode_plans_per_lane_on_the_gpu() -> None:
    """The same metadata under two lanes gets two plans and two buffers (no shared workspace between streams)."""
    from tests.helpers.mla_inputs import make_inputs
    from wspool.flashinfer import mla_decode

    reg = make_registry()
    inputs = make_inputs(2, 128, [70, 300], device=current_cuda_device())
    for name in ("a", "b"):
        with wspool.lane(name):
            mla_decode(
                inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, inputs.max_seq_len,
                sm_scale=inputs.sm_scale, registry=reg,
            )  # fmt: skip
    buffers = {s.lane: s.capacity_bytes for s in reg.all_stats() if s.pool == "flashinfer_mla"}
    assert set(buffers) == {"a", "b"} and all(buffers.values())
    a, b = (reg.pool("flashinfer_mla", current_cuda_device(), lane=n).buffer for n in ("a", "b"))
    assert a is not None and b is not None and a.data_ptr() != b.data_ptr()
