"""Every option that takes a path, given what is not a usable file: a FIFO, a
directory, /dev/zero, a dangling symbolic link and an unreadable file.

The table is checked against the CLI's own option list (every parameter
whose metavar names a file, folder or bundle), so a new path option cannot
skip it. Each case must end within seconds (a FIFO opened for reading would
block forever), with exit 2 or 3 and one `error:` line that names the path,
and no traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import typer.main
from helpers import ROOT, cli

from cuda_runner.cli.main import app

KINDS = ("fifo", "directory", "devzero", "dangling", "unreadable")
STANDIN = ROOT / "tests" / "data" / "executorch" / "standin_g3"

# (command, option) -> (argv with {x} for the path under test, the path's suffix,
# kinds that are a valid value there and so not refused). {bundle}, {tmp}: as in test_contract.
PATH_OPTIONS: dict[tuple[str, str], tuple[list[str], str, tuple[str, ...]]] = {
    ("compile", "program"): (["compile", "{x}", "-o", "{tmp}/c.bundle"], ".pt2", ()),
    ("compile", "--output"): (["compile", "{tmp}/missing.pt2", "-o", "{x}"], ".bundle", ("dangling", "unreadable")),
    ("compile", "--method"): (["compile", "--method", "m={x}", "-o", "{tmp}/c.bundle"], ".pt2", ()),
    ("compile", "--sample-inputs"): (["compile", "{tmp}/missing.pt2", "--sample-inputs", "{x}"], ".npz", ()),
    ("compile", "--sign-key"): (["compile", "{tmp}/missing.pt2", "--sign-key", "{x}"], ".pem", ()),
    ("sign", "bundle"): (["sign", "{x}", "--key", "{tmp}/private.pem"], ".bundle", ()),
    ("sign", "--key"): (["sign", "{bundle}", "--key", "{x}"], ".pem", ()),
    ("convert", "program"): (["convert", "{x}", "-o", "{tmp}/c.bundle"], ".pte", ()),
    ("convert", "--data"): (["convert", "{standin}/model.pte", "--data", "{x}", "-o", "{tmp}/c.bundle"], ".ptd", ()),
    ("convert", "--output"): (["convert", "{standin}/model.pte", "-o", "{x}"], ".bundle", ("dangling", "unreadable")),
    ("convert", "--sign-key"): (["convert", "{standin}/model.pte", "-o", "{tmp}/c.bundle", "--sign-key", "{x}"], ".pem", ()),
    ("inspect", "bundle"): (["inspect", "{x}"], ".bundle", ()),
    ("inspect", "--data"): (["inspect", "{standin}/model.pte", "--data", "{x}"], ".ptd", ()),
    ("inspect", "--trusted-key"): (["inspect", "{bundle}", "--trusted-key", "{x}"], ".pem", ()),
    ("run", "bundle"): (["run", "{x}", "--random-inputs"], ".bundle", ()),
    ("run", "--data"): (["run", "{standin}/model.pte", "--data", "{x}", "--random-inputs"], ".ptd", ()),
    ("run", "--inputs"): (["run", "{bundle}", "-i", "x={x}", "-i", "bias={tmp}/bias.npy"], ".npy", ()),
    ("run", "--out-dir"): (["run", "{bundle}", "-i", "{tmp}/samples.npz", "--out-dir", "{x}"], "", ("directory",)),
    ("run", "--out"): (["run", "{bundle}", "-i", "{tmp}/samples.npz", "--out", "{x}"], ".npz", ("dangling", "unreadable")),
    ("run", "--save-inputs"): (["run", "{bundle}", "--random-inputs", "--save-inputs", "{x}"], "", ("directory",)),
    ("run", "--expected"): (["run", "{bundle}", "-i", "{tmp}/samples.npz", "--expected", "{x}"], ".npz", ()),
    ("run", "--trusted-key"): (["run", "{bundle}", "--random-inputs", "--trusted-key", "{x}"], ".pem", ()),
    ("run", "--batch"): (["run", "{bundle}", "--batch", "{x}", "--out-dir", "{tmp}/batch-out"], "", ("directory",)),
    ("run", "--expected-dir"): (["run", "{bundle}", "--batch", "{tmp}/sets", "--out-dir", "{tmp}/batch-out", "--expected-dir", "{x}"], "", ("directory",)),
    ("bench", "bundle"): (["bench", "{x}", "--iterations", "1"], ".bundle", ()),
    ("bench", "--data"): (["bench", "{standin}/model.pte", "--data", "{x}", "--iterations", "1"], ".ptd", ()),
    ("bench", "--inputs"): (["bench", "{bundle}", "-i", "x={x}", "-i", "bias={tmp}/bias.npy", "--iterations", "1"], ".npy", ()),
    ("bench", "--trusted-key"): (["bench", "{bundle}", "--iterations", "1", "--trusted-key", "{x}"], ".pem", ()),
}
# Not an option, but read on every signed load: the signature beside the bundle.
SIGNATURE_CASE = (["run", "{x}", "--random-inputs", "--trusted-key", "{tmp}/public.pem"], ".bundle", ())

_PATH_METAVAR = re.compile(r"BUNDLE|FILE|PROGRAM|\.pem|DIR|PATH|REF|^INPUT$")


def path_parameters() -> set[tuple[str, str]]:
    """(command, option) for every parameter of the CLI that takes a path."""
    found = set()
    for name, command in typer.main.get_command(app).commands.items():
        for parameter in command.params:
            if parameter.metavar and _PATH_METAVAR.search(parameter.metavar):
                found.add((name, max(parameter.opts, key=len)))
    return found


def test_every_path_option_is_in_the_table():
    assert path_parameters() == set(PATH_OPTIONS)


def _valid_file(suffix: str, folder: Path, bundle: Path, public: Path) -> bytes:
    """Bytes that would be a usable file of that kind, so only the file's type or permissions are wrong."""
    sources = {".bundle": bundle, ".pem": public, ".npz": folder / "samples.npz", ".npy": folder / "x.npy",
               ".pte": STANDIN / "model.pte", ".ptd": STANDIN / "aoti_cuda_blob.ptd"}
    return sources[suffix].read_bytes() if suffix in sources else b"not a program"


