"""Tests for wspool.integrations.vllm.getters: the replacements' logic on the CPU, without vLLM."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

import wspool
from tests.helpers.dcp_config import use_lse_rule_without_facts
from tests.helpers.paths import REPO_ROOT
from wspool.errors import ConfigError, RuleError, WorkspaceFrozenError
from wspool.integrations.vllm import getters as ws
from wspool.integrations.vllm.facts import call_facts
from wspool.integrations.vllm.internals import VllmLanes

MiB = 1 << 20
CPU = torch.device("cpu")


@pytest.fixture
def vg() -> ws.VllmGetters:
    """The replacements on the CPU, as WSPOOL_VLLM_DEVICE=cpu makes them, with no vLLM hooks."""
    return ws.VllmGetters(device="cpu")


def _small(**pools: Any) -> wspool.PoolRegistry:
    """Install a registry with small MLA sizes (and any other pools given) as the default one."""
    reg = wspool.PoolRegistry.from_config(
        pools={"flashinfer_mla": {"rules": {"default": "1MiB", "lse": "2MiB"}}, **pools}
    )
    wspool.set_registry(reg)
    return reg


def _builder(**attrs: Any) -> SimpleNamespace:
    base = {"_workspace_buffer": None, "device": CPU, "max_num_batched_tokens": 8, "num_qo_heads": 8}
    return SimpleNamespace(**{**base, "head_dim": 64, **attrs})


def test_mla_view_is_int8_and_cached_per_buffer(vg: ws.VllmGetters) -> None:
    """The MLA workspace is one int8 view per buffer: the same tensor until the pool grows, then a new one."""
    reg = _small()
    first = vg.get_mla_workspace_buffer(False)
    assert (first.dtype, first.numel()) == (torch.int8, MiB) and vg.get_mla_workspace_buffer(False) is first
    grown = vg.get_mla_workspace_buffer(True)
    assert grown is not first and grown.numel() == 2 * MiB
    assert grown.data_ptr() == reg.pool("flashinfer_mla", "cpu").buffer.data_ptr()  # type: ignore[union-attr]


def test_reset_drops_the_buffers_the_getters_hold(vg: ws.VllmGetters) -> None:
    """After reset() the getter binds again: a new buffer from the reset registry, not the one it held."""
    reg = _small()
    first = vg.get_mla_workspace_buffer(False)
    assert reg.peek_state(ws.VllmPools) is not None
    reg.reset()
    assert reg.peek_state(ws.VllmPools) is None
    second = vg.get_mla_workspace_buffer(False)
    assert second is not first and second.data_ptr() == reg.stats("flashinfer_mla", "cpu").capacity_bytes * 0 + (
        reg.pool("flashinfer_mla", "cpu").buffer.data_ptr()  # type: ignore[union-attr]
    )


def test_plugin_pools_are_declared_below_the_configuration(vg: ws.VllmGetters) -> None:
    """The plugin's rules apply unless configured; a configured rule of the same name wins."""
    reg = _small(flashinfer={"rules": {"vllm": "3MiB"}})
    vg.get_multi_ctas_kv_counter_buffer(64, CPU)
    assert reg.resolve("flashinfer", "vllm") == 3 * MiB
    assert reg.resolve("flashinfer", "vllm_batch_invariant") == 2048 * MiB
    assert reg.resolve("flashinfer_mla_sparse", "default") == 394 * MiB
    assert reg.resolve("flashinfer_mla_counters", "counters", min_bytes=77) == 77


def test_configs_vllm_yaml_writes_out_the_declared_rules() -> None:
    """configs/vllm.yaml carries the plugin's declared rules and the MLA sizes it keeps."""
    data = yaml.safe_load((Path(REPO_ROOT) / "configs" / "vllm.yaml").read_text())
    rules = {pool: config["rules"] for pool, config in data["pools"].items()}
    assert rules == {**ws.VLLM_POOLS, "flashinfer_mla": {"default": "128MiB", "lse": "256MiB"}}


