"""Tests for wspool.settings.sources: engines' own workspace variables, below YAML and WSPOOL_*, above defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from wspool.cli import main
from wspool.errors import ConfigError
from wspool.settings.schema import load_settings, load_settings_with_provenance

VLLM = "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE"
SGLANG = "SGLANG_FLASHINFER_WORKSPACE_SIZE"
MiB = 1 << 20


def _rules(pool: str) -> dict[str, str]:
    return dict(load_settings().pools[pool].rules)


def test_vllm_knob_sizes_paged_attention_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's variable sets the paged rules and vLLM's sparse MLA size; MLA and batch-invariant keep theirs."""
    monkeypatch.setenv(VLLM, str(394 * MiB))
    assert _rules("flashinfer") == {"decode": str(394 * MiB), "prefill": str(394 * MiB), "vllm": str(394 * MiB)}
    assert _rules("flashinfer_mla_sparse") == {"default": str(394 * MiB)}
    assert _rules("flashinfer_mla") == {"default": "128MiB", "lse": "256MiB"}
    _, provenance = load_settings_with_provenance()
    assert provenance.source_of(("pools", "flashinfer", "rules", "decode")) == f"environment variable {VLLM}"
    assert provenance.source_of(("pools", "flashinfer_mla", "rules", "lse")) == "default"


def test_sglang_knob_sizes_every_flashinfer_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's variable sets the paged and MLA rules; where both engines' variables are set, vLLM's wins."""
    monkeypatch.setenv(SGLANG, str(384 * MiB))
    assert set(_rules("flashinfer_mla").values()) == set(_rules("flashinfer").values()) == {str(384 * MiB)}
    monkeypatch.setenv(VLLM, str(64 * MiB))
    assert {k: v for k, v in _rules("flashinfer").items() if k in ("decode", "prefill")} == {
        "decode": str(64 * MiB),
        "prefill": str(64 * MiB),
    }
    assert _rules("flashinfer_mla")["lse"] == str(384 * MiB)


def test_sglang_knob_sizes_the_sglang_integrations_variable_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's variable sets the integration's rules for the workspaces SGLang sizes with it alone."""
    monkeypatch.setenv(SGLANG, str(256 * MiB))
    settings, provenance = load_settings_with_provenance()
    keys = (("flashinfer", "sglang"), ("flashinfer_mla", "sglang_mla"), ("sglang_dsa_sparse_mla", "default"))
    for pool, rule in keys:
        assert settings.pools[pool].rules[rule] == str(256 * MiB)
        assert provenance.source_of(("pools", pool, "rules", rule)) == f"environment variable {SGLANG}"
    monkeypatch.setenv(VLLM, str(64 * MiB))
    assert _rules("flashinfer")["sglang"] == str(256 * MiB)  # vLLM's variable does not set SGLang's rules


def test_knob_is_below_yaml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A value in the YAML file beats the engine's variable, and its source says so; the variable sets the rest."""
    monkeypatch.setenv(VLLM, str(394 * MiB))
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  flashinfer:\n    rules:\n      decode: 64MiB\n")
    settings, provenance = load_settings_with_provenance(path)
    rules = dict(settings.pools["flashinfer"].rules)
    assert (rules["decode"], rules["prefill"], rules["vllm"]) == ("64MiB", str(394 * MiB), str(394 * MiB))
    source = provenance.source_of(("pools", "flashinfer", "rules", "decode"))
    assert source == f"YAML file {path}; overrides environment variable {VLLM}"
    assert provenance.source_of(("pools", "flashinfer", "rules", "vllm")) == f"environment variable {VLLM}"


def test_tokenspeed_knobs_count_mib_or_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """TokenSpeed's _MB variables count MiB and FLASHINFER_WORKSPACE_SIZE bytes; each sets one integration rule."""
    monkeypatch.setenv("TOKENSPEED_WORKSPACE_TRTLLM_MHA_MB", "96")
    monkeypatch.setenv("TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB", "128")
    monkeypatch.setenv("FLASHINFER_WORKSPACE_SIZE", str(200 * MiB))
    settings, provenance = load_settings_with_provenance()
    assert settings.pools["tokenspeed_scratch"].rules["trtllm_mha"] == str(96 * MiB)
    assert settings.pools["tokenspeed_trtllm_mla"].rules["default"] == str(128 * MiB)
    assert settings.pools["flashinfer"].rules["tokenspeed_flashmla"] == str(200 * MiB)
    assert settings.pools["flashinfer"].rules["decode"] != str(200 * MiB)  # TokenSpeed's variable sizes FlashMLA only
    source = provenance.source_of(("pools", "tokenspeed_trtllm_mla", "rules", "default"))
    assert source == "environment variable TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB"


def test_a_tokenspeed_mib_variable_that_is_not_a_whole_number_names_its_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    """TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB=1.5 is refused, naming MiB and the rule it sizes."""
    monkeypatch.setenv("TOKENSPEED_WORKSPACE_TRTLLM_MLA_MB", "1.5")
    with pytest.raises(ConfigError, match=r"whole number of MiB, and wspool sizes pools\.tokenspeed_trtllm_mla"):
        load_settings()


def test_knob_is_below_wspool_env_and_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """WSPOOL_* variables and values in code beat the engine's variable."""
    monkeypatch.setenv(SGLANG, str(384 * MiB))
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE", "512MiB")
    assert _rules("flashinfer_mla") == {"default": str(384 * MiB), "lse": "512MiB", "sglang_mla": str(384 * MiB)}
    settings = load_settings(pools={"flashinfer_mla": {"rules": {"lse": "1GiB"}}})
    assert settings.pools["flashinfer_mla"].rules["lse"] == "1GiB"


def test_knob_is_above_defaults_and_empty_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset or empty, the built-in defaults apply; set, the knob replaces them."""
    monkeypatch.setenv(VLLM, "")
    assert _rules("flashinfer")["decode"].startswith("(512 * sm_count")
    monkeypatch.setenv(VLLM, "1048576")
    assert _rules("flashinfer")["decode"] == "1048576"


@pytest.mark.parametrize("value", ["394MiB", "-1", "0", "1e9", "lots"])
def test_bad_knob_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """A knob that is not a positive whole number of bytes is a ConfigError naming it and the keys it sets."""
    monkeypatch.setenv(VLLM, value)
    with pytest.raises(ConfigError, match=rf"invalid environment variable {VLLM} = '{value}': vLLM reads it as a "
                       r"positive whole number of bytes.*pools\.flashinfer\.rules\.decode"):  # fmt: skip
        load_settings()


def test_show_names_the_knob(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """wspool show gives the engine's variable as the source of the values it set."""
    monkeypatch.setenv(VLLM, str(394 * MiB))
    assert main(["show"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("pools.flashinfer.rules.prefill "))
    assert " ".join(line.split()).endswith(f"{394 * MiB} environment variable {VLLM}")