@pytest.fixture(scope="module")
def bundle(compiled):
    return compiled("dict_mlp", "cpu").path


@pytest.fixture(scope="module")
def special(bundle, tmp_path_factory):
    """{tmp}: the folder, and a function (kind, suffix) -> path of that kind."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder = tmp_path_factory.mktemp("special")
    np.save(folder / "x.npy", np.ones((2, 16), np.float32))
    np.save(folder / "bias.npy", np.zeros(8, np.float32))
    np.savez(folder / "samples.npz", x=np.ones((2, 16), np.float32), bias=np.zeros(8, np.float32))
    (folder / "sets").mkdir()
    np.savez(folder / "sets" / "a.npz", x=np.ones((2, 16), np.float32), bias=np.zeros(8, np.float32))
    key = ec.generate_private_key(ec.SECP256R1())
    (folder / "private.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    public = folder / "public.pem"
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))

    def make(kind: str, suffix: str, *, signature: bool = False) -> Path:
        name = f"{kind}-sig{suffix}" if signature else f"{kind}{suffix or '-folder'}"
        path = folder / name
        if signature:  # a good bundle whose signature file is the special one
            shutil.copy(bundle, path)
            path, suffix = Path(f"{path}.sig"), ".sig"
        if os.path.lexists(path):
            return folder / name
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "directory":
            path.mkdir()
        elif kind == "devzero":
            path.symlink_to("/dev/zero")
        elif kind == "dangling":
            path.symlink_to(folder / "nothing-here")
        elif suffix == "":
            path.mkdir(mode=0)
        else:
            path.write_bytes(_valid_file(suffix, folder, bundle, public))
            path.chmod(0)
        return folder / name

    return folder, make


def _cases():
    for key, (argv, suffix, valid) in [*PATH_OPTIONS.items(), (("run", ".sig"), SIGNATURE_CASE)]:
        for kind in KINDS:
            if kind not in valid:
                yield pytest.param(key, argv, suffix, kind, id=f"{' '.join(key)}-{kind}")


def _argv(template, special, bundle, key, suffix, kind):
    folder, make = special
    path = make(kind, suffix, signature=key == ("run", ".sig"))
    values = {"x": path, "bundle": bundle, "tmp": folder, "standin": STANDIN}
    return [arg.format(**values) for arg in template], path


def _check(code: int, stdout: str, stderr: str, path: Path, argv: list[str]) -> None:
    lines = stderr.strip().splitlines()
    assert code in (2, 3), (argv, code, stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, stderr)
    assert path.name.removesuffix(".sig") in lines[0], (argv, lines[0])
    assert "Traceback" not in stdout + stderr and "internal error" not in stderr


@pytest.mark.parametrize(("key", "template", "suffix", "kind"), [case for case in _cases() if case.values[3] != "unreadable"])
def test_a_path_that_is_no_usable_file_is_refused_at_once(special, bundle, key, template, suffix, kind):
    argv, path = _argv(template, special, bundle, key, suffix, kind)
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail(f"{argv} blocked"))
    signal.alarm(60)  # a FIFO opened for reading blocks forever; compile's first import of torch takes a few seconds
    try:
        result = cli(*argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    _check(result.returncode, result.stdout, result.stderr, path, argv)


@pytest.mark.heavy
def test_unreadable_paths_are_refused(special, bundle):
    """Mode 000 files and folders. root reads them anyway, so as root the cases
    run in one process without the capabilities that let root ignore permissions."""
    cases = [case.values for case in _cases() if case.values[3] == "unreadable"]
    argvs = [_argv(template, special, bundle, key, suffix, kind) for key, template, suffix, kind in cases]
    script = (
        "import contextlib, io, json, sys\n"
        "from cuda_runner.cli.main import run\n"
        "results = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    out, err = io.StringIO(), io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
        "        code = run(argv)\n"
        "    results.append((code, out.getvalue(), err.getvalue()))\n"
        "print(json.dumps(results))\n"
    )
    command = [sys.executable, "-c", script, json.dumps([argv for argv, _ in argvs])]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: cannot drop the capability to read any file")
        drop = "-dac_override,-dac_read_search"
        command = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", *command]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT, env=dict(os.environ, NO_COLOR="1"))
    assert completed.returncode == 0, completed.stderr[-2000:]
    for (argv, path), (code, stdout, stderr) in zip(argvs, json.loads(completed.stdout.splitlines()[-1])):
        _check(code, stdout, stderr, path, argv)


def test_option_names_do_not_depend_on_the_typer_version():
    """typer 0.27 named an option without explicit names after its metavar when
    the two matched ("--DEVICE"); every option spells its names out."""
    for name, command in typer.main.get_command(app).commands.items():
        for parameter in command.params:
            for option in parameter.opts:
                assert option == option.lower(), (name, option)
            if parameter.opts and parameter.opts[0].startswith("-"):
                assert f"--{parameter.name.replace('_', '-')}" in parameter.opts or parameter.name in ("json_output", "value_range", "print_stats"), (name, parameter.opts)
