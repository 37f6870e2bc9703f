"""Tests for wspool.tools.sweep on the CPU: shapes from flags, mappings and files, and their facts."""

from __future__ import annotations

from pathlib import Path

import pytest

from wspool.tools.sweep import DEFAULT_SHAPES, MLAShape, ShapeError, load_shapes, parse_shape, shape_from_mapping


def test_a_shape_flag_takes_aliases_and_a_bare_lse() -> None:
    """``b=2,h=16,l=1024,q=2,lse`` is the shape with those fields and rule lse."""
    shape = parse_shape("b=2, h=16, l=1024, q=2, lse")
    assert shape == MLAShape(batch_size=2, num_heads=16, max_seq_len=1024, q_len=2, return_lse=True)
    assert (shape.rule, shape.label) == ("lse", "B=2 H=16 L=1024 q=2 lse")


def test_a_mapping_reads_integers_in_any_base_and_boolean_words() -> None:
    """String values parse as integers (0x allowed) and booleans as words."""
    shape = shape_from_mapping({"batch_size": "0x10", "num_heads": 8, "max_seq_len": "64", "return_lse": "no"})
    assert shape == MLAShape(batch_size=16, num_heads=8, max_seq_len=64)
    assert shape.rule == "default"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"batch_size": 1, "num_heads": 8}, "missing max_seq_len"),
        ({"b": 1, "h": 8, "l": -4}, "max_seq_len must be a positive integer, got -4"),
        ({"b": 1, "h": 8, "l": "x"}, "max_seq_len must be a positive integer, got 'x'"),
        ({"b": 1, "h": 8, "l": 64, "lse": "maybe"}, "return_lse must be true or false, got 'maybe'"),
    ],
)
def test_a_malformed_mapping_is_a_shape_error(data: dict[str, object], match: str) -> None:
    """A missing field, a non-positive or non-integer size, or a non-boolean flag is named."""
    with pytest.raises(ShapeError, match=match):
        shape_from_mapping(data)


def test_the_facts_are_what_a_plan_passes() -> None:
    """A shape's facts carry its sizes, the device's SMs and the dtype width."""
    facts = MLAShape(batch_size=4, num_heads=16, max_seq_len=1000).facts(sm_count=132)
    assert {k: facts[k] for k in ("batch_size", "num_heads", "max_seq_len", "sm_count", "dtype_bytes")} == {
        "batch_size": 4,
        "num_heads": 16,
        "max_seq_len": 1000,
        "sm_count": 132,
        "dtype_bytes": 2,
    }


def test_a_shapes_file_loads_in_order(tmp_path: Path) -> None:
    """``shapes: [...]`` in YAML gives the shapes in the file's order."""
    path = tmp_path / "shapes.yaml"
    path.write_text(
        "shapes:\n  - {b: 1, h: 16, l: 128}\n  - {batch_size: 8, num_heads: 128, max_seq_len: 4096, lse: true}\n"
    )
    assert [s.label for s in load_shapes(path)] == ["B=1 H=16 L=128 q=1", "B=8 H=128 L=4096 q=1 lse"]


def test_the_default_sweep_covers_its_stated_range() -> None:
    """The 26 default shapes run batch 1..512, heads 16..128, lengths 1K..32K, q_len 1..4, with and without LSE."""
    assert len(DEFAULT_SHAPES) == 26 == len(set(DEFAULT_SHAPES))
    assert {s.batch_size for s in DEFAULT_SHAPES} >= {1, 512}
    assert (min(s.num_heads for s in DEFAULT_SHAPES), max(s.num_heads for s in DEFAULT_SHAPES)) == (16, 128)
    assert (min(s.max_seq_len for s in DEFAULT_SHAPES), max(s.max_seq_len for s in DEFAULT_SHAPES)) == (1024, 32768)
    assert {s.q_len for s in DEFAULT_SHAPES} == {1, 2, 4} and {s.return_lse for s in DEFAULT_SHAPES} == {False, True}
