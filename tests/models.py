"""Small example models: the demo compiles one, and the tests compile several.

Each builder returns (module, example args, dynamic_shapes)."""

from __future__ import annotations

import torch
from torch.export import Dim


class DictMLP(torch.nn.Module):
    """float32, dynamic batch, nested dict outputs (named 'logits', 'aux.loss', 'aux.hidden')."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.encoder = torch.nn.Linear(16, width)
        self.head = torch.nn.Linear(width, 8)

    def forward(self, x: torch.Tensor, bias: torch.Tensor):
        hidden = torch.relu(self.encoder(x))
        return {"logits": self.head(hidden) + bias, "aux": {"loss": hidden.mean(), "hidden": hidden}}


class Embedder(torch.nn.Module):
    """int64 indices in, several outputs out: a bfloat16 tensor, a transposed
    (non-contiguous) view, and an int64 passthrough count."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(50, 8)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor):
        vectors = self.table(ids) * scale
        pooled = vectors.sum(dim=1)
        return pooled.to(torch.bfloat16), pooled.t(), (ids > 10).sum(dim=1)


class Bf16MLP(torch.nn.Module):
    """bfloat16 weights, input and output."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))

    def forward(self, x: torch.Tensor):
        return self.layers(x)


def dict_mlp():
    torch.manual_seed(0)
    batch = Dim("batch", min=1, max=64)
    return DictMLP().eval(), (torch.randn(4, 16), torch.randn(8)), {"x": {0: batch}, "bias": None}


def embedder():
    torch.manual_seed(1)
    return Embedder().eval(), (torch.randint(0, 50, (3, 6)), torch.tensor(0.5)), None


def bf16_mlp():
    torch.manual_seed(2)
    return Bf16MLP().to(torch.bfloat16).eval(), (torch.randn(2, 32).to(torch.bfloat16),), None


BUILDERS = {"dict_mlp": dict_mlp, "embedder": embedder, "bf16_mlp": bf16_mlp}


def linear():
    """One layer with a bounded dynamic batch: what a Ray batch is split against."""
    torch.manual_seed(3)
    return torch.nn.Linear(16, 4).eval(), (torch.randn(2, 16),), {"input": {0: Dim("batch", max=64)}}


BUILDERS["linear"] = linear


class Writer(torch.nn.Module):
    """Writes what a run changes: its buffer adds up every x it is given (a KV
    cache in miniature), a step counter counts the runs (a new value from
    buffers alone, which Inductor's constant folding once froze), and it
    doubles its input y in place. `offset` is a buffer no run writes."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.full((4,), 0.5))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("offset", torch.tensor([0.25, -0.5, 0.75, -1.0]))
        self.scale = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.total.add_(x)
        self.steps.add_(1)
        y.mul_(2.0)
        return self.total * self.scale + y + self.offset * x + self.steps


def writer():
    return Writer(), (torch.ones(4), torch.ones(4)), None


BUILDERS["writer"] = writer


class PromptCache(torch.nn.Module):
    """A prefill that writes a cache of 16 positions the way Hugging Face's static cache does: the
    prompt's first position copied into a counter, the cache written at arange(n) + the counter (so
    the prompt is bounded as a span: no element of the index is one of its own), the counter advanced."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 16, 4))
        self.register_buffer("counter", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        self.counter.copy_(cache_position[0])
        self.cache.index_copy_(1, torch.arange(cache_position.shape[0]) + self.counter, x)
        self.counter.add_(cache_position.shape[0])
        return self.cache.sum(dim=1)


def prompt_cache():
    count = Dim("count", min=1, max=16)
    return PromptCache().eval(), (torch.ones(1, 4, 4), torch.arange(4)), {"x": {1: count}, "cache_position": {0: count}}


BUILDERS["prompt_cache"] = prompt_cache


def hugging_face_static_llama(device: str = "cpu", dtype: torch.dtype | None = None) -> torch.nn.Module:
    """transformers' own tiny Llama wrapped for export with its static cache of 32 positions
    (TorchExportableModuleWithStaticCache), made on `device` (the cache is made where the model is).
    Callers skip where transformers, or this module of it, is not installed."""
    import transformers
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    model = (model.to(dtype) if dtype is not None else model).to(device).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": 32}
    return TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=32)


class Views(torch.nn.Module):
    """Outputs that share memory: one tensor twice, and a view of an input."""

    def forward(self, x: torch.Tensor):
        doubled = x * 2
        return doubled, doubled, x[1:]


def views():
    return Views().eval(), (torch.arange(12.0).reshape(4, 3),), None


BUILDERS["views"] = views


class PrefillDecode(torch.nn.Module):
    """`forward` and `decode` read one Linear (`shared`); only `forward` has a head:
    what a bundle with shared weights is compiled from."""

    def __init__(self, width: int = 16, hidden: int = 8, outputs: int = 4, seed: int = 11) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.shared = torch.nn.Linear(width, hidden)
        self.head = torch.nn.Linear(hidden, outputs)

    def forward(self, x):
        return self.head(torch.relu(self.shared(x)))

    def decode(self, x):
        return torch.tanh(self.shared(x))


class MethodOf(torch.nn.Module):
    """One method of a decoder with several (prefill, decode: tokens and their positions) as a
    module's forward, for torch.export (named arguments, as the dynamic shapes name them)."""

    def __init__(self, model: torch.nn.Module, method: str) -> None:
        super().__init__()
        self.model, self.method = model, method

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return getattr(self.model, self.method)(tokens, input_pos)


def compile_tiny_llama(path, options: dict, seed: int = 0) -> torch.nn.Module:
    """The scale models' tiny decoder (bfloat16, prefill and decode) compiled for CUDA into `path` with
    `options`; the eager module, on the CPU."""
    import copy

    import cuda_runner

    config = scale_models.LLAMA_TINY
    torch.manual_seed(seed)
    module = scale_models.LlamaDecoder(config).eval()
    cuda_runner.compile_methods(copy.deepcopy(module), scale_models.llama_examples(config, 6), path, device="cuda",
                                dynamic_shapes=scale_models.llama_dynamic_shapes(config), options=options)
    return module


def _scale_models():
    """scripts/scale_models.py: the models bench_scale.py measures at their real sizes, here at tiny ones."""
    import importlib.util
    import sys
    from pathlib import Path

    if "scale_models" in sys.modules:
        return sys.modules["scale_models"]
    path = Path(__file__).resolve().parent.parent / "scripts" / "scale_models.py"
    spec = importlib.util.spec_from_file_location("scale_models", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["scale_models"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


scale_models = _scale_models()


def tiny_vit():
    """ViT-B/16's code at a tiny size: patch convolution, pre-norm encoder (attention, LayerNorm, GELU), head."""
    torch.manual_seed(12)
    return scale_models.VisionTransformer(scale_models.VIT_TINY).eval(), (torch.randn(2, 3, 32, 32),), None


def tiny_resnet():
    """ResNet-50's code at a tiny size: 7x7 strided stem, max pool, bottlenecks with 1x1 and 3x3 convolutions and batch norm."""
    torch.manual_seed(13)
    return scale_models.randomize_batch_norms(scale_models.resnet_tiny()).eval(), (torch.randn(1, 3, 32, 32),), None


BUILDERS["tiny_vit"] = tiny_vit
BUILDERS["tiny_resnet"] = tiny_resnet
