"""Tests for wspool.integrations.sglang.wrappers: SGLang 0.5.23's FlashInfer wrappers on right-sized int workspaces.

They build SGLang's real ``FlashInferAttnBackend`` and ``FlashInferMLAAttnBackend``
with the integration registered, let SGLang's own code make its eager and
CUDA-graph wrappers and plan its MLA wrappers, and check each wrapper's int
workspace: bound, sized by its rule of pool ``flashinfer_int`` for the facts,
far below FlashInfer's 8 MiB. Every test skips, with the reason, where SGLang is
not installed; run them with

    WSPOOL_SGLANG_DEVICE=cpu .venv-sglang/bin/python -m pytest -q tests/integrations/test_sglang_int_workspaces.py

On a machine without CUDA, SGLang does not import FlashInfer's wrapper classes;
the tests put the CPU doubles of ``tests/helpers`` in their place (they bind
every call to FlashInfer's real signatures, and the MLA one builds FlashInfer's
real MLA backend object at each plan, so wspool's hook supplies its buffers).
SGLang's attention modules also allocate index buffers on ``"cuda"`` and pin
host copies; here those modules see a ``torch`` whose allocations land in CPU
memory (:class:`CpuTorch`), and the CPU stands in for an H200.
"""

from __future__ import annotations

import gc
import importlib
import logging
import threading
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

import wspool
from tests.helpers.devices_fake import H200
from tests.helpers.int_plans import read_plan, write_plan
from tests.helpers.mla_doubles import WrapperDouble, bind_to_flashinfer
from tests.helpers.paged_doubles import DecodeWrapperDouble, PrefillWrapperDouble, RaggedWrapperDouble
from tests.helpers.sglang_model import publish_tiny_llama
from wspool.devices import fake_device
from wspool.errors import RuleError
from wspool.flashinfer import wrapper_buffers
from wspool.flashinfer.wrapper_buffers import FLASHINFER_INT_DEFAULT_BYTES, binding_of
from wspool.integrations import sglang as sg
from wspool.integrations.sglang import facts as sf
from wspool.integrations.sglang import wrappers as sw

MiB = 1 << 20
CPU = torch.device("cpu")
VERSION = "0.5.23"
SGLANG_MISSING = "SGLang is not installed here; docs/sglang.md's recipe installs sglang==0.5.23 in .venv-sglang"
CONTEXT_LEN = 65536  # above SGLang's prefill limits here: with chunked prefill no batch reaches it
REQUESTS = 8  # the runner's request pool


