"""The command-line checks of scripts/min_versions.sh, in one interpreter.

Each check is `cuda_runner.cli.main.run(argv)`, the function the console
script calls, with the command's output captured: the options are parsed by
the installed typer and click, errors are rendered by the installed rich, and
the exit code is the one a user gets. One process for every check instead of
one each: each cold interpreter costs about 0.7 s of a core, which the 2-core
CI machine takes from the test suite running beside it. Before each check
cuda-runner's own modules are dropped from `sys.modules`, so that each
command imports what it needs itself. The shell script still runs
`python -m cuda_runner --help` and a compile without torch in processes of
their own.

    python scripts/min_versions_check.py WORK_FOLDER PROGRAM.pte
"""

from __future__ import annotations

import contextlib
import io
import shlex
import sys
from pathlib import Path

COMMANDS = ("compile", "sign", "convert", "inspect", "run", "bench", "devices")


def checks(work: Path, program: Path) -> list[tuple[int, list[str]]]:
    """(expected exit code, argv) in the order they run: later ones read what earlier ones wrote."""
    empty = work / "empty.pt2"  # an empty zip archive, written by the shell script
    converted = str(work / "converted.bundle")
    return [
        (0, ["--help"]),
        *[(0, [command, "--help"]) for command in COMMANDS],
        (2, ["run", str(work / "missing.bundle"), "--device", "cpu", "--random-inputs"]),
        (2, ["bench", str(work / "missing.bundle"), "--device", "cpu"]),
        (2, ["compile", str(work / "missing.pt2"), "--device", "cuda", "-o", str(work / "m.bundle")]),  # before torch is needed
        (4, ["compile", str(empty), "--device", "cuda", "-o", str(work / "m.bundle")]),  # needs torch: one line, exit 4
        (0, ["inspect", str(program)]),
        (0, ["inspect", str(program), "--json"]),
        (0, ["convert", str(program), "-o", converted, "--no-call-helper"]),
        (0, ["inspect", converted]),
        (0, ["devices", "--json"]),
    ]


def run_one(argv: list[str]) -> tuple[int, str, str]:
    """One check, with cuda-runner's own modules imported afresh: a command
    must not pass only because an earlier one imported what it forgot to
    (typer, click, rich and NumPy stay loaded: that is what saves the time)."""
    for name in [name for name in sys.modules if name == "cuda_runner" or name.startswith("cuda_runner.")]:
        del sys.modules[name]
    from cuda_runner.cli.main import run

    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = run(argv)
    except BaseException as error:  # run() returns every exit code: anything raised is a failure, SystemExit too
        return -1, stdout.getvalue(), f"{stderr.getvalue()}raised {type(error).__name__}: {error}\n"
    return code, stdout.getvalue(), stderr.getvalue()


def main(work: Path, program: Path) -> int:
    failed = 0
    for expected, argv in checks(work, program):
        code, stdout, stderr = run_one(argv)
        problem = code != expected or "Traceback" in stderr
        if argv == ["run", "--help"] and "--device" not in stdout:
            problem = True
        if problem:
            failed += 1
            print(f"FAILED ({code}, wanted {expected}): cuda-runner {shlex.join(argv)}\n{stderr}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
