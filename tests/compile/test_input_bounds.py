"""compile/input_bounds.py: an input that indexes a cache write is bounded by
the cache's positions, directly or through a counter the way Hugging Face's
static cache writes; an index that wraps, or that another method offsets,
bounds nothing. Token ids are bounded by the embedding's rows, positions
written with index_put_ or read from a table by eager's negative range."""

from __future__ import annotations

import pytest
import torch
from helpers import as_moved_to_a_gpu
from models import MethodOf, scale_models

from cuda_runner.compile.input_bounds import input_bounds


class _Cache(torch.nn.Module):
    """One cache of `length` positions written at an index `how` computes from the position."""

    def __init__(self, how: str, length: int = 16, second: int | None = None):
        super().__init__()
        self.how = how
        self.register_buffer("cache", torch.zeros(1, 2, length, 4))
        self.register_buffer("counter", torch.zeros((), dtype=torch.int64))
        self.register_buffer("offset", torch.zeros(1, dtype=torch.int64))
        if second is not None:
            self.register_buffer("other", torch.zeros(1, 2, second, 4))

    def forward(self, x, position):
        if self.how == "direct":
            index = position
        elif self.how == "counter":  # Hugging Face: the position copied into a counter, which then advances
            self.counter.copy_(position[0])
            index = torch.arange(1) + self.counter
            self.counter.add_(1)
        elif self.how == "ring":
            index = position % self.cache.shape[2]
        elif self.how == "offset":
            index = position + self.offset
        elif self.how == "int32":  # wraps past 2**31: eager accepts 2**32 + 3, and writes at 3
            index = position.to(torch.int32).to(torch.int64)
        elif self.how == "limited":  # the position within the cache only below 1000
            index = torch.where(position < 1000, position, position - 1000)
        else:
            index = torch.zeros(1, dtype=torch.int64)
        self.cache.index_copy_(2, index, x)
        if hasattr(self, "other"):
            self.other.index_copy_(2, index, x)
        return self.cache.sum(dim=2)


def _bounds(module, written_elsewhere=frozenset()):
    program = torch.export.export(module, (torch.ones(1, 2, 1, 4), torch.tensor([3])))
    return input_bounds(program, written_elsewhere)


@pytest.mark.parametrize("how", ["direct", "counter"])
def test_an_input_that_indexes_a_cache_write_is_bounded_by_its_positions(how):
    assert _bounds(_Cache(how)) == {"position": (0, 15)}


def test_two_caches_bound_an_input_by_the_shorter():
    assert _bounds(_Cache("direct", length=16, second=8)) == {"position": (0, 7)}


@pytest.mark.parametrize("how", ["ring", "constant", "int32", "limited"])
def test_an_index_that_wraps_or_is_no_input_bounds_nothing(how):
    assert _bounds(_Cache(how)) == {}


def test_a_counter_another_method_writes_still_bounds_the_position_it_is_overwritten_with():
    """A prefill that leaves its own value in the counter changes nothing: the step copies its position over it first."""
    assert _bounds(_Cache("counter"), frozenset({"counter"})) == {"position": (0, 15)}


def test_an_index_offset_by_what_another_method_writes_bounds_nothing():
    assert _bounds(_Cache("offset")) == {"position": (0, 15)}  # the offset as compiled (zero) is proven
    assert _bounds(_Cache("offset"), frozenset({"offset"})) == {}  # but another method may set it


def test_the_decoders_prefill_and_decode_are_bounded_by_their_cache():
    config = scale_models.LLAMA_TINY
    module = scale_models.LlamaDecoder(config).eval()
    examples = scale_models.llama_examples(config, 6)
    for name in ("prefill", "decode"):
        program = torch.export.export(MethodOf(module, name), examples[name], dynamic_shapes=scale_models.llama_dynamic_shapes(config)[name])
        assert input_bounds(program) == {"input_pos": (0, config.max_seq - 1), "tokens": (0, config.vocab - 1)}, name


def test_a_write_into_a_tensor_of_no_elements_bounds_nothing():
    class Empty(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(0, 2, 16, 4))

        def forward(self, x, position):
            self.cache.index_copy_(2, position, x)
            return self.cache.sum() + x.sum()

    program = torch.export.export(Empty(), (torch.ones(0, 2, 1, 4), torch.tensor([3])))
    assert input_bounds(program) == {}