def test_counters_pool_must_not_share_a_buffer(vg: ws.VllmGetters) -> None:
    """Counters configured to share another pool's buffer are refused, naming the setting."""
    _small(flashinfer_mla_counters={"shared_with": "flashinfer_mla"})
    with pytest.raises(ConfigError, match=r"pool 'flashinfer_mla_counters' must have its own buffer.*SHARED_WITH"):
        vg.get_multi_ctas_kv_counter_buffer(64, CPU)


def test_counters_grow_to_min_bytes_and_refuse_when_frozen(vg: ws.VllmGetters) -> None:
    """The counters grow to a larger min_bytes, zeroed; frozen, such a growth is refused."""
    reg = _small()
    assert vg.get_multi_ctas_kv_counter_buffer(128, CPU).numel() == 128
    assert int(vg.get_multi_ctas_kv_counter_buffer(256, CPU).count_nonzero()) == 0
    reg.freeze()
    assert vg.get_multi_ctas_kv_counter_buffer(200, CPU).numel() == 256
    with pytest.raises(WorkspaceFrozenError, match=r"flashinfer_mla_counters.*while the registry is frozen"):
        vg.get_multi_ctas_kv_counter_buffer(512, CPU)


def test_sparse_floor_grows_past_the_rule(vg: ws.VllmGetters) -> None:
    """Sparse MLA serves the rule's size, or min_bytes where that is larger, as int8."""
    _small(flashinfer_mla_sparse={"rules": {"default": "1MiB"}})
    assert vg.get_sparse_workspace_buffer(CPU).numel() == MiB
    floor = vg.get_sparse_workspace_buffer(CPU, 3 * MiB)
    assert (floor.dtype, floor.numel()) == (torch.int8, 3 * MiB)
    assert vg.get_sparse_workspace_buffer(CPU, MiB) is floor


def test_paged_rule_floor_and_batch_invariant_hook(vg: ws.VllmGetters) -> None:
    """The builder gets rule vllm, grown to vLLM's prefill floor; the batch-invariant hook picks the other rule."""
    reg = _small(flashinfer={"shared_with": "", "rules": {"vllm": "1MiB", "vllm_batch_invariant": "5MiB"}})
    assert vg.get_paged_workspace_buffer(_builder(), 16).numel() == MiB
    wide = _builder(max_num_batched_tokens=64, num_qo_heads=32, head_dim=128)  # 64 * 32 * 128 * 16 = 4 MiB
    assert vg.get_paged_workspace_buffer(wide, 16).numel() == 4 * MiB
    assert vg.get_paged_workspace_buffer(_builder(max_num_batched_tokens=None), 16).numel() == 4 * MiB
    vg = ws.VllmGetters(device="cpu", batch_invariant=lambda: True)
    assert vg.get_paged_workspace_buffer(_builder(), 16).numel() == 5 * MiB
    assert dict(reg.stats("flashinfer", "cpu").requests_by_rule) == {
        "vllm": 3,
        "vLLM's prefill floor": 1,
        "vllm_batch_invariant": 1,
    }


def test_paged_keeps_a_buffer_vllm_set(vg: ws.VllmGetters) -> None:
    """A buffer set on the builder (vLLM's set_workspace_buffer) is returned as it is."""
    _small()
    mine = torch.zeros(8, dtype=torch.uint8)
    assert vg.get_paged_workspace_buffer(_builder(_workspace_buffer=mine)) is mine


def test_vllm_lanes_select_wspool_lanes() -> None:
    """vLLM's (ubatch, lane) (0, 0) is wspool's current lane; any other is its own lane, with its own buffer."""
    reg = _small()
    where: list[tuple[int, int]] = [(0, 0)]
    vg = ws.VllmGetters(device="cpu", lanes=VllmLanes({}, lambda: where[0][1], lambda: where[0][0]))
    main = vg.get_mla_workspace_buffer(False)
    with wspool.lane("mine"):
        assert vg.get_mla_workspace_buffer(False) is not main
    where[0] = (1, 2)
    assert vg.get_mla_workspace_buffer(False) is not main
    assert {s.lane for s in reg.all_stats()} == {"main", "mine", "vllm-u1-l2"}


