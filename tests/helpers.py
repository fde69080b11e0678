"""Helpers shared by the test packages (fixtures live in the conftest files)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class CompiledModel:
    path: Path
    module: Any
    args: tuple

    def eager(self, *arrays: np.ndarray) -> Any:
        """The eager PyTorch result for NumPy inputs."""
        import torch

        tensors = [to_tensor(torch, array) for array in arrays]
        with torch.no_grad():
            return self.module(*tensors)


def run_under_triton_interpreter(script: str) -> subprocess.CompletedProcess:
    """`script` run in a new interpreter with Triton's CPU interpreter on and this process's import path;
    the test skipped where this torch's wrap_triton refuses the interpreter's kernels."""
    import pytest
    import torch

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    older_torch = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
    if older_torch and result.returncode and "wrap_triton only works on functions annotated with triton.jit" in result.stderr:
        pytest.skip("this torch's wrap_triton refuses the interpreter's kernels (torch 2.11 for an operator that writes its inputs; 2.13 takes them)")
    return result


def to_tensor(torch: Any, array: np.ndarray) -> Any:
    import ml_dtypes

    array = np.ascontiguousarray(array)
    if array.dtype == ml_dtypes.bfloat16:  # torch.from_numpy does not know ml_dtypes
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def as_moved_to_a_gpu(program: Any) -> Any:
    """The program with every device its graph names written as torch's move_to_device_pass writes it
    for a GPU build (a string, 'cuda:0'), without moving a tensor: what compile hands its rewrites and
    proofs on a GPU, here on a machine without one."""
    for node in program.graph.nodes:
        if "device" in node.kwargs:
            node.kwargs = {**node.kwargs, "device": "cuda:0"}
    return program


def compile_fixture(folder: Path, builder: str, device: str = "cpu") -> CompiledModel:
    """Compile tests/models.py's `builder` into `folder`/<builder>.bundle."""
    import models

    import cuda_runner

    module, args, dynamic_shapes = models.BUILDERS[builder]()
    path = folder / f"{builder}.bundle"
    samples = SAMPLES.get(builder)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cuda_runner.compile_module(
            module, args, path, device=device, dynamic_shapes=dynamic_shapes, metadata={"fixture": builder},
            sample_inputs=samples() if samples else None, options=OPTIONS.get(builder), standalone=builder in STANDALONE,
        )
    # torch 2.13 warned on every compile about a check of its own (demo.sh showed it): compile keeps it quiet.
    leaked = [f"{warning.filename}:{warning.lineno}" for warning in caught if "LeafSpec" in str(warning.message)]
    assert not leaked, f"torch's own FutureWarning reached the caller ({leaked})"
    return CompiledModel(path, module, args)


# Inductor options some fixtures are compiled with (tests/compile/test_options.py);
# coordinate descent tuning only tunes Triton kernels, so a CPU build is unchanged.
OPTIONS = {"linear": {"coordinate_descent_tuning": True}}

# Fixtures compiled --standalone: they run on cuda-runner's shim with no torch installed.
STANDALONE = {"tiny_vit", "tiny_resnet"}

# Sample inputs stored in fixture bundles, for --self-test.
SAMPLES = {
    "dict_mlp": lambda: {"x": np.random.default_rng(7).standard_normal((5, 16), dtype=np.float32), "bias": np.ones(8, np.float32)},
}


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


