"""Tests for wspool.cli: show and resolve, exit codes and error lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import wspool
from wspool.cli import main
from wspool.settings.profiles import shipped_config_names

LSE_ENV = "WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE"


def show_rows(out: str) -> dict[str, str]:
    """``show``'s lines as {what: the rest}, its wrapped lines joined: ``key = value (from ...)`` or ``what: ...``."""
    lines: list[str] = []
    for line in out.splitlines():
        if line.startswith("    ") and lines:
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    rows = {}
    for line in lines:
        head, sep, rest = line.partition(" = ")
        if not sep:
            head, sep, rest = line.partition(": ")
        rows[head] = rest
    return rows


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WSPOOL_")}
    return subprocess.run(
        [sys.executable, "-m", "wspool", *args], capture_output=True, text=True, env={**clean, **(env or {})}
    )


def test_resolve_acceptance_values(tmp_path: Path) -> None:
    """The issue's acceptance: defaults, env override, YAML file, env beats file (real processes)."""
    assert _run("resolve", "flashinfer_mla", "lse", "--bytes").stdout.strip() == "268435456"
    assert _run("resolve", "flashinfer_mla", "--bytes").stdout.strip() == "134217728"
    assert _run("resolve", "flashinfer_mla", "lse", "--bytes", env={LSE_ENV: "512MiB"}).stdout.strip() == "536870912"
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  flashinfer_mla:\n    rules:\n      lse: 300MiB\n")
    assert _run("resolve", "flashinfer_mla", "lse", "--bytes", "--config", str(path)).stdout.strip() == "314572800"
    assert (
        _run("resolve", "flashinfer_mla", "lse", "--bytes", env={"WSPOOL_CONFIG": str(path)}).stdout.strip()
        == "314572800"
    )
    both = _run("resolve", "flashinfer_mla", "lse", "--bytes", env={"WSPOOL_CONFIG": str(path), LSE_ENV: "512MiB"})
    assert both.stdout.strip() == "536870912"


