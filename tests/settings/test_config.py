"""Tests for wspool.settings.schema: sources, precedence, provenance and errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.helpers.paths import REPO_ROOT
from wspool.errors import ConfigError
from wspool.settings.schema import BUILTIN_DEFAULTS, load_settings, load_settings_with_provenance

LSE_ENV = "WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "wspool.yaml"
    path.write_text(text)
    return path


def _lse(settings: object) -> str:
    return settings.pools["flashinfer_mla"].rules["lse"]  # type: ignore[attr-defined]


def test_builtin_defaults_are_vllms_fixed_sizes() -> None:
    """With no file and no environment, vLLM's fixed 128MiB/256MiB rules apply."""
    settings = load_settings()
    assert settings.pools["flashinfer_mla"].rules == {"default": "128MiB", "lse": "256MiB"}


def test_default_yaml_matches_builtin_defaults() -> None:
    """configs/default.yaml carries exactly the built-in defaults."""
    data = yaml.safe_load((REPO_ROOT / "configs" / "default.yaml").read_text())
    assert data == BUILTIN_DEFAULTS


def test_every_shipped_config_validates() -> None:
    """Every file under configs/ loads without error."""
    paths = sorted((REPO_ROOT / "configs").glob("*.yaml"))
    assert [path.stem for path in paths] == [
        "blackwell",
        "default",
        "hopper",
        "kimi_dcp",
        "sglang",
        "tokenspeed",
        "vllm",
    ]
    for path in paths:
        load_settings(path)


def test_yaml_beats_defaults_and_keeps_other_rules(tmp_path: Path) -> None:
    """A YAML value overrides its default; the other default rules stay."""
    path = _write(tmp_path, "pools:\n  flashinfer_mla:\n    rules:\n      lse: 300MiB\n")
    settings = load_settings(path)
    assert settings.pools["flashinfer_mla"].rules == {"default": "128MiB", "lse": "300MiB"}


def test_env_beats_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment variable overrides a built-in default."""
    monkeypatch.setenv(LSE_ENV, "512MiB")
    assert _lse(load_settings()) == "512MiB"


def test_env_beats_yaml_and_keeps_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment variable overrides one YAML value and leaves the rest of the file in place."""
    path = _write(
        tmp_path, "pools:\n  flashinfer_mla:\n    growth: 32MiB\n    rules:\n      lse: 300MiB\n      default: 64MiB\n"
    )
    monkeypatch.setenv(LSE_ENV, "512MiB")
    pool = load_settings(path).pools["flashinfer_mla"]
    assert pool.rules == {"default": "64MiB", "lse": "512MiB"}
    assert pool.growth == "32MiB"


def test_code_beats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value passed in code overrides the environment."""
    monkeypatch.setenv(LSE_ENV, "512MiB")
    settings = load_settings(pools={"flashinfer_mla": {"rules": {"lse": "1GiB"}}})
    assert _lse(settings) == "1GiB"
    assert settings.pools["flashinfer_mla"].rules["default"] == "128MiB"


def test_code_beats_yaml(tmp_path: Path) -> None:
    """A value passed in code overrides the YAML file."""
    path = _write(tmp_path, "pools:\n  flashinfer_mla:\n    rules:\n      lse: 300MiB\n")
    assert _lse(load_settings(path, pools={"flashinfer_mla": {"rules": {"lse": "2GiB"}}})) == "2GiB"


def test_config_file_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """WSPOOL_CONFIG names the YAML file when none is passed in code."""
    path = _write(tmp_path, "pools:\n  flashinfer_mla:\n    rules:\n      lse: 300MiB\n")
    monkeypatch.setenv("WSPOOL_CONFIG", str(path))
    assert _lse(load_settings()) == "300MiB"


def test_new_pool_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool can be defined entirely through nested environment variables."""
    monkeypatch.setenv("WSPOOL_POOLS__PAGED__RULES__DEFAULT", "64MiB")
    monkeypatch.setenv("WSPOOL_POOLS__PAGED__MAX_BYTES", "1GiB")
    pool = load_settings().pools["paged"]
    assert pool.rules == {"default": "64MiB"}
    assert pool.max_bytes == 2**30


