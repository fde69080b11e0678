"""A prompt that would run past the cache, on a GPU: transformers' own static-cache Llama, exported
for a prompt of any length and compiled for CUDA. Its cache writes are Inductor's, whose device-side
assert stops the process for an index past the cache; the prompt's span bounds refuse it first."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import run_cli
from models import hugging_face_static_llama

import cuda_runner

pytestmark = pytest.mark.gpu


def test_hugging_faces_prefill_refuses_a_prompt_past_its_cache_and_runs_one_inside_it(tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    try:
        wrapped = hugging_face_static_llama("cuda")  # its static cache is made where the model is
    except ImportError as error:
        pytest.skip(f"this transformers exports no static-cache module: {error}")
    length = torch.export.Dim("length", min=1, max=32)
    example = {"input_ids": torch.tensor([[1, 2, 3, 4]], device="cuda"), "cache_position": torch.arange(4, device="cuda")}
    program = torch.export.export(copy.deepcopy(wrapped), (), example, dynamic_shapes={"input_ids": {1: length}, "cache_position": {0: length}},
                                  strict=False)
    torch.export.save(program, tmp_path / "prefill.pt2")
    path = tmp_path / "prefill.bundle"
    cuda_runner.compile_programs({"forward": tmp_path / "prefill.pt2"}, path, device="cuda")
    inputs = {spec.name: spec for spec in cuda_runner.read_manifest(path).methods["forward"].inputs}
    assert inputs["cache_position"].span_bounds == (0, 31) and inputs["input_ids"].bounds == (0, 999)
    np.save(tmp_path / "past.npy", np.array([30, 31, 32]))
    np.save(tmp_path / "inside.npy", np.array([0, 1, 2]))
    ids = "input_ids=1x3xi64=5"
    past = run_cli("run", str(path), "-i", ids, "-i", f"cache_position={tmp_path / 'past.npy'}")
    assert past.returncode == 2 and "counts 3 position(s) from 30, to 32" in past.stderr, past.stderr
    inside = run_cli("run", str(path), "-i", ids, "-i", f"cache_position={tmp_path / 'inside.npy'}", "--out-dir", str(tmp_path / "out"))
    assert inside.returncode == 0, inside.stderr
    with torch.no_grad():
        want = wrapped(input_ids=torch.full((1, 3), 5, device="cuda"), cache_position=torch.arange(3, device="cuda")).float().cpu().numpy()
    np.testing.assert_allclose(np.load(tmp_path / "out" / "output_0.npy"), want, rtol=1e-3, atol=2e-3)
