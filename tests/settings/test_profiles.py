"""Tests for wspool.settings.profiles: the choice per device, the precedence of a profile, and the shipped profiles."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

import wspool
from tests.helpers.devices_fake import A100, B200, GB300, H200, HOPPER_MLA_BYTES, RTX_PRO_6000, meta_allocator
from wspool.devices import DeviceDescription, fake_device
from wspool.errors import ConfigError
from wspool.flashinfer.layouts import softmax_slab_bytes
from wspool.settings.profiles import PROFILE_NAMES, choose_profile, load_profile

MiB = 1 << 20


@pytest.mark.parametrize(
    ("description", "profile"),
    [
        (A100, "fixed"),
        (H200, "hopper"),
        (B200, "blackwell"),
        (GB300, "blackwell"),
        (RTX_PRO_6000, "fixed"),
        (None, "fixed"),
    ],
)
def test_auto_picks_by_compute_capability(description: DeviceDescription | None, profile: str) -> None:
    """auto: SM90 hopper; SM100/SM103 blackwell; SM80, SM120 and the CPU vLLM's fixed sizes (fixed)."""
    choice = choose_profile("auto", description)
    assert choice.profile == profile
    assert choice.reason.startswith("auto: ")
    if description is not None:
        assert f"compute capability {description.cc_major}.{description.cc_minor}" in choice.reason


def test_sm107_is_blackwell() -> None:
    """SM107 (Blackwell's third variant) gets the blackwell profile."""
    assert choose_profile("auto", DeviceDescription("x", 10, 7, 148, 1 << 30)).profile == "blackwell"


def test_an_explicit_profile_applies_to_every_device() -> None:
    """A profile named in the settings wins over auto, and the reason says where it was set."""
    choice = choose_profile("hopper", B200, source="environment variable WSPOOL_PROFILE")
    assert choice.profile == "hopper"
    assert choice.reason == "profile = hopper (from environment variable WSPOOL_PROFILE)"


def test_every_shipped_profile_loads_and_validates() -> None:
    """Each shipped profile parses and its settings validate as configuration."""
    for name in PROFILE_NAMES:
        profile = load_profile(name)
        assert profile.description
        settings = wspool.load_settings(profile=name)
        reg = wspool.PoolRegistry(settings)
        assert reg.profile_of("cpu").profile == name


def test_blackwell_says_it_was_not_measured() -> None:
    """The blackwell profile is marked unmeasured and its description says so; hopper's says what was measured."""
    assert not load_profile("blackwell").measured
    assert "NOT measured on hardware" in load_profile("blackwell").description
    assert load_profile("hopper").measured
    assert "Not measured on SM80" in load_profile("hopper").description


@pytest.mark.parametrize(
    ("heads", "batch", "q_len", "cp_world"),
    list(itertools.product([1, 16, 128], [1, 64, 512, 1024], [1, 4, 257], [1, 8])),
)
def test_blackwell_lse_rule_never_below_flashinfer_sizing(heads: int, batch: int, q_len: int, cp_world: int) -> None:
    """The blackwell lse rule covers the launcher's softmax slab for the heads the kernel sees, plus 32MiB scratch."""
    with fake_device("cpu", B200):
        reg = wspool.PoolRegistry()
        facts = {"num_heads": heads, "batch_size": batch, "q_len": q_len, "cp_world": cp_world}
        nbytes = reg.resolve("flashinfer_mla", "lse", device="cpu", **facts)
        assert nbytes >= softmax_slab_bytes(heads * cp_world, batch, q_len) + 32 * MiB
        assert reg.resolve("flashinfer_mla", "default", device="cpu", **facts) >= 32 * MiB


def test_hopper_profile_on_an_h200_resolves_the_measured_size() -> None:
    """On a faked H200 both MLA rules resolve to 64 * 132 * (4 * 512 + 8) bytes without facts."""
    with fake_device("cpu", H200):
        reg = wspool.PoolRegistry(allocator=meta_allocator)
        assert reg.resolve("flashinfer_mla", "lse", device="cpu") == HOPPER_MLA_BYTES == 17_369_088
        assert reg.workspace("flashinfer_mla", "cpu", rule="default").numel() == HOPPER_MLA_BYTES


def test_profile_fixed_gives_vllms_fixed_sizes_on_an_h200() -> None:
    """profile: fixed keeps 128MiB / 256MiB on a Hopper device."""
    with fake_device("cpu", H200):
        reg = wspool.PoolRegistry(wspool.load_settings(profile="fixed"))
        assert reg.resolve("flashinfer_mla", "default", device="cpu") == 128 * MiB
        assert reg.resolve("flashinfer_mla", "lse", device="cpu") == 256 * MiB