def test_provenance_names_each_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Provenance says whether a value came from code, the environment, the file or the defaults."""
    path = _write(tmp_path, "pools:\n  flashinfer_mla:\n    rules:\n      default: 64MiB\n    growth: power_of_two\n")
    monkeypatch.setenv(LSE_ENV, "512MiB")
    _, prov = load_settings_with_provenance(path, pools={"flashinfer_mla": {"max_bytes": "4GiB"}})
    assert prov.source_of(("pools", "flashinfer_mla", "rules", "lse")) == f"environment variable {LSE_ENV}"
    assert prov.source_of(("pools", "flashinfer_mla", "rules", "default")) == f"YAML file {path}"
    assert prov.source_of(("pools", "flashinfer_mla", "max_bytes")) == "code"
    assert prov.source_of(("debug_streams",)) == "built-in default"


def test_missing_named_file_is_an_error(tmp_path: Path) -> None:
    """A config file named explicitly that does not exist is an error."""
    with pytest.raises(ConfigError, match=r"config file .*nope\.yaml \(given explicitly\) does not exist"):
        load_settings(tmp_path / "nope.yaml")


def test_missing_env_named_file_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config file named by WSPOOL_CONFIG that does not exist is an error naming the variable."""
    monkeypatch.setenv("WSPOOL_CONFIG", str(tmp_path / "gone.yaml"))
    with pytest.raises(ConfigError, match=r"named by WSPOOL_CONFIG\) does not exist"):
        load_settings()


def test_invalid_yaml_names_file_and_line(tmp_path: Path) -> None:
    """Invalid YAML is an error with the file, line and column."""
    path = _write(tmp_path, "pools:\n  flashinfer_mla:\n    rules: [unclosed\n")
    with pytest.raises(ConfigError, match=r"invalid YAML in config file .*wspool\.yaml:4:1"):
        load_settings(path)


