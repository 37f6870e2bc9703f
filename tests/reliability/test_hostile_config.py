"""Reliability under hostile configuration: bad YAML files and environments, and fuzzed ones, only raise ConfigError.

Hand-written inputs pin each error's text; property tests feed random YAML
documents, YAML text and WSPOOL_* values, which must either load into a
configuration that resolves or raise ConfigError. The larger corpus is
tests/reliability/test_corpus.py's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wspool
from wspool.errors import ConfigError
from wspool.settings.schema import MAX_CONFIG_FILE_BYTES, load_settings

_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefg", "bcdefgh", strict=True)
)

BAD_YAML = [
    ("pools: [unclosed\n", r"invalid YAML in config file .*c\.yaml:2:1"),
    ("pools: !!python/object/apply:os.system ['true']\n", r"invalid YAML .*could not determine a constructor"),
    ("\x00", r"invalid YAML .*special characters are not allowed"),
    ("[" * 5000 + "]" * 5000, r"invalid YAML in config file .*: it nests too deeply"),
    ("a: " + "{a: " * 40 + "1" + "}" * 40 + "\n", r"nests deeper than 32 levels"),
    (_BOMB, r"holds more than 10000 values once its YAML aliases are expanded"),
    ("# padding\n" * (MAX_CONFIG_FILE_BYTES // 10 + 1), r"is larger than 64KiB"),
    ("- 1\n- 2\n", r"must hold a mapping at the top level, got list"),
    ("? [a]\n: 1\n", r"found unhashable key"),
    ("0: 1\n", r"top-level key 0 is not a string \(the keys are pools, debug_streams, profile\)"),
    ("pools: {p: {0: 1}}\n", r"pools\.p\.0 = 0 .*Keys should be strings"),
    ("pools: !!binary aGVsbG8=\n", r"pools = b'hello' .*valid dictionary"),
    ("pools:\n  1: {rules: {default: 1MiB}}\n", r"pools\.1 = 1 \(from YAML file .*\): a key must be a string, not int"),
    ("pools: {p: {rules: {r: 0}}}\n", r"pools\.p\.rules\.r = 0 .*must be a positive size"),
    ("pools: {p: {rules: {r: '1MiB - 2MiB'}}}\n", r"pools\.p\.rules\.r .*is not positive"),
    ("pools: {p: {rules: {r: -1}}}\n", r"pools\.p\.rules\.r = -1 .*negative"),
    ("pools: {p: {rules: {r: 2001-01-01}}}\n", r"pools\.p\.rules\.r = datetime\.date\(2001, 1, 1\) .*got date"),
    ("pools: {p: {rules: {r: .nan}}}\n", r"pools\.p\.rules\.r = nan .*got float"),
    ("pools: {p: {rules: {r: 99999999999999999999999}}}\n", r"exceeds the limit of 1024TiB"),
    ("pools: {p: {rules: {r: \"__import__('os')\"}}}\n", r"pools\.p\.rules\.r = .*calling '__import__' is not allowed"),
    ("pools: {p: {rules: {r: '" + "x + " * 300 + "x'}}}\n", r"longer than 1000 characters"),
    ("pools: {p: {rules: {r: '" + "-(" * 40 + "x" + ")" * 40 + "'}}}\n", r"deeper than 32 levels"),
    ("pools: {p: {max_bytes: 0}}\n", r"pools\.p\.max_bytes = 0 .*must be positive"),
    ("pools: {p: {rules: {lse: 256MiB}, max_bytes: 128MiB}}\n",
     r"pools\.p\.rules\.lse = '256MiB' \(256MiB, from YAML file .*\) is above pools\.p\.max_bytes = 128MiB \(from "
     r"YAML file .*\), so it could never be served; lower pools\.p\.rules\.lse / WSPOOL_POOLS__P__RULES__LSE or "
     r"raise pools\.p\.max_bytes / WSPOOL_POOLS__P__MAX_BYTES"),
    ("pools: {p: {description: [1, 2]}}\n", r"pools\.p\.description = \[1, 2\] .*valid string"),
    ("pools: {p: {description: " + "[" * 8 + "]" * 8 + "}}\n", r"pools\.p\.description = \[\[\[\[\.\.\.\]\]\]\]"),
    ("pools: {p: {growth: sometimes}}\n", r"pools\.p\.growth = 'sometimes'"),
    ("debug_streams: maybe\n", r"debug_streams = 'maybe'"),
]  # fmt: skip

BAD_ENV = [
    ({"WSPOOL_POOLS": "{not json"}, r"invalid environment variable WSPOOL_POOLS = '\{not json': is not valid JSON"),
    ({"WSPOOL_POOLS": "[" * 100_000}, r"invalid environment variable WSPOOL_POOLS = '\[\[\[.*: nests too deeply"),
    ({"WSPOOL_POOLS__P__RULES": "garbage"},
     r"invalid environment variable WSPOOL_POOLS__P__RULES = 'garbage': is not valid JSON .*pools\.p\.rules takes a "
     r"mapping"),
    ({"WSPOOL_POOLS__P": "garbage"}, r"pools\.p = 'garbage' \(from environment variable WSPOOL_POOLS__P\)"),
    ({"WSPOOL_POOLS__P__RULES": "[1, 2]"},
     r"pools\.p\.rules = \[1, 2\] \(from environment variable WSPOOL_POOLS__P__RULES\)"),
    ({"WSPOOL_DEBUG_STREAMS": "maybe"}, r"debug_streams = 'maybe' \(from environment variable WSPOOL_DEBUG_STREAMS\)"),
    ({"WSPOOL_POOLS__P__MAX_BYTES": "lots"}, r"pools\.p\.max_bytes = 'lots' \(from environment variable"),
    ({"WSPOOL_POOLS__P__GROWTH": "0"}, r"pools\.p\.growth = '0' .*positive"),
    ({"WSPOOL_POOLS__P__RULES__DEFAULT": "__import__('os').system('true')"},
     r"WSPOOL_POOLS__P__RULES__DEFAULT\).*calling"),
    ({"WSPOOL_POOLS__P__RULES__DEFAULT": "x" * 2000}, r"longer than 1000 characters"),
    ({"WSPOOL_POOLS__P__RULES__DEFAULT": "10 ** 10 ** 10"}, r"'\*\*' is not allowed"),
    ({"WSPOOL_POOLS__P__RULES__DEFAULT": "0"}, r"must be a positive size"),
    ({"WSPOOL_POOLS__P__RULES__DEFAULT": "1MiB", "WSPOOL_POOLS__P__MAX_BYTES": "1KiB"},
     r"pools\.p\.rules\.default = '1MiB' \(1MiB, from environment variable WSPOOL_POOLS__P__RULES__DEFAULT\) is above "
     r"pools\.p\.max_bytes = 1KiB \(from environment variable WSPOOL_POOLS__P__MAX_BYTES\)"),
    ({"WSPOOL_POOLS": '{"p": {"rules": {"d": "2GiB"}, "max_bytes": "1GiB"}}'},
     r"pools\.p\.rules\.d = '2GiB'.*is above"),
    ({"WSPOOL_CONFIG": "/nonexistent/wspool.yaml"}, r"named by WSPOOL_CONFIG\) does not exist"),
    ({"WSPOOL_CONFIG": "/"}, r"config file / \(named by WSPOOL_CONFIG\) does not exist or is not a file"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "match"), BAD_YAML, ids=range(len(BAD_YAML)))
def test_each_hostile_yaml_file_is_a_config_error(tmp_path: Path, text: str, match: str) -> None:
    """Malformed, unsafe, deep, huge, aliased or out-of-range YAML is a ConfigError that says what is wrong."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_settings(path)


