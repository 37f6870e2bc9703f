"""Tests for wspool.integrations.vllm: the plugin loaded by the real vLLM (0.33.0 or 0.34.0), and without vLLM.

The tests that need vLLM skip, with the reason, where it is not installed;
those of one vLLM version's paths skip, with the reason, on the other. One
command runs them in each engine environment (``.ci/engine-envs`` builds both)::

    .venv-vllm/bin/python -m pytest -q tests/integrations/test_vllm_plugin.py      # vLLM 0.33.0
    .venv-vllm034/bin/python -m pytest -q tests/integrations/test_vllm_plugin.py   # vLLM 0.34.0

The device hook ``WSPOOL_VLLM_DEVICE=cpu`` points every replacement at the CPU;
FlashInfer's kernels are replaced by recorders (there is no GPU).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points, version
from pathlib import Path
from types import MethodType, ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

import wspool
from tests.helpers.dcp_config import use_lse_rule_without_facts
from tests.helpers.paths import REPO_ROOT
from wspool.errors import RuleError, WorkspaceFrozenError
from wspool.integrations import vllm as plugin
from wspool.targets import Target

MiB = 1 << 20
MLA = "vllm.v1.attention.backends.mla.flashinfer_mla"
SPARSE = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse"
PAGED = "vllm.v1.attention.backends.flashinfer"
SPARSE_SM120 = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120"
WORKSPACE = "vllm.v1.worker.workspace"
DRAFTER = "vllm.models.kimi_k3.nvidia.specialized_decode.drafter.attention"
DSV4 = "vllm.models.deepseek_v4.nvidia.flashinfer_sparse"
DSV41 = "vllm.models.deepseek_v41.nvidia.flashinfer_sparse"
DSV41_SPARSE = "vllm.models.deepseek_v41.nvidia.specialized_decode.attention.sparse_mla"
DASH = "vllm.v1.attention.ops.dash_attention"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
VLLM_VERSION = version("vllm") if HAS_VLLM else None
#: The FlashInfer each tested vLLM runs with: 0.33.0's pin, and 0.34.0's pin (0.7.3) or the
#: override its documented install uses where the package index lacks 0.7.3 (docs/vllm.md).
FLASHINFER_OF_VLLM = {"0.33.0": ("0.7.2.post1",), "0.34.0": ("0.7.3", "0.7.4")}


@pytest.fixture
def vllm() -> ModuleType:
    """The real vLLM package; skips where it is not installed."""
    return pytest.importorskip(
        "vllm", reason="vLLM is not installed here; `.ci/engine-envs` builds .venv-vllm (0.33.0) and .venv-vllm034"
    )


@pytest.fixture
def vllm034(vllm: ModuleType) -> ModuleType:
    """The real vLLM 0.34; skips on another version."""
    if not (VLLM_VERSION or "").startswith("0.34."):
        pytest.skip(f"a vLLM 0.34 path; this is vLLM {VLLM_VERSION}")
    return vllm


@pytest.fixture
def vllm033(vllm: ModuleType) -> ModuleType:
    """The real vLLM 0.33; skips on another version."""
    if not (VLLM_VERSION or "").startswith("0.33."):
        pytest.skip(f"a vLLM 0.33 path; this is vLLM {VLLM_VERSION}")
    return vllm


@pytest.fixture
def load(vllm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Return a function that loads vLLM's general plugins through vLLM itself; undo every patch after the test."""
    import vllm.plugins

    monkeypatch.setenv("WSPOOL_VLLM_DEVICE", "cpu")

    def load_plugins() -> None:
        monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
        vllm.plugins.load_general_plugins()

    try:
        yield load_plugins
    finally:
        plugin.unregister()
        from vllm.v1.worker.workspace import reset_workspace_manager

        reset_workspace_manager()


@pytest.fixture
def loaded(load: Any) -> None:
    """vLLM's plugins loaded (wspool's among them)."""
    load()


def _module(name: str) -> Any:
    return importlib.import_module(name)


def _present(target: Target) -> bool:
    """Whether this vLLM has the target's attribute (the optional ones exist in one version only)."""
    if target.imported_only and target.module not in sys.modules:
        return False  # a by-name copy in a module not imported: patched by its import, not by loading
    try:
        owner: Any = importlib.import_module(target.module)
    except ModuleNotFoundError:
        return False
    for part in target.path.split("."):
        owner = getattr(owner, part, None)
    return owner is not None


def _present_targets() -> list[str]:
    return sorted(target.name for target in plugin.TARGETS if _present(target))


def _pool_ptr(pool: str) -> int:
    """The address of the CPU buffer pool ``pool`` draws from (its own, or its shared_with host's)."""
    buffer = wspool.get_registry().pool(pool, "cpu").buffer
    assert buffer is not None, pool
    return int(buffer.data_ptr())


def _builder(**attrs: Any) -> SimpleNamespace:
    """An object with the attributes vLLM's FlashInferMetadataBuilder._get_workspace_buffer reads."""
    base = {"_workspace_buffer": None, "device": torch.device("cpu"), "max_num_batched_tokens": 8}
    return SimpleNamespace(**{**base, "num_qo_heads": 8, "head_dim": 64, **attrs})


# -- without vLLM ------------------------------------------------------------


@pytest.mark.skipif(HAS_VLLM, reason="checks the behaviour where vLLM is not installed")
def test_register_without_vllm_warns_and_patches_nothing(warnings_seen: pytest.LogCaptureFixture) -> None:
    """Without vLLM, register() says in one warning that vLLM is not installed, patches nothing, raises nothing."""
    plugin.register()
    assert plugin.patched() == []
    (warning,) = {r.getMessage() for r in warnings_seen.records if r.levelno == logging.WARNING}
    assert warning == (
        "wspool: vLLM is not installed (wspool supports >=0.33.0,<0.35); nothing patched, vLLM's own workspaces "
        "stay in use"
    )


def test_disabled_by_environment_patches_nothing(
    monkeypatch: pytest.MonkeyPatch, warnings_seen: pytest.LogCaptureFixture
) -> None:
    """WSPOOL_VLLM=0 leaves everything as it is and says so."""
    monkeypatch.setenv("WSPOOL_VLLM", "0")
    plugin.register()
    assert plugin.patched() == []
    assert "WSPOOL_VLLM=0" in warnings_seen.text