def test_unsafe_yaml_tags_are_refused(tmp_path: Path) -> None:
    """Python object tags are not constructed (safe loader)."""
    path = _write(tmp_path, "pools: !!python/object/apply:os.system ['touch pwned']\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_settings(path)
    assert not Path("pwned").exists()


def test_yaml_top_level_must_be_mapping(tmp_path: Path) -> None:
    """A YAML file holding a list is an error."""
    with pytest.raises(ConfigError, match="must hold a mapping at the top level, got list"):
        load_settings(_write(tmp_path, "- 1\n- 2\n"))


def test_empty_yaml_means_defaults(tmp_path: Path) -> None:
    """An empty file changes nothing."""
    assert _lse(load_settings(_write(tmp_path, ""))) == "256MiB"


def test_bad_rule_in_yaml_names_key_env_value_and_source(tmp_path: Path) -> None:
    """A bad rule in the file names the key, the variable, the value and the file."""
    path = _write(tmp_path, "pools:\n  flashinfer_mla:\n    rules:\n      lse: 256 MiBs\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    message = str(info.value)
    assert "pools.flashinfer_mla.rules.lse = '256 MiBs'" in message
    assert LSE_ENV in message
    assert f"YAML file {path}" in message
    assert info.value.key == "pools.flashinfer_mla.rules.lse"


def test_garbage_env_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A garbage environment value is an error naming that variable."""
    monkeypatch.setenv(LSE_ENV, "__import__('os')")
    with pytest.raises(ConfigError, match=rf"from environment variable {LSE_ENV}\).*calling"):
        load_settings()


def test_garbage_json_env_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-JSON value for a whole mapping is an error naming WSPOOL_POOLS."""
    monkeypatch.setenv("WSPOOL_POOLS", "{not json")
    with pytest.raises(ConfigError, match="invalid environment variable WSPOOL_POOLS"):
        load_settings()


@pytest.mark.parametrize(
    ("yaml_text", "match"),
    [
        ("pools:\n  p:\n    rulez: {}\n", r"pools\.p\.rulez.*unknown key"),
        ("pools:\n  p:\n    growth: sometimes\n", r"pools\.p\.growth = 'sometimes'.*expected 'exact'"),
        ("pools:\n  p:\n    growth: 0\n", r"pools\.p\.growth.*positive"),
        ("pools:\n  p:\n    max_bytes: -1\n", r"pools\.p\.max_bytes = -1.*negative"),
        ("pools:\n  p:\n    max_bytes: 1.5\n", r"pools\.p\.max_bytes.*got float"),
        ("pools:\n  p:\n    rules:\n      r: [1]\n", r"pools\.p\.rules\.r.*expected a size or an expression"),
        ("pools:\n  p:\n    rules:\n      r: 0\n", r"pools\.p\.rules\.r.*must be a positive size"),
        ("pools:\n  p:\n    rules:\n      r: true\n", r"pools\.p\.rules\.r.*expected a size"),
        ("pools: 5\n", r"pools = 5"),
        ("extra_key: 1\n", r"extra_key.*unknown key"),
        ("debug_streams: maybe\n", r"debug_streams = 'maybe'"),
    ],
)
def test_each_kind_of_bad_value(tmp_path: Path, yaml_text: str, match: str) -> None:
    """Each kind of bad configuration value is a ConfigError naming its key."""
    with pytest.raises(ConfigError, match=match):
        load_settings(_write(tmp_path, yaml_text))


def test_literal_rule_above_max_bytes_is_rejected_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fixed-size rule above its pool's max_bytes could never be served: loading names both keys and sources."""
    path = _write(tmp_path, "pools:\n  flashinfer_mla:\n    max_bytes: 200MiB\n")
    with pytest.raises(
        ConfigError,
        match=r"pools\.flashinfer_mla\.rules\.lse = '256MiB' \(256MiB, from built-in default\) is above "
        r"pools\.flashinfer_mla\.max_bytes = 200MiB \(from YAML file .*wspool\.yaml\), so it could never be "
        r"served; lower pools\.flashinfer_mla\.rules\.lse / WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE or raise "
        r"pools\.flashinfer_mla\.max_bytes / WSPOOL_POOLS__FLASHINFER_MLA__MAX_BYTES",
    ) as info:
        load_settings(path)
    assert info.value.key == "pools.flashinfer_mla"
    monkeypatch.setenv(LSE_ENV, "192MiB")  # lowering the rule fixes it
    assert load_settings(path).pools["flashinfer_mla"].max_bytes == 200 * 2**20


def test_expression_rule_is_checked_against_max_bytes_per_call() -> None:
    """An expression rule may exceed max_bytes only for some calls: it loads, and such a call is refused."""
    from wspool.errors import WorkspaceLimitError
    from wspool.registry import PoolRegistry

    reg = PoolRegistry.from_config(pools={"p": {"rules": {"default": "x * 1MiB"}, "max_bytes": "2MiB"}})
    assert reg.workspace("p", device="cpu", x=2).numel() == 2 * 2**20
    with pytest.raises(WorkspaceLimitError, match=r"needs 3145728 bytes \(3MiB\) for rule default, above max_bytes"):
        reg.workspace("p", device="cpu", x=3)


def test_max_bytes_must_be_positive(tmp_path: Path) -> None:
    """max_bytes: 0 would refuse every request: it is an error; leaving it out means no limit."""
    with pytest.raises(ConfigError, match=r"pools\.p\.max_bytes = 0 .*must be positive \(leave it out for no limit\)"):
        load_settings(_write(tmp_path, "pools:\n  p:\n    max_bytes: 0\n"))


def test_several_errors_are_reported_together(tmp_path: Path) -> None:
    """All invalid values are listed, not just the first."""
    path = _write(tmp_path, "pools:\n  a:\n    growth: nope\n  b:\n    max_bytes: lots\n")
    with pytest.raises(ConfigError, match=r"\(2 errors\).*pools\.a\.growth.*pools\.b\.max_bytes"):
        load_settings(path)


def test_kimi_dcp_lse_rule_scales_with_cp_world() -> None:
    """configs/kimi_dcp.yaml sizes the LSE workspace by the all-gathered heads: num_heads * cp_world."""
    from wspool.registry import PoolRegistry

    reg = PoolRegistry.from_config(REPO_ROOT / "configs" / "kimi_dcp.yaml")
    facts = {"num_heads": 8, "batch_size": 1024, "q_len": 1}
    slab = 135266304  # the trtllm-gen softmax slab of the original overflow report (64 heads x 1024)
    assert reg.resolve("flashinfer_mla", rule="lse", cp_world=8, **facts) == slab + 32 * 2**20
    assert reg.resolve("flashinfer_mla", rule="lse", cp_world=1, **facts) == 8 * 8 * 1024 * 256 + 33 * 2**20
    assert reg.resolve("flashinfer_mla", rule="default", cp_world=8, **facts) == 128 * 2**20
    # A call that leaves cp_world out gets the file's default fact (a DCP group of 8).
    assert reg.resolve("flashinfer_mla", rule="lse", **facts) == slab + 32 * 2**20


# -- hostile input: only ConfigError, nothing silently lost ----------------------------------


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("pools: !!timestamp x\n", r"c\.yaml:1:8: cannot read 'x' as timestamp"),
        ("pools: !!bool maybe\n", r"c\.yaml:1:8: cannot read 'maybe' as bool"),
        ("pools: 2021-13-45\n", r"c\.yaml:1:8: cannot read '2021-13-45' as timestamp"),
        ("pools: {p: {max_bytes: !!int abc}}\n", r"c\.yaml:1:24: cannot read 'abc' as int"),
        ("pools: {p: {max_bytes: " + "9" * 6000 + "}}\n", r"c\.yaml:1:24: cannot read '9999.*' as int"),
        ("pools: {}\npools: {}\n", r"c\.yaml:2:1: duplicate key 'pools' \(first given on line 1\)"),
        (
            "pools:\n  p:\n    max_bytes: 1MiB\n    rules: {default: 1KiB}\n    max_bytes: 2MiB\n",
            r"c\.yaml:5:5: duplicate key 'max_bytes' \(first given on line 3\)",
        ),
        ("pools: {p: {rules: {default: max(5)}}}\n", r"max\(\) takes at least 2 argument\(s\), got 1"),
        ("pools: {'': {rules: {default: 1KiB}}}\n", r"a pool name is empty"),
        ("pools: {p: {rules: {'': 1KiB}}}\n", r"pool 'p' has a rule with an empty name"),
        ("pools: {p: {rules: {default: '１２KiB'}}}\n", r"pools\.p\.rules\.default"),
        ("pools: {p: {max_bytes: '١٢'}}\n", r"pools\.p\.max_bytes = '١٢'"),
    ],
)
def test_hostile_yaml_is_a_config_error_naming_where(tmp_path: Path, text: str, match: str) -> None:
    """Tagged, date-like and huge scalars, duplicate keys, max(5), empty names, non-ASCII digits: ConfigError."""
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=match):
        load_settings(path)


