"""One-dimensional convolutions in standalone CUDA builds, computed as 2-D ones.

A standalone build takes its convolutions from Inductor's Triton templates
(no cuDNN extern kernel: the library must not need libtorch), and Inductor
has Triton templates for 2-D and 3-D convolutions and for depthwise 1-D ones
only. A plain Conv1d, as in Whisper's encoder, had no choice at all, and the
whole method fell back to libtorch. A 1-D convolution over [N, C, L] is the
2-D one over [N, C, 1, L] with a kernel one row high, so each is rewritten
as that, between an unsqueeze and a squeeze: the same arithmetic, now on a
template.
"""

from __future__ import annotations

from typing import Any

from .graph_values import static_shape

_CONV1D = frozenset({"aten.conv1d.default", "aten.conv1d.padding"})
_CONV1D_PARAMETERS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
# aten.convolution, as a decomposed program has it: a 1-D one where its weight is 3-D.
_CONVOLUTION_PARAMETERS = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")


def as_two_dimensional(graph_module: Any) -> int:
    """Rewrite the 1-D convolutions of `graph_module` (a copy the caller owns)
    that Inductor has no Triton template for as 2-D ones; the number rewritten."""
    import torch

    aten = torch.ops.aten
    graph = graph_module.graph
    rewritten = 0
    for node in list(graph.nodes):
        arguments = _conv1d_arguments(node)
        if arguments is None or not _plain_one_dimensional(arguments):
            continue
        padding = arguments["padding"]
        padding = padding if isinstance(padding, str) else [0, _single(padding, 0)]
        target = aten.conv2d.padding if isinstance(padding, str) else aten.conv2d.default
        with graph.inserting_before(node):
            # ATen's 1-D convolution makes its input contiguous first, so its output is
            # contiguous too, and code after it may view it so. A transposed [N, L, C]
            # input unsqueezed as it is would look channels-last to the 2-D convolution,
            # whose output then could not be viewed.
            dense = graph.call_function(aten.contiguous.default, (arguments["input"],))
            rows = graph.call_function(aten.unsqueeze.default, (dense, -2))
            kernel = graph.call_function(aten.unsqueeze.default, (arguments["weight"], 2))
            planar = graph.call_function(target, (
                rows, kernel, arguments["bias"], [1, _single(arguments["stride"], 1)], padding, [1, 1], arguments["groups"],
            ))
            flat = graph.call_function(aten.squeeze.dim, (planar, -2))
        flat.meta.update(node.meta)
        node.replace_all_uses_with(flat)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        graph.lint()
        graph_module.recompile()
    return rewritten


def _conv1d_arguments(node: Any) -> dict[str, Any] | None:
    if node.op != "call_function":
        return None
    if str(node.target) == "aten.convolution.default" and len(node.args) == len(_CONVOLUTION_PARAMETERS):
        arguments = dict(zip(_CONVOLUTION_PARAMETERS, node.args, strict=True))
        if arguments.pop("transposed") is not False or any(arguments.pop("output_padding")):
            return None  # Inductor has no template for a transposed convolution either way
        return arguments if isinstance(arguments["groups"], int) and isinstance(arguments["padding"], (list, tuple)) else None
    if str(node.target) not in _CONV1D or len(node.args) > len(_CONV1D_PARAMETERS):
        return None
    defaults: dict[str, Any] = {"bias": None, "stride": [1], "padding": "valid" if str(node.target).endswith("padding") else [0],
                                "dilation": [1], "groups": 1}
    arguments = {**defaults, **dict(zip(_CONV1D_PARAMETERS, node.args, strict=False)), **node.kwargs}
    if set(arguments) != set(_CONV1D_PARAMETERS) or not isinstance(arguments["groups"], int):
        return None
    return arguments


def _plain_one_dimensional(arguments: dict[str, Any]) -> bool:
    """Whether the weight is known to be a 1-D kernel's, and a 2-D template can take
    the convolution: not dilated (the templates cannot), and not depthwise (one
    input channel a group: Inductor has a 1-D template for those)."""
    shape = static_shape(arguments["weight"]) or ()
    if len(shape) != 3 or _single(arguments["dilation"], 1) != 1:
        return False
    return not (arguments["groups"] > 1 and shape[1] == 1 and shape[0] == arguments["groups"])


def _single(value: Any, default: int) -> Any:
    """The one size of a 1-D convolution's stride, padding or dilation ([s], (s,) or s)."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else default
    return value
