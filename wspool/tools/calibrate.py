"""``wspool calibrate``: measure the workspace MLA decode needs, derive the rules, write them.

Each shape's minimum is searched, checked at the rule's size, and the rules are
written as a YAML file :meth:`wspool.PoolRegistry.from_config` loads. Only the
probe needs the GPU.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import yaml

from wspool.errors import WspoolError
from wspool.flashinfer.layouts import FA_MLA_WORKSPACE_RULE
from wspool.rules import compile_rule
from wspool.settings.schema import VLLM_FIXED_MLA_WORKSPACE_BYTES
from wspool.tools.search import CalibrationError, SearchResult
from wspool.tools.sweep import MLAShape
from wspool.units import format_size

__all__ = [
    "NEEDS_GPU",
    "CalibrationError",
    "CalibrationReport",
    "DerivedRule",
    "Measurement",
    "ShapeProber",
    "derive_rules",
    "run_calibration",
]

NEEDS_GPU = (
    "needs a CUDA GPU to measure on (torch.cuda.is_available() is False here); run it on the GPU the "
    "rules are for, or take the shipped configuration measured on an H200: --config hopper (WSPOOL_CONFIG=hopper)"
)


class ShapeProber(Protocol):
    """Measures one kernel's workspace need on one device (see ``MLAWorkspaceProbe``)."""

    sm_count: int

    def describe(self) -> dict[str, str]:
        """The device, library versions and kernel path, for the file's header."""
        ...

    def search(self, shape: MLAShape, *, granularity: int = 1) -> SearchResult:
        """Find the smallest workspace the kernel accepts for ``shape``."""
        ...

    def verify(self, shape: MLAShape, nbytes: int) -> str | None:
        """Run ``shape`` with an ``nbytes`` workspace; ``None`` when correct, else why not."""
        ...


@dataclass(frozen=True)
class Measurement:
    """One shape's result: its minimum, the derived rule's size, and the verification runs."""

    shape: MLAShape
    facts: Mapping[str, int]
    min_bytes: int
    probes: int
    rule_bytes: int = 0
    at_min: str | None = "not run"
    at_rule: str | None = "not run"

    @property
    def ratio(self) -> float:
        """The rule's size over the minimum."""
        return self.rule_bytes / self.min_bytes

    @property
    def constant_bytes(self) -> int:
        """What vLLM's fixed size reserves for this call (shown next to the measured one)."""
        return VLLM_FIXED_MLA_WORKSPACE_BYTES[self.shape.rule]

    @property
    def ok(self) -> bool:
        """Whether the call ran correctly at its minimum and at the rule's size."""
        return self.at_min is None and self.at_rule is None and self.rule_bytes >= self.min_bytes

    def as_dict(self) -> dict[str, Any]:
        """Return the measurement as plain data."""
        return {
            "shape": self.shape.label,
            **self.shape.as_dict(),
            "minimum_bytes": self.min_bytes,
            "rule_bytes": self.rule_bytes,
            "constant_bytes": self.constant_bytes,
            "rule_over_minimum": round(self.ratio, 6),
            "probes": self.probes,
            "run_at_minimum": self.at_min or "ok",
            "run_at_rule": self.at_rule or "ok",
        }


@dataclass(frozen=True)
class DerivedRule:
    """The rule chosen for one rule name and how well it fits the measurements."""

    name: str
    source: str
    how: str
    peak_bytes: int
    worst_ratio: float
    shapes: int

    def resolve(self, facts: Mapping[str, int]) -> int:
        """Return the rule's size for a call's facts."""
        return compile_rule(self.source).resolve(facts)


def derive_rules(
    measured: Iterable[tuple[MLAShape, Mapping[str, int], int]],
    *,
    candidates: Sequence[str] = (FA_MLA_WORKSPACE_RULE,),
    max_ratio: float = 1.1,
) -> dict[str, DerivedRule]:
    """Choose per rule name the first formula covering every minimum within ``max_ratio``, else the peak."""
    groups: dict[str, list[tuple[Mapping[str, int], int]]] = {}
    for shape, facts, min_bytes in measured:
        groups.setdefault(shape.rule, []).append((facts, min_bytes))
    rules: dict[str, DerivedRule] = {}
    for name in sorted(groups, key=lambda n: (n != "default", n)):
        rows = groups[name]
        peak = max(m for _, m in rows)
        for source in candidates:
            rule = compile_rule(source)
            try:
                sizes = [rule.resolve(facts) for facts, _ in rows]
            except WspoolError:
                continue
            ratios = [size / m for size, (_, m) in zip(sizes, rows, strict=True)]
            if min(ratios) >= 1 and max(ratios) <= max_ratio:
                rules[name] = DerivedRule(name, source, "formula", peak, max(ratios), len(rows))
                break
        else:
            worst = max(peak / m for _, m in rows)
            rules[name] = DerivedRule(name, str(peak), "peak", peak, worst, len(rows))
    return rules


