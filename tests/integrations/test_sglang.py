"""Tests for wspool.integrations.sglang against the real SGLang 0.5.23, loaded through SGLang's own plugin loader.

Every test here needs SGLang and skips, with the reason, where it is not
installed (docs/sglang.md's recipe builds ``.venv-sglang``); run them with

    .venv-sglang/bin/python -m pytest -q tests/integrations/test_sglang.py

``WSPOOL_SGLANG_DEVICE=cpu`` points every pool buffer at the CPU, so SGLang's
own factories (which name ``"cuda"``) and code run on a machine without a GPU.
The integration's logic without SGLang is tested in ``test_sglang_serving.py``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from importlib.metadata import entry_points
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import wspool
from tests.helpers.sglang_model import publish_tiny_llama
from wspool.errors import WorkspaceFrozenError, WspoolError
from wspool.integrations import sglang as sg
from wspool.targets import Target, TargetGroup

MiB = 1 << 20
CPU = torch.device("cpu")
VERSION = "0.5.23"
SGLANG_MISSING = "SGLang is not installed here; docs/sglang.md's recipe installs sglang==0.5.23 in .venv-sglang"


class SGLang(SimpleNamespace):
    """The real SGLang modules the tests call."""


@pytest.fixture(scope="module")
def srt() -> SGLang:
    """SGLang's modules; skips where SGLang is not installed, or is not the version the integration targets."""
    sglang = pytest.importorskip("sglang", reason=SGLANG_MISSING)
    if sglang.__version__ != VERSION:
        pytest.skip(f"the integration targets SGLang {VERSION}; this environment has {sglang.__version__}")
    names = {
        "plugins": "sglang.srt.plugins",
        "rc": "sglang.srt.runtime_context",
        "envs": "sglang.srt.environ",
        "paged": "sglang.srt.layers.attention.flashinfer_backend",
        "mla": "sglang.srt.layers.attention.flashinfer_mla_backend",
        "trtllm_mla": "sglang.srt.layers.attention.trtllm_mla_backend",
        "trtllm_mha": "sglang.srt.layers.attention.trtllm_mha_backend",
        "dsv4": "sglang.srt.layers.attention.deepseek_v4_trtllm_backend",
        "decode_runner": "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
        "prefill_runner": "sglang.srt.model_executor.runner.prefill_cuda_graph_runner",
    }
    return SGLang(**{key: importlib.import_module(module) for key, module in names.items()})


def _originals(srt: SGLang) -> dict[str, Any]:
    """The attribute each target names, as it is now."""
    found = {}
    for target in sg.TARGETS:
        class_name, attr = target.path.split(".")
        found[target.name] = vars(getattr(importlib.import_module(target.module), class_name))[attr]
    return found