def test_resolve_with_facts(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--fact supplies the facts of an expression rule; without --bytes the size is explained."""
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  mla:\n    rules:\n      lse: 8 * num_heads * batch_size * round_up(q_len, 256) + 1MiB\n")
    assert (
        main(
            [
                "resolve",
                "mla",
                "lse",
                "--config",
                str(path),
                "--fact",
                "num_heads=128",
                "--fact",
                "batch_size=2",
                "--fact",
                "q_len=1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("mla.lse = 1572864 bytes (1.5MiB)")
    assert "WSPOOL_POOLS__MLA__RULES__LSE" in out


def test_show_names_sources(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """show prints each value with default, YAML file or environment variable as its source."""
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  flashinfer_mla:\n    rules:\n      default: 64MiB\n")
    monkeypatch.setenv(LSE_ENV, "512MiB")
    assert main(["show", "--config", str(path)]) == 0
    rows = show_rows(capsys.readouterr().out)
    assert rows["config file"] == f"{path} (given explicitly)"
    assert rows["pools.flashinfer_mla.rules.lse"] == f"512MiB (from environment variable {LSE_ENV})"
    assert rows["pools.flashinfer_mla.rules.default"] == f"64MiB (from YAML file {path})"
    assert rows["pools.flashinfer_mla.growth"] == "exact (from built-in default)"


def test_show_says_where_flashinfers_int_workspaces_come_from(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """show names the MLA hook's state and the int workspace rules, a configured one as configured."""
    monkeypatch.setenv("WSPOOL_POOLS__FLASHINFER_INT__RULES__MLA", "1MiB")
    assert main(["show"]) == 0
    out = capsys.readouterr().out
    assert "FlashInfer wrappers' int workspaces: MLA wrappers take int workspaces from pool flashinfer_int" in out
    rows = show_rows(out)
    assert (
        rows["  pools.flashinfer_int.rules.mla"]
        == "1MiB (from environment variable WSPOOL_POOLS__FLASHINFER_INT__RULES__MLA)"
    )
    assert rows["  pools.flashinfer_int.rules.decode"] == (
        "13 * max(batch_size, ceil_div(32 * sm_count, num_kv_heads)) + 64 (from wspool's default for FlashInfer "
        "wrappers' int workspaces (declared in code))"
    )
    assert main(["show", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["int_workspaces"]["rules"]["mla"] == {
        "value": "1MiB",
        "source": "environment variable WSPOOL_POOLS__FLASHINFER_INT__RULES__MLA",
    }


def test_show_json(capsys: pytest.CaptureFixture[str]) -> None:
    """show --json is machine-readable."""
    assert main(["show", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {row["key"]: row for row in data["settings"]}
    assert rows["pools.flashinfer_mla.rules.lse"] == {
        "key": "pools.flashinfer_mla.rules.lse",
        "value": "256MiB",
        "source": "profile fixed",  # the CPU's profile under auto
        "overrides": [],
    }
    assert data["devices"][0]["profile"] == "fixed"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["resolve", "nope"], {}, "wspool resolve: error: unknown pool 'nope'"),
        (["resolve", "flashinfer_mla", "prefill"], {}, "wspool resolve: error: pool 'flashinfer_mla' has no rule"),
        (["resolve", "flashinfer_mla", "--config", "/nonexistent.yaml"], {}, "does not exist"),
        (["resolve", "flashinfer_mla", "--fact", "x=y"], {}, "fact 'x' must be an integer"),
        (["resolve", "flashinfer_mla", "lse"], {LSE_ENV: "lots of"}, f"from environment variable {LSE_ENV}"),
        (["show"], {"WSPOOL_CONFIG": "/nonexistent.yaml"}, "named by WSPOOL_CONFIG"),
        (["frobnicate"], {}, "invalid choice"),
        (["--bogus"], {}, "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_exits_2_with_one_line(args: list[str], env: dict[str, str], message: str) -> None:
    """Bad input exits 2 with a single error line on stderr and no traceback."""
    result = _run(*args, env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr


def test_bench_prints_hot_path_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """bench prints vLLM's and wspool's per-call costs from one run."""
    assert main(["bench", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert "vLLM's _get_workspace_buffer(True)" in out
    assert "x vLLM's)" in out


# -- every bad invocation: exit 2, one line on stderr, no traceback ---------------------------


def _in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        status = main(list(args))
    except SystemExit as exc:  # argparse's own errors
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("demo", "--device", "cuda"), "no CUDA device is available"),
        (("demo", "--device", "cuda:0"), "no CUDA device is available"),
        (("demo", "--device", "meta"), "this command runs on cpu or a CUDA device"),
        (("demo", "--device", "mps"), "this command runs on cpu or a CUDA device"),
        (("demo", "--device", "0"), "is not a device"),
        (("bench", "--device", "cuda", "--sections", "hot_path"), "no CUDA device is available"),
        (("resolve", "flashinfer_mla", "--fact", "pool=5"), "a fact cannot be named 'pool'"),
        (("resolve", "flashinfer_mla", "--fact", "rule=5"), "a fact cannot be named 'rule'"),
        (("resolve", "flashinfer_mla", "--fact", "lane=5"), "a fact cannot be named 'lane'"),
        (("resolve", "flashinfer_mla", "--fact", "device=5"), "a fact cannot be named 'device'"),
        (("stats", "--fact", "self=5"), "a fact cannot be named 'self'"),
    ],
)
def test_bad_invocations_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], match: str
) -> None:
    """Unavailable devices and facts named like parameters: exit 2, exactly one stderr line."""
    import torch

    if torch.cuda.is_available() and "cuda" in args:
        pytest.skip("this machine has CUDA")
    status, _, err = _in_process(capsys, *args)
    assert status == 2
    assert len(err.splitlines()) == 1 and match in err, err


def test_malformed_plot_from_json_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--plot-from with truncated JSON, a list, or figures of the wrong shape: exit 2, one line."""
    cases = {"cut.json": '{"machine": ', "list.json": "[1, 2]", "odd.json": '{"machine": 1, "memory": 5}'}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        plot = ("--plot", str(tmp_path / "x.png"), "--plot-from", str(tmp_path / name))
        status, _, err = _in_process(capsys, "bench", *plot)
        assert status == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (name, err)


def test_output_to_dev_full_is_one_line() -> None:
    """A real process with stdout on /dev/full exits 2 with one line naming the failure."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WSPOOL_")}
    with open("/dev/full", "w") as full:
        command = [sys.executable, "-m", "wspool", "show"]
        done = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, env=clean)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["wspool show: error: cannot write the output: No space left on device"]


@pytest.mark.parametrize(
    ("args", "statuses"),
    [
        (("show",), {141}),
        (("doctor",), {141}),
        (("resolve", "flashinfer_mla"), {141}),
        (("--help",), {0, 141}),  # argparse's own printing drops the write error
        (("--version",), {0, 141}),
    ],
)
def test_a_closed_pipe_is_silent(args: tuple[str, ...], statuses: set[int]) -> None:
    """A reader that closes the pipe at once (`wspool show | head -1`): no message; a command exits 141, as git."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WSPOOL_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "wspool", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert err == ""
    assert proc.wait(60) in statuses


def test_show_and_errors_escape_control_characters(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A pool name with an ANSI escape and a newline reaches the terminal escaped, in show and in errors."""
    path = tmp_path / "c.yaml"
    path.write_text('pools: {"\\e[31mred\\nfake": {rules: {default: 1KiB}}}\n')
    status, out, _ = _in_process(capsys, "show", "--config", str(path))
    assert status == 0
    assert "\x1b" not in out and "\\x1b[31mred\\nfake" in out
    path.write_text('pools: {"\\e[31mred\\nfake": {rules: {default: -1}}}\n')
    status, _, err = _in_process(capsys, "show", "--config", str(path))
    assert status == 2 and "\x1b" not in err and len(err.splitlines()) == 1