def test_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    """A file that is not UTF-8 is a ConfigError naming the file."""
    path = tmp_path / "c.yaml"
    path.write_bytes(b"pools: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"cannot read config file .*c\.yaml \(given explicitly\)"):
        load_settings(path)


@pytest.mark.parametrize(("env", "match"), BAD_ENV, ids=range(len(BAD_ENV)))
def test_each_hostile_environment_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], match: str
) -> None:
    """A garbage WSPOOL_* value is a ConfigError naming the variable."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=match):
        load_settings()


_KEYS = st.one_of(
    st.sampled_from(
        ["pools", "flashinfer_mla", "p", "rules", "default", "lse", "growth", "max_bytes", "description",
         "debug_streams"]
    ),
    st.text(max_size=6),
    st.integers(-3, 3),
)  # fmt: skip
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=20),
    st.sampled_from(["256MiB", "0", "-1MiB", "1.5GiB", "x * 1KiB", "max(x, 1MiB)", "power_of_two", "exact", "32MiB",
                     "1e3", "nan", "10 ** 10", "__import__('os')", "x // 0", "round_up(x, 0)"]),
)  # fmt: skip
_VALUES = st.recursive(
    _SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4), max_leaves=16
)
_POOL = st.fixed_dictionaries(
    {},
    optional={
        "rules": st.dictionaries(_KEYS, _VALUES, max_size=3) | _VALUES,
        "growth": _VALUES,
        "max_bytes": _VALUES,
        "description": _VALUES,
    },
)
_DOCUMENTS = st.one_of(
    st.fixed_dictionaries({}, optional={"pools": st.dictionaries(_KEYS, _POOL | _VALUES, max_size=3),
                                        "debug_streams": _VALUES}),
    st.dictionaries(_KEYS, _VALUES, max_size=4),
    _VALUES,
)  # fmt: skip


def _loads_or_config_error(load: Callable[[], wspool.WspoolSettings]) -> None:
    """Load; on success, the settings must also build a registry that resolves every fixed rule."""
    try:
        settings = load()
    except ConfigError:
        return
    reg = wspool.PoolRegistry(settings)
    for name, pool in settings.pools.items():
        for rule in pool.rules:
            try:
                nbytes = reg.resolve(name, rule)
            except ConfigError:
                continue  # an expression rule needs the call's facts
            assert 0 < nbytes <= (pool.max_bytes or 2**50)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(document=_DOCUMENTS)
def test_random_yaml_documents_only_raise_config_errors(tmp_path: Path, document: object) -> None:
    """Any YAML document either loads into a usable configuration or raises ConfigError."""
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(document))
    _loads_or_config_error(lambda: load_settings(path))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_random_yaml_text_only_raises_config_errors(tmp_path: Path, text: str) -> None:
    """Any text as a config file either loads or raises ConfigError (never a YAML or Python error)."""
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    _loads_or_config_error(lambda: load_settings(path))


_ENV_NAMES = st.sampled_from(
    ["WSPOOL_POOLS", "WSPOOL_POOLS__P", "WSPOOL_POOLS__P__RULES", "WSPOOL_POOLS__P__RULES__DEFAULT",
     "WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE", "WSPOOL_POOLS__P__MAX_BYTES", "WSPOOL_POOLS__P__GROWTH",
     "WSPOOL_POOLS__P__DESCRIPTION", "WSPOOL_DEBUG_STREAMS", "WSPOOL_POOLS__FLASHINFER_MLA__MAX_BYTES",
     "WSPOOL_POOLS__P__RULES__DEFAULT__X", "WSPOOL_NOPE"]
)  # fmt: skip
_ENV_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)
_ENV_VALUES = st.one_of(_ENV_TEXT, _SCALARS.map(str), _DOCUMENTS.map(lambda d: json.dumps(d, default=str))).map(
    lambda v: v.replace("\x00", "").encode("utf-8", "replace").decode()  # what an environment can hold
)


@given(env=st.dictionaries(_ENV_NAMES, _ENV_VALUES, min_size=1, max_size=4))
def test_random_environment_only_raises_config_errors(env: dict[str, str]) -> None:
    """Any WSPOOL_* values either load into a usable configuration or raise ConfigError."""
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("WSPOOL_")]:
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        _loads_or_config_error(load_settings)
