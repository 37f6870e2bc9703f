"""The ``wspool`` command: show, resolve, bench (and the commands of the FlashInfer ops).

Bad input exits with status 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from wspool.config import iter_settings, load_settings_with_provenance
from wspool.errors import WspoolError, describe_setting
from wspool.registry import PoolRegistry
from wspool.units import format_size

__all__ = ["main"]

_Handler = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """Bad command-line input: exit 2 with the message."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _fact(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=INTEGER, got {text!r}")
    try:
        return name, int(value, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"fact {name!r} must be an integer, got {value!r}") from None


def _add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML configuration file (default: $WSPOOL_CONFIG)")


def _cmd_show(args: argparse.Namespace) -> int:
    settings, provenance = load_settings_with_provenance(args.config)
    if args.json:
        rows = [
            {"key": ".".join(path), "value": value, "source": provenance.source_of(path)}
            for path, value in iter_settings(settings)
        ]
        print(json.dumps({"config_file": str(provenance.config_file or ""), "settings": rows}, indent=2))
        return 0
    print(f"config file: {provenance.config_file or '(none: built-in defaults and environment)'}")
    table = [
        (".".join(path), _show_value(path, value), provenance.source_of(path))
        for path, value in iter_settings(settings)
    ]
    width = max(len(key) for key, _, _ in table)
    vwidth = max(len(value) for _, value, _ in table)
    for key, value, source in table:
        print(f"{key:<{width}}  {value:<{vwidth}}  {source}")
    return 0


def _show_value(path: tuple[str, ...], value: object) -> str:
    if path and path[-1] == "max_bytes" and isinstance(value, int):
        return f"{value} ({format_size(value)})"
    return str(value)


def _cmd_resolve(args: argparse.Namespace) -> int:
    registry = PoolRegistry.from_config(args.config)
    facts = dict(args.fact or [])
    nbytes = registry.resolve(args.pool, args.rule, **facts)
    if args.bytes:
        print(nbytes)
    else:
        rule = registry.spec(args.pool).rules[args.rule]
        print(
            f"{args.pool}.{args.rule} = {nbytes} bytes ({format_size(nbytes)})  [rule {rule.source!r}; "
            f"set {describe_setting(('pools', args.pool, 'rules', args.rule))}]"
        )
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from wspool.bench import measure_hot_path

    figures = measure_hot_path(args.device, repeats=args.repeats)
    if args.json:
        print(json.dumps({"hot_path": figures.as_dict()}, indent=2))
        return 0
    print(f"hot path on {figures.device} (median per call, same run):")
    print(f"  seed _get_workspace_buffer(True)      {figures.seed_bare_ns:8.1f} ns")
    print(
        f"  reg.workspace(..., rule='lse') literal {figures.literal_rule_ns:8.1f} ns  "
        f"({figures.literal_vs_seed:.2f}x the seed)"
    )
    print(f"  reg.workspace(..., rule=expr, facts)   {figures.expression_rule_ns:8.1f} ns")
    print(f"  empty call (loop overhead)             {figures.empty_loop_ns:8.1f} ns")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from wspool.demo import run_demo

    registry = PoolRegistry.from_config(args.config)
    return 0 if run_demo(registry, args.device) else 1


def build_parser() -> argparse.ArgumentParser:
    """Return the ``wspool`` argument parser."""
    parser = _Parser(prog="wspool", description="Configurable GPU workspace pools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    demo = commands.add_parser("demo", help="run MLA decode through the pool and check the results")
    demo.add_argument("--device", default=None, help="device (default: CUDA when available, else cpu)")
    _add_config_option(demo)
    demo.set_defaults(handler=_cmd_demo)

    show = commands.add_parser("show", help="print the effective configuration and where each value came from")
    _add_config_option(show)
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.set_defaults(handler=_cmd_show)

    resolve = commands.add_parser("resolve", help="print the size a call would get")
    resolve.add_argument("pool")
    resolve.add_argument("rule", nargs="?", default="default")
    resolve.add_argument("--fact", action="append", type=_fact, metavar="NAME=VALUE", help="a fact of the call")
    resolve.add_argument("--bytes", action="store_true", help="print only the integer")
    _add_config_option(resolve)
    resolve.set_defaults(handler=_cmd_resolve)

    bench = commands.add_parser("bench", help="measure the per-call path")
    bench.add_argument("--device", default="cpu", help="device of the hot-path pools (default cpu)")
    bench.add_argument("--repeats", type=int, default=101, help="timed batches per figure")
    bench.add_argument("--json", action="store_true", help="print the figures as JSON")
    bench.set_defaults(handler=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: _Handler = args.handler
    try:
        return handler(args)
    except (WspoolError, UsageError, ValueError) as exc:
        message = " ".join(str(exc).split())
        print(f"wspool {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