def test_no_logger_line_before_the_error(tmp_path: Path) -> None:
    """A refused growth logs a WARNING; the CLI keeps it off stderr, which holds only the error line (real process)."""
    path = tmp_path / "c.yaml"
    rules = "{default: num_heads * 1MiB, lse: num_heads * 1MiB}"
    path.write_text(f"pools: {{flashinfer_mla: {{rules: {rules}, max_bytes: 2MiB}}}}\n")
    done = _run("demo", "--device", "cpu", "--config", str(path))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "wspool demo: error: pool 'flashinfer_mla' on cpu (lane main) needs 16777216 bytes (16MiB) for rule default, "
        "above max_bytes = 2097152 bytes (2MiB); raise pools.flashinfer_mla.max_bytes / "
        "WSPOOL_POOLS__FLASHINFER_MLA__MAX_BYTES"
    ]


@pytest.mark.parametrize("name", ["nbytes", "class", "max", "round_up", "pool"])
def test_a_fact_named_like_a_reserved_name_is_refused_by_the_one_list(
    capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """--fact refuses exactly the names the settings refuse for default facts: one list for both."""
    from wspool.settings.schema import RESERVED_FACT_NAMES

    assert name in RESERVED_FACT_NAMES
    status, _, err = _in_process(capsys, "resolve", "flashinfer_mla", "--fact", f"{name}=5")
    assert status == 2
    assert err.splitlines() == [
        f"wspool resolve: error: argument --fact: a fact cannot be named {name!r}: it is reserved (a parameter "
        "of PoolRegistry.workspace(), a Python keyword or a rule function), so no call can pass such a fact "
        "(see wspool resolve --help)"
    ]


def test_the_old_name_of_the_reserved_facts_still_works_with_a_warning() -> None:
    """wspool.cli.RESERVED_FACTS is a deprecated alias of wspool.settings.schema.RESERVED_FACT_NAMES."""
    import wspool.cli
    from wspool.settings.schema import RESERVED_FACT_NAMES

    with pytest.warns(DeprecationWarning, match="RESERVED_FACTS is deprecated; use .*RESERVED_FACT_NAMES"):
        assert wspool.cli.RESERVED_FACTS is RESERVED_FACT_NAMES


def test_config_takes_a_shipped_name(capsys: pytest.CaptureFixture[str]) -> None:
    """wspool resolve --config kimi_dcp reads the shipped file, as an installed package has no configs/ folder."""
    facts = ("--fact", "num_heads=8", "--fact", "cp_world=8", "--fact", "batch_size=1024", "--fact", "q_len=1")
    assert main(["resolve", "flashinfer_mla", "lse", "--config", "kimi_dcp", "--bytes", *facts]) == 0
    assert capsys.readouterr().out.strip() == str(135266304 + 32 * 2**20)
    status, _, err = _in_process(capsys, "show", "--config", "nope")
    assert status == 2
    shipped = "(shipped: blackwell, default, hopper, kimi_dcp, sglang, tokenspeed, vllm)"
    assert f"no shipped configuration has that name {shipped}" in err


def test_show_refuses_a_rule_of_an_own_pool_that_no_call_can_resolve(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """WSPOOL_POOLS__FLASHINFER_MLA__RULES__LSE=lots: show exits 2 with one line naming the setting."""
    monkeypatch.setenv(LSE_ENV, "lots")
    status, out, err = _in_process(capsys, "show")
    assert status == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith(
        f"wspool show: error: invalid wspool configuration: pools.flashinfer_mla.rules.lse = 'lots' "
        f"(from environment variable {LSE_ENV}) reads lots, which is neither a size nor a fact"
    )
    assert f"set pools.flashinfer_mla.rules.lse / {LSE_ENV}" in line


def test_show_warns_of_a_fact_only_a_backend_can_pass(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A pool declared in code may pass its own facts: show still flags the name, on stderr, and exits 0."""
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  attn:\n    rules: {default: x * 1KiB, split: num_heads * 4, d: y * sm_count}\n"
                    "    facts: {y: 2}\n")  # fmt: skip
    status, out, err = _in_process(capsys, "show", "--config", str(path))
    assert status == 0 and "pools.attn.rules.default" in out
    (line,) = err.splitlines()
    assert line.startswith(
        f"wspool show: warning: pools.attn.rules.default = 'x * 1KiB' (from YAML file {path}) reads x, "
        "which is neither a size nor a fact that pool 'attn' is given"
    )
    assert line.endswith(
        "it resolves only for calls that pass x (a backend that declares pool 'attn' in code may); give a default "
        "in pools.attn.facts.x / WSPOOL_POOLS__ATTN__FACTS__X, or fix pools.attn.rules.default / "
        "WSPOOL_POOLS__ATTN__RULES__DEFAULT"
    )
    assert main(["show", "--config", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["warnings"] == [line.removeprefix("wspool show: warning: ")]
    assert captured.err == ""


@pytest.mark.parametrize("command", [("resolve", "flashinfer_mla"), ("calibrate",), ("demo",), ("bench",)])
def test_every_command_checks_device_against_the_devices_present(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: tuple[str, ...]
) -> None:
    """--device cuda:7 on a (simulated) one-GPU machine: exit 2 with one line, not an answer for another device."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    status, out, err = _in_process(capsys, *command, "--device", "cuda:7")
    assert status == 2 and out == ""
    assert err.splitlines() == [f"wspool {command[0]}: error: --device 'cuda:7': this machine has 1 CUDA device(s)"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("resolve", "p", "--device", "cuda"), "--device 'cuda': no CUDA device is available on this machine"),
        (("calibrate", "--device", "cuda:0"), "--device 'cuda:0': no CUDA device is available on this machine"),
        (("resolve", "p", "--device", "meta"), "--device 'meta': this command runs on cpu or a CUDA device"),
        (("resolve", "p", "--device", "gpu"), "--device 'gpu' is not a device (e.g. cpu, cuda, cuda:1)"),
    ],
)
def test_resolve_and_calibrate_check_device_as_demo_does(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    """resolve --device cuda without CUDA is one error line and exit 2, not a traceback and exit 1."""
    import torch

    if torch.cuda.is_available() and "cuda" in args[-1]:
        pytest.skip("this machine has CUDA")
    status, _, err = _in_process(capsys, *args)
    assert status == 2
    assert err.splitlines() == [f"wspool {args[0]}: error: {message}"]


#: The shipped configurations whose MLA rules read a device fact (sm_count): on the CPU they cannot resolve.
DEVICE_SIZED = {"hopper"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(shipped_config_names()) - DEVICE_SIZED))
def test_demo_passes_with_every_shipped_configuration_on_the_cpu(capsys: pytest.CaptureFixture[str], name: str) -> None:
    """wspool demo --config NAME --device cpu exits 0 for every shipped configuration sized without the device."""
    assert set(shipped_config_names()) >= DEVICE_SIZED
    status, out, err = _in_process(capsys, "demo", "--config", name, "--device", "cpu")
    assert (status, err) == (0, ""), out
    assert out.splitlines()[-1] == "demo: all checks passed"
    assert all(len(line) <= 100 for line in out.splitlines())
    assert "  vLLM's fixed size = 128MiB: Buffer overflow" in out


@pytest.mark.parametrize("name", sorted(DEVICE_SIZED))
def test_demo_names_a_device_fact_the_cpu_lacks_as_resolve_does(capsys: pytest.CaptureFixture[str], name: str) -> None:
    """On the CPU, demo --config hopper exits 2 with resolve's error naming sm_count, not a stand-in size."""
    status, out, err = _in_process(capsys, "demo", "--config", name, "--device", "cpu")
    assert (status, out) == (2, "")
    _, _, resolve_err = _in_process(capsys, "resolve", "flashinfer_mla", "--config", name, "--device", "cpu")
    assert (
        err.removeprefix("wspool demo: ").split(" that the call")[0]
        == (resolve_err.removeprefix("wspool resolve: ").split(" that the call")[0])
    )
    assert "needs fact(s) sm_count" in err and "pools.flashinfer_mla.facts.sm_count" in err
    assert "--fact sm_count=VALUE" in resolve_err


def test_the_demo_replay_names_a_configuration_not_meant_for_blackwell(capsys: pytest.CaptureFixture[str]) -> None:
    """With configs/hopper.yaml the replay resolves the rule with a B200's facts, names its source, and checks
    the blackwell profile's own rule instead."""
    from wspool.registry import PoolRegistry
    from wspool.tools.demo import run_demo

    lines: list[str] = []
    assert run_demo(PoolRegistry.from_config("hopper"), "cpu", batch=2, heads=4, max_len=128, layers=1,
                    echo=lines.append)  # fmt: skip
    replay = lines[-5:]
    assert replay[1].startswith(
        "  rule pools.flashinfer_mla.rules.lse on a modelled NVIDIA B200 (from shipped configuration hopper)"
    )
    assert f"= {wspool.format_size(64 * 148 * (4 * 512 + 8))}: Buffer overflow" in replay[1]
    assert replay[2].startswith("  this configuration does not size MLA decode for Blackwell")
    assert replay[3] == "  the blackwell profile's rule = 193MiB: fits"
    assert replay[4] == "demo: all checks passed"


def test_the_cli_keeps_a_wspool_modules_log_records_off_stderr() -> None:
    """A warning logged on a wspool module's own logger (a child of 'wspool') during a command is not printed."""
    code = (
        "import logging, sys\n"
        "import wspool.cli as cli, wspool.cli.commands as commands\n"
        "show = commands.cmd_show\n"
        "def noisy(args):\n"
        "    logging.getLogger('wspool.settings.schema').warning('a warning nobody configured a handler for')\n"
        "    return show(args)\n"
        "commands.cmd_show = noisy\n"
        "sys.exit(cli.main(['show']))\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WSPOOL_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("config file: ")


# -- the command line's own inputs and conventions (issue 35's defects 9-11, issue 34's conventions) --------


def _run_guarded(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run wspool (or ``code``) in a process that may not outlive 60 s nor hold more than 4 GiB of address space."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    clean = {k: v for k, v in os.environ.items() if not k.startswith("WSPOOL_")}
    command = [sys.executable, "-c", code] if code is not None else [sys.executable, "-m", "wspool", *args]
    return subprocess.run(command, capture_output=True, text=True, env=clean, timeout=60, preexec_fn=limit)


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "directory"])
def test_bench_plot_from_refuses_what_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    """bench --plot-from refuses a FIFO (no writer: it would block), /dev/zero (endless) and a directory: exit 2."""
    if kind == "fifo":
        path = tmp_path / "figures.json"
        os.mkfifo(path)
    else:
        path = tmp_path if kind == "directory" else Path(kind)
    done = _run_guarded("bench", "--plot-from", str(path), "--plot", str(tmp_path / "x.png"))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"wspool bench: error: figures file {path} does not exist or is not a file (a FIFO, device or directory)\n"
    )


