"""Tests for the known facts: a rule of wspool's own pools may read only the facts their callers pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.paged_inputs import make_paged_inputs
from wspool.errors import ConfigError
from wspool.flashinfer import COUNTER_POOL, MLA_POOL, PAGED_POOL
from wspool.flashinfer.backends import call_facts
from wspool.flashinfer.mla import COUNTER_RULE
from wspool.flashinfer.paged import paged_decode_plan
from wspool.flashinfer.wrapper_buffers import INT_POOL
from wspool.integrations import sglang
from wspool.integrations.sglang import facts as sglang_facts
from wspool.integrations.tokenspeed import buffers as tokenspeed_buffers
from wspool.integrations.vllm import getters as vllm_workspaces
from wspool.integrations.vllm.facts import FACT_NAMES
from wspool.rules import compile_rule
from wspool.settings.profiles import PROFILE_NAMES, engine_spec, shipped_config_names
from wspool.settings.schema import (
    BUILTIN_DEFAULTS,
    DEVICE_FACTS,
    OWN_POOLS,
    SHAPE_FACTS,
    load_settings,
    profile_settings,
    unknown_rule_facts,
)

LSE_ENV = "WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE"
#: The facts wspool's own ops pass (MLA decode, paged attention, the counters, the MLA pool's defaults).
CORE_FACTS = frozenset(
    {"batch_size", "q_len", "num_heads", "max_seq_len", "page_size", "dtype_bytes", "cp_world", "kv_lora_rank",
     "qk_rope_head_dim", "qk_nope_head_dim", "num_tokens", "num_qo_heads", "num_kv_heads", "head_dim"}
)  # fmt: skip


def test_the_shape_facts_are_what_wspools_ops_pass() -> None:
    """SHAPE_FACTS holds every fact MLA decode, paged attention, the counters and the engine integrations pass."""
    mla = call_facts(
        batch_size=1, q_len=1, num_heads=16, max_seq_len=64, page_size=64, dtype_bytes=2, sm_count=1, cp_world=1
    )
    inputs = make_paged_inputs([5, 9])
    paged = paged_decode_plan(
        inputs.block_tables, inputs.seq_lens, num_qo_heads=inputs.num_qo_heads, num_kv_heads=inputs.num_kv_heads,
        head_dim=inputs.head_dim, page_size=inputs.page_size,
    ).facts  # fmt: skip
    defaults = BUILTIN_DEFAULTS["pools"]["flashinfer_mla"]["facts"]
    counters = compile_rule(COUNTER_RULE).names
    tokenspeed = tokenspeed_buffers.FACT_NAMES
    passed = {*mla, *paged, *FACT_NAMES, *sglang_facts.FACT_NAMES, *tokenspeed, *defaults, *counters, "min_bytes"}
    assert passed - set(DEVICE_FACTS) <= SHAPE_FACTS
    assert passed >= SHAPE_FACTS  # no name that nothing passes


def test_the_own_pools_are_the_pools_of_wspools_ops() -> None:
    """OWN_POOLS is exactly the pools the FlashInfer ops and the engine integrations use."""
    plugin = {getattr(vllm_workspaces, n) for n in dir(vllm_workspaces) if n.startswith("POOL_")}
    sglang_pools = {w.pool for w in (*sglang.BUFFERS.values(), sglang.CUTE_DSL_WORKSPACE)}
    tokenspeed_pools = {w.pool for w in tokenspeed_buffers.WORKSPACES}
    assert {MLA_POOL, COUNTER_POOL, PAGED_POOL, INT_POOL} | plugin | sglang_pools | tokenspeed_pools == OWN_POOLS
    # Each engine's spec names the pools its package serves (OWN_POOLS reads them there).
    assert plugin | {INT_POOL} == engine_spec("vllm").pools
    assert sglang_pools | {INT_POOL} == engine_spec("sglang").pools
    assert tokenspeed_pools == engine_spec("tokenspeed").pools


def test_each_engines_spec_lists_the_facts_its_package_passes() -> None:
    """The facts beyond wspool's own ops' that an engine's extractors pass are in its spec (SHAPE_FACTS reads them)."""
    assert {*sglang_facts.FACT_NAMES, "sglang_bytes"} - CORE_FACTS == engine_spec("sglang").facts
    assert set(tokenspeed_buffers.FACT_NAMES) - CORE_FACTS == engine_spec("tokenspeed").facts
    assert {*FACT_NAMES, "min_bytes"} - CORE_FACTS == engine_spec("vllm").facts


@pytest.mark.parametrize("pool", sorted(OWN_POOLS))
def test_a_rule_of_an_own_pool_reading_an_unknown_name_is_refused_at_load(
    pool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WSPOOL_POOLS__<OWN POOL>__RULES__X=lots fails when the configuration loads, naming the setting, not at a call."""
    env = f"WSPOOL_POOLS__{pool.upper()}__RULES__X"
    monkeypatch.setenv(env, "lots")
    with pytest.raises(
        ConfigError,
        match=rf"^invalid wspool configuration: pools\.{pool}\.rules\.x = 'lots' \(from environment variable {env}\) "
        rf"reads lots, which is neither a size nor a fact that pool '{pool}' is given \(wspool's ops pass "
        r"batch_size, .*; the device gives sm_count, cc_major, cc_minor, device_memory; .*\); "
        rf"set pools\.{pool}\.rules\.x / {env} \(a size takes a unit, e\.g\. 256MiB\), or, if a call passes lots, "
        rf"give it a default in pools\.{pool}\.facts\.lots / WSPOOL_POOLS__{pool.upper()}__FACTS__LOTS$",
    ) as info:
        load_settings()
    assert info.value.key == f"pools.{pool}.rules.x"


def test_a_bad_rule_from_yaml_or_code_names_its_source(tmp_path: Path) -> None:
    """The refusal says where the rule came from, and every name that is unknown."""
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  flashinfer:\n    rules:\n      decode: heads * sm_count * tokens\n")
    with pytest.raises(ConfigError, match=rf"decode = 'heads \* sm_count \* tokens' \(from YAML file {path}\) reads "
                       r"heads, tokens, which"):  # fmt: skip
        load_settings(path)
    with pytest.raises(ConfigError, match=r"pools\.flashinfer_mla\.rules\.lse = 'lse_bytes' \(from code\) reads"):
        load_settings(pools={"flashinfer_mla": {"rules": {"lse": "lse_bytes"}}})


def test_a_default_fact_makes_a_name_known(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule may read a name the pool declares under facts:, and the device facts."""
    monkeypatch.setenv(LSE_ENV, "lots * sm_count")
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_MLA__FACTS__LOTS", "3")
    assert load_settings().pools["flashinfer_mla"].rules["lse"] == "lots * sm_count"


def test_a_pool_of_another_backend_may_read_its_own_facts() -> None:
    """A pool wspool does not own loads with any fact name: its backend passes them (show flags them)."""
    settings = load_settings(pools={"p": {"rules": {"default": "x * 1KiB", "lse": "num_heads * 2"}}})
    assert unknown_rule_facts(settings) == [(("pools", "p", "rules", "default"), "x * 1KiB", ["x"])]


@pytest.mark.parametrize("name", shipped_config_names())
def test_every_shipped_configuration_loads_under_every_profile(name: str) -> None:
    """The shipped configurations and profiles read only known facts."""
    settings = load_settings(name)
    for profile in PROFILE_NAMES:
        layered, _ = profile_settings(settings, profile)
        assert unknown_rule_facts(layered) == []