def cli(*args: str, cwd: Path | None = None) -> CliResult:
    """The command line, in this process: what a user gets, without a new interpreter."""
    from cuda_runner.cli.main import run

    stdout, stderr = io.StringIO(), io.StringIO()
    previous = Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = run(list(args))
    finally:
        os.chdir(previous)
    return CliResult(code, stdout.getvalue(), stderr.getvalue())


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The console script in a fresh process: for what only a process shows
    (start-up imports, signals, native output, exit status)."""
    environment = dict(os.environ, NO_COLOR="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "cuda_runner", *args], cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout,
    )


def compile_with_option(program: Path, bundle: Path, option: str, setting: str | None) -> dict:
    """`compile PROGRAM --device cuda --quick --option OPTION=SETTING` (no --option
    where SETTING is None) through the console script; the compile options the
    manifest records for its one method, "forward"."""
    import cuda_runner

    chosen = [] if setting is None else ["--option", f"{option}={setting}"]
    result = run_cli("compile", str(program), "-o", str(bundle), "--device", "cuda", "--quick", *chosen)
    assert result.returncode == 0, result.stderr
    return dict(cuda_runner.read_manifest(bundle).methods["forward"].compile_options)


# ---------------------------------------------------------------------------
# PTX of a programmatic-dependent kernel, read as basic blocks

def ptx_statements(line: str) -> list[str]:
    """The statements of one line of PTX, without their predicates: an inline
    asm is one line of several, some in a { } scope of their own."""
    statements = []
    for piece in line.split("//")[0].split(";"):
        statement = re.sub(r"^[{}\s]*(@!?%?\w+\s+)?", "", piece).strip()
        if statement and statement != "}":
            statements.append(statement)
    return statements


def ptx_blocks(ptx: str) -> dict[str, tuple[list[str], list[str]]]:
    """The kernel's basic blocks in order: label -> (its memory operations
    and waits, the labels it may go to next)."""
    blocks: dict[str, tuple[list[str], list[str]]] = {}
    label, ops, order = "entry", [], []
    for raw in ptx.splitlines():
        line = raw.strip()
        if line.startswith("$L__BB") and line.split()[0].endswith(":"):
            blocks[label] = (ops, [])
            order.append(label)
            label, ops = line.split()[0][:-1], []
            continue
        for statement in ptx_statements(line):
            if statement.startswith(("ld.global", "st.global")):
                ops.append(statement.split()[0])
            elif statement.startswith("griddepcontrol.wait"):
                ops.append("griddepcontrol.wait")
            elif statement.startswith("bra"):
                ops.append(("goto " if statement.startswith("bra.uni") else "branch ") + statement.split()[-1])
    blocks[label] = (ops, [])
    order.append(label)
    for position, name in enumerate(order):
        ops, successors = blocks[name]
        ends = True
        for op in [op for op in ops if op.startswith(("goto ", "branch "))]:
            successors.append(op.split()[1])
            ends = ends and not op.startswith("goto ")
        if ends and position + 1 < len(order):
            successors.append(order[position + 1])
        blocks[name] = ([op for op in ops if not op.startswith(("goto ", "branch "))], successors)
    return blocks


def parameters_read_before_wait(ptx: str) -> tuple[set[int], int]:
    """(the kernel parameters, by position, whose pointers address a global
    load that the PTX's entry block makes before griddepcontrol.wait; how many
    such loads there are). Each load's address register is traced back through
    the instructions that define it to the ld.param that read a parameter."""
    sources: dict[str, set[str]] = {}
    found: set[int] = set()
    loads = 0
    for raw in ptx.splitlines():
        line = raw.strip()
        if line.startswith("$L__BB") or "griddepcontrol.wait" in line:
            break
        statement = line.lstrip("@%p0123456789! ")
        parameter = re.match(r"ld\.param\.\w+\s+(%\w+),\s*\[\w+_param_(\d+)\]", statement)
        if parameter:
            sources[parameter.group(1)] = {f"param {parameter.group(2)}"}
            continue
        if statement.startswith("ld.global"):
            loads += 1
            address = re.search(r"\[\s*(%\w+)", statement)
            found |= {int(name.split()[1]) for name in _traced(address.group(1), sources)} if address else set()
            continue
        registers = re.findall(r"%\w+", statement.split("//")[0])
        if len(registers) >= 1 and not statement.startswith(("st.", "//")):
            sources.setdefault(registers[0], set()).update(*(_traced(register, sources) for register in registers[1:]))
    return found, loads


def _traced(register: str, sources: dict[str, set[str]]) -> set[str]:
    """The parameters a register's value is computed from."""
    return {name for name in sources.get(register, set()) if name.startswith("param ")}


def waited_on_entry(blocks: dict[str, tuple[list[str], list[str]]]) -> dict[str, bool]:
    """Whether every path from the kernel's entry to each block has passed a wait."""
    waited = dict.fromkeys(blocks, True)
    waited["entry"] = False
    changed = True
    while changed:
        changed = False
        for label, (ops, successors) in blocks.items():
            leaves = waited[label] or "griddepcontrol.wait" in ops
            for successor in successors:
                if waited[successor] and not leaves:
                    waited[successor], changed = False, True
    return waited
