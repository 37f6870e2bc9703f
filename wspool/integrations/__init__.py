"""Integrations: wspool embedded in inference engines through the engines' own plugin mechanisms.

Each integration is a module of its own, imported only by the engine that
loads it (:mod:`wspool.integrations.vllm` through vLLM's
``vllm.general_plugins`` entry point); importing this package imports no engine.
"""

from __future__ import annotations

__all__: list[str] = []
