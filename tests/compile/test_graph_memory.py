"""Which values of an exported graph share memory and which an op writes
(compile/graph_memory.py), in memory and after torch.export.save and load,
which keeps no storage shared between a view and its base."""

from __future__ import annotations

import pytest
import torch

from cuda_runner.compile.graph_memory import GraphMemory


class _WritesThroughViews(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("sliced", torch.zeros(8))
        self.register_buffer("unbound", torch.zeros(2, 4))
        self.register_buffer("kept", torch.ones(8))
        self.register_buffer("base", torch.zeros(4))
        self.register_buffer("tail", self.base[2:])  # a view of another buffer: written with it
        self.register_buffer("typed", torch.zeros(4))

    def forward(self, x):
        self.sliced[:3] = x[:3]
        self.unbound.unbind(0)[1].add_(1.0)
        mask = (torch.arange(8) < 5).float()
        mask.view(2, 4).mul_(2.0)  # an intermediate written through a view of it
        self.base.add_(1.0)
        self.typed.type_as(x).add_(1.0)  # type_as returns self where the dtype matches; its schema does not say so
        return self.sliced + self.unbound.sum() + self.kept + mask + self.tail.sum() + self.typed.sum()


def _graph(saved: bool, tmp_path):
    program = torch.export.export(_WritesThroughViews(), (torch.randn(8),))
    if saved:
        torch.export.save(program, str(tmp_path / "p.pt2"))
        program = torch.export.load(str(tmp_path / "p.pt2"))
    return program.module().graph


@pytest.mark.parametrize("saved", [False, True], ids=["in memory", "saved and loaded"])
def test_writes_through_views_are_found_with_or_without_shared_storages(saved, tmp_path):
    graph = _graph(saved, tmp_path)
    memory = GraphMemory(graph)
    buffers = {node.target: memory.written(node) for node in graph.nodes if node.op == "get_attr"}
    assert buffers == {"sliced": True, "unbound": True, "kept": False, "base": True, "tail": True, "typed": True}
    by_name = {node.name: node for node in graph.nodes}
    assert memory.written(by_name["to"]) and memory.written(by_name["view"])  # the mask, written through its view
    assert not memory.written(by_name["arange"]) and not memory.written(by_name["x"])
