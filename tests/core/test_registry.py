"""Tests for wspool.registry: the public API backends use."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import wspool
from wspool.errors import ConfigError, WorkspaceFrozenError, WorkspaceLimitError

MiB = 2**20


def test_default_registry_serves_the_seed_sizes() -> None:
    """The process default registry gives 128MiB by default and 256MiB for lse."""
    reg = wspool.get_registry()
    assert reg.resolve("flashinfer_mla") == 128 * MiB
    assert reg.resolve("flashinfer_mla", rule="lse") == 256 * MiB
    assert reg.workspace("flashinfer_mla", device="cpu").numel() == 128 * MiB
    assert reg.workspace("flashinfer_mla", device="cpu", rule="lse").numel() == 256 * MiB
    assert wspool.get_registry() is reg


def test_from_config_reads_the_file(tmp_path: Path) -> None:
    """from_config loads an explicit file."""
    path = tmp_path / "my.yaml"
    path.write_text("pools:\n  flashinfer_mla:\n    rules:\n      lse: 300MiB\n")
    assert wspool.PoolRegistry.from_config(path).resolve("flashinfer_mla", rule="lse") == 314572800


def test_from_config_missing_file() -> None:
    """from_config with a missing file is a ConfigError."""
    with pytest.raises(ConfigError, match="does not exist"):
        wspool.PoolRegistry.from_config("/nonexistent/wspool.yaml")


def test_backends_share_one_buffer() -> None:
    """Two callers naming the same pool and device get the same buffer."""
    reg = wspool.PoolRegistry.from_config(pools={"shared": {"rules": {"a": "1MiB", "b": "2MiB"}}})
    first = reg.workspace("shared", device="cpu", rule="b")
    second = reg.workspace("shared", device=torch.device("cpu"), rule="a")
    assert first.data_ptr() == second.data_ptr()
    assert reg.stats("shared", device="cpu").request_count == 2


def test_pools_and_lanes_are_separate() -> None:
    """Different pools, and different lanes of one pool, never share memory."""
    reg = wspool.PoolRegistry.from_config(
        pools={"x": {"rules": {"default": "1MiB"}}, "y": {"rules": {"default": "1MiB"}}}
    )
    x = reg.workspace("x", device="cpu")
    y = reg.workspace("y", device="cpu")
    with wspool.lane("ubatch1"):
        x1 = reg.workspace("x", device="cpu")
    x2 = reg.workspace("x", device="cpu", lane="ubatch2")
    assert len({x.data_ptr(), y.data_ptr(), x1.data_ptr(), x2.data_ptr()}) == 4
    assert reg.workspace("x", device="cpu").data_ptr() == x.data_ptr()
    assert {s.lane for s in reg.all_stats() if s.pool == "x"} == {"main", "ubatch1", "ubatch2"}


def test_device_none_means_cpu_without_cuda() -> None:
    """device=None is the current device: the CPU on a machine without CUDA."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; covered by the GPU tests")
    reg = wspool.PoolRegistry()
    assert reg.workspace("flashinfer_mla").device == torch.device("cpu")


def test_resolve_allocates_nothing() -> None:
    """resolve() returns bytes without creating a buffer."""
    reg = wspool.PoolRegistry()
    assert reg.resolve("flashinfer_mla", rule="lse") == 256 * MiB
    assert list(reg.pools()) == []


def test_unknown_pool_and_rule_name_the_setting() -> None:
    """Unknown pools and rules are ConfigErrors naming the key to set."""
    reg = wspool.PoolRegistry()
    with pytest.raises(ConfigError, match=r"unknown pool 'nope'.*WSPOOL_POOLS__NOPE__RULES__DEFAULT"):
        reg.workspace("nope", device="cpu")
    with pytest.raises(ConfigError, match=r"no rule 'prefill'.*pools\.flashinfer_mla\.rules\.prefill"):
        reg.resolve("flashinfer_mla", rule="prefill")
    assert list(reg.pools()) == []


