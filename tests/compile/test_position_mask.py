"""Masks proven to say "cache positions up to the step's" (compile/position_mask.py):
the ways models write them are taken, anything that differs at any position,
or that cannot be evaluated from the position alone, keeps its mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import MethodOf, scale_models

from cuda_runner.compile import position_mask
from cuda_runner.compile.attention import _mask_target, decode_attention_sites
from cuda_runner.compile.position_mask import position_limit

LENGTH = 24


class _Masked(torch.nn.Module):
    """One SDPA call over a cache of LENGTH positions, its mask made from the position by `make`."""

    def __init__(self, make, rows: int = 1):
        super().__init__()
        self.make, self.rows = make, rows
        self.register_buffer("causal", torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril())

    def forward(self, q, k, v, input_pos, other):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.make(self, input_pos, other))


def _arange(input_pos):
    return torch.arange(LENGTH, device=input_pos.device)


MASKS = {
    "arange compare": lambda m, p, o: (_arange(p)[None, :] <= p[:, None]).view(1, 1, 1, LENGTH),
    "causal buffer row": lambda m, p, o: m.causal[p].view(1, 1, 1, LENGTH),
    "additive, lowest value": lambda m, p, o: torch.where(_arange(p) <= p, 0.0, torch.finfo(torch.float32).min).view(1, 1, 1, LENGTH),
    "additive, -inf": lambda m, p, o: torch.zeros(LENGTH).masked_fill(_arange(p) > p, float("-inf")).view(1, 1, 1, LENGTH),
}
NOT_POSITION_MASKS = {
    "one short": lambda m, p, o: (_arange(p) < p).view(1, 1, 1, LENGTH),
    "a sliding window": lambda m, p, o: ((_arange(p) <= p) & (_arange(p) > p - 4)).view(1, 1, 1, LENGTH),
    "additive, -1e4": lambda m, p, o: torch.where(_arange(p) <= p, 0.0, -1e4).view(1, 1, 1, LENGTH),
    "from two inputs": lambda m, p, o: (_arange(p) <= p + o).view(1, 1, 1, LENGTH),
    "random": lambda m, p, o: ((_arange(p) <= p) | (torch.rand(LENGTH) > 2.0)).view(1, 1, 1, LENGTH),
}


def _site(make, rows: int = 1, moved_to: str | None = None):
    q, k, v = torch.randn(1, 4, rows, 8), torch.randn(1, 4, LENGTH, 8), torch.randn(1, 4, LENGTH, 8)
    program = torch.export.export(_Masked(make, rows), (q, k, v, torch.tensor([5]), torch.tensor([0])))
    if moved_to is not None:  # as compile moves every program it builds for a GPU
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, moved_to)
    (site,) = decode_attention_sites(program.module().graph)
    return site


@pytest.mark.parametrize("make", MASKS.values(), ids=MASKS.keys())
def test_masks_that_allow_the_positions_up_to_the_steps_are_taken(make):
    site = _site(make)
    limit = position_limit(site.mask, _mask_target(site))
    assert limit is not None and limit.op == "placeholder" and limit.name == "input_pos"


@pytest.mark.parametrize("make", NOT_POSITION_MASKS.values(), ids=NOT_POSITION_MASKS.keys())
def test_masks_that_differ_anywhere_or_need_more_than_the_position_are_kept(make):
    site = _site(make)
    assert position_limit(site.mask, _mask_target(site)) is None


@pytest.mark.parametrize("dtype, taken", [(torch.float32, True), (torch.bfloat16, True), (torch.float16, False)])
def test_an_additive_masks_lowest_value_counts_as_minus_infinity_only_where_no_score_comes_near_it(dtype, taken):
    """float16's lowest is -65504: a masked score more than that above the kept ones wins in eager."""
    allowed = torch.arange(LENGTH) <= 5
    lowest = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)
    assert position_mask._allows_exactly(lowest, allowed) is taken
    assert position_mask._allows_exactly(lowest.masked_fill(~allowed, float("-inf")), allowed)


