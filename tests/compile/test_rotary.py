"""Rotations by the step's position (compile/rotary.py): the forms models
write RoPE in are proven by their values, with the tables the kernel reads;
what only looks like one, or reads what the step or another method writes,
is not taken."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import MethodOf, scale_models

from cuda_runner.compile import rotary
from cuda_runner.compile.attention import decode_attention_sites


def _position(graph, name="input_pos"):
    return next(node for node in graph.nodes if node.op == "placeholder" and node.name == name)


def _llama(dtype=torch.float32):
    config = scale_models.LLAMA_TINY
    model = scale_models.LlamaDecoder(config, dtype).eval()
    module = torch.export.export(MethodOf(model, "decode"), scale_models.llama_examples(config, 6)["decode"]).module()
    return module, config


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class HalvesAttention(torch.nn.Module):
    """Hugging Face's Llama form: cos and sin computed from inv_freq and the
    position each step, rounded to the model's dtype, and rotate_half; `norm`
    puts a per-head RMSNorm on q and k before the rotation (Qwen3's QK-norm);
    `mix` rolls the query's heads after it (no rotation the kernel computes)."""

    def __init__(self, heads=4, kv_heads=2, dim=16, length=24, norm=False, mix=False, per_head=False):
        super().__init__()
        self.heads, self.kv_heads, self.dim, self.norm, self.mix, self.per_head = heads, kv_heads, dim, norm, mix, per_head
        self.q = torch.nn.Linear(32, heads * dim, bias=False)
        self.k = torch.nn.Linear(32, kv_heads * dim, bias=False)
        self.v = torch.nn.Linear(32, kv_heads * dim, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
        self.register_buffer("head_scale", torch.linspace(0.5, 1.5, heads).view(1, heads, 1, 1))
        self.register_buffer("k_cache", torch.zeros(1, kv_heads, length, dim))
        self.register_buffer("v_cache", torch.zeros(1, kv_heads, length, dim))

    def forward(self, x, cache_position):
        freqs = (self.inv_freq[None, :, None].float() @ cache_position[None, None, :].float()).transpose(1, 2)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(x.dtype).unsqueeze(1), angles.sin().to(x.dtype).unsqueeze(1)
        q = self.q(x).view(1, 1, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(1, 1, self.kv_heads, self.dim).transpose(1, 2)
        v = self.v(x).view(1, 1, self.kv_heads, self.dim).transpose(1, 2)
        if self.norm:
            q, k = F.rms_norm(q, (self.dim,)), F.rms_norm(k, (self.dim,))
        q_sin = sin * self.head_scale if self.per_head else sin
        q, k = q * cos + _rotate_half(q) * q_sin, k * cos + _rotate_half(k) * sin
        if self.mix:
            q = q.roll(1, dims=1)
        self.k_cache.index_copy_(2, cache_position, k)
        self.v_cache.index_copy_(2, cache_position, v)
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, enable_gqa=True)


def _halves_graph(dtype=torch.float32, **options):
    module = HalvesAttention(**options).to(dtype).eval()
    graph_module = torch.export.export(module, (torch.randn(1, 1, 32, dtype=dtype), torch.tensor([3]))).module()
    (site,) = decode_attention_sites(graph_module.graph)
    return graph_module, site


def test_the_decoders_neighbour_pairs_are_proven_from_its_tables_once_for_every_layer():
    module, config = _llama()
    position = _position(module.graph)
    proven: dict = {}
    for site in decode_attention_sites(module.graph):
        for rotated in (site.query, site.key.args[3]):
            found = rotary.rotation(rotated, position, config.max_seq, proven=proven)
            assert found is not None and found.pairs == rotary.NEIGHBOURS
            assert str(found.source.target) == "aten.transpose.int"  # the projection's view, not its float32 cast
            cos, sin = module.model.rope_cos, module.model.rope_sin  # [positions, D/2], float32
            assert torch.equal(found.cos[:, 0::2], cos) and torch.equal(found.cos[:, 1::2], cos)
            assert torch.equal(found.sin[:, 0::2], -sin) and torch.equal(found.sin[:, 1::2], sin)
    assert len(proven) == 2  # the query's and the key's, each proven once for both layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hugging_faces_halves_are_proven_with_cos_and_sin_as_the_model_rounds_them(dtype):
    graph_module, site = _halves_graph(dtype)
    position = _position(graph_module.graph, "cache_position")
    found = rotary.rotation(site.query, position, 24)
    assert found is not None and found.pairs == rotary.HALVES
    angles = torch.outer(torch.arange(24).float(), graph_module.inv_freq)
    cos, sin = angles.cos().to(dtype).float(), angles.sin().to(dtype).float()
    assert torch.equal(found.cos, torch.cat((cos, cos), dim=1))
    assert torch.equal(found.sin, torch.cat((-sin, sin), dim=1))
    assert rotary.rotation(site.key.args[3], position, 24).pairs == rotary.HALVES


def test_a_norm_before_the_rotation_stays_the_models_and_the_rotation_starts_after_it():
    graph_module, site = _halves_graph(norm=True)
    found = rotary.rotation(site.query, _position(graph_module.graph, "cache_position"), 24)
    assert found is not None and "rms_norm" in str(found.source.target)


@pytest.mark.parametrize("options", [{"mix": True}, {"per_head": True}], ids=["heads mixed", "sin scaled per head"])
def test_what_only_looks_like_a_rotation_is_not_taken(options):
    graph_module, site = _halves_graph(**options)
    assert rotary.rotation(site.query, _position(graph_module.graph, "cache_position"), 24) is None


def test_a_map_that_is_not_linear_in_the_projection_is_not_taken():
    class Folded(torch.nn.Module):
        def __init__(self, fold):
            super().__init__()
            self.fold = fold

        def forward(self, q, position):
            angle = torch.arange(8, dtype=torch.float32)[position].view(1, 1, 1, 1)
            rotated = q * angle.cos() + _rotate_half(q) * angle.sin()
            return rotated.abs() if self.fold else rotated  # abs() is right on probes of 0 and 1 alone

    for fold, taken in ((False, True), (True, False)):
        graph_module = torch.export.export(Folded(fold), (torch.randn(1, 2, 1, 8), torch.tensor([1]))).module()
        output = next(node for node in graph_module.graph.nodes if node.op == "output").args[0][0]
        assert (rotary.rotation(output, _position(graph_module.graph, "position"), 8) is not None) is taken



def test_tables_that_another_method_or_the_step_writes_are_not_proven():
    module, config = _llama()
    position = _position(module.graph)
    site = decode_attention_sites(module.graph)[0]
    assert rotary.rotation(site.query, position, config.max_seq, written_elsewhere=frozenset({"model.rope_cos"})) is None

    class Refilled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cos", torch.rand(8, 4))

        def forward(self, q, position):
            self.cos.mul_(1.0)  # the step writes its own table
            cos = self.cos[position].view(1, 1, 1, 4).repeat_interleave(2, dim=-1)
            return q * cos

    graph_module = torch.export.export(Refilled(), (torch.randn(1, 2, 1, 8), torch.tensor([1]))).module()
    output = next(node for node in graph_module.graph.nodes if node.op == "output").args[0][0]
    assert rotary.rotation(output, _position(graph_module.graph, "position"), 8) is None

