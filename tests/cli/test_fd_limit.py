"""A process out of file descriptors is told so, not that a good file is damaged."""

from __future__ import annotations

import subprocess
import sys

import numpy as np


def test_too_few_file_descriptors_is_a_runtime_error_naming_the_limit(dict_mlp_bundle, tmp_path):
    np.savez(tmp_path / "in.npz", x=np.ones((4, 16), np.float32), bias=np.zeros(8, np.float32))
    command = f"ulimit -n 8; exec {sys.executable} -m cuda_runner run {dict_mlp_bundle.path} --inputs {tmp_path / 'in.npz'} -q"
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert result.returncode == 4, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: cannot read {tmp_path / 'in.npz'}: too many open files in this process (raise the limit: ulimit -n)"]
