"""The MLA decode shapes that ``wspool calibrate`` and ``wspool bench`` sweep.

Shapes come from :data:`DEFAULT_SHAPES`, a YAML file of ``shapes:`` mappings, or
``--shape`` flags. A shape's facts are exactly those
:class:`wspool.flashinfer.MLADecodePlan` resolves its rule with, so a rule
measured here sizes the same calls there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from wspool.errors import ConfigError
from wspool.flashinfer.backends import call_facts
from wspool.settings.sources import read_yaml_file
from wspool.units import positive_int

__all__ = ["DEFAULT_SHAPES", "MLAShape", "ShapeError", "load_shapes", "parse_shape", "shape_from_mapping"]


class ShapeError(ConfigError):
    """A shape (from a file or a ``--shape`` flag) is malformed (a ``ConfigError``, so also a ``ValueError``)."""


@dataclass(frozen=True)
class MLAShape:
    """One MLA decode call's shape; every request holds ``max_seq_len`` tokens."""

    batch_size: int
    num_heads: int
    max_seq_len: int
    q_len: int = 1
    return_lse: bool = False
    page_size: int = 64

    @property
    def rule(self) -> str:
        """The ``flashinfer_mla`` rule that sizes this call."""
        return "lse" if self.return_lse else "default"

    @property
    def label(self) -> str:
        """A short name, e.g. ``"B=128 H=128 L=4096 q=1 lse"``."""
        lse = " lse" if self.return_lse else ""
        return f"B={self.batch_size} H={self.num_heads} L={self.max_seq_len} q={self.q_len}{lse}"

    def facts(self, sm_count: int, dtype_bytes: int = 2) -> dict[str, int]:
        """Return the facts :class:`~wspool.flashinfer.MLADecodePlan` passes for this call."""
        return call_facts(
            batch_size=self.batch_size,
            q_len=self.q_len,
            num_heads=self.num_heads,
            max_seq_len=self.max_seq_len,
            page_size=self.page_size,
            dtype_bytes=dtype_bytes,
            sm_count=sm_count,
            cp_world=1,
        )

    def as_dict(self) -> dict[str, Any]:
        """Return the shape as plain data."""
        return asdict(self)


def _shape(b: int, h: int, length: int, lse: bool, q: int = 1) -> MLAShape:
    return MLAShape(batch_size=b, num_heads=h, max_seq_len=length, q_len=q, return_lse=lse)


#: 26 shapes: batch 1..512, heads 16..128, lengths 1K..32K, q_len 1..4, with and without LSE.
DEFAULT_SHAPES: tuple[MLAShape, ...] = (
    _shape(1, 16, 1024, False),
    _shape(1, 128, 1024, True),
    _shape(1, 128, 32768, False),
    _shape(1, 64, 32768, True),
    _shape(1, 16, 2048, False, q=2),
    _shape(8, 16, 4096, True),
    _shape(8, 128, 8192, False),
    _shape(16, 32, 2048, False),
    _shape(32, 128, 4096, False),
    _shape(32, 128, 4096, True),
    _shape(64, 16, 16384, True),
    _shape(64, 128, 4096, False),
    _shape(64, 128, 4096, True, q=4),
    _shape(64, 128, 32768, True),
    _shape(128, 128, 4096, False),
    _shape(128, 128, 4096, True),
    _shape(128, 64, 8192, True),
    _shape(128, 16, 32768, False),
    _shape(256, 128, 1024, True),
    _shape(256, 32, 8192, False),
    _shape(256, 128, 8192, True),
    _shape(512, 16, 1024, False),
    _shape(512, 128, 1024, True),
    _shape(512, 64, 4096, False),
    _shape(512, 128, 4096, True),
    _shape(512, 128, 32768, False),
)

_FIELDS = {f.name for f in fields(MLAShape)}
_REQUIRED = ("batch_size", "num_heads", "max_seq_len")
_ALIASES = {"b": "batch_size", "h": "num_heads", "l": "max_seq_len", "q": "q_len", "lse": "return_lse"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def shape_from_mapping(data: Mapping[str, object], where: str = "shape") -> MLAShape:
    """Build a shape from a mapping of its fields (aliases ``b h l q lse`` allowed), else raise ``ShapeError``."""
    if not isinstance(data, Mapping):
        raise ShapeError(f"{where}: expected a mapping of shape fields, got {type(data).__name__}")
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = _ALIASES.get(str(raw_key).lower(), str(raw_key))
        if key not in _FIELDS:
            raise ShapeError(f"{where}: unknown key {raw_key!r} (keys: {', '.join(sorted(_FIELDS))})")
        if key == "return_lse":
            values[key] = _boolean(value, f"{where}: {key}")
        else:
            values[key] = _shape_field(value, f"{where}: {key}")
    missing = [k for k in _REQUIRED if k not in values]
    if missing:
        raise ShapeError(f"{where}: missing {', '.join(missing)}")
    return MLAShape(**values)


def _shape_field(value: object, where: str) -> int:
    number = value
    if isinstance(value, str):
        try:
            number = int(value, 0)
        except ValueError:
            raise ShapeError(f"{where} must be a positive integer, got {value!r}") from None
    found = positive_int(number)
    if found is None:
        raise ShapeError(f"{where} must be a positive integer, got {number!r}")
    return found


def _boolean(value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ShapeError(f"{where} must be true or false, got {value!r}")


def parse_shape(text: str) -> MLAShape:
    """Parse a ``--shape`` flag: ``batch_size=1,num_heads=128,max_seq_len=4096[,q_len=1][,lse]``."""
    data: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        data[key.strip()] = value.strip() if sep else "true"
    return shape_from_mapping(data, f"--shape {text!r}")


def load_shapes(path: str | os.PathLike[str]) -> list[MLAShape]:
    """Read shapes from a YAML file holding ``shapes: [{batch_size: ..., ...}, ...]``, else raise ``ShapeError``."""
    file = Path(path)
    data = read_yaml_file(file, what="shapes file", error=ShapeError)
    if not isinstance(data, Mapping) or not isinstance(data.get("shapes"), list) or not data["shapes"]:
        raise ShapeError(f"shapes file {file} must hold 'shapes:' with a non-empty list of shapes")
    return [shape_from_mapping(item, f"{file}: shapes[{i}]") for i, item in enumerate(data["shapes"])]