def test_reserve_and_warmup() -> None:
    """reserve() pre-sizes by bytes or rule; warmup() grows once to the largest shape."""
    reg = wspool.PoolRegistry.from_config(pools={"p": {"rules": {"default": "x * 1MiB"}}})
    reg.reserve("p", device="cpu", nbytes="2MiB")
    assert reg.stats("p", device="cpu").capacity_bytes == 2 * MiB
    capacity = reg.warmup("p", [{"x": 1}, {"x": 5}, {"x": 3}], device="cpu")
    assert capacity == 5 * MiB
    assert reg.stats("p", device="cpu").grow_count == 2
    reg.reserve("p", device="cpu", rule="default", x=6)
    assert reg.stats("p", device="cpu").capacity_bytes == 6 * MiB
    with pytest.raises(ValueError, match="exactly one of nbytes= or rule="):
        reg.reserve("p", device="cpu")


def test_freeze_context_manager() -> None:
    """Inside frozen(), growth is refused; afterwards it is allowed again."""
    reg = wspool.PoolRegistry()
    reg.workspace("flashinfer_mla", device="cpu")
    with reg.frozen():
        assert reg.is_frozen
        with pytest.raises(WorkspaceFrozenError, match=r"rules\.lse"):
            reg.workspace("flashinfer_mla", device="cpu", rule="lse")
    assert not reg.is_frozen
    assert reg.workspace("flashinfer_mla", device="cpu", rule="lse").numel() == 256 * MiB


def test_declared_pool_is_overridden_by_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend's declared rules apply unless the configuration sets them."""
    monkeypatch.setenv("WSPOOL_POOLS__MYBACKEND__RULES__DEFAULT", "8MiB")
    reg = wspool.PoolRegistry()
    reg.declare_pool("mybackend", {"default": "4MiB", "prefill": "16MiB"}, max_bytes="1GiB")
    assert reg.resolve("mybackend") == 8 * MiB
    assert reg.resolve("mybackend", rule="prefill") == 16 * MiB
    assert reg.spec("mybackend").max_bytes == 2**30


def test_reset_drops_buffers() -> None:
    """reset() forgets every pool instance."""
    reg = wspool.PoolRegistry()
    reg.workspace("flashinfer_mla", device="cpu")
    reg.reset()
    assert reg.all_stats() == []


def test_concurrent_first_requests_allocate_once() -> None:
    """Threads racing on a new pool allocate it exactly once and count every request."""
    allocations = []

    def allocator(nbytes: int, device: torch.device) -> torch.Tensor:
        allocations.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)

    reg = wspool.PoolRegistry(wspool.load_settings(pools={"p": {"rules": {"default": "1MiB"}}}), allocator=allocator)
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        for _ in range(500):
            reg.workspace("p", device="cpu")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert allocations == [MiB]
    assert reg.stats("p", device="cpu").request_count == 4000