class _Indexing(torch.nn.Module):
    """A cache written with index_put_ (`cache[:, :, pos] = x`, ExecuTorch's Llama), a table read at the
    position, and token ids into an embedding: eager refuses an index outside each dimension."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.register_buffer("cache", torch.zeros(1, 2, 16, 4))
        self.register_buffer("table", torch.zeros(12, 4))
        self.register_buffer("counter", torch.zeros((), dtype=torch.int64))
        self.embedding = torch.nn.Embedding(100, 4)

    def forward(self, x, position, tokens):
        if self.how == "counter":
            self.counter.copy_(position[0])
            index = torch.arange(1) + self.counter
        else:
            index = position
        self.cache[:, :, index] = x
        out = self.cache.sum(dim=2) + self.embedding(tokens).sum()
        if self.how == "table":
            out = out + self.table[position].sum()
        if self.how == "mask":  # a mask spans dimensions: the index after it is left
            out = out + self.cache[torch.ones(1, 2, dtype=torch.bool), position].sum()
        return out


def _indexing_bounds(how):
    program = torch.export.export(_Indexing(how), (torch.ones(1, 2, 1, 4), torch.tensor([3]), torch.tensor([[5, 6]])))
    return input_bounds(program)


def test_an_index_put_write_accepts_negative_positions_as_eager_does():
    assert _indexing_bounds("direct") == {"position": (-16, 15), "tokens": (0, 99)}


def test_a_read_of_a_shorter_table_narrows_the_bounds():
    assert _indexing_bounds("table") == {"position": (-12, 11), "tokens": (0, 99)}


def test_an_index_proven_through_a_counter_is_bounded_on_the_positions_proven():
    assert _indexing_bounds("counter") == {"position": (0, 15), "tokens": (0, 99)}


def test_an_index_beside_a_mask_is_left_to_the_write():
    assert _indexing_bounds("mask") == {"position": (-16, 15), "tokens": (0, 99)}


def test_a_token_id_computed_from_the_input_bounds_nothing():
    """Only a write's index is proven equal to an input: a read's proof would evaluate the graph once per row."""

    class Computed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(100, 4)

        def forward(self, tokens):
            return self.embedding(tokens * 1)

    assert input_bounds(torch.export.export(Computed(), (torch.tensor([5]),))) == {}


def test_a_counter_in_a_program_moved_to_another_device_still_bounds_the_position():
    """compile moves a program it builds for a GPU with move_to_device_pass, which writes the devices the
    graph names as strings: the proof, run on the CPU, takes them for the CPU too."""
    program = as_moved_to_a_gpu(torch.export.export(_Cache("counter"), (torch.ones(1, 2, 1, 4), torch.tensor([3]))))
    assert input_bounds(program) == {"position": (0, 15)}


def test_an_input_the_method_changes_in_place_bounds_nothing():
    """tokens[:, 0] = bos before the embedding: eager indexes with what the method wrote, not what it was given."""

    class Bos(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(10, 4)

        def forward(self, tokens):
            tokens[:, 0] = 1
            return self.embedding(tokens)

    assert input_bounds(torch.export.export(Bos(), (torch.tensor([[3, 4]]),))) == {}


def test_an_index_beside_one_that_may_be_empty_bounds_nothing():
    """t[rows, col] with no rows is empty: eager checks no column then."""

    class Pick(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.zeros(8, 8))

        def forward(self, rows, col):
            return self.table[rows, col]

    rows = torch.export.Dim("rows", min=0, max=16)
    program = torch.export.export(Pick(), (torch.tensor([1, 2]), torch.tensor([3])), dynamic_shapes={"rows": {0: rows}, "col": None})
    assert input_bounds(program) == {}
    both_static = torch.export.export(Pick(), (torch.tensor([1, 2]), torch.tensor([3])))
    assert input_bounds(both_static) == {"rows": (-8, 7), "col": (-8, 7)}


class _AlongDim(torch.nn.Module):
    """A table of 12 rows read or written at an index made from the position by `how`."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.register_buffer("table", torch.zeros(12, 4))

    def forward(self, position):
        how = self.how
        if how == "index_select of a view":
            return self.table.index_select(0, position.view(-1))
        if how == "gather of an expand":
            return self.table.gather(0, position.view(1, 1).expand(3, 4))
        if how == "gather of an expand to nothing":
            return self.table.gather(0, position.view(1, 1).expand(0, 4)).sum() + position.sum()
        if how == "scatter_add_ of an expand":
            return self.table.clone().scatter_add_(0, position.view(1, 1).expand(1, 4), torch.ones(1, 4))
        if how == "index_fill_":
            return self.table.clone().index_fill_(0, position, 1.0)
        if how == "read of a reshape":
            return self.table[position.reshape(1, 1)]
        if how == "a copy written through a view first":
            index = position.clone()
            index.view(-1).add_(1)
            return self.table.index_select(0, index)
        if how == "a slice":  # drops values: those past it are the input's own, not the index's
            return self.table.index_select(0, position[:1])
        return self.table.index_select(0, position.to(torch.int32))  # a cast may wrap: 2**32 + 3 reads row 3


