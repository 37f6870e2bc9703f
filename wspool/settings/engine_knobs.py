"""Engine knobs: the workspace sizes that engines already read from their own environment variables.

An engine that switches to wspool keeps honouring the variable its users
already set. Each knob is a whole number of bytes, read exactly as the engine
reads it, and sets the wspool keys below, with lower precedence than the YAML
file and the ``WSPOOL_*`` variables and higher than the built-in defaults:

=========================================  ==================================================
variable                                   sets
=========================================  ==================================================
``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE``  ``pools.flashinfer.rules.decode``, ``.prefill`` and
                                           ``.vllm`` (vLLM's FlashInfer attention backend), and
                                           ``pools.flashinfer_mla_sparse.rules.default``
                                           (vLLM's sparse FlashInfer MLA backend)
``SGLANG_FLASHINFER_WORKSPACE_SIZE``       the same, and ``pools.flashinfer_mla.rules.default``
                                           and ``.lse`` (SGLang sizes all its FlashInfer
                                           backends with it); for the SGLang integration,
                                           ``pools.flashinfer.rules.sglang``,
                                           ``pools.flashinfer_mla.rules.sglang_mla`` and
                                           ``pools.sglang_dsa_sparse_mla.rules.default`` (the
                                           workspaces SGLang sizes with it alone)
=========================================  ==================================================

Where both are set, the vLLM variable wins for the keys both set. An empty
variable counts as unset; any other value that is not a positive whole number
is a :class:`~wspool.errors.ConfigError` naming the variable.

Reading the knobs touches nothing but ``os.environ``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from wspool.errors import ConfigError, setting_names

__all__ = ["ENGINE_KNOBS", "engine_knob_layers", "engine_knob_settings"]

#: (variable, engine, the (pool, rule) keys it sets), highest precedence first.
ENGINE_KNOBS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    (
        "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE",
        "vLLM",
        (
            ("flashinfer", "decode"),
            ("flashinfer", "prefill"),
            ("flashinfer", "vllm"),
            ("flashinfer_mla_sparse", "default"),
        ),
    ),
    (
        "SGLANG_FLASHINFER_WORKSPACE_SIZE",
        "SGLang",
        (
            ("flashinfer", "decode"),
            ("flashinfer", "prefill"),
            ("flashinfer_mla", "default"),
            ("flashinfer_mla", "lse"),
            ("flashinfer", "sglang"),
            ("flashinfer_mla", "sglang_mla"),
            ("sglang_dsa_sparse_mla", "default"),
        ),
    ),
)


def engine_knob_layers(environ: Mapping[str, str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Return ``(source label, settings)`` for each knob that is set, highest precedence first.

    Args:
        environ: The environment to read; default ``os.environ``.

    Raises:
        ConfigError: A knob is set to something other than a positive whole number of bytes.
    """
    environ = os.environ if environ is None else environ
    layers = []
    for name, engine, keys in ENGINE_KNOBS:
        raw = environ.get(name, "").strip()
        if not raw:
            continue
        try:
            nbytes = int(raw, 10)
        except ValueError:
            nbytes = 0
        if nbytes <= 0:
            names = ", ".join(setting_names(("pools", pool, "rules", rule))[0] for pool, rule in keys)
            raise ConfigError(
                f"invalid environment variable {name} = {raw[:80]!r}: {engine} reads it as a positive whole "
                f"number of bytes, and wspool sizes {names} with it; fix or unset it (the YAML file and "
                f"WSPOOL_* variables take precedence over it)"
            )
        data: dict[str, Any] = {"pools": {}}
        for pool, rule in keys:
            data["pools"].setdefault(pool, {"rules": {}})["rules"][rule] = nbytes
        layers.append((f"environment variable {name}", data))
    return layers


def engine_knob_settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Return the settings of every knob that is set, merged (the first knob wins a shared key)."""
    merged: dict[str, Any] = {"pools": {}}
    for _, data in reversed(engine_knob_layers(environ)):
        for pool, config in data["pools"].items():
            merged["pools"].setdefault(pool, {"rules": {}})["rules"].update(config["rules"])
    return merged if merged["pools"] else {}
