"""Tests for pools that share a buffer (pools.<pool>.shared_with): validation, the registry, statistics."""

from __future__ import annotations

from pathlib import Path

import pytest

import wspool
from tests.helpers.registry import make_registry
from wspool.errors import ConfigError, RuleError
from wspool.settings.schema import load_settings
from wspool.units import MiB


def test_guest_rules_are_served_by_the_host_buffer() -> None:
    """A pool with shared_with draws from its host's buffer, which grows to the largest of both pools' rules."""
    reg = make_registry({"a": {"rules": {"x": "64MiB"}}, "b": {"shared_with": "a", "rules": {"y": "96MiB"}}})
    assert reg.pool("b", "cpu") is reg.pool("a", "cpu") and reg.buffer_pool("b") == "a"
    small = reg.workspace("a", "cpu", rule="x")
    big = reg.workspace("b", "cpu", rule="y")
    assert (small.numel(), big.numel()) == (64 * MiB, 96 * MiB)
    assert reg.workspace("a", "cpu", rule="x") is big
    stats = reg.stats("b", "cpu")
    assert (stats.pool, stats.capacity_bytes, dict(stats.requests_by_rule)) == ("a", 96 * MiB, {"x": 2, "y": 1})
    assert reg.resolve("b", "y") == 96 * MiB and list(reg.spec("b").rules) == ["y"]


def test_host_limit_applies_and_errors_name_the_guest_key() -> None:
    """The host's max_bytes caps the shared buffer; a refused growth names the key of the guest's rule."""
    reg = make_registry(
        {"a": {"rules": {"x": "1MiB"}, "max_bytes": "8MiB"}, "b": {"shared_with": "a", "rules": {"y": "n * 1MiB"}}}
    )
    with pytest.raises(
        wspool.WorkspaceLimitError, match=r"pool 'a' .* for rule y, above max_bytes .* pools\.a\.max_bytes"
    ):
        reg.workspace("b", "cpu", rule="y", n=16)
    reg.workspace("b", "cpu", rule="y", n=2)
    with (
        reg.frozen(),
        pytest.raises(wspool.WorkspaceFrozenError, match=r"raise pools\.b\.rules\.y / WSPOOL_POOLS__B__RULES__Y"),
    ):
        reg.workspace("b", "cpu", rule="y", n=4)
    with pytest.raises(wspool.RuleError, match=r"pools\.b\.rules\.y .*needs fact"):
        reg.workspace("b", "cpu", rule="y")


def test_lanes_and_devices_stay_apart() -> None:
    """Sharing is per device and lane: another lane of the guest is another lane of the host."""
    reg = make_registry({"a": {"rules": {"x": "1MiB"}}, "b": {"shared_with": "a", "rules": {"y": "2MiB"}}})
    with wspool.lane("ubatch1"):
        reg.workspace("b", "cpu", rule="y")
    reg.workspace("a", "cpu", rule="x")
    assert sorted((s.pool, s.lane, s.capacity_bytes) for s in reg.all_stats()) == [
        ("a", "main", MiB), ("a", "ubatch1", 2 * MiB),
    ]  # fmt: skip


def test_declared_guest_rules_join_the_host() -> None:
    """A backend declaring its shared pool's default rules makes them part of the host buffer's rules."""
    reg = make_registry({"a": {"rules": {"x": "1MiB"}}, "b": {"shared_with": "a"}})
    reg.declare_pool("b", {"y": "3MiB"})
    assert reg.workspace("b", "cpu", rule="y").numel() == 3 * MiB
    assert reg.pool("a", "cpu").spec.rule_pools == {"x": "a", "y": "b"}


@pytest.mark.parametrize(
    ("pools", "match"),
    [
        ({"a": {"shared_with": "a"}}, r"pools\.a\.shared_with = 'a' \(from code\): a pool cannot share its own"),
        ({"a": {"shared_with": "nope"}}, r"there is no pool 'nope' \(configured: a, flashinfer, flashinfer_mla\)"),
        ({"a": {"shared_with": "flashinfer"}}, r"pool 'flashinfer' itself draws from 'flashinfer_mla'; name "),
        ({"a": {"shared_with": "flashinfer_mla", "max_bytes": "1GiB"}}, r"set growth and max_bytes under pools\.fl"),
        ({"a": {"shared_with": "flashinfer_mla", "rules": {"lse": 1}}}, r"both pools have a rule 'lse'"),
        ({"a": {"shared_with": 3}}, r"pools\.a\.shared_with = 3 .*expected the name of another pool"),
    ],
)
def test_bad_sharing_is_a_config_error(pools: dict[str, object], match: str) -> None:
    """A shared_with naming no pool, itself, another guest, or with clashing rules or limits is refused."""
    with pytest.raises(ConfigError, match=match) as info:
        load_settings(pools=pools)
    assert info.value.key in ("pools.a.shared_with", "pools.a")


def test_default_configuration_shares_and_can_be_undone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """By default paged attention shares flashinfer_mla's buffer; an empty variable or YAML null undoes it."""
    assert wspool.get_registry().buffer_pool("flashinfer") == "flashinfer_mla"
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER__SHARED_WITH", "")
    assert wspool.PoolRegistry().buffer_pool("flashinfer") == "flashinfer"
    monkeypatch.delenv("WSPOOL_POOLS__FLASHINFER__SHARED_WITH")
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  flashinfer:\n    shared_with: null\n")
    assert wspool.PoolRegistry.from_config(path).buffer_pool("flashinfer") == "flashinfer"