def test_facts_from_the_config_reach_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the DCP rule, the configuration's facts size the LSE workspace; a new config object is read again."""
    monkeypatch.setenv("WSPOOL_CONFIG", str(REPO_ROOT / "configs" / "kimi_dcp.yaml"))
    wspool.reset_registry()
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(decode_context_parallel_size=2),
        scheduler_config=SimpleNamespace(max_num_seqs=16),
        model_config=SimpleNamespace(get_num_attention_heads=lambda parallel: 4, dtype=torch.bfloat16),
        speculative_config=None,
    )
    current = [config]
    vg = ws.VllmGetters(device="cpu", get_config=lambda: current[0])
    vg.get_mla_workspace_buffer(True)
    reg = wspool.get_registry()
    assert reg.stats("flashinfer_mla", "cpu").peak_request_bytes == 8 * 4 * 2 * 16 * 256 + MiB + 32 * MiB
    current[0] = SimpleNamespace(**{**vars(config), "scheduler_config": SimpleNamespace(max_num_seqs=64)})
    vg.get_mla_workspace_buffer(True)
    assert reg.stats("flashinfer_mla", "cpu").peak_request_bytes == 8 * 4 * 2 * 64 * 256 + MiB + 32 * MiB


def test_missing_facts_name_what_the_plugin_knows(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A rule that reads facts nobody gave fails naming the facts known and unknown."""
    rule = "8 * num_heads * batch_size * round_up(q_len, 256) + 1MiB"  # num_heads: no call has given it yet
    use_lse_rule_without_facts(monkeypatch, tmp_path, rule)
    vg = ws.VllmGetters(
        device="cpu", get_config=lambda: SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8))
    )
    with pytest.raises(
        RuleError, match=r"plugin passes the facts it knows: batch_size=8, q_len=1; unknown here: num_heads, cp_world,"
    ):
        vg.get_mla_workspace_buffer(True)


def test_forward_mqa_wrapper_sets_and_restores_call_facts(vg: ws.VllmGetters) -> None:
    """The wrapper gives the call's heads and DCP size to the rules during the call, and clears them after."""
    _small(flashinfer_mla={"rules": {"default": "1MiB", "lse": "num_heads * cp_world * 1KiB"}})
    seen: list[object] = []

    def forward_mqa(self: Any, q: Any, kv: Any, metadata: Any, layer: Any) -> str:
        seen.append(dict(call_facts() or {}))
        if metadata == "fail":
            raise RuntimeError("kernel failed")
        return "out"

    wrapped = vg.wrap_forward_mqa(forward_mqa)
    impl = SimpleNamespace(dcp_world_size=4)
    q = (torch.zeros(2, 32, 8), torch.zeros(2, 32, 4))
    assert wrapped(impl, q, None, None, None) == "out"
    assert seen == [{"q_heads": 32, "num_heads": 8, "cp_world": 4}] and call_facts() is None
    with pytest.raises(RuntimeError, match="kernel failed"):
        wrapped(impl, torch.zeros(2, 16, 8), None, "fail", None)
    assert call_facts() is None and wrapped.__wrapped__ is forward_mqa


def test_forward_mqa_passes_straight_through_when_no_rule_reads_its_facts(vg: ws.VllmGetters) -> None:
    """With fixed MLA rules the wrapper records nothing: the call goes to vLLM's method as it is."""
    _small()
    seen: list[object] = []

    def forward_mqa(self: Any, q: Any, kv: Any, metadata: Any, layer: Any) -> str:
        seen.append(call_facts())
        return "out"

    wrapped = vg.wrap_forward_mqa(forward_mqa)
    assert not vg.mla_reads_call_facts()
    assert wrapped(SimpleNamespace(dcp_world_size=4), torch.zeros(2, 32, 8), None, None, None) == "out"
    assert seen == [None]


def test_call_facts_fill_in_what_the_config_lacks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Inside forward_mqa the heads come from the query where the configuration has none."""
    use_lse_rule_without_facts(monkeypatch, tmp_path)
    vg = ws.VllmGetters(
        device="cpu", get_config=lambda: SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8))
    )

    def forward_mqa(self: Any, q: Any, kv: Any, metadata: Any, layer: Any) -> torch.Tensor:
        return vg.get_mla_workspace_buffer(True)

    with pytest.raises(RuleError, match=r"needs fact\(s\) num_heads "):
        vg.get_mla_workspace_buffer(True)
    vg.wrap_forward_mqa(forward_mqa)(SimpleNamespace(dcp_world_size=2), torch.zeros(8, 16, 4), None, None, None)
    assert wspool.get_registry().stats("flashinfer_mla", "cpu").peak_request_bytes == 8 * 8 * 2 * 8 * 256 + 33 * MiB


def _dcp_config(*, seqs: int, speculative: int, batched: int, heads: int, dcp: int) -> SimpleNamespace:
    """An object with the attributes of a VllmConfig the facts read."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp),
        scheduler_config=SimpleNamespace(max_num_seqs=seqs, max_num_batched_tokens=batched),
        model_config=SimpleNamespace(get_num_attention_heads=lambda parallel: heads, dtype=torch.bfloat16),
        speculative_config=SimpleNamespace(num_speculative_tokens=speculative),
    )


