"""Settings: the configuration schema, its sources (YAML, ``WSPOOL_*``, engine knobs) and the device profiles.

Imports only the core modules below it (units, rules, errors, device facts);
nothing here touches CUDA or FlashInfer.
"""

from wspool.settings.profiles import PROFILE_NAMES, Profile, choose_profile, load_profile
from wspool.settings.schema import (
    PoolConfig,
    Provenance,
    WspoolSettings,
    iter_settings,
    load_settings,
    load_settings_with_provenance,
    profile_settings,
)

__all__ = [
    "PROFILE_NAMES",
    "PoolConfig",
    "Profile",
    "Provenance",
    "WspoolSettings",
    "choose_profile",
    "iter_settings",
    "load_profile",
    "load_settings",
    "load_settings_with_provenance",
    "profile_settings",
]
