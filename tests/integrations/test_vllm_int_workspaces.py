"""Tests for wspool.integrations.vllm.wrappers: vLLM's FlashInfer paged wrappers on right-sized int workspaces.

The vLLM tests build vLLM's real ``FlashInferMetadataBuilder`` (0.33.0 or 0.34.0) on
the CPU, from a real ``VllmConfig`` of a two-layer model described by a local
``config.json`` and a real FlashInfer attention layer, after vLLM loaded wspool's
plugin. FlashInfer's wrappers pin host memory in their constructors, which needs
CUDA, so the builder's module builds the CPU doubles of tests/helpers/paged_doubles.py
instead (bound to the installed FlashInfer's signatures). On the CPU vLLM builds
its decode wrappers with backend ``fa2`` (below SM90) and its prefill wrapper with
``auto``; ``wspool.devices.fake_device`` stands the CPU in for an A100 or an H200,
whose SM count the rules read. Without vLLM only the pure functions are tested.

    .venv-vllm/bin/python -m pytest -q tests/integrations/test_vllm_int_workspaces.py      # vLLM 0.33.0
    .venv-vllm034/bin/python -m pytest -q tests/integrations/test_vllm_int_workspaces.py   # vLLM 0.34.0
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

import wspool
from tests.helpers.devices_fake import A100, H200
from tests.helpers.paged_doubles import DecodeWrapperDouble, PrefillWrapperDouble, RaggedWrapperDouble
from wspool.devices import DeviceDescription, fake_device
from wspool.errors import RuleError
from wspool.flashinfer import wrapper_buffers
from wspool.flashinfer.wrapper_buffers import FLASHINFER_INT_DEFAULT_BYTES, binding_of, planner_backend, wrapper_record
from wspool.integrations import vllm as plugin
from wspool.integrations.vllm.wrappers import step_bounds
from wspool.units import ceil_div, round_up

PAGED = "vllm.v1.attention.backends.flashinfer"
LAYER = "model.layers.0.self_attn.attn"
HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 2, 64, 16
CPU = torch.device("cpu")


def decode_rule(sm: int, batch: int, kv: int) -> int:
    """Rule ``decode`` of pool flashinfer_int, written out: the CUDA-core decode planner's bound."""
    return 13 * max(batch, ceil_div(32 * sm, kv)) + 64


def prefill_rule(sm: int, batch: int, tokens: int, qo: int, kv: int) -> int:
    """Rule ``prefill`` of pool flashinfer_int, written out: the fa2 prefill planner's bound."""
    return 13 * max(ceil_div(32 * sm, kv), ceil_div(tokens * qo, 16 * kv) + batch) + 4 * (batch + tokens) + 128


def region_bytes(rule_bytes: int) -> int:
    """What a region of a rule's size holds: at least 16 bytes, on a 16-byte boundary."""
    return round_up(max(rule_bytes, 16), 16)


# -- without vLLM: the pure functions -----------------------------------------------


@pytest.mark.parametrize(
    ("backend", "description", "planner"),
    [("auto", A100, "fa2"), ("auto", H200, "auto"), ("auto", None, "auto"), ("fa3", A100, "fa3"),
     ("trtllm-gen", A100, "trtllm-gen"), ("fa2", H200, "fa2")],
)  # fmt: skip
def test_auto_is_fa2_off_hopper(backend: str, description: DeviceDescription | None, planner: str) -> None:
    """'auto' plans with fa2 on a GPU that is not SM90; on SM90, or a device with no description, it stays 'auto'."""
    with fake_device("cpu", description):
        assert planner_backend(backend, CPU) == planner


def test_step_bounds_take_the_larger_of_budget_and_requests() -> None:
    """T is the token budget or max_num_seqs * (1 + drafts), whichever is more; no scheduler bounds are an error."""

    def config(seqs: int, tokens: int, drafts: int | None) -> SimpleNamespace:
        speculative = None if drafts is None else SimpleNamespace(num_speculative_tokens=drafts)
        scheduler = SimpleNamespace(max_num_seqs=seqs, max_num_batched_tokens=tokens)
        return SimpleNamespace(scheduler_config=scheduler, speculative_config=speculative)

    assert step_bounds(config(256, 8192, None)) == (256, 8192)
    assert step_bounds(config(256, 512, 3)) == (256, 1024)
    with pytest.raises(LookupError, match="max_num_seqs or max_num_batched_tokens"):
        step_bounds(SimpleNamespace(scheduler_config=None))


# -- with the real vLLM ---------------------------------------------------------------