def test_import_touches_neither_flashinfer_nor_cuda() -> None:
    """import wspool loads no FlashInfer and creates no CUDA context."""
    code = (
        "import sys, torch, wspool; "
        "assert 'flashinfer' not in sys.modules, 'flashinfer imported'; "
        "assert not torch.cuda.is_initialized(), 'cuda initialised'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


# -- hostile use: overlapping freezes, failed declarations, a bad environment --------------


def test_overlapping_frozen_blocks_in_two_threads_keep_the_freeze() -> None:
    """Two threads' frozen() blocks overlap: frozen throughout, no growth, unfrozen after the last closes."""
    reg = wspool.PoolRegistry.from_config(None, pools={"p": {"rules": {"default": "1KiB", "big": "2KiB"}}})
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def first() -> None:
        with reg.frozen():
            first_in.set()
            assert second_in.wait(10)
        first_out.set()

    def second() -> None:
        assert first_in.wait(10)
        with reg.frozen():
            second_in.set()
            assert first_out.wait(10)
            seen["frozen"] = reg.is_frozen
            try:
                reg.workspace("p", "cpu", rule="big")
            except WorkspaceFrozenError as exc:
                seen["error"] = exc

    threads = [threading.Thread(target=first, daemon=True), threading.Thread(target=second, daemon=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
        assert not thread.is_alive(), "deadlock in the frozen blocks"
    assert seen["frozen"] is True
    assert isinstance(seen["error"], WorkspaceFrozenError)
    assert reg.is_frozen is False
    reg.freeze()
    with reg.frozen():
        pass
    assert reg.is_frozen is True  # the state from before the block
    reg.unfreeze()
    assert reg.is_frozen is False


def test_a_failed_declare_pool_changes_nothing() -> None:
    """A declaration refused for a rule clash with its host changes nothing; a later valid one applies."""
    reg = wspool.PoolRegistry.from_config(
        None, pools={"h": {"rules": {"a": "1KiB"}}, "g": {"shared_with": "h", "rules": {"b": "2KiB"}}}
    )
    with pytest.raises(ConfigError, match=r"pools 'g' and 'h' share one buffer .* both have a rule 'a'"):
        reg.declare_pool("g", {"a": "64KiB"})
    with pytest.raises(ConfigError, match="has no rule 'a'"):
        reg.resolve("g", "a")
    reg.declare_pool("g", {"c": "4KiB"})  # a later, valid declaration still applies
    assert reg.workspace("g", "cpu", rule="c").numel() == 4096
    assert reg.resolve("g", "b") == 2048


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_bytes": 0}, r"pools\.d\.max_bytes = 0 .*max_bytes must be positive"),
        ({"max_bytes": "1KiB"}, r"pools\.d\.rules\.default = '4KiB' .* is above pools\.d\.max_bytes = 1KiB"),
        ({"growth": "sideways"}, r"pools\.d\.growth = 'sideways' .*expected 'exact', 'power_of_two'"),
    ],
)
def test_declare_pool_validates_as_yaml_does(kwargs: dict[str, object], match: str) -> None:
    """declare_pool refuses what a YAML file refuses, naming the key, and declares nothing."""
    reg = wspool.PoolRegistry.from_config(None)
    with pytest.raises(ConfigError, match=match):
        reg.declare_pool("d", {"default": "4KiB"}, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown pool 'd'"):
        reg.spec("d")


def test_declare_pool_takes_growth_in_any_case_and_refuses_empty_names() -> None:
    """growth="POWER_OF_TWO" is power_of_two, as in YAML; an empty pool or rule name is an error."""
    reg = wspool.PoolRegistry.from_config(None)
    assert reg.declare_pool("d", {"default": "3KiB"}, growth="POWER_OF_TWO").growth == "power_of_two"
    with pytest.raises(ConfigError, match="a pool name must be a non-empty string"):
        reg.declare_pool("", {"default": "1KiB"})
    with pytest.raises(ConfigError, match="has a rule with an empty name"):
        reg.declare_pool("e", {"": "1KiB"})


def test_after_reset_a_bad_environment_makes_get_registry_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented choice: get_registry() raises ConfigError naming the variable until it is fixed."""
    good = wspool.get_registry()
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE", "5 +")
    wspool.reset_registry()
    for _ in range(2):
        with pytest.raises(ConfigError, match="WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE"):
            wspool.get_registry()
    monkeypatch.delenv("WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE")
    assert wspool.get_registry() is not good


def test_registry_holds_to_the_settings_it_was_built_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device whose profile is first used after the file was edited, then deleted, and the environment changed
    still gets the configuration the registry was built from."""
    from tests.helpers.devices_fake import H200, meta_allocator

    config = tmp_path / "wspool.yaml"
    config.write_text("pools:\n  p:\n    rules:\n      default: 1MiB\n")
    settings = wspool.load_settings(config)
    reg = wspool.PoolRegistry(
        settings, allocator=meta_allocator, describe_device=lambda d: H200 if d.type == "meta" else None
    )
    config.write_text("pools:\n  p:\n    rules:\n      default: 2MiB\n")
    assert reg.resolve("p", device="cpu") == 1 << 20  # the base profile's view
    config.unlink()
    monkeypatch.setenv("WSPOOL_POOLS__P__RULES__DEFAULT", "3MiB")
    assert reg.profile_of("meta").profile == "hopper"  # a view made only now
    assert reg.resolve("p", device="meta") == 1 << 20
    assert reg.workspace("p", "meta").numel() == 1 << 20


def test_a_registry_serves_the_settings_it_was_given_not_the_file_they_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Settings loaded, then the file edited, the environment changed, or the file deleted: a registry built from
    them afterwards serves what they hold, on the CPU and on a GPU profile's device."""
    from tests.helpers.devices_fake import H200, meta_allocator

    config = tmp_path / "wspool.yaml"
    config.write_text("pools:\n  p:\n    rules:\n      default: 1MiB\n")
    settings = wspool.load_settings(config)

    def registry() -> wspool.PoolRegistry:
        return wspool.PoolRegistry(
            settings, allocator=meta_allocator, describe_device=lambda d: H200 if d.type == "meta" else None
        )

    config.write_text("pools:\n  p:\n    rules:\n      default: 2MiB\n")
    edited = registry()
    monkeypatch.setenv("WSPOOL_POOLS__P__RULES__DEFAULT", "3MiB")
    changed = registry()
    config.unlink()
    deleted = registry()
    for reg in (edited, changed, deleted):
        assert reg.settings.pools["p"].rules["default"] == settings.pools["p"].rules["default"]
        assert reg.resolve("p", device="cpu") == reg.resolve("p", device="meta") == 1 << 20
        assert reg.profile_of("meta").profile == "hopper"


def test_profile_settings_layer_the_inputs_read_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """profile_settings layers a profile under what load_settings read, not under the file or environment now;
    where each value came from is as it was at load."""
    from wspool.settings.schema import profile_settings

    config = tmp_path / "wspool.yaml"
    config.write_text("pools:\n  p:\n    rules:\n      default: 1MiB\n")
    settings = wspool.load_settings(config, pools={"q": {"rules": {"default": "5MiB"}}})
    config.unlink()
    monkeypatch.setenv("WSPOOL_POOLS__Q__RULES__DEFAULT", "6MiB")
    layered, provenance = profile_settings(settings, "hopper")
    assert (layered.pools["p"].rules["default"], layered.pools["q"].rules["default"]) == ("1MiB", "5MiB")
    assert provenance.source_of(("pools", "p", "rules", "default")) == f"YAML file {config}"
    assert provenance.source_of(("pools", "flashinfer_mla", "rules", "lse")) == "profile hopper"


@pytest.mark.parametrize("rules", ["64MiB", 64 << 20, ["64MiB"], {}])
def test_declare_pool_with_rules_that_are_not_a_mapping_says_what_they_must_be(rules: object) -> None:
    """declare_pool's rules must be a mapping of rule names to sizes; anything else is a ConfigError that says so."""
    reg = wspool.PoolRegistry(wspool.load_settings())
    with pytest.raises(ConfigError, match=r"rules must be a non-empty mapping of rule name to a size or an expression"):
        reg.declare_pool("p", rules)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown pool 'p'"):
        reg.spec("p")


def test_a_declaration_reaches_profiles_first_used_after_it() -> None:
    """A pool declared before any GPU was seen is declared, with its cap and growth, under each later profile."""
    from tests.helpers.devices_fake import B200, H200, meta_allocator

    kinds = {"cpu": H200, "meta": B200}
    reg = wspool.PoolRegistry(describe_device=lambda device: kinds.get(device.type), allocator=meta_allocator)
    reg.declare_pool("extra", {"default": "sm_count * 1KiB"}, growth="power_of_two", max_bytes="1MiB")
    assert reg.resolve("extra", device="cpu") == 132 * 1024
    assert reg.resolve("extra", device="meta") == 148 * 1024
    for device in ("cpu", "meta"):
        spec = reg.spec("extra", device)
        assert (spec.growth, spec.max_bytes) == ("power_of_two", MiB)
    assert reg.workspace("extra", "meta").numel() == 256 * 1024


def test_allowing_growth_lets_only_its_block_grow_a_frozen_registry_and_retires_what_it_replaces() -> None:
    """Inside allowing_growth() a frozen registry grows, retiring the buffer current at the freeze; outside it
    refuses, and release_retired() frees the retired bytes of every pool."""
    reg = wspool.PoolRegistry()
    reg.declare_pool("a", {"small": "1MiB", "big": "2MiB"})
    reg.declare_pool("b", {"small": "1MiB", "big": "3MiB"})
    for pool in ("a", "b"):
        reg.workspace(pool, "cpu", rule="small")
    reg.freeze()
    with reg.allowing_growth():
        assert reg.is_frozen
        assert reg.workspace("a", "cpu", rule="big").numel() == 2 * MiB
    with pytest.raises(WorkspaceFrozenError, match=r"pools\.b\.rules\.big"):
        reg.workspace("b", "cpu", rule="big")
    reg.unfreeze()
    assert not reg.is_frozen
    reg.workspace("b", "cpu", rule="big")
    assert [(s.pool, s.retired_bytes) for s in reg.all_stats()] == [("a", MiB), ("b", MiB)]
    assert reg.release_retired() == 2 * MiB and reg.release_retired() == 0


def test_reset_unfreezes_and_drops_pools_and_state() -> None:
    """reset() ends a freeze and an open frozen() block, and forgets pools and state objects."""
    reg = wspool.PoolRegistry()
    reg.workspace("flashinfer_mla", device="cpu")
    made = reg.state(dict)
    reg.freeze()
    with reg.frozen():
        reg.reset()
        assert not reg.is_frozen
    assert reg.all_stats() == [] and reg.peek_state(dict) is None and reg.state(dict) is not made
    assert reg.workspace("flashinfer_mla", device="cpu", rule="lse").numel() == 256 * MiB


def test_redeclaring_a_pool_in_use_with_another_cap_or_growth_is_refused() -> None:
    """A pool in use keeps the cap in force: a re-declaration that changes max_bytes or growth raises, naming it."""
    reg = wspool.PoolRegistry.from_config(None)
    reg.declare_pool("d", {"default": "1KiB", "n": "n"}, max_bytes="2KiB")
    reg.workspace("d", "cpu")
    reg.declare_pool("d", {"default": "1KiB", "n": "n"}, max_bytes=2048)  # the same declaration: accepted
    for change in ({"max_bytes": None}, {"max_bytes": "1MiB"}, {"growth": "power_of_two", "max_bytes": "2KiB"}):
        with pytest.raises(ConfigError, match=r"pool 'd' is in use: .*pools\.d\.(max_bytes|growth)"):
            reg.declare_pool("d", {"default": "1KiB", "n": "n"}, **change)  # type: ignore[arg-type]
    with pytest.raises(WorkspaceLimitError, match=r"raise pools\.d\.max_bytes"):
        reg.workspace("d", "cpu", rule="n", n=1 << 20)
    assert reg.stats("d", "cpu").capacity_bytes == 1024 and reg.spec("d").max_bytes == 2048


def test_redeclaring_a_pool_in_use_never_drops_a_configured_cap() -> None:
    """A configured max_bytes wins over a re-declaration without one: the same pool, accepted, still capped."""
    reg = wspool.PoolRegistry.from_config(None, pools={"d": {"rules": {"n": "n"}, "max_bytes": "2KiB"}})
    reg.workspace("d", "cpu", rule="n", n=1024)
    reg.declare_pool("d", {"n": "n"})
    with pytest.raises(WorkspaceLimitError, match=r"pools\.d\.max_bytes"):
        reg.workspace("d", "cpu", rule="n", n=1 << 20)


def test_declaring_a_rule_above_the_cap_of_the_buffer_it_shares_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A declared fixed rule on a shared buffer above its max_bytes is refused as YAML refuses it, naming both keys."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_MLA__MAX_BYTES", "256MiB")
    reg = wspool.PoolRegistry()
    with pytest.raises(
        ConfigError,
        match=r"pools\.flashinfer\.rules\.vllm / WSPOOL_POOLS__FLASHINFER__RULES__VLLM = '394MiB' is above "
        r"pools\.flashinfer_mla\.max_bytes / WSPOOL_POOLS__FLASHINFER_MLA__MAX_BYTES = 268435456",
    ):
        reg.declare_pool("flashinfer", {"vllm": "394MiB"})
    with pytest.raises(ConfigError, match="has no rule 'vllm'"):
        reg.resolve("flashinfer", "vllm")
    reg.declare_pool("flashinfer", {"vllm": "200MiB"})
    assert reg.resolve("flashinfer", "vllm") == 200 << 20
    monkeypatch.delenv("WSPOOL_POOLS__FLASHINFER_MLA__MAX_BYTES")
    reg = wspool.PoolRegistry()
    reg.declare_pool("flashinfer", {"vllm": "394MiB"})
    with pytest.raises(
        ConfigError, match=r"pools\.flashinfer\.rules\.vllm .* is above pools\.flashinfer_mla\.max_bytes"
    ):
        reg.declare_pool("flashinfer_mla", {"default": "128MiB"}, max_bytes="300MiB")
    assert reg.spec("flashinfer_mla").max_bytes is None


def test_a_declaration_refused_under_a_configured_cap_names_where_the_cap_came_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A declared rule above a max_bytes from WSPOOL_* or YAML names that source, not the declaration, as the cap's."""
    monkeypatch.setenv("WSPOOL_POOLS__Q__MAX_BYTES", "1MiB")
    with pytest.raises(
        ConfigError,
        match=r"pools\.q\.rules\.default = '4MiB' \(4MiB, from code \(declare_pool\)\) is above pools\.q\.max_bytes = "
        r"1MiB \(from environment variable WSPOOL_POOLS__Q__MAX_BYTES\)",
    ):
        wspool.PoolRegistry().declare_pool("q", {"default": "4MiB"})
    monkeypatch.delenv("WSPOOL_POOLS__Q__MAX_BYTES")
    (tmp_path / "q.yaml").write_text("pools:\n  q:\n    rules: {big: 8MiB}\n")
    with pytest.raises(
        ConfigError,
        match=r"pools\.q\.rules\.big = '8MiB' \(8MiB, from YAML file .*q\.yaml\) is above pools\.q\.max_bytes = 2MiB "
        r"\(from code \(declare_pool\)\)",
    ):
        wspool.PoolRegistry.from_config(tmp_path / "q.yaml").declare_pool("q", {"default": "1MiB"}, max_bytes="2MiB")


def test_resolve_refuses_a_fact_no_rule_reads() -> None:
    """registry.resolve(..., batchsize=8) raises, naming the fact, what the rule reads and the close spelling."""
    reg = wspool.PoolRegistry.from_config("kimi_dcp")
    with pytest.raises(
        wspool.RuleError,
        match=r"fact 'batchsize' is read by no rule of pool 'flashinfer_mla', so it would be ignored \(rule lse reads "
        r"batch_size, cp_world, num_heads, q_len\); did you mean 'batch_size'\?",
    ):
        reg.resolve("flashinfer_mla", "lse", device="cpu", batchsize=8)
    # Facts wspool's ops pass, or that another rule of the pool reads, are accepted.
    assert reg.resolve("flashinfer_mla", "default", device="cpu", batch_size=8, num_heads=128) == 128 * MiB


def test_resolve_refuses_a_negative_fact() -> None:
    """registry.resolve(..., batch_size=-1) raises naming the default-fact key, as YAML and WSPOOL_* refuse -1."""
    reg = wspool.PoolRegistry.from_config("kimi_dcp")
    with pytest.raises(wspool.RuleError, match=r"fact 'batch_size' = -1 is negative.*pools\.flashinfer_mla\.facts"):
        reg.resolve("flashinfer_mla", "lse", device="cpu", batch_size=-1)


def test_the_per_call_path_takes_extra_facts_unchecked() -> None:
    """workspace() takes facts no rule reads (an engine passes its own), as before: no check on the hot path."""
    reg = wspool.PoolRegistry.from_config("kimi_dcp")
    buffer = reg.workspace("flashinfer_mla", "cpu", rule="lse", batch_size=1, engine_step=3)
    assert buffer.numel() >= reg.resolve("flashinfer_mla", "lse", device="cpu", batch_size=1)


def test_a_pool_in_use_cannot_be_declared_again_with_other_rules() -> None:
    """Declaring a pool again after its first request, with other rules, is refused; the old rules keep serving."""
    reg = wspool.PoolRegistry()
    reg.declare_pool("mine", {"default": "1MiB"})
    reg.declare_pool("mine", {"default": "2MiB"})  # before its first request: replaces the declaration
    assert reg.workspace("mine", "cpu").numel() == 2 * MiB
    with pytest.raises(ConfigError, match=r"pool 'mine' is in use"):
        reg.declare_pool("mine", {"default": "4MiB"})
    assert reg.resolve("mine") == 2 * MiB and reg.workspace("mine", "cpu").numel() == 2 * MiB


def test_a_profile_first_used_while_a_declared_pool_is_in_use_takes_the_declaration() -> None:
    """A GPU of a new profile, first seen after a declared pool served requests elsewhere, still gets the pool."""
    from tests.helpers.devices_fake import B200, H200, meta_allocator

    kinds = {"cpu": H200, "meta": B200}
    reg = wspool.PoolRegistry(describe_device=lambda device: kinds.get(device.type), allocator=meta_allocator)
    reg.declare_pool("extra", {"default": "sm_count * 1KiB"})
    assert reg.workspace("extra", "cpu").numel() == 132 * 1024
    assert reg.workspace("extra", "meta").numel() == 148 * 1024


def test_registry_workspace_serves_repeated_calls_without_the_pools_full_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a call's first miss, registry.workspace() returns the held buffer without asking the pool again."""
    reg = wspool.PoolRegistry()
    reg.declare_pool("mine", {"default": "1MiB"})
    first = reg.workspace("mine", "cpu")
    reg.workspace("mine", "cpu")
    pool = reg.pool("mine", "cpu")
    asked: list[str] = []
    served = pool.workspace
    monkeypatch.setattr(pool, "workspace", lambda rule, facts: asked.append(rule) or served(rule, facts))
    assert all(reg.workspace("mine", "cpu") is first for _ in range(3))
    assert asked == [] and reg.stats("mine", "cpu").requests_by_rule["default"] == 5


def test_warmup_over_no_shapes_allocates_nothing() -> None:
    """warmup() with an empty list of shapes grows nothing and returns the capacity held (0 for a new pool)."""
    reg = wspool.PoolRegistry()
    reg.declare_pool("mine", {"default": "n * 1KiB"})
    assert reg.warmup("mine", [], "cpu") == 0
    assert reg.stats("mine", "cpu").grow_count == 0
    assert reg.warmup("mine", [{"n": 3}, {"n": 5}, {"n": 4}], "cpu") == 5 * 1024


def test_a_configured_and_declared_pool_in_use_reaches_a_profile_first_used_later() -> None:
    """A pool set in the configuration and declared with more rules, in use on one GPU, is whole on a new one."""
    from tests.helpers.devices_fake import B200, H200, meta_allocator
    from tests.helpers.registry import make_registry

    kinds = {"cpu": H200, "meta": B200}
    reg = make_registry(
        {"extra": {"rules": {"default": "1KiB"}}},
        allocator=meta_allocator,
        describe_device=lambda device: kinds.get(device.type),
    )
    reg.declare_pool("extra", {"more": "sm_count * 1KiB"})
    assert reg.workspace("extra", "cpu", rule="more").numel() == 132 * 1024
    assert reg.workspace("extra", "meta", rule="more").numel() == 148 * 1024
    assert reg.resolve("extra", "default", device="meta") == 1024


def test_a_process_wide_handle_is_refused_a_rule_its_pool_no_longer_owns() -> None:
    """After set_registry, a handle whose rule belongs to the new host of its pool's buffer is refused, named."""
    from tests.helpers.registry import make_registry

    wspool.set_registry(make_registry({"b": {"rules": {"y": "1KiB"}}}))
    handle = wspool.get_registry().handle("b", "y", device="cpu")
    assert handle.get().numel() == 1024
    shared = {"a": {"rules": {"y": "2KiB"}}, "b": {"shared_with": "a", "rules": {"z": "4KiB"}}}
    wspool.set_registry(make_registry(shared))
    with pytest.raises(wspool.RuleError, match=r"pools\.b\.rules"):
        handle.get()