def _use_kimi_dcp(
    monkeypatch: pytest.MonkeyPatch, config: SimpleNamespace
) -> tuple[wspool.PoolRegistry, ws.VllmGetters]:
    """configs/kimi_dcp.yaml's DCP rule, a registry that allocates nothing, and getters reading ``config``."""
    monkeypatch.setenv("WSPOOL_CONFIG", str(REPO_ROOT / "configs" / "kimi_dcp.yaml"))
    wspool.reset_registry()
    meta = wspool.PoolRegistry(allocator=lambda n, d: torch.empty(n, dtype=torch.uint8, device="meta"))
    wspool.set_registry(meta)
    return meta, ws.VllmGetters(device="cpu", get_config=lambda: config)


def test_ragged_dcp_call_is_sized_for_a_row_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ragged causal DCP step gets the LSE workspace of min(seqs * (1 + k), batched tokens) single-token rows.

    DCP 4 with 8 heads per rank, 256 sequences, 3 speculative tokens, 8192 batched tokens: the
    kernel sees up to 1024 rows of 32 heads, 8 * 32 * 1024 * 256 B = 64 MiB of softmax slab
    (+ 33 MiB), where the configuration's 256 request rows would give 16 MiB.
    """
    reg, vg = _use_kimi_dcp(monkeypatch, _dcp_config(seqs=256, speculative=3, batched=8192, heads=8, dcp=4))

    def forward_mqa(self: Any, q: Any, kv: Any, metadata: Any, layer: Any) -> torch.Tensor:
        return vg.get_mla_workspace_buffer(True)

    wrapped = vg.wrap_forward_mqa(forward_mqa)
    impl = SimpleNamespace(dcp_world_size=4)
    uniform = SimpleNamespace(num_decodes=5, num_decode_tokens=20, causal=True, decode=SimpleNamespace(max_query_len=4))
    wrapped(impl, torch.zeros(20, 32, 8, device="meta"), None, uniform, None)
    assert reg.stats("flashinfer_mla", "cpu").peak_request_bytes == 8 * 32 * 256 * 256 + 33 * MiB
    ragged = SimpleNamespace(num_decodes=5, num_decode_tokens=11, causal=True, decode=SimpleNamespace(max_query_len=4))
    wrapped(impl, torch.zeros(11, 32, 8, device="meta"), None, ragged, None)
    assert reg.stats("flashinfer_mla", "cpu").peak_request_bytes == 8 * 32 * 1024 * 256 + 33 * MiB == 97 * MiB


def test_a_call_from_no_wrapped_site_gets_the_widest_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside forward_mqa, the LSE workspace is sized for the most rows any layout has at the full q_len."""
    reg, vg = _use_kimi_dcp(monkeypatch, _dcp_config(seqs=256, speculative=3, batched=8192, heads=8, dcp=4))
    vg.get_mla_workspace_buffer(True)
    assert reg.stats("flashinfer_mla", "cpu").peak_request_bytes == 8 * 8 * 4 * 1024 * 256 + 33 * MiB