@pytest.fixture
def paged(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[ModuleType]:
    """vLLM's FlashInfer backend module after vLLM loaded its plugins, building the CPU doubles; unpatched after."""
    pytest.importorskip("vllm", reason="vLLM is not installed here; `.ci/engine-envs` builds both engine environments")
    import vllm.plugins

    monkeypatch.setenv("WSPOOL_VLLM_DEVICE", "cpu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the model is a local config.json
    # vLLM's floor for the float workspace (tokens * heads * head_dim * 16) is 4 MiB here: no need for 394 MiB.
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER__RULES__VLLM", "1MiB")
    module = importlib.import_module(PAGED)
    for name, double in (
        ("BatchDecodeWithPagedKVCacheWrapper", DecodeWrapperDouble),
        ("BatchPrefillWithPagedKVCacheWrapper", PrefillWrapperDouble),
        ("BatchPrefillWithRaggedKVCacheWrapper", RaggedWrapperDouble),
    ):
        monkeypatch.setattr(module, name, double)
    # FlashInferImpl sizes trtllm-gen's counters with the GPU's SM count when it is built.
    monkeypatch.setattr(module, "get_device_sm_count", lambda device: 108)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * HEAD_DIM,
             "intermediate_size": 1024, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
             "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "bfloat16",
             "rms_norm_eps": 1e-5}
        )
    )  # fmt: skip
    vllm.plugins.load_general_plugins()
    try:
        yield module
    finally:
        plugin.unregister()
        wspool.reset_registry()


def _vllm_config(model: Path, *, seqs: int = 16, tokens: int = 512, drafts: int = 0) -> Any:
    """vLLM's VllmConfig of the local model, with FULL decode CUDA graphs and an NHD cache layout.

    ``drafts``: n-gram speculative decoding of that many tokens (the one method that needs no draft model).
    """
    from vllm.config import DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    speculative = (
        SpeculativeConfig(method="ngram", num_speculative_tokens=drafts, prompt_lookup_max=3, prompt_lookup_min=1)
        if drafts
        else None
    )
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048),
        scheduler_config=SchedulerConfig(
            max_num_seqs=seqs, max_num_batched_tokens=tokens, max_model_len=2048, is_encoder_decoder=False
        ),
        device_config=DeviceConfig(device="cpu"),
        speculative_config=speculative,
    )
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY  # the CPU platform turns graphs off
    config.cache_config.kv_cache_layout = "NHD"  # the engine core resolves it before building builders
    return config


@pytest.fixture
def make_builder(paged: ModuleType, tmp_path: Path) -> Callable[..., Any]:
    """Return a function that builds vLLM's FlashInferMetadataBuilder over one real FlashInfer attention layer."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    def build(**config_args: Any) -> Any:
        config = _vllm_config(tmp_path, **config_args)
        with set_current_vllm_config(config):
            Attention(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, cache_config=config.cache_config, prefix=LAYER,
                      attn_backend=paged.FlashInferBackend)  # fmt: skip
            spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
            return paged.FlashInferMetadataBuilder(spec, [LAYER], config, CPU)

    return build


def _as_gpu(description: DeviceDescription) -> Iterator[None]:
    with fake_device("cpu", description):
        wspool.reset_registry()  # a registry that reads the fake's SM count
        yield


@pytest.fixture
def a100() -> Iterator[None]:
    """The CPU stands in for an A100 (108 SMs, SM80: 'auto' plans with fa2)."""
    yield from _as_gpu(A100)


@pytest.fixture
def h200() -> Iterator[None]:
    """The CPU stands in for an H200 (132 SMs, SM90: 'auto' may plan with fa3)."""
    yield from _as_gpu(H200)


def _assert_region(wrapper: Any, builder: Any, expected: int) -> None:
    """The wrapper's int workspace is its wspool region of ``expected`` bytes, its host copy as large."""
    binding = binding_of(wrapper)
    assert binding is not None and binding.region.group is None
    assert binding.region.nbytes == region_bytes(expected) < FLASHINFER_INT_DEFAULT_BYTES // 100
    assert wrapper._int_workspace_buffer is binding.region.tensor
    assert wrapper._pin_memory_int_workspace_buffer.numel() == binding.region.nbytes
    assert wrapper.workspace is builder._workspace_buffer  # the float workspace is passed back unchanged