@pytest.mark.parametrize("how, expected", [
    ("index_select of a view", (0, 11)), ("gather of an expand", (0, 11)), ("scatter_add_ of an expand", (0, 11)),
    ("index_fill_", (-12, 11)), ("read of a reshape", (-12, 11)),
])
def test_an_index_holding_the_inputs_values_bounds_it_as_eager_does(how, expected):
    """Each range is the one eager accepts for that op (-1 is refused by index_select, gather and scatter_add_,
    taken from the end by index_fill_ and indexing): checked against eager itself on the CPU."""
    module = _AlongDim(how)
    assert input_bounds(torch.export.export(module, (torch.tensor([3]),))) == {"position": expected}
    low, high = expected
    for accepted in (low, high):
        module(torch.tensor([accepted]))
    for refused in (low - 1, high + 1):
        with pytest.raises((IndexError, RuntimeError)):
            module(torch.tensor([refused]))


@pytest.mark.parametrize("how", ["gather of an expand to nothing", "a copy written through a view first", "a slice", "a cast"])
def test_an_index_that_may_not_hold_the_inputs_values_bounds_nothing(how):
    position = torch.tensor([3, 3]) if how == "a slice" else torch.tensor([3])
    assert input_bounds(torch.export.export(_AlongDim(how), (position,))) == {}


class _Prompt(torch.nn.Module):
    """A prefill that writes a cache of 16 positions at arange(n) + a counter it copies the prompt's
    first position into, as Hugging Face's static cache does; `how` changes what the index counts from."""

    def __init__(self, how: str = "counter"):
        super().__init__()
        self.how = how
        self.register_buffer("cache", torch.zeros(1, 2, 16, 4))
        self.register_buffer("counter", torch.zeros((), dtype=torch.int64))

    def forward(self, x, cache_position):
        count = cache_position.shape[0]
        if self.how == "second":  # counts from the second element: what the first holds is not where it writes
            self.counter.copy_(cache_position[-1] - count + 1)
        else:
            self.counter.copy_(cache_position[0])
        index = torch.arange(count) + self.counter
        if self.how == "ring":
            index = index % 16
        self.counter.add_(count)
        self.cache.index_copy_(2, index, x)
        return self.cache.sum(dim=2)


def _prompt_bounds(module, dynamic: bool = True, written_elsewhere=frozenset()):
    from cuda_runner.compile.input_bounds import all_input_bounds

    count = torch.export.Dim("count", min=1, max=16)
    shapes = {"x": {2: count}, "cache_position": {0: count}} if dynamic else None
    program = torch.export.export(module, (torch.ones(1, 2, 4, 4), torch.arange(4)), dynamic_shapes=shapes)
    return all_input_bounds(program, written_elsewhere)


@pytest.mark.parametrize("dynamic", [True, False], ids=["prompt of any length", "prompt of 4"])
def test_a_prompt_a_cache_write_counts_up_from_is_bounded_as_a_span(dynamic):
    """No element of the index is one of the input's: it gets a span, first 0 and first + n - 1 up to 15, not values."""
    bounds = _prompt_bounds(_Prompt(), dynamic)
    assert bounds.spans == {"cache_position": (0, 15)} and "cache_position" not in bounds.values


@pytest.mark.parametrize("how", ["second", "ring"])
def test_a_prompt_counted_from_another_element_or_wrapping_at_the_end_is_not_bounded(how):
    """Taken from its last element, the first says nothing of where it writes; wrapped, eager writes a
    prompt past the cache at its start, which a span would refuse."""
    assert _prompt_bounds(_Prompt(how)) == ({}, {})


