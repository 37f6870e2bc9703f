"""Profiles: named sets of pool settings for a kind of device, chosen per device.

A profile (``wspool/data/profiles/<name>.yaml``) holds pool settings, in the
configuration's own schema, that sit just above the built-in defaults: the
YAML file, the engines' knobs, ``WSPOOL_*`` and code override it key by key.
The ``profile`` setting (``profile`` / ``WSPOOL_PROFILE``) is ``auto`` (the
default) or a profile's name. ``auto`` picks per device from its compute
capability, so several GPUs of different kinds each get their own:

==========  ===============================  =========================================
profile     auto picks it for                sizes
==========  ===============================  =========================================
hopper      compute capability 9.0           measured on an H200 (16.56MiB on 132 SMs)
blackwell   10.0, 10.3, 10.7                 FlashInfer's launcher formula + headroom;
                                             NOT measured on hardware
fixed       everything else: CPU, 8.x, 12.x  the seed's constants, 128MiB / 256MiB
==========  ===============================  =========================================

Reading profiles touches no device; they are parsed once per process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import yaml

from wspool.device_facts import DeviceDescription
from wspool.shipped import shipped_text

__all__ = ["AUTO", "FALLBACK_PROFILE", "PROFILE_NAMES", "Profile", "ProfileChoice", "choose_profile", "load_profile"]

#: The profile setting that picks per device.
AUTO = "auto"
#: The shipped profiles.
PROFILE_NAMES = ("blackwell", "fixed", "hopper")
#: What auto picks for a device no profile names: the seed's constants.
FALLBACK_PROFILE = "fixed"


@dataclass(frozen=True)
class Profile:
    """One shipped profile.

    Attributes:
        name: Its name (``"hopper"``).
        description: What it is for, and whether its sizes were measured on hardware.
        measured: Whether its sizes were measured on a device of its kind.
        compute_capabilities: The ``(major, minor)`` pairs ``auto`` picks it for.
        settings: Its settings, in the configuration's schema (``{"pools": {...}}``).
    """

    name: str
    description: str
    measured: bool
    compute_capabilities: tuple[tuple[int, int], ...]
    settings: Mapping[str, Any]


@dataclass(frozen=True)
class ProfileChoice:
    """The profile a device got, and why.

    Attributes:
        profile: The profile's name.
        reason: Why, e.g. ``"auto: compute capability 9.0 (NVIDIA H200) is hopper's"``.
    """

    profile: str
    reason: str


@cache
def load_profile(name: str) -> Profile:
    """Return the shipped profile ``name``, parsed once.

    Raises:
        KeyError: No profile has that name (the ``profile`` setting is validated
            before this is called; see :data:`PROFILE_NAMES`).
    """
    if name not in PROFILE_NAMES:
        raise KeyError(f"no profile {name!r} (profiles: {', '.join(PROFILE_NAMES)})")
    data = yaml.safe_load(shipped_text("profiles", name))
    capabilities = tuple(
        (int(major), int(minor)) for major, minor in (str(cc).split(".") for cc in data["compute_capabilities"])
    )
    return Profile(
        name=name,
        description=" ".join(str(data["description"]).split()),
        measured=bool(data["measured"]),
        compute_capabilities=capabilities,
        settings=data["settings"],
    )


def choose_profile(setting: str, description: DeviceDescription | None, *, source: str = "default") -> ProfileChoice:
    """Return the profile for a device under the ``profile`` setting.

    Args:
        setting: ``"auto"`` or a profile's name (validated by the configuration).
        description: The device, or ``None`` for a device without one (the CPU).
        source: Where the setting came from, quoted in the reason.
    """
    if setting != AUTO:
        return ProfileChoice(setting, f"profile = {setting} (from {source})")
    if description is None:
        return ProfileChoice(FALLBACK_PROFILE, "auto: no GPU description (not a CUDA device); the seed's constants")
    cc = description.compute_capability
    shown = f"compute capability {cc[0]}.{cc[1]} ({description.name})"
    for name in PROFILE_NAMES:
        if cc in load_profile(name).compute_capabilities:
            return ProfileChoice(name, f"auto: {shown} is {name}'s")
    return ProfileChoice(FALLBACK_PROFILE, f"auto: no profile was measured for {shown}; the seed's constants")
