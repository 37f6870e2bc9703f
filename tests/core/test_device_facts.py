"""Tests for wspool.devices: facts from the device, cached, below configured and caller facts."""

from __future__ import annotations

import pytest
import torch

import wspool
from tests.helpers.devices_fake import B200, H200
from wspool.devices import describe_device, device_facts, fake_device
from wspool.errors import RuleError
from wspool.settings.schema import DEVICE_FACTS

RULE = "sm_count * 1KiB + cc_major + device_memory // 1TiB"


def _registry(**pools: object) -> wspool.PoolRegistry:
    return wspool.PoolRegistry(wspool.load_settings(pools={"p": {"rules": {"default": RULE}, **pools}}))


def test_cpu_has_no_device_facts() -> None:
    """The CPU has no description and supplies no facts."""
    assert describe_device(torch.device("cpu")) is None
    assert device_facts(torch.device("cpu")) == {}


def test_fake_device_supplies_every_device_fact() -> None:
    """A faked H200 supplies sm_count, cc_major, cc_minor and device_memory, and the fake ends with the block."""
    with fake_device("cpu", H200):
        facts = device_facts(torch.device("cpu"))
        assert tuple(facts) == DEVICE_FACTS
        assert dict(facts) == {"sm_count": 132, "cc_major": 9, "cc_minor": 0, "device_memory": H200.device_memory}
    assert device_facts(torch.device("cpu")) == {}


def test_rules_of_every_pool_read_device_facts() -> None:
    """Any pool's rule on a faked device reads the device's facts without the call passing them."""
    with fake_device("cpu", H200):
        reg = _registry()
        assert reg.resolve("p", device="cpu") == 132 * 1024 + 9
        assert reg.workspace("p", "cpu").numel() == 132 * 1024 + 9


def test_a_caller_fact_wins_over_the_device() -> None:
    """A fact the call passes replaces the device's fact of the same name."""
    with fake_device("cpu", H200):
        reg = _registry()
        assert reg.workspace("p", "cpu", sm_count=2).numel() == 2 * 1024 + 9
        assert reg.resolve("p", device="cpu", sm_count=2, cc_major=0) == 2 * 1024


def test_a_configured_fact_wins_over_the_device() -> None:
    """pools.<pool>.facts overrides a device fact, and a caller's fact overrides both."""
    with fake_device("cpu", B200):
        reg = _registry(facts={"sm_count": 100})
        assert reg.workspace("p", "cpu").numel() == 100 * 1024 + 10
        assert reg.workspace("p", "cpu", sm_count=4).numel() >= 4 * 1024 + 10
        assert reg.resolve("p", device="cpu", sm_count=4) == 4 * 1024 + 10


def test_on_the_cpu_a_rule_needing_a_device_fact_names_it() -> None:
    """Without a device description the rule fails naming the fact and the key that can set it."""
    reg = _registry()
    with pytest.raises(RuleError, match=r"needs fact\(s\) cc_major, device_memory, sm_count.*pools\.p\.facts\.sm_"):
        reg.workspace("p", "cpu")
    assert reg.stats("p", "cpu").capacity_bytes == 0


def test_the_device_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """get_device_properties is called once per device, however many pools and calls follow."""
    calls: list[object] = []

    class Props:
        name, major, minor, multi_processor_count, total_memory = "NVIDIA H200", 9, 0, 132, 1 << 30

    def properties(device: object) -> Props:
        calls.append(device)
        return Props()

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    device = torch.device("cuda", 7)
    first = describe_device(device)
    for _ in range(3):
        assert describe_device(device) is first
        assert device_facts(device)["sm_count"] == 132
    assert calls == [device]


def test_an_injected_describer_serves_the_registry() -> None:
    """PoolRegistry(describe_device=...) stands any device in for a GPU, per registry."""
    reg = wspool.PoolRegistry(
        wspool.load_settings(pools={"p": {"rules": {"default": RULE}}}),
        describe_device=lambda device: H200 if device.type == "cpu" else None,
    )
    assert reg.device_facts("cpu")["sm_count"] == 132
    assert reg.profile_of("cpu").profile == "hopper"
    assert reg.device_facts("meta") == {}