def fold_plan(k: int, heads: int, need_lse: bool, cake_ok: bool) -> tuple[int, str]:
    """vLLM 0.34's drafter rule: all k tokens without an LSE, else the most with fold * heads <= 128.

    wrap_folded_decode reads ``fold_plan`` from the wrapped function's module, as in vLLM.
    """
    if not need_lse:
        return k, "cake" if cake_ok else "auto"
    return max(d for d in range(1, k + 1) if k % d == 0 and d * heads <= 128), "cute-dsl"


def folded_decode(
    q: Any,
    kv_cache: Any,
    block_table: Any,
    seq_lens: Any,
    max_seq_len: int,
    tokens_per_request: int,
    *,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    bmm1_scale: float,
    bmm2_scale: float,
    workspace: torch.Tensor,
    return_lse: bool = False,
    dcp_world_size: int = 1,
    dcp_rank: int = 0,
    dcp_tot_seq_lens: Any = None,
    max_reqs: int = 0,
    backend: str | None = None,
    table_cache: Any = None,
) -> torch.Tensor:
    """A stand-in for vLLM 0.34's drafter folded_decode (its parameters): returns the workspace it got."""
    return workspace


_SCALES = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "bmm1_scale": 1.0, "bmm2_scale": 1.0}


def test_folded_draft_decode_passes_straight_through_where_no_rule_reads_the_call(vg: ws.VllmGetters) -> None:
    """With MLA rules that read no call fact, the drafter's call reaches folded_decode as made: no pool is asked."""
    reg = _small()
    wrapped = vg.wrap_folded_decode(folded_decode)
    pool_view = vg.get_mla_workspace_buffer(True)
    before = dict(reg.stats("flashinfer_mla", "cpu").requests_by_rule)
    q = torch.zeros(12, 32, 576, device="meta")
    assert wrapped(q, None, None, None, 1024, 4, workspace=pool_view, return_lse=True, **_SCALES) is pool_view
    assert not vg.mla_reads_call_facts() and dict(reg.stats("flashinfer_mla", "cpu").requests_by_rule) == before