@pytest.mark.parametrize("key", ["off", "no", "yes", "on", "Off", "true"])
def test_a_key_yaml_11_reads_as_a_boolean_is_the_name_written(tmp_path: Path, key: str) -> None:
    """A rule called `off:` (or no/yes/on/true) is a rule of that name, from the file, as a YAML 1.2 reader sees it."""
    path = tmp_path / "c.yaml"
    path.write_text(f"pools:\n  p:\n    rules:\n      default: 1KiB\n      {key}: 2KiB\n")
    settings, provenance = load_settings_with_provenance(path)
    assert settings.pools["p"].rules == {"default": "1KiB", key: "2KiB"}
    assert provenance.source_of(("pools", "p", "rules", key)) == f"YAML file {path}"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("pools:\n  p:\n    rules: {default: 1KiB}\n    no: 3\n",
         r"^invalid wspool configuration: pools\.p\.no \(from YAML file \S*c\.yaml\): unknown key"),
        ("yes: 1\n", r"^invalid wspool configuration: yes \(from YAML file \S*c\.yaml\): unknown key"),
    ],
)  # fmt: skip
def test_a_misplaced_boolean_looking_key_is_refused_by_its_written_name(tmp_path: Path, text: str, match: str) -> None:
    """A key `no:` or `yes:` where no such key exists is refused naming the key as written and its file."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_settings(path)


@pytest.mark.parametrize(("word", "on"), [("yes", True), ("on", True), ("no", False), ("off", False)])
def test_a_boolean_value_keeps_its_yaml_11_meaning(tmp_path: Path, word: str, on: bool) -> None:
    """`debug_streams: yes` is true and `debug_streams: off` false: only keys are read as written."""
    assert load_settings(_write(tmp_path, f"debug_streams: {word}\n")).debug_streams is on


def test_an_overlong_config_path_is_a_config_error(tmp_path: Path) -> None:
    """A config name longer than the OS allows is a ConfigError."""
    with pytest.raises(ConfigError, match=r"cannot read config file .*File name too long"):
        load_settings(tmp_path / ("x" * 5000))


def test_a_config_in_an_unsearchable_directory_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """stat() and open() failing with PermissionError (simulated: the tests may run as root) is a ConfigError."""
    import os

    real_open = os.open

    def denied(self: Path) -> bool:
        raise PermissionError(13, "Permission denied", str(self))

    def open_denied(path: object, *args: object, **kwargs: object) -> int:
        if str(path).startswith("/locked/"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "is_file", denied)
    monkeypatch.setattr(os, "open", open_denied)
    with pytest.raises(ConfigError, match=r"cannot read config file '/locked/c.yaml' .*Permission denied"):
        load_settings("/locked/c.yaml")


@pytest.mark.parametrize("name", ["WSPOOL_POOL__P__RULES__DEFAULT", "WSPOOL_CONFIGG", "wspool_debug_stream"])
def test_a_misspelt_wspool_variable_is_an_error(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A WSPOOL_* variable that names no setting is an error naming it, not ignored."""
    monkeypatch.setenv(name, "1")
    with pytest.raises(ConfigError, match=rf"unknown environment variable\(s\) {name}: no wspool setting"):
        load_settings()


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("WSPOOL_POOL__P__RULES__DEFAULT", "WSPOOL_POOLS__P__RULES__DEFAULT"),
        ("WSPOOL_CONFIGG", "WSPOOL_CONFIG"),
        ("wspool_debug_stream", "WSPOOL_DEBUG_STREAMS"),
        ("WSPOOL_PROFLE", "WSPOOL_PROFILE"),
    ],
)
def test_a_misspelt_wspool_variable_names_the_variable_meant(
    monkeypatch: pytest.MonkeyPatch, name: str, meant: str
) -> None:
    """The error for a misspelt WSPOOL_* variable ends with the variable the user most likely meant."""
    monkeypatch.setenv(name, "1")
    with pytest.raises(ConfigError, match=rf"; did you mean {meant}\?$"):
        load_settings()


