"""Tests for wspool.memory: summaries and statistics, MemPool allocation, the stats command, wrappers' own buffers."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import wspool
from wspool.cli import main
from wspool.memory import dry_run, kernel_buffer_stats, mem_pool_allocator, track_kernel_buffers

MiB = 1 << 20
DEFAULT_INT = 8 * MiB  # what FlashInfer allocates per wrapper by default, as its side of wspool passes
FACTS = ["--fact", "sm_count=132", "--fact", "head_dim=128", "--fact", "num_qo_heads=32"]


def _busy_registry() -> wspool.PoolRegistry:
    reg = wspool.PoolRegistry.from_config(pools={"solo": {"rules": {"default": "8MiB"}}})
    reg.workspace("flashinfer_mla", "cpu", rule="lse")
    reg.workspace("flashinfer_mla", "cpu")
    reg.workspace("flashinfer", "cpu", rule="decode", sm_count=132, num_qo_heads=32, head_dim=128)
    reg.workspace("solo", "cpu")
    with wspool.lane("ubatch1"):
        reg.workspace("solo", "cpu")
    return reg


def test_memory_stats_is_plain_data_per_buffer_and_backend() -> None:
    """memory_stats lists each buffer with its backends' requests per rule and the bytes held; it is JSON-able."""
    data = json.loads(json.dumps(_busy_registry().memory_stats()))
    by_key = {(b["pool"], b["lane"]): b for b in data["buffers"]}
    assert sorted(by_key) == [("flashinfer_mla", "main"), ("solo", "main"), ("solo", "ubatch1")]
    shared = by_key["flashinfer_mla", "main"]
    assert shared["backends"] == {"flashinfer": {"decode": 1}, "flashinfer_mla": {"default": 1, "lse": 1}}
    assert (shared["capacity_bytes"], shared["grow_count"], shared["request_count"]) == (256 * MiB, 1, 3)
    assert data["held_bytes"] == data["devices"]["cpu"]["held_bytes"] == 272 * MiB
    assert "torch_allocated_bytes" not in data["devices"]["cpu"]  # PyTorch's figures are for CUDA devices


def test_memory_summary_table() -> None:
    """memory_summary has the columns of the issue, one row per buffer, then what each device holds."""
    lines = _busy_registry().memory_summary().splitlines()
    assert lines[0].split() == ["pool", "device", "lane", "capacity", "peak", "request", "grows", "backends",
                                "(requests", "per", "rule)"]  # fmt: skip
    assert lines[1].split()[:6] == ["flashinfer_mla", "cpu", "main", "256MiB", "256MiB", "1"]
    assert lines[1].endswith("flashinfer (decode 1); flashinfer_mla (default 1, lse 1)")
    assert lines[-1] == "cpu: wspool holds 272MiB"
    empty = wspool.PoolRegistry().memory_summary().splitlines()
    assert empty[1] == "(no buffers: nothing has requested a workspace yet)"