def test_every_decode_wrapper_gets_a_region_for_its_bounds(make_builder: Callable[..., Any], a100: None) -> None:
    """Each CUDA-graph decode wrapper is sized for its batch; the eager one for the step's most tokens.

    vLLM plans decode with tensor cores (the fa2 prefill planner) over the batch's
    rows: a graph wrapper of batch B plans B requests of one token, the eager one
    at most T = max(512, 16 * 1) = 512 of them.
    """
    builder = make_builder()
    graphs = {batch: builder._get_decode_wrapper(batch, True) for batch in (1, 4, 16)}
    eager = builder._get_decode_wrapper(3)
    for batch, wrapper in graphs.items():
        _assert_region(wrapper, builder, prefill_rule(108, batch, batch, HEADS, KV_HEADS))
        record = wrapper_record(wrapper)
        assert record is not None and (record.kind, record.rule) == ("decode-graph", "prefill")
        assert (record.facts["batch_size"], record.facts["num_tokens"]) == (batch, batch)
    _assert_region(eager, builder, prefill_rule(108, 512, 512, HEADS, KV_HEADS))
    record = wrapper_record(eager)
    assert record is not None and (record.kind, record.facts["batch_size"], record.facts["num_tokens"]) == (
        "decode", 512, 512,
    )  # fmt: skip
    # Later steps get the same wrappers on the same regions.
    regions = {id(w): binding_of(w).region for w in (*graphs.values(), eager)}  # type: ignore[union-attr]
    assert builder._get_decode_wrapper(4, True) is graphs[4] and builder._get_decode_wrapper(7) is eager
    assert all(binding_of(w).region is regions[id(w)] for w in (*graphs.values(), eager))  # type: ignore[union-attr]
    assert len({id(r) for r in regions.values()}) == 4  # never shared
    stats = wspool.get_registry().memory_stats()["int_regions"]
    assert [s["kinds"] for s in stats] == [{"vllm-decode-graph": 3, "vllm-decode": 1}]


def test_bounds_follow_speculative_decoding(make_builder: Callable[..., Any], a100: None) -> None:
    """With 3 drafts a graph wrapper plans B requests of 4 tokens; the eager ones max_num_seqs * 4 tokens.

    256 sequences of 1 + 3 tokens outgrow the 512-token budget: T = 1024.
    """
    builder = make_builder(seqs=256, tokens=512, drafts=3)
    graph = builder._get_decode_wrapper(4, True, 4)
    _assert_region(graph, builder, prefill_rule(108, 4, 16, HEADS, KV_HEADS))
    assert {k: wrapper_record(graph).facts[k] for k in ("batch_size", "num_tokens")} == {  # type: ignore[union-attr]
        "batch_size": 4, "num_tokens": 16,
    }  # fmt: skip
    eager = builder._get_decode_wrapper(2, False, 4)
    _assert_region(eager, builder, prefill_rule(108, 1024, 1024, HEADS, KV_HEADS))
    prefill = builder._get_prefill_wrapper()
    _assert_region(prefill, builder, prefill_rule(108, 256, 1024, HEADS, KV_HEADS))


def test_prefill_wrappers_get_regions_off_hopper(make_builder: Callable[..., Any], a100: None) -> None:
    """The causal and the non-causal prefill wrappers ('auto', fa2 on an A100) are sized for max_num_seqs and T."""
    builder = make_builder()
    causal, noncausal = builder._get_prefill_wrapper(), builder._get_prefill_wrapper(causal=False)
    assert causal is not noncausal and causal.init_kwargs["backend"] == "auto"
    for wrapper in (causal, noncausal):
        _assert_region(wrapper, builder, prefill_rule(108, 16, 512, HEADS, KV_HEADS))
        record = wrapper_record(wrapper)
        assert record is not None and (record.kind, record.facts["batch_size"], record.facts["num_tokens"]) == (
            "prefill", 16, 512,
        )  # fmt: skip
    assert builder._get_prefill_wrapper() is causal and binding_of(causal).region.nbytes < 64 * 1024  # type: ignore[union-attr]


def test_auto_prefill_keeps_flashinfers_buffers_on_hopper(
    make_builder: Callable[..., Any], h200: None, warnings_seen: pytest.LogCaptureFixture
) -> None:
    """On SM90 'auto' may plan prefill with fa3, which no rule bounds: the wrapper keeps its 8 MiB; decode is sized."""
    builder = make_builder()
    prefill = builder._get_prefill_wrapper()
    decode = builder._get_decode_wrapper(8, True)
    assert binding_of(prefill) is None and prefill._int_workspace_buffer.numel() == FLASHINFER_INT_DEFAULT_BYTES
    record = wrapper_record(prefill)
    assert record is not None and record.rule is None and "backend 'auto' on cpu" in (record.why or "")
    assert "prefill wrapper keeps FlashInfer's 8 MiB int workspace" in warnings_seen.text
    _assert_region(decode, builder, prefill_rule(132, 8, 8, HEADS, KV_HEADS))  # fa2 decode, the H200's 132 SMs