def test_yaml_environment_and_code_override_the_profile_key_by_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile sits just above the built-in defaults: YAML, WSPOOL_* and code each replace one key of it."""
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  flashinfer_mla:\n    rules:\n      default: 3MiB\n")
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_MLA__FACTS__KV_LORA_RANK", "256")
    with fake_device("cpu", H200):
        reg = wspool.PoolRegistry.from_config(path)
        assert reg.resolve("flashinfer_mla", "default", device="cpu") == 3 * MiB  # YAML over the profile
        assert reg.resolve("flashinfer_mla", "lse", device="cpu") == 64 * 132 * (4 * 256 + 8)  # the profile's rule
        coded = wspool.PoolRegistry.from_config(path, pools={"flashinfer_mla": {"rules": {"lse": "5MiB"}}})
        assert coded.resolve("flashinfer_mla", "lse", device="cpu") == 5 * MiB


def test_engine_knobs_sit_above_profiles_and_leave_their_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's variable sets its engine's rule under every profile; the profile's own rules stay."""
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", str(64 * MiB))
    with fake_device("cpu", H200):
        reg = wspool.PoolRegistry()
        assert reg.resolve("flashinfer_mla", "sglang_mla", device="cpu") == 64 * MiB
        assert reg.resolve("flashinfer_mla", "lse", device="cpu") == HOPPER_MLA_BYTES


def test_devices_of_different_kinds_each_get_their_own_profile() -> None:
    """An H200 and a B200 in one registry get hopper and blackwell, with separate buffers and rules."""
    kinds = {"cpu": H200, "meta": B200}
    reg = wspool.PoolRegistry(describe_device=lambda device: kinds.get(device.type), allocator=meta_allocator)
    assert reg.profile_of("cpu").profile == "hopper"
    assert reg.profile_of("meta").profile == "blackwell"
    assert reg.workspace("flashinfer_mla", "cpu", rule="lse").numel() == HOPPER_MLA_BYTES
    blackwell = reg.workspace("flashinfer_mla", "meta", rule="lse")
    assert blackwell.numel() == softmax_slab_bytes(128, 512, 1) + 64 * MiB
    assert {s.device: s.capacity_bytes for s in reg.all_stats()} == {"cpu": HOPPER_MLA_BYTES, "meta": blackwell.numel()}
    reg.declare_pool("extra", {"default": "sm_count * 1KiB"})
    assert reg.resolve("extra", device="cpu") == 132 * 1024
    assert reg.resolve("extra", device="meta") == 148 * 1024


