#!/usr/bin/env python3
"""Export a zoo of small ExecuTorch CUDA programs (model.pte + aoti_cuda_blob.ptd) for cuda-runner's tests.

Each program goes into its own folder under --out-dir with:
    model.pte, aoti_cuda_blob.ptd   from to_edge_transform_and_lower(CudaPartitioner) + to_executorch
    io.npz                          inputs and eager PyTorch (CPU, fp32) outputs of every reference call
    entry.json                      this program's record (also gathered into <out-dir>/zoo.json)
and <out-dir>/zoo.json indexes them all: per method the inputs/outputs, dynamic dims, the weight and
mutable-buffer FQNs, the plan's instruction/value wiring (delegate argument order against the method's),
the .ptd keys, the per-method ETCUDAFQN3 weight manifests, and the reference calls with their npz keys.

Programs (random weights, torch.manual_seed fixed per program):
    a_llm_kv          token_embedding(input_ids[1,T] i64) -> embeds; text_decoder(inputs_embeds[1,T,D],
                      cache_position[T] i64) -> logits, KV cache = buffers updated in place (index_copy_),
                      dynamic T; constant methods get_max_seq_len, get_vocab_size, use_kv_cache,
                      enable_dynamic_shape. io.npz: prefill 5 tokens, then 3 greedy single-token decodes.
    b_enc_dec         encoder(x) -> enc; decoder(ids i64, enc) -> logits (decoder uses enc first)
    c_permuted_out    forward(x, y) -> (x - y, x * 2 + y): computed a = x*2+y first, returned second
    d_repeated_out    forward(x) -> (h, h, g): the same tensor twice
    e_input_out       forward(x) -> (lin(x), x): a method input returned as an output
    f_dtypes          forward(x f32, idx i64, keep bool) -> (x > 0 bool, argmax i64, picked f32,
                      count i64, idx*2 i32)
    g_dyn2            forward(x[B,S,16]) with B in 1..8 and S in 2..32 -> (y[B,S,8], pooled[B,8])
    h_shared_weights  prefill(tokens[1,T] i64) and decode(token[1,1] i64) over the same core.* weights
                      (ExecuTorch 1.5 stores CUDA weights per FQN, so the .ptd should hold them once)

Modes:
    (default)       real CUDA export: needs a CUDA build of torch and a GPU (Inductor autotunes on it)
    --dry-run       torch.export only; checks the exported modules against the eager references and
                    writes io.npz + entry.json (no executorch needed)
    --cpu-standin   CPU stand-in: ExecuTorch's AotiBackend pipeline with a backend *named* CudaBackend
                    that compiles for the CPU (G3 layout: ExecuTorch's CudaWeightCollector around
                    AotiBackend.preprocess, a multi-method preprocess like the real one, and the partitioner's target_device
                    spec so the plan gets the same h2d/d2h copies); the .so is CPU code.

Inductor's options are the backend's own: nothing here overrides max_autotune (the CUDA backend
relies on it, with Triton as the only GEMM backend, so that no matmul falls back to an extern
libtorch kernel that ExecuTorch's shims lack).

    python make_et_zoo.py --out-dir zoo_et151 --et-version-tag et151 [--only a_llm_kv,c_permuted_out] [--jobs 4]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.export import Dim

PTD_NAME = "aoti_cuda_blob.ptd"
_STANDIN = None


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class KVCache(nn.Module):
    def __init__(self, heads: int, max_seq: int, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, heads, max_seq, head_dim))
        self.register_buffer("v_cache", torch.zeros(1, heads, max_seq, head_dim))

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        return self.k_cache, self.v_cache


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, max_seq: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.max_seq = heads, dim // heads, max_seq
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.kv_cache = KVCache(heads, max_seq, self.head_dim)
        self.use_bmm = True  # False: the same attention as broadcast-multiply + sum (no bmm for Inductor to tune)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q(x).reshape(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).reshape(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = self.v(x).reshape(b, t, self.heads, self.head_dim).transpose(1, 2)
        k_all, v_all = self.kv_cache.update(pos, k, v)
        # Without bmm: [1,H,T,1,hd] * [1,H,1,S,hd] -> [1,H,T,S]
        scores = torch.matmul(q, k_all.transpose(-1, -2)) if self.use_bmm else (q.unsqueeze(3) * k_all.unsqueeze(2)).sum(-1)
        scores = scores * (1.0 / math.sqrt(self.head_dim))
        visible = torch.arange(self.max_seq, device=x.device).unsqueeze(0) <= pos.unsqueeze(1)  # [T, S]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        # Without bmm: [1,H,T,S,1] * [1,H,1,S,hd] -> [1,H,T,hd]
        out = torch.matmul(probs, v_all) if self.use_bmm else (probs.unsqueeze(-1) * v_all.unsqueeze(2)).sum(3)
        return self.o(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, max_seq: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, max_seq)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), pos)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    VOCAB, DIM, HEADS, LAYERS, MAX_SEQ = 64, 32, 2, 2, 32

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, self.DIM)
        self.layers = nn.ModuleList([Block(self.DIM, self.HEADS, self.MAX_SEQ) for _ in range(self.LAYERS)])
        self.norm = nn.LayerNorm(self.DIM)
        self.lm_head = nn.Linear(self.DIM, self.VOCAB, bias=False)


class TokenEmbedding(nn.Module):
    def __init__(self, lm: TinyLM) -> None:
        super().__init__()
        self.embed = lm.embed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)


class TextDecoder(nn.Module):
    def __init__(self, lm: TinyLM) -> None:
        super().__init__()
        self.layers, self.norm, self.lm_head = lm.layers, lm.norm, lm.lm_head

    def forward(self, inputs_embeds: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        h = inputs_embeds
        for layer in self.layers:
            h = layer(h, cache_position)
        return self.lm_head(self.norm(h))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.ff = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(torch.nn.functional.gelu(self.norm(self.proj(x))))


class Decoder(nn.Module):
    """Uses enc (its 2nd input) before ids, so a delegate may take them in the other order."""

    def __init__(self, vocab: int = 40) -> None:
        super().__init__()
        self.mem = nn.Linear(32, 32)
        self.embed = nn.Embedding(vocab, 32)
        self.head = nn.Linear(32, vocab)

    def forward(self, ids: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
        memory = self.mem(enc)
        h = self.embed(ids)
        weights = torch.softmax(torch.matmul(h, memory.transpose(1, 2)) * (1.0 / math.sqrt(32)), dim=-1)
        return self.head(h + torch.matmul(weights, memory))


class Permuted(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x * 2 + y
        b = x - y
        return b, a


class Repeated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.relu(self.lin(x))
        g = h.sum(dim=-1)
        return h, h, g


class InputOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.lin(x)), x


class Dtypes(nn.Module):
    def forward(self, x: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor):
        mask = x > 0
        picked = torch.where(keep, x, torch.zeros_like(x)).index_select(0, idx)
        return mask, x.argmax(dim=-1), picked, mask.sum(dim=-1), (idx * 2).to(torch.int32)


class Dyn2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))
        return y, y.mean(dim=1)


class SharedCore(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)


class Prefill(nn.Module):
    def __init__(self, core: SharedCore) -> None:
        super().__init__()
        self.core = core

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.core.proj(self.core.embed(tokens)))
        return self.core.head(h.mean(dim=1))


class Decode(nn.Module):
    def __init__(self, core: SharedCore) -> None:
        super().__init__()
        self.core = core
        self.decode_scale = nn.Parameter(torch.rand(32) + 0.5)  # this method's own weight

    def forward(self, token: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.core.proj(self.core.embed(token))) * self.decode_scale
        return self.core.head(h[:, 0, :])


# --------------------------------------------------------------------------------------------
# Program specs: methods, export variants, reference calls
# --------------------------------------------------------------------------------------------


@dataclass
class Call:
    method: str
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    input_keys: list[str]
    output_keys: list[str]
    note: str = ""


@dataclass
class Variant:
    label: str
    dynamic_shapes: dict[str, Any]  # method -> dynamic_shapes for torch.export (or None)
    setup: Callable[[dict[str, nn.Module]], None] | None = None  # changes the modules (eager references too)


@dataclass
class Spec:
    name: str
    what: str
    build: Callable[[], dict[str, nn.Module]]  # fresh modules per method, seeded
    examples: dict[str, tuple]
    variants: list[Variant]
    reference: Callable[[dict[str, nn.Module]], list[Call]]
    constant_methods: dict[str, Any] | None = None
    expect: dict[str, Any] = field(default_factory=dict)


def _outs(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _call(modules, method, inputs, prefix, note="") -> Call:
    with torch.no_grad():
        outputs = [o.detach().clone() for o in _outs(modules[method](*inputs))]
    return Call(method, [i.clone() for i in inputs], outputs,
                [f"{prefix}input_{i}" for i in range(len(inputs))],
                [f"{prefix}output_{i}" for i in range(len(outputs))], note)


def seeded(seed: int, make: Callable[[], dict[str, nn.Module]]) -> Callable[[], dict[str, nn.Module]]:
    def build() -> dict[str, nn.Module]:
        torch.manual_seed(seed)
        return {name: module.eval() for name, module in make().items()}
    return build


def spec_a() -> Spec:
    def make():
        lm = TinyLM()
        return {"token_embedding": TokenEmbedding(lm), "text_decoder": TextDecoder(lm)}

    D = TinyLM.DIM
    examples = {"token_embedding": (torch.zeros(1, 5, dtype=torch.long),),
                "text_decoder": (torch.zeros(1, 5, D), torch.arange(5, dtype=torch.long))}

    def shapes(lo: int, hi: int):
        t = Dim("seq_len", min=lo, max=hi)
        return {"token_embedding": {"input_ids": {1: t}},
                "text_decoder": {"inputs_embeds": {1: t}, "cache_position": {0: t}}}

    def no_bmm(modules):
        for module in modules["text_decoder"].modules():
            if isinstance(module, Attention):
                module.use_bmm = False

    def reference(m):
        g = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, TinyLM.VOCAB, (1, 5), generator=g)
        calls, pos = [], 0
        for step in range(4):
            t = ids.shape[1]
            emb = _call(m, "token_embedding", [ids], f"step{step}_token_embedding_")
            cache_position = torch.arange(pos, pos + t, dtype=torch.long)
            dec = _call(m, "text_decoder", [emb.outputs[0], cache_position], f"step{step}_",
                        "prefill" if step == 0 else "decode")
            calls += [emb, dec]
            pos += t
            ids = dec.outputs[0][:, -1, :].argmax(dim=-1, keepdim=True)  # greedy next token, [1, 1]
        return calls

    return Spec("a_llm_kv", "LLM-style decoder with a KV cache (buffers mutated in place by index_copy_), "
                "token_embedding + text_decoder, dynamic T, constant methods",
                seeded(0, make), examples,
                [Variant("dynamic T 1..16", shapes(1, 16)),
                 Variant("dynamic T 1..16, attention without bmm", shapes(1, 16), no_bmm),
                 Variant("dynamic T 2..16 (decode with T=1 not covered)", shapes(2, 16))],
                reference,
                constant_methods={"get_max_seq_len": TinyLM.MAX_SEQ, "get_vocab_size": TinyLM.VOCAB,
                                  "use_kv_cache": True, "enable_dynamic_shape": True},
                expect={"stateful": "text_decoder: run the calls in order on one loaded program; "
                        "the KV cache lives in the delegate"})


def spec_b() -> Spec:
    def make():
        return {"encoder": Encoder(), "decoder": Decoder()}

    def reference(m):
        g = torch.Generator().manual_seed(7)
        x = torch.randn(1, 8, 16, generator=g)
        enc = _call(m, "encoder", [x], "encoder_")
        ids = torch.randint(0, 40, (1, 4), generator=g)
        return [enc, _call(m, "decoder", [ids, enc.outputs[0]], "decoder_")]

    return Spec("b_enc_dec", "encoder(x[1,8,16]) -> enc[1,8,32]; decoder(ids[1,4] i64, enc) -> logits[1,4,40]; "
                "decoder reads enc before ids", seeded(1, make),
                {"encoder": (torch.randn(1, 8, 16),), "decoder": (torch.zeros(1, 4, dtype=torch.long), torch.randn(1, 8, 32))},
                [Variant("static", {})], reference)


def _single(name, what, seed, make, example, variants, inputs_fn, extra_calls=None, expect=None) -> Spec:
    def reference(m):
        calls = [_call(m, "forward", inputs_fn(), "")]
        for k, inputs in enumerate(extra_calls() if extra_calls else [], start=1):
            calls.append(_call(m, "forward", inputs, f"call{k}_"))
        return calls

    return Spec(name, what, seeded(seed, lambda: {"forward": make()}), {"forward": example}, variants, reference,
                expect=expect or {})


def all_specs() -> list[Spec]:
    g = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731
    specs = [spec_a(), spec_b()]
    specs.append(_single(
        "c_permuted_out", "forward(x, y) -> (x - y, x*2 + y); a = x*2+y is computed first, returned second",
        2, Permuted, (torch.randn(4, 8), torch.randn(4, 8)), [Variant("static", {})],
        lambda: [torch.randn(4, 8, generator=g(20)), torch.randn(4, 8, generator=g(21))],
        expect={"method_outputs": ["b = x - y", "a = x * 2 + y"]}))
    specs.append(_single(
        "d_repeated_out", "forward(x[4,16]) -> (h, h, g): one tensor returned twice", 3, Repeated,
        (torch.randn(4, 16),), [Variant("static", {})], lambda: [torch.randn(4, 16, generator=g(30))]))
    specs.append(_single(
        "e_input_out", "forward(x[4,16]) -> (tanh(lin(x)), x): a method input returned as an output", 4, InputOut,
        (torch.randn(4, 16),), [Variant("static", {})], lambda: [torch.randn(4, 16, generator=g(40))]))

    def dtype_inputs():
        gen = g(50)
        return [torch.randn(4, 8, generator=gen), torch.tensor([3, 0, 2], dtype=torch.long),
                torch.rand(4, 8, generator=gen) > 0.5]

    specs.append(_single(
        "f_dtypes", "forward(x f32[4,8], idx i64[3], keep bool[4,8]) -> (x>0 bool, argmax i64[4], picked f32[3,8], "
        "count i64[4], idx*2 i32[3])", 5, Dtypes,
        (torch.randn(4, 8), torch.tensor([0, 1, 2], dtype=torch.long), torch.ones(4, 8, dtype=torch.bool)),
        [Variant("static", {})], dtype_inputs))

    def dyn2_variants():
        b, s = Dim("batch", min=1, max=8), Dim("seq", min=2, max=32)
        return [Variant("dynamic batch 1..8 and seq 2..32", {"forward": {"x": {0: b, 1: s}}})]

    specs.append(_single(
        "g_dyn2", "forward(x[B,S,16]) -> (y[B,S,8], pooled[B,8]), B in 1..8, S in 2..32", 6, Dyn2,
        (torch.randn(2, 5, 16),), dyn2_variants(), lambda: [torch.randn(3, 11, 16, generator=g(60))],
        extra_calls=lambda: [[torch.randn(8, 32, 16, generator=g(61))], [torch.randn(1, 2, 16, generator=g(62))]]))

    def make_h():
        core = SharedCore()
        return {"prefill": Prefill(core), "decode": Decode(core)}

    def reference_h(m):
        gen = g(70)
        return [_call(m, "prefill", [torch.randint(0, 50, (1, 7), generator=gen)], "prefill_"),
                _call(m, "decode", [torch.randint(0, 50, (1, 1), generator=gen)], "decode_")]

    t = Dim("tokens", min=2, max=16)
    specs.append(Spec(
        "h_shared_weights", "prefill(tokens[1,T] i64, T in 2..16) -> logits[1,50] and decode(token[1,1] i64) -> "
        "logits[1,50], both over the same core.* weights; decode also has its own decode_scale", seeded(7, make_h),
        {"prefill": (torch.zeros(1, 5, dtype=torch.long),), "decode": (torch.zeros(1, 1, dtype=torch.long),)},
        [Variant("prefill dynamic T 2..16, decode static", {"prefill": {"tokens": {1: t}}})], reference_h))
    return specs


# --------------------------------------------------------------------------------------------
# Export helpers
# --------------------------------------------------------------------------------------------


def tensor_info(t: torch.Tensor) -> dict[str, Any]:
    return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}


def mutated_buffers(ep) -> list[str]:
    # torch.export's default IR keeps in-place ops; the functional form names the mutated buffers
    try:
        return sorted(copy.deepcopy(ep).run_decompositions({}).graph_signature.buffers_to_mutate.values())
    except Exception as error:
        return [f"unknown: {first_line(error)}"]


def method_summary(ep, example, dynamic) -> dict[str, Any]:
    sig = ep.graph_signature
    dims: dict[str, Any] = {}
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in sig.user_inputs:
            val = node.meta.get("val")
            if val is not None and any(not isinstance(s, int) for s in val.shape):
                dims[node.name] = [str(s) for s in val.shape]
    return {
        "inputs": [tensor_info(t) for t in example],
        "input_names": list(sig.user_inputs),
        "dynamic_dims": dims,
        "range_constraints": {str(k): [int(v.lower), int(v.upper)] if str(v.upper).isdigit() else [str(v.lower), str(v.upper)]
                              for k, v in ep.range_constraints.items()},
        "weights": sorted(sig.inputs_to_parameters.values()),
        "buffers": sorted(sig.inputs_to_buffers.values()),
        "mutated_buffers": mutated_buffers(ep),
        "constants": sorted(sig.inputs_to_lifted_tensor_constants.values()),
        "user_outputs": list(sig.user_outputs),
    }


def build_for(spec: Spec, variant: Variant | None) -> dict[str, nn.Module]:
    modules = spec.build()
    if variant is not None and variant.setup is not None:
        variant.setup(modules)
    return modules


def export_methods(spec: Spec, variant: Variant) -> dict[str, Any]:
    modules = build_for(spec, variant)
    return {name: torch.export.export(modules[name], spec.examples[name], dynamic_shapes=variant.dynamic_shapes.get(name))
            for name in modules}


def replay(programs: dict[str, Any], calls: list[Call]) -> float:
    """Run the reference calls through deep copies of the exported modules; the max abs error."""
    modules = {name: copy.deepcopy(ep).module() for name, ep in programs.items()}
    worst = 0.0
    for call in calls:
        with torch.no_grad():
            got = _outs(modules[call.method](*call.inputs))
        if len(got) != len(call.outputs):
            raise AssertionError(f"{call.method}: {len(got)} outputs, eager had {len(call.outputs)}")
        for a, b in zip(got, call.outputs):
            if a.dtype != b.dtype or a.shape != b.shape:
                raise AssertionError(f"{call.method}: {a.dtype}{list(a.shape)} vs eager {b.dtype}{list(b.shape)}")
            if a.dtype.is_floating_point:
                worst = max(worst, float((a - b).abs().max()))
            elif not torch.equal(a, b):
                raise AssertionError(f"{call.method}: integer/bool output differs from eager")
    return worst


def check_weights_equal(a: dict[str, nn.Module], b: dict[str, nn.Module]) -> None:
    for name in a:
        sa, sb = a[name].state_dict(), b[name].state_dict()
        for key in sa:
            if not torch.equal(sa[key], sb[key]):
                raise AssertionError(f"fresh build differs in {name}.{key}: seeding is not deterministic")


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------


class _AllFallbacks(dict):
    def __contains__(self, key):  # CPU libtorch has every aoti_torch_cpu_* fallback
        return True


def make_standin_backend():
    """A backend named CudaBackend compiling for the CPU, with the real 1.5 G3 weight collector."""
    import contextlib

    import executorch.backends.cuda.cuda_backend as real
    from executorch.backends.aoti.aoti_backend import AotiBackend
    from executorch.backends.cuda.cuda_weight_collector import CudaWeightCollector
    from executorch.exir.backend.backend_details import BackendDetails

    real.CudaBackend.__name__ = "RealCudaBackend"  # keep the by-name backend lookup unambiguous

    def one(cls, program, specs, collector):
        with collector.capture(real._aoti_device_type_for_weight) as capture:
            result = AotiBackend.preprocess.__func__(cls, program, specs)
        collector.add_preprocess_result(result, capture.artifact, "cuda")  # "cuda": the real external tag
        return result

    def preprocess(cls, program, specs):
        collector = CudaWeightCollector()
        result = one(cls, program, specs, collector)
        collector.finish()
        return result

    def preprocess_multimethod(cls, edge_programs, compile_specs):
        collector = CudaWeightCollector()  # one (device, FQN) store for all methods, as the real one
        results = {m: [one(cls, p, s, collector) for p, s in zip(programs, compile_specs[m])]
                   for m, programs in edge_programs.items()}
        collector.finish()
        return results

    body = {
        "get_device_name": classmethod(lambda cls: "cpu"),
        "get_decomposition_table": classmethod(lambda cls: {}),
        "get_custom_passes": classmethod(lambda cls, specs: []),
        "save_data_externally": classmethod(lambda cls: True),
        "get_supported_fallback_kernels": classmethod(lambda cls: _AllFallbacks()),
        "get_extra_aoti_compile_context_manager": classmethod(lambda cls, specs=None: contextlib.nullcontext()),
        "get_aoti_compile_options": classmethod(lambda cls, specs: {
            "aot_inductor.link_libtorch": False,
            "aot_inductor.package": True,
            "aot_inductor.package_constants_in_so": False,
            "aot_inductor.package_constants_on_disk_format": "pickle_weights",
        }),
        "preprocess": classmethod(preprocess),
        "preprocess_multimethod": classmethod(preprocess_multimethod),
        "materialize_weights_blob": classmethod(real.CudaBackend.materialize_weights_blob.__func__),
    }
    return type("CudaBackend", (AotiBackend, BackendDetails), body)


def partitioners(methods, mode: str, standin_device: str | None):
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    if mode == "cuda":
        from executorch.backends.cuda.cuda_backend import CudaBackend
        from executorch.backends.cuda.cuda_partitioner import CudaPartitioner

        return {m: [CudaPartitioner([CudaBackend.generate_method_name_compile_spec(m)])] for m in methods}
    from executorch.backends.aoti.aoti_partitioner import AotiPartitioner

    out = {}
    for m in methods:
        specs = [CompileSpec("method_name", m.encode())]
        if standin_device:
            specs.append(CompileSpec("target_device", standin_device.encode()))
        out[m] = [AotiPartitioner("CudaBackend", specs)]
    return out


# --------------------------------------------------------------------------------------------
# Reading back what was written
# --------------------------------------------------------------------------------------------


def parse_fqn_manifest(data: bytes) -> dict[str, Any] | None:
    magic = b"ETCUDAFQN3"
    if not data.startswith(magic):
        return None
    at = len(magic)

    def string():
        nonlocal at
        (n,) = struct.unpack_from("<I", data, at)
        at += 4
        value = data[at:at + n].decode()
        at += n
        return value

    so_key = string()
    (count,) = struct.unpack_from("<I", data, at)
    at += 4
    entries = []
    for _ in range(count):
        fqn, key = string(), string()
        nbytes, dtype, device, offset, ndim = struct.unpack_from("<QiiqI", data, at)
        at += struct.calcsize("<QiiqI")
        sizes = list(struct.unpack_from(f"<{ndim}q", data, at))
        at += 8 * ndim
        strides = list(struct.unpack_from(f"<{ndim}q", data, at))
        at += 8 * ndim
        entries.append({"fqn": fqn, "storage_key": key, "nbytes": nbytes, "dtype": dtype, "device_type": device,
                        "offset": offset, "sizes": sizes, "strides": strides})
    return {"so_blob_key": so_key, "entries": entries}


def _value_desc(value) -> dict[str, Any]:
    v = value.val
    kind = type(v).__name__
    desc: dict[str, Any] = {"kind": kind}
    if kind == "Tensor":
        desc.update(scalar_type=int(v.scalar_type), sizes=list(v.sizes), dynamism=int(v.shape_dynamism),
                    const=v.data_buffer_idx != 0)
        info = v.extra_tensor_info
        if info is not None:
            desc.update(device=int(info.device_type), fqn=info.fully_qualified_name, location=int(info.location))
    elif kind in ("Int", "Bool", "Double", "String"):
        desc["value"] = next(iter(vars(v).values()))
    return desc


def delegate_output_counts(manager, method: str) -> list[int]:
    """How many outputs each delegate call of a method has, in graph (= emission) order."""
    from executorch.exir.delegate import executorch_call_delegate

    try:
        graph = manager.exported_program(method).graph_module.graph
    except KeyError:  # a constant method has no program
        return []
    counts = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is executorch_call_delegate:
            val = node.meta.get("val")
            counts.append(len(val) if isinstance(val, (tuple, list)) else 1)
    return counts


def wiring_flags(delegate_inputs: list[list[str]], method_outputs: list[str]) -> dict[str, Any]:
    """For a method with one delegate: does the delegate take/return tensors in another order than the method?"""
    if len(delegate_inputs) != 1:
        return {}
    position = lambda w: int(w.rsplit("_", 1)[1])  # noqa: E731
    d_in = [w for w in delegate_inputs[0] if w.startswith("method_input_")]
    d_out = [w for w in method_outputs if w.startswith("delegate0_output_")]
    first_seen = list(dict.fromkeys(d_out))  # distinct delegate outputs in the order the method returns them
    return {
        "delegate_input_order_differs": d_in != sorted(d_in, key=position),
        "delegate_output_order_differs": first_seen != sorted(first_seen, key=position),
        "repeated_outputs": len(set(method_outputs)) != len(method_outputs),
        "outputs_from_method_inputs": [k for k, w in enumerate(method_outputs) if w.startswith("method_input_")],
    }


def plan_wiring(program, method: str, counts: list[int]) -> dict[str, Any]:
    """The plan's instructions, and how delegate inputs/outputs map to the method's inputs/outputs.

    program: an executorch schema Program (manager.executorch_program, or deserialize_pte_binary(...).program);
    counts: the output count of each delegate call (delegate_output_counts)."""
    plan = next(p for p in program.execution_plan if p.name == method)
    ops = [f"{o.name}.{o.overload}" if o.overload else o.name for o in plan.operators]
    instructions, delegates = [], []
    origin: dict[int, tuple] = {v: ("method_input", i) for i, v in enumerate(plan.inputs)}
    d_index = 0
    for chain in plan.chains:
        for ins in chain.instructions:
            a = ins.instr_args
            kind = type(a).__name__
            if kind == "KernelCall":
                op = ops[a.op_index]
                instructions.append({"kind": "kernel", "op": op, "args": list(a.args)})
                if "_h2d_copy" in op or "_d2h_copy" in op:
                    origin[a.args[-1]] = ("copy_of", a.args[0])
            elif kind == "DelegateCall":
                n_out = counts[d_index] if d_index < len(counts) else 1
                args = list(a.args)
                ins_v, outs_v = args[:-n_out], args[-n_out:]
                delegates.append({"delegate": plan.delegates[a.delegate_index].id, "inputs": ins_v, "outputs": outs_v})
                instructions.append({"kind": "delegate", "id": plan.delegates[a.delegate_index].id, "args": args,
                                     "n_outputs": n_out})
                for k, v in enumerate(outs_v):
                    origin[v] = ("delegate_output", len(delegates) - 1, k)
                d_index += 1
            else:
                instructions.append({"kind": kind, **{k: (list(v) if isinstance(v, list) else v)
                                                      for k, v in vars(a).items()}})

    def where(v):
        for _ in range(16):  # follow h2d/d2h copies back to their source
            if origin.get(v, ("",))[0] != "copy_of":
                break
            v = origin[v][1]
        o = origin.get(v)
        if o is None:
            return "other"
        return f"method_input_{o[1]}" if o[0] == "method_input" else f"delegate{o[1]}_output_{o[2]}"

    delegate_inputs = [[where(v) for v in d["inputs"]] for d in delegates]
    method_outputs = [where(v) for v in plan.outputs]
    return {
        "plan_inputs": list(plan.inputs), "plan_outputs": list(plan.outputs),
        "input_values": [_value_desc(plan.values[v]) for v in plan.inputs],
        "output_values": [_value_desc(plan.values[v]) for v in plan.outputs],
        "instructions": instructions, "delegates": delegates,
        "delegate_inputs_are": delegate_inputs, "method_outputs_are": method_outputs,
        **wiring_flags(delegate_inputs, method_outputs),
    }


def read_back(manager, folder: str) -> dict[str, Any]:
    info: dict[str, Any] = {}
    program = manager.executorch_program
    manifests = {}
    for plan in program.execution_plan:
        if plan.delegates:
            per = []
            for d in plan.delegates:
                ref = d.processed
                data = bytes(program.backend_delegate_data[ref.index].data) if int(ref.location) == 0 else b""
                parsed = parse_fqn_manifest(data)
                per.append(parsed if parsed is not None else {"raw_keys": data.decode("utf-8", "replace").splitlines()[:4]})
            manifests[plan.name] = per
    info["delegate_payloads"] = manifests
    ptd = os.path.join(folder, PTD_NAME)
    if not os.path.exists(ptd):
        ptds = [f for f in os.listdir(folder) if f.endswith(".ptd")]
        ptd = os.path.join(folder, ptds[0]) if ptds else ""
    if ptd:
        try:
            from executorch.exir._serialize._cord import Cord
            from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

            with open(ptd, "rb") as f:
                payload = FlatTensorSerializer().deserialize(Cord(f.read()))
            named = getattr(payload, "named_data", None) or getattr(payload, "key_to_data", {})
            info["ptd_keys"] = sorted(named.keys())
        except Exception as error:  # reading back is a bonus
            info["ptd_keys_error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return info


# --------------------------------------------------------------------------------------------
# One program
# --------------------------------------------------------------------------------------------


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:500]


def save_io(folder: str, calls: list[Call]) -> None:
    arrays = {}
    for call in calls:
        for key, t in zip(call.input_keys + call.output_keys, call.inputs + call.outputs):
            arrays[key] = t.detach().cpu().numpy()
    np.savez(os.path.join(folder, "io.npz"), **arrays)


def record_calls(entry: dict[str, Any], folder: str, calls: list[Call]) -> None:
    save_io(folder, calls)
    entry["calls"] = [{"method": c.method, "inputs": c.input_keys, "outputs": c.output_keys,
                       "input_info": [tensor_info(t) for t in c.inputs],
                       "output_info": [tensor_info(t) for t in c.outputs], **({"note": c.note} if c.note else {})}
                      for c in calls]


def run_program(spec: Spec, args) -> dict[str, Any]:
    folder = os.path.join(args.out_dir, f"{spec.name}-{args.et_version_tag}" if args.et_version_tag else spec.name)
    os.makedirs(folder, exist_ok=True)
    entry: dict[str, Any] = {"name": spec.name, "folder": os.path.basename(folder), "what": spec.what,
                             "mode": args.mode, "status": "failed", "attempts": {}}
    if spec.constant_methods:
        entry["constant_methods"] = spec.constant_methods
    if spec.expect:
        entry["expect"] = spec.expect
    started = time.time()
    try:
        reference_modules = spec.build()
        check_weights_equal(reference_modules, spec.build())  # the exported build will hold the same weights
        calls = spec.reference(reference_modules)  # runs (and mutates) this fresh eager build only
        record_calls(entry, folder, calls)
    except Exception as error:
        entry["error"] = first_line(error)
        traceback.print_exc()
        return finish(entry, folder, started)

    for variant in spec.variants[min(args.start_variant, len(spec.variants) - 1):]:
        try:
            if variant.setup is not None:  # the references come from eager modules changed the same way
                calls = spec.reference(build_for(spec, variant))
                record_calls(entry, folder, calls)
            programs = export_methods(spec, variant)
            entry["methods"] = {name: method_summary(ep, spec.examples[name], variant.dynamic_shapes.get(name))
                                for name, ep in programs.items()}
            entry["eager_vs_exported_max_abs"] = replay(programs, calls)
            if args.mode == "dry-run":
                entry["attempts"][variant.label] = "torch.export ok"
                entry["variant"], entry["status"] = variant.label, "ok"
                break
            from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

            t0 = time.time()
            edge = to_edge_transform_and_lower(
                programs if len(programs) > 1 or "forward" not in programs else programs["forward"],
                partitioner=partitioners(list(programs), args.mode, args.standin_device),
                constant_methods=spec.constant_methods,
                compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
            )
            manager = edge.to_executorch()
            for stale in os.listdir(folder):
                if stale.endswith((".pte", ".ptd")):
                    os.remove(os.path.join(folder, stale))
            with open(os.path.join(folder, "model.pte"), "wb") as handle:
                manager.write_to_file(handle)
            manager.write_tensor_data_to_file(folder)
            entry["lower_seconds"] = round(time.time() - t0, 1)
            entry["attempts"][variant.label] = "ok"
            entry["variant"] = variant.label
            entry["wiring"] = {}
            for plan in manager.executorch_program.execution_plan:
                try:
                    entry["wiring"][plan.name] = plan_wiring(manager.executorch_program, plan.name,
                                                             delegate_output_counts(manager, plan.name))
                except Exception as error:
                    entry["wiring"][plan.name] = {"error": first_line(error)}
            entry.update(read_back(manager, folder))
            entry["status"] = "ok"
            break
        except Exception as error:
            entry["attempts"][variant.label] = f"failed: {first_line(error)}"
            entry["error"] = first_line(error)
            traceback.print_exc()
    if entry["status"] == "ok":
        entry.pop("error", None)
    return finish(entry, folder, started)


def finish(entry: dict[str, Any], folder: str, started: float) -> dict[str, Any]:
    entry["seconds"] = round(time.time() - started, 1)
    entry["files"] = {f: os.path.getsize(os.path.join(folder, f)) for f in sorted(os.listdir(folder))
                      if f != "entry.json"}
    with open(os.path.join(folder, "entry.json"), "w") as handle:
        json.dump(entry, handle, indent=1, default=str)
    return entry


def summary_line(entry: dict[str, Any]) -> str:
    size = sum(v for k, v in entry.get("files", {}).items() if k.endswith((".pte", ".ptd")))
    bits = [f"{entry['name']:<18}", f"{entry['status']:<6}", f"{entry.get('seconds', 0):>6.1f}s"]
    if entry["status"] == "ok":
        bits.append(f"variant={entry.get('variant')!r}")
        if "eager_vs_exported_max_abs" in entry:
            bits.append(f"exported-vs-eager={entry['eager_vs_exported_max_abs']:.2g}")
        if size:
            bits.append(f"pte+ptd={size / 1e6:.2f}MB")
        for method, w in (entry.get("wiring") or {}).items():
            flags = [k for k in ("delegate_input_order_differs", "delegate_output_order_differs", "repeated_outputs")
                     if w.get(k)]
            if w.get("outputs_from_method_inputs"):
                flags.append(f"outputs_from_inputs={w['outputs_from_method_inputs']}")
            if flags:
                bits.append(f"{method}:{','.join(flags)}")
    else:
        bits.append(entry.get("error", ""))
    return " ".join(bits)


def environment(args) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "mode": args.mode,
                            "et_version_tag": args.et_version_tag}
    try:
        from importlib.metadata import version

        info["executorch"] = version("executorch")
    except Exception:
        info["executorch"] = None
    if torch.cuda.is_available():
        info["cuda"] = torch.version.cuda
        info["gpu"] = torch.cuda.get_device_name()
        info["compute_capability"] = "{}.{}".format(*torch.cuda.get_device_capability())
    if args.mode == "cpu-standin":
        info["standin_device_spec"] = args.standin_device
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="et_zoo")
    parser.add_argument("--et-version-tag", default="et151", help="suffix of each folder name ('' for none)")
    parser.add_argument("--only", default="", help="comma-separated program names (or their letters: a,c,h)")
    parser.add_argument("--jobs", type=int, default=1, help="export this many programs at once, each in its own process")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="torch.export and eager checks only, no lowering")
    mode.add_argument("--cpu-standin", action="store_true", help="lower with a CPU-compiling backend named CudaBackend")
    parser.add_argument("--standin-device", default="cuda:0",
                        help="target_device spec the stand-in partitioner adds, as CudaPartitioner does ('' for none)")
    parser.add_argument("--start-variant", type=int, default=0,
                        help="skip each program's first N export variants (to test a fallback)")
    parser.add_argument("--list", action="store_true", help="print the programs and exit")
    parser.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.mode = "dry-run" if args.dry_run else "cpu-standin" if args.cpu_standin else "cuda"
    args.standin_device = args.standin_device or None

    specs = all_specs()
    if args.list:
        for s in specs:
            print(f"{s.name:<18} {s.what}")
        return 0
    if args.only:
        wanted = {w.strip() for w in args.only.split(",") if w.strip()}
        specs = [s for s in specs if s.name in wanted or s.name.split("_")[0] in wanted]
        if not specs:
            print(f"no program matches --only {args.only}", file=sys.stderr)
            return 2
    if args.mode == "cuda" and (not torch.cuda.is_available() or torch.version.cuda is None):
        print("the CUDA export needs a CUDA build of PyTorch and a visible GPU (use --dry-run or --cpu-standin here)",
              file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    if args.mode == "cpu-standin":
        global _STANDIN  # keep it alive: the backend is found through BackendDetails.__subclasses__() (weak refs)
        _STANDIN = make_standin_backend()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 8)))

    entries = []
    if args.jobs > 1 and len(specs) > 1 and not args._child:
        from concurrent.futures import ThreadPoolExecutor

        def child(spec: Spec) -> dict[str, Any]:
            command = [sys.executable, os.path.abspath(__file__), "--_child", "--only", spec.name,
                       "--out-dir", args.out_dir, "--et-version-tag", args.et_version_tag,
                       "--standin-device", args.standin_device or "", "--start-variant", str(args.start_variant)]
            command += ["--dry-run"] if args.mode == "dry-run" else ["--cpu-standin"] if args.mode == "cpu-standin" else []
            folder = os.path.join(args.out_dir, f"{spec.name}-{args.et_version_tag}" if args.et_version_tag else spec.name)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "export.log"), "w") as log:
                rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
            try:
                with open(os.path.join(folder, "entry.json")) as handle:
                    return json.load(handle)
            except Exception:
                return {"name": spec.name, "status": "failed", "error": f"child exited {rc}, no entry.json (see export.log)"}

        with ThreadPoolExecutor(args.jobs) as pool:
            for entry in pool.map(child, specs):
                entries.append(entry)
                print(summary_line(entry), flush=True)
    else:
        for spec in specs:
            entry = run_program(spec, args)
            entries.append(entry)
            print(summary_line(entry), flush=True)
    if args._child:
        return 0 if all(e["status"] == "ok" for e in entries) else 1

    index_path = os.path.join(args.out_dir, "zoo.json")
    index: dict[str, Any] = {"programs": {}}
    if os.path.exists(index_path):  # keep programs exported by earlier --only runs
        try:
            with open(index_path) as handle:
                index = json.load(handle)
        except Exception:
            pass
    index["environment"] = environment(args)
    index["io_npz"] = ("each program's io.npz holds every reference call's inputs and eager outputs under the keys its "
                       "'calls' list names; for a single-method program the first call's keys are input_<i>/output_<i>")
    for entry in entries:
        index.setdefault("programs", {})[entry["name"]] = entry
    with open(index_path, "w") as handle:
        json.dump(index, handle, indent=1, default=str)
    ok = sum(e["status"] == "ok" for e in entries)
    print(f"{ok}/{len(entries)} programs ok ({args.mode}); index: {index_path}", flush=True)
    return 0 if ok == len(entries) else 1


if __name__ == "__main__":
    sys.exit(main())