def test_folded_draft_decode_gets_a_workspace_for_the_folded_query(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kimi K3's draft decode under DCP folds 4 tokens into 128 heads: the pool's buffer follows that shape.

    DCP 4, 8 heads per rank (32 after the gather), 64 sequences, 4-token draft blocks: fold_plan
    folds 4 tokens (4 * 32 = 128 heads), so at most min(64 * 4, 8192) / 4 = 64 rows of 128 heads.
    """
    reg, vg = _use_kimi_dcp(monkeypatch, _dcp_config(seqs=64, speculative=3, batched=8192, heads=8, dcp=4))
    wrapped = vg.wrap_folded_decode(folded_decode)
    q = torch.zeros(12, 32, 576, device="meta")  # 3 requests x 4 draft tokens, 32 heads after the gather
    args = (q, None, None, None, 1024, 4)
    # A buffer of vLLM's own (the CAKE workspace) passes through untouched.
    mine = torch.zeros(16, dtype=torch.int8)
    assert wrapped(*args, workspace=mine, return_lse=True, dcp_world_size=4, **_SCALES) is mine
    assert [p.capacity_bytes for p in reg.pools()] in ([], [0])  # nothing allocated
    # The pool's view, fetched before the fold, is asked for again with the folded kernel's facts.
    before = vg.get_mla_workspace_buffer(True)
    got = wrapped(*args, workspace=before, return_lse=True, dcp_world_size=4, **_SCALES)
    assert got is vg.get_mla_workspace_buffer(True) and got.dtype == torch.int8
    folded = 8 * 32 * 4 * 64 * 256 + 33 * MiB  # 8 * num_heads * cp_world * rows * round_up(1, 256) + ...
    seen = reg.stats("flashinfer_mla", "cpu")
    assert dict(seen.requests_by_rule) == {"lse": 3} and seen.peak_request_bytes == folded == 49 * MiB
    # Without an LSE every token of a request folds, under the default rule.
    plain = vg.get_mla_workspace_buffer(False)
    assert wrapped(*args, workspace=plain, **_SCALES) is vg.get_mla_workspace_buffer(False)


def test_folded_draft_decode_sizes_from_the_folded_heads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A rule that reads the kernel's heads sees fold * heads over rows / fold, not a token's own heads."""
    use_lse_rule_without_facts(monkeypatch, tmp_path, "q_heads * batch_size * 1KiB")
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_MLA__RULES__DEFAULT", "1KiB")
    wspool.reset_registry()
    vg = ws.VllmGetters(
        device="cpu", get_config=lambda: _dcp_config(seqs=64, speculative=3, batched=8192, heads=8, dcp=4)
    )
    with pytest.raises(RuleError, match=r"needs fact\(s\) q_heads"):
        vg.get_mla_workspace_buffer(True)  # outside a call site nobody knows the kernel's heads
    q = torch.zeros(12, 32, 576, device="meta")
    plain = vg.get_mla_workspace_buffer(False)
    got = vg.wrap_folded_decode(folded_decode)(
        q, None, None, None, 1024, 4, workspace=plain, return_lse=True, dcp_world_size=4, **_SCALES
    )
    # 64 rows of 4 * 32 = 128 heads: 8 MiB.
    assert got.numel() == 128 * 64 * 1024 == wspool.get_registry().stats("flashinfer_mla", "cpu").peak_request_bytes


def test_dsv4_workspace_is_its_own_zeroed_uint8_buffer(vg: ws.VllmGetters) -> None:
    """DeepSeek V4's sparse workspace: uint8, zeroed, 128 MiB by default, the same tensor while it suffices."""
    reg = _small(flashinfer_dsv4={"rules": {"default": "2MiB"}})
    buffer = vg.get_dsv4_workspace(CPU)
    assert (buffer.dtype, buffer.numel(), int(buffer.count_nonzero())) == (torch.uint8, 2 * MiB, 0)
    buffer[0] = 7  # a kernel's counter: wspool never clears it
    assert vg.get_dsv4_workspace(CPU) is buffer and int(buffer[0]) == 7
    assert reg.buffer_pool("flashinfer_dsv4") == "flashinfer_dsv4"
    fresh = _small()
    vg.get_dsv4_workspace(CPU)
    assert fresh.resolve("flashinfer_dsv4", "default") == 128 * MiB


def test_dsv4_workspace_refuses_to_share_a_buffer(vg: ws.VllmGetters) -> None:
    """The DSv4 pool configured to share another pool's buffer is refused, naming the setting."""
    _small(flashinfer_dsv4={"shared_with": "flashinfer_mla_counters"}, flashinfer_mla_counters={"rules": {"c": "1"}})
    with pytest.raises(ConfigError, match=r"pool 'flashinfer_dsv4' must have its own buffer.*FLASHINFER_DSV4__SHARED"):
        vg.get_dsv4_workspace(CPU)


def test_dash_workspace_is_a_pool_buffer(vg: ws.VllmGetters) -> None:
    """DASH attention's FlashInfer workspace: uint8 of the rule's size, one per device and lane."""
    reg = _small(flashinfer_dash={"rules": {"default": "3MiB"}})
    buffer = vg.get_dash_workspace(CPU)
    assert (buffer.dtype, buffer.numel()) == (torch.uint8, 3 * MiB) and vg.get_dash_workspace(CPU) is buffer
    assert dict(reg.stats("flashinfer_dash", "cpu").requests_by_rule) == {"default": 2}