@pytest.mark.parametrize("where", ["env", "yaml", "code"])
def test_unknown_profile_is_a_config_error(where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown profile name is a ConfigError naming profile / WSPOOL_PROFILE; no registry, nothing allocated."""
    path = None
    overrides: dict[str, object] = {}
    if where == "env":
        monkeypatch.setenv("WSPOOL_PROFILE", "volta")
    elif where == "yaml":
        path = tmp_path / "c.yaml"
        path.write_text("profile: volta\n")
    else:
        overrides["profile"] = "volta"
    with pytest.raises(ConfigError, match=r"profile = 'volta' .*unknown profile 'volta'.*set profile / WSPOOL_PROFILE"):
        wspool.PoolRegistry.from_config(path, **overrides)


def test_profile_names_are_case_insensitive(monkeypatch: pytest.MonkeyPatch) -> None:
    """WSPOOL_PROFILE=Hopper names the hopper profile."""
    monkeypatch.setenv("WSPOOL_PROFILE", "Hopper")
    assert wspool.load_settings().profile == "hopper"


def test_the_fixed_profile_says_it_holds_vllms_fixed_sizes() -> None:
    """The fixed profile and auto's reasons name vLLM's fixed sizes."""
    assert load_profile("fixed").description.startswith("vLLM's fixed sizes on any device: 128MiB for MLA decode")
    assert choose_profile("auto", None).reason == "auto: no GPU description (not a CUDA device); vLLM's fixed sizes"
    assert choose_profile("auto", A100).reason.endswith("; vLLM's fixed sizes")


def test_the_old_name_of_vllms_fixed_sizes_still_works_with_a_warning() -> None:
    """SEED_MLA_WORKSPACE_BYTES is a deprecated alias of VLLM_FIXED_MLA_WORKSPACE_BYTES."""
    import wspool.settings.schema as schema

    assert dict(schema.VLLM_FIXED_MLA_WORKSPACE_BYTES) == {"default": 128 * MiB, "lse": 256 * MiB}
    with pytest.warns(DeprecationWarning, match="SEED_MLA_WORKSPACE_BYTES is deprecated; use VLLM_FIXED_MLA"):
        assert schema.SEED_MLA_WORKSPACE_BYTES is schema.VLLM_FIXED_MLA_WORKSPACE_BYTES


#: The kernel each shipped configuration sizes MLA decode for; ``None``: it leaves flashinfer_mla's
#: rules to the profile (or vLLM's fixed sizes for every kernel).
SHIPPED_KERNEL = {
    "blackwell": "trtllm-gen",
    "default": None,
    "hopper": "fa3",
    "kimi_dcp": "trtllm-gen",
    "sglang": None,
    "tokenspeed": None,
    "vllm": None,
}
#: Headroom each trtllm-gen configuration keeps for the unchecked scratch behind the softmax slab.
TRTLLM_HEADROOM = {"blackwell": 64 * MiB, "kimi_dcp": 32 * MiB, "profile blackwell": 64 * MiB}
#: One decode step with decode-context parallelism: 32 heads per rank, a DCP group of 4, 256 requests.
DCP_FACTS = {"num_heads": 32, "cp_world": 4, "batch_size": 256, "q_len": 1, "kv_lora_rank": 512}


def _lse_bytes(config: str | None, device: DeviceDescription) -> int:
    settings = wspool.load_settings(config)
    registry = wspool.PoolRegistry(settings, describe_device=lambda _: device, allocator=meta_allocator)
    return registry.resolve("flashinfer_mla", "lse", device="cpu", **DCP_FACTS)


def test_every_shipped_configuration_and_profile_read_num_heads_as_heads_per_rank() -> None:
    """At 32 heads per rank, DCP 4 and batch 256, each trtllm-gen rule is the launcher's slab for 128 heads plus
    its headroom, each fa3 rule the planner's SM-count formula: one meaning of num_heads and cp_world throughout."""
    from wspool.flashinfer.layouts import fa_mla_float_workspace_bytes
    from wspool.settings.profiles import shipped_config_names

    assert sorted(SHIPPED_KERNEL) == shipped_config_names()
    heads_seen = DCP_FACTS["num_heads"] * DCP_FACTS["cp_world"]
    slab = softmax_slab_bytes(heads_seen, DCP_FACTS["batch_size"], DCP_FACTS["q_len"])
    fa3 = fa_mla_float_workspace_bytes(sm_count=H200.sm_count, num_heads=heads_seen, q_len=1, kv_lora_rank=512)
    # The profiles themselves, with no file: auto picks blackwell on a B200 and hopper on an H200.
    assert _lse_bytes(None, B200) == slab + TRTLLM_HEADROOM["profile blackwell"]
    assert _lse_bytes(None, H200) == fa3
    for name, kernel in SHIPPED_KERNEL.items():
        if kernel == "trtllm-gen":
            assert _lse_bytes(name, B200) == slab + TRTLLM_HEADROOM[name], name
        elif kernel == "fa3":
            assert _lse_bytes(name, H200) == fa3, name
        else:  # the profile's rule on each device, or vLLM's fixed 256 MiB where the file fixes it
            assert _lse_bytes(name, B200) in (slab + TRTLLM_HEADROOM["profile blackwell"], 256 * MiB), name
    # The figure: the blackwell configuration and profile agree (129 MiB + 64 MiB here).
    assert _lse_bytes("blackwell", B200) == _lse_bytes(None, B200)


def test_a_local_file_named_as_a_shipped_configuration_is_read_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A file hopper in the working directory wins over the shipped hopper, and a warning says which was read."""
    (tmp_path / "hopper").write_text("pools:\n  flashinfer_mla:\n    rules:\n      lse: 1MiB\n")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING", logger="wspool"):
        settings = wspool.load_settings("hopper")
    assert settings.pools["flashinfer_mla"].rules["lse"] == "1MiB"
    assert [r.getMessage() for r in caplog.records] == [
        f"configuration 'hopper' is the file {tmp_path.resolve() / 'hopper'} in the working directory, not the "
        "shipped configuration hopper"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="wspool"):
        wspool.load_settings("./hopper")
    assert caplog.records == []