def test_entry_point_is_declared() -> None:
    """pyproject.toml declares the vllm.general_plugins entry point wspool -> register."""
    text = (REPO_ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points."vllm.general_plugins"]\nwspool = "wspool.integrations.vllm:register"' in text


# -- with the real vLLM --------------------------------------------------------


def test_entry_point_is_installed(vllm: ModuleType) -> None:
    """The installed package registers the entry point vLLM looks up."""
    (found,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "wspool"]
    assert found.value == "wspool.integrations.vllm:register"


def test_vllm_is_a_version_the_plugin_knows(vllm: ModuleType) -> None:
    """The vLLM tested against is 0.33.0 or 0.34.0, with the FlashInfer its install gives."""
    import flashinfer

    assert vllm.__version__ in FLASHINFER_OF_VLLM, vllm.__version__
    assert flashinfer.__version__ in FLASHINFER_OF_VLLM[vllm.__version__]


def test_load_general_plugins_patches_each_function(loaded: None) -> None:
    """After vLLM loads its plugins, each workspace function vLLM's callers look up is wspool's."""
    mla, sparse, paged, workspace = _module(MLA), _module(SPARSE), _module(PAGED), _module(WORKSPACE)
    installed = plugin.INTEGRATION.getters  # the replacements the integration made when it activated
    assert mla._get_workspace_buffer is installed.get_mla_workspace_buffer
    assert mla._get_multi_ctas_kv_counter_buffer is installed.get_multi_ctas_kv_counter_buffer
    assert sparse._get_workspace_buffer is installed.get_sparse_workspace_buffer
    assert _module(SPARSE_SM120)._get_workspace_buffer is installed.get_sparse_workspace_buffer  # a by-name copy
    assert paged._get_multi_ctas_kv_counter_buffer is installed.get_paged_multi_ctas_kv_counter_buffer
    assert mla.FlashInferMLAImpl.forward_mqa.__wspool__
    assert paged.FlashInferMetadataBuilder._get_workspace_buffer.__module__ == plugin.__name__
    assert workspace.WorkspaceManager.lock.__module__ == plugin.__name__
    assert workspace.WorkspaceManager.unlock.__module__ == plugin.__name__
    assert sorted(plugin.patched()) == _present_targets()


def test_each_version_has_its_own_optional_targets(loaded: None) -> None:
    """vLLM 0.34's new paths are patched on 0.34, vLLM 0.33's old names on 0.33, and no target is missed."""
    patched = set(plugin.patched())
    new_in_034 = {f"{DRAFTER}.folded_decode", f"{DASH}._workspace", f"{DSV4}.get_flashinfer_dsv4_workspace"}
    only_033 = {f"{DSV4}._get_flashinfer_dsv4_workspace", f"{DSV41}._get_flashinfer_dsv4_workspace"}
    if VLLM_VERSION == "0.34.0":
        assert new_in_034 <= patched and not only_033 & patched
    else:
        assert only_033 <= patched and not new_in_034 & patched
    assert {t.name for t in plugin.TARGETS if not t.optional} <= patched


def test_loading_twice_is_harmless(loaded: None, load: Any) -> None:
    """A second load (vLLM's or a direct register()) patches nothing again and keeps the same functions."""
    mla = _module(MLA)
    forward = mla.FlashInferMLAImpl.forward_mqa
    load()
    plugin.register()
    assert mla.FlashInferMLAImpl.forward_mqa is forward and forward.__wrapped__.__module__ == MLA
    assert sorted(plugin.patched()) == _present_targets()


def test_unregister_restores_vllms_functions(load: Any) -> None:
    """unregister() puts vLLM's own functions back."""
    mla = _module(MLA)
    original = mla._get_workspace_buffer
    load()
    assert mla._get_workspace_buffer is not original
    plugin.unregister()
    assert mla._get_workspace_buffer is original and plugin.patched() == []


def test_mla_workspace_is_int8_sized_and_kept(loaded: None) -> None:
    """The MLA workspace is an int8 view: 128 MiB, then 256 MiB with the LSE, the same tensor while it suffices."""
    mla = _module(MLA)
    plain = mla._get_workspace_buffer(False)
    assert (plain.dtype, plain.numel(), plain.device.type) == (torch.int8, 128 * MiB, "cpu")
    assert mla._get_workspace_buffer(False) is plain
    lse = mla._get_workspace_buffer(True)
    assert (lse.dtype, lse.numel()) == (torch.int8, 256 * MiB) and int(lse.count_nonzero()) == 0
    assert mla._get_workspace_buffer(False) is lse
    stats = wspool.get_registry().stats("flashinfer_mla", "cpu")
    assert stats.grow_count == 2 and dict(stats.requests_by_rule) == {"default": 3, "lse": 1}


def test_counters_are_zeroed_once_and_persist(loaded: None) -> None:
    """The counter buffer is uint8, zero when allocated, and the same tensor (contents kept) on later calls."""
    mla = _module(MLA)
    counters = mla._get_multi_ctas_kv_counter_buffer(4096, torch.device("cpu"))
    assert (counters.dtype, counters.numel(), int(counters.count_nonzero())) == (torch.uint8, 4096, 0)
    counters[0] = 1  # a kernel's semaphore; the kernel resets it, wspool never does
    again = mla._get_multi_ctas_kv_counter_buffer(1024, torch.device("cpu"))
    assert again is counters and int(again[0]) == 1
    grown = mla._get_multi_ctas_kv_counter_buffer(8192, torch.device("cpu"))
    assert grown.numel() == 8192 and int(grown.count_nonzero()) == 0
    assert wspool.get_registry().buffer_pool("flashinfer_mla_counters") == "flashinfer_mla_counters"