@pytest.mark.parametrize("misspelt", ["RULE", "RLUES", "RULEZ"])
def test_a_misspelt_key_in_a_variable_names_the_key_and_variable_meant(
    monkeypatch: pytest.MonkeyPatch, misspelt: str
) -> None:
    """WSPOOL_POOLS__FLASHINFER_MLA__RULE__LSE is answered with pools.flashinfer_mla.rules.lse and its variable."""
    variable = f"WSPOOL_POOLS__FLASHINFER_MLA__{misspelt.upper()}__LSE"
    monkeypatch.setenv(variable, "512MiB")
    with pytest.raises(
        ConfigError,
        match=rf"pools\.flashinfer_mla\.{misspelt.lower()} \(from environment variable {variable}\): unknown key; "
        r"did you mean 'rules'\? set pools\.flashinfer_mla\.rules\.lse / WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE$",
    ):
        load_settings()


def test_a_pool_named_in_two_cases_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """YAML MyPool plus WSPOOL_POOLS__MYPOOL__MAX_BYTES would make a second pool: an error naming both."""
    path = tmp_path / "c.yaml"
    path.write_text("pools: {MyPool: {rules: {default: 1KiB}}}\n")
    monkeypatch.setenv("WSPOOL_POOLS__MYPOOL__MAX_BYTES", "1MiB")
    with pytest.raises(
        ConfigError,
        match=r"pools 'MyPool' \(from YAML file .*\) and 'mypool' \(from environment variable "
        r"WSPOOL_POOLS__MYPOOL__MAX_BYTES\) differ only in case",
    ):
        load_settings(path)