def test_bench_plot_from_refuses_a_file_over_its_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A figures file larger than MAX_FIGURES_BYTES is refused before it is parsed."""
    from wspool.tools.bench_report import MAX_FIGURES_BYTES

    path = tmp_path / "big.json"
    path.write_text(" " * (MAX_FIGURES_BYTES + 1))
    status, out, err = _in_process(capsys, "bench", "--plot-from", str(path), "--plot", str(tmp_path / "x.png"))
    assert (status, out) == (2, "")
    assert err == f"wspool bench: error: figures file {path} is larger than 16MiB\n"


#: A value for every fact wspool's ops and the device supply, so every rule of every pool resolves.
ALL_FACTS = [
    *(f"{name}=8" for name in ("batch_size", "q_len", "num_heads", "page_size", "cp_world", "num_tokens")),
    *(f"{name}=8" for name in ("num_qo_heads", "num_kv_heads", "q_heads", "batch_tokens")),
    "max_seq_len=4096", "dtype_bytes=2", "kv_dtype_size=2", "kv_lora_rank=512", "qk_rope_head_dim=64",
    "qk_nope_head_dim=128", "head_dim=128", "min_bytes=4096", "sglang_bytes=1048576",
    "tokenspeed_bytes=1048576",
    "sm_count=132", "cc_major=9", "cc_minor=0", "device_memory=150000000000",
]  # fmt: skip


@pytest.mark.parametrize("config", [None, *shipped_config_names()])
def test_every_pool_show_lists_resolves(capsys: pytest.CaptureFixture[str], config: str | None) -> None:
    """Every rule `show` lists, pools.flashinfer_int's included, is one `resolve` resolves (with its facts)."""
    from wspool.settings.schema import DEVICE_FACTS, SHAPE_FACTS

    assert {fact.split("=")[0] for fact in ALL_FACTS} == SHAPE_FACTS | set(DEVICE_FACTS)
    given = ["--config", config] if config else []
    assert main(["show", "--json", *given]) == 0
    data = json.loads(capsys.readouterr().out)
    listed = [row["key"].split(".") for row in data["settings"] if ".rules." in row["key"]]
    listed += [["pools", "flashinfer_int", "rules", rule] for rule in data["int_workspaces"]["rules"]]
    assert ["pools", "flashinfer_int", "rules", "mla"] in listed and len(listed) >= 6
    for _, pool, _, rule in listed:
        facts = [arg for fact in ALL_FACTS for arg in ("--fact", fact)]
        status, out, err = _in_process(capsys, "resolve", pool, rule, "--bytes", "--device", "cpu", *given, *facts)
        assert (status, err) == (0, ""), (pool, rule)
        assert int(out) > 0


