"""Tests for wspool.integrations.vllm._get_workspace_buffer with profiles and default facts: every shipped config."""

from __future__ import annotations

import pytest

import wspool
from tests.helpers.devices_fake import B200, H200, HOPPER_MLA_BYTES, meta_allocator
from wspool.devices import DeviceDescription, fake_device
from wspool.errors import ConfigError
from wspool.flashinfer.layouts import softmax_slab_bytes
from wspool.integrations import vllm as drop_in
from wspool.settings.profiles import shipped_config, shipped_config_names

MiB = 1 << 20


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Point the adapter at the CPU, which the tests fake as a GPU."""
    monkeypatch.setattr(drop_in, "_DROP_IN_DEVICE", "cpu")


def _serve(config: str | None, description: DeviceDescription) -> tuple[int, int]:
    with fake_device("cpu", description):
        settings = wspool.load_settings(None if config is None else shipped_config(config))
        registry = wspool.PoolRegistry(settings, allocator=meta_allocator)
        wspool.set_registry(registry)
        drop_in.check_workspace_facts(registry, "cpu")
        default = drop_in._get_workspace_buffer(False).numel()
        return default, drop_in._get_workspace_buffer(True).numel()


def test_no_facts_on_an_h200_serves_the_hopper_profile() -> None:
    """The drop-in function, given only return_lse, gets 17369088 bytes on a faked H200."""
    assert _serve(None, H200) == (HOPPER_MLA_BYTES, HOPPER_MLA_BYTES)


def test_no_facts_on_a_b200_serves_the_blackwell_profile() -> None:
    """On a faked B200 the blackwell profile's default facts size the LSE slab."""
    assert _serve(None, B200) == (64 * MiB, softmax_slab_bytes(128, 512, 1) + 64 * MiB)


@pytest.mark.parametrize("name", ["blackwell", "default", "hopper", "kimi_dcp", "sglang", "tokenspeed", "vllm"])
@pytest.mark.parametrize("description", [H200, B200], ids=["h200", "b200"])
def test_every_shipped_config_is_served_without_facts(name: str, description: DeviceDescription) -> None:
    """Each shipped configuration passes the load-time check and serves both rules through the adapter."""
    default, lse = _serve(name, description)
    assert lse >= default > 0
    if name == "hopper":
        assert (default, lse) == (64 * description.sm_count * 2056, 64 * description.sm_count * 2056)
    if name == "kimi_dcp":
        assert lse >= softmax_slab_bytes(8 * 8, 1024, 1) + 32 * MiB  # the seed's overflow, served


def test_the_shipped_configs_are_all_tested() -> None:
    """The parametrisation above covers every shipped configuration."""
    assert shipped_config_names() == ["blackwell", "default", "hopper", "kimi_dcp", "sglang", "tokenspeed", "vllm"]


def test_a_missing_fact_fails_at_load_time_naming_its_key() -> None:
    """check_workspace_facts names the fact a rule lacks and the key that sets it, allocating nothing."""
    rule = "8 * num_heads * max_seq_len + 1MiB"
    with fake_device("cpu", H200):
        registry = wspool.PoolRegistry(
            wspool.load_settings(pools={"flashinfer_mla": {"rules": {"lse": rule}}}), allocator=meta_allocator
        )
        with pytest.raises(
            ConfigError,
            match=r"needs fact\(s\) max_seq_len, num_heads, .*set pools\.flashinfer_mla\.facts\.max_seq_len / "
            r"WSPOOL_POOLS__FLASHINFER_MLA__FACTS__MAX_SEQ_LEN, pools\.flashinfer_mla\.facts\.num_heads",
        ):
            drop_in.check_workspace_facts(registry, "cpu")
    assert all(s.capacity_bytes == 0 for s in registry.all_stats())


def test_on_the_cpu_the_hopper_profile_names_the_device_fact() -> None:
    """profile hopper on a device without facts fails the check naming sm_count."""
    registry = wspool.PoolRegistry(wspool.load_settings(profile="hopper"), allocator=meta_allocator)
    with pytest.raises(ConfigError, match=r"profile hopper\) needs fact\(s\) sm_count.*facts\.sm_count"):
        drop_in.check_workspace_facts(registry, "cpu")
