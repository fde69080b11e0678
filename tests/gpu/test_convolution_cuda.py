"""1-D convolutions in standalone CUDA builds (compile/convolution.py): a
Whisper-shaped encoder, whose stem is two Conv1d layers, compiles standalone
(runtime="standalone" refuses a libtorch fallback) and matches eager."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from models import scale_models

import cuda_runner

pytestmark = pytest.mark.gpu


def test_whispers_convolution_stem_compiles_standalone_and_matches_eager(tmp_path):
    config = scale_models.WHISPER_TINY
    torch.manual_seed(1)
    module = scale_models.Whisper(config).eval()
    examples = scale_models.whisper_examples(config)
    path = tmp_path / "whisper.bundle"
    cuda_runner.compile_methods(copy.deepcopy(module), {"encode": examples["encode"]}, path, device="cuda", runtime="standalone")
    assert cuda_runner.read_manifest(path).methods["encode"].compile_options["standalone"] is True
    mel = examples["encode"][0]
    with cuda_runner.load(path, "cuda") as model:
        got = model.run([mel.numpy()], "encode")["output_0"]
    with torch.no_grad():
        want = copy.deepcopy(module).cuda().encode(mel.cuda()).cpu().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-3)  # float32 convolutions in Triton templates, sums reordered