def test_a_huge_invalid_file_gives_a_bounded_error(tmp_path: Path) -> None:
    """Thousands of invalid values: the error quotes the first few and counts the rest."""
    path = tmp_path / "c.yaml"
    body = "".join(f"  p{i}: {{max_bytes: -{i + 1}}}\n" for i in range(2000))
    path.write_text("pools:\n" + body)
    with pytest.raises(ConfigError, match=r"\(2000 errors\): .* and 1995 more$") as info:
        load_settings(path)
    assert len(str(info.value)) < 2000


@pytest.mark.parametrize(
    ("pool", "match"),
    [
        ({"max_bytes": 10**5000}, r"pools\.p\.max_bytes = 1e\+5000 \(from code\): size 1e\+5000 exceeds the limit"),
        ({"rules": {"default": 10**5000}}, r"pools\.p\.rules\.default = 1e\+5000 \(from code\): size 1e\+5000 exceeds"),
        ({"facts": {"x": 10**5000}}, r"pools\.p\.facts\.x = 1e\+5000 \(from code\): a fact must be at most 2\*\*64"),
        ({"facts": {"x": 2**64 + 1}}, r"pools\.p\.facts\.x = 18446744073709551617 .*at most 2\*\*64"),
        ({"facts": {"x": "9" * 5000}}, r"pools\.p\.facts\.x = '9999.*at most 2\*\*64"),
    ],
    ids=["max_bytes", "rule", "fact", "fact-2**64+1", "fact-string"],
)
def test_a_huge_number_in_the_configuration_is_a_config_error(pool: dict[str, object], match: str) -> None:
    """Sizes, rules and facts of thousands of digits are ConfigErrors quoting their magnitude, not ValueErrors."""
    with pytest.raises(ConfigError, match=match):
        load_settings(pools={"p": pool})


def test_a_merge_key_with_an_explicit_override_loads_and_the_explicit_key_wins(tmp_path: Path) -> None:
    """`<<: *base` followed by a key the base also has is valid YAML: it loads, and the explicit value wins."""
    path = _write(
        tmp_path,
        "pools:\n"
        "  a: &base\n    rules: {default: 1KiB, lse: 2KiB}\n    growth: exact\n"
        "  b:\n    <<: *base\n    growth: 4KiB\n    rules: {default: 3KiB}\n",
    )
    pools = load_settings(path).pools
    assert pools["b"].growth == "4KiB" and pools["b"].rules == {"default": "3KiB"}
    assert pools["a"].growth == "exact" and pools["a"].rules == {"default": "1KiB", "lse": "2KiB"}


