"""Reliability on a CUDA device: graphs captured through the pool, refusals during capture, lanes on two streams.

The kernels are plain PyTorch ones that use the pool's buffer as scratch, as
an attention kernel uses its workspace: ``scratch = ws.view(float32)``, then
``sin(x) * 3`` into the scratch and ``scratch + x`` into the output. Every test
skips, with the reason, where there is no CUDA device.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

import wspool
from wspool.errors import WorkspaceFrozenError
from wspool.streams import StreamOrderWarning

pytestmark = pytest.mark.gpu

MiB = 2**20
NUMEL = 4 * MiB  # float32 elements of scratch: 16MiB, the pool's default rule
SLEEP_CYCLES = 200_000_000  # about 0.1 s of GPU time: keeps a stream busy while the host moves on


def _registry(*, debug_streams: bool = False) -> wspool.PoolRegistry:
    settings = wspool.load_settings(
        pools={"ws": {"rules": {"default": "16MiB", "big": "64MiB"}}}, debug_streams=debug_streams
    )
    return wspool.PoolRegistry(settings)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _step(reg: wspool.PoolRegistry, x: torch.Tensor, out: torch.Tensor, *, rule: str = "default") -> None:
    """One layer: ask the pool for its workspace (as a backend does on every call), compute through it."""
    ws = reg.workspace("ws", x.device, rule=rule)
    scratch = ws[: x.numel() * 4].view(torch.float32)
    torch.sin(x, out=scratch)
    scratch.mul_(3.0)
    torch.add(scratch, x, out=out)


def _capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """Warm ``fn`` up on a side stream, then capture it (the pattern of PyTorch's CUDA-graph docs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _eager(reg: wspool.PoolRegistry, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _step(reg, x, out)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("debug_streams", [False, True], ids=["plain", "debug_streams"])
def test_graph_captured_through_the_pool_replays_identically(debug_streams: bool) -> None:
    """A graph whose kernels use the pool's buffer replays with output identical to eager runs; nothing grows."""
    device = _device()
    reg = _registry(debug_streams=debug_streams)
    reg.reserve("ws", device, rule="default")
    x = torch.randn(NUMEL, device=device)
    out = torch.empty_like(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamOrderWarning)  # capture and replay never trip the stream check
        graph = _capture(lambda: _step(reg, x, out))
        pointer = reg.pool("ws", device).buffer.data_ptr()  # type: ignore[union-attr]
        for seed in range(3):
            x.copy_(torch.randn(NUMEL, device=device, generator=torch.Generator(device).manual_seed(seed)))
            expected = _eager(reg, x)
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, expected)
    stats = reg.stats("ws", device)
    assert (stats.capacity_bytes, stats.grow_count, stats.refused_count) == (16 * MiB, 1, 0)
    assert reg.pool("ws", device).buffer.data_ptr() == pointer  # type: ignore[union-attr]