def test_paged_counters_have_their_own_buffer(loaded: None) -> None:
    """The paged backend's counters are uint8, zeroed, persistent, and apart from the MLA counters."""
    paged, mla = _module(PAGED), _module(MLA)
    counters = paged._get_multi_ctas_kv_counter_buffer(2048, torch.device("cpu"))
    assert (counters.dtype, counters.numel(), int(counters.count_nonzero())) == (torch.uint8, 2048, 0)
    assert paged._get_multi_ctas_kv_counter_buffer(2048, torch.device("cpu")) is counters
    assert mla._get_multi_ctas_kv_counter_buffer(2048, torch.device("cpu")) is not counters


def test_no_module_keeps_a_stale_copy(load: Any) -> None:
    """After loading, no imported vLLM module holds vLLM's original of a replaced function, under any name."""
    originals = {}
    for target in plugin.TARGETS:
        if "." not in target.path and _present(target):  # methods are looked up on their class at each call
            originals[id(getattr(_module(target.module), target.path))] = target.name
    load()
    stale = [
        f"{name}.{attr}"
        for name, module in list(sys.modules.items())
        if name.startswith("vllm.") and module is not None
        for attr, value in list(vars(module).items())
        if id(value) in originals
    ]
    assert stale == [] and originals


def test_sparse_workspace_has_the_vllm_size_and_floor(loaded: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sparse MLA gets VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE as int8, grown to min_bytes where that is larger."""
    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(16 * MiB))
    wspool.reset_registry()
    sparse = _module(SPARSE)
    buffer = sparse._get_workspace_buffer(torch.device("cpu"))
    assert (buffer.dtype, buffer.numel()) == (torch.int8, 16 * MiB)
    assert sparse._get_workspace_buffer(torch.device("cpu"), 8 * MiB) is buffer
    floor = sparse._get_workspace_buffer(torch.device("cpu"), 24 * MiB)
    assert (floor.dtype, floor.numel()) == (torch.int8, 24 * MiB)
    assert sparse._get_workspace_buffer(torch.device("cpu")) is floor


def test_sparse_default_is_vllms(loaded: None) -> None:
    """Unset, the sparse workspace is vLLM's default of 394 MiB."""
    buffer = _module(SPARSE)._get_workspace_buffer(torch.device("cpu"))
    assert buffer.numel() == 394 * MiB


def test_paged_workspace_default_floor_and_cache(loaded: None) -> None:
    """The builder's workspace is uint8 at 394 MiB, at least vLLM's prefill floor, and kept on the builder."""
    builder_cls = _module(PAGED).FlashInferMetadataBuilder
    small = _builder()
    buffer = builder_cls._get_workspace_buffer(small)
    assert (buffer.dtype, buffer.numel()) == (torch.uint8, 394 * MiB)
    assert builder_cls._get_workspace_buffer(small) is buffer and small._workspace_buffer is buffer
    wide = _builder(max_num_batched_tokens=8192, num_qo_heads=32, head_dim=128)
    floor = 8192 * 32 * 128 * _module(PAGED).FLASHINFER_PREFILL_WORKSPACE_BYTES_PER_ELEM
    assert builder_cls._get_workspace_buffer(wide).numel() == floor


def test_paged_batch_invariant_is_two_gib(loaded: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With VLLM_BATCH_INVARIANT=1 the builder asks for rule vllm_batch_invariant: 2 GiB."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    meta = wspool.PoolRegistry(allocator=lambda n, d: torch.empty(n, dtype=torch.uint8, device="meta"))
    wspool.set_registry(meta)
    buffer = _module(PAGED).FlashInferMetadataBuilder._get_workspace_buffer(_builder())
    assert buffer.numel() == 2048 * MiB
    assert dict(meta.stats("flashinfer_mla", "cpu").requests_by_rule) == {"vllm_batch_invariant": 1}


@pytest.mark.parametrize(
    ("knob", "wspool_value", "expected"),
    [(None, None, 394 * MiB), (str(20 * MiB), None, 20 * MiB), (str(20 * MiB), "12MiB", 12 * MiB)],
)
def test_vllm_knob_and_wspool_variable(
    loaded: None, monkeypatch: pytest.MonkeyPatch, knob: str | None, wspool_value: str | None, expected: int
) -> None:
    """What vLLM sizes with VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE gets it unless WSPOOL_* for that key is set."""
    if knob is not None:
        monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", knob)
    if wspool_value is not None:
        monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER__RULES__VLLM", wspool_value)
        monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_MLA_SPARSE__RULES__DEFAULT", wspool_value)
    wspool.reset_registry()
    meta = wspool.PoolRegistry(allocator=lambda n, d: torch.empty(n, dtype=torch.uint8, device="meta"))
    wspool.set_registry(meta)
    assert _module(PAGED).FlashInferMetadataBuilder._get_workspace_buffer(_builder()).numel() == expected
    assert _module(SPARSE)._get_workspace_buffer(torch.device("cpu")).numel() == expected


def test_lock_workspace_freezes_wspool(loaded: None) -> None:
    """vLLM's lock_workspace() also freezes wspool (a growth is refused); unlock_workspace() unfreezes it."""
    workspace = _module(WORKSPACE)
    mla = _module(MLA)
    workspace.init_workspace_manager(torch.device("cpu"))
    mla._get_workspace_buffer(False)
    workspace.lock_workspace()
    assert workspace.current_workspace_manager().is_locked() and wspool.get_registry().is_frozen
    assert mla._get_workspace_buffer(False).numel() == 128 * MiB  # what fits is still served
    with pytest.raises(WorkspaceFrozenError, match="would have to grow while the registry is frozen"):
        mla._get_workspace_buffer(True)
    workspace.unlock_workspace()
    assert not workspace.current_workspace_manager().is_locked() and not wspool.get_registry().is_frozen
    assert mla._get_workspace_buffer(True).numel() == 256 * MiB


def test_vllm_lanes_map_to_wspool_lanes(loaded: None) -> None:
    """A buffer asked for in vLLM's workspace lane 1 is separate from lane 0's, in wspool lane vllm-u0-l1."""
    workspace = _module(WORKSPACE)
    counters = _module(MLA)._get_multi_ctas_kv_counter_buffer
    main = counters(64, torch.device("cpu"))
    with workspace.use_workspace_lane(1):
        other = counters(64, torch.device("cpu"))
        assert counters(64, torch.device("cpu")) is other
    assert other is not main
    lanes = {s.lane for s in wspool.get_registry().all_stats()}
    assert lanes == {"main", "vllm-u0-l1"}


def test_wspools_lane_follows_vllms_workspace_lane(loaded: None) -> None:
    """Inside vLLM's lane 1 wspool's lane is vllm-u0-l1; inside lane 0 within it, the lane outside them all."""
    workspace = _module(WORKSPACE)
    counters = _module(MLA)._get_multi_ctas_kv_counter_buffer
    mla = _module(MLA)._get_workspace_buffer
    main, main_mla = counters(64, torch.device("cpu")), mla(False)
    with wspool.lane("mine"), workspace.use_workspace_lane(1):
        assert wspool.current_lane() == "vllm-u0-l1" and workspace._workspace_lane.get() == 1
        assert counters(64, torch.device("cpu")) is not main
        with workspace.use_workspace_lane(0):
            assert wspool.current_lane() == "mine" and workspace._workspace_lane.get() == 0
        assert wspool.current_lane() == "vllm-u0-l1"
    with workspace.use_workspace_lane(1), workspace.use_workspace_lane(0):
        assert wspool.current_lane() == "main"
        assert counters(64, torch.device("cpu")) is main and mla(False) is main_mla  # the steady state again
    assert wspool.current_lane() == "main" and workspace._workspace_lane.get() == 0


def test_only_use_workspace_lane_sets_vllms_lane(vllm: ModuleType) -> None:
    """wspool's lane follows vLLM's through use_workspace_lane: no other code of vLLM may set the lane."""
    package = Path(vllm.__file__).parent
    setters = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if "_workspace_lane.set(" in path.read_text(encoding="utf-8", errors="replace")
    )
    assert setters == ["v1/worker/workspace.py"], f"vLLM sets its workspace lane elsewhere too: {setters}"
    source = inspect.getsource(inspect.unwrap(_module(WORKSPACE).use_workspace_lane))
    assert "_workspace_lane.set(" in source


def _fake_mla_call(
    mla: Any, monkeypatch: pytest.MonkeyPatch, dcp: int, heads_per_rank: int, query_lens: tuple[int, ...] = (1, 1, 1, 1)
) -> dict[str, Any]:
    """Run vLLM's real FlashInferMLAImpl.forward_mqa with the kernel replaced by a recorder (no GPU here).

    ``query_lens``: each decode request's query tokens (1 + its drafts); uneven lengths make a ragged batch.
    """
    seen: dict[str, Any] = {}
    requests, tokens, dim = len(query_lens), sum(query_lens), 8

    def kernel(**kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        seen.update(kwargs)
        q = kwargs["query"]
        return torch.zeros(*q.shape[:-1], 4), torch.zeros(*q.shape[:-1])

    monkeypatch.setattr(mla, "trtllm_batch_decode_with_kv_cache_mla", kernel)
    impl = SimpleNamespace(
        bmm1_scale=1.0,
        bmm2_scale=1.0,
        need_to_return_lse_for_decode=True,
        dcp_world_size=dcp,
        dcp_rank=0,
        qk_nope_head_dim=4,
        kv_lora_rank=4,
        qk_rope_head_dim=4,
        kv_cache_dtype="auto",
    )
    # vLLM's own row split, bound to the stand-in (0.34's ragged DCP branch calls it).
    impl._flattened_decode_metadata = MethodType(mla.FlashInferMLAImpl._flattened_decode_metadata, impl)
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    decode = SimpleNamespace(
        block_table=torch.zeros(requests, 1, dtype=torch.int32),
        seq_lens=torch.full((requests,), 8, dtype=torch.int32),
        max_query_len=max(query_lens),
        dcp_tot_seq_lens=torch.full((requests,), 32, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        query_len=0,
        flattened_block_table=None,
        flattened_seq_lens=None,
        flattened_row_req=None,
    )
    metadata = SimpleNamespace(
        decode=decode, causal=True, num_decode_tokens=tokens, num_decodes=requests, max_seq_len=8
    )
    q = torch.zeros(tokens, heads_per_rank * dcp, dim)  # after DCP's query gather
    kv = torch.zeros(2, 16, dim)  # page size 16: the counters are not asked for
    mla.FlashInferMLAImpl.forward_mqa(impl, q, kv, metadata, SimpleNamespace())
    return seen


def _dcp_vllm_config(max_num_seqs: int, speculative_tokens: int) -> Any:
    """vLLM's own VllmConfig with DCP 4 (TP 4), 8192 batched tokens and ``speculative_tokens`` drafts per step.

    The speculative config is set as an object with vLLM's attribute: vLLM's own needs a draft model to build.
    """
    from vllm.config import DeviceConfig, ParallelConfig, SchedulerConfig, VllmConfig

    config = VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=4),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, max_model_len=8192, is_encoder_decoder=False
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    if speculative_tokens:
        object.__setattr__(config, "speculative_config", SimpleNamespace(num_speculative_tokens=speculative_tokens))
    return config


def test_dcp_config_gives_the_dcp_rules_size(loaded: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With kimi_dcp.yaml and a vLLM config of DCP 4, forward_mqa's workspace follows the DCP rule."""
    from vllm.config import set_current_vllm_config

    monkeypatch.setenv("WSPOOL_CONFIG", str(REPO_ROOT / "configs" / "kimi_dcp.yaml"))
    wspool.reset_registry()
    mla = _module(MLA)
    with set_current_vllm_config(_dcp_vllm_config(max_num_seqs=256, speculative_tokens=0)):
        seen = _fake_mla_call(mla, monkeypatch, dcp=4, heads_per_rank=8)
    rule = 8 * 8 * 4 * 256 * 256 + MiB + 32 * MiB  # 8 * num_heads * cp_world * batch * round_up(q_len, 256) + ...
    workspace = seen["workspace_buffer"]
    assert workspace.dtype == torch.int8 and workspace.numel() >= rule and seen["cp_world"] == 4
    assert wspool.get_registry().stats("flashinfer_mla", "cpu").peak_request_bytes == rule


def test_ragged_causal_dcp_decode_is_sized_per_token(
    vllm034: ModuleType, load: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.34 splits a causal DCP batch of uneven drafts into single-token rows; the LSE rule follows.

    DCP 4 with 8 heads per rank, 256 sequences, 3 speculative tokens, 8192 batched tokens. Two
    requests with 4 and 2 query tokens reach the kernel as 6 rows of 1 token. The rows can be
    min(256 * (1 + 3), 8192) = 1024, so the rule sizes 8 * 8 * 4 * 1024 * 256 B + 33 MiB = 97 MiB;
    the configuration's 256 request rows give 49 MiB, a softmax slab of 16 MiB: 4 times too small.
    """
    from vllm.config import set_current_vllm_config

    monkeypatch.setenv("WSPOOL_CONFIG", str(REPO_ROOT / "configs" / "kimi_dcp.yaml"))
    load()
    with set_current_vllm_config(_dcp_vllm_config(max_num_seqs=256, speculative_tokens=3)):
        uniform = _fake_mla_call(_module(MLA), monkeypatch, dcp=4, heads_per_rank=8, query_lens=(4, 4))
        stats = wspool.get_registry().stats("flashinfer_mla", "cpu")
        assert tuple(uniform["query"].shape) == (2, 4, 32, 8) and stats.peak_request_bytes == 49 * MiB
        ragged = _fake_mla_call(_module(MLA), monkeypatch, dcp=4, heads_per_rank=8, query_lens=(4, 2))
    assert tuple(ragged["query"].shape) == (6, 1, 32, 8)  # vLLM's own split: a row per token
    stats = wspool.get_registry().stats("flashinfer_mla", "cpu")
    assert stats.peak_request_bytes == 8 * 8 * 4 * 1024 * 256 + 33 * MiB == 97 * MiB
    assert ragged["workspace_buffer"].numel() >= 97 * MiB and ragged["workspace_buffer"].dtype == torch.int8


def test_dcp_rule_without_its_facts_is_a_clear_error(
    loaded: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Called outside a vLLM config and call site, the DCP rule names the facts it lacks."""
    # cp_world and q_len still come from the flashinfer_mla pool's built-in default facts.
    use_lse_rule_without_facts(monkeypatch, tmp_path)
    with pytest.raises(
        RuleError,
        match=r"needs fact\(s\) batch_size, num_heads .*plugin passes the facts it knows: none",
    ):
        _module(MLA)._get_workspace_buffer(True)


def test_not_in_vllm_plugins_patches_nothing(load: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A VLLM_PLUGINS allowlist without wspool leaves vLLM's functions alone."""
    mla = _module(MLA)
    original = mla._get_workspace_buffer
    monkeypatch.setenv("VLLM_PLUGINS", "someone_else")
    load()
    assert mla._get_workspace_buffer is original and plugin.patched() == []


def test_wspool_vllm_zero_patches_nothing(load: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """WSPOOL_VLLM=0, with vLLM loading the plugin, keeps every vLLM function."""
    mla, workspace = _module(MLA), _module(WORKSPACE)
    before = (mla._get_workspace_buffer, workspace.WorkspaceManager.lock)
    monkeypatch.setenv("WSPOOL_VLLM", "0")
    load()
    assert (mla._get_workspace_buffer, workspace.WorkspaceManager.lock) == before and plugin.patched() == []


def test_missing_or_changed_function_is_a_warning(
    load: Any, monkeypatch: pytest.MonkeyPatch, warnings_seen: pytest.LogCaptureFixture
) -> None:
    """A missing function and one with other parameters keep vLLM's behaviour for their groups, in one warning."""
    mla, sparse = _module(MLA), _module(SPARSE)
    monkeypatch.delattr(mla, "_get_multi_ctas_kv_counter_buffer")

    def changed(device: torch.device) -> torch.Tensor:
        return torch.zeros(1)

    monkeypatch.setattr(sparse, "_get_workspace_buffer", changed)
    load()
    assert sparse._get_workspace_buffer is changed
    # The by-name copy belongs to the same group: it keeps vLLM's function too.
    assert _module(SPARSE_SM120)._get_workspace_buffer is not plugin.INTEGRATION.getters.get_sparse_workspace_buffer
    assert mla._get_workspace_buffer is plugin.INTEGRATION.getters.get_mla_workspace_buffer
    (warning,) = {r.getMessage() for r in warnings_seen.records if r.levelno == logging.WARNING}
    assert f"trtllm-gen's MLA counters ({MLA}._get_multi_ctas_kv_counter_buffer is missing)" in warning
    assert f"{SPARSE}._get_workspace_buffer takes (device), not (device, min_bytes)" in warning
    assert "vLLM's own behaviour stays" in warning
    assert "patched" in warnings_seen.text and "pool flashinfer_mla (int8)" in warnings_seen.text


def test_lock_and_unlock_are_patched_together(
    load: Any, monkeypatch: pytest.MonkeyPatch, warnings_seen: pytest.LogCaptureFixture
) -> None:
    """An unlock the plugin cannot patch leaves the lock unpatched too: vLLM's unlock never leaves wspool frozen."""
    workspace = _module(WORKSPACE)
    vllms_lock = workspace.WorkspaceManager.__dict__["lock"]

    def unlock(self: Any, reason: str = "") -> None:  # another signature, as a later vLLM might have
        self._locked = False

    monkeypatch.setattr(workspace.WorkspaceManager, "unlock", unlock)
    load()
    assert workspace.WorkspaceManager.__dict__["lock"] is vllms_lock
    workspace.init_workspace_manager(torch.device("cpu"))
    workspace.lock_workspace()
    workspace.unlock_workspace()
    assert not wspool.get_registry().is_frozen
    assert _module(MLA)._get_multi_ctas_kv_counter_buffer(4096, torch.device("cpu")).numel() == 4096  # grows
    assert "vLLM's workspace lock (vllm.v1.worker.workspace.WorkspaceManager.unlock takes (self, reason)" in (
        warnings_seen.text
    )


def test_an_exception_while_registering_undoes_every_patch(
    load: Any, monkeypatch: pytest.MonkeyPatch, warnings_seen: pytest.LogCaptureFixture
) -> None:
    """A target that cannot be set after others were undoes them all, and the log says nothing stayed patched."""
    mla, paged = _module(MLA), _module(PAGED)
    originals = (mla._get_workspace_buffer, mla.FlashInferMLAImpl.__dict__["forward_mqa"])

    class ReadOnlyCounters(ModuleType):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "_get_multi_ctas_kv_counter_buffer":
                raise AttributeError(f"{name} is read-only here")
            super().__setattr__(name, value)

    monkeypatch.setattr(paged, "__class__", ReadOnlyCounters)
    load()
    assert plugin.patched() == []
    assert (mla._get_workspace_buffer, mla.FlashInferMLAImpl.__dict__["forward_mqa"]) == originals
    assert paged.FlashInferMetadataBuilder._get_workspace_buffer.__module__ == PAGED
    (error,) = {r.getMessage() for r in warnings_seen.records if r.levelno >= logging.ERROR}
    assert "failed to load and patched nothing; vLLM's own workspaces stay in use" in error
    assert "is read-only here" in warnings_seen.text  # the traceback of the cause
    assert "vLLM plugin loaded" not in warnings_seen.text


def test_a_patch_that_cannot_be_undone_is_reported(
    load: Any, monkeypatch: pytest.MonkeyPatch, warnings_seen: pytest.LogCaptureFixture
) -> None:
    """Where undoing fails too, the error names what stays wspool's, and patched() lists it."""
    mla, paged = _module(MLA), _module(PAGED)
    refusals = [1]

    class ReadOnlyCounters(ModuleType):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "_get_multi_ctas_kv_counter_buffer":
                raise AttributeError(f"{name} is read-only here")
            super().__setattr__(name, value)

    class StickyWorkspace(ModuleType):
        def __setattr__(self, name: str, value: Any) -> None:
            if (
                name == "_get_workspace_buffer"
                and value is not plugin.INTEGRATION.getters.get_mla_workspace_buffer
                and refusals
            ):
                refusals.pop()  # refuses the first undo only, so the test's teardown can restore it
                raise AttributeError("cannot restore")
            super().__setattr__(name, value)

    monkeypatch.setattr(paged, "__class__", ReadOnlyCounters)
    monkeypatch.setattr(mla, "__class__", StickyWorkspace)
    load()
    assert plugin.patched() == [f"{MLA}._get_workspace_buffer"]
    assert mla._get_workspace_buffer is plugin.INTEGRATION.getters.get_mla_workspace_buffer
    assert mla.FlashInferMLAImpl.forward_mqa.__module__ == MLA  # undone
    (error,) = {r.getMessage() for r in warnings_seen.records if r.levelno >= logging.ERROR}
    assert f"undoing its patches failed for {MLA}._get_workspace_buffer (AttributeError: cannot restore)" in error
    assert "which stay wspool's" in error and "every other patch was undone" in error


def test_an_optional_target_of_another_shape_leaves_its_group_alone(
    load: Any, monkeypatch: pytest.MonkeyPatch, warnings_seen: pytest.LogCaptureFixture
) -> None:
    """A Kimi K3 drafter whose folded_decode differs keeps the whole MLA group vLLM's: never half-patched.

    Patching the MLA workspace without the drafter's wrapper would size the drafter's folded
    kernel from the configuration alone, possibly too small; vLLM's fixed buffer is kept instead.
    """
    mla = _module(MLA)
    original = mla._get_workspace_buffer
    drafter = ModuleType(DRAFTER)

    def folded_decode(q: Any, workspace: Any) -> None:
        return None

    drafter.folded_decode = folded_decode  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, DRAFTER, drafter)
    load()
    assert mla._get_workspace_buffer is original and mla.FlashInferMLAImpl.forward_mqa.__module__ == MLA
    assert (
        mla._get_multi_ctas_kv_counter_buffer is plugin.INTEGRATION.getters.get_multi_ctas_kv_counter_buffer
    )  # another group
    assert f"the MLA decode workspace ({DRAFTER}.folded_decode takes (q, workspace)" in warnings_seen.text


def test_kimi_k3_draft_decode_gets_a_pool_buffer_for_its_folded_query(
    vllm034: ModuleType, load: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kimi K3's folded drafter (a forward_mqa override) under DCP gets the pool's workspace, sized for its fold.

    DCP 4, 8 heads per rank (32 after the gather), 64 sequences, 3 speculative tokens, 4-token
    draft blocks: vLLM folds the 4 tokens of a request into 128 heads, so the kernel sees at
    most min(64 * 4, 8192) / 4 = 64 rows of 128 heads: 8 * 128 * 64 * 256 B + 33 MiB = 49 MiB.
    """
    import flashinfer.decode
    from vllm.config import set_current_vllm_config
    from vllm.models.kimi_k3.nvidia.specialized_decode.drafter import attention as drafter
    from vllm.models.kimi_k3.nvidia.specialized_decode.drafter.model import _folded_impl

    monkeypatch.setenv("WSPOOL_CONFIG", str(REPO_ROOT / "configs" / "kimi_dcp.yaml"))
    load()
    mla = _module(MLA)
    seen: dict[str, Any] = {}

    def kernel(**kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        seen.update(kwargs)
        rows, _, heads, _ = kwargs["query"].shape
        return torch.zeros(rows, 1, heads, 512), torch.zeros(rows, heads)

    monkeypatch.setattr(flashinfer.decode, "trtllm_batch_decode_with_kv_cache_mla", kernel)
    monkeypatch.setattr(drafter, "balanced_tiers", lambda device, rows: ())  # it reads the GPU's SM count
    impl = object.__new__(_folded_impl(mla.FlashInferMLAImpl))
    vars(impl).update(
        bmm1_scale=1.0, bmm2_scale=1.0, need_to_return_lse_for_decode=True, dcp_world_size=4, dcp_rank=0,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, kv_cache_dtype="auto", _mla_counter_max_batch=64,
    )  # fmt: skip
    requests, k = 3, 4
    decode = SimpleNamespace(
        block_table=torch.zeros(requests, 1, dtype=torch.int32),
        seq_lens=torch.full((requests,), 8, dtype=torch.int32),
        dcp_tot_seq_lens=torch.full((requests,), 32, dtype=torch.int32),
        max_query_len=k,
    )
    metadata = SimpleNamespace(
        decode=decode, causal=False, num_decodes=requests, num_decode_tokens=requests * k, max_seq_len=8
    )
    q = torch.zeros(requests * k, 32, 576)
    with set_current_vllm_config(_dcp_vllm_config(max_num_seqs=64, speculative_tokens=3)):
        out, lse = impl.forward_mqa(q, torch.zeros(2, 64, 576), metadata, SimpleNamespace())
    assert tuple(seen["query"].shape) == (3, 1, 128, 576) and seen["backend"] == "cute-dsl"  # vLLM's fold
    assert (tuple(out.shape), tuple(lse.shape)) == ((12, 32, 512), (12, 32))
    workspace = seen["workspace_buffer"]
    assert workspace.dtype == torch.int8 and workspace.data_ptr() == _pool_ptr("flashinfer_mla")
    stats = wspool.get_registry().stats("flashinfer_mla", "cpu")
    assert stats.peak_request_bytes == 8 * 128 * 64 * 256 + 33 * MiB == 49 * MiB
    assert workspace.numel() >= stats.peak_request_bytes
    assert drafter.folded_decode.__wspool__


_SMALL_RULES = {
    "WSPOOL_POOLS__FLASHINFER_MLA__RULES__DEFAULT": "1MiB",
    "WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE": "2MiB",
    "WSPOOL_POOLS__FLASHINFER_MLA_SPARSE__RULES__DEFAULT": "3MiB",
    "WSPOOL_POOLS__FLASHINFER__RULES__VLLM": "4MiB",
    "WSPOOL_POOLS__FLASHINFER_DSV4__RULES__DEFAULT": "5MiB",
    "WSPOOL_POOLS__FLASHINFER_DASH__RULES__DEFAULT": "6MiB",
}


@pytest.fixture
def small_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small sizes for every pool the plugin fills (the real ones are hundreds of MiB on the CPU)."""
    for name, value in _SMALL_RULES.items():
        monkeypatch.setenv(name, value)
    wspool.reset_registry()


def test_vllm_034_workspaces_come_from_pools(vllm034: ModuleType, small_pools: None, load: Any) -> None:
    """After vLLM 0.34's own plugin loader runs, every FlashInfer workspace it hands out is a pool's buffer.

    Both MLA buffers (workspace and counters), the sparse MLA workspace (and its by-name copy), the
    FlashInfer attention builder's, every binding of get_flashinfer_dsv4_workspace (and the SM120
    attention's _get_workspace, which calls it), and DASH attention's.
    """
    load()
    cpu = torch.device("cpu")
    mla, sparse, paged = _module(MLA), _module(SPARSE), _module(PAGED)
    lse = mla._get_workspace_buffer(True)
    assert (lse.dtype, lse.data_ptr()) == (torch.int8, _pool_ptr("flashinfer_mla"))
    counters = mla._get_multi_ctas_kv_counter_buffer(4096, cpu)
    assert counters.data_ptr() == _pool_ptr("flashinfer_mla_counters")
    for module in (sparse, _module(SPARSE_SM120)):
        buffer = module._get_workspace_buffer(cpu)
        assert (buffer.dtype, buffer.data_ptr()) == (torch.int8, _pool_ptr("flashinfer_mla_sparse"))
    builder = paged.FlashInferMetadataBuilder._get_workspace_buffer(_builder())
    assert (builder.dtype, builder.data_ptr()) == (torch.uint8, _pool_ptr("flashinfer"))
    bindings = [_module(name).get_flashinfer_dsv4_workspace for name in (DSV4, DSV41, DSV41_SPARSE)]
    assert all(binding is plugin.INTEGRATION.getters.get_dsv4_workspace for binding in bindings)
    dsv4 = bindings[0](cpu)
    assert (dsv4.dtype, dsv4.numel(), dsv4.data_ptr()) == (torch.uint8, 5 * MiB, _pool_ptr("flashinfer_dsv4"))
    assert all(binding(cpu) is dsv4 for binding in bindings)
    assert _module(DSV4).DeepseekV4FlashInferSM120Attention._get_workspace(cpu) is dsv4
    dash = _module(DASH)._workspace(cpu)
    assert (dash.dtype, dash.numel(), dash.data_ptr()) == (torch.uint8, 6 * MiB, _pool_ptr("flashinfer_dash"))
    assert wspool.get_registry().buffer_pool("flashinfer_dsv4") == "flashinfer_dsv4"


def test_vllm_033_dsv4_workspaces_come_from_one_pool(vllm033: ModuleType, small_pools: None, load: Any) -> None:
    """vLLM 0.33's two private DeepSeek V4 workspace functions and their by-name copy all draw from flashinfer_dsv4."""
    load()
    cpu = torch.device("cpu")
    bindings = [_module(name)._get_flashinfer_dsv4_workspace for name in (DSV4, DSV41, DSV41_SPARSE)]
    assert all(binding is plugin.INTEGRATION.getters.get_dsv4_workspace for binding in bindings)
    assert {binding(cpu).data_ptr() for binding in bindings} == {_pool_ptr("flashinfer_dsv4")}


def test_get_retained_composes_with_the_lock(vllm034: ModuleType, small_pools: None, loaded: None) -> None:
    """vLLM 0.34's tail span keeps its semantics under the patched lock, and the lock still freezes wspool."""
    workspace = _module(WORKSPACE)
    workspace.init_workspace_manager(torch.device("cpu"))
    manager = workspace.current_workspace_manager()
    mla = _module(MLA)
    mla._get_workspace_buffer(False)
    span, intact = manager.get_retained("mine", (1024,), torch.uint8)
    assert not intact
    workspace.lock_workspace()
    assert manager.is_locked() and wspool.get_registry().is_frozen
    again, intact = manager.get_retained("mine", (1024,), torch.uint8)
    assert intact and again.data_ptr() == span.data_ptr()  # the same span, its contents kept
    with pytest.raises(AssertionError, match="Workspace growth is not allowed after locking"):
        manager.get_retained("mine", (1 << 20,), torch.uint8)
    with pytest.raises(WorkspaceFrozenError):
        mla._get_workspace_buffer(True)  # wspool refuses to grow under vLLM's lock as well
    assert manager.is_locked() and wspool.get_registry().is_frozen  # a refused growth unlocks neither
    workspace.unlock_workspace()
    assert not manager.is_locked() and not wspool.get_registry().is_frozen
    grown, intact = manager.get_retained("mine", (1 << 20,), torch.uint8)
    assert grown.numel() == 1 << 20 and not intact
    assert mla._get_workspace_buffer(True).numel() == 2 * MiB


# -- the seam: switch, configuration and rollback, as every engine has them ---------------------


@pytest.mark.parametrize("value", ["disabled", "2", "enable"])
def test_an_unknown_switch_patches_nothing_and_names_the_variable(
    load: Any, monkeypatch: pytest.MonkeyPatch, warnings_seen: pytest.LogCaptureFixture, value: str
) -> None:
    """A WSPOOL_VLLM value that is neither on nor off is one error naming the variable; vLLM stays untouched."""
    mla, workspace = _module(MLA), _module(WORKSPACE)
    before = (mla._get_workspace_buffer, workspace.WorkspaceManager.lock)
    monkeypatch.setenv("WSPOOL_VLLM", value)
    load()
    assert (mla._get_workspace_buffer, workspace.WorkspaceManager.lock) == before and plugin.patched() == []
    errors = {r.getMessage() for r in warnings_seen.records if r.levelno >= logging.ERROR}
    assert errors == {
        f"wspool: vLLM: nothing patched, vLLM's own workspaces stay in use: invalid environment variable "
        f"WSPOOL_VLLM = {value!r}: expected 1 or 0 (true/false, on/off, yes/no); unset it to keep wspool on"
    }


def _load_refused_in_one_error_line(load: Any, warnings_seen: pytest.LogCaptureFixture) -> str:
    """Load the plugin, check vLLM's getter and lock are still its own, and return the one error line logged."""
    mla, workspace = _module(MLA), _module(WORKSPACE)
    before = (mla._get_workspace_buffer, workspace.WorkspaceManager.lock)
    load()
    assert (mla._get_workspace_buffer, workspace.WorkspaceManager.lock) == before and plugin.patched() == []
    (error,) = {r.getMessage() for r in warnings_seen.records if r.levelno >= logging.ERROR}
    return error


def test_a_broken_configuration_patches_nothing_and_says_why_in_one_line(
    load: Any, monkeypatch: pytest.MonkeyPatch, warnings_seen: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """An invalid WSPOOL_CONFIG is read at load: one error line, nothing patched, vLLM's lock still vLLM's."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("pools:\n  flashinfer_mla:\n    rules:\n      lse: 12 parsecs\n")
    monkeypatch.setenv("WSPOOL_CONFIG", str(broken))
    wspool.reset_registry()
    error = _load_refused_in_one_error_line(load, warnings_seen)
    assert "\n" not in error and "pools.flashinfer_mla.rules.lse" in error
    assert "targets patched" not in warnings_seen.text


def test_a_cap_that_a_declared_rule_can_never_fit_patches_nothing_and_says_why_in_one_line(
    load: Any, monkeypatch: pytest.MonkeyPatch, warnings_seen: pytest.LogCaptureFixture
) -> None:
    """A flashinfer_mla cap below the plugin's 394MiB rule on that shared buffer: one error line, nothing patched."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_MLA__MAX_BYTES", "256MiB")
    wspool.reset_registry()
    error = _load_refused_in_one_error_line(load, warnings_seen)
    assert "\n" not in error and "nothing patched" in error
    assert "pools.flashinfer.rules.vllm" in error and "WSPOOL_POOLS__FLASHINFER_MLA__MAX_BYTES" in error


def test_the_third_of_three_targets_failing_restores_the_first_two(
    load: Any, monkeypatch: pytest.MonkeyPatch, warnings_seen: pytest.LogCaptureFixture
) -> None:
    """A group of three whose third replacement raises: the first two are vLLM's own again."""
    from wspool.targets import TargetGroup

    def explode(original: Any) -> Any:
        raise RuntimeError("cannot wrap the third")

    mla = _module(MLA)
    first, second = plugin.GROUPS[0].targets[:2]  # the MLA workspace and forward_mqa
    third = plugin.GROUPS[1].targets[0]  # the counters
    broken = Target(third.module, third.path, third.parameters, explode, "explodes")
    monkeypatch.setattr(plugin, "GROUPS", (TargetGroup("three", (first, second, broken)),))
    before = (mla._get_workspace_buffer, mla.FlashInferMLAImpl.__dict__["forward_mqa"])
    load()
    assert plugin.patched() == []
    assert (mla._get_workspace_buffer, mla.FlashInferMLAImpl.__dict__["forward_mqa"]) == before
    assert "RuntimeError: cannot wrap the third" in warnings_seen.text


def test_the_load_line_is_one_short_line(load: Any, warnings_seen: pytest.LogCaptureFixture) -> None:
    """Loading says one line at info level (details at debug): the version, the count, the configuration."""
    load()
    (line,) = {r.getMessage() for r in warnings_seen.records if r.levelno == logging.INFO}
    assert len(line) < 120
    assert line == (
        f"wspool: vLLM {VLLM_VERSION}: {len(plugin.patched())} targets patched; config: built-in defaults; profile auto"
    )


def test_the_engine_path_times_vllms_getters_against_vllms_own(vllm: ModuleType, monkeypatch: Any) -> None:
    """wspool bench's engine path times the MLA, counter and wrapper probes in the real vLLM, each a ratio."""
    from wspool.tools.engine_path import measure_engine_path

    monkeypatch.setenv("WSPOOL_VLLM_DEVICE", "cpu")
    try:
        found = measure_engine_path(rounds=1, batch=50)["vLLM"]
    finally:
        plugin.unregister()
    calls = [row["call"] for row in found["rows"]]
    assert found["version"] == VLLM_VERSION and calls[:3] == [
        "MLA workspace (LSE)", "MLA workspace", "MLA multi-CTA counters"
    ]  # fmt: skip
    assert "forward_mqa wrapper (added)" in calls
    assert all(row["own_ns"] > 0 and row["wspool_ns"] > 0 for row in found["rows"])
