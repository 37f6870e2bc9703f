"""Tests for wspool.integrations.reserving: an engine's reservation, its switch, its log line and its snapshots."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import wspool
from tests.helpers.registry import make_registry
from wspool.bounds import FactLimit
from wspool.cli import main
from wspool.integrations.reserving import read_snapshots, reserve_for_engine, write_snapshot

MiB = 1 << 20
POOLS = {
    "mla": {"rules": {"lse": "batch_size * 1MiB", "default": "1MiB"}},
    "odd": {"rules": {"default": "q_len * 1MiB"}},
}
LIMITS = {"batch_size": FactLimit(1, 8, None, "the engine's --max-batch")}


def test_reserves_the_rules_the_engine_calls_and_logs_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """The named rules are reserved at their bound; one line says what is held and what the engine's constants hold."""
    registry = make_registry(POOLS)
    with caplog.at_level(logging.INFO, logger="wspool"):
        plan = reserve_for_engine(
            "Engine", LIMITS, {"mla": ["lse"]}, device="cpu", lanes=["main"], engine_bytes=256 * MiB, registry=registry
        )
    assert plan is not None and registry.stats("mla", "cpu").capacity_bytes == 8 * MiB
    (line,) = [r.getMessage() for r in caplog.records if "before Engine sizes its KV cache" in r.getMessage()]
    assert line == (
        "wspool: rank 0 reserved 8MiB in 1 buffer(s): mla 8MiB (cpu, lane main) before Engine sizes its KV cache; "
        "Engine's own constants would hold 256MiB"
    )


def test_switch_off_reserves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """WSPOOL_RESERVE=0 leaves every pool to grow on first use."""
    monkeypatch.setenv("WSPOOL_RESERVE", "0")
    registry = make_registry(POOLS)
    assert (
        reserve_for_engine("Engine", LIMITS, {"mla": ["lse"]}, device="cpu", lanes=["main"], registry=registry) is None
    )
    assert registry.stats("mla", "cpu").capacity_bytes == 0


def test_malformed_switch_is_a_warning_and_reserves(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A WSPOOL_RESERVE value that is not understood is one warning naming it; the reservation goes on."""
    monkeypatch.setenv("WSPOOL_RESERVE", "maybe")
    registry = make_registry(POOLS)
    with caplog.at_level(logging.WARNING, logger="wspool"):
        reserve_for_engine("Engine", LIMITS, {"mla": ["lse"]}, device="cpu", lanes=["main"], registry=registry)
    assert any("WSPOOL_RESERVE = 'maybe'" in r.getMessage() for r in caplog.records)
    assert registry.stats("mla", "cpu").capacity_bytes == 8 * MiB


def test_a_rule_without_limits_is_a_warning_and_the_rest_is_reserved(caplog: pytest.LogCaptureFixture) -> None:
    """A rule reading a fact with no limit grows on first use (a warning naming the fact); the others are reserved."""
    registry = make_registry(POOLS)
    with caplog.at_level(logging.WARNING, logger="wspool"):
        reserve_for_engine(
            "Engine", LIMITS, {"mla": ["lse"], "odd": ["default"]}, device="cpu", lanes=["main"], registry=registry
        )
    assert any("odd.default not reserved" in r.getMessage() and "'q_len'" in r.getMessage() for r in caplog.records)
    assert registry.stats("mla", "cpu").capacity_bytes == 8 * MiB


def test_snapshots_are_written_per_event_and_read_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With WSPOOL_STATS_DIR each event is a snapshot in the rank's file; read_snapshots returns them by rank."""
    monkeypatch.setenv("WSPOOL_STATS_DIR", str(tmp_path))
    registry = make_registry(POOLS)
    reserve_for_engine("Engine", LIMITS, {"mla": ["lse"]}, device="cpu", lanes=["main"], registry=registry)
    registry.workspace("mla", "cpu", rule="lse", batch_size=3)
    assert write_snapshot("captured", registry) == tmp_path / "wspool-rank0.json"
    (rank,) = read_snapshots(tmp_path)
    assert sorted(rank["events"]) == ["captured", "reserved"]
    (pool,) = rank["events"]["captured"]["pools"]
    # Two requests: the reservation's, then the call's.
    assert (pool["pool"], pool["capacity_bytes"], pool["grow_count"], pool["request_count"]) == ("mla", 8 * MiB, 1, 2)
    assert rank["events"]["reserved"]["reservation"]["total_bytes"] == 8 * MiB


def test_no_stats_dir_writes_nothing() -> None:
    """Without WSPOOL_STATS_DIR no snapshot is written."""
    assert write_snapshot("reserved", make_registry(POOLS)) is None


def test_stats_from_shows_each_rank_and_the_total(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """wspool stats --from DIR lists each rank's events and pools, then the total at each rank's latest snapshot."""
    monkeypatch.setenv("WSPOOL_STATS_DIR", str(tmp_path))
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        registry = make_registry(POOLS)
        reserve_for_engine("Engine", LIMITS, {"mla": ["lse"]}, device="cpu", lanes=["main"], registry=registry)
    assert main(["stats", "--from", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rank 0 (pid" in out and "rank 1 (pid" in out
    assert "reserved: 8MiB held in 1 pool(s)" in out
    assert "total over 2 rank(s), each at its latest snapshot: 16MiB held, 2 grows, 0 refused" in out
    assert main(["stats", "--from", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"]["capacity_bytes"] == 16 * MiB


@pytest.mark.parametrize(("files", "message"), [({}, "no wspool-rank"), ({"wspool-rank0.json": "{"}, "not a wspool")])
def test_stats_from_a_bad_folder_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], files: dict[str, str], message: str
) -> None:
    """An empty folder, or one holding a file that is not a snapshot, is one error line and exit status 2."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert main(["stats", "--from", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err


def test_the_default_registry_is_used_when_none_is_given() -> None:
    """reserve_for_engine reserves in the process's registry by default."""
    wspool.set_registry(make_registry(POOLS))
    reserve_for_engine("Engine", LIMITS, {"mla": ["lse"]}, device="cpu", lanes=["main"])
    assert wspool.get_registry().stats("mla", "cpu").capacity_bytes == 8 * MiB