@pytest.fixture
def load(srt: SGLang, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Iterator[Any]:
    """SGLang's own load_plugins(), callable again per test, with fresh SGLang resources and nothing left patched."""
    monkeypatch.setenv("WSPOOL_SGLANG_DEVICE", "cpu")
    monkeypatch.setenv("SGLANG_PLUGINS", "wspool")
    monkeypatch.setattr(srt.rc.get_context(), "resources", srt.rc.Resources())
    caplog.set_level(logging.INFO, logger=srt.plugins.logger.name)
    caplog.set_level(logging.DEBUG, logger=sg.logger.name)

    def load_plugins() -> None:
        monkeypatch.setattr(srt.plugins, "_plugins_loaded", False)
        srt.plugins.load_plugins()

    yield load_plugins
    sg.unregister()


@pytest.fixture
def loaded(load: Any) -> None:
    """The integration, loaded by SGLang."""
    load()
    assert sg.patched(), "the integration did not load"


def _workspace_factory(srt: SGLang, name: str, made: list[str]) -> Any:
    """SGLang 0.5.23's factory for ``name``, as its backend writes it (device "cuda", as on a GPU)."""
    size = srt.envs.envs.SGLANG_FLASHINFER_WORKSPACE_SIZE.get
    mha = srt.trtllm_mha
    makers = {
        "flashinfer_workspace": lambda: torch.empty(size(), dtype=torch.uint8, device="cuda"),
        "flashinfer_mla_workspace": lambda: torch.empty(size(), dtype=torch.uint8, device="cuda"),
        "trtllm_mla_zero_workspace": lambda: torch.zeros(
            srt.trtllm_mla.DEFAULT_WORKSPACE_SIZE_MB * MiB, dtype=torch.int8, device="cuda"
        ),
        "trtllm_mha_zero_workspace": lambda: torch.zeros(
            mha._XQA_SEMAPHORE_BYTES + size(), dtype=torch.uint8, device="cuda"
        ),
        "dsa_flashinfer_sparse_mla_workspace": lambda: torch.zeros(size(), dtype=torch.uint8, device="cuda"),
        "dsa_trtllm_workspace": lambda: torch.empty(size() * 2, dtype=torch.uint8, device="cuda"),
    }

    def factory() -> torch.Tensor:
        tensor = makers[name]()
        made.append(type(tensor).__name__)
        return tensor

    return factory


def test_sglang_finds_the_entry_point_and_patches_every_target(srt: SGLang, load: Any, caplog: Any) -> None:
    """SGLang's load_plugins() runs wspool's entry point, which wraps each target around SGLang's own."""
    assert any(ep.name == "wspool" and ep.value == "wspool.integrations.sglang:register"
               for ep in entry_points(group="sglang.srt.plugins"))  # fmt: skip
    before = _originals(srt)
    load()
    assert sg.patched() == [t.name for t in sg.TARGETS]
    for name, wrapper in _originals(srt).items():
        assert wrapper is not before[name] and wrapper.__wrapped__ is before[name], name
    assert "Executed general plugin: wspool" in caplog.text
    loaded = [r.getMessage() for r in caplog.records if r.name == sg.logger.name and r.levelno == logging.INFO]
    line = f"wspool: SGLang 0.5.23: {len(sg.TARGETS)} targets patched; config: built-in defaults; profile auto"
    assert loaded == [line]
    assert "RuntimeContext.get_buffer -> pools for" in caplog.text  # the details, at debug level


@pytest.mark.parametrize(
    "name",
    [
        "flashinfer_workspace",
        "flashinfer_mla_workspace",
        "trtllm_mla_zero_workspace",
        "trtllm_mha_zero_workspace",
        "dsa_flashinfer_sparse_mla_workspace",
        "dsa_trtllm_workspace",
    ],
)
def test_get_buffer_serves_each_workspace_from_its_pool(
    srt: SGLang, loaded: None, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Every way SGLang calls get_buffer gets the pool's buffer: SGLang's size and dtype, zeroed, one tensor."""
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", str(2 * MiB))
    wspool.reset_registry()  # the engine knob is read when the registry is built
    made: list[str] = []
    factory = _workspace_factory(srt, name, made)
    expected = srt.trtllm_mla.DEFAULT_WORKSPACE_SIZE_MB * MiB if name == "trtllm_mla_zero_workspace" else None
    expected = expected or {"trtllm_mha_zero_workspace": 10 * MiB, "dsa_trtllm_workspace": 4 * MiB}.get(name, 2 * MiB)
    got = srt.rc.get_buffer(name, factory)  # the module function
    w = sg.BUFFERS[name]
    registry = wspool.get_registry()
    pool_buffer = registry.pool(w.pool, CPU).buffer
    assert made == ["FakeTensor"]  # SGLang's factory never allocated
    dtype = torch.int8 if name == "trtllm_mla_zero_workspace" else torch.uint8
    assert (got.dtype, got.numel(), got.device) == (dtype, expected, CPU)
    assert pool_buffer is not None and got.data_ptr() == pool_buffer.data_ptr() and not got.any()
    assert srt.rc.get_context().get_buffer(name, factory) is got  # the method
    assert srt.paged.get_buffer(name, factory) is got  # a backend's by-name copy
    assert registry.stats(w.pool, CPU).requests_by_rule[w.rule] == 3
    assert name not in srt.rc.get_resources().buffers  # SGLang's own registry never held it


def test_sglangs_own_dsv4_accessor_is_served_from_its_pool(srt: SGLang, loaded: None) -> None:
    """DeepSeek-V4's trtllm workspace, asked for by SGLang's own function: 128 MiB, int8, zeroed, pooled."""
    got = srt.dsv4._get_trtllm_workspace_buffer(torch.device("cuda"))
    stats = wspool.get_registry().stats("sglang_trtllm_dsv4", CPU)
    assert (got.dtype, got.numel(), stats.capacity_bytes) == (torch.int8, 128 * MiB, 128 * MiB)
    assert srt.dsv4._get_trtllm_workspace_buffer(torch.device("cuda")) is got and not got.any()


def test_other_names_get_the_factorys_own_object(srt: SGLang, loaded: None) -> None:
    """Any other name is SGLang's: the factory's object, cached by SGLang, no pool involved."""
    scale = torch.ones(1, dtype=torch.float32)
    assert srt.rc.get_buffer("trtllm_mha_default_kv_scale", lambda: scale) is scale
    assert srt.rc.get_buffer("trtllm_mha_default_kv_scale", lambda: pytest.fail("factory called again")) is scale
    assert srt.rc.get_resources().buffers["trtllm_mha_default_kv_scale"] is scale
    assert not wspool.get_registry().all_stats()


def test_loading_twice_patches_once(srt: SGLang, loaded: None, load: Any, caplog: Any) -> None:
    """A second load_plugins() or register() leaves the wrappers as they are, not wrapped twice."""
    first = _originals(srt)
    load()
    sg.register()
    assert _originals(srt) == first and sg.patched() == [t.name for t in sg.TARGETS]
    assert "targets patched" in "".join(r.getMessage() for r in caplog.get_records("setup"))
    assert "targets patched" not in caplog.text  # not again, in this test's own calls
    assert caplog.text.count("the SGLang integration is already loaded") == 2


def test_switched_off_it_patches_nothing(srt: SGLang, load: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """WSPOOL_SGLANG=0: the plugin runs, says so, and SGLang's get_buffer calls its own factory."""
    monkeypatch.setenv("WSPOOL_SGLANG", "0")
    before = _originals(srt)
    load()
    assert sg.patched() == [] and _originals(srt) == before
    assert "WSPOOL_SGLANG=0: SGLang's own workspaces stay in use" in caplog.text
    mine = torch.empty(16, dtype=torch.uint8)
    assert srt.rc.get_buffer("flashinfer_workspace", lambda: mine) is mine


def test_sglang_plugins_without_wspool_skips_it(
    srt: SGLang, load: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """An SGLANG_PLUGINS allowlist that does not name wspool: SGLang never runs it."""
    monkeypatch.setenv("SGLANG_PLUGINS", "some-other-plugin")
    load()
    assert sg.patched() == [] and "Skipping plugin wspool (not in SGLANG_PLUGINS)" in caplog.text


def test_a_changed_target_means_nothing_is_patched(
    srt: SGLang, load: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """One target with another signature and one missing module global: no target patched, one warning."""

    def capture(self: Any, graphs: Any) -> None: ...

    monkeypatch.setattr(srt.prefill_runner.PrefillCudaGraphRunner, "capture", capture)
    monkeypatch.delattr(srt.trtllm_mla, "global_cute_dsl_workspace_buffer")
    before = _originals(srt)
    load()
    assert sg.patched() == [] and _originals(srt) == before
    warnings = [r.getMessage() for r in caplog.records if r.name == sg.logger.name and r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "PrefillCudaGraphRunner.capture takes (self, graphs), not (self)" in warnings[0]
    assert "trtllm_mla_backend has no global_cute_dsl_workspace_buffer" in warnings[0]


def test_a_failure_while_patching_rolls_everything_back(
    srt: SGLang, load: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """An exception after some targets were patched puts SGLang's originals back, and the log says so."""

    def explode(original: Any) -> Any:
        raise RuntimeError("cannot wrap")

    last = sg.TARGETS[-1]
    broken = Target(last.module, last.path, last.parameters, explode, "explodes")
    monkeypatch.setattr(sg, "GROUPS", (TargetGroup("SGLang's workspaces", (*sg.TARGETS[:-1], broken)),))
    before = _originals(srt)
    load()
    assert sg.patched() == [] and _originals(srt) == before
    said = "the SGLang integration failed to load and patched nothing; SGLang's own workspaces stay in use"
    assert said in caplog.text
    assert "RuntimeError: cannot wrap" in caplog.text


def test_capture_freezes_the_registry_and_a_recapture_thaws_it(srt: SGLang, loaded: None) -> None:
    """SGLang's capture() runs with growth allowed and leaves the registry frozen; so does a recapture."""
    registry = wspool.get_registry()
    seen: list[bool] = []
    runner = SimpleNamespace(model_context=contextlib.nullcontext, _capture=lambda: seen.append(registry.is_frozen))
    got = srt.rc.get_buffer("flashinfer_mla_workspace", lambda: torch.empty(MiB, dtype=torch.uint8))
    srt.decode_runner.DecodeCudaGraphRunner.capture(runner)
    assert seen == [False] and registry.is_frozen
    assert srt.rc.get_buffer("flashinfer_mla_workspace", lambda: torch.empty(MiB, dtype=torch.uint8)) is got
    with pytest.raises(WorkspaceFrozenError, match="flashinfer_mla"):
        srt.rc.get_buffer("flashinfer_mla_workspace", lambda: torch.empty(2 * MiB, dtype=torch.uint8))
    srt.prefill_runner.PrefillCudaGraphRunner.capture(runner)
    assert seen == [False, False] and registry.is_frozen


# -- SGLang's backend constructors, on a published (tiny) model configuration --------------------------


@pytest.fixture(scope="module")
def published(srt: SGLang, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """SGLang's process configuration for a tiny local model, as a scheduler publishes it."""
    publish_tiny_llama(srt.rc, tmp_path_factory.mktemp("tiny-llama"))
    yield
    srt.rc.reset_context()


def _runner(srt: SGLang) -> SimpleNamespace:
    """A model runner with what SGLang's FlashInfer constructors read before FlashInfer's own wrappers."""
    quant = SimpleNamespace(resolve_attention_access=lambda *args: None)
    model_config = SimpleNamespace(
        hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]), is_encoder_decoder=False,
        is_multimodal=False, context_len=4096, num_attention_heads=16, head_dim=32,
        get_num_kv_heads=lambda *args: 4, kv_lora_rank=512, qk_rope_head_dim=64,
    )  # fmt: skip
    return SimpleNamespace(
        model_config=model_config, device="cpu", req_to_token_pool=SimpleNamespace(size=8),
        token_to_kv_pool=SimpleNamespace(get_kv_cache_quant_method=lambda: quant), kv_index_translator=None,
        is_draft_worker=True, spec_algorithm=SimpleNamespace(is_frozen_kv_mtp=lambda: False),
        server_args=srt.rc.get_server_args(), prefill_attention_backend_str="triton",
        decode_attention_backend_str="triton", sliding_window_size=None, page_size=16, max_running_requests=8,
        kv_cache_dtype=torch.bfloat16, dtype=torch.bfloat16,
    )  # fmt: skip


# Without CUDA, SGLang does not import FlashInfer's wrapper classes, so its constructors stop with this
# NameError right after asking for their workspace: everything up to it is SGLang's own code.
NO_FLASHINFER_ON_CPU = "name 'BatchPrefillWithRaggedKVCacheWrapper' is not defined"


def test_a_backend_constructor_gives_the_rules_its_runner(
    srt: SGLang, published: None, loaded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FlashInferMLAAttnBackend's get_buffer call sees its runner's heads, DCP, page size and batch."""
    rule = "num_heads * cp_world * kv_lora_rank * page_size * batch_size"
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_MLA__RULES__SGLANG_MLA", rule)
    wspool.reset_registry()  # the configuration is read when the registry is built
    with srt.rc.get_parallel().override(attn_dcp_size=2), pytest.raises(NameError, match=NO_FLASHINFER_ON_CPU):
        srt.mla.FlashInferMLAAttnBackend(_runner(srt))
    assert wspool.get_registry().stats("flashinfer_mla", CPU).capacity_bytes == 16 * 2 * 512 * 16 * 8


def test_a_backend_built_after_a_capture_may_grow_its_pool(srt: SGLang, published: None, loaded: None) -> None:
    """A constructor is a growth window even while a capture's freeze holds; the freeze holds after it."""
    registry = wspool.get_registry()
    srt.decode_runner.DecodeCudaGraphRunner.capture(SimpleNamespace(model_context=contextlib.nullcontext,
                                                                    _capture=lambda: None))  # fmt: skip
    assert registry.is_frozen
    with pytest.raises(NameError, match=NO_FLASHINFER_ON_CPU):
        srt.mla.FlashInferMLAAttnBackend(_runner(srt))
    assert registry.stats("flashinfer_mla", CPU).capacity_bytes == 384 * MiB and registry.is_frozen


def test_init_new_workspace_is_a_lane_of_its_own(srt: SGLang, published: None, loaded: None) -> None:
    """FlashInferAttnBackend(init_new_workspace=True): a pool buffer in a new lane, not SGLang's torch.empty."""
    with pytest.raises(NameError, match=NO_FLASHINFER_ON_CPU):
        srt.paged.FlashInferAttnBackend(_runner(srt), init_new_workspace=True)
    stats = wspool.get_registry().all_stats()
    assert [(s.pool, s.lane.startswith("sglang-new-workspace-"), s.capacity_bytes) for s in stats] == [
        ("flashinfer_mla", True, 384 * MiB)
    ]
    assert "flashinfer_workspace" not in srt.rc.get_resources().buffers


def test_deterministic_inference_reads_sglangs_configuration(
    srt: SGLang, published: None, loaded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With SGLang's deterministic inference on, flashinfer_workspace is sized by its own rule."""
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", str(MiB))
    wspool.reset_registry()
    context = srt.rc.get_context()
    context.override("test", enable_deterministic_inference=True)
    try:
        got = srt.rc.get_buffer("flashinfer_workspace", lambda: torch.empty(4 * MiB, dtype=torch.uint8))
    finally:
        context.override("test", enable_deterministic_inference=False)
    assert got.numel() == 4 * MiB  # SGLang's own size, not the variable's 1 MiB
    assert wspool.get_registry().stats("flashinfer", CPU).requests_by_rule == {"sglang_deterministic": 1}


def test_errors_reach_sglang_as_wspool_errors(srt: SGLang, loaded: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule reading a fact SGLang did not give fails SGLang's call with a RuleError naming the facts."""
    monkeypatch.setenv("WSPOOL_POOLS__SGLANG_DSA_TRTLLM__RULES__DEFAULT", "sglang_bytes * cp_world")
    wspool.reset_registry()
    with pytest.raises(WspoolError, match=r"dsa_trtllm_workspace the integration passes the facts it knows: "
                       r"sglang_bytes=1024; unknown here: num_heads.*cp_world"):  # fmt: skip
        srt.rc.get_buffer("dsa_trtllm_workspace", lambda: torch.empty(1024, dtype=torch.uint8))


# -- the seam: switch, configuration and rollback, as every engine has them ---------------------


@pytest.mark.parametrize("value", ["disabled", "2", "enable"])
def test_an_unknown_switch_patches_nothing_and_names_the_variable(
    srt: SGLang, load: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any, value: str
) -> None:
    """A WSPOOL_SGLANG value that is neither on nor off is one error naming the variable; nothing is patched."""
    monkeypatch.setenv("WSPOOL_SGLANG", value)
    before = _originals(srt)
    load()
    assert sg.patched() == [] and _originals(srt) == before
    errors = [r.getMessage() for r in caplog.records if r.name == sg.logger.name and r.levelno == logging.ERROR]
    assert errors == [
        f"wspool: SGLang: nothing patched, SGLang's own workspaces stay in use: invalid environment variable "
        f"WSPOOL_SGLANG = {value!r}: expected 1 or 0 (true/false, on/off, yes/no); unset it to keep wspool on"
    ]


def test_a_broken_configuration_patches_nothing_and_says_why_in_one_line(
    srt: SGLang, load: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any, tmp_path: Any
) -> None:
    """An invalid WSPOOL_CONFIG is read before anything is patched: one error line, SGLang untouched."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("pools:\n  flashinfer:\n    rules:\n      sglang: 12 parsecs\n")
    monkeypatch.setenv("WSPOOL_CONFIG", str(broken))
    wspool.reset_registry()
    before = _originals(srt)
    load()
    assert sg.patched() == [] and _originals(srt) == before
    errors = [r.getMessage() for r in caplog.records if r.name == sg.logger.name and r.levelno == logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0] and "pools.flashinfer.rules.sglang" in errors[0]
    mine = torch.empty(16, dtype=torch.uint8)
    assert srt.rc.get_buffer("flashinfer_workspace", lambda: mine) is mine


def test_the_third_of_three_targets_failing_restores_the_first_two(
    srt: SGLang, load: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A group of three whose third replacement raises: the first two are SGLang's own again."""

    def explode(original: Any) -> Any:
        raise RuntimeError("cannot wrap the third")

    first, second, third = sg.TARGETS[:3]
    broken = Target(third.module, third.path, third.parameters, explode, "explodes")
    monkeypatch.setattr(sg, "GROUPS", (TargetGroup("three", (first, second, broken)),))
    before = _originals(srt)
    load()
    assert sg.patched() == [] and _originals(srt) == before
    assert "RuntimeError: cannot wrap the third" in caplog.text


def test_the_load_line_is_one_short_line(srt: SGLang, load: Any, caplog: Any) -> None:
    """Loading says one line at info level (details at debug): the version, the count, the configuration."""
    load()
    lines = [r.getMessage() for r in caplog.records if r.name == sg.logger.name and r.levelno == logging.INFO]
    assert len(lines) == 1 and len(lines[0]) < 120 and lines[0].startswith("wspool: SGLang 0.5.23: ")


def test_a_constructors_growth_allowance_is_its_own_thread_only(srt: SGLang, loaded: None) -> None:
    """While one thread builds a backend after a capture, another thread's get_buffer still may not grow a pool."""
    import threading

    registry = wspool.get_registry()
    srt.decode_runner.DecodeCudaGraphRunner.capture(
        SimpleNamespace(model_context=contextlib.nullcontext, _capture=lambda: None)
    )
    assert registry.is_frozen
    outcome: list[str] = []

    def other_thread() -> None:
        try:
            srt.rc.get_buffer("dsa_trtllm_workspace", lambda: torch.empty(8 * MiB, dtype=torch.uint8))
            outcome.append("grew")
        except WorkspaceFrozenError:
            outcome.append("refused")

    class Backend:
        """A backend whose constructor runs while another thread asks SGLang for a workspace."""

        def __init__(self, model_runner: Any, skip_prefill: bool = False) -> None:
            worker = threading.Thread(target=other_thread)
            worker.start()
            worker.join()

    Backend.__init__ = sg.buffers.wrap_constructor(Backend.__init__)  # type: ignore[method-assign]
    Backend(SimpleNamespace(model_config=SimpleNamespace(num_attention_heads=8), device="cpu"))
    assert outcome == ["refused"] and registry.is_frozen


def test_two_constructors_on_two_threads_do_not_refreeze_each_other(srt: SGLang, loaded: None) -> None:
    """One constructor ending does not take the allowance from another still running on another thread."""
    import threading

    registry = wspool.get_registry()
    registry.freeze()
    first_inside, first_done = threading.Event(), threading.Event()
    grown: list[int] = []

    def first() -> None:
        with registry.allowing_growth():
            first_inside.set()
            first_done.wait(5)
            grown.append(registry.workspace("flashinfer", CPU, rule="sglang", sglang_bytes=4 * MiB).numel())

    worker = threading.Thread(target=first)
    worker.start()
    first_inside.wait(5)
    with registry.allowing_growth():  # a second constructor opens and closes meanwhile
        registry.workspace("flashinfer_mla", CPU, rule="sglang_mla", sglang_bytes=MiB)
    first_done.set()
    worker.join()
    assert grown == [4 * MiB] and registry.is_frozen


def test_a_capture_after_unfreeze_is_not_thawed_by_a_stale_flag(srt: SGLang, loaded: None) -> None:
    """After registry.unfreeze() and a user's own freeze, a recapture leaves the user's freeze alone."""
    registry = wspool.get_registry()
    runner = SimpleNamespace(model_context=contextlib.nullcontext, _capture=lambda: None)
    srt.decode_runner.DecodeCudaGraphRunner.capture(runner)
    registry.unfreeze()
    registry.freeze()  # the user's own freeze, not the capture's
    seen: list[bool] = []
    srt.decode_runner.DecodeCudaGraphRunner.capture(
        SimpleNamespace(model_context=contextlib.nullcontext, _capture=lambda: seen.append(registry.is_frozen))
    )
    assert seen == [True] and registry.is_frozen


def test_a_constructor_after_unfreeze_leaves_the_registry_unfrozen(srt: SGLang, loaded: None) -> None:
    """After a capture and registry.unfreeze(), building a backend does not freeze the registry again."""
    registry = wspool.get_registry()
    srt.decode_runner.DecodeCudaGraphRunner.capture(
        SimpleNamespace(model_context=contextlib.nullcontext, _capture=lambda: None)
    )
    registry.unfreeze()

    class Backend:
        """A backend that asks for nothing."""

        def __init__(self, model_runner: Any, skip_prefill: bool = False) -> None:
            pass

    Backend.__init__ = sg.buffers.wrap_constructor(Backend.__init__)  # type: ignore[method-assign]
    Backend(SimpleNamespace(model_config=SimpleNamespace(num_attention_heads=8), device="cpu"))
    assert not registry.is_frozen


def test_the_engine_path_times_sglangs_get_buffer_against_sglangs_own(srt: SGLang, load: Any) -> None:
    """wspool bench's engine path times get_buffer for a name wspool does not pool, and the plan wrapper."""
    from wspool.tools.engine_path import measure_engine_path

    found = measure_engine_path(rounds=1, batch=50)["SGLang"]
    calls = [row["call"] for row in found["rows"]]
    assert found["version"] == VERSION and calls[0] == "RuntimeContext.get_buffer (a name not pooled)"
    assert all(row["own_ns"] > 0 and row["wspool_ns"] > 0 for row in found["rows"])