_FAILING_FLASHINFER = """
import sys


class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "flashinfer" or name.startswith("flashinfer."):
            raise {error}
        return None


sys.meta_path.insert(0, Refuse())
from wspool.cli import main

sys.exit(main(["show"]))
"""


@pytest.mark.parametrize(
    "error",
    [
        "OSError('libcudart.so.13: cannot open shared object file: No such file or directory')",
        "RuntimeError('CUDA driver initialization failed')",
    ],
)
def test_show_shows_the_configuration_when_flashinfer_fails_to_load(error: str) -> None:
    """FlashInfer's import raising an OSError or a RuntimeError: show still shows everything, says why, exits 0."""
    done = _run_guarded(code=_FAILING_FLASHINFER.format(error=error))
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    kind, _, message = error.partition("('")
    why = message.removesuffix("')")
    rows = show_rows(done.stdout)
    assert rows["FlashInfer wrappers' int workspaces"].startswith(f"FlashInfer could not be loaded ({kind}: {why})")
    assert rows["pools.flashinfer_mla.rules.lse"] == "256MiB (from profile fixed)"
    assert rows["  pools.flashinfer_int.rules.mla"].startswith("9 * 65536 + 5 * round_up(4 * sm_count, 16)")


def test_version_and_a_bare_call(capsys: pytest.CaptureFixture[str]) -> None:
    """--version prints wspool's version (pyproject's); a bare `wspool` prints the usage on stderr and exits 2."""
    import re

    from tests.helpers.paths import REPO_ROOT

    version = re.search(r'^version = "(.+)"$', (REPO_ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert version is not None
    status, out, _ = _in_process(capsys, "--version")
    assert (status, out) == (0, f"wspool {version.group(1)}\n")
    status, out, err = _in_process(capsys)
    assert (status, out) == (2, "")
    assert err.startswith("usage: wspool [-h] [--version] COMMAND ...") and "doctor" in err


def test_help_shows_defaults_and_choices(capsys: pytest.CaptureFixture[str]) -> None:
    """Each command's help gives the defaults and the choices of its options."""
    status, out, _ = _in_process(capsys, "calibrate", "--help")
    text = " ".join(out.split())
    assert status == 0
    assert "--backend {auto,fa3,fa2} wrapper backend (default: auto)" in text
    assert "most a formula may reserve over a minimum (default: 1.1)" in text
    _, out, _ = _in_process(capsys, "bench", "--help")
    text = " ".join(out.split())
    assert (
        "comma-separated subset of hot_path, engine_path, mla_decode, mla_plan, decode_step, memory (default: "
        "hot_path,mla_decode,mla_plan,decode_step,memory)"
    ) in text
    assert "timed batches per hot-path figure (default: 101)" in text
    _, out, _ = _in_process(capsys, "resolve", "--help")
    assert "the pool's rule (default: default)" in " ".join(out.split())


def test_bench_sections_are_the_benchmarks_sections() -> None:
    """The parser's list of bench sections (kept without importing the benchmarks) is the benchmarks' own."""
    from wspool.cli import BENCH_SECTIONS
    from wspool.tools.bench import SECTIONS

    assert tuple(SECTIONS) == BENCH_SECTIONS


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["show", "--help"], ["doctor", "--help"]])
def test_help_and_version_import_neither_torch_nor_flashinfer(args: list[str]) -> None:
    """--help and --version run without importing torch or FlashInfer (they start at once)."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['wspool', *{args!r}]\n"
        "try:\n"
        "    runpy.run_module('wspool', run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        "heavy = sorted(m for m in ('torch', 'flashinfer') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = _run_guarded(code=code)
    assert (done.returncode, done.stderr) == (0, "")


def test_the_public_names_still_import_from_the_package() -> None:
    """`from wspool import PoolRegistry` and every other public name still work, loaded on first use."""
    import importlib

    fresh = importlib.import_module("wspool")
    assert {"PoolRegistry", "load_settings", "get_registry"} <= set(fresh.__all__)
    assert all(getattr(fresh, name) is not None for name in fresh.__all__)
    from wspool import PoolRegistry, load_settings

    assert PoolRegistry.__module__ == "wspool.registry" and load_settings.__module__ == "wspool.settings.schema"
    assert wspool.registry.PoolRegistry is PoolRegistry  # a submodule is an attribute, as before


# -- what a new user meets: facts, advice that names the fix, CLI conventions --------------------------------------


def test_resolve_refuses_a_fact_no_rule_reads(capsys: pytest.CaptureFixture[str]) -> None:
    """A mistyped --fact exits 2 with one line naming it, the facts the rule reads and the close spelling."""
    status, out, err = _in_process(
        capsys, "resolve", "flashinfer_mla", "lse", "--config", "kimi_dcp", "--fact", "batchsize=8", "--device", "cpu"
    )
    assert (status, out, len(err.splitlines())) == (2, "", 1)
    assert "'batchsize' is read by no rule of pool 'flashinfer_mla'" in err
    assert "rule lse reads batch_size, cp_world, num_heads, q_len" in err and "did you mean 'batch_size'?" in err


def test_stats_refuses_a_fact_no_rule_reads(capsys: pytest.CaptureFixture[str]) -> None:
    """stats --fact with a name no rule of any pool reads exits 2 naming it and the close spelling."""
    status, out, err = _in_process(capsys, "stats", "--fact", "headdim=128")
    assert (status, out, len(err.splitlines())) == (2, "", 1)
    assert "--fact headdim: no rule of any pool reads 'headdim'" in err and "did you mean 'head_dim'?" in err


@pytest.mark.parametrize(
    "args",
    [
        ("stats", "--fact", "batch_size=-1"),
        ("stats", "--config", "kimi_dcp", "--fact", "batch_size=-1"),
        ("plan", "--config", "kimi_dcp", "--limit", "batch_size=8", "--fact", "q_len=-3"),
    ],
)
def test_stats_and_plan_refuse_a_negative_fact(capsys: pytest.CaptureFixture[str], args: tuple[str, ...]) -> None:
    """stats and plan refuse a negative --fact in one line, exit 2, as resolve does, instead of skipping the rule."""
    status, out, err = _in_process(capsys, *args)
    name, value = args[-1].split("=")
    assert (status, out, len(err.splitlines())) == (2, "", 1)
    assert f"--fact {name}={value} is negative: a fact is a non-negative integer" in err


def test_resolve_names_each_fact_it_read_and_its_source() -> None:
    """resolve prints each fact the rule read with its value and origin (variable, --fact, shipped), text and JSON."""
    env = {"WSPOOL_POOLS__FLASHINFER_MLA__FACTS__BATCH_SIZE": "64"}
    args = ("resolve", "flashinfer_mla", "lse", "--config", "kimi_dcp", "--device", "cpu", "--fact", "q_len=2")
    text = _run(*args, env=env)
    assert text.returncode == 0, text.stderr
    lines = [line.strip() for line in text.stdout.splitlines()]
    assert "fact batch_size = 64 (from environment variable WSPOOL_POOLS__FLASHINFER_MLA__FACTS__BATCH_SIZE)" in lines
    assert (
        "fact q_len = 2 (from --fact)" in lines and "fact cp_world = 8 (from shipped configuration kimi_dcp)" in lines
    )
    assert "on cpu (--device), profile fixed (auto: no GPU description" in text.stdout
    data = json.loads(_run(*args, "--json", env=env).stdout)
    assert data["facts"]["batch_size"] == {
        "value": 64,
        "source": "environment variable WSPOOL_POOLS__FLASHINFER_MLA__FACTS__BATCH_SIZE",
    }
    assert data["facts"]["q_len"] == {"value": 2, "source": "--fact"}
    assert data["profile_reason"].startswith("auto: no GPU description")
    assert data["bytes"] == 8 * 8 * 8 * 64 * 256 + 33 * 2**20


def test_resolve_names_a_fact_given_that_the_rule_does_not_read(capsys: pytest.CaptureFixture[str]) -> None:
    """A known fact a fixed-size rule does not read is shown as not read, never silently dropped."""
    status, out, _ = _in_process(
        capsys, "resolve", "flashinfer_mla", "lse", "--fact", "batch_size=3", "--device", "cpu"
    )
    assert status == 0
    assert "facts: none (the rule is a fixed size)" in out and "given, but not read by this rule: batch_size=3" in out


@pytest.mark.parametrize("value", ["-1", "-0x10"])
def test_resolve_refuses_a_negative_fact(capsys: pytest.CaptureFixture[str], value: str) -> None:
    """--fact batch_size=-1 exits 2 naming the fact, as a default fact in YAML or WSPOOL_* is refused."""
    status, out, err = _in_process(
        capsys, "resolve", "flashinfer_mla", "lse", "--config", "kimi_dcp", "--fact", f"batch_size={value}"
    )
    assert (status, out, len(err.splitlines())) == (2, "", 1)
    assert f"fact 'batch_size' = {int(value, 0)} is negative: a fact is a non-negative integer" in err
    assert "pools.flashinfer_mla.facts.batch_size / WSPOOL_POOLS__FLASHINFER_MLA__FACTS__BATCH_SIZE" in err


@pytest.mark.parametrize(
    ("args", "needed"),
    [
        (("resolve", "flashinfer", "decode"), "--fact head_dim=VALUE --fact num_qo_heads=VALUE --fact sm_count=VALUE"),
        (("resolve", "flashinfer_mla", "lse", "--config", "hopper"), "--fact sm_count=VALUE"),
    ],
)
def test_resolve_names_fact_for_a_missing_fact(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], needed: str
) -> None:
    """A fact nothing supplies is named with the --fact that gives it, and the default fact's key."""
    status, out, err = _in_process(capsys, *args, "--device", "cpu")
    assert (status, out, len(err.splitlines())) == (2, "", 1)
    assert needed in err and "that the call did not supply" in err and "(sm_count: a CUDA device gives it" in err


