"""wspool in SGLang 0.5.23: the ``sglang.srt.plugins`` entry point and what it patches.

:func:`register` is the entry point (:mod:`wspool.integrations.sglang.plugin`
declares the targets); SGLang's named workspaces are served by
:mod:`~wspool.integrations.sglang.buffers`, with the runner's facts from
:mod:`~wspool.integrations.sglang.facts`, and its FlashInfer wrappers take
int workspaces in :mod:`~wspool.integrations.sglang.wrappers`. docs/sglang.md
is the user's guide.
"""

from __future__ import annotations

from wspool.integrations import SGLANG
from wspool.integrations.sglang.buffers import (
    BUFFERS,
    CUTE_DSL_WORKSPACE,
    DEVICE_ENV_VAR,
    SGLANG_POOLS,
    configure,
    serve,
)
from wspool.integrations.sglang.plugin import GROUPS, INTEGRATION, TARGETS

__all__ = [
    "BUFFERS",
    "CUTE_DSL_WORKSPACE",
    "DEVICE_ENV_VAR",
    "ENABLE_ENV_VAR",
    "GROUPS",
    "INTEGRATION",
    "SGLANG_POOLS",
    "TARGETS",
    "configure",
    "logger",
    "patched",
    "register",
    "serve",
    "unregister",
]

#: ``0`` (or ``false``, ``off``, ``no``) leaves SGLang untouched although the integration loads; other values
#: are refused.
ENABLE_ENV_VAR = SGLANG.switch_var
#: The integration's logger (SGLang shows it with its own lines).
logger = INTEGRATION.logger


def register() -> None:
    """Install wspool's workspaces into SGLang (the ``sglang.srt.plugins`` entry point); never raises.

    Idempotent. Reads the switch, checks SGLang's version and wspool's
    configuration, then patches every target or none; logs one line.
    """
    INTEGRATION.load()


def unregister() -> list[str]:
    """Put SGLang's originals back (for tests); return the names restored.

    A module global wspool set is reset to ``None``; backends built meanwhile keep their buffers.
    """
    return INTEGRATION.unload()


def patched() -> list[str]:
    """Return the names of the SGLang attributes wspool replaced in this process."""
    return INTEGRATION.patched()