def test_dcp_context_wrapper_is_sized_for_the_gathered_heads(
    paged: ModuleType, make_builder: Callable[..., Any], a100: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under DCP 2 the prefill wrapper is vLLM's; its paged context pass plans 2 * 8 heads and gets a region.

    Its ragged new-token wrapper ('auto': fa2, fa3, fmha_v2, cuDNN or CUTLASS) keeps FlashInfer's buffers.
    Decode plans the gathered heads too.
    """
    monkeypatch.setattr(paged, "get_dcp_world_size_and_rank", lambda enabled=True: (2, 0) if enabled else (1, 0))
    builder = make_builder()
    assert builder.use_dcp
    dcp = builder._get_prefill_wrapper()
    assert type(dcp) is paged.BatchDCPPrefillWrapper
    _assert_region(dcp._native_context, builder, prefill_rule(108, 16, 512, 2 * HEADS, KV_HEADS))
    assert wrapper_record(dcp) is wrapper_record(dcp._native_context)
    assert wrapper_record(dcp).kind == "dcp-context"  # type: ignore[union-attr]
    assert binding_of(dcp._new_tokens) is None
    assert dcp._new_tokens._int_workspace_buffer.numel() == FLASHINFER_INT_DEFAULT_BYTES
    decode = builder._get_decode_wrapper(4, True)
    _assert_region(decode, builder, prefill_rule(108, 4, 4, 2 * HEADS, KV_HEADS))


def test_a_registry_that_keeps_flashinfers_buffers_is_what_the_records_say(
    make_builder: Callable[..., Any], a100: None
) -> None:
    """With keep_flashinfer_buffers every wrapper keeps its 8 MiB, and its record says so: no rule, the reason."""
    wrapper_buffers.keep_flashinfer_buffers(wspool.get_registry())
    builder = make_builder()
    wrappers = [builder._get_decode_wrapper(4, True), builder._get_decode_wrapper(3), builder._get_prefill_wrapper()]
    for wrapper in wrappers:
        record = wrapper_record(wrapper)
        assert binding_of(wrapper) is None and wrapper._int_workspace_buffer.numel() == FLASHINFER_INT_DEFAULT_BYTES
        assert record is not None and record.rule is None and record.why == "the registry keeps FlashInfer's buffers"
    assert [r.kind for r in map(wrapper_record, wrappers)] == ["decode-graph", "decode", "prefill"]  # type: ignore[union-attr]
    assert wspool.get_registry().memory_stats()["int_regions"] == []


def test_a_rule_that_cannot_resolve_names_the_setting(
    make_builder: Callable[..., Any], a100: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A configured rule reading a fact the plugin does not give (q_len) fails naming that rule's setting."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_INT__RULES__PREFILL", "q_len * 1KiB")
    wspool.reset_registry()
    builder = make_builder()
    with pytest.raises(RuleError, match=r"WSPOOL_POOLS__FLASHINFER_INT__RULES__PREFILL.* q_len "):
        builder._get_decode_wrapper(4, True)


def test_unregister_restores_the_getters(paged: ModuleType, make_builder: Callable[..., Any], a100: None) -> None:
    """unregister() puts vLLM's getters back; the wrappers they make then keep FlashInfer's buffers."""
    cls = paged.FlashInferMetadataBuilder
    assert cls.__dict__["_get_decode_wrapper"].__wspool__ and cls.__dict__["_get_prefill_wrapper"].__wspool__
    originals = (cls.__dict__["_get_decode_wrapper"].__wrapped__, cls.__dict__["_get_prefill_wrapper"].__wrapped__)
    builder = make_builder()  # while patched: its attention layer asks for the counters on the CPU
    restored = plugin.unregister()
    assert f"{PAGED}.FlashInferMetadataBuilder._get_decode_wrapper" in restored
    assert (cls.__dict__["_get_decode_wrapper"], cls.__dict__["_get_prefill_wrapper"]) == originals
    decode, prefill = builder._get_decode_wrapper(4, True), builder._get_prefill_wrapper()
    assert binding_of(decode) is None and binding_of(prefill) is None and wrapper_record(decode) is None
    assert decode._int_workspace_buffer.numel() == FLASHINFER_INT_DEFAULT_BYTES


def test_a_changed_prefill_getter_leaves_decode_patched(
    paged: ModuleType, monkeypatch: pytest.MonkeyPatch, warnings_seen: pytest.LogCaptureFixture
) -> None:
    """A prefill getter of another signature keeps vLLM's (and the warning says so); the decode getter is wrapped."""
    import vllm.plugins

    plugin.unregister()

    def _get_prefill_wrapper(self: Any, causal: bool = True, dcp: bool = False) -> Any:
        return None

    monkeypatch.setattr(paged.FlashInferMetadataBuilder, "_get_prefill_wrapper", _get_prefill_wrapper)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert paged.FlashInferMetadataBuilder._get_prefill_wrapper is _get_prefill_wrapper
    assert paged.FlashInferMetadataBuilder.__dict__["_get_decode_wrapper"].__wspool__
    assert "the FlashInfer prefill wrappers' int workspaces (" in warnings_seen.text
    assert "_get_prefill_wrapper takes (self, causal, dcp)" in warnings_seen.text
