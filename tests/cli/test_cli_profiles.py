"""Tests for the profile and fact output of ``wspool show`` and ``wspool resolve``."""

from __future__ import annotations

import json

import pytest

from tests.helpers.devices_fake import B200, H200, HOPPER_MLA_BYTES
from wspool.cli import main
from wspool.devices import fake_device

ENV = "WSPOOL_POOLS__FLASHINFER_MLA__FACTS__KV_LORA_RANK"


def test_show_names_each_devices_profile_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    """show says which profile the device got and why, with its device facts."""
    with fake_device("cpu", H200):
        assert main(["show"]) == 0
    out = capsys.readouterr().out
    assert all(len(line) <= 100 for line in out.splitlines())
    text = " ".join(out.split())  # wrapped lines joined
    assert "profile: auto (from built-in default)" in text
    assert "device cpu: profile hopper (auto: compute capability 9.0 (NVIDIA H200) is hopper's); " in text
    assert "device facts: sm_count=132, cc_major=9, cc_minor=0" in text
    assert "profile hopper: Hopper (SM90)" in text
    assert "pools.flashinfer_mla.rules.lse = 64 * sm_count * (4 * kv_lora_rank + 8) (from profile hopper)" in text


@pytest.mark.parametrize("config", [None, "blackwell", "kimi_dcp", "vllm", "sglang"])
@pytest.mark.parametrize("device", [H200, B200], ids=["hopper", "blackwell"])
def test_show_fits_100_columns_under_every_profile(
    capsys: pytest.CaptureFixture[str], config: str | None, device: object
) -> None:
    """Under the hopper and blackwell profiles, with the shipped files, every line show prints fits 100 columns."""
    with fake_device("cpu", device):  # type: ignore[arg-type]
        assert main(["show", *(["--config", config] if config else [])]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_show_lists_each_fact_with_its_source(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every default fact is a row with its value and where it came from."""
    monkeypatch.setenv(ENV, "256")
    assert main(["show", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {row["key"]: row for row in data["settings"]}
    assert rows["pools.flashinfer_mla.facts.kv_lora_rank"] == {
        "key": "pools.flashinfer_mla.facts.kv_lora_rank",
        "value": 256,
        "source": f"environment variable {ENV}",
        "overrides": [],
    }
    assert rows["pools.flashinfer_mla.facts.qk_rope_head_dim"]["source"] == "built-in default"
    assert data["profile"] == {"value": "auto", "source": "built-in default"}
    assert data["devices"] == [
        {"device": "cpu", "profile": "fixed", "reason": data["devices"][0]["reason"], "facts": {}}
    ]


def test_show_says_where_an_explicit_profile_came_from(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """WSPOOL_PROFILE=hopper is shown with its source, on every device."""
    monkeypatch.setenv("WSPOOL_PROFILE", "hopper")
    assert main(["show"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "profile: hopper (from environment variable WSPOOL_PROFILE)" in out
    assert "device cpu: profile hopper (profile = hopper (from environment variable WSPOOL_PROFILE))" in out


def test_resolve_uses_the_devices_profile_and_facts(capsys: pytest.CaptureFixture[str]) -> None:
    """resolve on a faked H200 needs no facts for the hopper profile's rule."""
    with fake_device("cpu", H200):
        assert main(["resolve", "flashinfer_mla", "lse", "--device", "cpu", "--bytes"]) == 0
    assert capsys.readouterr().out.strip() == str(HOPPER_MLA_BYTES)


def test_show_with_an_unknown_profile_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unknown WSPOOL_PROFILE is one error line naming the key and the variable, exit 2."""
    monkeypatch.setenv("WSPOOL_PROFILE", "volta")
    assert main(["show"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "set profile / WSPOOL_PROFILE" in err[0]
