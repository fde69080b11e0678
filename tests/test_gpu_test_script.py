"""scripts/gpu-test.sh's GPU_REQUIRE, run for real with a stand-in nvidia-smi: on another card, or
none, nothing is built or run and the status is 3; on the card asked for, the script goes on."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT

# Everything the script can run is switched off, so that only its start is exercised.
_NOTHING = {"GPU_BUILD": "0", "GPU_TESTS": "0", "GPU_NO_TORCH_ENV": "0", "GPU_COLDSTART": "0", "GPU_CHECKS": "0", "GPU_BENCH": "0",
            "GPU_ET_EXPORT": "0"}


def _gpu_test(tmp_path: Path, card: str | None, require: str) -> tuple[subprocess.CompletedProcess, Path]:
    stand_in = tmp_path / "bin"
    stand_in.mkdir()
    smi = stand_in / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{card}'\n" if card is not None else "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    smi.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, **_NOTHING, "PATH": f"{stand_in}{os.pathsep}{os.environ['PATH']}", "OUT": str(out), "GPU_REQUIRE": require}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-test.sh")], capture_output=True, text=True, env=env, timeout=300)
    return done, out


@pytest.mark.parametrize("card, named", [("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"), (None, "not found")], ids=["other card", "none"])
def test_another_card_runs_nothing_and_says_which_it_is(tmp_path, card, named):
    done, out = _gpu_test(tmp_path, card, "H200")
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == [f"GPU_REQUIRE=H200: this machine's GPU is {named}; nothing was run"]
    assert not out.exists()  # not even the log folder


def test_the_card_asked_for_goes_on(tmp_path):
    done, out = _gpu_test(tmp_path, "NVIDIA H200", "H200")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "versions.txt").exists()
