"""Integrations: wspool embedded in inference engines through the engines' own plugin mechanisms.

Each integration is a module of its own: :mod:`wspool.integrations.adapters`
(drop-in replacements for an engine's module-level workspace functions) and
:mod:`wspool.integrations.vllm` (loaded by vLLM through its
``vllm.general_plugins`` entry point). Importing this package imports no engine.
"""

from __future__ import annotations

__all__: list[str] = []
