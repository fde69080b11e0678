"""compile/written_constants.py: a KV cache kept the way transformers 5 keeps its
static cache (tensors of a plain object, which torch.export lifts as constants,
and the same tensors registered as buffers of a wrapper that never reads them)
is compiled as the method's state: the bundle builds, its steps match eager's,
the state is listed and reset_state empties it. Without the rewrite
AOTInductor refuses the program."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import cuda_runner
from cuda_runner.compile.written_constants import written_constants_as_buffers


class _Cache:
    """Not a module: torch.export lifts its tensors as constants of the program."""

    def __init__(self, length: int):
        self.keys = torch.zeros(1, 2, length, 4)
        self.counter = torch.zeros((), dtype=torch.int64)


class _Step(torch.nn.Module):
    """A step that counts its position and writes its cache in place, as transformers' static layers do;
    `registered`: the wrapper also registers the cache's tensors as buffers (TorchExportableModuleWithStaticCache)."""

    def __init__(self, registered: bool, length: int = 8):
        super().__init__()
        self.project = torch.nn.Linear(4, 4)
        self.cache = _Cache(length)
        if registered:
            self.register_buffer("key_cache", self.cache.keys, persistent=False)
            self.register_buffer("counter", self.cache.counter, persistent=False)

    def forward(self, x, cache_position):
        self.cache.counter.copy_(cache_position[0])
        index = torch.arange(1) + self.cache.counter
        self.cache.counter.add_(1)
        self.cache.keys.index_copy_(2, index, self.project(x).view(1, 1, 1, 4).expand(1, 2, 1, 4))
        return self.cache.keys.sum(dim=2)


def _export(module):
    return torch.export.export(module, (torch.ones(1, 4), torch.tensor([2])), strict=False)


@pytest.mark.parametrize("registered", [True, False])
def test_constants_the_graph_writes_are_read_as_buffers(registered):
    from torch.export.graph_signature import InputKind

    program = _export(_Step(registered))
    kinds = [spec.kind for spec in program.graph_signature.input_specs]
    rewritten, names = written_constants_as_buffers(program)
    assert len(names) == 2 and program.graph_signature.input_specs[0].kind == kinds[0]  # the given program is left as it was
    assert InputKind.CONSTANT_TENSOR not in [spec.kind for spec in rewritten.graph_signature.input_specs]
    assert len(rewritten.graph_signature.buffers) == 2  # the wrapper's twins, or the constants themselves
    first, second = rewritten.module(), _Step(registered)
    second.load_state_dict(first.state_dict(), strict=False)
    for step in range(3):  # the rewritten graph computes what the module does, and keeps its state
        given = (torch.full((1, 4), float(step)), torch.tensor([step]))
        assert torch.equal(first(*given), second(*given))


def test_a_program_that_writes_no_constant_is_returned_as_it_is():
    class Reads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = _Cache(4)

        def forward(self, x):
            return x + self.table.keys.sum()

    program = torch.export.export(Reads(), (torch.ones(1),), strict=False)
    assert written_constants_as_buffers(program) == (program, [])


def test_a_cache_held_outside_the_modules_buffers_compiles_as_state(tmp_path):
    module = _Step(registered=True).eval()
    eager = copy.deepcopy(module)
    path = tmp_path / "step.bundle"
    cuda_runner.compile_methods(module, {"forward": (torch.ones(1, 4), torch.tensor([2]))}, path)
    spec = cuda_runner.read_manifest(path).methods["forward"]
    assert sorted(spec.compile_options["mutated_buffers"]) == ["counter", "key_cache"]
    assert spec.input("cache_position").bounds == (0, 7)
    with cuda_runner.load(path) as model:
        for step in range(8):
            x = np.full((1, 4), step / 8, np.float32)
            got = model.run({"x": x, "cache_position": np.array([step])})["output_0"]
            with torch.no_grad():
                want = eager(torch.from_numpy(x), torch.tensor([step])).numpy()
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        model.reset_state()
        after = model.run({"x": np.zeros((1, 4), np.float32), "cache_position": np.array([0])})["output_0"]
    with torch.no_grad():
        fresh = _Step(registered=True)
        fresh.project.load_state_dict(eager.project.state_dict())
        np.testing.assert_allclose(after, fresh(torch.zeros(1, 4), torch.tensor([0])).numpy(), rtol=1e-5, atol=1e-6)
