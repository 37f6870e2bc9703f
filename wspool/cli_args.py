"""The ``wspool`` command's argument types and checks: bad input is a one-line error and exit status 2.

Each check raises :class:`UsageError` (or argparse's type error, which
:class:`Parser` reports the same way) naming the option and what it expects.
Nothing here touches a device but :func:`device_arg`, which only counts them.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = [
    "RESERVED_FACTS",
    "Parser",
    "UsageError",
    "add_config_option",
    "device_arg",
    "fact_arg",
    "shape_arg",
    "write_text",
]


class UsageError(Exception):
    """Bad command-line input: exit 2 with the message."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


#: Names a fact cannot take: they are parameters of PoolRegistry.workspace/resolve/reserve.
RESERVED_FACTS = frozenset({"self", "pool", "rule", "lane", "device", "nbytes"})


def fact_arg(text: str) -> tuple[str, int]:
    """Parse ``--fact NAME=INTEGER``."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier() or not name.isascii():
        raise argparse.ArgumentTypeError(f"expected NAME=INTEGER, got {text!r}")
    if name in RESERVED_FACTS:
        raise argparse.ArgumentTypeError(
            f"a fact cannot be named {name!r}: {', '.join(sorted(RESERVED_FACTS))} are parameters of "
            f"PoolRegistry.workspace(), so no call can pass such a fact"
        )
    try:
        if not value.isascii():
            raise ValueError
        return name, int(value, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"fact {name!r} must be an integer, got {value!r}") from None


def device_arg(text: str, *, allow_meta: bool = False) -> str:
    """Check that ``--device`` names a device this machine has (cpu, an available CUDA device, meta for bench)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(f"--device {text!r} is not a device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(f"--device {text!r}: no CUDA device is available on this machine")
        if device.index is not None and device.index >= count:
            raise UsageError(f"--device {text!r}: this machine has {count} CUDA device(s)")
    elif device.type != "cpu" and not (allow_meta and device.type == "meta"):
        allowed = "cpu, meta or a CUDA device" if allow_meta else "cpu or a CUDA device"
        raise UsageError(f"--device {text!r}: this command runs on {allowed}")
    return text


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE``."""
    parser.add_argument("--config", metavar="FILE", help="YAML configuration file (default: $WSPOOL_CONFIG)")


def shape_arg(text: str) -> object:
    """Parse a calibration ``--shape`` spec."""
    from wspool.tools.sweep import ShapeError, parse_shape

    try:
        return parse_shape(text)
    except ShapeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def write_text(path: str, text: str) -> None:
    """Write an output file; a failure is a :class:`UsageError` naming it."""
    try:
        with open(path, "w") as file:
            file.write(text)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None