def test_a_pool_serves_only_its_own_rules_as_resolve_says() -> None:
    """Pools sharing one buffer each serve their own rules: workspace, reserve and warmup refuse the other pool's
    rules with the error resolve gives, naming the setting."""
    reg = make_registry({"a": {"rules": {"x": "64MiB"}}, "b": {"shared_with": "a", "rules": {"y": "96MiB"}}})
    for pool, foreign in (("b", "x"), ("a", "y")):
        with pytest.raises(RuleError, match=rf"pool '{pool}' has no rule '{foreign}'.*pools\.{pool}\.rules\.{foreign}"):
            reg.resolve(pool, foreign, device="cpu")
        with pytest.raises(RuleError, match=rf"pool '{pool}' has no rule '{foreign}'"):
            reg.workspace(pool, "cpu", rule=foreign)
        with pytest.raises(RuleError, match=rf"pool '{pool}' has no rule '{foreign}'"):
            reg.reserve(pool, "cpu", rule=foreign)
        with pytest.raises(RuleError, match=rf"pool '{pool}' has no rule '{foreign}'"):
            reg.warmup(pool, [{}], "cpu", rule=foreign)
    assert reg.stats("a", "cpu").request_count == 0 and reg.stats("a", "cpu").capacity_bytes == 0
    assert reg.workspace("b", "cpu", rule="y").numel() == 96 * MiB


def test_warmup_agrees_on_a_shared_buffer_in_a_one_rank_group(tmp_path: Path) -> None:
    """warmup(..., agree_group=...) on a shared_with pool agrees under its buffer's name and grows it, on one rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        reg = make_registry({"a": {"rules": {"x": "1MiB"}}, "b": {"shared_with": "a", "rules": {"y": "3MiB"}}})
        assert reg.warmup("b", [{}], "cpu", rule="y", agree_group=dist.group.WORLD) == 3 * MiB
        assert reg.stats("a", "cpu").capacity_bytes == 3 * MiB
    finally:
        dist.destroy_process_group()


def test_a_guest_fixed_rule_above_the_hosts_cap_is_refused_at_load() -> None:
    """A fixed rule a shared_with pool brings above the host's max_bytes is refused when the registry is built."""
    pools = {"h": {"rules": {"x": "1MiB"}, "max_bytes": "64MiB"}, "g": {"shared_with": "h", "rules": {"y": "100MiB"}}}
    with pytest.raises(ConfigError, match=r"pools\.g\.rules\.y / WSPOOL_POOLS__G__RULES__Y = '100MiB' is above "
                       r"pools\.h\.max_bytes / WSPOOL_POOLS__H__MAX_BYTES = 67108864"):  # fmt: skip
        make_registry(pools)
    pools["g"]["rules"]["y"] = "60MiB"
    assert make_registry(pools).workspace("g", "cpu", rule="y").numel() == 60 * MiB


def test_agree_reserves_a_shared_pool_on_its_hosts_buffer_in_a_one_rank_group(tmp_path: Path) -> None:
    """agree(reserve={(guest, lane): n}) grows the host's buffer once and succeeds on one rank; a size above the
    host's max_bytes is refused before anything is allocated."""
    import torch.distributed as dist

    from wspool.distributed import AgreedChange, AgreementLimitError, agree

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        pools = {"a": {"rules": {"x": "1MiB"}, "max_bytes": "8MiB"}, "b": {"shared_with": "a", "rules": {"y": "3MiB"}}}
        reg = make_registry(pools)
        changes = agree(reg, device="cpu", reserve={("b", "main"): 3 * MiB, ("a", "main"): 2 * MiB})
        assert changes == [AgreedChange("a", "main", "cpu", 0, 3 * MiB)]
        assert reg.stats("a", "cpu").capacity_bytes == 3 * MiB
        fresh = make_registry(pools)
        with pytest.raises(AgreementLimitError, match=r"pool 'a' \(lane main\) on cpu needs 16777216 bytes .*above "
                           r"max_bytes = 8388608 bytes .*pools\.a\.max_bytes"):  # fmt: skip
            agree(fresh, device="cpu", reserve={("b", "main"): "16MiB"})
        assert fresh.all_stats() == []
    finally:
        dist.destroy_process_group()


def test_agree_reserves_the_builtin_flashinfer_pool_on_flashinfer_mlas_buffer(tmp_path: Path) -> None:
    """The built-in flashinfer pool shares flashinfer_mla's buffer: agreeing a reserve for it grows that buffer."""
    import torch.distributed as dist

    from wspool.distributed import agree

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        reg = make_registry()
        assert reg.buffer_pool("flashinfer") == "flashinfer_mla"
        (change,) = agree(reg, device="cpu", reserve={("flashinfer", "main"): 4 * MiB})
        assert (change.pool, change.new_bytes) == ("flashinfer_mla", 4 * MiB)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("pool", "rule"), [("a", "y"), ("b", "x")])
def test_a_pool_is_never_served_another_pools_rule_on_its_shared_buffer(pool: str, rule: str) -> None:
    """workspace() and handle() refuse a rule the named pool does not own, though the shared buffer has it."""
    reg = make_registry({"a": {"rules": {"x": "1MiB"}}, "b": {"shared_with": "a", "rules": {"y": "2MiB"}}})
    for _ in range(2):  # the first call and a call after the fast path was filled for the owned rules
        with pytest.raises(RuleError, match=rf"pools\.{pool}\.rules"):
            reg.workspace(pool, "cpu", rule=rule)
        with pytest.raises(RuleError, match=rf"pools\.{pool}\.rules"):
            reg.handle(pool, rule, device="cpu")
        reg.workspace("a", "cpu", rule="x"), reg.workspace("b", "cpu", rule="y")
    assert reg.stats("a", "cpu").request_count == 4
