"""Where each value of a loaded configuration came from: :class:`Provenance`.

Plain data, built once per load; reading it has no side effects.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from wspool.errors import setting_names

__all__ = ["Provenance", "deep_copy"]


def deep_copy(data: Any) -> Any:
    """Copy nested mappings (so a source never shares dicts with another); other values as they are."""
    if isinstance(data, Mapping):
        return {k: deep_copy(v) for k, v in data.items()}
    return data


class Provenance:
    """Where each value of a loaded configuration came from.

    Attributes:
        config_file: The YAML file that was read, if any.
    """

    def __init__(self, layers: list[tuple[str, dict[str, Any]]], config_file: Path | None) -> None:
        self._layers = layers
        self.config_file = config_file

    def source_of(self, path: tuple[str, ...]) -> str:
        """Return ``"code"``, ``"environment variable WSPOOL_..."``, ``"YAML file ..."`` or ``"default"``."""
        for label, data in self._layers:
            node: Any = data
            for part in path:
                if not isinstance(node, Mapping):
                    break
                # YAML keys need not be strings (``1:``), while error paths are.
                found = part if part in node else next((k for k in node if str(k) == part), None)
                if found is None:
                    break
                node = node[found]
            else:
                if label == "env":
                    return f"environment variable {setting_names(path)[1]}"
                if label == "yaml":
                    return f"YAML file {self.config_file}"
                return label
        return "default"