class CpuTorch:
    """The ``torch`` SGLang's attention modules see here: allocations on ``"cuda"`` or pinned land in CPU memory.

    Everything else is torch itself; ``torch.cuda.get_device_properties`` describes the H200 the CPU stands in for.
    """

    cuda = SimpleNamespace(get_device_properties=lambda device: SimpleNamespace(multi_processor_count=H200.sm_count))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def _on_cpu(kwargs: dict[str, Any]) -> dict[str, Any]:
        if torch.device(kwargs.get("device") or "cpu").type == "cuda":
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return kwargs

    def empty(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.empty(*args, **self._on_cpu(kwargs))

    def zeros(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, **self._on_cpu(kwargs))

    def ones(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.ones(*args, **self._on_cpu(kwargs))

    def arange(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.arange(*args, **self._on_cpu(kwargs))


class MLAWrapperDouble(WrapperDouble):
    """``BatchMLAPagedAttentionWrapper`` as SGLang plans it: the flat positional form, and FlashInfer's mirrors.

    Each ``plan()`` builds FlashInfer's real MLA backend object (wspool's hook gives it the
    wrapper's region inside ``supplying``), writes the plan into that backend's int workspace,
    and publishes the backend's buffers and a compiled module on the wrapper, as FlashInfer
    does, for SGLang's ``fast_mla_decode_plan`` replays.
    """

    replays: ClassVar[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []

    def plan(self, *args: Any, **kwargs: Any) -> None:
        bind_to_flashinfer("BatchMLAPagedAttentionWrapper.plan", self, *args, **kwargs)
        self.plan_calls += 1
        backend = self._build_backend()
        write_plan(backend._int_workspace_buffer, [args[0], args[1], args[3]], "mla_q_indptr", self.plan_calls)
        self._planned_backend = backend
        self._int_workspace_buffer = backend._int_workspace_buffer
        self._pin_memory_int_workspace_buffer = backend._pin_memory_int_workspace_buffer
        self._cached_module = SimpleNamespace(plan=self._replay)

    def _replay(self, float_workspace: torch.Tensor, int_workspace: torch.Tensor, pinned: torch.Tensor,
                *rest: Any) -> None:  # fmt: skip
        MLAWrapperDouble.replays.append((float_workspace, int_workspace, pinned))


class SGLang(SimpleNamespace):
    """The real SGLang modules the tests call."""


@pytest.fixture(scope="module")
def srt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLang]:
    """SGLang's modules, with a tiny model's configuration published as a scheduler publishes it."""
    sglang = pytest.importorskip("sglang", reason=SGLANG_MISSING)
    if sglang.__version__ != VERSION:
        pytest.skip(f"the integration targets SGLang {VERSION}; this environment has {sglang.__version__}")

    names = {
        "rc": "sglang.srt.runtime_context",
        "paged": "sglang.srt.layers.attention.flashinfer_backend",
        "mla": "sglang.srt.layers.attention.flashinfer_mla_backend",
        "batch": "sglang.srt.model_executor.forward_batch_info",
        "utils": "sglang.srt.utils",
    }
    found = SGLang(**{key: importlib.import_module(module) for key, module in names.items()})
    publish_tiny_llama(found.rc, tmp_path_factory.mktemp("tiny-llama"))
    yield found
    found.rc.reset_context()


@pytest.fixture
def loaded(srt: SGLang, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The integration registered on SGLang's modules, with the doubles and CPU allocations, on a stand-in H200."""
    monkeypatch.setenv("WSPOOL_SGLANG_DEVICE", "cpu")
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", str(16 * MiB))  # small float pool buffers on the CPU
    monkeypatch.setattr(srt.rc.get_context(), "resources", srt.rc.Resources())
    for module in (srt.paged, srt.mla):
        monkeypatch.setattr(module, "torch", CpuTorch())
        monkeypatch.setattr(module, "BatchPrefillWithRaggedKVCacheWrapper", RaggedWrapperDouble, raising=False)
    monkeypatch.setattr(srt.paged, "BatchDecodeWithPagedKVCacheWrapper", DecodeWrapperDouble, raising=False)
    monkeypatch.setattr(srt.paged, "BatchPrefillWithPagedKVCacheWrapper", PrefillWrapperDouble, raising=False)
    monkeypatch.setattr(srt.mla, "BatchMLAPagedAttentionWrapper", MLAWrapperDouble, raising=False)
    MLAWrapperDouble.replays.clear()
    caplog.set_level(logging.INFO, logger=sw.logger.name)
    wspool.reset_registry()
    sg.register()
    assert sg.patched(), "the integration did not load"
    with fake_device("cpu", H200):
        yield
    sg.unregister()


def _runner(srt: SGLang, num_kv_heads: int = 4, *, multimodal: bool = False) -> SimpleNamespace:
    """A model runner with what SGLang's FlashInfer backends read (16 query heads, MLA geometry too)."""
    quant = SimpleNamespace(resolve_attention_access=lambda *args: None)
    model_config = SimpleNamespace(
        hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]), is_encoder_decoder=False,
        is_multimodal=multimodal, context_len=CONTEXT_LEN, num_attention_heads=16, head_dim=32, v_head_dim=32,
        get_max_num_attention_heads=lambda: 16, get_num_kv_heads=lambda *args: num_kv_heads, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, scaling=0.1,
    )  # fmt: skip
    translator = SimpleNamespace(pack_read_stream=lambda *args, **kwargs: True, needs_read_translate=False)
    return SimpleNamespace(
        model_config=model_config, device="cpu", req_to_token_pool=SimpleNamespace(size=REQUESTS),
        token_to_kv_pool=SimpleNamespace(get_kv_cache_quant_method=lambda: quant), kv_index_translator=translator,
        is_draft_worker=True, spec_algorithm=SimpleNamespace(is_frozen_kv_mtp=lambda: False),
        server_args=srt.rc.get_server_args(), prefill_attention_backend_str="triton",
        decode_attention_backend_str="triton", sliding_window_size=None, page_size=1,
        max_running_requests=REQUESTS, kv_cache_dtype=torch.bfloat16, dtype=torch.bfloat16,
    )  # fmt: skip


def _expected(rule: str, **facts: int) -> int:
    """The region a rule gives: its bytes for the facts on the stand-in H200, rounded up to 16 bytes."""
    nbytes = wrapper_buffers.int_bytes(wspool.get_registry(), rule, CPU, facts)
    return -(-nbytes // 16) * 16


def _assert_bound(wrapper: Any, nbytes: int) -> None:
    """``wrapper`` has a region of ``nbytes`` as its int workspace, and a pinned copy as large, far below 8 MiB."""
    binding = binding_of(wrapper)
    assert binding is not None, f"{type(wrapper).__name__} is not bound"
    assert binding.region.nbytes == nbytes < FLASHINFER_INT_DEFAULT_BYTES // 8
    assert wrapper._int_workspace_buffer is binding.region.tensor
    assert wrapper._pin_memory_int_workspace_buffer.numel() == nbytes


def _chunked_rows(srt: SGLang) -> int:
    """The largest extend of the published configuration, whose chunked prefill is on."""
    assert srt.rc.get_schedule().chunked_prefill_size > 0
    return max(srt.rc.get_schedule().max_prefill_tokens, srt.rc.max_prefill_buffer_tokens())


def _batch(srt: SGLang) -> int:
    """The requests SGLang's backend indptr buffers hold for the runner's pool."""
    return int(srt.utils.get_cuda_graph_max_batch_size(REQUESTS))


# -- FlashInferAttnBackend: eager wrappers ---------------------------------------------------


@pytest.mark.parametrize(("num_kv_heads", "decode_rule"), [(4, "prefill"), (8, "decode")])
def test_eager_wrappers_are_bound_when_the_constructor_returns(
    srt: SGLang, loaded: None, caplog: pytest.LogCaptureFixture, num_kv_heads: int, decode_rule: str
) -> None:
    """Decode (tensor cores: the prefill planner), paged prefill and verify wrappers get regions for SGLang's maxima."""
    backend = srt.paged.FlashInferAttnBackend(_runner(srt, num_kv_heads))
    assert backend.decode_use_tensor_cores is (decode_rule == "prefill")
    batch = _batch(srt)
    heads = {"num_qo_heads": 16, "num_kv_heads": num_kv_heads}
    rows = _chunked_rows(srt)
    (decode,) = backend.decode_wrappers
    _assert_bound(decode, _expected(decode_rule, batch_size=batch, num_tokens=batch, **heads))
    for wrapper in (*backend.prefill_wrappers_paged, *backend.prefill_wrappers_verify):
        _assert_bound(wrapper, _expected("prefill", batch_size=batch, num_tokens=rows, **heads))
    # SGLang builds the ragged wrapper with backend "auto" off SM100: no rule bounds its planner.
    ragged = backend.prefill_wrapper_ragged
    assert binding_of(ragged) is None and ragged._int_workspace_buffer.numel() == FLASHINFER_INT_DEFAULT_BYTES
    assert "FlashInferAttnBackend's FlashInfer wrappers take int workspaces from pool flashinfer_int" in caplog.text
    assert "FlashInfer's own: ragged (auto)" in caplog.text
    assert "3 wrapper(s) (sglang-decode 1, sglang-prefill 2)" in wspool.get_registry().memory_summary()


def test_a_ragged_wrapper_built_with_fa2_is_bound(srt: SGLang, loaded: None) -> None:
    """On SM100 SGLang builds its ragged prefill wrapper with fa2 for head sizes cutlass lacks: the prefill rule."""
    with srt.rc.override_platform(is_sm100=True):
        backend = srt.paged.FlashInferAttnBackend(_runner(srt))
    assert backend.prefill_wrapper_ragged._backend == "fa2"
    nbytes = _expected(
        "prefill", batch_size=_batch(srt), num_tokens=_chunked_rows(srt), num_qo_heads=16, num_kv_heads=4
    )
    _assert_bound(backend.prefill_wrapper_ragged, nbytes)


def test_a_multimodal_model_may_extend_a_whole_context(srt: SGLang, loaded: None) -> None:
    """SGLang may run a multimodal model's prompts whole despite chunked prefill: its context bounds the extend."""
    backend = srt.paged.FlashInferAttnBackend(_runner(srt, multimodal=True))
    nbytes = _expected("prefill", batch_size=_batch(srt), num_tokens=CONTEXT_LEN, num_qo_heads=16, num_kv_heads=4)
    assert nbytes > _expected("prefill", batch_size=_batch(srt), num_tokens=_chunked_rows(srt), num_qo_heads=16,
                              num_kv_heads=4)  # fmt: skip
    _assert_bound(backend.prefill_wrappers_paged[0], nbytes)


def test_new_workspace_backends_and_draft_steps_are_bound(srt: SGLang, loaded: None) -> None:
    """init_new_workspace=True binds in its own lane; a draft step's backend sizes for its (topk-wide) indptr."""
    private = srt.paged.FlashInferAttnBackend(_runner(srt), init_new_workspace=True)
    binding = binding_of(private.decode_wrappers[0])
    assert binding is not None and binding.region.lane.startswith("sglang-new-workspace-")
    wide = torch.zeros(4 * REQUESTS + 1, dtype=torch.int32)  # a multi-step draft's row: max_bs x topk requests
    step = srt.paged.FlashInferAttnBackend(_runner(srt), skip_prefill=True, kv_indptr_buf=wide)
    facts = {"batch_size": 4 * REQUESTS, "num_tokens": 4 * REQUESTS, "num_qo_heads": 16, "num_kv_heads": 4}
    _assert_bound(step.decode_wrappers[0], _expected("prefill", **facts))


def test_unpublished_limits_leave_prefill_wrappers_to_flashinfer(
    srt: SGLang, loaded: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Where SGLang's limits cannot be read, the prefill wrappers keep FlashInfer's buffers; decode is bound."""
    sf.set_context_readers(srt.rc.get_parallel, srt.rc.get_spec)  # as loaded, less the scheduling limits
    backend = srt.paged.FlashInferAttnBackend(_runner(srt))
    assert binding_of(backend.decode_wrappers[0]) is not None
    assert all(binding_of(w) is None for w in (*backend.prefill_wrappers_paged, *backend.prefill_wrappers_verify))
    assert caplog.text.count("scheduling limits (max_prefill_tokens) are not published") == 1


def test_a_bad_rule_names_the_setting_and_the_facts(srt: SGLang, loaded: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flashinfer_int rule that reads a fact the integration does not give fails the constructor, naming both."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_INT__RULES__PREFILL", "num_tokens * page_size")
    wspool.reset_registry()
    with pytest.raises(RuleError, match=r"(?s)pools\.flashinfer_int\.rules\.prefill.*page_size.*for SGLang's "
                       r"(decode|prefill) wrapper the integration passes batch_size="):  # fmt: skip
        srt.paged.FlashInferAttnBackend(_runner(srt))


# -- FlashInferAttnBackend: CUDA-graph wrappers ----------------------------------------------


def _graph_backend(srt: SGLang) -> Any:
    backend = srt.paged.FlashInferAttnBackend(_runner(srt))
    backend.init_cuda_graph_state(_batch(srt), 4 * _batch(srt))
    return backend


def test_graph_wrappers_are_bound_when_capture_prepares_them(srt: SGLang, loaded: None) -> None:
    """Decode and verify graph wrappers get regions for their captured batch and tokens, before their first plan."""
    backend = _graph_backend(srt)
    mode = srt.batch.ForwardMode
    heads = {"num_qo_heads": 16, "num_kv_heads": 4}
    for bs in (4, 1):
        (wrapper,) = backend.get_cuda_graph_decode_wrappers(bs=bs, num_tokens=bs)
        assert wrapper.init_kwargs["use_cuda_graph"] and wrapper.plan_calls == 0
        _assert_bound(wrapper, _expected("prefill", batch_size=bs, num_tokens=bs, **heads))
    backend._prepare_cuda_graph_metadata(2, 8, mode.TARGET_VERIFY, None)  # 2 requests x 4 draft tokens
    (verify,) = backend.prefill_cuda_graph_metadata[2]
    _assert_bound(verify, _expected("prefill", batch_size=2, num_tokens=8, **heads))
    backend._prepare_cuda_graph_metadata(2, 6, mode.DRAFT_EXTEND_V2, None)
    (draft,) = backend.draft_extend_cuda_graph_metadata[2]
    _assert_bound(draft, _expected("prefill", batch_size=2, num_tokens=6, **heads))
    graph = (backend.decode_cuda_graph_metadata[4][0], backend.decode_cuda_graph_metadata[1][0], verify, draft)
    regions = {id(binding.region) for w in (backend.decode_wrappers[0], *graph) if (binding := binding_of(w))}
    assert len(regions) == 5  # a region per wrapper: engine wrappers never share


def test_full_graph_prefill_wrappers_are_bound_once_for_the_largest_bucket(srt: SGLang, loaded: None) -> None:
    """Full-graph prefill reuses one wrapper set for every bucket: bound for the first (largest), never rebound."""
    backend = _graph_backend(srt)
    extend = srt.batch.ForwardMode.EXTEND
    backend._prepare_cuda_graph_metadata(1, 64, extend, None)
    (wrapper,) = backend.full_cg_prefill_wrappers
    assert wrapper.workspace is backend.full_cg_prefill_workspace_buffer  # SGLang's own, given back unchanged
    nbytes = _expected("prefill", batch_size=1, num_tokens=64, num_qo_heads=16, num_kv_heads=4)
    _assert_bound(wrapper, nbytes)
    region = binding_of(wrapper).region  # type: ignore[union-attr]
    backend._prepare_cuda_graph_metadata(1, 512, extend, None)  # a later bucket: the captured address stays
    assert backend.full_cg_prefill_wrappers == [wrapper] and binding_of(wrapper).region is region  # type: ignore[union-attr]


# -- FlashInferMLAAttnBackend ----------------------------------------------------------------


def _mla_bytes() -> int:
    return _expected("mla")


def _decode_batch(srt: SGLang, bs: int, **more: Any) -> SimpleNamespace:
    seq_lens = torch.full((bs,), 5, dtype=torch.int32)
    return SimpleNamespace(
        batch_size=bs, req_pool_indices=torch.arange(bs), seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
        seq_lens_sum=int(seq_lens.sum()), forward_mode=srt.batch.ForwardMode.DECODE, spec_info=None,
        positions=torch.zeros(bs, dtype=torch.int64), kv_loc_plan=None, **more,
    )  # fmt: skip


def _assert_planned_in_region(wrapper: Any) -> None:
    """The MLA backend built at the last plan took the wrapper's region and pinned copy, and holds the plan."""
    binding = binding_of(wrapper)
    assert binding is not None and binding.region.nbytes == _mla_bytes() < FLASHINFER_INT_DEFAULT_BYTES // 8
    backend = wrapper._planned_backend
    assert backend._int_workspace_buffer is binding.region.tensor
    assert backend._pin_memory_int_workspace_buffer is binding.pinned
    assert read_plan(binding.region.tensor)[0] == wrapper.plan_calls


def test_mla_graph_wrapper_is_bound_before_its_first_plan_and_replays_in_it(srt: SGLang, loaded: None) -> None:
    """A decode graph wrapper: bound at its capture plan, which runs in its region; SGLang's replays plan there too."""
    backend = srt.mla.FlashInferMLAAttnBackend(_runner(srt))
    backend.init_cuda_graph_state(_batch(srt), _batch(srt))
    backend.init_forward_metadata_out_graph(_decode_batch(srt, 4), in_capture=True)
    wrapper = backend.decode_cuda_graph_metadata[4]
    assert isinstance(wrapper, MLAWrapperDouble) and wrapper.plan_calls == 1
    _assert_planned_in_region(wrapper)
    binding = binding_of(wrapper)
    assert binding is not None
    backend.init_forward_metadata_out_graph(_decode_batch(srt, 4))  # a replay's metadata: fast_mla_decode_plan
    assert len(MLAWrapperDouble.replays) == 2  # the capture's own replay plan, then this one
    for _, int_workspace, pinned in MLAWrapperDouble.replays:
        assert int_workspace is binding.region.tensor and pinned is binding.pinned
    backend.init_forward_metadata_out_graph(_decode_batch(srt, 2), in_capture=True)
    other = binding_of(backend.decode_cuda_graph_metadata[2])
    assert other is not None and other.region is not binding.region  # one region per wrapper, never shared


def test_mla_eager_wrappers_are_bound_at_their_first_plan(srt: SGLang, loaded: None) -> None:
    """Eager decode and paged prefill wrappers: bound when SGLang first plans them, the same region every step."""
    backend = srt.mla.FlashInferMLAAttnBackend(_runner(srt))
    wrappers = (backend.decode_wrapper, backend.prefill_wrapper_paged, backend.prefill_wrapper_verify)
    assert all(binding_of(w) is None for w in wrappers)  # FlashInfer's MLA wrapper holds nothing until it plans
    for _ in range(2):
        backend.init_forward_metadata(_decode_batch(srt, 3))
        _assert_planned_in_region(backend.decode_wrapper)
    first = binding_of(backend.decode_wrapper)
    assert backend.decode_wrapper.plan_calls == 2 and binding_of(backend.decode_wrapper) is first
    prefix = torch.tensor([2, 0, 1])
    extend = _decode_batch(
        srt, 3, extend_prefix_lens=prefix, extend_prefix_lens_cpu=prefix.tolist(), attn_dcp_metadata=None
    )
    extend.forward_mode = srt.batch.ForwardMode.EXTEND
    backend.init_forward_metadata(extend)  # a prefix: the paged MLA wrapper, not the ragged one
    _assert_planned_in_region(backend.prefill_wrapper_paged)
    assert binding_of(backend.prefill_wrapper_verify) is None  # never planned without speculative decoding
    regions = {id(binding_of(w).region) for w in wrappers[:2]}  # type: ignore[union-attr]
    assert len(regions) == 2


def test_mla_wrappers_keep_flashinfers_buffers_where_the_hook_is_not_in_place(
    srt: SGLang, loaded: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a FlashInfer whose MLA backend wspool has not read, the plan runs as FlashInfer wrote it; said once."""
    monkeypatch.setattr(wrapper_buffers, "install_mla_hook", lambda: "FlashInfer 9.9 is not a version wspool read")
    backend = srt.mla.FlashInferMLAAttnBackend(_runner(srt))
    for _ in range(2):
        backend.init_forward_metadata(_decode_batch(srt, 3))
    assert binding_of(backend.decode_wrapper) is None
    assert backend.decode_wrapper._int_workspace_buffer.numel() == FLASHINFER_INT_DEFAULT_BYTES
    assert caplog.text.count("MLA wrappers keep FlashInfer's int workspaces: FlashInfer 9.9 is not") == 1


def test_a_registry_that_keeps_flashinfers_buffers_binds_nothing(
    srt: SGLang, loaded: None, caplog: pytest.LogCaptureFixture
) -> None:
    """With keep_flashinfer_buffers (comparisons against FlashInfer's defaults) every wrapper keeps its own pair."""
    wrapper_buffers.keep_flashinfer_buffers(wspool.get_registry())
    backend = srt.paged.FlashInferAttnBackend(_runner(srt))
    wrappers = (*backend.decode_wrappers, *backend.prefill_wrappers_paged, *backend.prefill_wrappers_verify)
    assert all(binding_of(w) is None for w in wrappers)
    assert all(w._int_workspace_buffer.numel() == FLASHINFER_INT_DEFAULT_BYTES for w in wrappers)
    assert "FlashInfer's own: decode (the registry keeps FlashInfer's buffers)" in caplog.text
    mla = srt.mla.FlashInferMLAAttnBackend(_runner(srt))
    mla.init_forward_metadata(_decode_batch(srt, 3))
    assert binding_of(mla.decode_wrapper) is None
    assert mla.decode_wrapper._int_workspace_buffer.numel() == FLASHINFER_INT_DEFAULT_BYTES
    assert "MLA wrappers keep FlashInfer's int workspaces: the registry keeps FlashInfer's buffers" in caplog.text


# -- unregistering ---------------------------------------------------------------------------


def test_unregister_restores_sglang(srt: SGLang, loaded: None) -> None:
    """After unregister() the seams are SGLang's own, and new wrappers keep FlashInfer's 8 MiB."""
    sg.unregister()
    for seam in sw.SEAMS:
        module, path = seam.module, seam.path
        cls_name, attr = path.split(".")
        method = vars(getattr(importlib.import_module(module), cls_name))[attr]
        assert not hasattr(method, "__wrapped__"), path
    assert not hasattr(vars(srt.paged.FlashInferAttnBackend)["__init__"], "__wrapped__")
    backend = srt.paged.FlashInferAttnBackend(_runner(srt))
    assert binding_of(backend.decode_wrappers[0]) is None
    assert backend.decode_wrappers[0]._int_workspace_buffer.numel() == FLASHINFER_INT_DEFAULT_BYTES
    mla = srt.mla.FlashInferMLAAttnBackend(_runner(srt))
    mla.init_forward_metadata(_decode_batch(srt, 3))
    assert binding_of(mla.decode_wrapper) is None
    assert mla.decode_wrapper._int_workspace_buffer.numel() == FLASHINFER_INT_DEFAULT_BYTES


def test_the_mla_decode_seam_supplies_each_wrappers_own_binding_and_lets_a_dead_ones_go(
    srt: SGLang, loaded: None
) -> None:
    """Alternating wrappers each plan with their own binding, on the calling thread; a dead one's region is freed."""
    supplied: list[object] = []

    def original(self: object, wrapper: object, *args: object, **kwargs: object) -> None:
        supplied.append(wrapper_buffers.SUPPLIED_BY_THREAD.get(threading.get_ident()))

    seam = sw.supplying_mla_decode(original)
    first, second = _Stand(), _Stand()
    registry, cpu = wspool.get_registry(), torch.device("cpu")
    bindings = [
        wrapper_buffers.bind_mla_wrapper(w, registry=registry, device=cpu, lane="main", facts={"sm_count": 132})
        for w in (first, second)
    ]
    for wrapper in (first, second, first, first):
        seam(None, wrapper, None, 0, None, None, plan=None, req_pool_indices=None)
    assert supplied == [bindings[0], bindings[1], bindings[0], bindings[0]] and bindings[0] is not None
    assert wrapper_buffers.SUPPLIED_BY_THREAD.get(threading.get_ident()) is None
    region = weakref.ref(bindings[0].region)
    del first, bindings, wrapper
    supplied.clear()
    gc.collect()
    assert region() is None


class _Stand:
    """Stands in for an MLA wrapper: wspool binds any object, held weakly."""