def test_several_query_rows_keep_their_mask():
    site = _site(lambda m, p, o: (_arange(p)[None, :] <= p[:, None]).view(1, 1, 1, LENGTH).expand(1, 1, 2, LENGTH), rows=2)
    assert position_limit(site.mask, _mask_target(site)) is None


def test_a_cache_longer_than_what_is_proven_keeps_its_mask(monkeypatch):
    site = _site(MASKS["arange compare"])
    monkeypatch.setattr(position_mask, "MAX_PROVEN_POSITIONS", LENGTH - 1)
    assert position_limit(site.mask, _mask_target(site)) is None


def test_every_layer_of_the_llama_decoders_step_is_masked_by_its_position():
    """In a bundle with its prefill too: the caches both methods write are not what the mask reads."""
    from cuda_runner.compile import MethodSource, _written_by_methods

    config = scale_models.LLAMA_TINY
    model = scale_models.LlamaDecoder(config, torch.float32).eval()
    examples = scale_models.llama_examples(config, 6)
    programs = {method: torch.export.export(MethodOf(model, method), examples[method]) for method in ("prefill", "decode")}
    written = _written_by_methods({method: MethodSource(program) for method, program in programs.items()})
    assert len(written) == 2 * config.layers  # the K and V caches
    sites = decode_attention_sites(programs["decode"].module().graph)
    assert len(sites) == config.layers
    assert {position_limit(site.mask, _mask_target(site), written).name for site in sites} == {"input_pos"}


def _decode_tensors():
    """q (one row), k and v over a cache of LENGTH positions."""
    return torch.randn(1, 4, 1, 8), torch.randn(1, 4, LENGTH, 8), torch.randn(1, 4, LENGTH, 8)


def _only_site(module, *args):
    """The one SDPA call of `module` exported with `args`."""
    (site,) = decode_attention_sites(torch.export.export(module, args).module().graph)
    return site


class _MaskKeptInABuffer(torch.nn.Module):
    """Allows exactly the positions up to the step's at compile time, but the step writes the buffer it reads."""

    def __init__(self):
        super().__init__()
        self.register_buffer("causal", torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril())

    def forward(self, q, k, v, input_pos):
        self.causal[0].copy_(torch.zeros(LENGTH, dtype=torch.bool))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.causal[input_pos].view(1, 1, 1, LENGTH))


def test_a_mask_read_from_a_buffer_the_step_writes_is_kept():
    site = _only_site(_MaskKeptInABuffer(), *_decode_tensors(), torch.tensor([5]))
    assert position_limit(site.mask, _mask_target(site)) is None


class _PositionAdvanced(torch.nn.Module):
    """Allows the positions up to p, then writes p through a view before the attention reads the mask's source."""

    def forward(self, q, k, v, input_pos):
        mask = (torch.arange(LENGTH) <= input_pos).view(1, 1, 1, LENGTH)
        input_pos[0] += 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_position_the_step_writes_through_a_view_keeps_its_mask():
    site = _only_site(_PositionAdvanced(), *_decode_tensors(), torch.tensor([5]))
    assert position_limit(site.mask, _mask_target(site)) is None


class _MaskNarrowedThroughItsBase(torch.nn.Module):
    """The mask is a view of a tensor that is then narrowed to a window in place:
    the SDPA's mask node is the view, computed before the write."""

    def forward(self, q, k, v, input_pos):
        base = torch.arange(LENGTH) <= input_pos
        mask = base.view(1, 1, 1, LENGTH)
        base.logical_and_(torch.arange(LENGTH) > input_pos - 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_mask_written_through_another_view_before_the_attention_keeps_its_mask():
    q, k, v = _decode_tensors()
    module = _MaskNarrowedThroughItsBase()
    site = _only_site(module, q, k, v, torch.tensor([5]))
    assert site.mask.target == torch.ops.aten.view.default  # the node read is the one before the write
    assert position_limit(site.mask, _mask_target(site)) is None
    # what it would have been proven as, had the write been missed: the window is what eager attends to
    pos = torch.tensor([9])
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=((torch.arange(LENGTH) <= pos) & (torch.arange(LENGTH) > pos - 4)).view(1, 1, 1, LENGTH))
    torch.testing.assert_close(module(q, k, v, pos), want)


