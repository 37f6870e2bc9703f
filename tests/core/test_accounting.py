"""Tests for wspool.memory: memory_summary / memory_stats, MemPool allocation, the stats command."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import wspool
from wspool.cli import main
from wspool.memory import dry_run, mem_pool_allocator

MiB = 1 << 20
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
