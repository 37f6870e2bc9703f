"""Printing, saving and plotting ``wspool bench`` figures, from the plain data ``--json`` writes."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from wspool.errors import WspoolError
from wspool.settings.sources import read_text_file
from wspool.units import MiB, format_size

__all__ = [
    "MAX_FIGURES_BYTES",
    "BenchError",
    "check_plot",
    "failed_sections",
    "format_report",
    "load_figures",
    "plot_memory",
    "save_figures",
]

#: The largest figures file ``--plot-from`` reads; ``bench --json`` writes a few hundred KiB at most.
MAX_FIGURES_BYTES = 16 * MiB


class BenchError(WspoolError):
    """The figures cannot be read, written or plotted."""


def _skipped(section: Mapping[str, Any] | None) -> str | None:
    """Why a section has no figures (``None`` when it has them)."""
    if section is None:
        return "skipped: not run"
    if "failed" in section:
        return f"FAILED: {section['failed']}"
    if "skipped" in section:
        return f"skipped: {section['skipped']}"
    return None


def failed_sections(figures: Mapping[str, Any]) -> list[str]:
    """The sections that raised instead of measuring."""
    return [name for name, section in figures.items() if isinstance(section, Mapping) and "failed" in section]


def _hot_path(figures: Mapping[str, Any]) -> list[str]:
    hot = figures.get("hot_path")
    if hot is None:
        return []
    return [
        f"(a) hot path on {hot['device']} (median per call, same run):",
        f"  vLLM's _get_workspace_buffer(True)     {hot['seed_bare_ns']:8.1f} ns",
        f"  reg.workspace(..., rule='lse') literal {hot['literal_rule_ns']:8.1f} ns  "
        f"({hot['literal_vs_seed']:.2f}x vLLM's)",
        f"  reg.workspace(..., rule=expr, facts)   {hot['expression_rule_ns']:8.1f} ns",
        f"  empty call (loop overhead)             {hot['empty_loop_ns']:8.1f} ns",
    ]


def _engine_path(figures: Mapping[str, Any]) -> list[str]:
    section = figures.get("engine_path")
    if section is None:
        return []
    lines = ["(a2) engine path: each getter wspool replaces, at the engine's call site (minimum per call):"]
    for engine, found in section.items():
        if "skipped" in found:
            lines.append(f"  {engine}: skipped ({found['skipped']})")
            continue
        lines.append(f"  {engine} {found['version']}:{'':35} own ns  wspool ns  ratio")
        for row in found["rows"]:
            lines.append(
                f"    {row['call']:<46} {row['path']:<17} {row['own_ns']:8.1f} {row['wspool_ns']:10.1f}  "
                f"{row['ratio']:5.2f}x"
            )
    return lines


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _us(value: float | None, fmt: str = "+.1f") -> str:
    return "-" if value is None else format(value, fmt)


def _mla_decode(section: Mapping[str, Any] | None) -> list[str]:
    title = "(b) mla_decode through wspool against direct FlashInfer calls (plan + run per step)"
    why = _skipped(section)
    if why is not None:
        return [f"{title}: {why}"]
    assert section is not None
    lines = [
        f"{title}, {section['runs']} timed pairs after warm-up, rules {section['rules_file']}:",
        "",
        "| batch | heads | length | LSE | query form | wspool (us) | direct (us) | added (us) "
        "| A/A noise (us) | within 2% or 2 us | 4-D reshapes, direct (us) |",
        "| ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in section["rows"]:
        lines.append(
            f"| {r['batch_size']} | {r['num_heads']} | {r['max_seq_len']} | {_yes(r['return_lse'])} | "
            f"{r.get('query_form', '4-D')} | {r['wspool_us']:.1f} | {r['direct_us']:.1f} | {r['added_us']:+.1f} "
            f"| {_us(r.get('noise_us'))} | {_yes(r['ok'])} | {_us(r.get('reshape_us'))} |"
        )
    return [
        *lines,
        "",
        "  wspool, direct: medians; added: median of the per-pair differences; A/A noise: the same for the",
        "  direct calls against a second, identical direct wrapper. Both sides get the same query: packed",
        "  [tokens, heads, 576] (FlashInfer's form) or 4-D [batch, q_len, heads, 576], which both reshape to",
        "  FlashInfer's form and back; the last column is what those reshapes cost the direct calls.",
    ]


def _mla_plan(section: Mapping[str, Any] | None) -> list[str]:
    title = "(b3) SGLang's eager MLA decode plan per step: FlashInfer's own int buffers against wspool's supply"
    why = _skipped(section)
    if why is not None:
        return [f"{title}: {why}"]
    assert section is not None
    return [
        f"{title}, batch {section['batch_size']}, {section['num_heads']} heads, length {section['max_seq_len']}:",
        f"  FlashInfer's own {section['own_us']:.1f} us, wspool {section['wspool_us']:.1f} us, "
        f"added {section['added_us']:+.2f} us (spread of FlashInfer's own rounds {section['noise_us']:.2f} us)",
    ]


def _decode_step(section: Mapping[str, Any] | None) -> list[str]:
    title = "(b2) decode step of 61 layer calls with LSE: a plan per step, run per layer"
    why = _skipped(section)
    if why is not None:
        return [f"{title}: {why}"]
    assert section is not None
    lines = [
        f"{title}, {section['runs']} timed pairs of steps after warm-up, rules {section['rules_file']}:",
        "",
        "| batch | heads | length | plans per step | wspool (us/layer) | direct run() (us/layer) | added (us/layer) "
        "| A/A noise (us/layer) | within 2% or 2 us | CUDA graph replay (us/step) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    notes = []
    for r in section["rows"]:
        graph = f"{r['graph_step_us']:.1f}" if r["graph_step_us"] is not None else "-"
        if r["graph_step_us"] is None:
            notes.append(f"  batch {r['batch_size']}: {r['graph_note']}")
        lines.append(
            f"| {r['batch_size']} | {r['num_heads']} | {r['max_seq_len']} | {r['plans_per_step']:g} | "
            f"{r['wspool_layer_us']:.1f} | {r['direct_layer_us']:.1f} | {r['added_us']:+.2f} "
            f"| {_us(r.get('noise_layer_us'), '+.2f')} | {_yes(r['ok'])} | {graph} |"
        )
    notes.append("  per layer: medians of the steps over 61; added: median of the per-pair differences over 61;")
    notes.append("  A/A noise: the same for the direct steps against a second, identical pre-planned wrapper")
    return [*lines, "", *notes]


def _memory(section: Mapping[str, Any] | None) -> list[str]:
    title = "(c) memory: bytes reserved per MLA decode call"
    why = _skipped(section)
    if why is not None:
        return [f"{title}: {why}"]
    assert section is not None
    rows = section["rows"]
    worst = max(r["rule_over_minimum"] for r in rows)
    under = [r["shape"] for r in rows if r["rule_bytes"] < r["minimum_bytes"] or r["run_at_rule"] != "ok"]
    lines = [
        f"{title}, {len(rows)} shapes, measured rules {section['rules_file']}:",
        "",
        "| shape | true minimum | measured rule | rule / minimum | fixed constant | constant / minimum | run at rule |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['minimum_bytes']} ({format_size(r['minimum_bytes'])}) | {r['rule_bytes']} "
            f"({format_size(r['rule_bytes'])}) | {r['rule_over_minimum']:.3f} | {format_size(r['constant_bytes'])} "
            f"| {r['constant_bytes'] / r['minimum_bytes']:.1f} | {r['run_at_rule']} |"
        )
    verdict = "never below the minimum" if not under else f"BELOW the minimum or failed for {', '.join(under)}"
    lines += ["", f"  measured rule: {verdict}; at most {worst:.3f}x the true minimum"]
    return lines


def format_report(figures: Mapping[str, Any]) -> str:
    """Return the printed report of a run's figures (sections that did not run are left out)."""
    machine = figures.get("machine", {})
    lines = [
        f"wspool bench: GPU {machine.get('gpu', '?')}; CPU {machine.get('cpu', '?')}; "
        f"python {machine.get('python', '?')}, torch {machine.get('torch', '?')}, "
        f"FlashInfer {machine.get('flashinfer', '?')}",
    ]
    renders = (("mla_decode", _mla_decode), ("mla_plan", _mla_plan), ("decode_step", _decode_step), ("memory", _memory))
    for key, render in renders:
        if key in figures:
            lines += ["", *render(figures[key])]
    engine = _engine_path(figures)
    if engine:
        lines[1:1] = ["", *engine]
    hot = _hot_path(figures)
    if hot:
        lines[1:1] = ["", *hot]
    return "\n".join(lines)


