"""Tests for the default facts of wspool.settings.schema (pools.<pool>.facts): values, names, precedence, provenance."""

from __future__ import annotations

from pathlib import Path

import pytest

import wspool
from wspool.errors import ConfigError
from wspool.settings.schema import BUILTIN_DEFAULTS, RESERVED_FACT_NAMES, load_settings, load_settings_with_provenance

KEY = "pools.flashinfer_mla.facts.kv_lora_rank"
ENV = "WSPOOL_POOLS__FLASHINFER_MLA__FACTS__KV_LORA_RANK"


def test_flashinfer_mla_ships_deepseek_geometry() -> None:
    """The built-in defaults carry DeepSeek/Kimi's MLA geometry as facts of flashinfer_mla."""
    facts = load_settings().pools["flashinfer_mla"].facts
    assert facts == BUILTIN_DEFAULTS["pools"]["flashinfer_mla"]["facts"]
    assert facts["kv_lora_rank"] == 512 and facts["qk_rope_head_dim"] == 64


def test_code_over_environment_over_yaml_over_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Facts follow the rules' precedence, name by name, and provenance says where each came from."""
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  flashinfer_mla:\n    facts:\n      kv_lora_rank: 256\n      num_heads: 16\n")
    settings, prov = load_settings_with_provenance(path)
    facts = settings.pools["flashinfer_mla"].facts
    assert facts["kv_lora_rank"] == 256 and facts["num_heads"] == 16 and facts["qk_rope_head_dim"] == 64
    assert prov.source_of(("pools", "flashinfer_mla", "facts", "kv_lora_rank")) == f"YAML file {path}"
    assert prov.source_of(("pools", "flashinfer_mla", "facts", "qk_rope_head_dim")) == "built-in default"
    monkeypatch.setenv(ENV, "128")
    settings, prov = load_settings_with_provenance(path)
    assert settings.pools["flashinfer_mla"].facts["kv_lora_rank"] == 128
    assert settings.pools["flashinfer_mla"].facts["num_heads"] == 16
    assert prov.source_of(("pools", "flashinfer_mla", "facts", "kv_lora_rank")) == f"environment variable {ENV}"
    settings, prov = load_settings_with_provenance(path, pools={"flashinfer_mla": {"facts": {"kv_lora_rank": 64}}})
    assert settings.pools["flashinfer_mla"].facts["kv_lora_rank"] == 64
    assert prov.source_of(("pools", "flashinfer_mla", "facts", "kv_lora_rank")) == "code"


def test_default_facts_size_calls_that_pass_none() -> None:
    """A rule reads its pool's default facts where the call lacks them; the call's own facts win."""
    reg = wspool.PoolRegistry.from_config(pools={"p": {"rules": {"default": "heads * 1KiB"}, "facts": {"heads": 4}}})
    assert reg.resolve("p", device="cpu") == 4096
    assert reg.resolve("p", device="cpu", heads=2) == 2048
    assert reg.workspace("p", "cpu").numel() == 4096
    assert reg.workspace("p", "cpu", heads=8).numel() == 8192


def test_a_partial_call_merges_with_the_defaults() -> None:
    """A call that passes some facts takes the rest from the defaults."""
    reg = wspool.PoolRegistry.from_config(pools={"p": {"rules": {"default": "a * b"}, "facts": {"a": 3, "b": 1024}}})
    assert reg.workspace("p", "cpu", b=2048).numel() == 3 * 2048
    assert reg.default_facts("p", "cpu") == {"a": 3, "b": 1024}


def test_shared_pools_read_their_own_facts() -> None:
    """A pool drawing from another's buffer sizes its rules with its own default facts."""
    reg = wspool.PoolRegistry.from_config(
        pools={
            "host": {"rules": {"h": "x * 1KiB"}, "facts": {"x": 2}},
            "guest": {"shared_with": "host", "rules": {"g": "x * 1KiB"}, "facts": {"x": 5}},
        }
    )
    assert reg.workspace("guest", "cpu", rule="g").numel() == 5 * 1024
    assert reg.workspace("host", "cpu", rule="h").numel() == 5 * 1024  # the one buffer, grown by the guest
    assert reg.resolve("host", "h", device="cpu") == 2 * 1024


@pytest.mark.parametrize(
    ("value", "shown"), [("-1", "'-1'"), ("1.5", "'1.5'"), ("lots", "'lots'"), ("", "''"), ("true", "'true'")]
)
def test_a_fact_that_is_not_a_non_negative_integer_is_a_config_error(
    value: str, shown: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fact from the environment must be a non-negative integer; the error names the key and the variable."""
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ConfigError, match=rf"{KEY} = {shown} .*non-negative integer.*set {KEY} / {ENV}"):
        wspool.PoolRegistry()


@pytest.mark.parametrize("value", [-1, 2.0, True, None, [1], "x"])
def test_a_bad_yaml_or_code_fact_is_a_config_error(value: object) -> None:
    """A negative, fractional, boolean or non-number fact given in code is refused, naming key and variable."""
    with pytest.raises(ConfigError, match=rf"{KEY} .*non-negative integer.*{ENV}"):
        load_settings(pools={"flashinfer_mla": {"facts": {"kv_lora_rank": value}}})


RESERVED = ["pool", "rule", "lane", "device", "self", "class", "lambda", "None", "max", "round_up"]


@pytest.mark.parametrize("name", RESERVED)
def test_a_fact_named_like_a_reserved_word_is_a_config_error(name: str) -> None:
    """Fact names that would collide with a per-call parameter, a keyword or a rule function are refused."""
    assert name in RESERVED_FACT_NAMES
    key, env = f"pools.p.facts.{name}", f"WSPOOL_POOLS__P__FACTS__{name.upper()}"
    with pytest.raises(ConfigError, match=rf"fact name '{name}' is reserved.*set {key} / {env}"):
        wspool.PoolRegistry.from_config(pools={"p": {"rules": {"default": "1MiB"}, "facts": {name: 1}}})


def test_a_reserved_fact_name_from_the_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """WSPOOL_POOLS__FLASHINFER_MLA__FACTS__LANE is refused, naming that variable."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_MLA__FACTS__LANE", "1")
    with pytest.raises(ConfigError, match=r"WSPOOL_POOLS__FLASHINFER_MLA__FACTS__LANE"):
        load_settings()


@pytest.mark.parametrize("name", ["_hidden", "2x", "a-b"])
def test_a_fact_name_no_rule_can_read_is_a_config_error(name: str) -> None:
    """A fact name that is not an identifier (or starts with _) is refused."""
    with pytest.raises(ConfigError, match=r"is not a name a rule can read"):
        load_settings(pools={"p": {"rules": {"default": "1MiB"}, "facts": {name: 1}}})


def test_nbytes_is_reserved_like_the_other_parameters() -> None:
    """nbytes, reserve()'s parameter, cannot name a default fact either: one reserved list for settings and CLI."""
    with pytest.raises(ConfigError, match=r"fact name 'nbytes' is reserved.*set pools\.p\.facts\.nbytes"):
        load_settings(pools={"p": {"rules": {"default": "1MiB"}, "facts": {"nbytes": 1}}})