class _Counted(torch.nn.Module):
    """A cache of `length` positions written at an index `how` makes of the prompt's positions."""

    def __init__(self, how, length: int = 16):
        super().__init__()
        self.how = how
        self.register_buffer("cache", torch.zeros(1, 2, length, 4))
        self.register_buffer("counter", torch.zeros((), dtype=torch.int64))

    def forward(self, x, cache_position):
        self.cache.index_copy_(2, self.how(self, cache_position), x)
        return self.cache.sum(dim=2)


def _counter_of(module, value):
    module.counter.copy_(value)
    return module.counter


@pytest.mark.parametrize("how", [
    pytest.param(lambda m, cp: torch.arange(cp.shape[0]) + _counter_of(m, cp.max()), id="from its largest element"),
    pytest.param(lambda m, cp: cp + 2 * torch.arange(cp.shape[0]), id="the prompt plus twice a count"),
    pytest.param(lambda m, cp: torch.arange(cp.shape[0]) + cp[0] + (torch.arange(cp.shape[0]).sum() == 10).long() * 100,
                 id="off at one length"),
    pytest.param(lambda m, cp: torch.arange(cp.shape[0]) + (cp[0] + (cp[0] == 37).long() * 10**6), id="off at one start"),
    pytest.param(lambda m, cp: torch.arange(2 * cp.shape[0])[: cp.shape[0]] * 2 + cp[0], id="counting by two"),
    pytest.param(lambda m, cp: torch.arange(cp.shape[0]) + cp[:1] + cp[-1:] - cp[-1:], id="reading its last element too"),
])
def test_an_index_that_is_not_its_first_element_plus_a_count_is_not_bounded_as_a_span(how):
    """Each accepts a prompt that a span would take and eager refuses (or the other way): a span is
    recorded only for arange(n) + a start computed from the first element alone and equal to it."""
    assert _prompt_bounds(_Counted(how, length=64)).spans == {}


def test_a_prompt_whose_counter_another_method_offsets_is_not_bounded():
    class Offset(_Prompt):
        def __init__(self):
            super().__init__()
            self.register_buffer("offset", torch.zeros((), dtype=torch.int64))

        def forward(self, x, cache_position):
            index = torch.arange(cache_position.shape[0]) + (cache_position[0] + self.offset)
            self.cache.index_copy_(2, index, x)
            return self.cache.sum(dim=2)

    assert _prompt_bounds(Offset()).spans == {"cache_position": (0, 15)}
    assert _prompt_bounds(Offset(), written_elsewhere=frozenset({"offset"})) == ({}, {})


def test_hugging_faces_exported_prefill_bounds_its_prompt_as_a_span():
    """transformers' own static-cache Llama, exported for a prompt of any length, where transformers is
    installed: each layer writes its cache at arange(n) plus a counter it copies cache_position[0] into."""
    pytest.importorskip("transformers")
    from models import hugging_face_static_llama

    wrapped = hugging_face_static_llama()
    length = torch.export.Dim("length", min=1, max=32)
    program = torch.export.export(wrapped, (), {"input_ids": torch.tensor([[1, 2, 3, 4]]), "cache_position": torch.arange(4)},
                                  dynamic_shapes={"input_ids": {1: length}, "cache_position": {0: length}}, strict=False)
    from cuda_runner.compile.input_bounds import all_input_bounds

    bounds = all_input_bounds(program)
    assert bounds.spans == {"cache_position": (0, 31)}
    assert bounds.values == {"input_ids": (0, 999)}  # the embedding's rows


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8])
def test_a_count_in_a_narrow_dtype_is_not_bounded_as_a_span(dtype):
    """arange(200, dtype=int8) wraps to -128 and on: the positions written are not first .. first + n - 1."""
    how = lambda m, cp: torch.arange(cp.shape[0], dtype=dtype) + _counter_of(m, cp[0])  # noqa: E731
    assert _prompt_bounds(_Counted(how, length=64)).spans == {}
    int64 = lambda m, cp: torch.arange(cp.shape[0], dtype=torch.int64) + _counter_of(m, cp[0])  # noqa: E731
    assert _prompt_bounds(_Counted(int64, length=64)).spans == {"cache_position": (0, 63)}