@pytest.mark.parametrize(
    ("args", "fix"),
    [
        (("resolve", "flashinfer", "vllm"), "--config vllm"),
        (("resolve", "sglang_trtllm_mla"), "--config sglang"),
        (("resolve", "tokenspeed_scratch"), "--config tokenspeed"),
    ],
)
def test_an_engine_rule_without_its_configuration_names_it(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], fix: str
) -> None:
    """A pool or rule only an engine's shipped configuration defines names that configuration as the fix."""
    status, out, err = _in_process(capsys, *args)
    assert (status, out, len(err.splitlines())) == (2, "", 1)
    assert f"the shipped configuration that defines it: {fix}" in err


@pytest.mark.parametrize(("args", "command"), [(("stats", "--device", "cpu"), "stats"), (("show", "--bytes"), "show")])
def test_an_option_the_command_lacks_names_its_help(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], command: str
) -> None:
    """An option a command does not take points at that command's help, as git and pip do."""
    status, out, err = _in_process(capsys, *args)
    assert (status, out) == (2, "")
    extra = " ".join(args[1:])
    assert err == f"wspool {command}: error: unrecognized arguments: {extra} (see wspool {command} --help)\n"


def test_bytes_and_json_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    """resolve --bytes --json is a usage error (exit 2), as README's synopsis says."""
    status, out, err = _in_process(capsys, "resolve", "flashinfer_mla", "--bytes", "--json")
    assert (status, out) == (2, "")
    assert "not allowed with argument" in err and "(see wspool resolve --help)" in err