def test_an_explicit_key_wins_over_several_merges(tmp_path: Path) -> None:
    """With two mappings merged in, an explicit key wins over both and the other merged keys come through."""
    path = _write(
        tmp_path,
        "pools:\n  x: &x {growth: 1KiB, max_bytes: 1MiB}\n  y: &y {max_bytes: 3MiB, description: from y}\n"
        "  z:\n    <<: [*x, *y]\n    max_bytes: 2MiB\n",
    )
    z = load_settings(path).pools["z"]
    assert (z.growth, z.max_bytes, z.description) == ("1KiB", 2 * 2**20, "from y")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            "pools:\n  a: &base {rules: {default: 1KiB}}\n  b:\n    <<: *base\n    growth: exact\n    growth: 4KiB\n",
            r"c\.yaml:6:5: duplicate key 'growth' \(first given on line 5\)",
        ),
        (
            "pools:\n  b:\n    <<: {growth: exact, growth: 4KiB}\n    rules: {default: 1KiB}\n",
            r"c\.yaml:3:25: duplicate key 'growth' \(first given on line 3\)",
        ),
    ],
    ids=["explicit-twice-after-a-merge", "twice-inside-a-merged-mapping"],
)
def test_a_key_given_twice_is_still_refused_next_to_a_merge(tmp_path: Path, text: str, match: str) -> None:
    """A key written twice in one mapping, or in a mapping merged in, stays a duplicate-key error."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_settings(path)


def test_loading_a_file_or_a_profile_builds_the_settings_class_itself(tmp_path: Path) -> None:
    """A load with a YAML file and a profile layered in gives a WspoolSettings, not a class made for that load."""
    from wspool.settings.schema import WspoolSettings, profile_settings

    path = _write(tmp_path, "pools:\n  flashinfer_mla:\n    rules:\n      lse: 300MiB\n")
    settings = load_settings(path)
    layered, provenance = profile_settings(settings, "hopper")
    assert type(settings) is WspoolSettings and type(layered) is WspoolSettings
    assert layered.pools["flashinfer_mla"].rules["lse"] == "300MiB"  # the file over the profile
    assert provenance.source_of(("pools", "flashinfer_mla", "rules", "default")) == "profile hopper"
    assert load_settings().pools["flashinfer_mla"].rules["lse"] == "256MiB"  # nothing of the last load remains


def test_settings_built_directly_read_the_environment_and_engine_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """WspoolSettings() keeps its sources: code over WSPOOL_* over the engines' variables over the built-in defaults."""
    from wspool.settings.schema import WspoolSettings

    monkeypatch.setenv(LSE_ENV, "512MiB")
    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", "1000")
    settings = WspoolSettings(pools={"flashinfer": {"rules": {"decode": "2KiB"}}})
    assert settings.pools["flashinfer_mla"].rules == {"default": "128MiB", "lse": "512MiB"}
    assert settings.pools["flashinfer"].rules["decode"] == "2KiB"
    assert settings.pools["flashinfer"].rules["vllm"] == "1000"
    assert settings.pools["flashinfer"].rules["prefill"].startswith("(256 * sm_count")