def test_capture_that_would_grow_raises_and_the_first_graph_still_replays() -> None:
    """Growth needed during capture raises WorkspaceFrozenError; the buffer is untouched; the first graph replays."""
    device = _device()
    reg = _registry()
    reg.reserve("ws", device, rule="default")
    x = torch.randn(NUMEL, device=device)
    out, other = torch.empty_like(x), torch.empty_like(x)
    graph = _capture(lambda: _step(reg, x, out))
    before = (reg.stats("ws", device).capacity_bytes, reg.pool("ws", device).buffer.data_ptr())  # type: ignore[union-attr]

    second = torch.cuda.CUDAGraph()
    with (
        pytest.raises(
            WorkspaceFrozenError,
            match=r"pool 'ws' on cuda:\d+ \(lane main\) would have to grow during CUDA-graph capture: rule big needs "
            r"67108864 bytes \(64MiB\), 16777216 bytes available",
        ),
        torch.cuda.graph(second),  # its __exit__ ends the capture cleanly while the error propagates
    ):
        other.copy_(x)  # a layer that fits was captured before the one that does not
        _step(reg, x, other, rule="big")
    assert not torch.cuda.is_current_stream_capturing()
    del second

    after = (reg.stats("ws", device).capacity_bytes, reg.pool("ws", device).buffer.data_ptr())  # type: ignore[union-attr]
    assert after == before
    assert reg.stats("ws", device).refused_count == 1
    x.copy_(torch.randn(NUMEL, device=device))
    expected = _eager(reg, x)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_buffer_served_during_capture_is_retired_when_the_pool_grows() -> None:
    """Growth after a capture keeps the captured buffer alive: replays stay correct and touch no new allocation."""
    device = _device()
    reg = _registry()
    reg.reserve("ws", device, rule="default")
    x = torch.randn(NUMEL, device=device)
    out = torch.empty_like(x)
    graph = _capture(lambda: _step(reg, x, out))
    captured = reg.pool("ws", device).buffer.data_ptr()  # type: ignore[union-attr]

    grown = reg.workspace("ws", device, rule="big").data_ptr()  # unfrozen, outside capture: allowed
    assert grown != captured
    assert reg.stats("ws", device).retired_bytes == 16 * MiB
    # Had the captured buffer been freed, blocks of its size would be handed out again; fill some to catch it.
    decoys = [torch.full((16 * MiB,), 0x5A, dtype=torch.uint8, device=device) for _ in range(4)]

    x.copy_(torch.randn(NUMEL, device=device))
    expected = _eager(reg, x)  # through the new, larger buffer
    out.zero_()
    graph.replay()  # through the retired one
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    assert all(bool((decoy == 0x5A).all()) for decoy in decoys)

    del graph
    torch.cuda.synchronize()
    assert reg.release_retired() == 16 * MiB
    assert reg.stats("ws", device).retired_bytes == 0


def test_two_lanes_on_two_streams_match_serial_results() -> None:
    """Two lanes used from two streams at once give bit-identical results to running them one after the other."""
    device = _device()
    reg = _registry(debug_streams=True)
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
    device = _device()
    reg = _registry(debug_streams=True)
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


def test_real_out_of_memory_is_a_counted_limit_error_and_the_pool_still_serves() -> None:
    """A request larger than the GPU (512 TiB) is a WorkspaceLimitError, counted; the old buffer is still served."""
    from wspool.errors import WorkspaceLimitError

    reg = wspool.PoolRegistry.from_config(None, pools={"p": {"rules": {"default": "1MiB"}}})
    device = _device()
    before = reg.workspace("p", device)
    with pytest.raises(WorkspaceLimitError, match="could not grow from 1048576 to 562949953421312 bytes"):
        reg.pool("p", device).request(2**49)
    stats = reg.stats("p", device)
    assert (stats.refused_count, stats.capacity_bytes) == (1, 1 << 20)
    assert reg.workspace("p", device).data_ptr() == before.data_ptr()


def test_mla_decode_plans_per_lane_on_the_gpu() -> None:
    """The same metadata under two lanes gets two plans and two buffers (no shared workspace between streams)."""
    from tests.helpers.mla_inputs import make_inputs
    from wspool.flashinfer import mla_decode

    reg = wspool.PoolRegistry.from_config(None)
    inputs = make_inputs(2, 128, [70, 300], device=_device())
    for name in ("a", "b"):
        with wspool.lane(name):
            mla_decode(
                inputs.query, inputs.kv_cache, inputs.block_tables, inputs.seq_lens, inputs.max_seq_len,
                sm_scale=inputs.sm_scale, registry=reg,
            )  # fmt: skip
    buffers = {s.lane: s.capacity_bytes for s in reg.all_stats() if s.pool == "flashinfer_mla"}
    assert set(buffers) == {"a", "b"} and all(buffers.values())
    a, b = (reg.pool("flashinfer_mla", _device(), lane=n).buffer for n in ("a", "b"))
    assert a is not None and b is not None and a.data_ptr() != b.data_ptr()