def save_figures(figures: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write the figures as JSON (``BenchError`` if the file cannot be written)."""
    try:
        Path(path).write_text(json.dumps(figures, indent=2) + "\n")
    except OSError as exc:
        raise BenchError(f"cannot write {path}: {exc.strerror or exc}") from None


def load_figures(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read figures ``--json`` wrote: a regular file of at most :data:`MAX_FIGURES_BYTES`, else ``BenchError``."""
    text = read_text_file(Path(path), what="figures file", max_bytes=MAX_FIGURES_BYTES, error=BenchError)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BenchError(f"{path} is not JSON: {exc}") from None
    except RecursionError:
        raise BenchError(f"{path} is not such JSON: it nests too deeply") from None
    if not isinstance(data, dict) or "machine" not in data:
        raise BenchError(f"{path} does not hold wspool bench figures (no 'machine' key)")
    return data


#: How to get figures that hold a memory sweep, the one thing ``--plot`` draws.
_SWEEP_HOWTO = (
    "write one with `wspool bench --sections memory --json FILE` on a Hopper or Ampere GPU, then draw it "
    "anywhere with `wspool bench --plot-from FILE --plot OUT.png`"
)
_NO_MATPLOTLIB = "--plot needs matplotlib, which is not installed: pip install matplotlib"


def check_plot(sections: Sequence[str], memory_blocker: str | None) -> None:
    """Refuse ``--plot`` before anything is measured, where the run could not draw it.

    Args:
        sections: The sections the run will measure; the plot draws ``memory``.
        memory_blocker: Why the memory sweep cannot run on this machine, or ``None``.

    Raises:
        BenchError: matplotlib is missing, ``memory`` is not among ``sections``, or it cannot run here.
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise BenchError(_NO_MATPLOTLIB)
    if "memory" not in sections:
        raise BenchError(
            f"--plot draws the memory sweep, and --sections {','.join(sections)} leaves it out: add memory"
        )
    if memory_blocker is not None:
        raise BenchError(f"--plot draws the memory sweep, which cannot run here ({memory_blocker}); {_SWEEP_HOWTO}")


def plot_memory(figures: Mapping[str, Any], path: str | os.PathLike[str], *, source: str | None = None) -> None:
    """Draw bytes reserved (fixed constant, measured rule) against the true minimum (needs matplotlib).

    ``source`` names the figures file (``--plot-from``) in the error where it holds no memory sweep.
    """
    section = figures.get("memory")
    why = _skipped(section)
    if why is not None:
        if source is not None:
            gpu = figures.get("machine", {}).get("gpu") or "no GPU"
            raise BenchError(
                f"{source} holds no memory sweep to plot (its memory section was {why}; machine: {gpu}); {_SWEEP_HOWTO}"
            )
        raise BenchError(f"no memory sweep to plot (memory section {why}); {_SWEEP_HOWTO}")
    assert section is not None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise BenchError(_NO_MATPLOTLIB) from None
    rows = section["rows"]
    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.42 * len(rows)), 5.0))
    ax.step(x, [r["constant_bytes"] / MiB for r in rows], where="mid", label="fixed constant (128 / 256 MiB)")
    ax.plot(x, [r["rule_bytes"] / MiB for r in rows], "o-", label="measured rule")
    ax.plot(x, [r["minimum_bytes"] / MiB for r in rows], "x", markersize=9, label="true minimum")
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set_ylabel("workspace per call (MiB, log scale)")
    ax.set_xticks(x)
    ax.set_xticklabels([r["shape"] for r in rows], rotation=60, ha="right", fontsize=7)
    gpu = figures.get("machine", {}).get("gpu", "?")
    ax.set_title(f"MLA decode workspace: reserved against needed\n{gpu}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=150)
    except OSError as exc:
        raise BenchError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
