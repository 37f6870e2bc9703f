"""wspool in TokenSpeed 0.1.1: the ``tokenspeed.plugins`` entry point and what it patches.

:func:`register` is the entry point (:mod:`wspool.integrations.tokenspeed.plugin`
declares the targets); TokenSpeed's workspaces are served by
:mod:`~wspool.integrations.tokenspeed.buffers`, and the private names it reads
go through :mod:`~wspool.integrations.tokenspeed.internals`. docs/tokenspeed.md
is the user's guide.
"""

from __future__ import annotations

from wspool.integrations import TOKENSPEED
from wspool.integrations.tokenspeed.buffers import TOKENSPEED_POOLS, WORKSPACES
from wspool.integrations.tokenspeed.plugin import GROUPS, INTEGRATION, TARGETS, tokenspeed_reporter

__all__ = [
    "ENABLE_ENV_VAR",
    "GROUPS",
    "INTEGRATION",
    "TARGETS",
    "TOKENSPEED_POOLS",
    "WORKSPACES",
    "patched",
    "register",
    "unregister",
]

#: ``0`` (or ``false``, ``off``, ``no``) leaves TokenSpeed untouched although the plugin loads; other values
#: are refused.
ENABLE_ENV_VAR = TOKENSPEED.switch_var


def register() -> None:
    """Install wspool's workspaces into TokenSpeed (the ``tokenspeed.plugins`` entry point); never raises.

    Idempotent. Reads the switch, wspool's configuration and TokenSpeed's
    version, then patches every target or none, reporting each to TokenSpeed's
    ``record_external``; logs one line.
    """
    INTEGRATION.load(tokenspeed_reporter())


def unregister() -> list[str]:
    """Put TokenSpeed's originals back (for tests); return the names restored.

    Backends built meanwhile keep the buffers they hold.
    """
    return INTEGRATION.unload()


def patched() -> list[str]:
    """Return the names of the TokenSpeed attributes wspool replaced in this process."""
    return INTEGRATION.patched()