@pytest.mark.parametrize(
    ("env", "key", "fix"),
    [
        ({"wspool_config": "c.yaml"}, "config", "set WSPOOL_CONFIG, not wspool_config"),
        ({"wspool_vllm": "0"}, "vllm", "set WSPOOL_VLLM, not wspool_vllm"),
        ({"Wspool_Vllm_Device": "cpu"}, "vllm_device", "set WSPOOL_VLLM_DEVICE, not Wspool_Vllm_Device"),
        ({"wspool_profile": "hopper"}, "profile", "set WSPOOL_PROFILE, not wspool_profile"),
        (
            {"WSPOOL_POOLS__P__MAX_BYTES": "2MiB", "wspool_pools__p__max_bytes": "1MiB"},
            "pools.p.max_bytes",
            "set WSPOOL_POOLS__P__MAX_BYTES, not wspool_pools__p__max_bytes",
        ),
        (
            {"WSPOOL_POOLS__MyPool__RULES__DEFAULT": "1KiB"},
            "pools.mypool.rules.default",
            "set WSPOOL_POOLS__MYPOOL__RULES__DEFAULT, not WSPOOL_POOLS__MyPool__RULES__DEFAULT",
        ),
    ],
    ids=["config", "vllm", "vllm-device", "profile", "two-cases", "mixed-case-pool"],
)
def test_a_wspool_variable_not_in_upper_case_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], key: str, fix: str
) -> None:
    """wspool_config=FILE or wspool_vllm=0 would be ignored, and one setting in two cases decided by order: refused."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=rf"not in upper case: .*; {fix}$") as info:
        load_settings()
    assert info.value.key == key


def test_the_case_check_is_the_one_a_component_calls_before_reading_its_own_variable() -> None:
    """check_env_names() takes an environment: the vLLM plugin's variables are checked like the settings'."""
    from wspool.settings.schema import check_env_names

    check_env_names(environ={"WSPOOL_VLLM": "0", "WSPOOL_VLLM_DEVICE": "cpu", "HOME": "/"})
    with pytest.raises(ConfigError, match=r"set WSPOOL_VLLM, not wspool_vllm"):
        check_env_names(environ={"wspool_vllm": "0"})


@pytest.mark.parametrize("name", ["vllm", "hopper", "blackwell", "kimi_dcp", "default"])
def test_a_shipped_configuration_is_reached_by_its_name(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """--config / WSPOOL_CONFIG take a shipped configuration's name: the package's file, as after pip install."""
    from wspool.settings.profiles import shipped_config

    settings, provenance = load_settings_with_provenance(name)
    assert provenance.config_file == shipped_config(name)
    assert settings == load_settings(shipped_config(name))
    monkeypatch.setenv("WSPOOL_CONFIG", name)
    assert load_settings() == settings


def test_every_shipped_name_is_reachable() -> None:
    """Each shipped configuration, whatever its name, loads by that name."""
    from wspool.settings.profiles import shipped_config_names

    names = shipped_config_names()
    assert names == ["blackwell", "default", "hopper", "kimi_dcp", "sglang", "tokenspeed", "vllm"]
    for name in names:
        load_settings(name)


def test_a_file_that_exists_wins_over_a_shipped_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file named like a shipped configuration, in the working directory, is read instead of the shipped one."""
    (tmp_path / "hopper").write_text("pools:\n  flashinfer_mla:\n    rules:\n      lse: 300MiB\n")
    monkeypatch.chdir(tmp_path)
    assert _lse(load_settings("hopper")) == "300MiB"


def test_an_unknown_name_lists_the_shipped_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name that is neither a file nor shipped is an error naming how it was given and every shipped name."""
    shipped = r"\(shipped: blackwell, default, hopper, kimi_dcp, sglang, tokenspeed, vllm\)"
    with pytest.raises(ConfigError, match=r"^config file hoper \(given explicitly\) does not exist or is not a file, "
                       rf"and no shipped configuration has that name {shipped}$"):  # fmt: skip
        load_settings("hoper")
    monkeypatch.setenv("WSPOOL_CONFIG", "vlm")
    with pytest.raises(ConfigError, match=rf"config file vlm \(named by WSPOOL_CONFIG\) does not exist.*{shipped}"):
        load_settings()


@pytest.mark.parametrize(
    ("key", "value", "fix"),
    [
        ("rules", {"lse": "512M"}, "write 512MiB (powers of 1024) or 512MB (powers of 1000)"),
        ("max_bytes", "2Gi", "write 2GiB"),
        ("growth", "32M", "write 32MiB (powers of 1024) or 32MB (powers of 1000)"),
    ],
)
def test_a_kubernetes_size_in_the_configuration_names_wspools_spelling(
    tmp_path: Path, key: str, value: object, fix: str
) -> None:
    """512M, 2Gi or 32M in a rule, max_bytes or growth is refused with wspool's spelling and the setting to change."""
    path = _write(tmp_path, yaml.safe_dump({"pools": {"flashinfer_mla": {key: value}}}))
    with pytest.raises(ConfigError, match=rf"{re.escape(fix)}.*set pools\.flashinfer_mla\.{key}"):
        load_settings(path)
