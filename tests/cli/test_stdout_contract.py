"""Every command's stdout contract, as a table built from the CLI's own list
of commands (a new command cannot skip it).

Each command runs in a representative successful invocation, in a process
started by bash, with its standard streams as the shell leaves them:

- pipe: stdout piped into `head -1`, which closes the pipe once it has its
  line: exit 0, or 141 where a write met the closed pipe; never 1, and
  nothing on stderr but the command's own lines (no traceback, no error);
- closed-stdout: `>&-`: exit 4 and one line, `error: cannot write to
  standard output: Bad file descriptor` (what it printed went nowhere);
- closed-stderr: `2>&-`: exit 0, and the usual output on stdout;
- full: `>/dev/full`: exit 4 and one line, `error: cannot write to standard
  output: No space left on device`.

compile's child process writes the session's fixture bundle instead of
importing torch and compiling (tests/cli/precompiled/sitecustomize.py); the
command itself, its child process and what it prints are real.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from helpers import ROOT

from cuda_runner.cli.main import app

pytestmark = pytest.mark.xdist_group("stdout_contract")  # one worker builds the fixtures once

STANDIN = ROOT / "tests" / "data" / "executorch" / "standin_g3"
PRECOMPILED = Path(__file__).resolve().parent / "precompiled"

# A successful invocation of each command; {out} is the test's own folder.
COMMANDS: dict[str, list[str]] = {
    "compile": ["compile", "{program}", "-o", "{out}/compiled.bundle", "--device", "cpu"],
    "sign": ["sign", "{out}/signed.bundle", "--key", "{key}"],
    "convert": ["convert", "{standin}/model.pte", "-o", "{out}/converted.bundle"],
    "inspect": ["inspect", "{bundle}"],
    "run": ["run", "{bundle}", "--random-inputs", "--out-dir", "{out}/outputs", "--print"],
    "bench": ["bench", "{bundle}", "--iterations", "3", "--warmup", "0"],
    "devices": ["devices"],
}
# Not commands, but printed through the same streams (by click).
EXTRA: dict[str, list[str]] = {"--help": ["--help"]}

MODES = {
    "pipe": "{command} | head -1 >/dev/null; exit ${{PIPESTATUS[0]}}",
    "closed-stdout": "{command} >&-",
    "closed-stderr": "{command} 2>&-",
    "full": "{command} >/dev/full",
}


def test_every_command_is_in_the_table():
    assert set(typer.main.get_command(app).commands) == set(COMMANDS)


@pytest.fixture(scope="module")
def inputs(compiled, tmp_path_factory):
    """{bundle}, {program} (the ExportedProgram the bundle was compiled from), {key}, {standin}."""
    import models
    import torch
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder = tmp_path_factory.mktemp("stdout-contract")
    module, args, dynamic_shapes = models.BUILDERS["dict_mlp"]()
    torch.export.save(torch.export.export(module, args, dynamic_shapes=dynamic_shapes), folder / "program.pt2")
    key = ec.generate_private_key(ec.SECP256R1())
    (folder / "private.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return {"bundle": compiled("dict_mlp", "cpu").path, "program": folder / "program.pt2", "key": folder / "private.pem", "standin": STANDIN}


def _environment(name: str, bundle: Path) -> dict[str, str]:
    env = dict(os.environ, NO_COLOR="1")
    if name == "compile":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PRECOMPILED), env.get("PYTHONPATH")]))
        env["CUDA_RUNNER_TEST_PRECOMPILED"] = str(bundle)
    return env


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", [*COMMANDS, *EXTRA])
def test_stdout_contract(inputs, tmp_path, name, mode):
    if name == "sign":
        shutil.copy(inputs["bundle"], tmp_path / "signed.bundle")
    argv = [arg.format(out=tmp_path, **inputs) for arg in {**COMMANDS, **EXTRA}[name]]
    command = shlex.join([sys.executable, "-m", "cuda_runner", *argv])
    result = subprocess.run(["bash", "-c", MODES[mode].format(command=command)], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path, env=_environment(name, inputs["bundle"]))
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    if mode == "pipe":
        assert result.returncode in (0, 141), result.stderr
        assert not [line for line in lines if line.startswith("error")], result.stderr
    elif mode == "closed-stdout":
        assert (result.returncode, lines) == (4, ["error: cannot write to standard output: Bad file descriptor"]), result.stderr
    elif mode == "closed-stderr":
        assert result.returncode == 0 and result.stdout.strip(), result.stdout
    else:
        assert (result.returncode, lines) == (4, ["error: cannot write to standard output: No space left on device"]), result.stderr
