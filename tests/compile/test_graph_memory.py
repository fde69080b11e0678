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


class _Counter(torch.nn.Module):
    """Hugging Face's static cache layer: the step's position copied into a counter buffer,
    read (an arange added to it), then the counter advanced; `when` moves the advance or reads
    the counter before the copy."""

    def __init__(self, when="after"):
        super().__init__()
        self.when = when
        self.register_buffer("counter", torch.zeros((), dtype=torch.int64))
        self.register_buffer("table", torch.arange(16) * 10)

    def forward(self, position):
        before = self.counter + 0  # what the counter held: the step before's
        self.counter.copy_(position[0])
        if self.when == "between":
            self.counter.add_(1)
        index = torch.arange(1) + self.counter
        looked_up = self.table[index]
        if self.when == "after":
            self.counter.add_(1)
        if self.when == "table written":
            self.table.add_(1)
        return (index + before) if self.when == "read before" else index, looked_up


def _outputs(when):
    graph = torch.export.export(_Counter(when), (torch.tensor([3]),)).module().graph
    output = next(node for node in graph.nodes if node.op == "output").args[0]
    return output[0], output[1]


def test_a_position_copied_into_a_counter_and_advanced_after_it_is_read_is_computed_from_the_input_alone():
    from cuda_runner.compile.graph_memory import computed_alone

    index, looked_up = _outputs("after")
    for node in (index, looked_up):
        computed_from = computed_alone(node)
        assert computed_from is not None and [other.name for other in computed_from if other.op == "placeholder"] == ["position"]


@pytest.mark.parametrize("when", ["between", "read before", "table written"])
def test_what_a_write_changes_is_not_computed_alone(when):
    """Advanced before the read, read before the copy (the step before's count), or a table the step writes."""
    from cuda_runner.compile.graph_memory import computed_alone

    index, looked_up = _outputs(when)
    assert computed_alone(looked_up if when == "table written" else index) is None


class _NamedTwice(torch.nn.Module):
    """A counter that is part of a larger buffer (`state`), or has a second name (`alias`): the
    copy does not write all that a read of its memory can see, or writes it under another name."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.register_buffer("state", torch.zeros(2, dtype=torch.int64))
        self.register_buffer("counter", self.state[0:1] if how == "slice" else torch.zeros(1, dtype=torch.int64))
        self.register_buffer("alias", self.counter.view(1))

    def forward(self, position):
        self.counter.copy_(position)
        index = torch.arange(1) + self.counter + (self.state[1] if self.how == "slice" else self.alias)
        self.counter.add_(1)
        self.state[1:].add_(1)
        return index


@pytest.mark.parametrize("how", ["slice", "alias"])
def test_a_counter_with_more_memory_or_another_name_is_not_taken_for_overwritten(how):
    from cuda_runner.compile.graph_memory import computed_alone

    graph = torch.export.export(_NamedTwice(how), (torch.tensor([3]),)).module().graph
    index = next(node for node in graph.nodes if node.op == "output").args[0][0]
    assert computed_alone(index) is None


def test_a_proof_on_the_cpu_writes_copies_of_the_module_tensors_not_them():
    from cuda_runner.compile.evaluation import on_cpu
    from cuda_runner.compile.graph_values import ancestors_of

    module = torch.export.export(_Counter("after"), (torch.tensor([3]),)).module()
    index = next(node for node in module.graph.nodes if node.op == "output").args[0][0]
    position = next(node for node in module.graph.nodes if node.op == "placeholder")
    assert int(on_cpu(index, [position], ancestors_of(index))(torch.tensor([7]))[0]) == 7
    assert int(module.counter) == 0  # the copy_ of the proof went to its own copy