@pytest.mark.parametrize("position", [torch.tensor(5), torch.tensor([[5]])], ids=["0-d", "1x1"])
def test_a_position_not_shaped_one_per_row_keeps_its_mask(position):
    """The kernel takes one position per query row, [1]; a 0-d or [1, 1] one would be refused by it at build time."""
    module = _Masked(lambda m, p, o: (_arange(p) <= p.reshape(-1)[:, None]).view(1, 1, 1, LENGTH))
    site = _only_site(module, *_decode_tensors(), position, torch.tensor([0]))
    assert position_limit(site.mask, _mask_target(site)) is None


def test_a_mask_built_from_a_square_matrix_in_the_step_is_not_evaluated_at_every_position():
    """torch.full((S, S)).triu(1)[p] would be computed again at each of S positions: minutes at S = 4096."""
    make = MASKS["causal buffer row"]
    slow = lambda m, p, o: torch.full((LENGTH, LENGTH), float("-inf")).triu(1)[p].view(1, 1, 1, LENGTH)  # noqa: E731
    assert position_limit(*_limit_arguments(make)) is not None
    assert position_limit(*_limit_arguments(slow)) is None


def _limit_arguments(make):
    site = _site(make)
    return site.mask, _mask_target(site)


class _PaddedByPrefill(torch.nn.Module):
    """prefill fills a buffer of the cache positions a prompt left valid; decode's mask reads it.
    The methods of a bundle share the buffer, so the decode step's graph alone does not show the write."""

    def __init__(self):
        super().__init__()
        self.register_buffer("valid", torch.ones(LENGTH, dtype=torch.bool))

    def prefill(self, pad):
        self.valid.copy_(torch.arange(LENGTH) >= pad)
        return self.valid.sum()

    def forward(self, q, k, v, input_pos):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(self.valid & (torch.arange(LENGTH) <= input_pos)).view(1, 1, 1, LENGTH))


def _padded_by_prefill_sources():
    from cuda_runner.compile import export_method

    module = _PaddedByPrefill()
    decode_args = (*_decode_tensors(), torch.tensor([5]))
    return module, {"prefill": export_method(module, "prefill", (torch.tensor(3),)), "decode": export_method(module, "forward", decode_args)}


def test_a_mask_read_from_a_buffer_another_method_writes_is_kept():
    from cuda_runner.compile import _written_by_methods

    _, sources = _padded_by_prefill_sources()
    written = _written_by_methods(sources)
    assert written == {"valid"}
    (site,) = decode_attention_sites(sources["decode"].program.module().graph)
    assert position_limit(site.mask, _mask_target(site)) is not None  # decode alone: the buffer looks constant
    assert position_limit(site.mask, _mask_target(site), written) is None
    assert not _written_by_methods({"decode": sources["decode"]})  # a bundle of one method: nothing else writes


def test_every_method_is_compiled_knowing_what_the_bundle_writes(monkeypatch, tmp_path):
    import cuda_runner.compile as compile_package

    _, sources = _padded_by_prefill_sources()
    heard: dict[str, frozenset[str]] = {}

    class _Stop(Exception):
        pass

    def compile_method(torch, method, source, device, progress, options, cpu_target, runtime, warn, written_by_methods):
        heard[method] = written_by_methods
        if len(heard) == len(sources):
            raise _Stop
        return None, {}, source.program, {}

    monkeypatch.setattr(compile_package, "_compile_method", compile_method)
    with pytest.raises(_Stop):
        compile_package.compile_sources(sources, tmp_path / "padded.bundle", device="cpu")
    assert heard == {"prefill": {"valid"}, "decode": {"valid"}}


@pytest.mark.parametrize("make", [MASKS["arange compare"], MASKS["additive, -inf"]], ids=["arange compare", "additive, -inf"])
def test_a_program_moved_to_another_device_is_proven_as_exported(make):
    """move_to_device_pass writes the devices the graph names as strings ("cuda:0"; "meta" here, which
    this machine has): the proof, on the CPU, must still take them for the CPU. It did not, and no
    CUDA build proved a mask."""
    site = _site(make, moved_to="meta")
    assert position_limit(site.mask, _mask_target(site)) is not None