def test_mem_pool_allocator_routes_cuda_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA buffers are made under torch.cuda.use_mem_pool(pool, device); other devices allocate as usual."""
    entered: list[tuple[object, torch.device]] = []

    @contextmanager
    def use_mem_pool(pool: object, device: torch.device) -> Iterator[None]:
        entered.append((pool, device))
        yield

    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    made: list[torch.device] = []

    def base(nbytes: int, device: torch.device) -> torch.Tensor:
        made.append(device)
        return torch.zeros(nbytes, dtype=torch.uint8)

    pool = object()
    allocate = mem_pool_allocator(pool, base)
    allocate(16, torch.device("cuda", 1))
    allocate(16, torch.device("cpu"))
    assert entered == [(pool, torch.device("cuda", 1))] and made == [torch.device("cuda", 1), torch.device("cpu")]


def test_registry_takes_a_mem_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """PoolRegistry(mem_pool=...) allocates through the MemPool allocator (and still zero-fills on the CPU)."""
    seen: list[object] = []
    monkeypatch.setattr("wspool.memory.mem_pool_allocator", lambda pool, base: seen.append(pool) or base)
    reg = wspool.PoolRegistry(wspool.load_settings(), mem_pool="the pool")
    assert seen == ["the pool"]
    assert int(reg.workspace("flashinfer_mla", "cpu").count_nonzero()) == 0


def test_dry_run_allocates_nothing_and_compares_with_separate_buffers() -> None:
    """On the meta device every rule is requested once, largest first; separate_bytes is one buffer per pool."""
    data = dry_run(wspool.PoolRegistry(), {"sm_count": 132, "head_dim": 128, "num_qo_heads": 32})
    (buffer,) = data["buffers"]
    assert (buffer["device"], buffer["capacity_bytes"], buffer["grow_count"]) == ("meta", 256 * MiB, 1)
    decode = (512 * 132 + 32) * 129 * 4 + MiB
    assert data["separate_bytes"] == 256 * MiB + decode and data["skipped"] == {}


def test_stats_command(capsys: pytest.CaptureFixture[str]) -> None:
    """wspool stats prints the dry run's table; rules whose facts are missing are listed as skipped."""
    assert main(["stats"]) == 0
    out = capsys.readouterr().out
    assert "flashinfer_mla  meta    main  256MiB" in out
    assert "skipped flashinfer.decode (give its facts with --fact NAME=VALUE)" in out
    assert main(["stats", "--json", *FACTS]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["held_bytes"] == 256 * MiB and data["buffers"][0]["backends"]["flashinfer"] == {
        "decode": 1,
        "prefill": 1,
    }


def test_stats_command_bad_fact(capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed --fact exits with status 2 and one line."""
    with pytest.raises(SystemExit) as info:
        main(["stats", "--fact", "sm_count"])
    assert info.value.code == 2
    assert "expected NAME=INTEGER, got 'sm_count'" in capsys.readouterr().err


# -- what FlashInfer's wrappers hold themselves ------------------------------------------


class FakeWrapper:
    """Stands in for a FlashInfer wrapper: a float workspace it was given, and buffers of its own."""

    def __init__(self, workspace: torch.Tensor, index: torch.Tensor) -> None:
        self._float_workspace_buffer = workspace
        self._qo_indptr_buf = index
        self._int_workspace_buffer = torch.empty(8 * MiB, dtype=torch.uint8, device="meta")
        self._backend = type("Backend", (), {})()
        self._backend.scratch = torch.empty(MiB, dtype=torch.uint8, device="meta")
        self._backend.same = self._int_workspace_buffer
        self._host_copy = torch.empty(16, dtype=torch.uint8)  # plain host memory: not pinned, not counted


def test_live_wrappers_are_counted_per_pool_and_dropped_ones_are_not() -> None:
    """Each live wrapper's own tensors count once; the pool's buffer and supplied index buffers do not."""
    reg = wspool.PoolRegistry.from_config(pools={"p": {"rules": {"default": "1MiB"}}})
    pool = reg.pool("p", "cpu")
    workspace = reg.workspace("p", "cpu")
    index = torch.zeros(9, dtype=torch.int32)
    first, second = FakeWrapper(workspace, index), FakeWrapper(workspace, index)
    for wrapper in (first, second, first):
        track_kernel_buffers(reg, pool, wrapper, supplied=[index], default_int_bytes=DEFAULT_INT)
    (stats,) = kernel_buffer_stats(reg)
    assert (stats.pool, stats.device, stats.lane, stats.wrappers) == ("p", "cpu", "main", 2)
    assert (stats.device_bytes, stats.pinned_host_bytes) == (2 * 9 * MiB, 0)
    del second
    gc.collect()
    assert kernel_buffer_stats(reg)[0].wrappers == 1


def test_memory_summary_shows_the_wrappers_buffers() -> None:
    """memory_summary and memory_stats report the wrappers' own bytes next to the pool's."""
    reg = wspool.PoolRegistry.from_config(pools={"p": {"rules": {"default": "1MiB"}}})
    wrapper = FakeWrapper(reg.workspace("p", "cpu"), torch.zeros(1))
    track_kernel_buffers(reg, reg.pool("p", "cpu"), wrapper, default_int_bytes=DEFAULT_INT)
    summary = reg.memory_summary()
    line = (
        "FlashInfer's own buffers on p cpu lane main: 1 wrapper(s) hold 9MiB more on the device, 0B pinned host "
        "(FlashInfer's defaults: 8MiB + 8MiB pinned)"
    )
    assert line in summary
    assert reg.memory_stats()["devices"]["cpu"]["kernel_bytes"] == 9 * MiB
    assert wrapper is not None


def test_no_wrappers_no_rows() -> None:
    """A registry whose ops built no wrapper reports none."""
    assert kernel_buffer_stats(wspool.PoolRegistry()) == []
