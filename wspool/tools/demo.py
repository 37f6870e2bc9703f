"""``wspool demo``: the main job, MLA decode through the pool, checked, on any configuration.

It runs a few MLA decode steps with and without the LSE, checks each against
an fp32 computation, then replays the LSE call that overflows vLLM's fixed
128 MiB on Blackwell's trtllm-gen carve at the configured size. Allocates on
the chosen device only; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from wspool.devices import DeviceDescription
from wspool.flashinfer.backends import call_facts
from wspool.flashinfer.layouts import carve_trtllm_mla_workspace, softmax_slab_bytes
from wspool.flashinfer.mla import mla_decode_plan
from wspool.flashinfer.reference import mla_decode_reference
from wspool.registry import PoolRegistry, get_registry
from wspool.rules import compile_rule
from wspool.settings.profiles import load_profile
from wspool.settings.schema import profile_settings
from wspool.units import MiB, ceil_div, format_size

__all__ = ["run_demo"]

_PAGE_SIZE = 64
_DIM = 576


def _inputs(batch: int, heads: int, max_len: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (batch,), generator=generator, dtype=torch.int32)
    lengths[0] = max_len
    pages = torch.tensor([ceil_div(n, _PAGE_SIZE) for n in lengths.tolist()], dtype=torch.int32)
    total = int(pages.sum()) + 4
    order = torch.randperm(total, generator=generator).to(torch.int32)
    tables = torch.zeros(batch, int(pages.max()), dtype=torch.int32)
    start = 0
    for b, count in enumerate(pages.tolist()):
        tables[b, :count] = order[start : start + count]
        start += count
    return {
        "query": torch.randn(batch, 1, heads, _DIM, generator=generator).to(torch.bfloat16).to(device),
        "kv_cache": torch.randn(total, _PAGE_SIZE, _DIM, generator=generator).to(torch.bfloat16).to(device),
        "block_tables": tables.to(device),
        "seq_lens": lengths.to(device),
    }


def _dense_check(t: dict[str, torch.Tensor], sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over each request's tokens gathered densely: independent of the paged reference."""
    outs, lses = [], []
    for b, length in enumerate(t["seq_lens"].tolist()):
        token = torch.arange(length, device=t["kv_cache"].device)
        pages = t["block_tables"][b].long()[token // _PAGE_SIZE]
        keys = t["kv_cache"][pages, token % _PAGE_SIZE].float()
        scores = t["query"][b, 0].float() @ keys.T * sm_scale
        lses.append(torch.logsumexp(scores, -1))
        outs.append(torch.softmax(scores, -1) @ keys[:, :512])
    return torch.stack(outs)[:, None], torch.stack(lses)[:, None]


def run_demo(
    registry: PoolRegistry | None = None,
    device: torch.device | str | None = None,
    *,
    batch: int = 8,
    heads: int = 16,
    max_len: int = 512,
    layers: int = 4,
    echo: Callable[[str], None] = print,
) -> bool:
    """Run the demo (``layers`` runs per plan) through ``echo``; return whether every check passed."""
    registry = registry if registry is not None else get_registry()
    target = (
        torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    sm_scale = 1.0 / (128 + 64) ** 0.5
    ok = True
    echo(
        f"wspool demo: MLA decode on {target}, batch {batch}, {heads} heads, lengths up to {max_len}, "
        f"{layers} layers per step"
    )
    choice = registry.profile_of(target)
    echo(f"profile {choice.profile} on {target}: {choice.reason}")
    for step, return_lse in enumerate((False, True)):
        t = _inputs(batch, heads, max_len, target, seed=step)
        plan = mla_decode_plan(
            t["block_tables"],
            t["seq_lens"],
            max_len,
            num_heads=heads,
            sm_scale=sm_scale,
            page_size=_PAGE_SIZE,
            return_lse=return_lse,
            registry=registry,
        )
        for _ in range(layers):
            result = plan.run(t["query"], t["kv_cache"])
        out, lse = result if isinstance(result, tuple) else (result, None)
        if plan.path == "reference":
            check_name = "dense fp32 attention"
            want_out, want_lse = _dense_check(t, sm_scale)
        else:
            check_name = "the fp32 reference"
            want_out, want_lse = mla_decode_reference(
                t["query"], t["kv_cache"], t["block_tables"], t["seq_lens"], sm_scale=sm_scale
            )
        err = float((out.float() - want_out.float()).norm() / want_out.float().norm())
        lse_err = float((lse - want_lse).abs().max()) if lse is not None else 0.0
        passed = err < 1e-2 and lse_err < 1e-3
        ok = ok and passed
        nbytes = registry.resolve("flashinfer_mla", plan.rule, device=target, **plan.facts)
        echo(
            f"  step {step}: return_lse={return_lse!s:<5} path={plan.path:<10} rule={plan.rule:<7} "
            f"workspace {format_size(nbytes):>7}  plans {plan.plan_calls}  "
            f"vs {check_name}: out rel err {err:.1e}"
            + (f", lse abs err {lse_err:.1e}" if lse is not None else "")
            + ("  ok" if passed else "  FAILED")
        )
    stats = registry.stats("flashinfer_mla", device=target)
    echo(
        f"pool flashinfer_mla on {stats.device}: capacity {format_size(stats.capacity_bytes)}, "
        f"peak request {format_size(stats.peak_request_bytes)}, {stats.request_count} requests "
        f"{dict(stats.requests_by_rule)}, {stats.grow_count} grows (last: {stats.last_grow_reason})"
    )
    ok = _overflow_replay(registry, echo) and ok
    echo("demo: all checks passed" if ok else "demo: CHECKS FAILED")
    return ok


#: The device the overflow replay models: trtllm-gen's carve runs on Blackwell (a B200's facts).
REPLAY_DEVICE = DeviceDescription("NVIDIA B200", 10, 0, 148, 191_514_607_616)
_LSE_RULE = ("pools", "flashinfer_mla", "rules", "lse")


def _overflow_replay(registry: PoolRegistry, echo: Callable[[str], None]) -> bool:
    """Carve the LSE call that overflows vLLM's 128 MiB as trtllm-gen would, at 128 MiB and at a B200's rule size."""
    heads, batch, scratch = 128, 512, 32 * MiB
    call = call_facts(
        batch_size=batch,
        q_len=1,
        num_heads=heads,
        max_seq_len=4096,
        page_size=_PAGE_SIZE,
        dtype_bytes=2,
        sm_count=REPLAY_DEVICE.sm_count,
        cp_world=None,
    )
    slab = softmax_slab_bytes(heads, batch, 1)
    echo(
        f"vLLM's fixed 128MiB, replayed (trtllm-gen carve, Blackwell launcher model): LSE call with {heads} heads "
        f"x {batch} requests needs a {format_size(slab)} softmax slab + ~{format_size(scratch)} scratch"
    )
    crashed = not _fits(128 * MiB, heads, batch, scratch, "  vLLM's fixed size", echo)
    settings, provenance = profile_settings(registry.settings, "blackwell")
    pool = settings.pools["flashinfer_mla"]
    defaults = {**REPLAY_DEVICE.facts(), **pool.facts}
    size = compile_rule(pool.rules["lse"], _LSE_RULE).resolve(call, defaults)
    source = provenance.source_of(_LSE_RULE)
    label = f"  rule pools.flashinfer_mla.rules.lse on a modelled {REPLAY_DEVICE.name} (from {source})"
    if _fits(size, heads, batch, scratch, label, echo):
        return crashed
    if source == "profile blackwell":
        return False  # the profile for this device is wrong
    own = load_profile("blackwell").settings["pools"]["flashinfer_mla"]
    own_size = compile_rule(own["rules"]["lse"], _LSE_RULE).resolve(call, {**defaults, **own.get("facts", {})})
    echo(
        f"  this configuration does not size MLA decode for Blackwell ({source} replaces the blackwell "
        "profile's rule); on Blackwell, use --config blackwell (WSPOOL_CONFIG=blackwell) or leave "
        "pools.flashinfer_mla.rules to the profile"
    )
    return _fits(own_size, heads, batch, scratch, "  the blackwell profile's rule", echo) and crashed


def _fits(nbytes: int, heads: int, batch: int, scratch: int, label: str, echo: Callable[[str], None]) -> bool:
    """Carve the call in ``nbytes``; print whether it fits."""
    try:
        carve_trtllm_mla_workspace(
            nbytes, num_heads=heads, batch_size=batch, q_len=1, return_lse=True, scratch_bytes=scratch
        )
    except RuntimeError as exc:
        echo(f"{label} = {format_size(nbytes)}: {exc}")
        return False
    echo(f"{label} = {format_size(nbytes)}: fits")
    return True
