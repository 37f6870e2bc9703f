"""Tests for wspool.devices' stream-order check (one buffer used from two unordered streams).

The decision logic runs here against a small simulated GPU: streams hold
queues of kernels and waits, events mark queue positions, and the GPU runs
only when the host waits on an event. The real-stream version is in
tests/reliability/test_streams_gpu.py.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import wspool
from wspool.devices import StreamOrderWarning, StreamOrderWatch

CUDA0 = torch.device("cuda", 0)


class FakeStream:
    """A stream of the simulated GPU: a queue of kernels (None) and waits (stream, position)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: list[tuple[FakeStream, int] | None] = []
        self.done = 0

    def launch(self) -> None:
        self.ops.append(None)

    def wait_stream(self, other: FakeStream) -> None:
        self.ops.append((other, len(other.ops)))

    def run_to(self, position: int) -> None:
        while self.done < position:
            op = self.ops[self.done]
            if op is not None:
                op[0].run_to(op[1])
            self.done += 1

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeEvent:
    """An event of the simulated GPU; synchronize() runs its stream up to it."""

    syncs = 0

    def record(self, stream: FakeStream) -> None:
        self.stream, self.position = stream, len(stream.ops)

    def query(self) -> bool:
        return self.stream.done >= self.position

    def synchronize(self) -> None:
        FakeEvent.syncs += 1
        self.stream.run_to(self.position)


class FakeDevice:
    """Two streams and a current one, as torch.cuda.current_stream() would return."""

    def __init__(self) -> None:
        self.a, self.b = FakeStream("A"), FakeStream("B")
        self.current = self.a

    def watch(self) -> StreamOrderWatch:
        return StreamOrderWatch(
            "pool 'p' on cuda:0 (lane main)", CUDA0, current_stream=self.current_stream, new_event=FakeEvent
        )

    def current_stream(self) -> FakeStream:
        return self.current

    def request(self, watch: StreamOrderWatch, stream: FakeStream) -> None:
        self.current = stream
        watch.observe()


@pytest.fixture
def gpu() -> FakeDevice:
    """A fresh simulated device."""
    FakeEvent.syncs = 0
    return FakeDevice()


def test_one_stream_never_warns_nor_waits(gpu: FakeDevice) -> None:
    """Requests from a single stream are ordered by the stream itself: no warning, no host wait."""
    watch = gpu.watch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamOrderWarning)
        for _ in range(5):
            gpu.a.launch()
            gpu.request(watch, gpu.a)
    assert FakeEvent.syncs == 0
    assert watch.warning_count == 0


def test_unordered_second_stream_warns(gpu: FakeDevice) -> None:
    """B asking while A has not reached its request, with no wait on A, warns naming pool, both streams, lanes."""
    watch = gpu.watch()
    gpu.a.launch()  # A is busy when it asks
    gpu.request(watch, gpu.a)
    with pytest.warns(
        StreamOrderWarning,
        match=r"pool 'p' on cuda:0 \(lane main\) was handed to stream <stream B> while stream <stream A>.*"
        r"did not wait for it.*own lane \(with wspool\.lane",
    ):
        gpu.request(watch, gpu.b)
    assert watch.warning_count == 1


def test_stream_that_waited_does_not_warn(gpu: FakeDevice) -> None:
    """B that waited for A before asking is ordered: the host wait shows it, and nothing is reported."""
    watch = gpu.watch()
    gpu.a.launch()
    gpu.request(watch, gpu.a)
    gpu.a.launch()  # A's kernel on the buffer
    gpu.b.wait_stream(gpu.a)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamOrderWarning)
        gpu.request(watch, gpu.b)
    assert FakeEvent.syncs == 1
    assert watch.warning_count == 0


def test_finished_earlier_stream_is_not_judged(gpu: FakeDevice) -> None:
    """If A already passed its request point on the GPU, the check stays quiet and does not wait."""
    watch = gpu.watch()
    gpu.a.launch()
    gpu.request(watch, gpu.a)
    gpu.a.run_to(len(gpu.a.ops))
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamOrderWarning)
        gpu.request(watch, gpu.b)
    assert FakeEvent.syncs == 0


def test_warns_once_per_pair_of_streams(gpu: FakeDevice) -> None:
    """A repeated race between the same two streams is reported once; the reverse pair once more."""
    watch = gpu.watch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for first, second in [(gpu.a, gpu.b), (gpu.a, gpu.b), (gpu.b, gpu.a)]:
            first.launch()
            gpu.request(watch, first)
            gpu.request(watch, second)
    assert [type(w.message) for w in caught] == [StreamOrderWarning, StreamOrderWarning]
    assert watch.warning_count == 2


def test_registry_pools_watch_streams_when_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """With WSPOOL_DEBUG_STREAMS=1, CUDA pools call the watch on each request outside capture, lanes apart."""
    gpu = FakeDevice()
    capturing = [False]
    # A CUDA device simulated through torch's public functions; buffers are made on the CPU.
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: gpu.current)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WSPOOL_DEBUG_STREAMS", "1")
    monkeypatch.setenv("WSPOOL_POOLS__P__RULES__DEFAULT", "1KiB")
    reg = wspool.PoolRegistry(allocator=lambda nbytes, device: torch.zeros(nbytes, dtype=torch.uint8))
    gpu.a.launch()  # stream A is busy when it asks
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamOrderWarning)
        reg.workspace("p", device=CUDA0)
        gpu.current = gpu.b
        reg.workspace("p", device=CUDA0, lane="b")  # another lane: another buffer and watch
        capturing[0] = True
        reg.workspace("p", device=CUDA0)  # during capture: not checked (event queries are not allowed)
        capturing[0] = False
    with pytest.warns(StreamOrderWarning, match=r"pool 'p' on cuda:0 \(lane main\)"):
        reg.workspace("p", device=CUDA0)


def test_cpu_pools_are_not_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    """debug_streams leaves CPU pools alone: they touch no CUDA function."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: pytest.fail("touched CUDA"))
    reg = wspool.PoolRegistry(wspool.load_settings(debug_streams=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamOrderWarning)
        for lane in ("a", "b", "a"):
            reg.workspace("flashinfer_mla", device="cpu", lane=lane)


def test_entering_a_lane_tells_the_hot_paths_to_ask_for_it() -> None:
    """Once any lane is entered the hot paths read the lane; a fresh interpreter starts with none entered."""
    code = (
        "import wspool, wspool.devices as d; first = d.LANES_ENTERED[0]\n"
        "with wspool.lane('x'): inside = d.LANES_ENTERED[0]\n"
        "print(first, inside, d.LANES_ENTERED[0], wspool.current_lane())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "True", "main"]
