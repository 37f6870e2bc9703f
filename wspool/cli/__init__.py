"""The ``wspool`` command: doctor, demo, show, resolve, plan, stats, bench, calibrate.

Bad input exits with status 2 and one line on stderr, never a traceback. The
parser imports neither torch nor FlashInfer; each command imports what it needs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from wspool import __version__
from wspool.errors import WspoolError, printable
from wspool.settings.profiles import shadowed_shipped_name, shipped_config_names

__all__ = [
    "BENCH_DEFAULT_SECTIONS",
    "BENCH_SECTIONS",
    "CLOSED_PIPE_STATUS",
    "PACKAGE_LOGGER",
    "WIDTH",
    "Parser",
    "UsageError",
    "add_config_option",
    "build_parser",
    "device_arg",
    "fact_arg",
    "main",
    "shape_arg",
    "wrap",
    "write_text",
]

#: The widest line the commands print (longer ones are wrapped, with an indented continuation).
WIDTH = 100


def wrap(text: str, indent: str = "    ") -> str:
    """Return ``text`` wrapped to :data:`WIDTH` columns, continuation lines indented by ``indent``.

    Words are never split: a path or an expression longer than a line stays whole.
    """
    return textwrap.fill(
        text, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False, drop_whitespace=True
    )


class UsageError(Exception):
    """Bad command-line input: exit 2 with the message."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2, naming its own ``--help``.

    Attributes:
        commands: The subcommands' parsers by name (the top-level parser's), so that an
            option a command does not take is reported against that command's help.
    """

    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help that shows each option's default (where it has one worth showing) and keeps descriptions' line breaks.

    A description's long lines are wrapped to the terminal's width, as argparse wraps the options' help.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(
            textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent) if line.strip() else line
            for line in text.splitlines()
        )

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or action.option_strings == []:
            return text
        return f"{text} (default: %(default)s)"


def __getattr__(name: str) -> object:
    """Serve the deprecated ``RESERVED_FACTS`` (the settings' :data:`RESERVED_FACT_NAMES` now)."""
    if name == "RESERVED_FACTS":
        warnings.warn(
            "wspool.cli.RESERVED_FACTS is deprecated; use wspool.settings.schema.RESERVED_FACT_NAMES",
            DeprecationWarning,
            stacklevel=2,
        )
        from wspool.settings.schema import RESERVED_FACT_NAMES

        return RESERVED_FACT_NAMES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fact_arg(text: str) -> tuple[str, int]:
    """Parse ``--fact NAME=INTEGER`` (a negative one is refused where it is used, after the rule's own errors)."""
    from wspool.settings.schema import RESERVED_FACT_NAMES

    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier() or not name.isascii():
        raise argparse.ArgumentTypeError(f"expected NAME=INTEGER, got {text!r}")
    if name in RESERVED_FACT_NAMES:
        raise argparse.ArgumentTypeError(
            f"a fact cannot be named {name!r}: it is reserved (a parameter of PoolRegistry.workspace(), a Python "
            f"keyword or a rule function), so no call can pass such a fact"
        )
    try:
        if not value.isascii():
            raise ValueError
        number = int(value, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"fact {name!r} must be an integer, got {value!r}") from None
    return name, number


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
    """Add ``--config FILE|NAME``."""
    parser.add_argument(
        "--config",
        metavar="FILE|NAME",
        help="YAML configuration file, or a shipped configuration's name: "
        f"{', '.join(shipped_config_names())} (default: $WSPOOL_CONFIG, else none)",
    )


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


_Handler = Callable[[argparse.Namespace], int]
_DEVICE_HELP = "device (default: the current one: CUDA when available, else cpu)"
#: bench's sections, in the order it runs them (wspool.tools.bench.SECTIONS; a test keeps them equal).
BENCH_SECTIONS = ("hot_path", "engine_path", "mla_decode", "mla_plan", "decode_step", "memory")
#: The sections bench runs by default: engine_path, which imports the installed engines, is asked for by name.
BENCH_DEFAULT_SECTIONS = ("hot_path", "mla_decode", "mla_plan", "decode_step", "memory")


def _handler(module: str, name: str) -> _Handler:
    """A command's handler, imported when the command runs (the parser stays free of torch)."""

    def run(args: argparse.Namespace) -> int:
        function: _Handler = getattr(importlib.import_module(module), name)
        return function(args)

    return run


def _cmd_bench(args: argparse.Namespace) -> int:
    from wspool.tools.bench import SECTIONS, memory_sweep_blocker, run_benchmarks
    from wspool.tools.bench_report import (
        check_plot,
        failed_sections,
        format_report,
        load_figures,
        plot_memory,
        save_figures,
    )
    from wspool.tools.sweep import DEFAULT_SHAPES, load_shapes

    if (args.runs is not None and args.runs < 1) or args.repeats < 1:
        raise UsageError(f"--runs and --repeats must be at least 1, got {args.runs} and {args.repeats}")
    if args.plot_from:
        if not args.plot:
            raise UsageError("--plot-from needs --plot FILE.png")
        try:
            figures = load_figures(args.plot_from)
            plot_memory(figures, args.plot, source=args.plot_from)
        except (KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
            raise UsageError(f"--plot-from {args.plot_from}: malformed figures ({type(exc).__name__})") from None
        print(f"wrote {args.plot}")
        return 0
    else:
        sections = [s.strip() for s in args.sections.split(",") if s.strip()]
        unknown = sorted(set(sections) - set(SECTIONS))
        if unknown or not sections:
            raise UsageError(f"--sections takes a subset of {','.join(SECTIONS)}; got {args.sections!r}")
        if args.plot:  # what the plot needs, checked before a run that may take minutes
            check_plot(sections, memory_sweep_blocker())
        figures = run_benchmarks(
            sections=sections,
            hot_device=args.device,
            repeats=args.repeats,
            runs=args.runs,
            rules_file=args.rules,
            shapes=load_shapes(args.shapes) if args.shapes else DEFAULT_SHAPES,
        )
        if args.json == "-":
            print(json.dumps(figures, indent=2))
        else:
            print(format_report(figures))
            if args.json:
                save_figures(figures, args.json)
                print(f"wrote {args.json}")
    if args.plot:
        plot_memory(figures, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr if args.json == "-" else sys.stdout)
    failed = [] if args.plot_from else failed_sections(figures)
    if failed:
        print(f"wspool bench: error: section(s) failed: {', '.join(failed)} (see the report)", file=sys.stderr)
        return 1
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from wspool.tools.calibrate import run_calibration
    from wspool.tools.mla_probe import MLAWorkspaceProbe
    from wspool.tools.sweep import DEFAULT_SHAPES, load_shapes
    from wspool.units import format_size

    shapes = [*(load_shapes(args.shapes) if args.shapes else []), *(args.shape or [])] or list(DEFAULT_SHAPES)
    probe = MLAWorkspaceProbe(args.device, backend=args.backend)
    progress = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    report = run_calibration(shapes, probe, max_ratio=args.max_ratio, granularity=args.granularity, progress=progress)
    print(report.table())
    for rule in report.rules.values():
        print(
            f"rule {rule.name}: {rule.source}  ({rule.how}; peak minimum {rule.peak_bytes} bytes "
            f"({format_size(rule.peak_bytes)}); at most {rule.worst_ratio:.3f}x the minimum over {rule.shapes} shapes)"
        )
    if args.table:
        write_text(args.table, report.table() + "\n")
    if args.json:
        write_text(args.json, json.dumps(report.as_dict(), indent=2) + "\n")
    if args.out:
        write_text(args.out, report.rules_yaml())
        print(f"wrote {args.out}")
    else:
        print()
        print(report.rules_yaml(), end="")
    if not report.ok:
        failed = [m.shape.label for m in report.measurements if not m.ok]
        print(f"wspool calibrate: error: {len(failed)} shape(s) failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _command(commands: Any, name: str, summary: str, description: str | None = None) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name,
        help=summary,
        description=description or summary[0].upper() + summary[1:] + ".",
        formatter_class=_HelpFormatter,
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    """Return the ``wspool`` argument parser (it imports nothing heavy)."""
    parser = Parser(
        prog="wspool",
        description="Configurable, shared GPU workspace pools for LLM inference kernels.",
        epilog="Start with `wspool doctor`. Each command's options: wspool COMMAND --help.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"wspool {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    doctor = _command(
        commands,
        "doctor",
        "check this environment: versions, devices, engines, configuration, problems",
        "Report wspool's version, Python, torch, CUDA and each device's profile, FlashInfer, each engine wspool "
        "integrates (installed, supported, active, what it patches), the active configuration with every value "
        "that differs from the built-in defaults and its source, and the problems found, one line each with the "
        "setting that fixes it. Exit status 0: no problem; 1: problems found. Imports no engine and creates no "
        "CUDA context.",
    )
    add_config_option(doctor)
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(handler=_handler("wspool.cli.doctor", "cmd_doctor"))

    demo = _command(commands, "demo", "run MLA decode through the pool and check the results")
    demo.add_argument("--device", default=None, help=_DEVICE_HELP)
    add_config_option(demo)
    demo.set_defaults(handler=_handler("wspool.cli.commands", "cmd_demo"))

    show = _command(commands, "show", "print the effective configuration and where each value came from")
    add_config_option(show)
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.set_defaults(handler=_handler("wspool.cli.commands", "cmd_show"))

    resolve = _command(commands, "resolve", "print the size a call would get, and the setting that sizes it")
    resolve.add_argument("pool", help="a pool that `wspool show` lists, e.g. flashinfer_mla")
    resolve.add_argument("rule", nargs="?", default="default", help="the pool's rule (default: %(default)s)")
    resolve.add_argument("--fact", action="append", type=fact_arg, metavar="NAME=VALUE", help="a fact of the call")
    output = resolve.add_mutually_exclusive_group()
    output.add_argument("--bytes", action="store_true", help="print only the integer")
    output.add_argument("--json", action="store_true", help="machine-readable output")
    resolve.add_argument(
        "--device", default=None, help="the device whose profile and facts apply (default: the current one)"
    )
    add_config_option(resolve)
    resolve.set_defaults(handler=_handler("wspool.cli.commands", "cmd_resolve"))

    stats = _command(
        commands,
        "stats",
        "what the pools would hold for given facts (a dry run)",
        "Request every configured rule once with the given facts on the meta device, which allocates nothing, "
        "and print what each buffer would hold and which backends share it. A running process reports its own "
        "pools with PoolRegistry.memory_summary() / memory_stats().",
    )
    stats.add_argument("--fact", action="append", type=fact_arg, metavar="NAME=VALUE", help="a fact of the calls")
    stats.add_argument(
        "--from",
        dest="from_dir",
        metavar="DIR",
        help="show the snapshots a running engine's ranks wrote to DIR ($WSPOOL_STATS_DIR) instead of a dry run",
    )
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    add_config_option(stats)
    stats.set_defaults(handler=_handler("wspool.cli.commands", "cmd_stats"))

    plan = _command(
        commands,
        "plan",
        "print what each pool would reserve for limits on the calls' facts (allocates nothing)",
        "Bound every rule of every pool over the limits: its bytes, the fact values that give them, and whether "
        "the bound is proven (the size is monotone in each fact) or searched (every value tried). A fact with "
        "no limit is fixed at its default. Exit status 0: every rule bounded; 1: some rule refused (named).",
    )
    plan.add_argument(
        "--limit",
        action="append",
        metavar="NAME=MAX",
        help="a fact's largest value (NAME=MAX), range (NAME=LO..HI) or values (NAME=A,B,C); repeatable",
    )
    plan.add_argument("--fact", action="append", type=fact_arg, metavar="NAME=VALUE", help="fix a fact at a value")
    plan.add_argument("--pool", action="append", metavar="NAME", help="plan only this pool (repeatable; default: all)")
    plan.add_argument("--lane", action="append", metavar="NAME", help="a lane to plan (repeatable; default: main)")
    plan.add_argument(
        "--device", default=None, help="the device whose profile and facts apply (default: the current one)"
    )
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    add_config_option(plan)
    plan.set_defaults(handler=_handler("wspool.cli.commands", "cmd_plan"))

    bench = _command(commands, "bench", "measure the per-call path, MLA decode and memory (GPU parts on a GPU)")
    bench.add_argument("--device", default=None, help="device of the hot-path pools (default: the GPU, else cpu)")
    bench.add_argument("--repeats", type=int, default=101, help="timed batches per hot-path figure")
    bench.add_argument(
        "--runs",
        type=int,
        default=None,
        help="timed pairs per GPU figure, after warm-up (default: 1000 for mla_decode, 100 for decode_step)",
    )
    bench.add_argument(
        "--json", nargs="?", const="-", metavar="FILE", help="write the figures to FILE (no FILE: print JSON only)"
    )
    bench.add_argument("--plot", metavar="FILE.png", help="draw reserved against needed bytes (needs matplotlib)")
    bench.add_argument("--plot-from", metavar="FILE.json", help="plot figures a --json run wrote; measure nothing")
    bench.add_argument("--rules", metavar="FILE", help="measured rules (default: shipped hopper, or blackwell)")
    bench.add_argument("--shapes", metavar="FILE", help="YAML shapes of the memory sweep (default: the built-in sweep)")
    bench.add_argument(
        "--sections",
        default=",".join(BENCH_DEFAULT_SECTIONS),
        metavar="LIST",
        help=f"comma-separated subset of {', '.join(BENCH_SECTIONS)}",
    )
    bench.set_defaults(handler=_cmd_bench)

    calibrate = _command(commands, "calibrate", "measure MLA decode's workspace on this GPU; write the rules")
    calibrate.add_argument("--shapes", metavar="FILE", help="YAML file: shapes: [{batch_size: 1, num_heads: 128, ...}]")
    calibrate.add_argument(
        "--shape",
        action="append",
        type=shape_arg,
        metavar="SPEC",
        help="a shape, e.g. batch_size=1,num_heads=128,max_seq_len=4096,lse (repeatable; default: the built-in sweep)",
    )
    calibrate.add_argument("--out", metavar="FILE", help="write the rules YAML here (default: print it)")
    calibrate.add_argument("--table", metavar="FILE", help="also write the Markdown table here")
    calibrate.add_argument("--json", metavar="FILE", help="also write the measurements as JSON here")
    calibrate.add_argument("--device", default=None, help="CUDA device (default: the current one)")
    calibrate.add_argument("--backend", default="auto", choices=("auto", "fa3", "fa2"), help="wrapper backend")
    calibrate.add_argument("--max-ratio", type=float, default=1.1, help="most a formula may reserve over a minimum")
    calibrate.add_argument("--granularity", type=int, default=1, help="search resolution in bytes (1: exact)")
    calibrate.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    calibrate.set_defaults(handler=_cmd_calibrate)
    parser.commands = dict(commands.choices)
    return parser


#: The package's logger, ``wspool``, not this module's: every wspool module logs to a child of it
#: (``logging.getLogger(__name__)``), so the one handler the CLI adds here covers them all.
PACKAGE_LOGGER = __name__.split(".")[0]


@contextlib.contextmanager
def _quiet_logger() -> Iterator[None]:
    """Keep wspool's log records off stderr (Python's last-resort handler) unless the caller set up logging."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    if logger.hasHandlers():
        yield
        return
    handler = logging.NullHandler()
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _error(command: str, message: str) -> int:
    """Print the one error line (control characters escaped) and return exit status 2."""
    line = printable(" ".join(message.split()))
    with contextlib.suppress(OSError, ValueError):
        print(f"wspool {command}: error: {line}", file=sys.stderr, flush=True)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # the command's own parser names them, and its help (`wspool stats --help`), as git and pip do
            command = parser.commands.get(args.command, parser) if isinstance(parser, Parser) else parser
            command.error(f"unrecognized arguments: {' '.join(extra)}")
    except BrokenPipeError:  # --help or --version into a pipe closed early
        return _closed_pipe()
    if args.command is None:  # a bare `wspool`: the usage, as git and uv give it
        with contextlib.suppress(OSError, ValueError):
            parser.print_help(sys.stderr)
        return 2
    handler: _Handler = args.handler
    if sys.stdout is None:  # started with file descriptor 1 closed
        return _error(args.command, "cannot write the output: standard output is closed")
    try:
        if getattr(args, "device", None) is not None:  # every command that takes --device: demo, resolve, ...
            device_arg(args.device, allow_meta=args.command == "bench")
        _warn_shadowed(args)
        with _quiet_logger():
            status = handler(args)
            sys.stdout.flush()  # a closed pipe or a full disk surfaces here, not at exit
        return status
    except (WspoolError, UsageError, ValueError) as exc:
        return _error(args.command, str(exc))
    except BrokenPipeError:  # the reader left (`wspool show | head -1`): nothing is wrong, as for git
        return _closed_pipe()
    except OSError as exc:  # stdout is /dev/full, or another write failed
        _silence_stdout()
        return _error(args.command, f"cannot write the output: {exc.strerror or exc}")


def _warn_shadowed(args: argparse.Namespace) -> None:
    """Say in one line on stderr that a file in the working directory is read instead of the shipped configuration."""
    name = shadowed_shipped_name(getattr(args, "config", None))
    if name is not None:
        how = f"--config {name}" if getattr(args, "config", None) else f"WSPOOL_CONFIG={name}"
        print(
            f"wspool {args.command}: warning: {how} reads the file {name} in this directory, not the shipped "
            f"configuration {name} (run from another directory, or rename the file, to take the shipped one)",
            file=sys.stderr,
        )


#: The exit status of a command whose reader closed the pipe: 128 + SIGPIPE, as git's (a shell's $?).
CLOSED_PIPE_STATUS = 141


def _silence_stdout() -> None:
    """Point stdout at /dev/null: nothing more can reach it, and the interpreter's exit flush must be silent."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _closed_pipe() -> int:
    """End quietly after the reader of stdout went away: no message, status :data:`CLOSED_PIPE_STATUS`."""
    _silence_stdout()
    return CLOSED_PIPE_STATUS


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