@dataclass
class CalibrationReport:
    """Everything one calibration run found, and the rules file it makes."""

    machine: dict[str, str]
    measurements: list[Measurement]
    rules: dict[str, DerivedRule]
    date: str = field(default_factory=lambda: datetime.date.today().isoformat())

    @property
    def ok(self) -> bool:
        """Whether every shape ran correctly at its minimum and at the rule's size."""
        return all(m.ok for m in self.measurements)

    def table(self) -> str:
        """Return the per-shape table in Markdown."""
        lines = [
            "| shape | minimum | rule | rule / minimum | fixed constant | constant / minimum | runs |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for m in self.measurements:
            runs = "ok" if m.ok else f"FAILED: {m.at_min or m.at_rule or 'rule below minimum'}"
            lines.append(
                f"| {m.shape.label} | {m.min_bytes} ({format_size(m.min_bytes)}) | {m.rule_bytes} "
                f"({format_size(m.rule_bytes)}) | {m.ratio:.3f} | {format_size(m.constant_bytes)} | "
                f"{m.constant_bytes / m.min_bytes:.1f} | {runs} |"
            )
        return "\n".join(lines)

    def rules_yaml(self) -> str:
        """Return the rules file: a comment header (device, versions, date, method, table) and the pools."""
        machine = self.machine
        header = [
            "# Rules for the flashinfer_mla pool, measured by `wspool calibrate`.",
            f"# device: {machine.get('device', '?')}; FlashInfer {machine.get('flashinfer', '?')}; "
            f"torch {machine.get('torch', '?')}; kernel path: {machine.get('path', '?')}; date: {self.date}",
            "# Method: per shape, the smallest float workspace (exact bytes) with which FlashInfer's plan()",
            "# succeeds, found by a search guided by its overflow messages; each shape then ran at that",
            "# size and at the rule's size, with a guard region after the buffer left untouched.",
        ]
        for rule in self.rules.values():
            why = "a formula" if rule.how == "formula" else "the peak minimum"
            header.append(
                f"# {rule.name}: {why} ({rule.source}), over {rule.shapes} shapes at most "
                f"{rule.worst_ratio:.3f}x the minimum; peak {rule.peak_bytes} bytes ({format_size(rule.peak_bytes)})"
            )
        header.append("#")
        header += [f"#   {line}" for line in self.table().splitlines()]
        body = {
            "pools": {
                "flashinfer_mla": {
                    "description": f"MLA decode workspace measured on {machine.get('device', '?')} ({self.date})",
                    "rules": {name: _yaml_rule(rule.source) for name, rule in self.rules.items()},
                }
            }
        }
        return "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False, width=1000)

    def as_dict(self) -> dict[str, Any]:
        """Return the report as plain data (for ``--json``)."""
        return {
            "machine": self.machine,
            "date": self.date,
            "rules": {n: {**vars(r)} for n, r in self.rules.items()},
            "shapes": [m.as_dict() for m in self.measurements],
        }


def _yaml_rule(source: str) -> str | int:
    return int(source) if source.isdigit() else source


def run_calibration(
    shapes: Sequence[MLAShape],
    prober: ShapeProber,
    *,
    max_ratio: float = 1.1,
    granularity: int = 1,
    candidates: Sequence[str] = (FA_MLA_WORKSPACE_RULE,),
    progress: Callable[[str], None] | None = None,
) -> CalibrationReport:
    """Measure every shape, derive the rules, then run each shape at its minimum and at the rule's size."""
    if not shapes:
        raise CalibrationError("no shapes to calibrate")
    found: list[tuple[MLAShape, dict[str, int], SearchResult]] = []
    for shape in shapes:
        result = prober.search(shape, granularity=granularity)
        found.append((shape, shape.facts(prober.sm_count), result))
        if progress:
            progress(f"{shape.label}: minimum {result.min_bytes} bytes after {result.probe_count} probes")
    rules = derive_rules(((s, f, r.min_bytes) for s, f, r in found), candidates=candidates, max_ratio=max_ratio)
    measurements = []
    for shape, facts, result in found:
        rule_bytes = rules[shape.rule].resolve(facts)
        measurements.append(
            Measurement(
                shape=shape,
                facts=facts,
                min_bytes=result.min_bytes,
                probes=result.probe_count,
                rule_bytes=rule_bytes,
                at_min=prober.verify(shape, result.min_bytes),
                at_rule=prober.verify(shape, rule_bytes),
            )
        )
    return CalibrationReport(machine=prober.describe(), measurements=measurements, rules=rules)