def test_show_json_spells_no_config_file_as_null(capsys: pytest.CaptureFixture[str]) -> None:
    """Without a file, show --json and doctor --json both give null for it."""
    assert main(["show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config_file"] is None
    main(["doctor", "--json"])
    assert json.loads(capsys.readouterr().out)["configuration"]["file"] is None


@pytest.mark.parametrize("command", ["doctor", "stats", "resolve", "bench", "calibrate"])
def test_help_fits_the_terminal(command: str) -> None:
    """Each command's help wraps to the terminal's width (COLUMNS=80), its description included."""
    done = _run(command, "--help", env={"COLUMNS": "80"})
    assert done.returncode == 0
    assert max(len(line) for line in done.stdout.splitlines()) <= 80


def test_a_local_file_shadowing_a_shipped_name_is_said(tmp_path: Path) -> None:
    """--config hopper, with a file hopper in the working directory, reads the file and says so in one line."""
    (tmp_path / "hopper").write_text("pools:\n  flashinfer_mla:\n    rules:\n      lse: 1MiB\n")
    command = [sys.executable, "-m", "wspool", "resolve", "flashinfer_mla", "lse", "--bytes", "--config", "hopper"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WSPOOL_")}
    root = str(Path(wspool.__file__).parents[1])
    env = {**clean, "PYTHONPATH": os.pathsep.join([root, clean.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert (done.returncode, done.stdout) == (0, "1048576\n")
    assert done.stderr.splitlines() == [
        "wspool resolve: warning: --config hopper reads the file hopper in this directory, not the shipped "
        "configuration hopper (run from another directory, or rename the file, to take the shipped one)"
    ]
    done = subprocess.run([*command[:-1], "./hopper"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert (done.stdout, done.stderr) == ("1048576\n", "")


@pytest.mark.parametrize("option", ["--fact", "--limit"])
def test_plan_refuses_a_fact_name_no_rule_reads(capsys: pytest.CaptureFixture[str], option: str) -> None:
    """plan --fact batchsize=8 or --limit batchsize=1..64 exits 2 naming it and the close spelling, not ignored."""
    value = "8" if option == "--fact" else "1..64"
    status, out, err = _in_process(capsys, "plan", "--config", "kimi_dcp", option, f"batchsize={value}")
    assert (status, out, len(err.splitlines())) == (2, "", 1)
    assert f"{option} batchsize: no rule of any pool reads 'batchsize'" in err and "did you mean 'batch_size'?" in err
